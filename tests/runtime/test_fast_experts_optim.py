"""Stacked experts under Muon (issue 22, item 3), in-process, on a tiny Mixtral built in code.

* ``muon_param_groups`` offers the stacked ``(E, m, n)`` experts to Muon ([Note: experts under
  Muon] in blockshard/optim/_semantics.py), the same names before and after sharding and on every
  rank; ``experts=False`` leaves them to AdamW.
* ``blockshard.optim.Muon`` and ``OwnerComputeOptimizer`` (around ``torch.optim.Muon``) step them per
  expert: **bitwise** equal to ``torch.optim.Muon`` on every expert's ``(m, n)`` matrix on one
  process, unsharded and at W = 2 (threads, every rank the whole batch, ``policy`` ``owner`` and
  ``whole``). Control: Muon on the stack flattened to ``(E * m, n)`` differs by more than 1e-3.
* Hand-built groups whose ``param_names`` do not fit raise ``OwnerComputeError`` naming the parameter.
"""

from __future__ import annotations

import _inproc
import pytest
import torch
from _experts import EXPERTS, per_expert_muon
from torch import nn

import blockshard
from blockshard._errors import SemanticsError
from blockshard.optim import Muon, OwnerComputeError, OwnerComputeOptimizer, muon_param_groups, optimizer_semantics

# in-process ranks: a hang fails the test, never the run; heavy: building the tiny Mixtral (transformers'
# lazy import of its modeling) costs seconds, so `make test-fast` leaves the file to `make test`
pytestmark = [pytest.mark.timeout(60), pytest.mark.heavy]

STEPS, LR = 2, 0.02
CONTROL_MIN = 1e-3  # Muon on the flattened stack against per expert (measured 1.5e-2 after 2 steps)


def _mixtral() -> nn.Module:
    """One decoder layer, 3 experts: gate_up_proj (3, 48, 16), down_proj (3, 16, 24)."""
    from blockshard._tiny import tiny_mixtral

    return tiny_mixtral(0)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 8), generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, opts: list, before_step=None) -> dict[str, torch.Tensor]:
    for ids in _batches():
        model(input_ids=ids, labels=ids).loss.backward()
        if before_step is not None:
            before_step()
        for o in opts:
            o.step()
            o.zero_grad()
    return {k: v.detach().clone() for k, v in blockshard.full_state_dict(model).items()}


def _reference(per_expert: bool = True) -> dict[str, torch.Tensor]:
    """One process, torch's own Muon on every expert's 2-D matrix (_experts.py); ``per_expert=False``,
    the control: on the stack flattened to ``(E * m, n)``."""
    model = _mixtral()
    opts, grads_to_views = per_expert_muon(model, LR, 1e-3, per_expert)
    return _train(model, opts, grads_to_views)


@pytest.fixture(scope="module")
def reference(gloo_w1) -> dict[str, torch.Tensor]:
    return _reference()


def _diff(got: dict, want: dict) -> list[str]:
    return [k for k in want if not torch.equal(got[k], want[k])]


def test_muon_param_groups_offers_the_stacked_experts_and_experts_false_keeps_them_out():
    model = _mixtral()
    muon, rest = muon_param_groups(model)
    assert set(EXPERTS) <= set(muon["param_names"]) and not set(EXPERTS) & set(rest["param_names"])
    assert "model.embed_tokens.weight" in rest["param_names"] and "lm_head.weight" in rest["param_names"]
    old_muon, old_rest = muon_param_groups(model, experts=False)
    assert old_muon["param_names"] == [n for n in muon["param_names"] if n not in EXPERTS]
    assert set(EXPERTS) <= set(old_rest["param_names"])
    conv = nn.Sequential(nn.Conv1d(4, 6, 3), nn.Linear(6, 6))  # a 3-D weight that is no expert stack
    assert muon_param_groups(conv)[0]["param_names"] == ["1.weight"]
    with pytest.raises(SemanticsError, match=r"experts='auto'.*must be True or False"):
        muon_param_groups(model, experts="auto")  # type: ignore[arg-type]
    with pytest.raises(SemanticsError, match=r"model must be a torch.nn.Module"):
        muon_param_groups(list(model.parameters()))  # type: ignore[arg-type]


def test_control_muon_on_the_flattened_stack_is_another_update(reference):
    flat = _reference(per_expert=False)
    worst = max((flat[k] - reference[k]).abs().max().item() for k in EXPERTS)
    assert worst > CONTROL_MIN, worst


@pytest.mark.parametrize("wrap", ["muon", "owner_compute"])
def test_unsharded_per_expert_is_bitwise_torch_muon_on_each_matrix(reference, wrap):
    model = _mixtral()
    muon_group, rest = muon_param_groups(model)
    if wrap == "muon":
        opt = Muon([muon_group], lr=LR)
    else:
        opt = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=LR), [muon_group])
        assert all(p.ndim == 2 for g in opt.inner.param_groups for p in g["params"])
    got = _train(model, [opt, torch.optim.AdamW([rest], lr=1e-3)])
    assert _diff(got, reference) == []


def _sharded_mixtral(policy: str) -> tuple[nn.Module, list[str]]:
    """Per layer, then the root, with the semantics of the param_groups taken before sharding."""
    with _inproc.serial():
        model = _mixtral()
    before = muon_param_groups(model)
    semantics = optimizer_semantics(before)  # matched by identity: this model's parameters
    for layer in model.model.layers:
        blockshard.fully_shard(layer, semantics=semantics, policy=policy)
    blockshard.fully_shard(model, semantics=semantics, policy=policy)
    return model, before[0]["param_names"]


def _w2(rank: int, world: int, policy: str) -> dict:
    out: dict = {}
    for wrap in ("muon", "owner_compute"):
        model, out["before"] = _sharded_mixtral(policy)
        out["owner"] = sorted(blockshard.runtime.owner_plan(model))
        muon_group, rest = muon_param_groups(model)
        out["after"] = muon_group["param_names"]
        if wrap == "muon":
            opt = Muon([muon_group], lr=LR)
        else:
            opt = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=LR), [muon_group])
        out[wrap] = _train(model, [opt, torch.optim.AdamW([rest], lr=1e-3)])
    return out


@pytest.mark.parametrize("policy", ["owner", "whole"])
def test_sharded_at_w2_both_optimizers_are_bitwise_one_process(reference, policy):
    outs = _inproc.run_ranks(_w2, 2, args=(policy,))
    for out in outs:
        assert set(EXPERTS) <= set(out["before"])
        assert out["after"] == [n for n in out["before"] if n in out["after"]]  # same order, same choice
        for wrap in ("muon", "owner_compute"):
            assert _diff(out[wrap], reference) == [], (policy, wrap)
    if policy == "owner":  # the experts' storage is cut: at least one expert matrix is computed at its owner
        assert all(set(EXPERTS) <= set(out["owner"]) for out in outs)
        assert all(out["after"] == out["before"] for out in outs)  # every rank passes its (maybe empty) piece
    else:  # whole experts on each rank: a rank lists a stack when it holds some of its experts
        assert set(EXPERTS) <= {n for out in outs for n in out["after"]}


def _w2_rows(rank: int, world: int) -> str:
    with _inproc.serial():
        model = _mixtral()
    blockshard.fully_shard(model, semantics="elementwise", policy="whole")  # experts cut anywhere
    try:
        muon_param_groups(model)
    except SemanticsError as exc:
        return str(exc)
    return "no error"


def test_a_piece_that_cuts_an_expert_without_an_owner_is_refused():
    msgs = _inproc.run_ranks(_w2_rows, 2)
    assert any("each expert's" in m and "experts=False" in m for m in msgs), msgs


def test_hand_built_groups_with_bad_param_names_name_the_parameter(gloo_w1):
    model = _mixtral()
    blockshard.fully_shard(model, semantics=optimizer_semantics(muon_param_groups(model)), policy="whole")
    muon_group, _ = muon_param_groups(model)
    names, params = muon_group["param_names"], muon_group["params"]
    for make in (lambda g: Muon([g], lr=LR), lambda g: OwnerComputeOptimizer(torch.optim.Muon, [g])):
        with pytest.raises(OwnerComputeError, match=r"\['params'\]\[0\] is a tensor of shape .*param_names"):
            make({"params": params})  # no names: used to be a bare KeyError in Muon's step
        with pytest.raises(OwnerComputeError, match=rf"{len(params)} params but {len(params) - 1} param_names: .*"
                           rf"\[{len(params) - 1}\] \(shape .*\) has no name"):  # fmt: skip
            make({"params": params, "param_names": names[:-1]})
        with pytest.raises(OwnerComputeError, match=r"parameter 'model.not_there' .* names another tensor"):
            make({"params": params[:1], "param_names": ["model.not_there"]})
        with pytest.raises(OwnerComputeError, match=rf"parameter {names[1]!r} .* is the piece of .*q_proj"):
            make({"params": params[:2], "param_names": [names[1], names[0]]})  # swapped
        with pytest.raises(OwnerComputeError, match=r"'param_names'\]\[0\] is 7 \(int\)"):
            make({"params": params[:1], "param_names": [7]})
        with pytest.raises(OwnerComputeError, match=r"process_group='world' is a str"):
            Muon([muon_group], process_group="world")


def test_muon_refuses_a_stack_whose_units_are_not_per_expert(gloo_w1):
    model = nn.Sequential(nn.Conv1d(4, 6, 3))  # 3-D, not an expert container: `matrix` keeps it whole
    blockshard.fully_shard(model, semantics="matrix", policy="whole")
    with pytest.raises(OwnerComputeError, match=r"'0.weight' has global shape \(6, 4, 3\).*not one expert's 4 x 3"):
        Muon(model.named_parameters())
