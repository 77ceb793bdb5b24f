"""The end-of-step check counts the all-gather of a group that holds only quantized weights
([Note: collective integrity], point 3), as it counts the float groups' (threaded gloo ranks).

Three ``Linear4bit`` layers of one shape, each its own ``fully_shard`` (quantized weights only), and
a float adapter in the root group. Aligned ranks count four all-gathers per forward (before, only
the root's one was counted: ``float_groups``). In step 1 rank 0 unshards layer 1 and rank 1 layer 2
(one equal-sized all-gather each): they pair, rank 0's layer 1 receives rank 1's segment of layer 2
(the control: its gathered bytes differ from step 0's, and nothing else sees it), and, counted, every
rank raises ``CollectiveIntegrityError`` at the end of that backward.
"""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(300)


class QuantizedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import bitsandbytes as bnb

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.adapter = nn.Linear(128, 128)
            self.layers = nn.ModuleList()
            for _ in range(3):
                q = bnb.nn.Linear4bit(128, 128, bias=False, compress_statistics=False, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(torch.randn(128, 128) / 11, requires_grad=False, quant_type="nf4")
                self.layers.append(q.to("cpu"))  # bitsandbytes quantizes on .to()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.adapter(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _run(rank: int, world: int, swap: bool) -> dict:
    import blockshard
    from blockshard.runtime.core._state import state_of

    with _inproc.serial():
        model = QuantizedStack()
    for layer in model.layers:
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    only_quantized = [state_of(m).buffers.layout is None for m in model.layers]
    float_groups = sum(state_of(m).buffers.layout is not None for m in (*model.layers, model))
    opt = torch.optim.SGD(model.adapter.parameters(), lr=0.1)
    losses, counts = [], []
    gathered, outcome = [], "no error"
    try:
        for step in range(3):
            if step < 2:  # an explicit unshard of a layer (rank 1 of another one in step 1 if ``swap``)
                layer = model.layers[2 if swap and step == 1 and rank == 1 else 1]
                layer.unshard()
                gathered.append(layer.weight.data.clone())
                layer.reshard()
            loss = model(torch.ones(4, 128)).square().mean()
            counts.append(state_of(model.layers[0]).buffers.tally.count)  # after forward
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    same = len(gathered) == 2 and torch.equal(gathered[0], gathered[1])
    return {
        "only_quantized": only_quantized,
        "float_groups": float_groups,
        "losses": losses,
        "counts": counts,
        "outcome": outcome,
        "same_bytes": same,
    }


def test_aligned_ranks_count_every_quantized_all_gather():
    for out in _inproc.run_ranks(_run, 2, args=(False,)):
        assert out["only_quantized"] == [True, True, True]
        assert out["outcome"] == "no error"
        # three quantized-only groups and the root; in step 1 the explicit unshard too (step 0's came before
        # the first forward made the root context that counts)
        assert out["counts"] == [4, 5, 4]
        assert out["same_bytes"]
        assert out["float_groups"] == 1  # the control: what was counted before


def test_quantized_all_gathers_out_of_order_raise_on_every_rank(monkeypatch):
    """Without headers ([Note: collective headers]) the swapped all-gathers pair: the end-of-step
    check is what raises."""
    monkeypatch.setenv("BLOCKSHARD_COLLECTIVE_HEADERS", "0")
    outs = _inproc.run_ranks(_run, 2, args=(True,))
    assert not outs[0]["same_bytes"]  # the control: rank 0's layer 1 was gathered with rank 1's layer 2
    for rank, out in enumerate(outs):
        assert out["outcome"].startswith("CollectiveIntegrityError"), (rank, out["outcome"])
        assert "did not line up" in out["outcome"] and "Fix:" in out["outcome"], out["outcome"]
        assert len(out["losses"]) == 2, out["losses"]  # raised in step 1, before its optimizer step


def test_with_headers_quantized_all_gathers_out_of_order_raise_before_pairing():
    """With headers (the default on gloo) every rank raises at the swapped all-gather itself, naming
    both ranks' groups, before any byte of it is exchanged."""
    for out in _inproc.run_ranks(_run, 2, args=(True,)):
        msg = out["outcome"]
        assert msg.startswith("CollectiveIntegrityError: blockshard: the ranks' collectives do not line up"), msg
        assert "rank 0: the all-gather of the quantized weights of group 'Linear4bit' (layers.1)" in msg, msg
        assert "rank 1: the all-gather of the quantized weights of group 'Linear4bit' (layers.2)" in msg, msg
        assert "Nothing was exchanged" in msg and "Fix:" in msg, msg
        assert len(out["losses"]) == 1, out["losses"]  # step 1 raised at the unshard, before its forward


def _mixed(rank: int, world: int) -> dict:
    import blockshard
    from blockshard.runtime.core._state import state_of
    from blockshard.runtime.quantized._frozen import frozen_buffers

    with _inproc.serial():
        model = QuantizedStack()
    blockshard.fully_shard(model)  # one group: the float adapter and the three quantized weights
    state = state_of(model)
    group = state.buffers
    model(torch.ones(4, 128))
    return {"mixed": group.layout is not None and frozen_buffers(state) is not None, "count": group.tally.count}


def test_a_group_of_float_and_quantized_weights_counts_both_all_gathers():
    """Its unshard issues two all-gathers (the float buffer's, the quantized segment's); both are
    counted (before: one, as for a float group)."""
    for out in _inproc.run_ranks(_mixed, 2):
        assert out["mixed"]
        assert out["count"] == 2, out["count"]
