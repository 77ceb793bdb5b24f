"""The registry (decorator, lookup errors, entry points) and the rules that assign semantics."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

import blockshard
from blockshard import BlockSemantics, Rule, SemanticsError, SemanticsRules, TensorSpec, UnitGrid
from blockshard.semantics import get_semantics, register_semantics, unregister_semantics


@pytest.fixture
def tile7():
    @register_semantics("tile7")
    class Tile7(BlockSemantics):
        def grid(self, shape, dtype, *, tensor="<tensor>"):
            return UnitGrid.units(math.prod(shape), 7)

    yield Tile7
    unregister_semantics("tile7")


def test_decorator_registers_and_lookup_builds(tile7):
    sem = get_semantics("tile7")
    assert isinstance(sem, tile7) and sem.spec == "tile7"
    assert "tile7" in blockshard.registered_semantics()
    assert sem.grid((3, 7), "float32") == UnitGrid.units(21, 7)


def test_unknown_name_lists_what_is_registered():
    with pytest.raises(SemanticsError) as info:
        get_semantics("nf5")
    msg = str(info.value)
    assert "unknown semantics 'nf5'" in msg
    for name in ("nf4", "bnb8bit", "matrix", "shampoo"):
        assert name in msg


def test_registering_twice_is_an_error(tile7):
    with pytest.raises(SemanticsError, match="already registered"):

        @register_semantics("tile7")
        class Other(BlockSemantics):
            def grid(self, shape, dtype, *, tensor="<tensor>"):
                return UnitGrid.whole(math.prod(shape))

    with pytest.raises(SemanticsError, match="not a BlockSemantics subclass"):
        register_semantics("bad")(object)


def _plugin(tmp_path, env_extra=""):
    """A real installed distribution with an entry point in blockshard.block_semantics."""
    pkg = tmp_path / "bs_plugin.py"
    pkg.write_text(
        textwrap.dedent(
            """
            import math
            from blockshard import BlockSemantics, UnitGrid
            class Tile5(BlockSemantics):
                def grid(self, shape, dtype, *, tensor="<tensor>"):
                    return UnitGrid.units(math.prod(shape), 5)
            """
        )
    )
    dist = tmp_path / "bs_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bs-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[blockshard.block_semantics]\ntile5 = bs_plugin:Tile5\n")
    code = (
        "import blockshard;"
        "print('tile5' in blockshard.registered_semantics());"
        "print(blockshard.get_semantics('tile5').grid((2, 5), 'float32').unit_numel if "
        "'tile5' in blockshard.registered_semantics() else -1)"
    )
    return code


def test_entry_points_autoload(tmp_path):
    code = _plugin(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path), "PATH": ""}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "5"]


def test_entry_points_opt_out(tmp_path):
    code = _plugin(tmp_path)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "", "BLOCKSHARD_NO_ENTRY_POINTS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "-1"]


W = TensorSpec(name="model.layers.0.mlp.up_proj.weight", shape=(96, 64), module_type="Linear", param_group=0)
N = TensorSpec(name="model.layers.0.input_layernorm.weight", shape=(64,), module_type="LlamaRMSNorm", param_group=1)
Q = TensorSpec(
    name="model.layers.0.self_attn.q_proj.weight", shape=(64, 64), module_type="Linear", tensor_type="Params4bit"
)


def test_rules_match_by_each_criterion():
    cases = [
        (Rule(semantics="matrix", name="*.mlp.*"), {W.name}),
        (Rule(semantics="rows:8", module_type="Linear"), {W.name, Q.name}),
        (Rule(semantics="nf4", tensor_type="Params4bit"), {Q.name}),
        (Rule(semantics="elementwise", param_group=1), {N.name}),
        (Rule(semantics="flat:4", predicate=lambda s: len(s.shape) == 1), {N.name}),
    ]
    for rule, expected in cases:
        assert {s.name for s in (W, N, Q) if rule.matches(s)} == expected, rule
    by_callable = SemanticsRules.coerce(lambda name, spec: "matrix" if name.endswith("up_proj.weight") else None)
    assert by_callable.resolve(W).grid.is_whole and not by_callable.resolve(N).grid.is_whole


def test_unmatched_tensors_are_elementwise():
    assert SemanticsRules.coerce({"*.mlp.*": "matrix"}).resolve(N).grid == UnitGrid.units(64, 1)


def test_two_semantics_combine_to_the_least_common_unit():
    rules = SemanticsRules.coerce("*.weight=rows:3,*.weight=mx")  # 3 rows of 64 = 192, and 32
    res = rules.resolve(W)
    assert res.grid.unit_numel == math.lcm(192, 32) == 192
    assert res.label == "rows:3+mx"


def test_incompatible_semantics_name_both_and_the_tensor():
    with pytest.raises(SemanticsError) as info:
        SemanticsRules.coerce({"*mlp*": "matrix", "*up_proj*": "bnb8bit"}).resolve(W)
    msg = str(info.value)
    assert W.name in msg and "'matrix'" in msg and "'bnb8bit'" in msg and "one optimizer" in msg
    with pytest.raises(SemanticsError, match=r"two quantizer semantics, 'nf4' and 'mx'"):
        SemanticsRules.coerce("*q_proj*=nf4,*q_proj*=mx").resolve(Q)


def test_muon_preset_whole_matrices_for_hidden_weights_only():
    rules = SemanticsRules.coerce("muon")
    emb = TensorSpec(name="model.embed_tokens.weight", shape=(100, 64), module_type="Embedding")
    head = TensorSpec(name="lm_head.weight", shape=(100, 64))
    assert rules.resolve(W).grid.is_whole
    assert not any(rules.resolve(s).grid.is_whole for s in (emb, head, N))


def test_blanket_specs_skip_tensors_the_semantics_does_not_handle():
    rules = SemanticsRules.coerce("nf4")
    assert rules.resolve(W).grid.unit_numel == 64
    assert rules.resolve(N).grid.unit_numel == 1  # a norm stays unquantized
    emb = TensorSpec(name="model.embed_tokens.weight", shape=(100, 60), module_type="Embedding")
    assert rules.resolve(emb).grid.unit_numel == 1  # so does the embedding (6000 is no multiple of 64)
    with pytest.raises(SemanticsError, match="numel 64"):  # an explicit rule on a norm is checked
        SemanticsRules.coerce("*layernorm*=ao_nf4").resolve(N)


@pytest.mark.parametrize("bad", ["", "=nf4", "nf4,,mx", 42])
def test_malformed_rule_text_raises(bad):
    with pytest.raises(SemanticsError):
        SemanticsRules.coerce(bad)
