"""How far W ranks drift from one process: per optimizer, world size and step, on a tiny Llama.

    python benchmarks/drift.py --worlds 2,3,4 --steps 5 --json --out docs/results/drift.json

Every rank trains on the whole batch (docs/design.md, "Sharding invariance"), so at W in {2, 4} the
gradient average is exact and the run equals one process bitwise; at W = 3 the average of three
equal values is off by an ulp in places, and each optimizer amplifies that differently (8-bit
quantization can flip a code; Muon's bf16 Newton-Schulz usually absorbs it). One run spawns W gloo
ranks (``blockshard.launch.spawn_gloo``, one thread per rank) per world size and optimizer, each
training ``blockshard.tiny.tiny_llama()`` sharded with the optimizer's semantics, and one process
trains the unsharded model (``run_single``). Reported: the largest absolute difference of any
parameter from one process after each step (``max_abs_diff``), and the step it first exceeded
1e-6. This is a measurement of these runs, not a bound: it grows with the steps and the model.
"""

from __future__ import annotations

import sys

import torch
from _common import add_output_args, command, emit, machine_facts, parser  # benchmarks/ is on sys.path

import blockshard
from blockshard.launch import run_single, spawn_gloo
from blockshard.optim import OwnerComputeOptimizer, muon_param_groups
from blockshard.tiny import text_batches, tiny_llama

OPTIMIZERS = ("adamw", "bnb8bit", "muon")
SEMANTICS = {"adamw": "elementwise", "bnb8bit": "bnb8bit", "muon": "muon"}


def _optimizers(name: str, model: torch.nn.Module, sharded: bool) -> list[torch.optim.Optimizer]:
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    if name == "bnb8bit":
        import bitsandbytes as bnb

        return [bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=256)]
    muon_group, rest = muon_param_groups(model)
    muon = (
        OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [muon_group])
        if sharded
        else torch.optim.Muon([muon_group], lr=0.02)
    )
    return [muon, torch.optim.AdamW([rest], lr=1e-3)]


def train(rank: int, world_size: int, name: str, steps: int) -> list[dict[str, torch.Tensor]]:
    """The full parameters after each step (on rank 0; the others return nothing)."""
    model = tiny_llama()
    if world_size > 1:
        for layer in model.model.layers:
            blockshard.fully_shard(layer, semantics=SEMANTICS[name])
        blockshard.fully_shard(model, semantics=SEMANTICS[name])
    opts = _optimizers(name, model, world_size > 1)
    after = []
    for input_ids, labels in text_batches(steps, batch_size=4, seq_len=32):
        model(input_ids=input_ids, labels=labels).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        full = blockshard.full_state_dict(model) if world_size > 1 else model.state_dict()
        after.append({k: v.detach().clone() for k, v in full.items()} if rank == 0 else {})
    return after


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__, world_size=None, steps=5, warmup=None)
    p.add_argument("--worlds", default="2,3,4", help="comma-separated world sizes")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    add_output_args(p, timeout=600.0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    names = args.optimizers.split(",")
    runs = []
    for name in names:
        one = run_single(train, args=(name, args.steps), timeout=args.timeout)
        for w in worlds:
            got = spawn_gloo(train, w, args=(name, args.steps), timeout=args.timeout)[0]
            diffs = [
                max((g[k].double() - o[k].double()).abs().max().item() for k in o)
                for g, o in zip(got, one, strict=True)
            ]
            first = next((i + 1 for i, d in enumerate(diffs) if d > 1e-6), None)
            runs.append({"optimizer": name, "world_size": w, "max_abs_diff": diffs, "first_step_above_1e-6": first})
    report = {
        "benchmark": "drift",
        "command": command("drift.py", sys.argv[1:] if argv is None else argv),
        "steps": args.steps,
        "model": "blockshard.tiny.tiny_llama() (default shapes), batch 4 x 32 byte tokens, whole batch on every rank",
        "runs": runs,
        "machine": machine_facts(),
    }
    return emit(report, render=_render, out=args.out, as_json=args.json)


def _render(report: dict) -> None:
    print(f"{'optimizer':10} {'W':>3}  max |W ranks - one process| after each of {report['steps']} steps")
    for r in report["runs"]:
        print(f"{r['optimizer']:10} {r['world_size']:>3}  " + "  ".join(f"{d:.1e}" for d in r["max_abs_diff"]))


if __name__ == "__main__":
    main()
