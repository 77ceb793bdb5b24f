"""Trainable weights gathered quantized (``quantized_gather=True``): rank functions and the one-process
reference. ``(rank, world, ...)``; the reference is a plain model whose weights pass through a
straight-through fake quantization with independent quantizers (torchao's ``to_mx`` on the whole
tensor; the pure-torch blockwise FP8 reference of ``_fp8_runs.py``).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import nn
from torch.nn.utils import parametrize

# (in, out, semantics): weight [out, in]. FP8: 320 rows = 2.5 stripes of 128, 192 cols = 1.5 tiles;
# MX: last dims multiples of 32
LAYERS = (
    (192, 320, "fp8_block:128"),
    (320, 96, "mx"),
    (96, 224, "mx:4"),
    (224, 256, "fp8_block:128"),
)
EXPERTS = ((3, 96, 64, "fp8_block:64"), (4, 128, 64, "fp8_block:64"))  # per-expert units; stripes


def reference_quantize(w: torch.Tensor, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole tensor's payload and scales, by the independent quantizers."""
    if spec.startswith("mx"):
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        elem = torch.float4_e2m1fn_x2 if spec == "mx:4" else torch.float8_e4m3fn
        mx = MXTensor.to_mx(w, elem, block_size=32)
        return mx.qdata, mx.scale
    from _fp8_runs import quantize_fp8_block

    tile = int(spec.split(":")[1])
    if w.dim() == 3:  # each expert tiled on its own
        parts = [quantize_fp8_block(e, (tile, tile)) for e in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    return quantize_fp8_block(w, (tile, tile))


def reference_fake_quant(w: torch.Tensor, spec: str, dtype: torch.dtype) -> torch.Tensor:
    """quantize-dequantize of the whole tensor, in ``dtype``."""
    q, s = reference_quantize(w, spec)
    if spec.startswith("mx"):
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        elem = torch.float4_e2m1fn_x2 if spec == "mx:4" else torch.float8_e4m3fn
        return MXTensor.to_mx(w, elem, block_size=32).dequantize(dtype)
    from _fp8_runs import dequantize_fp8_block

    tile = int(spec.split(":")[1])
    if w.dim() == 3:
        return torch.stack([dequantize_fp8_block(qe, se, (tile, tile), dtype) for qe, se in zip(q, s, strict=True)])
    return dequantize_fp8_block(q, s, (tile, tile), dtype)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, spec: str) -> torch.Tensor:
        return reference_fake_quant(w.detach(), spec, w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class FakeQuant(nn.Module):
    def __init__(self, spec: str) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _STE.apply(w, self.spec)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(i, o) for i, o, _ in LAYERS)
            for lin, (i, _, _) in zip(self.layers, LAYERS, strict=True):
                nn.init.normal_(lin.weight, std=1 / math.sqrt(i))
            self.experts = nn.ParameterList(
                nn.Parameter(torch.randn(e, r, c) / math.sqrt(c), requires_grad=False) for e, r, c, _ in EXPERTS
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.silu(layer(x))
        return x


def _serial():
    import _qlora

    return _qlora._serial()


def _shard(model: Stack, **kw) -> None:
    import blockshard

    for layer, (_, _, spec) in zip(model.layers, LAYERS, strict=True):
        blockshard.fully_shard(layer, semantics={"weight": spec}, quantized_gather=True, **kw)
    experts = {f"experts.{k}": spec for k, (*_, spec) in enumerate(EXPERTS)}
    blockshard.fully_shard(model, semantics=experts, quantized_gather=True, **kw)


class ByteCount:
    """Bytes all-gathered per rank thread, float and quantized, by patching the engine's names."""

    def __init__(self, monkeypatch) -> None:
        import blockshard.runtime.core._buffers as group_mod
        import blockshard.runtime.quantized._gather as qg_mod

        self.lock, self.bytes = threading.Lock(), {}
        for mod, kind in ((group_mod, "float"), (qg_mod, "quantized")):
            monkeypatch.setattr(mod, "all_gather_into", self._wrap(mod.all_gather_into, kind))

    def _wrap(self, fn, kind):
        def counted(out, inp, group, **kw):
            with self.lock:
                key = (threading.get_ident(), kind)
                self.bytes[key] = self.bytes.get(key, 0) + out.numel() * out.element_size()
            return fn(out, inp, group, **kw)

        return counted

    def take(self) -> dict[str, int]:
        """This thread's counts since the last take."""
        me = threading.get_ident()
        with self.lock:
            return {kind: self.bytes.pop((me, kind), 0) for kind in ("float", "quantized")}


def gathered(
    rank: int, world: int, counter: ByteCount | None = None, dtype: torch.dtype | None = None, tile_placement=False
) -> dict:
    """Per quantized weight: the gathered payload and scales, the unsharded weight during an
    unshard, and the whole master weight; bytes all-gathered per layer unshard and stats."""
    import blockshard
    from blockshard.runtime import full_quantized

    with _serial():
        model = Stack()
    mp = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=dtype) if dtype is not None else None
    _shard(model, mp_policy=mp, tile_placement=tile_placement)
    masters = {n: t.clone() for n, t in blockshard.full_state_dict(model).items()}
    out: dict = {"payload": full_quantized(model), "masters": masters, "unsharded": {}, "bytes": {}}
    for k, layer in enumerate(model.layers):
        if counter is not None:
            counter.take()
        layer.unshard()
        out["unsharded"][f"layers.{k}.weight"] = layer.weight.detach().clone()
        layer.reshard()
        if counter is not None:
            out["bytes"][k] = counter.take()
    model.unshard()
    for k, p in enumerate(model.experts):
        out["unsharded"][f"experts.{k}"] = p.detach().clone()
    model.reshard()
    out["stats"] = blockshard.quantized_gather_stats(model)
    return out


def _model(world: int, tile_placement=False) -> nn.Module:
    """The stack sharded with ``quantized_gather`` (``world`` > 0), else with the reference fake
    quantization as a parametrization (one process)."""
    with _serial():
        model = Stack()
    if world:
        _shard(model, tile_placement=tile_placement)
    else:
        for layer, (_, _, spec) in zip(model.layers, LAYERS, strict=True):
            parametrize.register_parametrization(layer, "weight", FakeQuant(spec))
    return model


def train(rank: int, world: int, steps: int = 3, tile_placement=False) -> dict:
    """Logits per step and the full parameters after ``steps`` AdamW steps; ``world == 0``: one
    process with the reference fake quantization. Precompute after even steps only, so odd steps
    quantize lazily at the next unshard."""
    import blockshard

    model = _model(world, tile_placement)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out: dict = {"logits": [], "quantizations": []}
    for step in range(steps):
        x = torch.randn(6, LAYERS[0][0], generator=torch.Generator().manual_seed(step))
        y = model(x)
        y.square().mean().backward()
        out["logits"].append(y.detach().clone())
        opt.step()
        opt.zero_grad()
        if world and step % 2 == 0:
            blockshard.precompute_quantized_gather(model)
        if world:
            out["quantizations"].append([_qgroup(layer).quantizations for layer in model.layers])
    if world:
        full = blockshard.full_state_dict(model)
    else:
        full = {n.replace(".parametrizations.weight.original", ".weight"): p for n, p in model.named_parameters()}
    out["params"] = {n: full[n].detach().clone() for n in full if n.startswith("layers.")}
    return out


def _qgroup(module: nn.Module):
    from blockshard.runtime.core._state import state_of
    from blockshard.runtime.quantized._gather import QuantizedGatherBuffers

    st = state_of(module)
    return next(g for g in st.buffer_sets if isinstance(g, QuantizedGatherBuffers))


def accumulate_clip_checkpoint(rank: int, world: int, path: str = "") -> dict:
    """Two micro-batches (the first without gradient sync), ``clip_grad_norm_``'s norm, one AdamW step;
    then a checkpoint saved and loaded into a model whose middle layers are one list group.
    ``world == 0``: one process with the reference fake quantization (no checkpoint)."""
    import blockshard

    model = _model(world)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for micro in range(2):
        if world:
            model.set_requires_gradient_sync(micro == 1)
        x = torch.randn(6, LAYERS[0][0], generator=torch.Generator().manual_seed(micro))
        model(x).square().mean().backward()
    # the global norm (no clipping at this bound: a clip coefficient off by an ulp from the norm's
    # summation order would move the masters by an ulp, which a quantizer may round to another code)
    out: dict = {"norm": torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)}
    opt.step()
    opt.zero_grad()
    x = torch.randn(4, LAYERS[0][0], generator=torch.Generator().manual_seed(9))
    out["logits"] = model(x).detach()
    if not world:
        return out
    blockshard.save_checkpoint(model, path, optimizer=opt)
    with _serial():
        other = Stack()
    listed = {"0.weight": LAYERS[1][2], "1.weight": LAYERS[2][2]}  # a list group's names: "<position>.<name>"
    blockshard.fully_shard([other.layers[1], other.layers[2]], semantics=listed, quantized_gather=True)
    for k in (0, 3):
        blockshard.fully_shard(other.layers[k], semantics={"weight": LAYERS[k][2]}, quantized_gather=True)
    blockshard.fully_shard(other, semantics={"experts.*": "fp8_block:64"}, quantized_gather=True)
    other_opt = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2)
    blockshard.load_checkpoint(other, path, optimizer=other_opt)
    out["loaded"] = other(x).detach()
    out["names"] = sorted(blockshard.runtime.full_quantized(other))
    return out
