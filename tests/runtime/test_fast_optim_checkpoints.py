"""Quantized and per-block optimizer state in DCP checkpoints, in-process (issue 11; the spawned
W = 4 -> 2, 1 training runs are in test_optim_checkpoints.py): torchao ``OptimState8bit`` saved at
W = 2 (threads) and loaded at W = 1 restores its codes and per-block scales exactly; state in
pieces that cut its blocks raises naming the semantics to use.
Tolerance: bitwise (copies). Control: the loading optimizer's state starts as zeros."""

from __future__ import annotations

import _inproc
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import blockshard
from blockshard.runtime import CheckpointError, PieceTensor

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


def _ao_model(semantics: str = "ao8bit") -> nn.Module:
    with _inproc.serial():
        model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 3))  # 8192 elements: 8-bit state
    return blockshard.fully_shard(model, semantics=semantics)


def _global(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name) * 1000 + numel)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)
    return torch.rand(numel, generator=g)


def _ao_optimizer(model: nn.Module, filled: bool, any_length: bool = False) -> torch.optim.Optimizer:
    """torchao AdamW8bit with state as its first step would make it (no step: none compiled),
    holding the pieces of deterministic global values (``filled``) or zeros; ``any_length``:
    8-bit state for pieces of >= 4096 elements that are no multiple of 256 too (a stand-in for
    state a layout would cut)."""
    with _inproc.serial():
        from torchao.optim import AdamW8bit
        from torchao.optim.subclass_8bit import OptimState8bit
    opt = AdamW8bit([p for p in model.parameters() if p.numel()], lr=torch.tensor(1e-3))
    entries = model.state_dict()
    for name, p in model.named_parameters():
        if not p.numel():
            continue
        start, n, N = entries[name].local_start, p.numel(), entries[name].numel()
        state = {"step": torch.tensor(2.0 if filled else 0.0)}
        for key in ("exp_avg", "exp_avg_sq"):
            if n >= 4096 and (n % 256 == 0 or any_length):
                v = OptimState8bit.zeros(p.shape, signed=key == "exp_avg")
                if filled:
                    v.codes.view(-1).copy_(_global(f"{name}.{key}.codes", N, torch.uint8)[start : start + n])
                    v.scale.copy_(_global(f"{name}.{key}.scale", N // 256, torch.float32)[start // 256 :][: n // 256])
            else:
                v = _global(f"{name}.{key}", N, torch.float32)[start : start + n].view(p.shape).clone()
                v.mul_(float(filled))
            state[key] = v
        opt.state[p] = state
    return opt


def _save_ao(rank: int, world: int, path: str) -> list:
    model = _ao_model()
    opt = _ao_optimizer(model, filled=True)
    sd = blockshard.optimizer_state_dict(model, opt)
    dcp.save({"optimizer": sd}, checkpoint_id=path)
    return [v.local_start for v in (sd["state"]["0.weight"]["exp_avg"]["scale"],)]


def test_torchao_8bit_state_saved_at_w2_loads_at_w1_exactly(tmp_path):
    starts = _inproc.run_ranks(_save_ao, 2, args=(str(tmp_path / "ao"),))
    assert sorted(s for r in starts for s in r) == [0, 16]  # 4096-element pieces: scale 0 and 16 of 32
    with _inproc.single_thread():
        model = _ao_model()
        opt = _ao_optimizer(model, filled=False)
        state = {"optimizer": blockshard.optimizer_state_dict(model, opt)}
        assert isinstance(state["optimizer"]["state"]["0.weight"]["exp_avg"]["codes"], PieceTensor)
        dcp.load(state, checkpoint_id=str(tmp_path / "ao"))
        blockshard.load_optimizer_state_dict(model, opt, state["optimizer"])
    w = model[0].weight
    for key in ("exp_avg", "exp_avg_sq"):
        live = opt.state[w][key]
        assert type(live).__name__ == "OptimState8bit"
        assert torch.equal(live.codes.view(-1), _global(f"0.weight.{key}.codes", 8192, torch.uint8))
        assert torch.equal(live.scale, _global(f"0.weight.{key}.scale", 32, torch.float32))
    assert torch.equal(opt.state[model[0].bias]["exp_avg"], _global("0.bias.exp_avg", 128, torch.float32))
    assert opt.state[w]["step"].item() == 2.0


def _cut(rank: int, world: int) -> dict:
    out = {}
    model = _ao_model("elementwise")
    opt = _ao_optimizer(model, filled=True, any_length=True)
    try:  # rank 0's piece of 0.weight starts at 0 but is not a multiple of 256 long
        blockshard.optimizer_state_dict(model, opt)
    except CheckpointError as e:
        out["ao"] = str(e)
    model = _ao_model("elementwise")
    from blockshard.optim import BlockedShampoo

    shampoo = BlockedShampoo(model.parameters(), lr=0.1, max_preconditioner_dim=32)
    try:
        blockshard.optimizer_state_dict(model, shampoo)
    except CheckpointError as e:
        out["shampoo"] = str(e)
    return out


def test_state_in_pieces_that_cut_its_blocks_raises_naming_the_semantics():
    outs = _inproc.run_ranks(_cut, 2)
    for out in outs:  # on every rank
        assert "cuts such a block" in out.get("ao", "") and "'ao8bit'" in out["ao"], outs
        assert "semantics='shampoo:32'" in out.get("shampoo", ""), outs


# -- torchao 4-bit and FP8 state ------------------------------------------------------------------
_AO_KINDS = {  # class, block size, semantics, codes per element
    "4bit": ("subclass_4bit", "OptimState4bit", 128, "ao4bit", 0.5),
    "fp8": ("subclass_fp8", "OptimStateFp8", 256, "ao8bit", 1),
}


def _ao_state(kind: str, shape, name: str, key: str, start: int, N: int, filled: bool):
    import importlib

    module, cls, block, _, per = _AO_KINDS[kind]
    with _inproc.serial():
        state_cls = getattr(importlib.import_module(f"torchao.optim.{module}"), cls)
    v = state_cls.zeros(shape, block_size=block) if kind == "fp8" else state_cls.zeros(shape, signed=key == "exp_avg")
    if filled:
        n = v.codes.numel()
        lo = int(start * per)
        codes = _global(f"{name}.{key}.codes", int(N * per), torch.uint8)[lo : lo + n]
        v.codes.view(-1).copy_(codes.view(v.codes.dtype) if kind == "fp8" else codes)
        v.scale.copy_(_global(f"{name}.{key}.scale", N // block, torch.float32)[start // block :][: v.scale.numel()])
    return v


def _ao_opt(model: nn.Module, kind: str, filled: bool) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.numel()], lr=1e-3)  # holds the state only
    entries = model.state_dict()
    for name, p in model.named_parameters():
        if p.numel() >= 4096:
            start, N = entries[name].local_start, entries[name].numel()
            opt.state[p] = {k: _ao_state(kind, p.shape, name, k, start, N, filled) for k in ("exp_avg", "exp_avg_sq")}
    return opt


def _save_ao_kind(rank: int, world: int, path: str, kind: str) -> None:
    model = _ao_model(_AO_KINDS[kind][3])
    dcp.save(
        {"optimizer": blockshard.optimizer_state_dict(model, _ao_opt(model, kind, filled=True))}, checkpoint_id=path
    )


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
@pytest.mark.parametrize("kind", sorted(_AO_KINDS))
def test_torchao_4bit_and_fp8_state_saved_at_w2_loads_at_w1_exactly(kind, tmp_path):
    _inproc.run_ranks(_save_ao_kind, 2, args=(str(tmp_path / kind), kind))
    with _inproc.single_thread():
        model = _ao_model(_AO_KINDS[kind][3])
        opt = _ao_opt(model, kind, filled=False)
        w = model[0].weight
        before = opt.state[w]["exp_avg"].codes.clone()
        state = {"optimizer": blockshard.optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=str(tmp_path / kind))
        blockshard.load_optimizer_state_dict(model, opt, state["optimizer"])
    per, block = _AO_KINDS[kind][4], _AO_KINDS[kind][2]
    for key in ("exp_avg", "exp_avg_sq"):
        live = opt.state[w][key]
        assert type(live).__name__ == _AO_KINDS[kind][1]
        codes = live.codes.view(-1).view(torch.uint8) if kind == "fp8" else live.codes.view(-1)
        assert torch.equal(codes, _global(f"0.weight.{key}.codes", int(8192 * per), torch.uint8))
        assert torch.equal(live.scale, _global(f"0.weight.{key}.scale", 8192 // block, torch.float32))
    assert not torch.equal(before.view(torch.uint8), opt.state[w]["exp_avg"].codes.view(torch.uint8))  # control


def test_bnb_code_books_stay_plain_tensors_for_a_256_element_piece():
    """A piece of exactly 256 elements (8-bit with ``min_8bit_size=256``) has the shape of its code
    book ``qmap1``: the book is the same on every rank, never a piece of the parameter (it was
    saved as one, read back at another placement as other ranks' elements)."""
    import bitsandbytes as bnb

    with _inproc.serial():
        model = nn.Sequential(nn.Linear(16, 256))
    blockshard.fully_shard(model, semantics="bnb8bit")
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=256)
    (model(torch.ones(2, 16)) ** 2).mean().backward()
    opt.step()
    state = blockshard.optimizer_state_dict(model, opt)["state"]
    bias = state["0.bias"]
    assert bias["state1"].dtype == torch.uint8 and isinstance(bias["state1"], PieceTensor)  # 8-bit, a piece
    for book in ("qmap1", "qmap2"):
        assert type(bias[book]) is torch.Tensor and torch.equal(bias[book], opt.state[model[0].bias][book])
        assert type(state["0.weight"][book]) is torch.Tensor  # control: a 4096-element piece's book, as before
