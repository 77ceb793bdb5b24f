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

        inner = model.base_model.model if hasattr(model, "peft_config") else model
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


# -- bytes ------------------------------------------------------------------------------------
def _linears4bit(model: nn.Module) -> list[tuple[str, nn.Module]]:
    import bitsandbytes as bnb

    return [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


def canonical_kernel(model: nn.Module) -> nn.Module:
    """``model`` with bitsandbytes' eval-mode AVX512-BF16 path off (on CPUs that have it, an eval
    forward repacks each ``Linear4bit`` weight in place and runs a bf16 kernel: other numerics, and
    it fails for ``in_features`` that are not a multiple of the blocksize, e.g. down_proj's 352).
    The engine turns it off for the modules it manages (``prepare_module`` in
    blockshard/runtime/quantized/_bnb4bit.py; docs/quantized.md), so a
    one-process reference in eval mode turns it off too; on other CPUs this changes nothing."""
    for _, m in _linears4bit(model):
        m.support_avx512bf16_for_cpu = False
    return model


def quantized_bytes(weight) -> dict[str, torch.Tensor]:
    """A Params4bit's payload and scales as bytes (what must be identical after a gather)."""
    from blockshard.runtime.quantized._tensor import byte_view

    qs = weight.quant_state
    out = {"payload": byte_view(weight.data), "absmax": byte_view(qs.absmax)}
    if qs.nested:
        out["state2.absmax"] = byte_view(qs.state2.absmax)
    return {k: v.clone() for k, v in out.items()}


def memory(rank: int, world: int, replicate: bool = False, **quant) -> dict:
    """This rank's quantized bytes: under blockshard (``held``: payload and scales of its pieces,
    ``stats``), or replicated as on Accelerate's path (stock FSDP2 with the Params4bit ignored)."""
    from blockshard.runtime import quantized_stats
    from blockshard.runtime.core._state import state_of
    from blockshard.runtime.quantized._frozen import frozen_buffers

    with _serial():
        model = qlora_llama(lora=False, **quant)
    if replicate:
        from torch.distributed.fsdp import fully_shard

        weights = {m.weight for _, m in _linears4bit(model)}
        for layer in model.model.layers:
            fully_shard(layer, ignored_params={w for w in weights if any(w is p for p in layer.parameters())})
        fully_shard(model)
        return {"replicated_bytes": sum(b.numel() for w in weights for b in quantized_bytes(w).values())}
    _shard(model, world)
    held = {}
    for prefix, m in model.named_modules():
        st = state_of(m)
        if st is not None and frozen_buffers(st) is not None:
            held[prefix] = frozen_buffers(st).layout.rank_bytes(rank)
    tensors = [
        t
        for _, m in model.named_modules()
        if (st := state_of(m)) and frozen_buffers(st)
        for t in frozen_buffers(st).tensors
    ]
    return {
        "held": held,
        "stats": quantized_stats(model),
        "pieces_are_uint8": all(
            type(m.weight) is nn.Parameter and m.weight.dtype == torch.uint8 for _, m in _linears4bit(model)
        ),
        "gathered_freed": all(g.untyped_storage().size() == 0 for t in tensors for g in t.gathered),
    }


def gathered_bytes(rank: int, world: int, **quant) -> dict:
    """Every Linear4bit's bytes while its layer is unsharded (the one process's as they are)."""
    with _serial():
        model = qlora_llama(lora=False, **quant)
    _shard(model, world)
    out: dict[str, torch.Tensor] = {}
    nans = 0
    for i, layer in enumerate(model.model.layers):
        if world:
            layer.unshard()
        for name, m in _linears4bit(layer):
            for k, v in quantized_bytes(m.weight).items():
                out[f"layers.{i}.{name}.{k}"] = v
            if m.weight.dtype == torch.bfloat16:
                nans += int(m.weight.data.isnan().sum())
        if world:
            layer.reshard()
    return {"bytes": out, "nan_payload_values": nans}


def stock_fsdp2(rank: int, world: int, **quant) -> dict:
    """Stock FSDP2 over the Params4bit: the forward's error (the quant state does not survive)."""
    from torch.distributed.fsdp import fully_shard

    with _serial():
        model = qlora_llama(**quant)
    inner = model.base_model.model
    for layer in inner.model.layers:
        fully_shard(layer)
    fully_shard(inner)
    ids, labels = next(iter(text_batches(1, 4, 16)))
    try:
        model(input_ids=ids, labels=labels)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": ""}


def float_roundtrip(**quant) -> dict:
    """A bf16-stored payload through a float cast (fp32 and back): changed bytes and weights."""
    import bitsandbytes.functional as F

    model = qlora_llama(lora=False, **quant)
    changed, equal = 0, True
    for _, m in _linears4bit(model):
        w = m.weight
        moved = w.data.float().to(w.dtype)
        changed += int((moved.view(torch.uint8) != w.data.view(torch.uint8)).sum())
        a = F.dequantize_4bit(w.data, w.quant_state)
        b = F.dequantize_4bit(moved, w.quant_state)
        equal = equal and torch.equal(a, b)
    return {"changed_bytes": changed, "dequantized_equal": equal}


def run(rank: int, world: int, sharded: bool, configs: list[tuple], steps: int) -> dict:
    """Spawned ranks: :func:`qlora` for each ``(quant_type, nested, storage)``, sharded or the reference."""
    out = {}
    for qt, nested, storage in configs:
        quant = {"quant_type": qt, "compress_statistics": nested, "quant_storage": getattr(torch, storage)}
        out[(qt, nested, storage)] = qlora(rank, world if sharded else 0, steps, **quant)
    return out


def qlora_variants(rank: int, world: int, variant: str) -> dict:
    """One training step of QLoRA under a loop variant: ``checkpointing`` (HF gradient
    checkpointing, the QLoRA default), ``keep`` (``reshard_after_forward=False``), ``eval`` (a
    no-grad eval forward first, then training), ``prefetch_off`` (no forward or backward prefetch) or
    ``list`` (each layer's attention and MLP in one list group, under the layer's)."""
    with _serial():
        model = qlora_llama()
    inner = model.base_model.model
    if variant == "checkpointing":
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if world:
        import blockshard

        kw = {"reshard_after_forward": False} if variant == "keep" else {}
        for layer in inner.model.layers:
            if variant == "list":  # one group over two modules (FSDP2's list form)
                blockshard.fully_shard([layer.self_attn, layer.mlp])
            blockshard.fully_shard(layer, **kw)
        blockshard.fully_shard(inner, **kw)
        if variant == "prefetch_off":
            for layer in inner.model.layers:
                layer.set_modules_to_forward_prefetch([])
                layer.set_modules_to_backward_prefetch([])
    elif variant == "eval":  # the engine keeps bitsandbytes' canonical packing (no AVX512 repack)
        canonical_kernel(model)
    ids, labels = next(iter(text_batches(1, 4, 16)))
    out: dict = {}
    if variant == "eval":
        model.eval()
        with torch.no_grad():
            out["eval_logits"] = model(input_ids=ids).logits.clone()
        model.train()
    res = model(input_ids=ids, labels=labels)
    res.loss.backward()
    out["logits"] = res.logits.detach().clone()
    out["grads"] = _lora_grads(model, world)
    return out
