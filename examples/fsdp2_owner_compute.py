"""Stock FSDP2 (``torch.distributed.fsdp.fully_shard``) + blockshard's placement and owner-compute.

Launch (CPU, gloo; ``--nproc_per_node 1`` is the one-process reference)::

    torchrun --nproc_per_node 2 examples/fsdp2_owner_compute.py --out fsdp2.json

``blockshard.integrations.fsdp2.fully_shard`` is torch's ``fully_shard`` with a block-aware
``shard_placement_fn``: it keeps units whole where FSDP2's row chunks allow and marks Muon's hidden
matrices for owner-compute. ``fsdp2.OwnerComputeOptimizer`` moves each matrix's gradient rows to
one owner (``all_to_all``), runs torch's unmodified Muon there on the whole matrix and sends the
new rows back; AdamW steps the rest. Every rank trains on the whole batch, so the final parameters
equal one process's bitwise.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from _common import write_result  # examples/_common.py: the --out files the tests compare
from torch.distributed.device_mesh import init_device_mesh

from blockshard._tiny import text_batches, tiny_llama
from blockshard.integrations import fsdp2
from blockshard.optim import muon_param_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="write losses and parameters (rank 0) for a comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    model = tiny_llama()
    for layer in model.model.layers:  # bottom-up, as with torch's fully_shard
        fsdp2.fully_shard(layer, semantics="muon", mesh=mesh, root=model)
    fsdp2.fully_shard(model, semantics="muon", mesh=mesh)

    muon_group, rest = muon_param_groups(model)  # by name and global shape, never by p.ndim
    muon = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [muon_group], semantics="matrix")
    adamw = fsdp2.OwnerComputeOptimizer(lambda g: torch.optim.AdamW(g, lr=1e-3), [rest])
    losses = []
    for input_ids, labels in text_batches(args.steps, batch_size=4, seq_len=32):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())

    params = {n: p.full_tensor() for n, p in model.named_parameters()}  # DTensors: collective
    if dist.get_rank() == 0:
        print(f"world_size={dist.get_world_size()} losses={losses}")
        write_result(args.out, world_size=dist.get_world_size(), losses=losses, params=params)
    dist.barrier()  # every rank is done before any tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # free what still holds the gloo groups now, not during interpreter shutdown
