"""DeepSpeed ZeRO-1/2 + bitsandbytes AdamW8bit with blockshard's hook, through ``install()``.

Launch (CPU, gloo; ``--reference`` is one process without DeepSpeed)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed_bnb.py --out ds.json
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_bnb.py --stage 1 --compare
    python examples/deepspeed_bnb.py --reference --out single.json

``bs_deepspeed.install()`` patches ``deepspeed.initialize``: an engine whose config has a
``"blockshard"`` section gets ZeRO partitions cut only at bitsandbytes' 256-element block
boundaries, and the optimizer sees each parameter's piece with its shape, so AdamW8bit quantizes
exactly the blocks it quantizes on one process. Every rank trains on the whole batch, so the final
parameters equal the reference's bitwise. ``--stage`` picks ZeRO-1 or ZeRO-2 (any launcher that
sets RANK / WORLD_SIZE / MASTER_ADDR works: ``deepspeed``, ``torchrun``).

``--compare`` trains two more models on every rank after the hooked one -- stock ZeRO (the same
config without the ``"blockshard"`` section) and one process without DeepSpeed -- and rank 0 prints
``ranks_agree=True`` (every rank holds the same parameters), ``hooked_vs_single_max_abs_diff=0.0``
and a non-zero ``stock_vs_single_max_abs_diff``: stock partition boundaries cut bitsandbytes'
blocks, and its flat tensor per ``param_group`` quantizes small parameters one process keeps in fp32.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import bitsandbytes as bnb
import torch
from _common import write_result  # examples/_common.py: the --out files the tests compare

from blockshard._tiny import text_batches, tiny_llama

STEPS = 3


def config(stage: int, hooked: bool = True) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0,  # DeepSpeed clips at 1.0 by default; the reference does not clip
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # bitsandbytes is not one of DeepSpeed's own optimizers
        "steps_per_print": 10**9,
    }
    if hooked:
        cfg["blockshard"] = {"semantics": {"*weight": "bnb8bit"}}  # 256-element blocks, whole below 4096
    return cfg


def train(stage: int, hooked: bool = True) -> tuple[torch.nn.Module, list[float], int, int]:
    """Train on DeepSpeed (``stage`` 1 or 2) or, with ``stage=0``, in this process alone."""
    model = tiny_llama()
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    engine, rank, world_size = model, 0, 1
    if stage:
        import deepspeed

        from blockshard.integrations import deepspeed as bs_deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage, hooked))
        if hooked and not bs_deepspeed.is_hooked(engine):
            raise SystemExit("blockshard's hook is not active: is the 'blockshard' section in the config?")
        rank, world_size = engine.global_rank, engine.world_size
    losses = []
    for input_ids, labels in text_batches(STEPS, batch_size=4, seq_len=32):
        loss = engine(input_ids=input_ids, labels=labels).loss
        if stage:
            engine.backward(loss)
            engine.step()  # reduce-scatter, AdamW8bit on this rank's pieces, all-gather
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses, rank, world_size


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def compare(model: torch.nn.Module, stage: int) -> dict:
    """Stock ZeRO and one process on this rank, against the hooked ``model``; whether the ranks agree."""
    import torch.distributed as dist

    stock, single = train(stage, hooked=False)[0], train(0)[0]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)  # ZeRO-1/2 keep whole parameters on every rank
    return {
        "ranks_agree": all(torch.equal(g, flat) for g in gathered),
        "hooked_vs_single_max_abs_diff": max_diff(model, single),
        "stock_vs_single_max_abs_diff": max_diff(stock, single),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2, help="ZeRO stage")
    parser.add_argument("--reference", action="store_true", help="one process, no DeepSpeed")
    parser.add_argument("--compare", action="store_true", help="also train stock ZeRO and one process (see above)")
    parser.add_argument("--out", help="write losses and parameters (rank 0) for a comparison")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if not args.reference:
        import deepspeed

        from blockshard.integrations import deepspeed as bs_deepspeed

        bs_deepspeed.install()  # the one added line: engines whose config has a "blockshard" section get the hook
        deepspeed.init_distributed(dist_backend="gloo")
    model, losses, rank, world_size = train(0 if args.reference else args.stage)
    extra = compare(model, args.stage) if args.compare and not args.reference else {}
    if rank == 0:  # ZeRO-1/2 keep whole parameters on every rank
        print(f"world_size={world_size} losses={losses}")
        for key, value in extra.items():
            print(f"{key}={value!r}")
        write_result(args.out, world_size=world_size, losses=losses, params=dict(model.named_parameters()), **extra)
    if not args.reference:  # leave the process group before exit (gloo can abort at exit otherwise)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
