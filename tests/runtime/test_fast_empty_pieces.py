"""Empty pieces in 8-bit optimizers ([Note: empty pieces hold no state] in _optim_state.py), in-process:
the README's recipe builds the optimizer over every piece, empty ones too. Under ``bnb8bit`` /
``ao8bit`` semantics with whole tensors per rank, at W = 2 each rank holds one Linear whole and an
empty piece of the other; bitsandbytes AdamW8bit (and torchao AdamW8bit) give the empty piece fp32
state beside the holder's 8-bit state. ``blockshard.save_checkpoint`` at W = 2 (threads) then
loads at W = 2 (and bitsandbytes' at W = 1), restoring the 8-bit state exactly; ranks whose state of one parameter
is of two kinds raise on every rank instead of writing a checkpoint that mixes them, and a
checkpoint that does not fit one rank's state raises on every rank, not only there.
Tolerance: bitwise (copies). Controls: the loading optimizer's state before the load differs from
the saved one; the empty piece's live state really is fp32 where the holder's is uint8 (what made
``load_checkpoint`` raise a dtype ``CheckpointError`` before)."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import CheckpointError, PieceTensor, load_checkpoint, optimizer_state_dict, save_checkpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


def _model(seed: int, semantics: str) -> nn.Module:
    """Two Linears of 8192 weights (8-bit state) under whole placement: at W = 2 one per rank."""
    with _inproc.serial(), torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    return blockshard.fully_shard(model, semantics=semantics, policy="whole")


def _pieces(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, tuple]:
    """Every PieceTensor entry of the optimizer's state: ``key -> (global shape, start, local)``."""
    out = {}
    for name, entries in optimizer_state_dict(model, opt)["state"].items():
        for key, v in entries.items():
            for part, t in v.items() if isinstance(v, dict) else [("", v)]:
                if isinstance(t, PieceTensor):
                    out[f"{name}.{key}.{part}".rstrip(".")] = (tuple(t.shape), t.local_start, t.to_local().clone())
    return out


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for entries in per_rank:
        for key, (shape, start, local) in entries.items():
            full = out.setdefault(key, torch.zeros(torch.Size(shape).numel(), dtype=local.dtype))
            full[start : start + local.numel()] = local
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# -- bitsandbytes AdamW8bit ------------------------------------------------------------------------
def _bnb(model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    with _inproc.serial():
        import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, **kwargs)  # every piece, empty ones too


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    (model(x) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _bnb_save(rank: int, world: int, path: str) -> dict:
    model = _model(0, "bnb8bit")
    opt = _bnb(model)
    _step(model, opt)
    save_checkpoint(model, path, opt)
    kinds = {n: (p.numel(), opt.state[p]["state1"].dtype) for n, p in model.named_parameters() if "weight" in n}
    return {"pieces": _pieces(model, opt), "kinds": kinds}


def _bnb_load(rank: int, world: int, path: str) -> dict:
    model = _model(1, "bnb8bit")
    opt = _bnb(model)
    before = _pieces(model, opt)
    load_checkpoint(model, path, opt)
    out = {"before": before, "pieces": _pieces(model, opt)}
    _step(model, opt)  # training goes on
    return out


@pytest.fixture(scope="module")
def bnb_saved(tmp_path_factory) -> tuple[str, list[dict]]:
    path = str(tmp_path_factory.mktemp("empty") / "bnb")
    return path, _inproc.run_ranks(_bnb_save, 2, args=(path,))


def test_bnb_8bit_state_with_empty_pieces_saved_at_w2_loads_at_w2_and_w1(bnb_saved):
    path, saved = bnb_saved
    assert [r["kinds"] for r in saved] == [  # each rank: one weight with 8-bit state, an empty fp32 piece
        {"0.weight": (8192, torch.uint8), "2.weight": (0, torch.float32)},
        {"0.weight": (0, torch.float32), "2.weight": (8192, torch.uint8)},
    ]
    want = _assemble([r["pieces"] for r in saved])
    assert want["0.weight.state1"].dtype == torch.uint8 and want["2.weight.absmax1"].numel() == 32
    w2 = _inproc.run_ranks(_bnb_load, 2, args=(path,))
    with _inproc.single_thread():
        w1 = [_bnb_load(0, 1, path)]
    for loaded in (w2, w1):
        assert _equal(_assemble([r["pieces"] for r in loaded]), want)
        assert not _equal(_assemble([r["before"] for r in loaded]), want)  # control: the fresh state


def _bnb_load_32bit_on_rank_1(rank: int, world: int, path: str) -> str:
    model = _model(1, "bnb8bit")
    opt = _bnb(model, min_8bit_size=4096 if rank == 0 else 1 << 20)  # rank 1: fp32 state for 2.weight
    try:
        load_checkpoint(model, path, opt)
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_a_checkpoint_that_does_not_fit_one_rank_raises_on_every_rank(bnb_saved):
    # rank 0's state fits the checkpoint; rank 1's does not: rank 0 must not wait in dcp.load
    errors = _inproc.run_ranks(_bnb_load_32bit_on_rank_1, 2, args=(bnb_saved[0],))
    assert "'optimizer.state.2.weight.state1': saved torch.uint8, model torch.float32" in errors[1], errors
    assert errors[0] == f"{errors[1]} (on rank 1; 1 of 2 ranks)", errors


def _mixed(rank: int, world: int) -> str:
    """Rank 1's optimizer keeps 32-bit state for its piece of 0.weight, rank 0's 8-bit state."""
    with _inproc.serial(), torch.random.fork_rng():
        model = nn.Sequential(nn.Linear(64, 256))  # 16384 weights: a piece of 8192 on each rank
    blockshard.fully_shard(model, semantics="bnb8bit")
    opt = _bnb(model, min_8bit_size=4096 if rank == 0 else 1 << 20)
    _step_mixed = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    model(_step_mixed).square().mean().backward()
    opt.step()
    try:
        optimizer_state_dict(model, opt)
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_state_of_one_parameter_of_two_kinds_raises_on_every_rank():
    errors = _inproc.run_ranks(_mixed, 2)
    for err in errors:
        assert "parameter '0.weight' differs between the ranks" in err, errors
        assert "rank 0 holds {" in err and "'state1': 'uint8'" in err and "'state1': 'float32'" in err, errors
        assert "min_8bit_size" in err, errors


# -- torchao AdamW8bit (its state as its first step makes it: no step, nothing compiled) ---------
def _ao(model: nn.Module, seed: int | None) -> torch.optim.Optimizer:
    """torchao AdamW8bit over every piece with the state its first step creates (``_new_buffer``:
    OptimState8bit for the 8192-element pieces, plain fp32 for the empty ones and the biases),
    filled with values of ``seed`` (``None``: zeros)."""
    with _inproc.serial():
        from torchao.optim import AdamW8bit
    opt = AdamW8bit(model.parameters(), lr=torch.tensor(1e-3))
    g = torch.Generator().manual_seed(seed or 0)
    for p in model.parameters():
        state = {
            "step": torch.tensor(1.0),
            "exp_avg": opt._new_buffer(p, True),
            "exp_avg_sq": opt._new_buffer(p, False),
        }
        if seed is not None:
            for key in ("exp_avg", "exp_avg_sq"):
                v = state[key]
                parts = [v.codes, v.scale] if type(v).__name__ == "OptimState8bit" else [v]
                for t in parts:
                    t.copy_(
                        torch.randint(0, 256, t.shape, generator=g)
                        if t.dtype == torch.uint8
                        else torch.rand(t.shape, generator=g)
                    )
        opt.state[p] = state
    return opt


def _ao_save(rank: int, world: int, path: str) -> dict:
    model = _model(0, "ao8bit")
    opt = _ao(model, seed=rank + 1)
    save_checkpoint(model, path, opt)
    kinds = {n: type(opt.state[p]["exp_avg"]).__name__ for n, p in model.named_parameters() if "weight" in n}
    return {"pieces": _pieces(model, opt), "kinds": kinds}


def _ao_load(rank: int, world: int, path: str) -> dict:
    model = _model(1, "ao8bit")
    opt = _ao(model, seed=None)
    before = _pieces(model, opt)
    load_checkpoint(model, path, opt)
    return {"before": before, "pieces": _pieces(model, opt)}


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_torchao_8bit_state_with_empty_pieces_saved_at_w2_loads_at_w2(tmp_path):
    path = str(tmp_path / "ao")
    saved = _inproc.run_ranks(_ao_save, 2, args=(path,))
    assert [r["kinds"] for r in saved] == [
        {"0.weight": "OptimState8bit", "2.weight": "Tensor"},
        {"0.weight": "Tensor", "2.weight": "OptimState8bit"},
    ]
    want = _assemble([r["pieces"] for r in saved])
    assert want["0.weight.exp_avg.codes"].dtype == torch.uint8 and "0.weight.exp_avg" not in want
    loaded = _inproc.run_ranks(_ao_load, 2, args=(path,))  # W = 1: test_fast_optim_checkpoints.py
    assert _equal(_assemble([r["pieces"] for r in loaded]), want)
    assert not _equal(_assemble([r["before"] for r in loaded]), want)  # control: zeros
