"""Training scenarios run on W spawned gloo ranks and on one process, for tests/runtime.

Every scenario returns full parameters by name (and a few facts) so the tests can compare the
sharded run against the single-process reference. Importable by spawned ranks (top-level functions).
"""

from __future__ import annotations

import copy

import torch

from blockshard._tiny import OddMLP, mlp_batches, text_batches, tiny_llama

STEPS = 3
LR = 1e-2


def _llama_loss(model, batch):
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def _mlp_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _model(kind: str):
    return tiny_llama() if kind == "llama" else OddMLP()


def _batches(kind: str, batch_size: int, micro: int = 1):
    n = STEPS * micro
    return text_batches(n, batch_size, 16) if kind == "llama" else mlp_batches(n, batch_size)


def _loss_fn(kind: str):
    return _llama_loss if kind == "llama" else _mlp_loss


def _blocks(model, kind: str):
    return model.model.layers if kind == "llama" else model.blocks


def _slice(batch, rank: int, world: int):
    return tuple(t[rank::world] for t in batch)


# -- single process references ----------------------------------------------------------------
def reference(
    _rank: int, _world: int, kind: str, batch_size: int, micro: int = 1, bf16: bool = False, split: int = 0
) -> dict:
    """Plain training on one process: AdamW, ``micro`` micro-batches accumulated per step. With
    ``split=W``: each step's gradient is the average of the W slices' gradients (``_slice``: rank r's
    share), summed in rank order and divided by W, as gloo's reduce-scatter ``AVG`` averages W
    ranks' (tests/runtime/_average.py), which the split-batch run must then equal bitwise."""
    if split:
        return _split_reference(kind, batch_size, split)
    model = _model(kind)
    loss_fn = _loss_fn(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _batches(kind, batch_size, micro)
    low = None
    if bf16:  # parameters in bf16, buffers (rotary frequencies) untouched: what param_dtype does
        low = copy.deepcopy(model)
        for p in low.parameters():
            p.data = p.data.to(torch.bfloat16)
    for step in range(STEPS):
        if low is not None:  # bf16 compute on a copy, fp32 master weights and optimizer
            with torch.no_grad():
                for p16, p32 in zip(low.parameters(), model.parameters(), strict=True):
                    p16.copy_(p32)
        for m in range(micro):
            loss = loss_fn(low if low is not None else model, batches[step * micro + m])
            loss.backward()
        if low is not None:
            for p16, p32 in zip(low.parameters(), model.parameters(), strict=True):
                p32.grad = p16.grad.float()
                p16.grad = None
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _split_reference(kind: str, batch_size: int, world: int) -> dict:
    model = _model(kind)
    loss_fn = _loss_fn(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params = list(model.parameters())
    for batch in _batches(kind, batch_size):
        total: list[torch.Tensor] | None = None
        for r in range(world):  # rank r's gradient, as that rank computes it alone
            loss_fn(model, _slice(batch, r, world)).backward()
            grads = [p.grad.clone() for p in params]
            total = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
            opt.zero_grad()
        assert total is not None
        for p, t in zip(params, total, strict=True):
            p.grad = t / world
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- sharded runs -----------------------------------------------------------------------------
def sharded(rank: int, world: int, kind: str, batch_size: int, options: dict) -> dict:
    """The same training under blockshard; ``options``: split, micro, reshard_after_forward, bf16."""
    import blockshard
    from blockshard.runtime import group_layouts, local_buffers

    model = _model(kind)
    mp_policy = None
    if options.get("bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raf = options.get("reshard_after_forward", True)
    for block in _blocks(model, kind):
        blockshard.fully_shard(block, reshard_after_forward=raf, mp_policy=mp_policy)
    blockshard.fully_shard(model, mp_policy=mp_policy)
    loss_fn = _loss_fn(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    micro = options.get("micro", 1)
    batches = _batches(kind, batch_size, micro)
    for step in range(STEPS):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            batch = batches[step * micro + m]
            if options.get("split"):
                batch = _slice(batch, rank, world)
            loss_fn(model, batch).backward()
        opt.step()
        grad_numel = {k: b["grad"].numel() for k, b in local_buffers(model).items() if "grad" in b}
        opt.zero_grad()
    layouts = group_layouts(model)
    buffers = local_buffers(model)
    facts = {
        "segment_numel": {k: v.segment_numel for k, v in layouts.items()},
        "local_numel": {k: b["local"].numel() for k, b in buffers.items()},
        "grad_numel": grad_numel,
        "grad_freed_by_zero_grad": all("grad" not in b for b in buffers.values()),
        "gathered_freed": all(
            blockshard.runtime._api._state_of(m).buffers.gathered.untyped_storage().size() == 0
            for m in model.modules()
            if blockshard.is_sharded(m) and blockshard.runtime._api._state_of(m).buffers.layout is not None
        ),
        "param_shapes": [tuple(p.shape) for p in model.parameters()],
    }
    return {"params": blockshard.full_state_dict(model), "facts": facts}


def prefetch_and_state_dicts(rank: int, world: int) -> dict:
    """Record the all-gathers of step 2 (after the order is known) and return both state dicts."""
    import blockshard
    from blockshard.runtime import ShardedState, _api
    from blockshard.runtime.core._buffers import ParamBuffers

    model = OddMLP()
    for block in model.blocks:
        blockshard.fully_shard(block)
    blockshard.fully_shard(model)
    names = {id(_api._state_of(m).buffers): n for n, m in model.named_modules() if blockshard.is_sharded(m)}
    events: list[tuple[str, str]] = []
    real_unshard, real_wait = ParamBuffers.unshard, ParamBuffers.wait_unshard

    def unshard(self, *, async_op=False):
        if self.sharded_state is ShardedState.SHARDED:
            events.append(("issue", names[id(self)], async_op))
        return real_unshard(self, async_op=async_op)

    def wait_unshard(self):
        events.append(("wait", names[id(self)], self.sharded_state is ShardedState.UNSHARDING))
        return real_wait(self)

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, batch in enumerate(mlp_batches(2, 8)):
        if step == 1:
            ParamBuffers.unshard, ParamBuffers.wait_unshard = unshard, wait_unshard
        _mlp_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    ParamBuffers.unshard, ParamBuffers.wait_unshard = real_unshard, real_wait
    shards = {k: (v.tensor.clone(), v.start, v.global_shape) for k, v in blockshard.sharded_state_dict(model).items()}
    return {"events": events, "shards": shards, "full": blockshard.full_state_dict(model)}
