"""The first-step optimizer checks in-process ([Note: first-step optimizer checks] in
blockshard/runtime/core/_optim_checks.py): the judgement on the ranks' rows as a pure function,
the state-kind rules against bitsandbytes' and torchao's own choice, ``param_groups_by`` and
``global_shape``, and the two-optimizer check at W = 1. The spawned W = 2 scenarios (each check
tripped on every rank, with controls bitwise equal to one process) are in test_optim_checks.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import blockshard
from blockshard._errors import OptimizerSetupError, ShardingError
from blockshard._tiny import OddMLP, mlp_batches
from blockshard.runtime.core import _optim_checks as checks
from blockshard.runtime.core._optim_facts import hyper_text, state_kind

pytestmark = pytest.mark.timeout(60)


def _row(holds: bool, piece_ndim: int, global_ndim: int, *classes: int) -> checks._Row:
    return checks._Row(holds, 0, piece_ndim, global_ndim, (None, None), 10, classes)


DECAY, NO_DECAY, MUON = 1, 2, 3
TEXTS = {DECAY: ("AdamW (weight_decay=0.1)", True), NO_DECAY: ("AdamW (weight_decay=0.0)", True)}
WITH_MUON = {**TEXTS, MUON: ("Muon", False)}


def test_a_choice_by_the_pieces_ndim_is_named_with_the_recipe():
    rows = {"w1": _row(True, 2, 2, DECAY), "w2": _row(True, 1, 2, NO_DECAY), "b": _row(True, 1, 1, NO_DECAY)}
    with pytest.raises(OptimizerSetupError, match=r"follow the ndim of this rank's pieces.*'w2'") as e:
        checks._judge_across([(rows, TEXTS)])
    assert "blockshard.param_groups_by" in str(e.value) and "global_shape" in str(e.value)


def test_a_choice_by_the_global_ndim_or_by_name_passes():
    by_global = {"w1": _row(True, 2, 2, DECAY), "w2": _row(True, 1, 2, DECAY), "b": _row(True, 1, 1, NO_DECAY)}
    by_name = {**by_global, "emb": _row(True, 2, 2, NO_DECAY)}  # a choice by name: not along the pieces' ndim
    # whole-unit optimizers are left out of the ndim judgement (Muon's matrices are whole on their owners)
    muon = {"w1": _row(True, 2, 2, MUON), "emb": _row(True, 1, 2, NO_DECAY), "b": _row(True, 1, 1, NO_DECAY)}
    for rows in (by_global, by_name, muon):
        checks._judge_across([(rows, WITH_MUON if rows is muon else TEXTS)])


def test_ranks_that_disagree_raise_and_empty_pieces_do_not_count():
    r0 = {"w": _row(True, 2, 2, DECAY), "v": _row(False, 1, 2, NO_DECAY)}
    r1 = {"w": _row(True, 2, 2), "v": _row(True, 2, 2, DECAY)}
    with pytest.raises(
        OptimizerSetupError, match=r"'w': rank 0: in AdamW \(weight_decay=0.1\); rank 1: in no optimizer"
    ):
        checks._judge_across([(r0, TEXTS), (r1, TEXTS)])
    r1["w"] = _row(True, 2, 2, DECAY)  # 'v' differs only on rank 0, which holds none of it
    checks._judge_across([(r0, TEXTS), (r1, TEXTS)])


def _bnb(p: nn.Parameter) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit([p], lr=1e-3)


def _ao(p: nn.Parameter) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit

    return AdamW8bit([p], lr=1e-3)


@pytest.mark.parametrize("make", [_bnb, pytest.param(_ao, marks=pytest.mark.heavy)])  # torchao compiles: 25 s
def test_state_kind_follows_bitsandbytes_and_torchao_own_choice(make):
    for numel in (255, 3072, 4096, 6144, 6145):
        p = nn.Parameter(torch.zeros(numel))
        p.grad = torch.ones(numel)
        for opt in (make(p),):
            predicted = state_kind(opt, 0, 0, numel)
            opt.step()
            state = opt.state[p]
            first = state.get("state1", state.get("exp_avg"))
            real = "fp32" if type(first) is torch.Tensor and first.dtype == torch.float32 else "8-bit"
            assert predicted == real, (type(opt).__module__, numel, predicted, real)
    assert state_kind(torch.optim.AdamW([torch.zeros(1)]), 0, 0, 10) is None


def test_hyper_text_leaves_out_params_and_scheduler_copies():
    group = {"params": [1], "param_names": ["a"], "lr": torch.tensor(0.5), "initial_lr": 0.5, "betas": (0.9, 0.99)}
    assert hyper_text(group) == "betas=(0.9, 0.99), lr=0.5"


def test_param_groups_by_chooses_by_global_shape_and_names_unknown_keys(gloo_w1):
    model = OddMLP()
    blockshard.fully_shard(model)
    groups = blockshard.param_groups_by(
        model, lambda n, s: "decay" if len(s) >= 2 else "no", {"decay": {"weight_decay": 0.1}, "no": {}}
    )
    assert [g.get("weight_decay") for g in groups] == [0.1, None]
    shapes = dict(model.named_parameters())
    assert all(len(blockshard.global_shape(shapes[n])) >= 2 for n in groups[0]["param_names"])
    assert all(tuple(p.global_shape) == tuple(blockshard.global_shape(p)) for p in model.parameters())
    with pytest.raises(ShardingError, match=r"returned 'x', which is not among the options' keys \['a'\]"):
        blockshard.param_groups_by(model, lambda n, s: "x", {"a": {}})


def test_two_optimizers_over_one_parameter_raise_at_the_first_one_s_next_step(gloo_w1):
    model = OddMLP()
    blockshard.fully_shard(model)
    first, second = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = mlp_batches(1, 4)[0]
    ((model(x) - y) ** 2).mean().backward()
    first.step()
    second.step()  # its own first step: notes that the AdamW holds the same pieces
    with pytest.raises(OptimizerSetupError, match=r"AdamW and SGD both step parameter"):
        first.step()


def test_a_replaced_optimizer_is_not_a_second_one(gloo_w1):
    model = OddMLP()
    blockshard.fully_shard(model)
    old = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = mlp_batches(1, 4)[0]
    for opt in (old, torch.optim.SGD(model.parameters(), lr=1e-3)):  # phase 1, then phase 2 (old never steps again)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_the_switch_is_validated(monkeypatch):
    monkeypatch.setenv(checks.CHECKS_ENV, "off")
    with pytest.raises(OptimizerSetupError, match="BLOCKSHARD_OPTIMIZER_CHECKS='off' must be 1"):
        checks.checks_on()
    monkeypatch.setenv(checks.CHECKS_ENV, "0")
    assert not checks.checks_on()


def test_a_whole_matrix_optimizer_that_steps_nothing_anywhere_raises():
    rows = {"w": _row(True, 2, 2, DECAY), "e": _row(False, 1, 2, MUON)}  # Muon holds only an empty piece
    with pytest.raises(OptimizerSetupError, match=r"Muon holds no element of any parameter on any rank"):
        checks._judge_across([(rows, WITH_MUON)])
    rows["e"] = _row(True, 2, 2, MUON)  # control: some rank holds elements of its matrix
    checks._judge_across([(rows, WITH_MUON)])


def test_strict_names_a_trainable_parameter_no_optimizer_steps(monkeypatch):
    rows = {"w": _row(True, 2, 2, DECAY), "b": _row(True, 1, 1)}
    checks._judge_across([(rows, TEXTS)])  # not strict: a setup one process accepts
    monkeypatch.setenv(checks.STRICT_ENV, "1")
    with pytest.raises(OptimizerSetupError, match=r"no optimizer steps the trainable parameter 'b'"):
        checks._judge_across([(rows, TEXTS)])
