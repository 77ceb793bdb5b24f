"""``blockshard.load_safetensors`` in process ([Note: sharded loading]): the boxes that read a
piece cover exactly its elements; a W = 2 threaded load equals the saved tensors and reads only
each rank's pieces; clear errors for a missing tensor, a wrong shape and a meta-device model."""

from __future__ import annotations

import itertools
import math

import _inproc
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import blockshard
from blockshard.runtime import ShardingError
from blockshard.runtime.checkpoint._safetensors import row_boxes

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_row_boxes_cover_exactly_the_run(shape):
    t = torch.arange(math.prod(shape)).reshape(shape)
    n = t.numel()
    for lo, hi in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = list(row_boxes(shape, lo, hi))
        got = torch.cat([t[b].reshape(-1) for b in boxes]) if boxes else torch.empty(0, dtype=t.dtype)
        assert torch.equal(got, t.reshape(-1)[lo:hi]), (lo, hi)
        assert len(boxes) <= 2 * len(shape) - 1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList([nn.Linear(7, 5), nn.Linear(5, 3)])
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x)) * self.scale


def _saved(tmp_path) -> str:
    state = {k: v.clone() + 1 for k, v in Net().state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def _load(rank: int, world: int, path: str) -> dict:
    with torch.device("meta"), _inproc.serial():
        model = Net()
    for layer in model.layers:
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    with pytest.raises(ShardingError, match=r"on the meta device; call model\.to_empty"):
        blockshard.load_safetensors(model, path)
    model.to_empty(device="cpu")
    report = blockshard.load_safetensors(model, path)
    held = sum(sp.local_numel * 4 for m in model.layers for sp in m._blockshard_state.buffers.params)
    return {"state": blockshard.full_state_dict(model), "read": report.read_bytes, "held": held}


def test_two_ranks_load_their_pieces(tmp_path):
    path = _saved(tmp_path)
    want = {k: v + 1 for k, v in Net().state_dict().items()}
    results = _inproc.run_ranks(_load, 2, args=(path,))
    for r in results:
        for k, v in want.items():
            assert torch.equal(r["state"][k], v), k
        assert r["read"] == r["held"] + 4  # its pieces, and the buffer `scale` whole
    assert sum(r["held"] for r in results) == sum(p.numel() * 4 for p in Net().parameters())


def test_missing_and_misshapen_tensors_raise(gloo_w1, tmp_path):
    state = {k: v.clone() for k, v in Net().state_dict().items()}
    del state["layers.1.bias"]
    save_file(state, str(tmp_path / "a.safetensors"))
    model = blockshard.fully_shard(Net())
    with pytest.raises(ShardingError, match=r"not in the checkpoint .*'layers.1.bias'"):
        blockshard.load_safetensors(model, tmp_path / "a.safetensors")
    blockshard.load_safetensors(model, tmp_path / "a.safetensors", strict=False)
    state["layers.1.bias"] = torch.zeros(4)
    save_file(state, str(tmp_path / "b.safetensors"))
    with pytest.raises(ShardingError, match=r"'layers.1.bias' has shape \(4,\) in the checkpoint"):
        blockshard.load_safetensors(model, tmp_path / "b.safetensors")
    with pytest.raises(ShardingError, match=r"neither a \.safetensors file nor a directory"):
        blockshard.load_safetensors(model, tmp_path / "nothing")
