"""DeepSpeed ZeRO-2 + bitsandbytes AdamW8bit with blockshard's hook, through ``install()``.

Launch (CPU, gloo; ``--reference`` is one process without DeepSpeed)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed_bnb.py --out ds.json
    python examples/deepspeed_bnb.py --reference --out single.json

``bs_deepspeed.install()`` patches ``deepspeed.initialize``: an engine whose config has a
``"blockshard"`` section gets ZeRO partitions cut only at bitsandbytes' 256-element block
boundaries, and the optimizer sees each parameter's piece with its shape, so AdamW8bit quantizes
exactly the blocks it quantizes on one process. Every rank trains on the whole batch, so the final
parameters equal the reference's bitwise (stock ZeRO-2 differs: tests/integrations/test_deepspeed.py).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import bitsandbytes as bnb
import torch
from _common import write_result  # examples/_common.py: the --out files the tests compare

from blockshard._tiny import text_batches, tiny_llama

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 0,  # DeepSpeed clips at 1.0 by default; the reference does not clip
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,  # bitsandbytes is not one of DeepSpeed's own optimizers
    "blockshard": {"semantics": {"*weight": "bnb8bit"}},  # 256-element blocks, whole below 4096
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reference", action="store_true", help="one process, no DeepSpeed")
    parser.add_argument("--out", help="write losses and parameters (rank 0) for a comparison")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = tiny_llama()
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    if args.reference:
        engine, rank, world_size = model, 0, 1
    else:
        import deepspeed

        from blockshard.integrations import deepspeed as bs_deepspeed

        bs_deepspeed.install()
        deepspeed.init_distributed(dist_backend="gloo")
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
        if not bs_deepspeed.is_hooked(engine):
            raise SystemExit("blockshard's hook is not active: is the 'blockshard' section in the config?")
        rank, world_size = engine.global_rank, engine.world_size

    losses = []
    for input_ids, labels in text_batches(args.steps, batch_size=4, seq_len=32):
        loss = engine(input_ids=input_ids, labels=labels).loss
        if args.reference:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.backward(loss)
            engine.step()  # reduce-scatter, AdamW8bit on this rank's pieces, all-gather
        losses.append(loss.item())
    if rank == 0:  # ZeRO-1/2 keep whole parameters on every rank
        print(f"world_size={world_size} losses={losses}")
        write_result(args.out, world_size=world_size, losses=losses, params=dict(model.named_parameters()))


if __name__ == "__main__":
    main()
