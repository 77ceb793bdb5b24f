"""Train with a block semantics that a separately installed package registers (``tile96``).

Launch (CPU, gloo; ``--nproc_per_node 1`` is the one-process reference)::

    pip install --no-deps --no-build-isolation examples/custom_block_type
    torchrun --nproc_per_node 2 examples/custom_block_type/train.py --out tile96.json

The script names the semantics only by its string, ``"tile96"``: blockshard loads it from the
``blockshard.block_semantics`` entry point of the ``blockshard-tile96`` package. Every rank's piece
of every tensor starts on a 96-element tile (checked below), and since every rank trains on the
whole batch the final parameters equal one process's bitwise.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist

import blockshard
from blockshard._tiny import text_batches, tiny_llama

TILE_NUMEL = 96


def pieces_start_on_tiles(model: torch.nn.Module, rank: int) -> bool:
    """Whether every piece this rank holds starts at a multiple of 96 elements of its tensor."""
    layouts = blockshard.group_layouts(model).values()
    return all(piece.start % TILE_NUMEL == 0 for layout in layouts for piece in layout.pieces(rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="write losses and parameters (rank 0) for a comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}: tile96 is {blockshard.get_semantics('tile96')!r}")  # loaded from the entry point

    model = tiny_llama()
    for layer in model.model.layers:
        blockshard.fully_shard(layer, semantics="tile96")
    blockshard.fully_shard(model, semantics="tile96")
    on_tiles = pieces_start_on_tiles(model, rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for input_ids, labels in text_batches(args.steps, batch_size=4, seq_len=32):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    params = blockshard.full_state_dict(model)  # collective: every rank calls it
    flags = [None] * world_size
    dist.all_gather_object(flags, on_tiles)
    if rank == 0:
        print(f"world_size={world_size} pieces_start_on_tiles={all(flags)} losses={losses}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world_size": world_size, "pieces_start_on_tiles": all(flags), "losses": losses}, f)
            torch.save(params, args.out + ".pt")
    dist.barrier()  # every rank is done before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # free what still holds the gloo groups now, not during interpreter shutdown
