"""FSDP2's own test scenarios (torch's test/distributed/_composable/fsdp/test_fully_shard_{autograd,
training,frozen,comm}.py), rebuilt here with tiny models, for test_fsdp2_scenarios.py; more rows
in _fsdp2_scenario_rows.py (:func:`w2_rows` joins them).

One spawned W = 2 run calls :func:`all_scenarios`: every scenario trains with stock FSDP2 and
with blockshard (the same code, only ``fully_shard`` swapped) and compares each against a
one-process reference computed in the rank itself (no collectives: the reference model sees
every rank's input, its loss is their mean, so its gradients are the ranks' average). A scenario
returns what it found (``"ok"`` or the error), never asserts, so the test shows every row.
"""

from __future__ import annotations

import collections
import copy
import itertools
import traceback

import _inproc
import torch
import torch.distributed as dist
from torch import nn

# Bound at import, before any fully_shard of the spawned rank, as scripts and torch's tests do:
# blockshard routes torch's function objects themselves, not only the attributes.
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.nn.utils import clip_grad_norm_

DIM = 8
W = 2


class Engine:
    """``fully_shard`` and the few reads that differ between FSDP2 and blockshard."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "fsdp2":
            from torch.distributed.fsdp import FSDPModule, fully_shard

            self.fully_shard, self.module_type = fully_shard, FSDPModule
        else:
            import blockshard
            from blockshard.runtime import ShardedModule

            self.fully_shard, self.module_type = blockshard.fully_shard, ShardedModule

    def full(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full parameters by ``named_parameters`` name (checkpoint-wrapper prefixes dropped)."""
        if self.name == "fsdp2":
            from torch.distributed.tensor import DTensor

            got = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
        else:
            import blockshard

            sd = blockshard.full_state_dict(model)
            got = {n: sd[_plain(n)] for n, _ in model.named_parameters()}
        return {_plain(n): v for n, v in got.items()}

    def gathered(self, module: nn.Module) -> bool:
        """Whether ``module``'s group holds its gathered parameters now."""
        if self.name == "fsdp2":
            from torch.distributed.tensor import DTensor

            nested = {
                p
                for m in module.modules()
                if m is not module and isinstance(m, self.module_type)
                for p in m.parameters()
            }
            own = [p for p in module.parameters() if p not in nested]  # this group's, not nested groups'
            return not isinstance(own[0], DTensor)
        from blockshard.runtime.core._common import ShardedState
        from blockshard.runtime.core._state import state_of

        st = state_of(module)
        assert st is not None
        return st.buffers.sharded_state is ShardedState.UNSHARDED


def _plain(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _check(got: dict, want: dict, what: str) -> None:
    """float32 tolerance of torch.testing.assert_close (rtol 1.3e-6, atol 1e-5), as FSDP2's tests."""
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{what} {k}: {m}")


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ids(seed: int, vocab: int = 32, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


def _mean_loss(loss_fn, ref: nn.Module, inputs: list) -> torch.Tensor:
    """The reference's loss over every rank's input: their mean (gradients: the ranks' average)."""
    return sum(loss_fn(ref, x) for x in inputs) / len(inputs)


def _train(E, model, ref, inputs, loss_fn, steps=3, opt=torch.optim.Adam, max_norm=None) -> None:
    """``inputs(step, rank)``; the sharded model trains on its rank's, ``ref`` on all of them;
    with ``max_norm``, both clip their gradients with torch's ``clip_grad_norm_`` (bound early)."""
    o, ro = opt(model.parameters(), lr=1e-2), opt(ref.parameters(), lr=1e-2)
    rank = dist.get_rank()
    for step in range(steps):
        loss = loss_fn(model, inputs(step, rank))
        loss.backward()
        want = _mean_loss(loss_fn, ref, [inputs(step, r) for r in range(W)])
        want.backward()
        if max_norm is not None:
            norm, ref_norm = clip_grad_norm_(model.parameters(), max_norm), clip_grad_norm_(ref.parameters(), max_norm)
            assert ref_norm > max_norm  # the clip acts
            torch.testing.assert_close(norm.full_tensor() if E.name == "fsdp2" else norm, ref_norm)
        got = loss.detach().clone()
        dist.all_reduce(got)
        torch.testing.assert_close(got / W, want.detach(), msg=lambda m, s=step: f"loss step {s}: {m}")
        for op in (o, ro):
            op.step()
            op.zero_grad(set_to_none=step % 2 == 0)
    _check(E.full(model), {_plain(n): p.detach() for n, p in ref.named_parameters()}, "params")


# -- models (as torch's common_fsdp.MLP, DoubleLinear, Transformer, in small) -------------------
class MLP(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


class DoubleLinear(nn.Module):
    def __init__(self, use_second_linear: bool) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.use_second_linear = use_second_linear

    def forward(self, x):
        if self.use_second_linear:
            return torch.relu(self.lin1(x)), torch.relu(self.lin2(x))
        return torch.relu(self.lin1(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM))
        self.feed_forward = MLP()

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.feed_forward(x)


class Transformer(nn.Module):
    def __init__(self, n_layers: int = 3, tie: bool = False) -> None:
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = nn.Embedding(32, DIM), nn.Embedding(8, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, 32, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        h = self.tok_embeddings(ids) + self.pos_embeddings(torch.arange(ids.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class ChunkedHead(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed, self.body = nn.Embedding(32, DIM), nn.Linear(DIM, DIM, bias=False)
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, 32, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens, *, skip_head: bool = False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _sum(m, x):
    return m(x).sum()


# -- scenarios: each returns None (passed) or raises --------------------------------------------
def reshard_after_forward_int(E, value: int) -> None:
    """test_fully_shard_autograd's ``reshard_after_forward=2`` (at W = 2 the shard group's size:
    True; at W = 4 a smaller world of 2 ranks) and test_fully_shard_training's ``=1`` (False); the
    non-root group after forward shows whether it keeps its gathered parameters."""
    torch.manual_seed(42)
    model = DoubleLinear(use_second_linear=True)
    ref = copy.deepcopy(model)
    E.fully_shard(model.lin1, reshard_after_forward=value)
    E.fully_shard(model, reshard_after_forward=value)
    model(_randn(0, 2, DIM))
    assert E.gathered(model.lin1) == (value == 1), f"lin1 gathered after forward: {E.gathered(model.lin1)}"
    model.reshard()
    model.lin1.reshard()

    def loss_fn(m, x):  # the second output unused from the second step on
        o1, o2 = m(x[0])
        return (o1 * o2).sum() if x[1] == 0 else o1.sum()

    _train(E, model, ref, lambda s, r: (_randn(10 * s + r, 2, DIM), s), loss_fn)


def reshard_after_forward_bad_int(E) -> None:
    """3 is no factor of the shard group's size 2: both engines refuse it (a ValueError)."""
    try:
        E.fully_shard(nn.Linear(2, 2), reshard_after_forward=3)
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("reshard_after_forward=3 was accepted")
    assert "reshard_after_forward" in message or "factor" in message, message


def unshard_in_backward_off(E) -> None:
    """test_train_parity_with_activation_checkpointing, grouping "mem_eff", checkpoint "wrapper":
    list groups of checkpoint-wrapped blocks; the embeddings' group is not gathered in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    torch.manual_seed(42)
    model = Transformer(n_layers=3)
    ref = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    E.fully_shard(model.layers[0])
    E.fully_shard([model.layers[1], model.layers[2]])
    E.fully_shard([model.tok_embeddings, model.pos_embeddings])
    E.fully_shard([model.norm, model.output])
    E.fully_shard(model)
    counts = []
    for flag in (True, False):  # the all-gathers of one step without and with the setting
        model.tok_embeddings.set_unshard_in_backward(flag)
        with _inproc.CollectiveLog() as log:
            model(_ids(99)).sum().backward()
        counts.append(log.count("all_gather"))
        for p in model.parameters():
            p.grad = None
    assert counts[1] == counts[0] - 1, f"all-gathers per step with it on, off: {counts}"
    _train(E, model, ref, lambda s, r: _ids(r), _sum)


def backward_prefetch_inside_ac(E) -> None:
    """test_set_modules_to_backward_prefetch_inside_ac: a group nested in a checkpoint-wrapped
    module inside a checkpoint-wrapped block, explicit backward prefetching across them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MLP))
    E.fully_shard([model.tok_embeddings, model.pos_embeddings])
    for layer in model.layers:
        E.fully_shard(layer.feed_forward.in_proj)
        E.fully_shard(layer)
    E.fully_shard([model.norm, model.output])
    E.fully_shard(model)
    blocks = list(reversed(model.layers))
    for m in (model, model.output):
        m.set_modules_to_backward_prefetch([blocks[0], blocks[0].feed_forward.in_proj])
    for block, before in itertools.pairwise(blocks):
        block.feed_forward.in_proj.set_modules_to_backward_prefetch([before, before.feed_forward.in_proj])
    blocks[-1].feed_forward.in_proj.set_modules_to_backward_prefetch([model.tok_embeddings])
    _train(E, model, ref, lambda s, r: _ids(10 * s + r), _sum)


def unshard_async_op(E) -> None:
    """test_train_parity_multi_group_unshard_async_op: ``model._set_unshard_async_op(True)``."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        E.fully_shard(layer)
    E.fully_shard(model)
    model._set_unshard_async_op(True)
    _train(E, model, ref, lambda s, r: _ids(10 * s + r), _sum)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, 1)

    def forward(self, x):
        return self.head(self.lin(x))

    def encode(self, x):
        return self.lin(x)


class _ForwardMethodModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit, self.proj = _Encoder(), nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.proj(self.vit.encode(x))


def torch_register_fsdp_forward_method(E) -> None:
    """test_fully_shard_training's forward-method case: the root calls ``vit.encode``, registered
    with *torch's* ``register_fsdp_forward_method`` (the name imported before any ``fully_shard``)."""
    torch.manual_seed(42)
    model = _ForwardMethodModel()
    ref = copy.deepcopy(model)
    E.fully_shard(model.vit)
    E.fully_shard(model.proj)
    E.fully_shard(model)
    register_fsdp_forward_method(model.vit, "encode")
    _train(E, model, ref, lambda s, r: _randn(10 * s + r, 2, DIM), _sum)


def unused_forward_module(E) -> None:
    torch.manual_seed(42)
    model = DoubleLinear(use_second_linear=False)
    ref = copy.deepcopy(model)
    for m in (model.lin1, model.lin2, model):
        E.fully_shard(m)
    _train(E, model, ref, lambda s, r: _randn(10 * s + r, 2, DIM), _sum)


_NT = collections.namedtuple("_NT", "x y")


class _Boxed(nn.Module):
    """Takes and returns its activation inside a dict or a namedtuple (nontensor activations)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, inp):
        if isinstance(inp, _NT):
            return _NT(torch.relu(self.lin(inp.x)), inp.y)
        if isinstance(inp, dict):
            return {"x": torch.relu(self.lin(inp["x"]))}
        return {"x": torch.relu(self.lin(inp))}


class _Unbox(nn.Module):
    def forward(self, inp):
        return inp["x"] if isinstance(inp, dict) else inp.x


def nontensor_activations(E) -> None:
    torch.manual_seed(42)
    model = nn.Sequential(_Boxed(), _Boxed(), _Boxed(), _Unbox())
    ref = copy.deepcopy(model)
    for m in model:
        E.fully_shard(m)
    E.fully_shard(model)
    _train(E, model, ref, lambda s, r: _randn(10 * s + r, 2, DIM), _sum)


class _TwiceUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def multi_forward_module(E) -> None:
    torch.manual_seed(42)
    model = _TwiceUsed()
    ref = copy.deepcopy(model)
    E.fully_shard(model.inner, reshard_after_forward=W)
    E.fully_shard(model, reshard_after_forward=W)
    _train(E, model, ref, lambda s, r: _randn(r, 8, 4), _sum)


def explicit_prefetching(E) -> None:
    torch.manual_seed(42)
    model = Transformer(n_layers=4)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        E.fully_shard(layer)
    E.fully_shard(model)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if i < len(layers) - 2:
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        if i >= 2:
            layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])
    _train(E, model, ref, lambda s, r: _ids(r), _sum, opt=torch.optim.AdamW)


def microbatching_1f1b(E) -> None:
    """test_1f1b_microbatching (explicit unshard, reshard after backward only on the last)."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        E.fully_shard(layer, reshard_after_forward=False)
    E.fully_shard(model, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, E.module_type):
            m.unshard(async_op=True)
    rank = dist.get_rank()
    for i in range(3):
        last = i == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        model.set_reshard_after_backward(last)
        _sum(model, _ids(10 * i + rank)).backward()
        _mean_loss(_sum, ref, [_ids(10 * i + r) for r in range(W)]).backward()
    for opt in (torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)):
        opt.step()
    _check(E.full(model), {n: p.detach() for n, p in ref.named_parameters()}, "params")


def _chunked(model, tokens) -> torch.Tensor:
    h = model(tokens, skip_head=True)
    grads, total = [], torch.zeros(())
    for chunk in torch.chunk(h.detach(), 4, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = model.head(chunk).sum()
        total = total + loss.detach()
        loss.backward()
        grads.append(chunk.grad)
    h.backward(torch.cat(grads, dim=1))
    return total


def partial_group_tied_chunks(E) -> None:
    """test_partial_group_forward_then_standalone (weight tying, reshard_after_forward=1)."""
    torch.manual_seed(42)
    model = ChunkedHead(tie=True)
    ref = copy.deepcopy(model)
    E.fully_shard(model.body, reshard_after_forward=1)
    E.fully_shard([model.embed, model.norm, model.head], reshard_after_forward=1)
    E.fully_shard(model, reshard_after_forward=1)
    o, ro = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    rank = dist.get_rank()
    for step in range(2):
        _chunked(model, _ids(10 * step + rank, seq=16))
        for r in range(W):
            _chunked(ref, _ids(10 * step + r, seq=16))
        for p in ref.parameters():
            p.grad.div_(W)
        for op in (o, ro):
            op.step()
            op.zero_grad()
    _check(E.full(model), {n: p.detach() for n, p in ref.named_parameters()}, "params")


def clipped(E) -> None:
    """test_fully_shard_clip_grad_norm_'s loop, with ``clip_grad_norm_`` imported before any
    ``fully_shard``: the norm of the whole gradients on every rank."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(), MLP())
    ref = copy.deepcopy(model)
    for m in model:
        E.fully_shard(m)
    E.fully_shard(model)
    _train(E, model, ref, lambda s, r: _randn(10 * s + r, 4, DIM), _sum, max_norm=0.05)


def frozen_mixed_per_group(E) -> None:
    """test_fully_shard_frozen: biases frozen in every group, one whole group frozen."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(), MLP(), MLP())
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for n, p in m.named_parameters():
            p.requires_grad_(not (n.endswith("bias") or n.startswith("1.")))
    for m in model:
        E.fully_shard(m)
    E.fully_shard(model)
    _train(E, model, ref, lambda s, r: _randn(10 * s + r, 4, DIM), _sum)


def to_float64_after_init(E) -> None:
    """test_fully_shard_training's ``test_to_float64_after_init``: ``model.to(torch.float64)`` after
    ``fully_shard``, then the optimizer, float64 inputs."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(), MLP(), MLP())
    ref = copy.deepcopy(model).to(torch.float64)
    for m in model:
        E.fully_shard(m)
    E.fully_shard(model)
    model.to(torch.float64)
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.float64}, dtypes
    _train(E, model, ref, lambda s, r: _randn(10 * s + r, 4, DIM).double(), _sum)


SCENARIOS = {
    "reshard_after_forward=2": lambda E: reshard_after_forward_int(E, 2),
    "reshard_after_forward=1": lambda E: reshard_after_forward_int(E, 1),
    "reshard_after_forward=3 refused": reshard_after_forward_bad_int,
    "set_unshard_in_backward(False), AC wrapper, list groups": unshard_in_backward_off,
    "_set_unshard_async_op(True)": unshard_async_op,
    "backward prefetch inside nested AC wrappers": backward_prefetch_inside_ac,
    "torch's register_fsdp_forward_method": torch_register_fsdp_forward_method,
    "unused forward module": unused_forward_module,
    "nontensor activations (dict, namedtuple)": nontensor_activations,
    "module used twice in forward": multi_forward_module,
    "explicit prefetching": explicit_prefetching,
    "1F1B microbatching": microbatching_1f1b,
    "partial list group, tied, chunked head": partial_group_tied_chunks,
    "frozen parameters mixed per group": frozen_mixed_per_group,
    "clip_grad_norm_ bound before fully_shard": clipped,
    "model.to(torch.float64) after fully_shard": to_float64_after_init,
}


# W = 4, where an int reshard_after_forward other than 1 and W is FSDP2's smaller world after
# forward (2: each rank keeps half of each parameter, backward gathers within 2 consecutive ranks)
SCENARIOS_W4 = {
    "reshard_after_forward=2 at W = 4": lambda E: reshard_after_forward_int(E, 2),
    "reshard_after_forward=3 refused at W = 4": reshard_after_forward_bad_int,
}


def w2_rows() -> dict:
    """:data:`SCENARIOS` and those of _fsdp2_scenario_rows.py, every row of the W = 2 run."""
    import _fsdp2_scenario_rows  # imports this module: late, not at the top

    return {**SCENARIOS, **_fsdp2_scenario_rows.ROWS}


def all_scenarios(rank: int, world: int, rows: str = "W2", only: str = "") -> dict[str, dict[str, str]]:
    """Every scenario with both engines: ``{scenario: {engine: "ok" | error}}``; ``rows="W4"``:
    those of :data:`SCENARIOS_W4` on 4 ranks; ``only``: the rows whose name contains it."""
    global W
    W = world
    scenarios = SCENARIOS_W4 if rows == "W4" else w2_rows()
    scenarios = {k: v for k, v in scenarios.items() if only in k}
    assert world == (4 if rows == "W4" else 2)
    out: dict[str, dict[str, str]] = {}
    for engine in ("fsdp2", "blockshard"):
        E = Engine(engine)
        for name, fn in scenarios.items():
            try:
                fn(E)
                result = "ok"
            except Exception as e:  # the test reports every row
                result = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            out.setdefault(name, {})[engine] = result
            dist.barrier()
    return out
