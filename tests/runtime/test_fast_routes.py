"""The torch routes ([Note: torch routes] in blockshard/runtime/routes/_route.py; issue 21, item 3):
``fully_shard`` installs them through one function that checks the shape of what each replaces,
raises ``TorchRouteError`` naming the route and the torch version when it differs (a deliberately
changed torch function below), can be turned off (``BLOCKSHARD_TORCH_ROUTES``) and undone
(torch's functions are its own objects again). Controls: with the route off, torch's
``clip_grad_norm_`` on sharded pieces returns the local norm, and the routed call the global one."""

from __future__ import annotations

import re
import types

import _inproc
import pytest
import torch
import torch.distributed.checkpoint.state_dict as dsd
import torch.distributed.fsdp._fully_shard._fully_shard as fsdp_impl
import torch.nn.utils.clip_grad as torch_clip
from torch import nn

import blockshard
from blockshard import TorchRouteError
from blockshard.runtime.routes import ROUTES, ROUTES_ENV, installed_torch_routes

pytestmark = pytest.mark.timeout(60)

_DSD = ("_get_model_state_dict", "_get_optim_state_dict", "_load_optim_state_dict", "_get_fqns")


def _applying() -> list:
    """The routes that apply now: the torch routes, and the peft route once this process imported
    peft (tests/quantized/test_fast_peft_adapters.py tests it)."""
    return [r for r in ROUTES if r.applies()]


@pytest.fixture(autouse=True)
def _routes_restored(gloo_w1, monkeypatch):
    """Every test starts and ends with the routes as the rest of the suite expects them."""
    monkeypatch.delenv(ROUTES_ENV, raising=False)
    blockshard.uninstall_torch_routes()
    yield
    monkeypatch.undo()
    blockshard.uninstall_torch_routes()
    blockshard.install_torch_routes()


def _torch_objects() -> dict[str, object]:
    """What the routes change: the objects themselves, compared by identity."""
    return {
        "clip cell": torch_clip.clip_grad_norm_.__closure__[0].cell_contents,
        "forward method code": fsdp_impl.register_fsdp_forward_method.__code__,
        "forward method namespace": "_blockshard_forward_method_route" in vars(fsdp_impl),
        **{name: getattr(dsd, name) for name in _DSD},
    }


def test_fully_shard_installs_every_route_and_uninstall_restores_torchs_own_objects():
    before = _torch_objects()
    assert before["clip cell"] is torch_clip.clip_grad_norm_.__wrapped__  # torch's implementation
    blockshard.fully_shard(nn.Linear(3, 2))
    assert installed_torch_routes() == tuple(r.name for r in _applying())
    during = _torch_objects()
    assert all(during[k] is not before[k] for k in before if k != "forward method namespace")
    blockshard.fully_shard(nn.Linear(3, 2))  # idempotent
    assert _torch_objects() == during
    assert blockshard.uninstall_torch_routes() == tuple(reversed([r.name for r in _applying()]))
    after = _torch_objects()
    assert all(after[k] is before[k] for k in before) and installed_torch_routes() == ()


def _local_and_routed_norms() -> tuple[float, float, float]:
    with _inproc.serial():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    blockshard.fully_shard(model[0])
    blockshard.fully_shard(model)
    model(torch.randn(4, 5)).square().sum().backward()
    routed = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    mine = blockshard.clip_grad_norm_(model, 1e9).item()
    local = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    return routed, mine, local


def _with_routes_off(rank: int, world: int) -> tuple[tuple[str, ...], float, float, float]:
    norms = _local_and_routed_norms()  # shards the model first
    return (installed_torch_routes(), *norms)


def test_the_routes_can_be_turned_off_and_then_torch_gives_the_local_norm(monkeypatch):
    monkeypatch.setenv(ROUTES_ENV, "none")
    got = _inproc.run_ranks(_with_routes_off, 2)
    for installed, torch_norm, global_norm, local in got:
        assert installed == () and torch_norm == pytest.approx(local)  # torch's own: this rank's pieces
        assert torch_norm != pytest.approx(global_norm)  # which is what the route is for
    monkeypatch.setenv(ROUTES_ENV, "all")
    got = _inproc.run_ranks(_with_routes_off, 2)
    for installed, torch_norm, global_norm, _ in got:  # the control: routed, torch's call is the global norm
        assert len(installed) == len(_applying()) and torch_norm == pytest.approx(global_norm, rel=1e-6)


def test_a_comma_list_keeps_some_routes_and_an_unknown_name_is_refused(monkeypatch):
    monkeypatch.setenv(ROUTES_ENV, "clip_grad_norm_, state_dict")
    blockshard.fully_shard(nn.Linear(3, 2))
    assert installed_torch_routes() == ("clip_grad_norm_", "state_dict")
    monkeypatch.setenv(ROUTES_ENV, "clip")
    with pytest.raises(TorchRouteError, match=r"BLOCKSHARD_TORCH_ROUTES='clip' names \['clip'\], which are no routes"):
        blockshard.fully_shard(nn.Linear(3, 2))


def _closure_function():
    hidden = 1

    def register_fsdp_forward_method(module, method_name):
        return hidden

    return register_fsdp_forward_method


@pytest.mark.parametrize(
    ("route", "change", "text"),
    [
        (
            "state_dict",
            lambda mp: mp.setattr(dsd, "_get_optim_state_dict", lambda model, info: {}),
            r"_get_optim_state_dict takes \('model', 'info'\), the route was written for \('model', 'optimizers', 'info'\)",
        ),
        (
            "clip_grad_norm_",
            lambda mp: mp.setattr(torch_clip, "clip_grad_norm_", lambda parameters, max_norm: None),
            r"torch.nn.utils.clip_grad_norm_ is not torch.nn.utils.clip_grad.clip_grad_norm_",
        ),
        (
            "register_fsdp_forward_method",
            lambda mp: mp.setattr(fsdp_impl, "register_fsdp_forward_method", _closure_function()),
            r"register_fsdp_forward_method is a closure",
        ),
    ],
)
def test_a_changed_torch_function_is_refused_by_name_and_nothing_is_installed(monkeypatch, route, change, text):
    change(monkeypatch)
    before = {name: getattr(dsd, name) for name in _DSD}
    with pytest.raises(
        TorchRouteError, match=rf"torch route {route!r} .* does not fit torch {re.escape(torch.__version__)}: "
    ):
        blockshard.fully_shard(nn.Linear(3, 2))
    with pytest.raises(TorchRouteError, match=text):
        blockshard.install_torch_routes()
    assert installed_torch_routes() == () and {name: getattr(dsd, name) for name in _DSD} == before
    monkeypatch.setenv(ROUTES_ENV, ",".join(r.name for r in ROUTES if r.name != route))  # the way out it names
    blockshard.fully_shard(nn.Linear(3, 2))
    assert route not in installed_torch_routes()
    monkeypatch.undo()
    blockshard.uninstall_torch_routes()
    blockshard.fully_shard(nn.Linear(3, 2))  # the control: torch's own functions fit
    assert len(installed_torch_routes()) == len(_applying())
    assert isinstance(fsdp_impl.register_fsdp_forward_method, types.FunctionType)
