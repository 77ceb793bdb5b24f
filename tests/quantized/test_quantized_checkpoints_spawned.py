"""Quantized weights through checkpoints on spawned gloo ranks: saved at W = 2, loaded at W = 1.

``blockshard.save_checkpoint`` and a plain ``dcp.save(model.state_dict())`` of a tiny Llama with
bitsandbytes 4-bit decoder linears (nf4 nested, bf16 storage; fp4 fp32 absmax, uint8 storage) and
of torchao NF4 weights, loaded into a model whose quantized segments were overwritten: its full
state dict is the unsharded quantized model's again, bitwise (the control: overwritten, it differs).
The threaded tier (test_fast_quantized_state_dicts.py) runs W = 2 -> 1 and 1 -> 2 for more formats.
"""

from __future__ import annotations

import _state_runs
import pytest

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow

CASES = [
    ("bnb", True, (("quant_type", "nf4"), ("compress_statistics", True), ("quant_storage", "bfloat16"))),
    ("bnb", False, (("quant_type", "fp4"), ("compress_statistics", False), ("quant_storage", "uint8"))),
    ("ao_nf4", True, ()),
]


@pytest.mark.parametrize(
    ("kind", "checkpoint", "quant"), CASES, ids=["bnb-nf4-nested-bf16", "bnb-fp4-uint8-dcp", "ao-nf4"]
)
def test_saved_at_w2_loads_at_w1_exactly(kind, checkpoint, quant, tmp_path):
    path = str(tmp_path / "ckpt")
    spawn_gloo(_state_runs.spawned, 2, args=("save", kind, path, checkpoint, quant), timeout=300)
    (out,) = spawn_gloo(_state_runs.spawned, 1, args=("load", kind, path, checkpoint, quant), timeout=300)
    assert out["corrupted_differs"]
    assert out["after_load"] == []
