"""Tiny QLoRA models built in code: a tiny Llama whose decoder linears are bitsandbytes 4-bit.

Every function takes ``(rank, world, ...)``; ``world == 0`` is one process without sharding (the
reference). Results are plain tensors (picklable across spawned ranks).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from blockshard._tiny import text_batches, tiny_llama

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# hidden 128 / MLP 352: q_proj holds exactly one nested block (16384 values), gate_proj 2.75, k_proj half
SHAPE = {"hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4, "num_key_value_heads": 2}


def quantize_linears(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    compress_statistics: bool = True,
    quant_storage: torch.dtype = torch.uint8,
    names: tuple[str, ...] = LINEARS,
) -> nn.Module:
    """Replace the ``nn.Linear`` children named ``names`` by frozen bitsandbytes ``Linear4bit``."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if type(child) is not nn.Linear or cname not in names:
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=child.weight.dtype,
                compress_statistics=compress_statistics,
                quant_type=quant_type,
                quant_storage=quant_storage,
            )
            q.weight = bnb.nn.Params4bit(
                child.weight.data.clone(),
                requires_grad=False,
                compress_statistics=compress_statistics,
                quant_type=quant_type,
                quant_storage=quant_storage,
            )
            if child.bias is not None:
                q.bias = child.bias
            setattr(parent, cname, q.to(child.weight.device))  # bitsandbytes quantizes on .to()
    return model


def qlora_llama(seed: int = 0, *, lora: bool = True, **quant) -> nn.Module:
    model = quantize_linears(tiny_llama(seed, **SHAPE), **quant)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    model.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets: peft's bnb LoRA layer
    torch.manual_seed(seed)  # LoRA's A matrices come from the global generator
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def _serial():
    try:
        import _inproc  # tests/runtime (conftest.py puts it on the path)
    except ImportError:  # a spawned rank: its own process
        return contextlib.nullcontext()
    return _inproc.serial()


def _shard(model: nn.Module, world: int) -> None:
    if world:
        import blockshard

        inner = model.base_model.model if hasattr(model, "base_model") else model
        for layer in inner.model.layers:
            blockshard.fully_shard(layer)
        blockshard.fully_shard(inner)


def _lora_grads(model: nn.Module, world: int) -> dict[str, torch.Tensor]:
    """Full LoRA gradients by name: the sharded pieces' ``.grad`` gathered like parameters."""
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not world:
        return {n: p.grad.clone() for n, p in lora.items()}
    import blockshard

    saved = {n: p.detach().clone() for n, p in lora.items()}
    with torch.no_grad():
        for p in lora.values():
            p.copy_(p.grad)
    full = blockshard.full_state_dict(model)
    with torch.no_grad():
        for n, p in lora.items():
            p.copy_(saved[n])
    return {n: full[n] for n in lora}


def qlora(rank: int, world: int, steps: int = 3, **quant) -> dict:
    """QLoRA on the tiny Llama: first-step logits, first-step LoRA gradients, LoRA weights after
    ``steps`` AdamW steps, losses, and this rank's quantized bytes (every rank sees the whole batch)."""
    with _serial():  # threaded ranks: model building seeds torch's process-wide generator
        model = qlora_llama(**quant)
    _shard(model, world)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    out: dict = {"losses": []}
    for step, (ids, labels) in enumerate(text_batches(steps, 4, 16)):
        res = model(input_ids=ids, labels=labels)
        res.loss.backward()
        if step == 0:
            out["logits"] = res.logits.detach().clone()
            out["grads"] = _lora_grads(model, world)
        opt.step()
        opt.zero_grad()
        out["losses"].append(res.loss.item())
    if world:
        import blockshard
        from blockshard.runtime import quantized_stats

        full = blockshard.full_state_dict(model)
        out["params"] = {n: full[n] for n, p in model.named_parameters() if p.requires_grad}
        out["stats"] = quantized_stats(model)
    else:
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out
