"""``blockshard.optim.MuonWithAdamW`` ([Note: Muon beside AdamW]): torch's Muon and AdamW as one
optimizer, bitwise the two run side by side; its state dict round-trips; bad groups are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from blockshard import BlockshardError
from blockshard.optim import MuonWithAdamW, muon_param_groups


def _model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _train(model: nn.Module, opt: torch.optim.Optimizer | list, steps: int = 3) -> None:
    opts = opt if isinstance(opt, list) else [opt]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 11, (4, 5), generator=g)
        (model(ids) ** 2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()


def _both(model: nn.Module) -> MuonWithAdamW:
    return MuonWithAdamW(muon_param_groups(model), muon={"lr": 0.02}, adamw={"lr": 1e-3, "weight_decay": 0.05})


def test_bitwise_torch_muon_and_adamw_side_by_side():
    ours, ref = _model(), _model()
    _train(ours, _both(ours))
    muon_group, rest = muon_param_groups(ref)
    assert len(muon_group["params"]) == 2 and len(rest["params"]) == 5  # the Linear weights; the rest AdamW
    _train(ref, [torch.optim.Muon([muon_group], lr=0.02), torch.optim.AdamW([rest], lr=1e-3, weight_decay=0.05)])
    for (n, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_state_dict_round_trip_continues_bitwise():
    a, b = _model(), _model()
    opt_a = _both(a)
    _train(a, opt_a, steps=2)
    b.load_state_dict(a.state_dict())
    opt_b = _both(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch loads a live state dict's tensors as they are
    assert opt_b.blockshard_group_semantics(0) == "matrix" and opt_b.blockshard_group_semantics(1) == "elementwise"
    _train(a, opt_a, steps=1)
    _train(b, opt_b, steps=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_bad_groups_and_arguments_are_refused_by_name():
    m = _model()
    with pytest.raises(BlockshardError, match=r"param_group 0 is marked use_muon=None.*use_muon=True"):
        MuonWithAdamW([{"params": list(m.parameters())}])
    with pytest.raises(BlockshardError, match=r"use_muon=True, optimizer='adamw'.*must agree"):
        MuonWithAdamW([{"params": [m[1].weight], "use_muon": True, "optimizer": "adamw"}])
    with pytest.raises(BlockshardError, match="muon="):
        MuonWithAdamW([{"params": [m[1].weight], "use_muon": True}], muon={"betas": (0.9, 0.95)})
    with pytest.raises(BlockshardError, match="no param_groups"):
        MuonWithAdamW([])


def test_for_model_splits_any_param_groups_as_muon_param_groups_does():
    """The HF Trainer's ``optimizer_cls_and_kwargs`` builds ``cls(its_groups, **kwargs)`` for an Optimizer
    subclass (anything else it treats as a factory): ``for_model`` gives such a subclass, which splits the
    Trainer's weight-decay groups into Muon's matrices and AdamW's rest, keeping each group's keys."""
    ours, ref = _model(), _model()
    cls = MuonWithAdamW.for_model(ours)
    assert issubclass(cls, torch.optim.Optimizer) and cls.__name__ == "MuonWithAdamW"
    decay = [p for n, p in ours.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in ours.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]
    opt = cls(groups, muon={"lr": 0.02}, adamw={"lr": 1e-3})
    assert [(g["use_muon"], len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == [
        (True, 2, 0.05),  # the Linear weights
        (False, 2, 0.05),  # the embedding and the norm's weight
        (False, 3, 0.0),  # the biases
    ]
    _train(ours, opt)
    muon_group, other = muon_param_groups(ref)
    w = {id(p) for n, p in ref.named_parameters() if n.endswith("weight")}
    adamw_decay = [p for p in other["params"] if id(p) in w]
    adamw_rest = [p for p in other["params"] if id(p) not in w]
    _train(
        ref,
        [
            torch.optim.Muon(muon_group["params"], lr=0.02, weight_decay=0.05),
            torch.optim.AdamW(
                [{"params": adamw_decay, "weight_decay": 0.05}, {"params": adamw_rest, "weight_decay": 0.0}], lr=1e-3
            ),
        ],
    )
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters(), strict=True))


def test_zero3_placeholders_are_chosen_and_built_by_their_whole_shape():
    """Under DeepSpeed ZeRO-3 / ``deepspeed.zero.Init`` every parameter is an empty 1-D placeholder
    carrying its shape as ``ds_shape`` (the state DeepSpeed leaves it in; the launched Trainer test
    runs the real thing). ``muon_param_groups`` and ``MuonWithAdamW.for_model`` choose by that shape,
    and ``MuonWithAdamW`` builds over the placeholders, its groups holding them. Control: by their own
    1-D shapes no placeholder would go to Muon, and torch's Muon refuses them."""
    whole, model = _model(), _model()
    want = muon_param_groups(whole)[0]["param_names"]
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    groups = muon_param_groups(model)
    assert groups[0]["param_names"] == want and want  # the Linear weights, by ds_shape
    assert all(p.dim() == 1 for p in groups[0]["params"])  # control: by their own shapes, none is a matrix
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        torch.optim.Muon(groups[0]["params"], lr=0.02)
    opt = MuonWithAdamW.for_model(model)(list(model.parameters()), muon={"lr": 0.02})
    muon = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert [id(p) for p in muon] == [id(p) for p in groups[0]["params"]]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
