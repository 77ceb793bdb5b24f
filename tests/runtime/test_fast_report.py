"""``blockshard.report`` ([Note: run report] in runtime/_report/_model.py) on the ragged engine.

Threaded gloo ranks at W = 2, 3, 4 (one run each, a fraction of a second): a model of odd shapes,
Muon-like matrices owner-computed in the layers, one parameter in ``ignored_params`` and an AdamW
that leaves ``head.bias`` out. Checked: every group's bytes held per rank equal the engine's buffers
(``blockshard.local_buffers``, this rank's) and what the planner predicts from shapes alone
(``plan_model``: segment, real elements per rank, padding, every parameter's piece); the optimizer's
state adds up to the whole tensors; the control ``head.bias`` is listed as not stepped and the ignored
parameter as replicated, with why. Then the JSON round trip and ``blockshard report`` on a saved
report (tables, ``--json``, ``--plot``) and on bad files (exit 2, one line).
"""

from __future__ import annotations

import json

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.cli import main
from blockshard.planner import plan_model
from blockshard.runtime import Report, local_buffers
from blockshard.semantics import TensorSpec

pytestmark = pytest.mark.timeout(60)

SEMANTICS = {"*weight": "matrix"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(13, 29), nn.GELU(), nn.Linear(29, 13)) for _ in range(2)
            )
            self.head = nn.Linear(13, 5)
            self.extra = nn.Parameter(torch.randn(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x) + self.extra[:5]


def _run(rank: int, world: int) -> dict:
    with _inproc.serial():
        model = Net()
    for b in model.blocks:
        blockshard.fully_shard(b, semantics=SEMANTICS, policy="owner")
    blockshard.fully_shard(model, semantics=SEMANTICS, policy="owner", ignored_params={model.extra})
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "head.bias"], lr=1e-2)
    model(torch.ones(3, 13)).sum().backward()
    opt.step()
    rep = blockshard.report(model, optimizers=[opt])
    local = {k: v["local"].numel() * v["local"].element_size() for k, v in local_buffers(model).items()}
    return {"report": rep, "local": local}


def _specs() -> list[TensorSpec]:
    out = []
    for name, p in Net().named_parameters():
        if name != "extra":
            group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else None
            out.append(TensorSpec(name=name, shape=tuple(p.shape), dtype=p.dtype, group=group))
    return out


# W = 2 in the fast tier; 3 and 4 (and the plot: matplotlib's import) in the heavy one
@pytest.fixture(
    scope="module", params=[2, pytest.param(3, marks=pytest.mark.heavy), pytest.param(4, marks=pytest.mark.heavy)]
)
def world(request):
    return request.param, _inproc.run_ranks(_run, request.param)


def test_bytes_per_rank_equal_the_buffers_and_the_plan(world):
    W, ranks = world
    rep: Report = ranks[0]["report"]
    assert all(r["report"] == rep for r in ranks)  # every rank returns the same report
    assert rep.world_size == W and rep.engine == "blockshard"
    plan = plan_model(_specs(), W, semantics=SEMANTICS, policy="owner")
    assert {g.name for g in rep.groups} == {g.name for g in plan.groups} == set(ranks[0]["local"])
    for g in rep.groups:
        layout = plan.group(g.name)
        assert g.held_bytes == tuple(r["local"][g.name] for r in ranks), g.name  # the engine's buffers
        assert g.held_bytes == (layout.segment_numel * 4,) * W, g.name  # the planner's segment
        assert g.data_bytes == tuple(4 * n for n in layout.rank_loads()), g.name
        assert g.padding_bytes == 4 * (layout.padded_numel - layout.total_numel), g.name
        assert g.total_bytes == 4 * layout.total_numel
    by_name = {p.name: p for p in rep.params}
    for layout in plan.groups:
        for i, t in enumerate(layout.tensors):
            held = [sum(p.numel for p in layout.pieces(r) if p.index == i) * 4 for r in range(W)]
            assert by_name[t.name].held_bytes == tuple(held), t.name
            assert by_name[t.name].semantics == t.semantics
    assert sum(p.padding_bytes or 0 for p in rep.params if p.sharded) == sum(g.padding_bytes for g in rep.groups)
    owned = [p for p in rep.params if p.policy == "owner"]
    if W > 2:  # a matrix cut across ranks is computed at an owner, which the report names
        assert owned and all(p.owner_ranks and p.compute_unit_numel == p.shape[0] * p.shape[1] for p in owned)
    assert rep.held_bytes == tuple(sum(g.held_bytes[r] for g in rep.groups) + 7 * 4 for r in range(W))
    assert rep.total_bytes == 4 * sum(p.numel() for p in Net().parameters())


def test_replicated_and_not_stepped(world):
    W, ranks = world
    rep: Report = ranks[0]["report"]
    (extra,) = rep.replicated
    assert extra.name == "extra" and "ignored_params" in extra.note and extra.held_bytes == (28,) * W
    assert rep.not_stepped == ("head.bias",)  # the control: left out of the optimizer
    (opt,) = rep.optimizers
    assert opt.name == "AdamW" and "head.bias" not in opt.steps and "blocks.0.0.weight" in opt.steps
    exp_avg = {s.param: s for s in opt.states if s.key == "exp_avg"}
    full = dict(Net().named_parameters())
    for name, s in exp_avg.items():  # the pieces' state adds up to the whole tensor, in fp32
        copies = W if name == "extra" else 1  # replicated: its state too, whole on every rank
        assert sum(s.bytes) == copies * full[name].numel() * 4 and s.kind == "fp32", name
        assert s.as_one_process is None  # AdamW keeps fp32 whatever the size: nothing to compare


def test_json_round_trip_and_cli(world, tmp_path, capsys):
    W, ranks = world
    rep: Report = ranks[0]["report"]
    data = json.loads(json.dumps(rep.to_json()))
    assert Report.from_json(data) == rep
    path = tmp_path / "report.json"
    path.write_text(json.dumps(rep.to_json()))
    if W == 2:
        assert main(["report", str(path)]) == 0
        out = capsys.readouterr().out
        assert "blocks.0.0.weight" in out and "head.bias" in out and "replicated" in out
        assert main(["report", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == rep.to_json()
    if W == 4:
        png = tmp_path / "bytes.png"
        assert main(["report", str(path), "--json", "--plot", str(png)]) == 0
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("content", "match"),
    [("not json", "is not JSON"), ('{"format": 99}', "format=99"), ('{"format": 1}', "malformed")],
)
def test_cli_bad_file_is_one_line_exit_2(tmp_path, capsys, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("blockshard report: error:") and match in err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_unsharded_model_is_all_replicated():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    rep = blockshard.report(model, optimizers=[opt])
    assert rep.world_size == 1 and rep.engine == "none" and not rep.groups
    assert [(p.name, p.note) for p in rep.replicated] == [
        ("weight", "not under any fully_shard"),
        ("bias", "not under any fully_shard"),
    ]
    assert rep.not_stepped == ("bias",) and rep.held_max_over_ideal == 1.0
    assert blockshard.report(model).not_stepped == ()  # no optimizers given: nothing claimed
