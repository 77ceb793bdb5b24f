"""Bytes gathered per step and persistent bytes per rank: bnb 4-bit and blockwise-FP8 weights under blockshard vs bf16 vs replicated.

    python benchmarks/quantized_gather.py --world-size 4 --json --out docs/results/quantized_gather.json

One run spawns W gloo ranks (one torch thread each). Every rank builds, in turn, the same bf16 tiny
Llama (``blockshard._tiny.tiny_llama`` at the sizes given, seed 0) three ways and runs one warm-up
and one counted training step (forward, backward, no optimizer: the base is frozen, the RMSNorm and
embedding weights train so backward reaches every layer), every rank on the same batch:
  * **blockshard-4bit**: the seven decoder linears are bitsandbytes ``Linear4bit`` (``--quant-type``,
    nested absmax on and off: two variants), sharded by ``blockshard.fully_shard`` per layer and the
    root: the quantized weights by whole quantization units, payload and absmax as bytes;
  * **blockshard-bf16**: the same linears left in bf16 (frozen), sharded by the same calls;
  * **replicated-4bit**: Accelerate's FSDP2 path (accelerate 1.15 ``utils/fsdp_utils.py:789-810``):
    stock ``torch.distributed.fsdp.fully_shard`` per layer and the root, every frozen uint8
    ``Params4bit`` in ``ignored_params``;
  * **blockshard-fp8-stripes** / **blockshard-fp8-tiles**: the linears as blockwise FP8 (128 x 128
    tiles, ``blockshard._tiny.FP8BlockWeight``: float8 payload, one fp32 scale per tile), sharded by
    whole 128-row tile stripes (the default) or by whole tiles (``tile_placement=True``, [Note: tile
    placement in the engine]);
  * **blockshard-fp8-masters-stripes** / **blockshard-fp8-masters-tiles**: the linears left as
    trainable bf16 masters with ``fp8_block:128`` semantics, gathered quantized
    (``quantized_gather=True``, [Note: quantized gather]): by 128-row stripes, or by tiles in packed
    tile order (``tile_placement=True``, [Note: packed tile order in the engine]); their persistent
    bytes are the masters' pieces plus the quantized segment.
A ``TorchDispatchMode`` over the counted step sums the output bytes of every ``c10d`` all-gather by
dtype: ``uint8`` are the quantized groups, floating dtypes the float groups. The base weights'
gathered bytes are the uint8 bytes (4-bit) or the bf16 bytes less those of the 4-bit variant's
float groups (norms and embeddings, the same in both). Persistent bytes per rank are what the rank
holds of the base weights between steps: its quantized segment plus replicated constants (code
tables, nested offsets), the bf16 local pieces, or every Params4bit's payload and scales.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _common import add_output_args, command, emit, machine_facts, parser  # benchmarks/ on sys.path
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODEL_DEFAULTS = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 2,
                  "num_attention_heads": 8, "num_key_value_heads": 4}  # fmt: skip
VARIANTS = (
    "blockshard-4bit-nested",
    "blockshard-4bit",
    "blockshard-bf16",
    "replicated-4bit",
    "blockshard-fp8-stripes",
    "blockshard-fp8-tiles",
    "blockshard-fp8-masters-stripes",
    "blockshard-fp8-masters-tiles",
)
MASTERS = ("blockshard-fp8-masters-stripes", "blockshard-fp8-masters-tiles")
QUANTIZED = ("blockshard-4bit-nested", "blockshard-4bit", "blockshard-fp8-stripes", "blockshard-fp8-tiles")
TARGET_GATHER, TARGET_MEMORY = 0.27, 1.05


class GatherCounter(TorchDispatchMode):
    """Output bytes of every c10d all-gather, by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.by_dtype: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if func.namespace == "c10d" and name.split("::", 1)[1] in (
            "_allgather_base_",
            "allgather_into_tensor_coalesced_",
        ):
            out = args[0]
            key = str(out.dtype).removeprefix("torch.")
            self.by_dtype[key] = self.by_dtype.get(key, 0) + out.numel() * out.element_size()
        return func(*args, **(kwargs or {}))


def quantize(model: nn.Module, quant_type: str, nested: bool) -> nn.Module:
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if type(child) is nn.Linear and cname in LINEARS:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      compress_statistics=nested, quant_type=quant_type)  # fmt: skip
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False,
                                             compress_statistics=nested, quant_type=quant_type)  # fmt: skip
                setattr(parent, cname, q.to("cpu"))  # bitsandbytes quantizes on .to()
    return model


def quantize_fp8(model: nn.Module) -> nn.Module:
    """The linears as frozen blockwise-FP8 weights (128 x 128 tiles)."""
    from blockshard._tiny import FP8BlockWeight

    for parent in list(model.modules()):
        for cname, child in list(parent.named_children()):
            if type(child) is nn.Linear and cname in LINEARS:
                setattr(parent, cname, FP8BlockWeight(child.weight))
    return model


def _params4bit_bytes(model: nn.Module) -> tuple[int, int]:
    """(payload and scales, constants) of every Params4bit of ``model``, as this rank holds them."""
    import bitsandbytes as bnb

    held = constants = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            qs = m.weight.quant_state
            held += m.weight.data.numel() * m.weight.data.element_size() + qs.absmax.numel() * qs.absmax.element_size()
            constants += qs.code.numel() * 4
            if qs.nested:
                held += qs.state2.absmax.numel() * 4
                constants += qs.state2.code.numel() * 4 + 4
    return held, constants


def _build(variant: str, cfg: dict, quant_type: str) -> nn.Module:
    from blockshard._tiny import tiny_llama

    model = tiny_llama(0, **cfg).to(torch.bfloat16)
    for n, p in model.named_parameters():
        p.requires_grad_(variant in MASTERS or not any(f"{lin}." in n for lin in LINEARS))
    if variant in MASTERS:
        import blockshard

        rules = {f"*.{lin}.weight": "fp8_block:128" for lin in LINEARS}
        tiles = variant == "blockshard-fp8-masters-tiles"
        for layer in model.model.layers:
            blockshard.fully_shard(layer, semantics=rules, quantized_gather=True, tile_placement=tiles)
        blockshard.fully_shard(model)
        return model
    if variant.startswith("blockshard-fp8"):
        quantize_fp8(model)
    elif variant != "blockshard-bf16":
        quantize(model, quant_type, nested=variant != "blockshard-4bit")
    if variant == "replicated-4bit":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, ignored_params={p for p in layer.parameters() if p.dtype == torch.uint8})
        fully_shard(model)
        return model
    import blockshard

    tiles = {"tile_placement": True} if variant == "blockshard-fp8-tiles" else {}
    for layer in model.model.layers:
        blockshard.fully_shard(layer, **tiles)
    blockshard.fully_shard(model, **tiles)
    return model


def _persistent(variant: str, model: nn.Module, rank: int) -> dict:
    if variant == "replicated-4bit":
        held, constants = _params4bit_bytes(model)
        return {"base_bytes": held + constants, "quantized_bytes": held, "constant_bytes": constants}
    from blockshard.runtime.core._state import state_of
    from blockshard.runtime.quantized._frozen import frozen_buffers

    if variant in MASTERS:
        import blockshard
        from blockshard.runtime.quantized._gather import _gather_sets

        gather_sets = [gs for _, gs in _gather_sets(model)]
        masters = sum(gs.local.numel() * gs.local.element_size() for gs in gather_sets)
        real = sum(p.numel * 2 for gs in gather_sets for p in gs.params)  # bf16, unpadded
        stats = blockshard.quantized_gather_stats(model).values()
        segment = sum(q.local_bytes for q in stats)
        return {"base_bytes": masters + segment, "master_bytes": masters, "master_real_bytes": real,
                "segment_bytes": segment, "quantized_total_bytes": sum(q.total_bytes for q in stats)}  # fmt: skip
    if variant == "blockshard-bf16":
        held = 0
        for n, p in model.named_parameters():
            if any(f"{lin}." in n for lin in LINEARS):
                held += p.numel() * p.element_size()  # this rank's piece
        return {"base_bytes": held}
    stats = [frozen_buffers(st) for m in model.modules() if (st := state_of(m)) and frozen_buffers(st)]
    held = sum(q.layout.rank_bytes(rank) for q in stats)
    segment = sum(q.layout.segment_bytes for q in stats)
    constants = sum(q.stats().constant_bytes for q in stats)
    total = sum(q.layout.total_bytes for q in stats)
    return {"base_bytes": segment + constants, "quantized_bytes": held, "segment_bytes": segment,
            "constant_bytes": constants, "quantized_total_bytes": total}  # fmt: skip


def _rank_main(rank: int, world_size: int, opts: dict) -> dict:
    os.dup2(2, 1)  # keep the parent's stdout for the JSON report
    from blockshard._tiny import text_batches

    cfg = opts["model"]
    out = {}
    for variant in VARIANTS:
        model = _build(variant, cfg, opts["quant_type"])
        batches = list(text_batches(2, opts["batch_size"], opts["seq_len"]))
        counter = GatherCounter()
        for i, (ids, labels) in enumerate(batches):
            with counter if i == 1 else _nothing():
                model(input_ids=ids, labels=labels).loss.backward()
            model.zero_grad()
        out[variant] = {"gathered_bytes_by_dtype": counter.by_dtype, **_persistent(variant, model, rank)}
        del model
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_FLOATS = ("bfloat16", "float16", "float32")


def _aggregate(per_rank: list[dict], W: int) -> dict:
    variants = {v: {"per_rank": [r[v] for r in per_rank]} for v in VARIANTS}
    r0 = {v: per_rank[0][v] for v in VARIANTS}
    # the float groups' bytes (norms, embeddings); not the engine's int64 collective headers
    float_bytes_4bit = sum(b for d, b in r0["blockshard-4bit"]["gathered_bytes_by_dtype"].items() if d in _FLOATS)
    base_gather = {v: r0[v]["gathered_bytes_by_dtype"].get("uint8", 0) for v in VARIANTS}
    base_gather["blockshard-bf16"] = (
        r0["blockshard-bf16"]["gathered_bytes_by_dtype"].get("bfloat16", 0) - float_bytes_4bit
    )
    for v in VARIANTS:
        variants[v]["base_gathered_bytes_per_step"] = base_gather[v]
        variants[v]["base_persistent_bytes_max_rank"] = max(r[v]["base_bytes"] for r in per_rank)
    ratios, targets = {}, {}
    for v in QUANTIZED:
        total = r0[v]["quantized_total_bytes"]
        # over the bf16 run's measured gather of the same weights (its layout's few padding bytes included)
        ratios[f"{v}_gathered_over_bf16"] = base_gather[v] / base_gather["blockshard-bf16"]
        # the honest one: over the payload and scales themselves (unpadded), for as many all-gathers
        gathers = base_gather[v] / (W * r0[v]["segment_bytes"])
        ratios[f"{v}_gathered_over_physical"] = base_gather[v] / (gathers * total)
        ratios[f"{v}_persistent_max_rank_over_total_over_W"] = variants[v]["base_persistent_bytes_max_rank"] / (
            total / W
        )
        if v.startswith("blockshard-fp8"):  # no replicated FP8 run; the 4-bit targets are not theirs
            continue
        ratios[f"replicated_persistent_over_{v}_persistent"] = (
            variants["replicated-4bit"]["base_persistent_bytes_max_rank"]
            / variants[v]["base_persistent_bytes_max_rank"]
        )
        if v == "blockshard-4bit-nested":  # the target; fp32 absmax is 0.281 x bf16 physically (notes)
            targets[f"{v}_gathered_le_{TARGET_GATHER}x_bf16"] = ratios[f"{v}_gathered_over_bf16"] <= TARGET_GATHER
        targets[f"{v}_persistent_le_{TARGET_MEMORY}x_total_over_W"] = (
            ratios[f"{v}_persistent_max_rank_over_total_over_W"] <= TARGET_MEMORY
        )
    for v in MASTERS:  # trainable masters gathered quantized: the honest ratios
        total = r0[v]["quantized_total_bytes"]
        gathers = base_gather[v] / (W * r0[v]["segment_bytes"])
        ratios[f"{v}_gathered_over_physical"] = base_gather[v] / (gathers * total)
        ratios[f"{v}_masters_max_rank_over_share"] = max(r[v]["master_bytes"] for r in per_rank) / (
            r0[v]["master_real_bytes"] / W
        )
        ratios[f"{v}_gathered_over_bf16"] = base_gather[v] / base_gather["blockshard-bf16"]
    ratios["fp8_masters_tiles_gathered_over_stripes"] = (
        variants["blockshard-fp8-masters-tiles"]["base_gathered_bytes_per_step"]
        / variants["blockshard-fp8-masters-stripes"]["base_gathered_bytes_per_step"]
    )
    # the same FP8 weights by whole tiles over by whole 128-row stripes (the padding tile placement saves)
    for what, key in (("gathered", "base_gathered_bytes_per_step"), ("persistent", "base_persistent_bytes_max_rank")):
        ratios[f"fp8_tiles_{what}_over_stripes"] = (
            variants["blockshard-fp8-tiles"][key] / variants["blockshard-fp8-stripes"][key]
        )
    return {"variants": variants, "ratios": ratios, "targets": targets}


def _parser():
    p = parser(__doc__, world_size=4, steps=None, warmup=None)
    for k, v in MODEL_DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--quant-type", choices=("nf4", "fp4"), default="nf4")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    return add_output_args(p, timeout=900.0)


def _render(report: dict) -> None:
    print(f"{'variant':<26}{'base gathered / step':>22}{'base persistent / rank':>24}", file=sys.stderr)
    for v, rec in report["variants"].items():
        print(
            f"{v:<26}{rec['base_gathered_bytes_per_step']:>22,}{rec['base_persistent_bytes_max_rank']:>24,}",
            file=sys.stderr,
        )
    for k, val in report["ratios"].items():
        print(f"  {k}: {val:.4f}", file=sys.stderr)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the report (also printed as JSON with --json, written with --out)."""
    import bitsandbytes
    import transformers

    from blockshard._launch import spawn_gloo

    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parser().parse_args(argv)
    if a.world_size < 2:
        raise SystemExit("need --world-size >= 2")
    cfg = {k: getattr(a, k) for k in MODEL_DEFAULTS}
    opts = {"model": cfg, "quant_type": a.quant_type, "batch_size": a.batch_size, "seq_len": a.seq_len}
    t0, load_before = time.perf_counter(), os.getloadavg()
    per_rank = spawn_gloo(_rank_main, a.world_size, args=(opts,), timeout=a.timeout, threads=1)
    report = {
        "benchmark": "quantized_gather",
        "command": command("quantized_gather.py", argv),
        "world_size": a.world_size,
        "model": {
            **cfg,
            "quant_type": a.quant_type,
            "blocksize": 64,
            "quantized": list(LINEARS),
            "dtype": "bfloat16",
            "batch_size": a.batch_size,
            "seq_len": a.seq_len,
        },
        "counted": "one training step (forward + backward) after one warm-up step; all-gather output bytes "
        "(W x segment, the rank's own segment included) on rank 0",
        "machine": machine_facts(
            load_before=load_before,
            versions={"bitsandbytes": bitsandbytes.__version__, "transformers": transformers.__version__},
        ),
        **_aggregate(per_rank, a.world_size),
        "notes": [
            "Physical bytes per value: 4-bit payload 0.5, fp32 absmax per 64 values 0.0625 (0.281 x bf16), "
            "nested: uint8 absmax 0.0156 + fp32 per 16384 values (0.258 x bf16). The gather target (<= 0.27 x bf16, "
            "the issue's) applies to nested statistics (QLoRA's double quantization); without them the fp32 "
            "absmax alone puts 4-bit at 0.281 x bf16.",
            "Physical bytes per value, blockwise FP8: payload 1, one fp32 scale per 128 x 128 tile 0.00024 (0.500 x "
            "bf16); gathered_over_physical is the padding the placement moves (stripes: a whole 128-row stripe per "
            "rank at most; tiles: one tile).",
            "Trainable FP8 masters (quantized_gather=True): gathered_over_physical as for frozen FP8 (each "
            "forward and backward unshard gathers the quantized segments); masters_max_rank_over_share is the "
            "largest rank's bf16 master bytes over the masters' unpadded bf16 bytes / W (tiles: the zeros of "
            "the packed tile order's slots included).",
            "Persistent per rank for blockshard: the padded segment (every rank holds S bytes) plus replicated "
            "code tables, once per group (the 64 B NF4/FP4 code; nested: + the 1024 B dynamic map) and a 4 B "
            "nested offset per tensor.",
        ],
        "wall_seconds": time.perf_counter() - t0,
    }
    return emit(report, render=_render, out=a.out, as_json=a.json)


if __name__ == "__main__":
    main()
