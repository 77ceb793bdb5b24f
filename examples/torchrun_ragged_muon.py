"""torchrun + blockshard's ragged engine + Muon on whole matrices (policy "auto").

Launch (CPU, gloo; ``--nproc_per_node 1`` is the one-process reference)::

    torchrun --nproc_per_node 2 examples/torchrun_ragged_muon.py --out muon.json

A tiny Llama is sharded layer by layer with ``blockshard.fully_shard`` (Muon semantics: a hidden
matrix is one unit). ``blockshard.optim.Muon`` orthogonalizes each matrix at its owner with
torch's Muon update, momentum kept on the shards; AdamW steps the embedding, head and norms.
Every rank trains on the whole batch, so the final parameters equal one process's bitwise.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from _common import write_result  # examples/_common.py: the --out files the tests compare

import blockshard
from blockshard._tiny import text_batches, tiny_llama
from blockshard.optim import Muon, muon_param_groups, optimizer_semantics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="write losses and parameters (rank 0) for a comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model = tiny_llama()
    semantics = optimizer_semantics(muon_param_groups(model))  # Muon's matrices are whole units
    for layer in model.model.layers:  # bottom-up, as with FSDP2
        blockshard.fully_shard(layer, semantics=semantics)
    blockshard.fully_shard(model, semantics=semantics)

    muon_group, rest = muon_param_groups(model)  # after sharding: by name and global shape
    optimizers = [Muon([muon_group], lr=0.02), torch.optim.AdamW([rest], lr=1e-3)]
    losses = []
    for input_ids, labels in text_batches(args.steps, batch_size=4, seq_len=32):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())

    params = blockshard.full_state_dict(model)  # collective: every rank calls it
    if rank == 0:
        print(f"world_size={world_size} losses={losses}")
        write_result(args.out, world_size=world_size, losses=losses, params=params)
    dist.barrier()  # every rank is done before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # free what still holds the gloo groups now, not during interpreter shutdown
