"""Muon through Accelerate, in Accelerate's order: build the optimizers, then ``prepare`` them with the model.

    blockshard accelerate-config --cpu --semantics muon --layers LlamaDecoderLayer --out cfg
    accelerate launch --config_file cfg/accelerate.yaml examples/accelerate/muon.py --out run
    python examples/accelerate/muon.py --out ref   # one process (stock Accelerate): the reference

``prepare`` shards the model and hands torch's Muon whole matrices: the attention matrices lie whole
on one rank, the MLP matrices (large against total / W) are cut by ``policy: auto`` and computed at
their owner ranks, inside the ``OwnerComputeOptimizer`` that ``prepare`` returns in Muon's place
(docs/accelerate.md, "Muon"). Every rank trains on the whole batch, so the run equals one process
bitwise (tests/integrations/test_accelerate_muon.py). ``--out FILE`` writes the parameters to FILE.pt.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator

from blockshard.integrations.accelerate import Accelerator  # noqa: F811  the one added line
from blockshard.optim import muon_param_groups
from blockshard.tiny import text_batches, tiny_llama


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="write the trained parameters to OUT.pt")
    args = p.parse_args()
    torch.set_num_threads(1)

    # -- the recipe (docs/accelerate.md) --
    accelerator = Accelerator(step_scheduler_with_optimizer=False)  # one schedule step per step ("LR schedulers")
    model = tiny_llama(hidden_size=32, intermediate_size=777, num_hidden_layers=2)
    muon_group, rest = muon_param_groups(model)  # by name and global shape: hidden matrices to Muon
    muon = torch.optim.Muon([muon_group], lr=0.02)
    adamw = torch.optim.AdamW([rest], lr=1e-3)
    decay = torch.optim.lr_scheduler.LambdaLR(muon, lambda step: 1 / (1 + step))
    model, muon, adamw, decay = accelerator.prepare(model, muon, adamw, decay)  # step what prepare returns
    for input_ids, labels in text_batches(5, batch_size=2, seq_len=16):
        loss = model(input_ids=input_ids, labels=labels).loss
        accelerator.backward(loss)
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        decay.step()
        accelerator.print(f"loss {loss.item():.4f}")
    state = accelerator.get_state_dict(model)  # full tensors (collective: every rank)
    # -- end of the recipe --

    if args.out and accelerator.is_main_process:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, f"{args.out}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
