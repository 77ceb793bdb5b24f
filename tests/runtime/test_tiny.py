"""blockshard._tiny: tiny models and data, built in code, identical for the same seed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from blockshard._tiny import TEXT, OddMLP, mlp_batches, text_batches, tiny_llama


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_llama_same_seed_same_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = tiny_llama(0), tiny_llama(0), tiny_llama(1)
    assert torch.equal(torch.get_rng_state(), before)
    assert _same_state(a, b)
    assert not _same_state(a, c)
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert a.config._attn_implementation == "eager" and not a.config.tie_word_embeddings
    assert a.lm_head.weight.data_ptr() != a.model.embed_tokens.weight.data_ptr()
    shapes = {n: tuple(p.shape) for n, p in a.named_parameters()}
    assert shapes["model.embed_tokens.weight"] == (257, 48)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (89, 48)


def _tiny_state(rank: int, world_size: int, seed: int):
    return tiny_llama(seed).state_dict(), OddMLP(seed).state_dict()


@pytest.mark.slow
def test_same_weights_in_a_spawned_process():
    from blockshard._launch import run_single

    llama, mlp = run_single(_tiny_state, args=(3,), timeout=120)
    for theirs, ours in ((llama, tiny_llama(3).state_dict()), (mlp, OddMLP(3).state_dict())):
        assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_tiny_llama_forward_backward_on_text_gives_finite_loss():
    model = tiny_llama(0)
    ids, labels = text_batches(1, 2, 33)[0]
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # about log(257) = 5.55 at init
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_odd_mlp_blocks_determinism_and_shapes():
    a, b, c = OddMLP(0), OddMLP(0), OddMLP(1)
    assert isinstance(a.blocks, torch.nn.ModuleList) and len(a.blocks) == 3
    assert _same_state(a, b) and not _same_state(a, c)
    assert any(isinstance(m, torch.nn.LayerNorm) for m in a.modules())
    x, y = mlp_batches(1, 5)[0]
    out = a(x)
    assert out.shape == y.shape == (5, 7) and x.shape == (5, 13)
    torch.nn.functional.mse_loss(out, y).backward()
    assert all(torch.isfinite(p.grad).all() for p in a.parameters())


def test_text_batches_deterministic():
    a, b, c = text_batches(3, 4, 17, seed=5), text_batches(3, 4, 17, seed=5), text_batches(3, 4, 17, seed=6)
    assert len(a) == 3
    for (ia, la), (ib, lb) in zip(a, b, strict=True):
        assert ia.dtype == torch.int64 and ia.shape == (4, 17)
        assert torch.equal(ia, ib) and torch.equal(la, lb) and torch.equal(ia, la)
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c, strict=True))
    tokens = list(TEXT.encode())
    row = a[0][0][0].tolist()
    assert any(tokens[s : s + 17] == row for s in range(len(tokens) - 16))  # a window of the text
    assert max(max(ids.max().item() for ids, _ in a), 0) < 128
    small = text_batches(1, 2, 9, seed=5, vocab_size=50)[0][0]
    assert small.max().item() < 50


def test_mlp_batches_deterministic():
    a, b, c = mlp_batches(2, 3, seed=1), mlp_batches(2, 3, seed=1), mlp_batches(2, 3, seed=2)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == ya.dtype == torch.float32
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], c[0][0])


@pytest.mark.parametrize("kwargs", [{"seq_len": 0}, {"seq_len": 10**6}, {"batch_size": 0}, {"num_steps": -1}])
def test_text_batches_bad_arguments(kwargs):
    call = {"num_steps": 1, "batch_size": 2, "seq_len": 8, **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        text_batches(**call)


@pytest.mark.slow  # in the slow tier to keep `make test-fast` under a minute
def test_import_tiny_is_cheap():
    code = "import sys, blockshard._tiny; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]
