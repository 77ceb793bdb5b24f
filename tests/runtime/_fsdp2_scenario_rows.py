"""More of FSDP2's own test scenarios (test_fully_shard_{training,autograd,frozen,comm}.py), rebuilt
with tiny models for test_fsdp2_scenarios.py; the helpers, models and the runner are in
_fsdp2_scenario_runs.py. Each row names the FSDP2 test method it rebuilds (torch main, read
2026-12); what a row leaves out of the method (CUDA delays, FSDP2's private event records) is said
in its docstring.
"""

from __future__ import annotations

import copy
import gc

import _fsdp2_scenario_runs as base
import _inproc
import torch
import torch.distributed as dist
from _fsdp2_scenario_runs import DIM, MLP, ChunkedHead, Transformer, _check, _chunked, _ids, _randn, _sum
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import Shard


def _ref_params(ref: nn.Module) -> dict[str, torch.Tensor]:
    return {base._plain(n): p.detach() for n, p in ref.named_parameters()}


def _shard_blocks(E, model: Transformer, **kwargs) -> None:
    for layer in model.layers:
        E.fully_shard(layer, **kwargs)
    E.fully_shard(model, **kwargs)


def _train_ids(E, model, ref, **kwargs) -> None:
    base._train(E, model, ref, lambda s, r: _ids(10 * s + r), _sum, **kwargs)


# -- test_fully_shard_training.py --------------------------------------------------------------
class _Paramless(nn.Module):
    def forward(self, x, ys):
        return x + ys[0] + ys[1] + 1


def root_paramless_nested_inputs(E) -> None:
    """test_root_move_forward_input_to_device: a root without parameters, a tuple among its inputs."""
    model = _Paramless()
    E.fully_shard(model)
    x, ys = _randn(0, 3), (_randn(1, 3), _randn(2, 3))
    torch.testing.assert_close(model(x, ys), x + ys[0] + ys[1] + 1)


class _ParamOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(_randn(3, 4, 4))

    def forward(self):
        return self.weight @ self.weight


def root_no_forward_inputs(E) -> None:
    """test_root_no_forward_inputs: ``model()`` with no inputs trains as one process."""
    model = _ParamOnly()
    ref = copy.deepcopy(model)
    E.fully_shard(model)
    base._train(E, model, ref, lambda s, r: None, lambda m, x: m().sum())


def registration_after_forward_backward(E, raf) -> None:
    """test_param_registration_after_forward / _after_backward: which groups hold their gathered
    parameters after forward (the root keeps its own with ``None``; ``reshard()`` frees them), none
    after backward, and the full values are the model's throughout."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(3), MLP(3))
    ref = copy.deepcopy(model)
    E.fully_shard(model[0].in_proj, reshard_after_forward=raf)
    E.fully_shard(model[0].out_proj, reshard_after_forward=raf)
    E.fully_shard(model, reshard_after_forward=raf)
    groups = (model[0].in_proj, model[0].out_proj, model)
    model(_randn(0, 2, 3))
    got = [E.gathered(m) for m in groups]
    want = [raf is False] * 2 + [raf is None or raf is False]
    assert got == want, f"gathered after forward {got}, want {want}"
    _check(E.full(model), _ref_params(ref), "params after forward")
    for m in groups:
        m.reshard()
    assert not any(E.gathered(m) for m in groups), "gathered after reshard()"
    model(_randn(0, 2, 3)).sum().backward()
    assert not any(E.gathered(m) for m in groups), [E.gathered(m) for m in groups]
    _check(E.full(model), _ref_params(ref), "params after backward")


def single_group_uneven(E) -> None:
    """test_train_parity_single_group_shard_dim0, shapes (7, 15), (15, 3): one group, odd dims."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(7, 15), nn.ReLU(), nn.Linear(15, 3))
    ref = copy.deepcopy(model)
    E.fully_shard(model)
    base._train(E, model, ref, lambda s, r: _randn(10 * s + r, 4, 7), _sum)


def multi_group(E, **kwargs) -> None:
    """test_train_parity_multi_group(_cpu_offload_eager), without the CUDA sleeps: block groups."""
    torch.manual_seed(42)
    model = Transformer(n_layers=3)
    ref = copy.deepcopy(model)
    _shard_blocks(E, model, **kwargs)
    _train_ids(E, model, ref)


def non_root_forward_backward(E) -> None:
    """test_non_root_forward_backward: a step through the root, then one through ``model[0]``."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(), MLP(), MLP())
    ref = copy.deepcopy(model)
    for m in model:
        E.fully_shard(m)
    E.fully_shard(model)
    o, ro = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    rank = dist.get_rank()
    for which in (lambda m: m, lambda m: m[0]):
        loss = _sum(which(model), _randn(rank, 8, DIM))
        loss.backward()
        want = base._mean_loss(_sum, which(ref), [_randn(r, 8, DIM) for r in range(base.W)])
        want.backward()
        dist.all_reduce(got := loss.detach().clone())
        torch.testing.assert_close(got / base.W, want.detach())
        for op in (o, ro):
            op.step()
            op.zero_grad()
    _check(E.full(model), _ref_params(ref), "params")


def ac_composable_tied_groups(E) -> None:
    """test_train_parity_with_activation_checkpointing, "composable" x "mem_eff_weight_tied":
    ``checkpoint(block)``, the tied embedding and output in one list group, no reshard."""
    torch.manual_seed(42)
    model = Transformer(n_layers=3, tie=True)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        checkpoint(layer)
    E.fully_shard([model.tok_embeddings, model.output], reshard_after_forward=False)
    _shard_blocks(E, model, reshard_after_forward=False)
    _train_ids(E, model, ref)


class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        return self.b(self.a(x).float())  # a float32 input to b: cast only by b's own hook


def grouped_cast_forward_inputs(E) -> None:
    """test_grouped_module_cast_forward_inputs: ``cast_forward_inputs`` reaches every module of a
    list group (bfloat16 parameters, a float32 activation between them)."""
    torch.manual_seed(42)
    model = _TwoLinear()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    E.fully_shard([model.a, model.b], mp_policy=mp)
    E.fully_shard(model, mp_policy=mp)
    out = model(_randn(0, 2, DIM))
    assert out.dtype == torch.bfloat16, out.dtype
    out.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"


def _chunked_groups(E, model: ChunkedHead, **kwargs) -> None:
    E.fully_shard(model.embed, **kwargs)
    E.fully_shard(model.body, **kwargs)
    E.fully_shard([model.norm, model.head], **kwargs)
    E.fully_shard(model, **kwargs)


def partial_group_grad_accum_chunked(E) -> None:
    """test_partial_group_forward_grad_accum_chunked: three microbatches of the chunked head, the
    gradients synchronized on the last only."""
    torch.manual_seed(42)
    model = ChunkedHead()
    ref = copy.deepcopy(model)
    _chunked_groups(E, model, reshard_after_forward=True)
    rank = dist.get_rank()
    for i in range(3):
        model.set_requires_gradient_sync(i == 2)
        model.set_is_last_backward(i == 2)
        _chunked(model, _ids(10 * i + rank, seq=16))
        for r in range(base.W):
            _chunked(ref, _ids(10 * i + r, seq=16))
    for p in ref.parameters():
        p.grad.div_(base.W)
    for opt in (torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)):
        opt.step()
    _check(E.full(model), _ref_params(ref), "params")


def partial_group_reshard_toggle(E) -> None:
    """test_partial_group_reshard_toggle (no tying, the list group not resharded after forward):
    reshard after forward and backward off for the chunk loop, then on, and ``head.reshard()``."""
    torch.manual_seed(42)
    model = ChunkedHead()
    ref = copy.deepcopy(model)
    E.fully_shard(model.embed)
    E.fully_shard(model.body)
    E.fully_shard([model.norm, model.head], reshard_after_forward=False)
    E.fully_shard(model)
    o, ro = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    rank = dist.get_rank()
    for step in range(2):
        tokens = _ids(10 * step + rank, seq=16)
        h = model(tokens, skip_head=True)
        model.head.set_reshard_after_forward(False)
        model.head.set_reshard_after_backward(False)
        grads = []
        for chunk in torch.chunk(h.detach(), 4, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            model.head(chunk).sum().backward()
            grads.append(chunk.grad)
            assert E.gathered(model.head), f"head group resharded inside the chunk loop, step {step}"
        model.head.set_reshard_after_forward(True)
        model.head.set_reshard_after_backward(True)
        model.head.reshard()
        assert not E.gathered(model.head), "head.reshard() left the group gathered"
        h.backward(torch.cat(grads, dim=1))
        for r in range(base.W):
            _chunked(ref, _ids(10 * step + r, seq=16))
        for p in ref.parameters():
            p.grad.div_(base.W)
        for op in (o, ro):
            op.step()
            op.zero_grad()
    _check(E.full(model), _ref_params(ref), "params")


class _Raiser(nn.Module):
    def __init__(self, wrapped: nn.Module) -> None:
        super().__init__()
        self.wrapped, self.armed = wrapped, False

    def forward(self, x):
        if self.armed:
            raise RuntimeError("boom")
        return self.wrapped(x)


def reset_iter_state_after_exception(E) -> None:
    """test_reset_iter_state_after_exception: a forward raises midway; ``reset_iter_state()``; the
    next steps train as one process."""
    torch.manual_seed(42)
    model = ChunkedHead()
    model.body = _Raiser(model.body)
    ref = copy.deepcopy(model)
    E.fully_shard([model.norm, model.head])
    E.fully_shard(model)
    model.body.armed = True
    message = ""
    try:
        model(_ids(0, seq=16), skip_head=True)
    except RuntimeError as e:
        message = str(e)
    assert message == "boom", f"the armed forward raised {message!r}"
    model.body.armed = False
    model.reset_iter_state()
    base._train(E, model, ref, lambda s, r: _ids(10 * s + r, seq=16), _sum, steps=2)


def double_forward_nested_ac(E) -> None:
    """test_double_forward_with_nested_fsdp_and_checkpoint ("composable", no reshard): two
    forwards before one backward (a DPO-style loss), groups nested three deep."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        checkpoint(layer)
        E.fully_shard(layer.attention, reshard_after_forward=False)
        E.fully_shard(layer.feed_forward, reshard_after_forward=False)
        E.fully_shard(layer, reshard_after_forward=False)
    E.fully_shard(model, reshard_after_forward=False)

    def loss_fn(m, x):
        return (m(x[0]).mean() - m(x[1]).mean()).pow(2)

    base._train(E, model, ref, lambda s, r: (_ids(10 * s + r), _ids(10 * s + r + 5)), loss_fn)


def double_partial_forward(E) -> None:
    """test_double_partial_forward_then_backward: two ``skip_head`` forwards, then one backward;
    the head, unused, gets no gradient (and so no update)."""
    torch.manual_seed(42)
    model = ChunkedHead()
    ref = copy.deepcopy(model)
    E.fully_shard([model.norm, model.head])
    E.fully_shard(model)

    def loss_fn(m, x):
        return m(x[0], skip_head=True).sum() + m(x[1], skip_head=True).sum()

    base._train(E, model, ref, lambda s, r: (_ids(10 * s + r, seq=16), _ids(10 * s + r + 5, seq=16)), loss_fn)
    assert model.head.weight.grad is None, "the unused head got a gradient"


def shared_params_ac(E) -> None:
    """test_train_parity_with_shared_params (tied, ``checkpoint(block)``, reshard after forward)."""
    torch.manual_seed(42)
    model = Transformer(n_layers=3, tie=True)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        checkpoint(layer)
    _shard_blocks(E, model)
    _train_ids(E, model, ref)


class _Tied(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok_embeddings, self.output = nn.Embedding(vocab, 16), nn.Linear(16, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        return self.output(self.tok_embeddings(ids))


def tied_uneven(E) -> None:
    """test_train_shared_params_uneven_shard: a tied vocabulary of W * 4 + 1 rows in one list
    group (the last rank's piece padded); trains as one process (the method checks every row moves)."""
    vocab = base.W * 4 + 1
    torch.manual_seed(42)
    model = _Tied(vocab)
    ref = copy.deepcopy(model)
    E.fully_shard([model.tok_embeddings, model.output])
    E.fully_shard(model)

    def loss_fn(m, ids):
        return nn.functional.cross_entropy(m(ids).view(-1, vocab), ids.view(-1))

    base._train(E, model, ref, lambda s, r: _ids(10 * s + r, vocab=vocab), loss_fn, opt=torch.optim.AdamW)


def tied_in_separate_groups_refused(E) -> None:
    """test_shared_params_separate_fsdp_groups_error: a weight tied across two separate groups
    raises a ValueError by the first forward (FSDP2: "already managed by another")."""
    model = _Tied(17)
    message = ""
    try:
        E.fully_shard(model.tok_embeddings)
        E.fully_shard(model.output)
        E.fully_shard(model)
        model(_ids(0, vocab=17))
    except ValueError as e:
        message = str(e)
    assert message, "a weight tied across two groups was accepted"


def layer_by_layer_shard(E) -> None:
    """test_layer_by_layer_shard_no_false_positive: blocks built and sharded one at a time with a
    ``gc.collect()`` between (ids reused), then the root."""
    torch.manual_seed(42)
    model, ref = nn.Sequential(), nn.Sequential()
    for _ in range(4):
        block = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM, bias=False))
        ref.append(copy.deepcopy(block))
        model.append(block)
        E.fully_shard(block)
        gc.collect()
    E.fully_shard(model)
    base._train(E, model, ref, lambda s, r: _randn(10 * s + r, 2, 4, DIM), _sum)


def gradient_accumulation(E, mode: str, raf) -> None:
    """test_gradient_accumulation (1-D mesh, no offload), without its collective counts: three
    microbatches, gradient sync (and with "all", reshard after backward) on the last only, for
    every group ("all"), the root's own ("root_only") or the first two MLPs ("some_mlps")."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, DIM), MLP(), MLP(), MLP())
    ref = copy.deepcopy(model)
    for m in model[1:]:
        E.fully_shard(m, reshard_after_forward=raf)
    E.fully_shard(model, reshard_after_forward=raf)

    def sync(last: bool) -> None:
        if mode == "all":
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        elif mode == "root_only":
            model.set_requires_gradient_sync(last, recurse=False)
        else:
            for m in model[1:3]:
                m.set_requires_gradient_sync(last)

    _train_microbatches(E, model, ref, sync, batch=2)


def _train_microbatches(E, model, ref, sync, batch: int) -> None:
    """Two steps of three microbatches (``sync(last)`` before each), Adam on both models; every rank
    its own microbatch, ``ref`` their mean; the parameters checked at the end."""
    o, ro = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    rank = dist.get_rank()
    for step in range(2):
        for i in range(3):
            sync(i == 2)
            _sum(model, _randn(100 * step + 10 * i + rank, batch, DIM)).backward()
            base._mean_loss(_sum, ref, [_randn(100 * step + 10 * i + r, batch, DIM) for r in range(base.W)]).backward()
        for op in (o, ro):
            op.step()
            op.zero_grad(set_to_none=step % 2 == 0)
    _check(E.full(model), _ref_params(ref), "params")


def hsdp_replicate_only(E) -> None:
    """test_train_parity_hsdp at W = 2 (as FSDP2 runs it there: a (2, 1) replicate x shard mesh),
    ``checkpoint`` per MLP, CPU offload, gradient sync on the last of three microbatches."""
    mesh = init_device_mesh("cpu", (base.W, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(42)
    model = nn.Sequential(nn.LayerNorm(DIM, bias=False), MLP(), MLP())
    ref = copy.deepcopy(model)
    kwargs = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    for m in model:
        checkpoint(m)
        E.fully_shard(m, **kwargs)
    E.fully_shard(model, **kwargs)
    _train_microbatches(E, model, ref, model.set_requires_gradient_sync, batch=8)


def shard_dim1_contiguous(E) -> None:
    """test_shard_placement_fn_contiguous_params_grads (W = 2): weights placed ``Shard(1)``;
    parameters contiguous in forward and after backward, gradients contiguous."""
    torch.manual_seed(42)
    model = MLP(4)

    def placement(p):
        return Shard(1) if p.ndim > 1 else Shard(0)

    for m in (model.in_proj, model.out_proj, model):
        E.fully_shard(m, shard_placement_fn=placement)
    seen = []
    for m in (model.in_proj, model.out_proj):
        m.register_forward_pre_hook(lambda m, args: seen.extend(p.is_contiguous() for p in m.parameters()))
    assert all(p.is_contiguous() for p in model.parameters()), "a parameter not contiguous after fully_shard"
    model(_randn(0, 2, 4)).sum().backward()
    assert seen and all(seen), f"contiguous in forward: {seen}"
    assert all(p.is_contiguous() and p.grad.is_contiguous() for p in model.parameters()), (
        "not contiguous after backward"
    )


# -- test_fully_shard_autograd.py --------------------------------------------------------------
class _Listed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, inp):
        out = torch.relu(self.lin(inp[0]))
        return [out] if isinstance(inp, list) else (out,)


class _ToContainer(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return self.kind([x])


def nontensor_list_tuple(E) -> None:
    """test_nontensor_activations, the ``list`` and ``tuple`` containers."""
    for kind in (list, tuple):
        torch.manual_seed(42)
        model = nn.Sequential(_ToContainer(kind), _Listed(), _Listed(), _Listed())
        ref = copy.deepcopy(model)
        for m in model[1:]:
            E.fully_shard(m)
        E.fully_shard(model)
        base._train(E, model, ref, lambda s, r: _randn(10 * s + r, 2, DIM), lambda m, x: m(x)[0].sum())


# -- test_fully_shard_frozen.py ----------------------------------------------------------------
def frozen_after_init_ac(E) -> None:
    """test_train_mixed_requires_grad_per_group, frozen after init, ``checkpoint`` per MLP,
    ``reshard_after_forward=2``: only biases train (BitFit)."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(), MLP(), MLP())
    ref = copy.deepcopy(model)
    for m in model:
        checkpoint(m)
        E.fully_shard(m, reshard_after_forward=2)
    E.fully_shard(model, reshard_after_forward=2)
    for m in (model, ref):
        for n, p in m.named_parameters():
            p.requires_grad_("bias" in n)
    base._train(E, model, ref, lambda s, r: _randn(10 * s + r, 8, DIM), _sum)


def frozen_across_groups(E) -> None:
    """test_train_mixed_requires_grad_across_groups (unfreeze): six linears each its own root, the
    first frozen, a no-grad step between, unfrozen for the last step."""
    torch.manual_seed(42)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(DIM, DIM), nn.ReLU())])
    ref = copy.deepcopy(model)
    for m in model:
        if isinstance(m, nn.Linear):
            E.fully_shard(m, reshard_after_forward=2)
    o, ro = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for m in (model, ref):
        m[0].requires_grad_(False)
    rank = dist.get_rank()
    for step in range(3):
        if step == 2:
            for m in (model, ref):
                m[0].requires_grad_(True)
        if step == 1:
            with torch.no_grad():
                got, want = _sum(model, _randn(rank, 8, DIM)), _sum(ref, _randn(rank, 8, DIM))
            torch.testing.assert_close(got, want)
            continue
        _sum(model, _randn(10 * step + rank, 8, DIM)).backward()
        base._mean_loss(_sum, ref, [_randn(10 * step + r, 8, DIM) for r in range(base.W)]).backward()
        for op in (o, ro):
            op.step()
            op.zero_grad(set_to_none=step % 2 == 0)
    _check(E.full(model), _ref_params(ref), "params")


class _MultiForwardFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_0, self.layer_no_grad, self.layer_with_grad = (nn.Linear(5, 5) for _ in range(3))
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(torch.relu(self.layer_with_grad(x)))
            with torch.no_grad():
                x += torch.relu(self.layer_with_grad(x))  # in place: x keeps its autograd history
        return x


def multi_forward_mixed_requires_grad(E) -> None:
    """test_multi_forward_mixed_requires_grad (``reshard_after_forward=2``): a trainable and a
    frozen linear each run three times, once more under ``no_grad``."""
    torch.manual_seed(42)
    model = _MultiForwardFrozen()
    ref = copy.deepcopy(model)
    for m in (model.layer_0, model.layer_no_grad, model.layer_with_grad, model):
        E.fully_shard(m, reshard_after_forward=2)
    base._train(E, model, ref, lambda s, r: _randn(10 * s + r, 8, 5), _sum)


# -- test_fully_shard_comm.py ------------------------------------------------------------------
def _counts(model, ids) -> tuple[int, int, int]:
    """All-gathers in forward; all-gathers and reduce-scatters in backward."""
    with _inproc.CollectiveLog() as fwd:
        out = model(ids)
    with _inproc.CollectiveLog() as bwd:
        out.sum().backward()
    return fwd.count("all_gather"), bwd.count("all_gather"), bwd.count("reduce_scatter")


def communication_count(E, raf) -> None:
    """test_fully_shard_communication_count: one all-gather per group in forward; in backward one
    per group that resharded (the root not with ``None``), one reduce-scatter per group."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    _shard_blocks(E, model, reshard_after_forward=raf)
    got = _counts(model, _ids(dist.get_rank()))
    want = (3, {True: 3, False: 0, None: 2}[raf], 3)
    assert got == want, f"(forward all-gathers, backward all-gathers, reduce-scatters) {got}, want {want}"


def manual_reshard_after_forward_false(E) -> None:
    """test_manual_reshard_with_reshard_after_forward_false: ``reshard()`` on every group after a
    forward that kept them gathered; backward gathers each again."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    _shard_blocks(E, model, reshard_after_forward=False)
    with _inproc.CollectiveLog() as fwd:
        out = model(_ids(dist.get_rank()))
    for m in model.modules():
        if isinstance(m, E.module_type):
            m.reshard()
    with _inproc.CollectiveLog() as bwd:
        out.sum().backward()
    got = (fwd.count("all_gather"), bwd.count("all_gather"), bwd.count("reduce_scatter"))
    assert got == (3, 3, 3), got


def set_reshard_after_forward_root_only(E) -> None:
    """test_set_reshard_after_forward (True, ``recurse=False``): built with False, the root alone
    set to reshard; backward gathers the root only."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    _shard_blocks(E, model, reshard_after_forward=False)
    model.set_reshard_after_forward(True, recurse=False)
    got = _counts(model, _ids(dist.get_rank()))
    assert got == (3, 1, 3), got


def max_input_buffers(E) -> None:
    """test_set_reduce_scatter_max_input_buffers (1-D mesh, float32): a cap of 2 trains as the default."""
    torch.manual_seed(42)
    model = Transformer(n_layers=2)
    ref = copy.deepcopy(model)
    _shard_blocks(E, model)
    model.set_reduce_scatter_max_input_buffers(2)
    _train_ids(E, model, ref, opt=torch.optim.AdamW)


def max_input_buffers_validation(E) -> None:
    """test_set_reduce_scatter_max_input_buffers_validation: 0 a ValueError, 2.5 and True a TypeError."""
    model = E.fully_shard(nn.Linear(16, 16))
    for bad, error in ((0, ValueError), (2.5, TypeError), (True, TypeError)):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except error:
            continue
        raise AssertionError(f"set_reduce_scatter_max_input_buffers({bad!r}) raised no {error.__name__}")
    model.set_reduce_scatter_max_input_buffers(2)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused_lin, self.lin = nn.Linear(1, 1), nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.lin(x))


def list_group_unused_module(E) -> None:
    """test_fully_shard_multi_module_unused_module, as parity (the method records FSDP2's private
    unshard events): a list group one of whose modules never runs."""
    torch.manual_seed(42)
    model = nn.Sequential(_WithUnused(), _WithUnused(), nn.Linear(16, 16))
    ref = copy.deepcopy(model)
    for m in model[:2]:
        E.fully_shard([m.unused_lin, m.lin])
    E.fully_shard(model)
    base._train(E, model, ref, lambda s, r: _randn(10 * s + r, 2, 16), _sum, opt=torch.optim.AdamW)


def backward_misprefetch(E) -> None:
    """test_backward_misprefetch: ``in_proj`` set to prefetch ``out_proj`` in backward (already done)."""
    torch.manual_seed(42)
    model = MLP(16)
    ref = copy.deepcopy(model)
    for m in (model.in_proj, model.out_proj, model):
        E.fully_shard(m)
    model.in_proj.set_modules_to_backward_prefetch([model.out_proj])
    base._train(E, model, ref, lambda s, r: _randn(r, 2, 16), _sum)


def unshard_no_param_group(E) -> None:
    """test_unshard_no_param_group: ``unshard(async_op=True).wait()`` on a root without parameters."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for m in (model[0], model[1], model):
        E.fully_shard(m)
    model.unshard(async_op=True).wait()


def unshard_without_lazy_init(E) -> None:
    """test_unshard_without_lazy_init: ``unshard()`` before any forward registers the full values."""
    torch.manual_seed(42)
    model = MLP(4)
    ref = copy.deepcopy(model)
    E.fully_shard(model)
    model.unshard()
    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    _check(got, _ref_params(ref), "unsharded params")
    model.reshard()


class _ReduceModule(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(_randn(7, dim, dim))

    def forward(self, x):
        return torch.relu(x @ self.weight)


class _MLPs(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp1, self.mlp2, self.mlp3 = MLP(dim), MLP(dim), MLP(dim)

    def forward(self, ys):
        return self.mlp1(ys[0]) + self.mlp2(ys[1]) + self.mlp3(ys[2])


class _ReduceModel(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.reduce_module1, self.reduce_module2, self.reduce_module3 = (_ReduceModule(dim) for _ in range(3))
        self.mlps = _MLPs(dim)

    def forward(self, x):
        ys = []
        for reduce, mlp in zip(
            (self.reduce_module1, self.reduce_module2, self.reduce_module3), self.mlps.children(), strict=True
        ):
            ys.append(reduce(x))
            if hasattr(mlp, "unshard"):  # sharded (isinstance FSDPModule): overlap its all-gather
                mlp.unshard(async_op=True)
        return self.mlps(ys)


def replicate_over_sharded(E) -> None:
    """test_unshard_async: torch's composable ``replicate`` over a model whose MLPs are sharded
    (``reshard_after_forward=False``), each MLP's all-gather issued early with
    ``unshard(async_op=True)``; DDP all-reduces the rest. Leaves out the method's non-differentiable
    all-reduce of activations in forward (the overlap it exercises is CUDA's)."""
    from torch.distributed._composable import replicate

    torch.manual_seed(42)
    model = _ReduceModel(8)
    ref = copy.deepcopy(model)
    for mlp in (model.mlps.mlp1, model.mlps.mlp2, model.mlps.mlp3):
        E.fully_shard(mlp, reshard_after_forward=False)
    E.fully_shard(model.mlps)
    replicate(model)
    base._train(E, model, ref, lambda s, r: _randn(10 * s + r, 2, 8), _sum)


ROWS = {
    "paramless root, tuple among its inputs": root_paramless_nested_inputs,
    "root forward without inputs": root_no_forward_inputs,
    **{
        f"gathered after forward / backward, reshard_after_forward={raf}": (
            lambda E, raf=raf: registration_after_forward_backward(E, raf)
        )
        for raf in (True, False, 2, None)
    },
    "one group, uneven dims": single_group_uneven,
    "block groups, reshard_after_forward=False": lambda E: multi_group(E, reshard_after_forward=False),
    "block groups, CPUOffloadPolicy": lambda E: multi_group(E, offload_policy=CPUOffloadPolicy(pin_memory=False)),
    "root step, then a non-root step": non_root_forward_backward,
    "composable checkpoint, tied list group": ac_composable_tied_groups,
    "cast_forward_inputs in a list group": grouped_cast_forward_inputs,
    "chunked head, gradient accumulation": partial_group_grad_accum_chunked,
    "chunked head, reshard toggled off and on": partial_group_reshard_toggle,
    "reset_iter_state after a raising forward": reset_iter_state_after_exception,
    "two forwards, one backward, nested groups, checkpoint": double_forward_nested_ac,
    "two partial forwards, one backward": double_partial_forward,
    "shared (tied) parameters, composable checkpoint": shared_params_ac,
    "tied list group, uneven rows": tied_uneven,
    "tied weight in two groups refused": tied_in_separate_groups_refused,
    "layer-by-layer fully_shard with gc": layer_by_layer_shard,
    "Shard(1) placements, contiguous parameters and gradients": shard_dim1_contiguous,
    **{
        f"gradient accumulation, {mode}, reshard_after_forward={raf}": (
            lambda E, mode=mode, raf=raf: gradient_accumulation(E, mode, raf)
        )
        for mode, raf in (("all", False), ("root_only", True), ("some_mlps", 2))
    },
    "HSDP (2, 1) mesh, checkpoint, CPU offload": hsdp_replicate_only,
    "nontensor activations (list, tuple)": nontensor_list_tuple,
    "frozen after init, checkpoint, reshard_after_forward=2": frozen_after_init_ac,
    "frozen across groups, no_grad step, unfrozen": frozen_across_groups,
    "module used thrice, frozen and trainable": multi_forward_mixed_requires_grad,
    **{
        f"collective count, reshard_after_forward={raf}": (lambda E, raf=raf: communication_count(E, raf))
        for raf in (True, False, None)
    },
    "manual reshard() with reshard_after_forward=False": manual_reshard_after_forward_false,
    "set_reshard_after_forward(True, recurse=False)": set_reshard_after_forward_root_only,
    "set_reduce_scatter_max_input_buffers(2)": max_input_buffers,
    "set_reduce_scatter_max_input_buffers refuses 0, 2.5, True": max_input_buffers_validation,
    "list group with a module unused in forward": list_group_unused_module,
    "backward misprefetch": backward_misprefetch,
    "unshard() on a root without parameters": unshard_no_param_group,
    "unshard() before the first forward": unshard_without_lazy_init,
    "replicate over sharded MLPs, unshard(async_op=True)": replicate_over_sharded,
}
