"""An ordinary Accelerate training script that trains with blockshard under `accelerate launch`.

    accelerate launch --config_file examples/accelerate/ragged.yaml examples/accelerate/train.py
    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate/train.py
    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate/deepspeed.yaml examples/accelerate/train.py

Run without a launcher (`python examples/accelerate/train.py`) it trains on one process: the reference.
`--accumulate N` splits each batch into N micro-batches (`accelerator.accumulate`); `--optimizer bnb8bit`
trains with bitsandbytes' AdamW8bit instead of torch's AdamW.
Every rank trains on the whole batch (the data is not split), so W processes compute exactly what one
process computes (docs/design.md). `--out FILE` writes what the tests check (JSON + a .pt file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
from accelerate import Accelerator
from torch import nn

from blockshard.integrations.accelerate import Accelerator  # noqa: F811  the one added line


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 37, hidden: int = 75, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(13, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)) for _ in range(steps)]


def optimizer_chain(optimizer) -> list:
    """The optimizer and what it wraps (accelerate's, DeepSpeed's wrappers), outermost first."""
    chain = [optimizer]
    while hasattr(chain[-1], "optimizer"):
        chain.append(chain[-1].optimizer)
    return chain


def state_numel(optimizer) -> int:
    """Elements of optimizer state this rank holds (AdamW's exp_avg, bitsandbytes' state1)."""
    inner = optimizer_chain(optimizer)[-1]
    return sum(s[k].numel() for s in inner.state.values() for k in ("exp_avg", "state1") if k in s)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (accelerator.accumulate)")
    p.add_argument("--optimizer", choices=("adamw", "bnb8bit"), default="adamw")
    p.add_argument("--save-at", type=int, help="accelerator.save_state(--ckpt) after this step")
    p.add_argument("--resume-at", type=int, help="accelerator.load_state(--ckpt), then train from this step on")
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--out", help="write the results here (FILE.json, FILE.pt)")
    p.add_argument(
        "--seed-per-rank",
        action="store_true",
        help="seed each rank's model with its rank (fsdp_sync_module_states makes them all rank 0's)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(int(os.environ.get("RANK", "0")) if args.seed_per_rank else 0)
    model = Net()
    if args.optimizer == "bnb8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    local_numel = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    first = 0
    if args.resume_at is not None:
        accelerator.load_state(args.ckpt)
        first = args.resume_at
    norms = []
    for step, (x, y) in enumerate(batches(args.steps)):
        if step < first:
            continue
        for xm, ym in zip(x.chunk(args.accumulate), y.chunk(args.accumulate), strict=True):
            with accelerator.accumulate(model):  # steps (and clips) on the last micro-batch only
                loss = torch.nn.functional.mse_loss(model(xm), ym)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
                optimizer.step()
                optimizer.zero_grad()
        accelerator.print(f"step {step}: loss {loss.item():.6f}")
        if args.save_at is not None and step + 1 == args.save_at:
            accelerator.save_state(args.ckpt)
    state = accelerator.get_state_dict(model)  # DeepSpeed ZeRO-3: gathered to the main process only (None elsewhere)
    total = sum(getattr(p, "ds_numel", 0) for p in model.parameters()) if state is None else None
    if args.out:
        info = dict(
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            distributed_type=str(accelerator.distributed_type),
            local_numel=local_numel,
            total_numel=total if state is None else sum(t.numel() for t in state.values()),
            state_numel=state_numel(optimizer),
            optimizers=[type(o).__module__ + "." + type(o).__name__ for o in optimizer_chain(optimizer)],
            norms=norms,
        )
        with open(f"{args.out}.rank{os.environ.get('RANK', '0')}.json", "w") as f:  # RANK: stock runs say 0 on all
            json.dump(info, f)
        if accelerator.is_main_process:
            torch.save({k: v.detach().cpu() for k, v in state.items()}, f"{args.out}.pt")
    accelerator.wait_for_everyone()  # every rank is done before any tears the group down
    accelerator.end_training()  # destroys the process group before exit


if __name__ == "__main__":
    main()
    gc.collect()  # free what still holds the gloo groups now, not during interpreter shutdown (a gloo abort)
