"""Launched by tests/integrations/test_accelerate_muon.py: Muon in each of its three forms (torch's
``Muon``, ``blockshard.optim.Muon``, ``OwnerComputeOptimizer``), built before ``accelerator.prepare``
(Accelerate's documented order: the optimizers go to ``prepare`` with the model) or after
``prepare(model)``, under ``policy`` auto and whole, on a tiny Llama whose MLP matrices ``auto``
computes at their owners at W = 2. One launch runs every variant (an ``Accelerator`` each, with the
launch config's settings and the variant's policy); ``--save-at`` saves each variant's state with
``accelerator.save_state``, ``--resume-at`` loads it and trains the remaining steps. Run as ``python``
with ``--reference`` it is the one-process reference: torch's Muon and AdamW on the unsharded model.

    accelerate launch --config_file CFG tests/integrations/_acc_muon.py --out FILE [--save-at 3 | --resume-at 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from blockshard.integrations.accelerate import Accelerator, load_settings
from blockshard.optim import Muon, OwnerComputeOptimizer, muon_param_groups
from blockshard.tiny import text_batches, tiny_llama

SHAPES = {"hidden_size": 32, "intermediate_size": 777, "num_hidden_layers": 2}
STEPS = 5
# torch's Muon built after prepare(model) under "auto" is left out: its constructor refuses the flat
# pieces of the cut matrices itself (torch: "only supports 2D parameters"); docs/accelerate.md says so
VARIANTS = [
    (form, order, policy)
    for form in ("torch", "blockshard", "owner")
    for order in ("before", "after")
    for policy in ("auto", "whole")
    if (form, order, policy) != ("torch", "after", "auto")
]


def build(form: str, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    muon_group, rest = muon_param_groups(model)
    if form == "torch":
        muon: torch.optim.Optimizer = torch.optim.Muon([muon_group], lr=0.02)
    elif form == "blockshard":
        muon = Muon([muon_group], lr=0.02)
    else:
        muon = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [muon_group])
    return [muon, torch.optim.AdamW([rest], lr=1e-3)]


def train(model, optimizers, accelerator, first: int, save_at: int | None, ckpt: str | None) -> None:
    for step, (input_ids, labels) in enumerate(text_batches(STEPS, batch_size=2, seq_len=16)):
        if step < first:
            continue
        loss = model(input_ids=input_ids, labels=labels).loss
        accelerator.backward(loss) if accelerator is not None else loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        if save_at is not None and step + 1 == save_at:
            accelerator.save_state(ckpt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", default="ckpt")
    p.add_argument("--save-at", type=int)
    p.add_argument("--resume-at", type=int)
    p.add_argument("--reference", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.reference:
        model = tiny_llama(**SHAPES)
        train(model, build("torch", model), None, 0, None, None)
        torch.save({"reference": {k: v.detach().clone() for k, v in model.state_dict().items()}}, f"{args.out}.pt")
        return
    base = load_settings()
    results, kinds = {}, {}
    accelerator = None
    for form, order, policy in VARIANTS:
        name = f"{form}-{order}-{policy}"
        accelerator = Accelerator(blockshard_settings=dataclasses.replace(base, policy=policy))
        model = tiny_llama(**SHAPES)
        if order == "before":
            prepared = accelerator.prepare(model, *build(form, model))
            model, optimizers = prepared[0], list(prepared[1:])
        else:
            model = accelerator.prepare(model)
            optimizers = list(accelerator.prepare(*build(form, model)))
        ckpt = os.path.join(args.ckpt, name)
        if args.resume_at is not None:
            accelerator.load_state(ckpt)
        train(model, optimizers, accelerator, args.resume_at or 0, args.save_at, ckpt)
        kinds[name] = [type(o.optimizer).__name__ for o in optimizers]
        state = accelerator.get_state_dict(model)
        results[name] = {k: v.detach().clone() for k, v in state.items()}
    assert accelerator is not None
    with open(f"{args.out}.rank{accelerator.process_index}.json", "w") as f:
        json.dump({"world_size": accelerator.num_processes, "optimizers": kinds}, f)
    if accelerator.is_main_process:
        torch.save(results, f"{args.out}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
