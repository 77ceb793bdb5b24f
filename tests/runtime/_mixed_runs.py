"""Spawned-rank runs for test_mixed_dtypes.py: a tiny Llama whose attention weights are frozen in
bf16 (the rest trainable fp32), each decoder layer one group of two dtypes, trained by blockshard,
FSDP2 or one process, optionally under ``MixedPrecisionPolicy(bf16, fp32)``."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import blockshard
from blockshard._tiny import text_batches, tiny_llama

STEPS = 3


def _model():
    model = tiny_llama()
    for layer in model.model.layers:
        layer.self_attn.to(torch.bfloat16).requires_grad_(False)
    return model


def _patch(model) -> None:
    """Attention computes in bf16, its weights' dtype (inputs cast in, the output cast back)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        forward = attn.forward

        def cast_forward(hidden_states, *args, _f=forward, **kwargs):
            kwargs = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in kwargs.items()}  # fmt: skip
            if isinstance(kwargs.get("position_embeddings"), tuple):
                kwargs["position_embeddings"] = tuple(t.to(torch.bfloat16) for t in kwargs["position_embeddings"])
            out = _f(hidden_states.to(torch.bfloat16), *args, **kwargs)
            return (out[0].to(hidden_states.dtype), *out[1:])

        attn.forward = cast_forward


def _train(model) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids, labels in text_batches(STEPS, 2, 16):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model, engine: str) -> dict:
    if engine == "blockshard":
        return blockshard.full_state_dict(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def run(rank: int, world: int, engine: str, mp: bool) -> dict:
    model = _model()
    _patch(model)
    if engine != "single":
        if engine == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            fully_shard = blockshard.fully_shard
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    losses = _train(model)
    state = model.state_dict() if engine == "single" else _full(model, engine)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in state.items()}}
