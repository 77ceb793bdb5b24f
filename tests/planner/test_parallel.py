"""Tensor- and expert-parallel plans on paper ([Note: TP and EP plans] in ``planner/_parallel.py``):
torchtitan's placements by parameter name, the units a TP plan splits under each semantics, the
data-parallel plans of the TP / EP-local shapes, the owner-compute traffic across tp, bad input, and
``blockshard plan --tp / --ep``. Pure: no process group."""

from __future__ import annotations

import json
import math

import pytest

from blockshard import PlanError
from blockshard.cli import main as cli_main
from blockshard.planner import model_tensors
from blockshard.planner._parallel import parallel_style, placements, plan_parallel
from blockshard.semantics import TensorSpec

HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_torchtitans_placements_by_name():
    styles = {
        "model.embed_tokens.weight": "vocab",
        "model.layers.0.self_attn.q_proj.weight": "colwise",
        "model.layers.0.self_attn.q_proj.bias": "colwise",
        "model.layers.0.self_attn.o_proj.weight": "rowwise",
        "model.layers.0.self_attn.o_proj.bias": "replicate",  # added after the all-reduce
        "model.layers.0.mlp.down_proj.weight": "rowwise",
        "model.layers.0.input_layernorm.weight": "replicate",
        "model.layers.3.self_attn.q_a_proj.weight": "replicate",  # DeepSeek's low-rank down-projections
        "model.layers.3.self_attn.kv_b_proj.weight": "colwise",
        "model.layers.3.mlp.gate.weight": "replicate",  # the router
        "model.layers.3.mlp.experts.gate_up_proj": "expert",
        "model.layers.3.mlp.shared_experts.up_proj.weight": "colwise",
        "lm_head.weight": "colwise",
    }
    assert {n: parallel_style(n) for n in styles} == styles
    shapes = {"a.q_proj.weight": (64, 32), "a.o_proj.weight": (32, 64), "a.experts.down_proj": (8, 32, 16)}
    got = placements([TensorSpec(name=n, shape=s) for n, s in shapes.items()], tp=4, ep=2)
    assert [(p.label, p.local_shape) for p in got] == [
        ("Shard(0) over tp = 4", (16, 32)),
        ("Shard(1) over tp = 4", (32, 16)),
        ("Shard(0) over ep = 2", (4, 32, 16)),
    ]


def _tensor_bytes(model: str) -> int:
    return sum(math.prod(t.shape) for t in model_tensors(model)) * 2


def test_llama3_70b_at_tp8_dp128_muon_splits_every_hidden_matrix_and_reports_the_owner_traffic():
    """Muon on whole matrices: every TP-sharded hidden matrix is split (80 layers x 7), each moved to an
    owner across tp: 2 x 4 B x numel x 7/8 per step; the embedding and lm_head stay AdamW's (the
    ``muon`` preset) and are not split."""
    plan = plan_parallel(model_tensors("llama3-70b"), 1024, tp=8, semantics="muon")
    assert (plan.dp, plan.tp, plan.ep) == (128, 8, 1)
    names = {s.name for s in plan.split}
    assert len(names) == 80 * 7 and all(n.rsplit(".", 2)[-2] in HIDDEN for n in names)
    assert {s.kind for s in plan.split} == {"optimizer"}
    hidden = [t for t in model_tensors("llama3-70b") if t.name in names]
    assert plan.owner_bytes_total == sum(2 * 4 * math.prod(t.shape) * 7 // 8 for t in hidden)
    assert plan.owner_bytes_total / 1024 <= plan.owner_bytes_max_rank <= 1.01 * plan.owner_bytes_total / 1024 + 2**31
    full, mean = plan.rank_bytes()
    assert full <= 1.001 * mean
    # every rank holds its dp share of its TP shard: the ideal is the TP-sharded bytes / dp plus the replicated / dp
    tp_bytes = sum(math.prod(p.local_shape) for p in plan.placements) * 2
    assert mean == pytest.approx(tp_bytes / 128, rel=1e-3)


def test_8bit_state_and_fp8_tiles_stay_whole_at_tp8_and_are_split_at_tp16():
    """bitsandbytes' 256-blocks: TP cuts at multiples of 256 elements keep them (Shard(1): rows of 512).
    FP8 128 x 128 tiles: k_proj's 1024 rows at tp 8 are 128 per shard (whole), at tp 16 64 (split,
    a quantizer: the fix names the degrees that keep them)."""
    tensors = model_tensors("llama3-8b")
    assert plan_parallel(tensors, 64, tp=8, semantics="bnb8bit").split == []
    assert plan_parallel(tensors, 64, tp=8, semantics="fp8_block:128").split == []
    split = plan_parallel(tensors, 256, tp=16, semantics="fp8_block:128").split
    assert {s.name.rsplit(".", 2)[-2] for s in split} == {"k_proj", "v_proj"} and len(split) == 64
    assert all(s.kind == "quantizer" and "a tp among [2, 4, 8]" in s.fix for s in split)


def test_shampoo_tiles_are_split_only_where_a_shard_is_not_whole_tiles():
    """shampoo:1024 at tp 8 on Llama-3-70B: q_proj's 8192 rows give 1024 per shard and o_proj's 8192
    columns 1024 (whole 1024 x 1024 tiles); k_proj / v_proj's 1024 rows give 128, the MLP's 28672
    give 3584 and the vocabulary's 128256 16032 (split; the fix names the degrees that keep them)."""
    plan = plan_parallel(model_tensors("llama3-70b"), 1024, tp=8, semantics="shampoo:1024")
    by_name = {s.name: s for s in plan.split}
    sharded = {p.name for p in plan.placements if p.axis == "tp"}
    assert {n.rsplit(".", 2)[-2] for n in sharded - set(by_name)} == {"q_proj", "o_proj"}
    assert len(by_name) == 80 * 5 + 2 and all(s.kind == "optimizer" for s in plan.split)
    k, down = by_name["model.layers.0.self_attn.k_proj.weight"], by_name["model.layers.0.mlp.down_proj.weight"]
    assert "each shard holds 128 of dim 0" in k.why and "each shard holds 3584 of dim 1" in down.why
    assert "a tp among [2, 4, 7, 14, 28]" in down.fix  # 28672 = 28 x 1024
    # owner-compute moves only the straddled tile stripes: cuts every 3584 columns fall inside a
    # 1024-tile at 3584, 10752, 17920, 25088 (half each): 4 x 512 columns x 8192 rows
    assert down.moved_numel == 4 * 512 * 8192
    assert k.moved_numel == 8192 * (1024 - 128) // 1024 * 1024  # one 1024-row tile over 8 shards: 7/8 move


def test_a_1d_block_semantics_on_a_column_cut():
    """A row-wise weight whose shard rows are not whole 256-blocks (384 elements) is split; 512 is not."""
    split = plan_parallel([TensorSpec(name="a.o_proj.weight", shape=(64, 768))], 2, tp=2, semantics="bnb8bit").split
    assert len(split) == 1 and "pieces of 384 elements" in split[0].why and "[3]" in split[0].fix
    assert (
        plan_parallel([TensorSpec(name="a.o_proj.weight", shape=(64, 1024))], 2, tp=2, semantics="bnb8bit").split == []
    )


def test_deepseek_v3_at_ep64_dp16_keeps_experts_whole_and_balances_the_ranks():
    """Experts sharded by expert over ep (256 / 64 = 4 per rank), blockshard over dp within; dense
    tensors data-parallel over dp x ep. Muon per expert: nothing split."""
    tensors = model_tensors("deepseek-v3")
    plan = plan_parallel(tensors, 1024, ep=64, semantics="muon")
    experts = [p for p in plan.placements if p.axis == "ep"]
    assert experts and all(p.local_shape[0] == 4 and p.global_shape[0] == 256 for p in experts)
    assert plan.split == [] and plan.experts is not None and plan.experts.world_size == 16
    assert plan.dense is not None and plan.dense.world_size == 1024
    full, mean = plan.rank_bytes()
    assert full <= 1.01 * mean
    assert mean == pytest.approx(_tensor_bytes("deepseek-v3") / 1024, rel=1e-3)  # nothing replicated over tp


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 64, "tp": 3}, r"world_size=64 is not a multiple of tp \* ep = 3"),
        (
            {"world_size": 48, "tp": 3},
            r"'model\.layers\.0\.self_attn\.q_proj\.weight' of shape \(4096, 4096\) is sharded",
        ),
        ({"world_size": 64, "ep": 2}, r"ep=2 but the model has no stacked expert tensor"),
        ({"world_size": 64, "tp": 0}, r"tp=0: the degree must be an integer >= 1"),
        ({"world_size": 64, "tp": True}, r"tp=True"),
    ],
)
def test_bad_meshes_raise_naming_the_value_and_the_fix(kwargs, match):
    with pytest.raises(PlanError, match=match) as info:
        plan_parallel(model_tensors("llama3-8b"), **kwargs)
    assert "Fix:" in str(info.value)


def test_the_cli_plans_a_mesh_as_json_and_a_table_and_bad_input_is_one_line(capsys):
    assert cli_main(["plan", "--model", "llama3-8b", "-W", "64", "--tp", "8", "--semantics", "muon", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == {"dp": 8, "tp": 8, "ep": 1, "world_size": 64} and len(data["units_split_by_tp"]) == 32 * 7
    assert "placements" not in data
    assert cli_main(["plan", "--model", "deepseek-v3", "-W", "1024", "--ep", "64"]) == 0
    assert "dp 16 x tp 1 x ep 64" in capsys.readouterr().out
    assert cli_main(["plan", "--model", "llama3-8b", "-W", "64", "--ep", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no stacked expert tensor" in err[0]
