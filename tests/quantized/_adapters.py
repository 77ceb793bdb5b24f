"""What the frozen-quantized-weight runs share (``_ao_runs.py``, ``_mx_runs.py``, ``_fp8_runs.py``):
a stack of quantized linears with bf16 adapters (``model.layers``) trained a few AdamW steps, and
the comparison of W ranks with one process. ``world == 0`` is one process without sharding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def batch(step: int, width: int) -> torch.Tensor:
    """The whole batch of ``step`` (the same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, width, generator=g).to(torch.bfloat16)


def train(
    model: nn.Module, rank: int, world: int, inputs: Callable[[int], torch.Tensor], steps: int = 2, **shard: object
) -> dict:
    """Shard every layer and the root (unless ``world == 0``; ``shard``: ``fully_shard``'s keyword
    arguments); logits and adapter gradients of the first step, adapters after ``steps`` AdamW
    steps, and this rank's quantized bytes, pieces and segment."""
    from _qlora import _lora_grads

    import blockshard

    if world:
        for layer in model.layers:
            blockshard.fully_shard(layer, **shard)
        blockshard.fully_shard(model, **shard)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out: dict = {}
    for step in range(steps):
        y = model(inputs(step))
        y.float().square().mean().backward()
        if step == 0:
            out["logits"] = y.detach().clone()
            out["grads"] = _lora_grads(model, world)
        opt.step()
        opt.zero_grad()
    full = blockshard.full_state_dict(model) if world else dict(model.named_parameters())
    out["params"] = {n: full[n].detach().clone() for n in full if "lora" in n}
    if world:
        from blockshard.runtime.core._state import state_of
        from blockshard.runtime.quantized._frozen import frozen_buffers

        qs = [frozen_buffers(st) for m in model.modules() if (st := state_of(m)) and frozen_buffers(st)]
        out["held"] = sum(q.layout.rank_bytes(rank) for q in qs)
        out["total"] = sum(q.layout.total_bytes for q in qs)
        out["pieces"] = [[(p.unit_start, p.unit_stop) for p in q.layout.pieces[rank]] for q in qs]  # units
        out["segment_bytes"] = sum(q.layout.segment_bytes for q in qs)
    return out


def check_equal_one_process(results: list[dict], want: dict, world: int) -> None:
    """Logits bitwise; adapter gradients and adapters bitwise at W in {2, 4}; at W = 3 the gradients
    within one bf16 ulp (the average of three identical bf16 gradients rounds differently from one
    process), and every quantized byte held by exactly one rank."""
    for rank, got in enumerate(results):
        assert torch.equal(got["logits"], want["logits"]), rank
        for n, g in want["grads"].items():
            if world == 3:
                torch.testing.assert_close(got["grads"][n], g, rtol=2**-7, atol=1e-6)  # one bf16 ulp
            else:
                assert torch.equal(got["grads"][n], g), (rank, n)
        if world != 3:
            assert all(torch.equal(got["params"][n], p) for n, p in want["params"].items()), rank
    assert sum(r["held"] for r in results) == results[0]["total"]  # payload and scales: one rank each
