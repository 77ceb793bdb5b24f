"""``blockshard.optim.rebind_optimizer`` ([Note: a reused optimizer]): Muon in any of its three forms,
built before or after ``fully_shard``, steps the pieces and equals one process bitwise.

Two gloo thread ranks; a tiny Llama whose MLP matrices ``policy="auto"`` cuts and computes at their
owners at W = 2 (the README's shapes), the rest whole. Reference: ``torch.optim.Muon`` and AdamW on the
unsharded model, one process. Control: torch's Muon handed the pieces as they are (what the
Accelerate plugin did before) refuses them at its first step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the engine tier's thread ranks
import _inproc

import blockshard
from blockshard.optim import Muon, OwnerComputeError, OwnerComputeOptimizer, muon_param_groups, rebind_optimizer
from blockshard.tiny import text_batches, tiny_llama

SHAPES = {"hidden_size": 32, "intermediate_size": 777, "num_hidden_layers": 2}  # auto: MLP at owners at W = 2
STEPS = 3


def _muon(form: str, group: dict):
    if form == "torch":
        return torch.optim.Muon([group], lr=0.02)
    if form == "blockshard":
        return Muon([group], lr=0.02)
    return OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [group])


def _train(rank: int, world: int, variants: list[tuple[str, str, str]]) -> list[dict[str, torch.Tensor]]:
    out = []
    for form, order, policy in variants:
        with _inproc.serial():
            model = tiny_llama(**SHAPES)
        names = {id(p): n for n, p in model.named_parameters()}
        if order == "before":  # Accelerate's order: build, then prepare (which shards)
            muon_group, rest = muon_param_groups(model)
            muon, adamw = _muon(form, muon_group), torch.optim.AdamW([rest], lr=1e-3)
        if world > 1:
            for layer in model.model.layers:
                blockshard.fully_shard(layer, semantics="muon", policy=policy)
            blockshard.fully_shard(model, semantics="muon", policy=policy)
        if order == "after":
            muon_group, rest = muon_param_groups(model)
            muon, adamw = _muon(form, muon_group), torch.optim.AdamW([rest], lr=1e-3)
        muon, adamw = (rebind_optimizer(o, model, names=names) for o in (muon, adamw))
        sched = torch.optim.lr_scheduler.StepLR(muon, step_size=1, gamma=0.5)  # built on what is stepped
        for input_ids, labels in text_batches(STEPS, batch_size=2, seq_len=16):
            model(input_ids=input_ids, labels=labels).loss.backward()
            for opt in (muon, adamw):
                opt.step()
                opt.zero_grad()
            sched.step()
        out.append({k: v.clone() for k, v in blockshard.full_state_dict(model).items()})
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    with _inproc.single_thread():
        return _train(0, 1, [("torch", "after", "auto")])[0]


VARIANTS = {
    "before": [("torch", "before", "auto"), ("blockshard", "before", "auto"), ("owner", "before", "auto")],
    "more": [("torch", "before", "whole"), ("blockshard", "after", "auto"), ("owner", "after", "whole")],
}


@pytest.mark.parametrize("which", [pytest.param(w, marks=pytest.mark.heavy) for w in VARIANTS])  # seconds: make test
def test_every_muon_form_built_before_or_after_sharding_equals_one_process(reference, which):
    results = _inproc.run_ranks(_train, 2, args=(VARIANTS[which],))
    for rank in results:
        for variant, got in zip(VARIANTS[which], rank, strict=True):
            assert sorted(got) == sorted(reference), variant
            diff = max((got[k] - reference[k]).abs().max().item() for k in reference)
            assert diff == 0.0, (variant, diff)


def _muon_before_sharding() -> tuple[nn.Module, torch.optim.Optimizer, dict[int, str]]:
    """A tiny Llama, torch's Muon over its matrices built before sharding (Accelerate's order), the
    model sharded whole with Muon's semantics, and the names of the parameters Muon was built over."""
    with _inproc.serial():
        model = tiny_llama(**SHAPES)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = torch.optim.Muon([muon_param_groups(model)[0]], lr=0.02)
    blockshard.fully_shard(model, semantics="muon")
    return model, muon, names


def _stepped_directly(rank: int, world: int) -> str:
    model, muon, names = _muon_before_sharding()
    wrapper = rebind_optimizer(muon, model, names=names)
    assert isinstance(wrapper, OwnerComputeOptimizer) and wrapper.inner is muon
    input_ids, labels = next(iter(text_batches(1, batch_size=2, seq_len=16)))
    model(input_ids=input_ids, labels=labels).loss.backward()
    with pytest.raises(OwnerComputeError, match="step the optimizer that prepare returned"):
        muon.step()
    wrapper.step()  # the wrapper's step is fine
    return "ok"


def test_the_reused_optimizer_refuses_a_step_of_its_own():
    assert _inproc.run_ranks(_stepped_directly, 2) == ["ok", "ok"]


def _control(rank: int, world: int) -> str:
    model, muon, names = _muon_before_sharding()
    new = dict(model.named_parameters())
    for group in muon.param_groups:  # the pieces as they are: what prepare() did before
        group["params"] = [new[names[id(p)]] for p in group["params"]]
    input_ids, labels = next(iter(text_batches(1, batch_size=2, seq_len=16)))
    model(input_ids=input_ids, labels=labels).loss.backward()
    try:
        muon.step()
    except (ValueError, RuntimeError) as e:  # torch's "must be a 2D matrix" or blockshard's guard
        return type(e).__name__
    return "stepped"


def test_control_torch_muon_on_the_pieces_as_they_are_fails():
    assert "stepped" not in _inproc.run_ranks(_control, 2)


def _stepped_then_rebound(rank: int, world: int) -> str:
    with _inproc.serial():
        model = tiny_llama(**SHAPES)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids, labels = next(iter(text_batches(1, batch_size=2, seq_len=16)))
    model(input_ids=input_ids, labels=labels).loss.backward()
    opt.step()
    blockshard.fully_shard(model, semantics="muon")
    with pytest.raises(OwnerComputeError, match="has stepped already"):
        rebind_optimizer(opt, model, names=names)
    stranger = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert rebind_optimizer(stranger, model) is stranger  # another model's: left alone
    return "ok"


def test_a_stepped_optimizer_cannot_follow_the_pieces():
    assert _inproc.run_ranks(_stepped_then_rebound, 2) == ["ok", "ok"]


# -- checkpoints: [Note: owner-compute state in checkpoints] ----------------------------------------
def _resumable(rank: int, world: int, form: str, policy: str, path: str, phase: str) -> dict[str, torch.Tensor]:
    """``phase="save"``: 2 steps, save, 2 more; ``"load"``: load the checkpoint, the last 2 steps."""
    with _inproc.serial():
        model = tiny_llama(**SHAPES)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_group, rest = muon_param_groups(model)
    muon, adamw = _muon(form, muon_group), torch.optim.AdamW([rest], lr=1e-3)
    for layer in model.model.layers:
        blockshard.fully_shard(layer, semantics="muon", policy=policy)
    blockshard.fully_shard(model, semantics="muon", policy=policy)
    muon, adamw = (rebind_optimizer(o, model, names=names) for o in (muon, adamw))
    batches = list(text_batches(4, batch_size=2, seq_len=16))
    if phase == "load":
        blockshard.load_checkpoint(model, path, [muon, adamw])
        batches = batches[2:]
    for i, (input_ids, labels) in enumerate(batches):
        if phase == "save" and i == 2:
            blockshard.save_checkpoint(model, path, [muon, adamw])
        model(input_ids=input_ids, labels=labels).loss.backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in blockshard.full_state_dict(model).items()}


@pytest.mark.parametrize(
    ("form", "policy"),
    [
        pytest.param("torch", "auto", marks=pytest.mark.heavy),  # seconds each: make test runs them
        pytest.param("blockshard", "auto", marks=pytest.mark.heavy),
        pytest.param("owner", "whole", marks=pytest.mark.heavy),
    ],
)
def test_every_muon_form_resumes_bitwise_at_w2_w1_and_w4(tmp_path, form, policy):
    """Saved at W = 2 after 2 steps; loaded at W = 2, 1 and 4 (DCP reshards the piece-shaped state,
    which then goes to the new owners), the last 2 steps equal the uninterrupted run bitwise."""
    path = str(tmp_path / "ck")
    want = _inproc.run_ranks(_resumable, 2, args=(form, policy, path, "save"))[0]
    for world in (2, 1, 4):
        got = _inproc.run_ranks(_resumable, world, args=(form, policy, path, "load"))[0]
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        assert diff == 0.0, (form, policy, world, diff)


def _elementwise_layout(rank: int, world: int, form: str) -> str:
    with _inproc.serial():
        model = tiny_llama(**SHAPES)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = _muon(form, muon_param_groups(model)[0])
    blockshard.fully_shard(model, semantics="bnb8bit")  # 256-element blocks: matrices cut, no owners
    try:
        rebind_optimizer(muon, model, names=names)
    except OwnerComputeError as e:
        return str(e)
    return "rebound"


@pytest.mark.parametrize("form", ["torch", "blockshard", "owner"])
def test_muon_over_matrices_cut_without_owners_raises_on_every_rank(form):
    """Sharded with semantics that are not Muon's, a cut matrix would be orthogonalized per piece
    (silently wrong): every rank raises, naming the parameter and the semantics to shard with."""
    for msg in _inproc.run_ranks(_elementwise_layout, 2, args=(form,)):
        assert "is cut between ranks" in msg and "semantics='muon'" in msg, msg


def _resumable_dcp(rank: int, world: int, path: str, phase: str) -> dict[str, torch.Tensor]:
    """As :func:`_resumable` (torch's Muon reused, ``auto``), through torch's ``get_state_dict`` /
    ``set_state_dict`` and ``dcp.save`` / ``dcp.load`` (the route blockshard gives them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with _inproc.serial():
        model = tiny_llama(**SHAPES)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_group, rest = muon_param_groups(model)
    opts = [torch.optim.Muon([muon_group], lr=0.02), torch.optim.AdamW([rest], lr=1e-3)]
    for layer in model.model.layers:
        blockshard.fully_shard(layer, semantics="muon")
    blockshard.fully_shard(model, semantics="muon")
    opts = [rebind_optimizer(o, model, names=names) for o in opts]
    batches = list(text_batches(4, batch_size=2, seq_len=16))
    if phase == "load":
        msd, osd = get_state_dict(model, opts)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opts, model_state_dict=state["model"], optim_state_dict=state["optim"])
        batches = batches[2:]
    for i, (input_ids, labels) in enumerate(batches):
        if phase == "save" and i == 2:
            msd, osd = get_state_dict(model, opts)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        model(input_ids=input_ids, labels=labels).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {k: v.clone() for k, v in blockshard.full_state_dict(model).items()}


@pytest.mark.heavy  # seconds: make test runs it
def test_torch_get_and_set_state_dict_of_a_reused_muon_reshard_bitwise(tmp_path):
    path = str(tmp_path / "dcp")
    want = _inproc.run_ranks(_resumable_dcp, 2, args=(path, "save"))[0]
    for world in (2, 1):
        got = _inproc.run_ranks(_resumable_dcp, world, args=(path, "load"))[0]
        assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0, world


def _dropped(rank: int, world: int) -> list:
    import weakref

    model, muon, names = _muon_before_sharding()
    wrapper = rebind_optimizer(muon, model, names=names)
    assert rebind_optimizer(muon, model) is muon  # prepared again: already reused, left as it is
    return [weakref.ref(muon), weakref.ref(wrapper)]


def test_a_reused_optimizer_and_its_wrapper_are_freed_with_the_model():
    """(Collected in the test thread: a gc.collect() in one rank thread returns at once while
    another thread's runs.)"""
    import gc

    refs = _inproc.run_ranks(_dropped, 2)
    gc.collect()
    assert [[r() is None for r in rank] for rank in refs] == [[True, True], [True, True]]


class _TwoMatrices(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
        self.norm = torch.nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(self.a(x)))


def _holding_none(rank: int, world: int, path: str) -> tuple[int, bool]:
    with _inproc.serial():
        torch.manual_seed(0)
        model = _TwoMatrices()
    blockshard.fully_shard(model, semantics="muon", policy="whole")
    group = muon_param_groups(model)[0]  # after sharding: ranks 2 and 3 hold neither matrix
    muon = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), [group])
    model(torch.ones(2, 64)).sum().backward()
    muon.step()
    blockshard.save_checkpoint(model, path, [muon])
    blockshard.load_checkpoint(model, path, [muon])
    return len(group["params"]), muon.process_group is None


def test_ranks_whose_owner_compute_optimizer_holds_nothing_checkpoint_with_the_others(tmp_path):
    """A rank may hold none of Muon's matrices (whole placement), so its OwnerComputeOptimizer has
    no process group: nothing is owner-computed, so no rank gathers state kinds (it hung before)."""
    got = _inproc.run_ranks(_holding_none, 4, args=(str(tmp_path / "ck"),), timeout=60)
    assert [n for n, _ in got].count(0) >= 1 and any(none for _, none in got), got
