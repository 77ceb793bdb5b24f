"""Fused weights declared per part (``parts:r1:r2:...``, [Note: fused parts] in semantics/_builtins.py).

A model with a fused ``qkv`` projection (``[q; k; v]``, 40 + 8 + 8 rows: GQA-like, unequal parts), a
fused ``gate_up`` (32 + 32 rows) and stacked experts whose ``gate_up_proj`` is ``[gate; up]`` per expert
(8 + 8 rows), sharded with ``matrix`` and the parts declared, stepped by ``blockshard.optim.Muon``.

Reference: one process, ``torch.optim.Muon`` on every part as its own matrix (views of the fused
weights, each given its slice of the gradient), AdamW on the biases. Expected: **bitwise** (every rank
the whole batch), at W = 1 and on 2 gloo thread ranks under ``policy="owner"`` (parts cut between
ranks, computed at owners) and ``"whole"``. Control: the same run without the parts (Newton-Schulz on
each fused matrix whole) differs from the reference by far more than an ulp.

Bad input: parts that do not sum to the rows, torch's Muon or ``OwnerComputeOptimizer`` around it on a
fused weight, Shampoo tiles straddling a part: each raises naming the parameter and the fix.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the engine tier's thread ranks
import _inproc

import blockshard
from blockshard import SemanticsError
from blockshard._tiny import tiny_mixtral
from blockshard.integrations import fsdp2
from blockshard.optim import BlockedShampoo, Muon, OwnerComputeError, OwnerComputeOptimizer, muon_param_groups
from blockshard.runtime import ShardingError
from blockshard.semantics import SemanticsRules, TensorSpec, newton_schulz_flops

PARTS = {"block.qkv.weight": (40, 8, 8), "block.gate_up.weight": (32, 32), "block.experts.gate_up_proj": (8, 8)}
WITH_PARTS = (
    "*weight=matrix,*gate_up_proj=matrix,*qkv.weight=parts:40:8:8,*gate_up.weight=parts:32:32,*gate_up_proj=parts:8:8"
)
WITHOUT_PARTS = "*weight=matrix,*gate_up_proj=matrix"
STEPS = 3


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, 16, 24) / 5)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(24, 56, bias=False)
        self.gate_up = nn.Linear(24, 64, bias=False)
        self.down = nn.Linear(32, 24, bias=False)
        self.experts = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split([40, 8, 8], dim=-1)
        att = torch.tanh(q[:, :8] * k) + v
        gate, up = self.gate_up(x).split(32, dim=-1)
        mlp = self.down(nn.functional.silu(gate) * up)
        eg, eu = torch.einsum("bh,eoh->beo", x, self.experts.gate_up_proj).split(8, dim=-1)
        moe = (nn.functional.silu(eg) * eu).sum(1)
        return torch.cat([mlp, att + moe], dim=-1)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x))


def _model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _Model()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 24, generator=g), torch.randn(6, 5, generator=g)) for _ in range(STEPS)]


def _is_matrix(name: str) -> bool:
    return name.endswith(("weight", "gate_up_proj"))


def _train(model: nn.Module, opts: list, before_step=None) -> dict[str, torch.Tensor]:
    for x, y in _batches():
        ((model(x) - y) ** 2).mean().backward()
        if before_step is not None:
            before_step()
        for o in opts:
            o.step()
            o.zero_grad()
        model.zero_grad()  # the reference's fused gradients (its optimizers hold views of them)
    return {k: v.detach().clone() for k, v in blockshard.full_state_dict(model).items()}


def _part_views(p: nn.Parameter, rows: tuple[int, ...] | None) -> list[tuple[torch.Tensor, nn.Parameter, tuple]]:
    """``(view, p, index)`` of every part of ``p`` (``rows``; None: one part), of every expert's matrix
    of a stacked ``(E, m, n)`` tensor: the matrices torch's Muon steps one by one in the references."""
    views = []
    for e in range(p.shape[0]) if p.ndim == 3 else [None]:
        at = 0
        for r in rows or (p.shape[-2],):
            index = (e, slice(at, at + r)) if e is not None else (slice(at, at + r),)
            views.append((p.detach()[index], p, index))
            at += r
    return views


def _reference() -> dict[str, torch.Tensor]:
    """torch's Muon on every part (and every expert's part) as a matrix of its own."""
    model = _model()
    views = [v for name, p in model.named_parameters() if _is_matrix(name) for v in _part_views(p, PARTS.get(name))]
    muon = torch.optim.Muon([v for v, _, _ in views], lr=0.02)
    adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if not _is_matrix(n)], lr=1e-3)

    def grads_to_parts() -> None:
        for v, p, index in views:
            v.grad = p.grad[index]

    return _train(model, [muon, adamw], grads_to_parts)


def _sharded(rank: int, world: int, variants: list[tuple[str, str]]) -> list[dict[str, torch.Tensor]]:
    out = []
    for semantics, policy in variants:
        with _inproc.serial():
            model = _model()
        blockshard.fully_shard(model.block, semantics=semantics, policy=policy)
        blockshard.fully_shard(model, semantics=semantics, policy=policy)
        named = list(model.named_parameters())
        muon = Muon([(n, p) for n, p in named if _is_matrix(n)], lr=0.02)
        adamw = torch.optim.AdamW([p for n, p in named if not _is_matrix(n)], lr=1e-3)
        out.append(_train(model, [muon, adamw]))
    return out


@pytest.fixture(scope="module")
def gloo_w1():
    with _inproc.world1() as group:
        yield group


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    with _inproc.single_thread():
        return _reference()


def _max_diff(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_muon_per_part_at_one_rank_equals_torch_muon_on_the_parts_bitwise(gloo_w1, reference):
    with _inproc.single_thread():
        got, control = _sharded(0, 1, [(WITH_PARTS, "owner"), (WITHOUT_PARTS, "owner")])
    assert sorted(got) == sorted(reference)
    assert _max_diff(got, reference) == 0.0
    assert _max_diff(control, reference) > 1e-3  # control: NS on the fused matrices whole


@pytest.mark.heavy
def test_muon_per_part_on_two_ranks_equals_torch_muon_on_the_parts_bitwise(reference):
    variants = [(WITH_PARTS, "owner"), (WITH_PARTS, "whole"), (WITHOUT_PARTS, "owner")]
    for rank in _inproc.run_ranks(_sharded, 2, args=(variants,)):
        owner, whole, control = rank
        assert _max_diff(owner, reference) == 0.0
        assert _max_diff(whole, reference) == 0.0
        assert _max_diff(control, reference) > 1e-3


def test_parts_that_do_not_sum_to_the_rows_raise_naming_the_tensor():
    rules = SemanticsRules.coerce("*qkv.weight=parts:40:8:4")
    with pytest.raises(SemanticsError, match=r"'block.qkv.weight'.*40 \+ 8 \+ 4 = 52 rows.*has 56 rows"):
        rules.resolve(TensorSpec(name="block.qkv.weight", shape=(56, 24), dtype="float32"))
    with pytest.raises(SemanticsError, match="at least 2 parts"):
        SemanticsRules.coerce("parts:56")


def test_shampoo_tiles_across_a_part_boundary_raise_and_aligned_ones_pass():
    spec = TensorSpec(name="w", shape=(96, 24), dtype="float32")
    with pytest.raises(SemanticsError, match=r"'w'.*boundary at row 80 is not a multiple of 32"):
        SemanticsRules.coerce("parts:64:16:16,shampoo:32").resolve(spec)
    assert SemanticsRules.coerce("parts:64:32,shampoo:32").resolve(spec).label == "parts:64:32+shampoo:32"


def test_torch_muon_and_owner_compute_around_it_refuse_a_fused_weight(gloo_w1):
    with _inproc.single_thread():
        model = _model()
        blockshard.fully_shard(model.block, semantics=WITH_PARTS, policy="owner")
        blockshard.fully_shard(model, semantics=WITH_PARTS, policy="owner")
        mats = [(n, p) for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2]
        with pytest.raises(OwnerComputeError, match=r"'block.qkv.weight'.*parts 40:8:8.*blockshard.optim.Muon"):
            OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), mats)
        muon = torch.optim.Muon([p for _, p in mats], lr=0.02)
        ((model(torch.randn(6, 24)) ** 2).mean()).backward()
        with pytest.raises(ShardingError, match=r"qkv.weight.*fused weight of parts 40:8:8.*blockshard.optim.Muon"):
            muon.step()
        # BlockedShampoo: 16-row tiles would straddle the part boundary at row 40; 8-row tiles would not
        qkv = [p for n, p in mats if n.endswith("qkv.weight")]
        with pytest.raises(ShardingError, match=r"16 x 16 tiles would hold rows of two parts.*row 40"):
            BlockedShampoo(qkv, lr=1e-3, max_preconditioner_dim=16).step()
        BlockedShampoo(qkv, lr=1e-3, max_preconditioner_dim=8).step()


def test_stock_fsdp2_owner_compute_around_torch_muon_refuses_a_fused_weight():
    """blockshard.integrations.fsdp2.OwnerComputeOptimizer takes the semantics itself: parts declared there
    reach no per-part Newton-Schulz, so torch's Muon inside it is refused; AdamW (element-wise) is not."""
    p = nn.Parameter(torch.randn(56, 24))
    with pytest.raises(OwnerComputeError, match=r"'qkv.weight' of shape \(56, 24\).*parts 40:8:8"):
        fsdp2.OwnerComputeOptimizer(
            lambda g: torch.optim.Muon(g, lr=0.02), [("qkv.weight", p)], semantics="matrix,*qkv.weight=parts:40:8:8"
        )
    fsdp2.OwnerComputeOptimizer(
        lambda g: torch.optim.AdamW(g), [("qkv.weight", p)], semantics="*qkv.weight=parts:40:8:8"
    )


def test_a_fused_weights_muon_cost_is_its_parts_newton_schulz():
    """Owners are balanced by cost: Muon on a fused weight costs Newton-Schulz on each part (per expert too)."""

    res = SemanticsRules.coerce("matrix,*qkv=parts:40:8:8").resolve(
        TensorSpec(name="a.qkv", shape=(56, 24), dtype="float32")
    )
    assert res.cost == newton_schulz_flops((40, 24)) + 2 * newton_schulz_flops((8, 24)) < newton_schulz_flops((56, 24))
    experts = TensorSpec(name="experts.gate_up_proj", shape=(2, 16, 24), dtype="float32")
    assert SemanticsRules.coerce("matrix,*gate_up_proj=parts:8:8").resolve(experts).cost == 4 * newton_schulz_flops(
        (8, 24)
    )


# -- Hugging Face models' fused weights (the rules docs/optimizers.md gives) ---------------------------
def _tiny_phi3() -> nn.Module:
    """A tiny ``transformers.Phi3ForCausalLM``: ``qkv_proj`` ``[q; k; v]`` of 32 + 16 + 16 rows (4 heads,
    2 KV heads of 8), ``gate_up_proj`` ``[gate; up]`` of 48 + 48 rows."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Phi3ForCausalLM(config).float().train()


HF_PARTS = {  # model -> (its fused weights' rules, as docs/optimizers.md gives them)
    "phi3": {"*.qkv_proj.weight": (32, 16, 16), "*.gate_up_proj.weight": (48, 48)},
    "mixtral": {"*.experts.gate_up_proj": (24, 24)},  # (3 experts, 2 x 24, 16): [gate; up] per expert
}


def _hf_model(kind: str) -> nn.Module:
    return _tiny_phi3() if kind == "phi3" else tiny_mixtral()


def _hf_train(kind: str, sharded: bool, parts: bool) -> dict[str, torch.Tensor]:
    """4 steps of blockshard's Muon (sharded with the parts' rules, or without them: the control) or,
    unsharded, torch's Muon on every part of every fused weight (every expert's) as a matrix of its own;
    AdamW on the rest (embedding, norms, head)."""
    model = _hf_model(kind)
    rules = HF_PARTS[kind]
    muon_names = set(muon_param_groups(model)[0]["param_names"])
    if sharded:
        semantics = "muon" + "".join(f",{g}=parts:{':'.join(map(str, r))}" for g, r in rules.items() if parts)
        for layer in model.model.layers:
            blockshard.fully_shard(layer, semantics=semantics, policy="owner")
        blockshard.fully_shard(model, semantics=semantics, policy="owner")
    groups = muon_param_groups(model)
    views: list[tuple[torch.Tensor, nn.Parameter, tuple]] = []
    if sharded:
        opts = [Muon(groups[0], lr=0.02)]
    else:
        for name, p in model.named_parameters():
            if name in muon_names:
                views += _part_views(p, next((r for g, r in rules.items() if fnmatch.fnmatchcase(name, g)), None))
        opts = [torch.optim.Muon([v for v, _, _ in views], lr=0.02)]
    opts.append(torch.optim.AdamW(groups[1]["params"], lr=1e-3))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(1, 64, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        for v, p, index in views:
            v.grad = p.grad[index]
        for o in opts:
            o.step()
            o.zero_grad()
        model.zero_grad()
    return {k: v.detach().clone() for k, v in blockshard.full_state_dict(model).items()}


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["phi3", "mixtral"])
def test_hugging_face_fused_weights_with_the_documented_parts_train_as_torch_muon_per_part(gloo_w1, kind):
    """Phi-3's ``qkv_proj`` / ``gate_up_proj`` and Mixtral's stacked ``experts.gate_up_proj`` (transformers 5:
    ``[gate; up]`` per expert), with the rules docs/optimizers.md gives: blockshard's Muon (``policy="owner"``,
    W = 1) equals torch's Muon on every part as its own matrix **bitwise**. Control: without the rules
    (Newton-Schulz on each fused matrix whole) the parameters differ by more than 1e-3."""
    with _inproc.single_thread():
        want = _hf_train(kind, sharded=False, parts=True)
        got = _hf_train(kind, sharded=True, parts=True)
        control = _hf_train(kind, sharded=True, parts=False)
    assert sorted(got) == sorted(want)
    assert _max_diff(got, want) == 0.0
    assert _max_diff(control, want) > 1e-3
