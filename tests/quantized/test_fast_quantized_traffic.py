"""Frozen bitsandbytes 4-bit weights move their quantized segments, as planned ([Note: traffic] in
runtime/core/_traffic.py): a QLoRA tiny Llama at W = 2, two steps; every collective's bytes agree
with the plan, the 4-bit weights travel as bytes (uint8, "quantized bytes"), one all-gather of
``quantized_stats``' ``gathered_bytes`` (``W * S``) each."""

from __future__ import annotations

import _inproc
import _qlora
import pytest
import torch

import blockshard
from blockshard.runtime import CollectiveCount, collective_counts

pytestmark = pytest.mark.timeout(60)

STEPS = 2


def _train(rank: int, world: int) -> tuple[list[CollectiveCount], dict[str, int]]:
    with _inproc.serial():
        model = _qlora.qlora_llama()
    _qlora._shard(model, world)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids, labels = next(iter(_qlora.text_batches(1, 4, 16)))
    for _ in range(STEPS):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    stats = {k: v.gathered_bytes for k, v in blockshard.quantized_stats(model).items()}
    return collective_counts(model), stats


@pytest.mark.heavy  # seconds: make test runs it
def test_frozen_4bit_weights_move_their_quantized_segments():
    for rows, stats in _inproc.run_ranks(_train, 2):
        assert all(r.agrees for r in rows), rows
        quantized = [r for r in rows if r.wire == "quantized bytes"]
        assert quantized and all(r.kind == "all-gather" and r.dtype == "uint8" for r in quantized)
        for r in quantized:  # stats are keyed by the module's full name, the rows by the path under the root
            (key,) = [k for k in stats if k == r.group or k.endswith("." + r.group)]
            assert r.bytes == r.calls * stats[key], (r, stats)
        assert len(quantized) == len(stats)
