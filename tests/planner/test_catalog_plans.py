"""Every catalog model's plan, under every built-in semantics at W in {64, 1024, 16384}, is the plan
recorded in ``catalog_plans.json``: a guard for changes meant to make the planner faster, not different.

A case's fingerprint hashes ``plan_model(...).to_json(layouts=True)`` less its timing: every group's
layout (offsets, buckets, rotations), the owner assignment's hash, the cost and padding figures and the
quantized groups. The FP8 variants the engine plans are cases too (quantized gather with tile
placement; ``tile_placement="auto"``). A change that is meant to change plans records the new ones with

    .venv/bin/python tests/planner/test_catalog_plans.py --write

and says in its commit why they changed. The fingerprints were recorded on the planner whose
``benchmarks/plan_quality.py`` rows are in docs/results/plan_quality.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from blockshard import SemanticsError
from blockshard.planner import catalog_models, model_tensors, plan_model
from blockshard.planner._units import layout_hash

RECORD = Path(__file__).with_name("catalog_plans.json")
SEMANTICS = ("elementwise", "bnb8bit", "nf4", "mx", "ao_nf4", "muon", "shampoo:1024", "fp8_block:128")
VARIANTS = {  # fp8_block:128 as the engine also plans it
    "fp8_block:128+qgather+tiles": {"semantics": "fp8_block:128", "quantized_gather": True, "tile_placement": True},
    "fp8_block:128+tiles=auto": {"semantics": "fp8_block:128", "tile_placement": "auto"},
}
WORLD_SIZES = (64, 1024, 16384)


def fingerprints() -> dict[str, str]:
    out = {}
    for model in catalog_models():
        tensors = model_tensors(model)
        for W in WORLD_SIZES:
            cases = {sem: {"semantics": sem} for sem in SEMANTICS} | VARIANTS
            for name, kwargs in cases.items():
                try:
                    plan = plan_model(tensors, W, **kwargs)
                except SemanticsError as e:  # a semantics that does not apply to the model: recorded too
                    out[f"{model} W={W} {name}"] = f"raises {type(e).__name__}"
                    continue
                data = plan.to_json(layouts=True)
                del data["plan_seconds"]
                out[f"{model} W={W} {name}"] = layout_hash(data)
    return out


@pytest.mark.heavy
def test_catalog_plans_are_the_recorded_plans():
    recorded = json.loads(RECORD.read_text())
    got = fingerprints()
    assert got.keys() == recorded.keys(), "cases added or gone: record them (see this module's docstring)"
    changed = sorted(k for k in got if got[k] != recorded[k])
    assert not changed, (
        f"{len(changed)} of {len(got)} plans differ from {RECORD.name}, e.g. {changed[:5]}: a planner change "
        "changed them; if it was meant to, record them (see this module's docstring)"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/planner/test_catalog_plans.py --write")
    RECORD.write_text(json.dumps(fingerprints(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")
