"""The model shape catalog and the shape readers.

The proof that the generator is right: for every supported model_type, a tiny config and every
full-size catalog config are built by transformers on the meta device (no download, no memory)
and their ``named_parameters()`` must equal the generated list exactly: names, order, shapes and
owning module classes.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from blockshard._errors import ShapesError
from blockshard.planner._catalog import (
    catalog_config,
    catalog_models,
    default_group,
    model_tensors,
    supported_model_types,
    tensors_from_hf_config,
)
from blockshard.planner._shapes_file import load_model_tensors, tensors_from_shapes_file

_GQA = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
_DSV3 = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=4,
    n_shared_experts=2,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
)

# Tiny configs with the same structure knobs as the real models (and a few variants).
TINY = {
    "llama": dict(model_type="llama", **_GQA, head_dim=16),
    "llama-tied-biases": dict(model_type="llama", **_GQA, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", **_GQA),
    "qwen3": dict(model_type="qwen3", **_GQA, head_dim=24),
    "qwen3-bias-tied": dict(model_type="qwen3", **_GQA, head_dim=8, attention_bias=True, tie_word_embeddings=True),
    "mixtral": dict(model_type="mixtral", **_GQA, num_local_experts=3, num_experts_per_tok=2),
    "deepseek_v3": dict(model_type="deepseek_v3", **_DSV3),
    "deepseek_v3-no-q-lora": dict(model_type="deepseek_v3", **{**_DSV3, "q_lora_rank": None}, attention_bias=True),
    "gpt_oss": dict(
        model_type="gpt_oss",
        **{**_GQA, "intermediate_size": 48},
        head_dim=16,
        num_local_experts=3,
        num_experts_per_tok=2,
    ),
    "gpt_oss-no-bias": dict(
        model_type="gpt_oss", **_GQA, head_dim=16, num_local_experts=4, num_experts_per_tok=2, attention_bias=False
    ),
}


def _hf_params(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    kwargs = dict(cfg)
    hf_config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    modules = dict(model.named_modules())
    return [(n, tuple(p.shape), type(modules[n.rpartition(".")[0]]).__name__) for n, p in model.named_parameters()]


def _ours(tensors) -> list[tuple[str, tuple[int, ...], str]]:
    return [(t.name, t.shape, t.module_type) for t in tensors]


def test_every_supported_model_type_has_a_tiny_check():
    assert {c["model_type"] for c in TINY.values()} == set(supported_model_types())


@pytest.mark.parametrize("key", list(TINY))
def test_tiny_config_matches_transformers(key):
    cfg = TINY[key]
    assert _ours(tensors_from_hf_config(cfg)) == _hf_params(cfg)


@pytest.mark.parametrize("name", catalog_models())
def test_full_catalog_config_matches_transformers(name):
    # Full size on the meta device: no memory, about 0.1 s each.
    assert _ours(model_tensors(name)) == _hf_params(catalog_config(name))


# Exact totals the generator gives (equal to transformers' models above), and the published sizes.
COUNTS = {
    "llama3-8b": (8_030_261_248, 8.03e9),
    "llama3-70b": (70_553_706_496, 70.6e9),
    "llama3-405b": (405_853_388_800, 405.9e9),
    "qwen2.5-7b": (7_615_616_512, 7.61e9),  # model card: 7.61B
    "qwen3-8b": (8_190_735_360, 8.2e9),  # model card: 8.2B
    "mixtral-8x7b": (46_702_792_704, 46.7e9),
    # 671B is the main model; the HF checkpoint's 685B adds the 14B multi-token-prediction
    # layer (num_nextn_predict_layers=1), which transformers' DeepseekV3ForCausalLM does not build.
    "deepseek-v3": (671_026_404_352, 671e9),
    "gpt-oss-120b": (116_829_156_672, 116.8e9),  # model card: 116.8B total
}


def test_catalog_names():
    assert catalog_models() == list(COUNTS)


@pytest.mark.parametrize("name", list(COUNTS))
def test_total_parameters_match_published(name):
    total = sum(t.numel for t in model_tensors(name))
    exact, published = COUNTS[name]
    assert total == exact
    assert total == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name", catalog_models())
def test_catalog_tensor_metadata(name):
    tensors = model_tensors(name)
    assert len({t.name for t in tensors}) == len(tensors)
    assert all(t.dtype == "bfloat16" and t.group == default_group(t.name) for t in tensors)
    groups = {t.group for t in tensors}
    layers = catalog_config(name)["num_hidden_layers"]
    assert groups == {""} | {f"model.layers.{i}" for i in range(layers)}
    root = sorted(t.name for t in tensors if t.group == "")
    assert root == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]


def test_moe_expert_layout():
    ds = {t.name: t for t in model_tensors("deepseek-v3")}
    assert "model.layers.2.mlp.down_proj.weight" in ds  # first_k_dense_replace = 3 dense layers
    assert ds["model.layers.3.mlp.experts.gate_up_proj"].shape == (256, 4096, 7168)
    assert ds["model.layers.3.mlp.experts.down_proj"].shape == (256, 7168, 2048)
    assert ds["model.layers.3.mlp.experts.down_proj"].module_type == "DeepseekV3Experts"
    assert ds["model.layers.3.mlp.shared_experts.up_proj.weight"].shape == (2048, 7168)
    assert ds["model.layers.60.self_attn.kv_b_proj.weight"].shape == (128 * 256, 512)
    oss = {t.name: t.shape for t in model_tensors("gpt-oss-120b")}
    assert oss["model.layers.0.mlp.experts.gate_up_proj"] == (128, 2880, 5760)  # (E, in, out)
    assert oss["model.layers.0.mlp.experts.down_proj"] == (128, 2880, 2880)
    assert oss["model.layers.0.mlp.experts.gate_up_proj_bias"] == (128, 5760)
    assert oss["model.layers.0.self_attn.sinks"] == (64,)
    mix = {t.name: t.shape for t in model_tensors("mixtral-8x7b")}
    assert mix["model.layers.0.mlp.experts.gate_up_proj"] == (8, 28672, 4096)  # (E, out, in)


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.layers.3.mlp.up_proj.weight", "model.layers.3"),
        ("model.layers.12.mlp.experts.gate_up_proj", "model.layers.12"),
        ("model.embed_tokens.weight", ""),
        ("model.norm.weight", ""),
        ("lm_head.weight", ""),
        ("transformer.h.0.attn.c_attn.weight", "transformer.h.0"),
        ("blocks.7.stage.2.weight", "blocks.7"),
        ("layer3x.weight", ""),
        ("0.weight", "0"),
    ],
)
def test_default_group(name, group):
    assert default_group(name) == group


def test_config_json_path_dir_and_architectures_only(tmp_path):
    cfg = TINY["qwen3"]
    expected = tensors_from_hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert tensors_from_hf_config(tmp_path / "config.json") == expected
    assert tensors_from_hf_config(str(tmp_path)) == expected
    assert load_model_tensors(config=tmp_path / "config.json") == expected
    arch_only = {k: v for k, v in cfg.items() if k != "model_type"}
    arch_only["architectures"] = ["Qwen3ForCausalLM"]
    assert tensors_from_hf_config(arch_only) == expected


def test_config_aliases_and_defaults():
    # num_experts is transformers' alias of num_local_experts; head_dim defaults to hidden/heads.
    cfg = {**TINY["mixtral"]}
    cfg["num_experts"] = cfg.pop("num_local_experts")
    assert tensors_from_hf_config(cfg) == tensors_from_hf_config(TINY["mixtral"])
    llama = {k: v for k, v in TINY["llama"].items() if k not in ("head_dim", "num_key_value_heads")}
    q = {t.name: t.shape for t in tensors_from_hf_config(llama)}
    assert q["model.layers.0.self_attn.k_proj.weight"] == (64, 64)


def _write_shapes(tmp_path, tensors, *, with_group=True, name="shapes.json"):
    entries = []
    for t in tensors:
        e = {"name": t.name, "shape": list(t.shape), "dtype": t.dtype}
        if with_group:
            e["group"] = t.group
        entries.append(e)
    path = tmp_path / name
    path.write_text(json.dumps({"model": "x", "tensors": entries}))
    return path


def test_shapes_file_round_trip(tmp_path):
    tensors = model_tensors("mixtral-8x7b")
    path = _write_shapes(tmp_path, tensors)
    back = tensors_from_shapes_file(path)
    assert [(t.name, t.shape, t.dtype, t.group) for t in back] == [(t.name, t.shape, t.dtype, t.group) for t in tensors]
    # group and dtype left out: default_group and bfloat16
    no_group = _write_shapes(tmp_path, tensors, with_group=False, name="nogroup.json")
    assert [t.group for t in tensors_from_shapes_file(no_group)] == [t.group for t in tensors]
    assert load_model_tensors(shapes=str(no_group))[5].group == tensors[5].group
    minimal = tmp_path / "min.json"
    minimal.write_text(
        '{"tensors": [{"name": "w", "shape": [3, 5], "dtype": "fp32", "group": null},'
        ' {"name": "b.0.x", "shape": [], "module_type": "Linear", "param_group": 1}]}'
    )
    w, b = tensors_from_shapes_file(minimal)
    assert (w.dtype, w.group, w.shape) == ("float32", "", (3, 5))
    assert (b.dtype, b.group, b.shape, b.module_type, b.param_group) == ("bfloat16", "b.0", (), "Linear", 1)


def test_load_model_tensors_catalog():
    assert load_model_tensors(model="qwen2.5-7b") == model_tensors("qwen2.5-7b")
    assert load_model_tensors(config=TINY["llama"]) == tensors_from_hf_config(TINY["llama"])


# ---- errors: ShapesError naming the thing, the value, the constraint and the fix -------------


def _raises(fn, *fragments):
    with pytest.raises(ShapesError) as info:
        fn()
    assert isinstance(info.value, ValueError)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_unknown_catalog_name():
    _raises(lambda: model_tensors("llama5-1t"), "'llama5-1t'", "llama3-8b", "deepseek-v3", "gpt-oss-120b")
    _raises(lambda: catalog_config(None), "None", "known models")


def test_unsupported_model_type():
    _raises(
        lambda: tensors_from_hf_config({**TINY["llama"], "model_type": "bert"}),
        "model_type='bert'",
        "not supported",
        "llama",
        "qwen3",
        "gpt_oss",
        "shapes file",
    )
    _raises(
        lambda: tensors_from_hf_config({"architectures": ["BertModel"], "hidden_size": 8}),
        "model_type",
        "BertModel",
        "deepseek_v3",
    )


def test_config_missing_or_bad_key(tmp_path):
    cfg = {k: v for k, v in TINY["deepseek_v3"].items() if k != "kv_lora_rank"}
    _raises(lambda: tensors_from_hf_config(cfg), "'kv_lora_rank'", "missing", "deepseek_v3")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY["llama"], "hidden_size": -4}))
    _raises(lambda: tensors_from_hf_config(path), str(path), "hidden_size=-4", ">= 1")
    _raises(
        lambda: tensors_from_hf_config({**TINY["llama"], "num_hidden_layers": "2"}), "num_hidden_layers='2'", "integer"
    )
    _raises(
        lambda: tensors_from_hf_config({**TINY["mixtral"], "num_local_experts": None}),
        "'num_local_experts'",
        "'num_experts'",
        "missing",
    )
    _raises(
        lambda: tensors_from_hf_config({**TINY["llama"], "tie_word_embeddings": "yes"}),
        "tie_word_embeddings='yes'",
        "true or false",
    )


def test_config_file_errors(tmp_path):
    _raises(lambda: tensors_from_hf_config(tmp_path / "nope.json"), "nope.json", "does not exist")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _raises(lambda: tensors_from_hf_config(bad), str(bad), "not valid JSON", "line 1")
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    _raises(lambda: tensors_from_hf_config(arr), str(arr), "list", "JSON object")
    _raises(lambda: tensors_from_hf_config(42), "config=42", "config dict")


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("{oops", ["not valid JSON", "line 1"]),
        ('[{"name": "a", "shape": [1]}]', ['without a "tensors" key']),
        ('{"tensors": {"a": [1]}}', ["tensors={'a': [1]}", '"tensors" list']),
        ('{"tensors": []}', ["empty", "no tensors"]),
        ('{"tensors": [3]}', ["tensors[0]", "int", "object"]),
        ('{"tensors": [{"shape": [2, 2]}]}', ["tensors[0]", "name=None", '"name"']),
        ('{"tensors": [{"name": "a", "shape": [1]}, {"name": "b"}]}', ["tensors[1]", "'b'", '"shape"']),
        ('{"tensors": [{"name": "a", "shape": [2.5, 2]}]}', ["tensors[0]", "'a'", "[2.5, 2]", "integers"]),
        ('{"tensors": [{"name": "a", "shape": "2x2"}]}', ["tensors[0]", "'2x2'", "list"]),
        ('{"tensors": [{"name": "a", "shape": [true]}]}', ["tensors[0]", "[True]", "integers"]),
        ('{"tensors": [{"name": "a", "shape": [4, -1]}]}', ["tensors[0]", "[4, -1]", "negative", ">= 0"]),
        (
            '{"tensors": [{"name": "a", "shape": [1]}, {"name": "a", "shape": [2]}]}',
            ["tensors[1]", "'a'", "tensors[0]", "unique"],
        ),
        (
            '{"tensors": [{"name": "z", "shape": [1]}, {"name": "a", "shape": [1], "dtype": "int4"}]}',
            ["tensors[1]", "'a'", "dtype='int4'", "bfloat16"],
        ),
        ('{"tensors": [{"name": "a", "shape": [1], "shap": [2]}]}', ["tensors[0]", "'shap'", "allowed keys"]),
        ('{"tensors": [{"name": "a", "shape": [1], "group": 3}]}', ["tensors[0]", "group=3", "string"]),
    ],
)
def test_shapes_file_errors(tmp_path, content, fragments):
    path = tmp_path / "shapes.json"
    path.write_text(content)
    _raises(lambda: tensors_from_shapes_file(path), str(path), *fragments)


def test_shapes_file_missing(tmp_path):
    _raises(lambda: tensors_from_shapes_file(tmp_path / "x.json"), "x.json", "does not exist")


def test_load_model_tensors_needs_exactly_one():
    _raises(lambda: load_model_tensors(), "exactly one", "got none")
    _raises(
        lambda: load_model_tensors(model="llama3-8b", shapes="s.json"),
        "exactly one",
        "model='llama3-8b'",
        "shapes='s.json'",
    )
