"""ZeRO-2 + bitsandbytes AdamW8bit with blockshard's DeepSpeed hook, on CPU (gloo).

Run with any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT::

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_zero2_bnb.py
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed_zero2_bnb.py   # DeepSpeed's launcher

Every rank trains the same small model on the whole batch three ways -- blockshard-hooked ZeRO-2,
stock ZeRO-2, and one process without DeepSpeed (the reference, computed locally) -- and rank 0
prints the largest parameter difference of each DeepSpeed run from the reference:
``hooked_vs_single_max_abs_diff=0.0`` (bitwise equal at W = 2 and 4) and a non-zero
``stock_vs_single_max_abs_diff`` (stock partition boundaries cut bitsandbytes' 256-element blocks and
its per-group flat tensor quantizes small parameters that one process keeps in fp32).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from torch import nn

STEPS, BATCH, LR = 4, 8, 1e-2
SEMANTICS = {"*weight": "bnb8bit", "*bias": "bnb8bit"}


def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # weights of 5696, 11570 and 13000 elements, small biases and head (fp32 state on one process)
        return nn.Sequential(
            nn.Linear(64, 89),
            nn.GELU(),
            nn.Linear(89, 130),
            nn.GELU(),
            nn.Linear(130, 100),
            nn.GELU(),
            nn.Linear(100, 7),
        )


def batches():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 64, generator=gen), torch.randn(BATCH, 7, generator=gen)) for _ in range(STEPS)]


def optimizer(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=LR)


def config(hooked: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if hooked:
        cfg["blockshard"] = {"semantics": SEMANTICS}
    return cfg


def train_deepspeed(hooked: bool) -> list[torch.Tensor]:
    import deepspeed

    from blockshard.integrations import deepspeed as bs_deepspeed

    model = make_model()
    init = bs_deepspeed.initialize if hooked else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=optimizer(model.parameters()), config=config(hooked))
    for x, y in batches():
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def train_single() -> list[torch.Tensor]:
    model = make_model()
    opt = optimizer(model.parameters())
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    parser.parse_args()
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hooked = train_deepspeed(True)
    stock = train_deepspeed(False)
    single = train_single()
    # all ranks must hold the same parameters after ZeRO's all-gather
    flat = torch.cat([p.reshape(-1) for p in hooked])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    agree = all(torch.equal(g, flat) for g in gathered)
    if rank == 0:
        print(f"world_size={world}")
        print(f"ranks_agree={agree}")
        print(f"hooked_vs_single_max_abs_diff={max_diff(hooked, single)!r}")
        print(f"stock_vs_single_max_abs_diff={max_diff(stock, single)!r}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
