"""blockshard's ragged engine against torch FSDP2 on the same Llama, data, optimizer and steps.

    python benchmarks/engine_vs_fsdp2.py --world-size 4 --json --out docs/results/engine_vs_fsdp2.json
    python benchmarks/engine_vs_fsdp2.py --persistent --world-size 1024 --json --out docs/results/engine_persistent_w1024.json

``--persistent``: no training; the persistent parameter bytes per rank of both engines at
``--world-size`` (any, e.g. 1024) for catalog models (``--catalog``, default Llama-3-70B and
DeepSeek-V3; shapes from ``blockshard/planner/_catalog.py``, bf16), one group per decoder layer
plus the root, as ``fully_shard`` makes them: blockshard's from the plan (``plan_model``, default
semantics and policy ``"whole"``: every rank holds ``S`` elements per group), FSDP2's from
``torch.distributed.fsdp.fully_shard`` itself, run on a meta-device copy of the shapes over a fake
process group of that size in a child process (each parameter's padded ``Shard(0)`` storage,
``ceil(dim0 / W) * rest`` elements on every rank; checked against that formula). Gradients and
optimizer state are sharded the same way, so their ratio is the same.

One run spawns W gloo ranks (``blockshard._launch.spawn_gloo``, one torch thread per rank). In every
round each engine builds a fresh model (same seed) and AdamW, shards it bottom-up (each decoder layer,
then the root) and trains ``warmup + steps`` steps on the same per-rank batches; the engines alternate
(which one goes first flips every round) so drift of the machine hits both alike. A ``dist.barrier()``
precedes every timed step; a step's time is the slowest rank's forward + backward + ``opt.step()`` +
``zero_grad()`` (phases likewise, each its own slowest rank). The CPU time of a step is the sum over
ranks of ``time.process_time()`` (all threads of a rank, gloo's included): less sensitive than wall
time to other load on the machine. Medians are over all timed steps of all rounds.

``--memory-only``: no timed rounds (no times in the report, ``rounds`` is 0); the instrumented
pass below runs as it does after them, and the loss difference is taken over its steps.

After the timed rounds, one instrumented pass per engine (never timed), on every rank:
  * **memory**: bytes held by torch's CPU allocator, sampled at every allocation event of the
    profiler (``profile_memory=True``), relative to the total just before the model is built. The
    allocator's own running total is used (c10's ``caffe2_report_cpu_memory_usage`` flag), so frees
    made on gloo's worker threads count. Reported: the total when a steady-state step starts
    (parameters, gradients, optimizer state, engine buffers), its peak inside that step, the peak per
    phase, and the op at the peak. Memory outside torch's allocator (gloo's own buffers, Python
    objects) is not counted; a spike made and freed on a gloo thread between two allocation
    events of this thread is missed.
  * **copies**: a ``TorchDispatchMode`` over one more step sums the bytes *written* by the ops in
    ``COPY_OPS`` (mutated arguments of in-place/out= ops, else the outputs; for FSDP2's custom
    ``fsdp::all_gather_copy_in`` the bytes of the shards it copies in). Each op is attributed by the
    Python stack: in engine code (``torch/distributed/fsdp/``, ``blockshard/runtime/``) on the
    all-gather path (innermost engine function named like ``all_gather``/``unshard``), on the
    reduce-scatter path (``reduce``/``grad``/``post_backward``), where blockshard places the
    reduce-scatter's output (``reduce_scatter_output``: its ``GradientSync.finish``; offload's copy
    to the host) or elsewhere in the engine; inside a collective (gloo copies the reduce-scatter
    result inside ``Work.wait()``); or outside the engine (model, autograd, optimizer). A copy that
    changes the dtype is a cast, counted apart (``cast_bytes``); so are fills (``FILL_OPS``) and
    ``aten::add_`` into an existing parameter ``.grad`` (autograd accumulating into a gradient view,
    [Note: gradient views]). Ops that run inside a c10d op (gloo's own temporaries, the clone of
    every reduce-scatter input) are not visible to the mode.
  * **collectives**: the same mode counts the ``c10d::*`` ops by kind, with bytes sent and received.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _common import (  # benchmarks/_common.py (scripts run with benchmarks/ on sys.path)
    HEADER,
    CollectiveCounter,
    add_output_args,
    command,
    emit,
    issuing_header,
    machine_facts,
    nbytes,
    parser,
)

ENGINES = ("fsdp2", "blockshard")
PRESETS = {
    "small-llama": dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, seq_len=64, batch_size=4),
    "tiny-llama": dict(vocab_size=257, hidden_size=48, intermediate_size=89, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, seq_len=32, batch_size=2),
}  # fmt: skip
SIZE_FLAGS = {"vocab": "vocab_size", "hidden": "hidden_size", "intermediate": "intermediate_size",
              "layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
              "seq_len": "seq_len", "batch_size": "batch_size"}  # fmt: skip
COPY_OPS = frozenset({
    "aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::stack", "aten::_chunk_cat",
    "aten::split_with_sizes_copy", "aten::_foreach_copy_", "aten::index_copy_", "aten::index_copy",
    "aten::narrow_copy", "aten::slice_scatter", "aten::select_scatter", "aten::as_strided_scatter",
    "aten::constant_pad_nd", "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat",
})  # fmt: skip
FILL_OPS = frozenset({"aten::zeros", "aten::zeros_like", "aten::new_zeros", "aten::zero_", "aten::fill_",
                      "aten::full", "aten::full_like", "aten::ones", "aten::ones_like"})  # fmt: skip
_ENGINE_DIRS = (os.path.join("torch", "distributed", "fsdp", ""), os.path.join("blockshard", "runtime", ""))
_AG_PATH, _RS_PATH = re.compile(r"all_gather|unshard"), re.compile(r"reduce|grad|post_backward")
# For c10d ops: (index of the argument this rank sends, index of the one it receives into).
_C10D_ARGS = {
    "_allgather_base_": (1, 0),
    HEADER: (1, 0),
    "_reduce_scatter_base_": (1, 0),
    "alltoall_base_": (1, 0),
}


_MARK = "engine_vs_fsdp2.measured_step"
# what every entry of "ratios" divides by ([Note: honest ratios] in blockshard/planner/_qgather.py)
RATIOS_DIVIDE = "blockshard's figure / FSDP2's, both measured in the same run"
CATEGORIES = ("all_gather_path", "reduce_scatter_path", "reduce_scatter_output", "engine_other", "inside_collective",
              "outside_engine")  # fmt: skip
# blockshard's function that places the reduce-scatter's output once it is done (offload: to the
# host; a cast to the parameters' dtype): what the collective wrote, not a gradient copied into it
_RS_OUTPUT = (os.path.join("blockshard", "runtime", "core", "_grad_sync.py"), "finish")


class OpCounter(CollectiveCounter):
    """Bytes written by copy-like and fill ops (by where they run) and c10d collectives, per step.
    A copy that changes the dtype (a cast: a bf16 gradient into an fp32 reduce-scatter input) is
    counted apart from the copies, under ``casts``. ``model``: whose parameters' ``.grad`` an
    ``aten::add_`` accumulates into (autograd into a preset gradient view), counted apart too."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.model = model
        self.in_wait = 0  # > 0 inside Work.wait(): gloo copies results there (part of the collective)
        self.copies: dict[str, dict[str, list[int]]] = {}  # category -> op -> [count, bytes]
        self.casts: dict[str, int] = {}  # category -> bytes written by dtype-changing copies
        self.fills: dict[str, int] = {}  # category -> bytes
        self.grad_accumulate = [0, 0]  # add_ into an existing param .grad: [count, bytes]

    def __enter__(self):
        from torch.distributed.distributed_c10d import Work

        self._wait = wait = Work.__dict__["wait"]

        def counted_wait(work, *args, **kwargs):
            self.in_wait += 1
            try:
                return wait(work, *args, **kwargs)
            finally:
                self.in_wait -= 1

        Work.wait = counted_wait
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.distributed.distributed_c10d import Work

        Work.wait = self._wait
        return super().__exit__(*exc)

    def _category(self) -> str:
        if self.in_wait:
            return "inside_collective"
        frame, in_engine = sys._getframe(2), False
        while frame is not None:
            if any(d in frame.f_code.co_filename for d in _ENGINE_DIRS):
                in_engine, name = True, frame.f_code.co_name
                if frame.f_code.co_filename.endswith(_RS_OUTPUT[0]) and name == _RS_OUTPUT[1]:
                    return "reduce_scatter_output"
                if _AG_PATH.search(name):
                    return "all_gather_path"
                if _RS_PATH.search(name):
                    return "reduce_scatter_path"
            frame = frame.f_back
        return "engine_other" if in_engine else "outside_engine"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if func.namespace == "c10d":
            kind = name.split("::", 1)[1]
            if kind == "_allgather_base_" and issuing_header():
                kind = HEADER  # blockshard's [Note: collective headers], counted apart
            i_in, i_out = _C10D_ARGS.get(kind, (0, 0))
            sent = nbytes(args[i_in]) if len(args) > i_in else 0
            self.record(kind, sent, nbytes(args[i_out]) if len(args) > i_out else 0)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if name in COPY_OPS or name in FILL_OPS:
            written = self._written(func, args, kwargs, out)
            where = self._category()
            if name in FILL_OPS:
                self.fills[where] = self.fills.get(where, 0) + written
            elif _casts(name, args, out):
                self.casts[where] = self.casts.get(where, 0) + written
            else:
                rec = self.copies.setdefault(where, {}).setdefault(name, [0, 0])
                rec[0] += 1
                rec[1] += written
        elif (
            name == "aten::add_" and self.model is not None and any(args[0] is p.grad for p in self.model.parameters())
        ):
            self.grad_accumulate[0] += 1
            self.grad_accumulate[1] += nbytes(args[0])
        return out

    @staticmethod
    def _written(func, args, kwargs, out) -> int:
        if func._schema.name == "fsdp::all_gather_copy_in":
            return nbytes(args[0])  # the shards copied into the all-gather input (output aliases a buffer)
        mutated = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                mutated.append(kwargs.get(arg.name, args[i] if i < len(args) else None))
        return nbytes(mutated) if mutated else nbytes(out)

    def summary(self) -> dict:
        copies = {}
        for cat in CATEGORIES:
            ops = self.copies.get(cat, {})
            copies[cat] = {"bytes": sum(b for _, b in ops.values()),
                           "ops": {k: {"count": c, "bytes": b} for k, (c, b) in ops.items()}}  # fmt: skip
        count, nbytes = self.grad_accumulate
        return {"copies": copies, "cast_bytes": self.casts, "fill_bytes": self.fills, "collectives": self.collectives,
                "grad_accumulate_add": {"count": count, "bytes": nbytes}}  # fmt: skip


# -- one rank ---------------------------------------------------------------------------------------
def _casts(name: str, args: tuple, out: object) -> bool:
    """Whether a copy op changes the dtype (``copy_(dst, src)``, ``_to_copy(src) -> out``)."""
    if name == "aten::copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[0].dtype != args[1].dtype
    if name == "aten::_to_copy" and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
        return args[0].dtype != out.dtype
    return False


def _build(cfg: dict):
    from blockshard._tiny import tiny_llama

    return tiny_llama(0, **{k: v for k, v in cfg.items() if k not in ("seq_len", "batch_size")})


def _num_params(cfg: dict) -> int:
    return sum(p.numel() for p in _build(cfg).parameters())


def _setup(engine: str, cfg: dict, checkpointing: bool = False):
    model = _build(cfg)
    if checkpointing:  # every decoder layer recomputed in backward (transformers' non-reentrant checkpoint)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from blockshard import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, batch, *, marks: bool = False) -> tuple[float, list[float]]:
    """One training step; ``marks`` labels its phases for the profiler (measurement pass only)."""
    from torch.profiler import record_function

    ids, labels = batch
    label = (lambda name: record_function(f"{_MARK}.{name}")) if marks else (lambda name: contextlib.nullcontext())
    c0, t0 = time.process_time(), time.perf_counter()
    with label("forward"):
        loss = model(input_ids=ids, labels=labels).loss
    t1 = time.perf_counter()
    with label("backward"):
        loss.backward()
    t2 = time.perf_counter()
    with label("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    t3, c3 = time.perf_counter(), time.process_time()
    return loss.item(), [t3 - t0, t1 - t0, t2 - t1, t3 - t2, c3 - c0]  # wall: total, fwd, bwd, opt; CPU


def _track_cpu_allocations() -> None:
    """Make torch's CPU allocator keep its running total for frees on every thread.

    The profiler alone records frees only on the profiled thread; gloo's worker threads free
    collective buffers too (whichever thread drops the last reference frees), which would leak into
    a running sum. With c10's ``caffe2_report_cpu_memory_usage`` flag the allocator's own total
    (``total_allocated`` of each profiler allocation event) includes frees (and allocations) made
    on any thread. The flag is a plain exported bool in libc10.
    """
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _memory(prof) -> dict:
    """Live bytes (allocator total) when the marked step starts and its peak inside the step,
    relative to the total just before the profiled window (before the model was built)."""

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    events = sorted(walk(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e.start_time_ns)
    mark = next(e for e in events if e.name == _MARK)
    allocs = [e for e in events if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"
              and str(e.extra_fields.device).startswith("cpu")]  # fmt: skip
    base = allocs[0].extra_fields.total_allocated - allocs[0].extra_fields.alloc_size
    before = [e.extra_fields.total_allocated for e in allocs if e.start_time_ns < mark.start_time_ns]
    inside = [e for e in allocs if mark.start_time_ns <= e.start_time_ns <= mark.end_time_ns]
    at_start = before[-1] - base
    top = max(inside, key=lambda e: e.extra_fields.total_allocated, default=None)
    peak = max(at_start, top.extra_fields.total_allocated - base if top else 0)
    where, parent = [], top.parent if top else None
    while parent is not None and parent.name != _MARK and len(where) < 3:
        where.append(parent.name)
        parent = parent.parent
    at = (top.start_time_ns - mark.start_time_ns) / max(1, mark.end_time_ns - mark.start_time_ns) if top else 0.0
    phases = {}
    for ph in (e for e in events if e.name.startswith(_MARK + ".")):
        totals = [e.extra_fields.total_allocated - base for e in inside
                  if ph.start_time_ns <= e.start_time_ns <= ph.end_time_ns]  # fmt: skip
        phases[ph.name.rsplit(".", 1)[1]] = max(totals, default=at_start)
    return {
        "peak": peak,
        "at_step_start": at_start,
        "transient": peak - at_start,
        "peak_by_phase": phases,
        "peak_at": {"ops": " < ".join(where), "fraction_of_step": round(at, 3)},
    }


def _measure(engine: str, cfg: dict, batches: list, warmup: int, checkpointing: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    pick = lambda i: batches[i % len(batches)]  # noqa: E731
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(1)  # an allocation event that fixes the baseline total
        model, opt = _setup(engine, cfg, checkpointing)
        losses = [_step(model, opt, pick(i))[0] for i in range(max(1, warmup))]  # lazy init, prefetch order, state
        dist.barrier()
        with record_function(_MARK):
            losses.append(_step(model, opt, pick(max(1, warmup)), marks=True)[0])
    memory = _memory(prof)
    del prof
    counter = OpCounter(model)
    with counter:
        losses.append(_step(model, opt, pick(max(1, warmup) + 1))[0])
    return {"memory": memory, "losses": losses, **counter.summary()}


def _rank_main(rank: int, world_size: int, opts: dict) -> dict:
    """Timed rounds (engines alternating), then one instrumented pass per engine."""
    from blockshard._tiny import text_batches

    os.dup2(2, 1)  # keep the parent's stdout for the JSON report
    os.environ["BLOCKSHARD_GRADIENT_VIEWS"] = {"auto": "", "on": "1", "off": "0"}[opts["gradient_views"]]
    torch.set_num_threads(1)
    cfg, warmup = opts["model"], opts["warmup"]
    batches = text_batches(warmup + opts["steps"], cfg["batch_size"], cfg["seq_len"], seed=1000 + rank,
                           vocab_size=cfg["vocab_size"])  # fmt: skip
    out = {e: {"times": [], "losses": []} for e in ENGINES}
    for r in range(opts["rounds"]):
        for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
            model, opt = _setup(engine, cfg, opts["checkpointing"])
            times, losses = [], []
            for i, batch in enumerate(batches):
                dist.barrier()
                loss, phases = _step(model, opt, batch)
                losses.append(loss)
                if i >= warmup:
                    times.append(phases)
            out[engine]["times"].append(times)
            out[engine]["losses"].append(losses)
            del model, opt
            gc.collect()
    _track_cpu_allocations()
    for engine in ENGINES:
        out[engine]["measured"] = _measure(engine, cfg, batches, warmup, opts["checkpointing"])
    return out


# -- report -----------------------------------------------------------------------------------------
def _times(per_rank: list[dict], e: str, n_rounds: int) -> dict:
    """The step times of engine ``e`` (slowest rank per step), medians over all timed steps."""
    rounds = [list(zip(*(rk[e]["times"][r] for rk in per_rank), strict=True)) for r in range(n_rounds)]
    slowest = [[[max(x[k] for x in step) for k in range(4)] for step in rnd] for rnd in rounds]
    flat = [s for rnd in slowest for s in rnd]
    cpu = [sum(x[4] for x in step) for rnd in rounds for step in rnd]  # all ranks' processes
    return {
        "step_time_s": {"median": statistics.median(s[0] for s in flat), "min": min(s[0] for s in flat),
                        "per_round_median": [statistics.median(s[0] for s in rnd) for rnd in slowest]},
        "cpu_s_all_ranks": {"median": statistics.median(cpu), "min": min(cpu)},
        "phase_median_s": {k: statistics.median(s[i] for s in flat)
                           for i, k in ((1, "forward"), (2, "backward"), (3, "optimizer"))},
    }  # fmt: skip


def _aggregate(per_rank: list[dict], opts: dict) -> dict:
    engines, timed = {}, opts["rounds"] > 0  # --memory-only: no timed rounds
    for e in ENGINES:
        meas = [rk[e]["measured"] for rk in per_rank]
        copies = {cat: max(m["copies"][cat]["bytes"] for m in meas) for cat in meas[0]["copies"]}
        engines[e] = {
            **(_times(per_rank, e, opts["rounds"]) if timed else {}),
            "memory_bytes": {k: max(m["memory"][k] for m in meas) for k in ("peak", "at_step_start", "transient")},
            "memory_peak_by_phase_bytes": {k: max(m["memory"]["peak_by_phase"][k] for m in meas)
                                           for k in meas[0]["memory"]["peak_by_phase"]},
            "memory_peak_per_rank": [m["memory"]["peak"] for m in meas],
            "memory_peak_at_rank0": meas[0]["memory"]["peak_at"],
            "copy_bytes": copies,
            "copy_bytes_per_rank": [{c: m["copies"][c]["bytes"] for c in m["copies"]} for m in meas],
            "copy_ops_rank0": {c: v["ops"] for c, v in meas[0]["copies"].items()},
            "fill_bytes": {c: max(m["fill_bytes"].get(c, 0) for m in meas) for c in
                           sorted({c for m in meas for c in m["fill_bytes"]})},
            "cast_bytes": {c: max(m["cast_bytes"].get(c, 0) for m in meas) for c in
                           sorted({c for m in meas for c in m["cast_bytes"]})},
            "grad_accumulate_add": meas[0]["grad_accumulate_add"],
            "collectives_rank0": meas[0]["collectives"],
        }  # fmt: skip
    f, b = engines["fsdp2"], engines["blockshard"]
    losses = (lambda rk, e: rk[e]["losses"]) if timed else (lambda rk, e: [rk[e]["measured"]["losses"]])
    diffs = [abs(x - y) for rk in per_rank for lf, lb in zip(losses(rk, "fsdp2"), losses(rk, "blockshard"), strict=True)
             for x, y in zip(lf, lb, strict=True)]  # fmt: skip
    engine_copies = lambda e: e["copy_bytes"]["all_gather_path"] + e["copy_bytes"]["reduce_scatter_path"]  # noqa: E731
    ratios = {"peak_memory": b["memory_bytes"]["peak"] / f["memory_bytes"]["peak"],
              "transient_memory": b["memory_bytes"]["transient"] / max(1, f["memory_bytes"]["transient"])}  # fmt: skip
    if timed:
        ratios = {"step_time": b["step_time_s"]["median"] / f["step_time_s"]["median"],
                  "cpu_time": b["cpu_s_all_ranks"]["median"] / f["cpu_s_all_ranks"]["median"], **ratios}  # fmt: skip
    targets = {"step_time_ratio_le_1": ratios["step_time"] <= 1.0} if timed else {}
    return {
        "engines": engines, "ratios": ratios, "ratios_divide": RATIOS_DIVIDE, "loss_max_abs_diff": max(diffs),
        "targets": {**targets, "peak_memory_ratio_le_1": ratios["peak_memory"] <= 1.0,
                    "blockshard_engine_copy_bytes": engine_copies(b), "fsdp2_engine_copy_bytes": engine_copies(f)},
    }  # fmt: skip


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def render(report: dict) -> None:
    """The side-by-side table, to stderr."""
    from rich.console import Console
    from rich.table import Table

    f, b, r = report["engines"]["fsdp2"], report["engines"]["blockshard"], report["ratios"]
    t = Table(title=f"blockshard vs FSDP2 — W={report['world_size']}, {report['model']['preset']}, "
                    f"{report['rounds']} rounds x {report['steps']} steps (gloo, CPU)")  # fmt: skip
    for col in ("metric", "FSDP2", "blockshard", "blockshard / FSDP2"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    ratio = lambda x, y: f"{x / y:.3f}" if y else ("—" if x == 0 else "∞")  # noqa: E731
    rows = []
    if "step_time_s" in f:  # not under --memory-only
        rows += [("step time, median (s)", f["step_time_s"]["median"], b["step_time_s"]["median"], "{:.4f}")]
        rows += [("step time, min (s)", f["step_time_s"]["min"], b["step_time_s"]["min"], "{:.4f}")]
        rows += [(f"  {k} (s, median)", f["phase_median_s"][k], b["phase_median_s"][k], "{:.4f}")
                 for k in f["phase_median_s"]]  # fmt: skip
        rows += [("CPU time, all ranks (s, median)", f["cpu_s_all_ranks"]["median"], b["cpu_s_all_ranks"]["median"],
                  "{:.4f}")]  # fmt: skip
    rows += [("peak memory / rank", f["memory_bytes"]["peak"], b["memory_bytes"]["peak"], None),
             ("  live at step start", f["memory_bytes"]["at_step_start"], b["memory_bytes"]["at_step_start"], None),
             ("  transient in step", f["memory_bytes"]["transient"], b["memory_bytes"]["transient"], None)]  # fmt: skip
    for cat in CATEGORIES:
        rows.append((f"copies: {cat.replace('_', ' ')}", f["copy_bytes"][cat], b["copy_bytes"][cat], None))
    rows.append(("add_ into preset .grad", f["grad_accumulate_add"]["bytes"], b["grad_accumulate_add"]["bytes"], None))
    for cat in sorted(set(f["fill_bytes"]) | set(b["fill_bytes"])):
        rows.append((f"fills: {cat.replace('_', ' ')}", f["fill_bytes"].get(cat, 0), b["fill_bytes"].get(cat, 0), None))
    for name, x, y, fmt_ in rows:
        cell = fmt_.format if fmt_ else _mib
        t.add_row(name, cell(x), cell(y), ratio(y, x))
    for kind in sorted(set(f["collectives_rank0"]) | set(b["collectives_rank0"])):
        cx, cy = (e["collectives_rank0"].get(kind, {"count": 0, "bytes_sent": 0}) for e in (f, b))
        t.add_row(
            f"c10d {kind}: count / sent",
            f"{cx['count']} / {_mib(cx['bytes_sent'])}",
            f"{cy['count']} / {_mib(cy['bytes_sent'])}",
            ratio(cy["bytes_sent"], cx["bytes_sent"]),
        )
    timing = f"step-time ratio {r['step_time']:.3f}, " if "step_time" in r else ""
    t.caption = (f"{timing}peak-memory ratio {r['peak_memory']:.3f}; "
                 f"max |loss FSDP2 - loss blockshard| = {report['loss_max_abs_diff']:.2e}")  # fmt: skip
    Console(stderr=True, width=120).print(t)


# -- --persistent: bytes per rank at large W, from plans and a fake process group --------------
PERSISTENT_MODELS = ("llama3-70b", "deepseek-v3")


def _fsdp2_padded_numel(name: str, world_size: int) -> int:
    """FSDP2's padded local storage per rank (elements), from ``fully_shard`` on the meta device
    over a fake process group of ``world_size`` ranks (run in a child process: it sets torch's
    default group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from blockshard.planner._catalog import model_tensors

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    root, groups = torch.nn.Module(), {}
    with torch.device("meta"):
        for spec in model_tensors(name):
            if spec.group not in groups:
                groups[spec.group] = torch.nn.Module()
                root.add_module(f"g{len(groups)}", groups[spec.group])
            param = torch.nn.Parameter(torch.empty(spec.shape, dtype=torch.bfloat16))
            groups[spec.group].register_parameter(spec.name.replace(".", "_"), param)
    for m in [*groups.values(), root]:
        fully_shard(m, mesh=mesh)
    states = [fully_shard.state(m)._fsdp_param_group for m in [*groups.values(), root]]
    total = sum(fp._sharded_param_data.numel() for g in states if g is not None for fp in g.fsdp_params)
    dist.destroy_process_group()
    return total


def persistent_report(world_size: int, names: list[str], argv: list[str]) -> dict:
    import math
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from blockshard.planner import plan_model
    from blockshard.planner._catalog import model_tensors

    rows = []
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        for name in names:
            specs = model_tensors(name)
            plan = plan_model(specs, world_size, policy="whole")
            total = sum(math.prod(t.shape) for t in specs)
            formula = sum(math.ceil(t.shape[0] / world_size) * math.prod(t.shape[1:]) for t in specs)
            fsdp2 = pool.submit(_fsdp2_padded_numel, name, world_size).result()
            ours, itemsize = plan.segment_numel_per_rank, 2  # bf16
            rows.append({
                "model": name, "num_params": total, "num_groups": len(plan.groups),
                "ideal_bytes_per_rank": math.ceil(total / world_size) * itemsize,
                "blockshard_bytes_per_rank": ours * itemsize, "fsdp2_bytes_per_rank": fsdp2 * itemsize,
                "fsdp2_matches_formula": fsdp2 == formula,
                "blockshard_padding": 1 - total / (ours * world_size), "fsdp2_padding": 1 - total / (fsdp2 * world_size),
                "ratio_blockshard_over_fsdp2": ours / fsdp2, "target": 0.9, "meets_target": ours / fsdp2 <= 0.9,
            })  # fmt: skip
    return {
        "benchmark": "engine_vs_fsdp2 --persistent",
        "command": command("engine_vs_fsdp2.py", argv),
        "world_size": world_size,
        "what": "persistent parameter bytes per rank (bf16); gradients and optimizer state scale alike",
        "models": rows,
        "machine": machine_facts(),
    }


def _render_persistent(report: dict) -> None:
    for r in report["models"]:
        print(
            f"{r['model']:>12} W={report['world_size']}: blockshard {_mib(r['blockshard_bytes_per_rank'])}, "
            f"FSDP2 {_mib(r['fsdp2_bytes_per_rank'])} per rank -> ratio {r['ratio_blockshard_over_fsdp2']:.4f} "
            f"(FSDP2 pads {100 * r['fsdp2_padding']:.2f}%, blockshard {100 * r['blockshard_padding']:.4f}%)",
            file=sys.stderr,
        )


def _parser():
    p = parser(__doc__, world_size=4, steps=10, warmup=2)
    p.add_argument("--rounds", type=int, default=3, help="rounds; each trains both engines afresh")
    p.add_argument("--model", choices=sorted(PRESETS), default="small-llama")
    p.add_argument("--persistent", action="store_true", help="only the persistent bytes per rank (no training)")
    p.add_argument("--memory-only", action="store_true",
                   help="no timed rounds: only the instrumented pass (memory, copies, collectives)")  # fmt: skip
    p.add_argument("--gradient-views", choices=("auto", "on", "off"), default="auto",
                   help="blockshard's unsharded gradients as views of the reduce-scatter input "
                        "(BLOCKSHARD_GRADIENT_VIEWS; auto: where the backend reduce-scatters in place, not gloo)")  # fmt: skip
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute every decoder layer in backward (both engines)")  # fmt: skip
    p.add_argument("--catalog", nargs="+", default=list(PERSISTENT_MODELS), help="catalog models for --persistent")
    for flag, key in SIZE_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, help=f"override the preset's {key}")
    return add_output_args(p, timeout=1800.0)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the report (also printed as JSON with --json, written with --out)."""
    from blockshard._launch import spawn_gloo

    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parser().parse_args(argv)
    if a.persistent:
        return emit(
            persistent_report(a.world_size, a.catalog, argv), render=_render_persistent, out=a.out, as_json=a.json
        )
    if a.world_size < 2 or a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("need --world-size >= 2, --rounds >= 1, --steps >= 1, --warmup >= 0")
    cfg = dict(PRESETS[a.model], **{k: getattr(a, f) for f, k in SIZE_FLAGS.items() if getattr(a, f) is not None})
    opts = {"model": cfg, "rounds": 0 if a.memory_only else a.rounds, "steps": a.steps, "warmup": a.warmup,
            "checkpointing": a.activation_checkpointing, "gradient_views": a.gradient_views}  # fmt: skip
    t0, load_before = time.perf_counter(), os.getloadavg()
    per_rank = spawn_gloo(_rank_main, a.world_size, args=(opts,), timeout=a.timeout, threads=1)
    report = {
        "benchmark": "engine_vs_fsdp2",
        "command": command("engine_vs_fsdp2.py", argv),
        "world_size": a.world_size, "rounds": opts["rounds"], "steps": a.steps, "warmup": a.warmup,
        "model": {"preset": a.model, **cfg, "num_params": _num_params(cfg),
                  "architecture": "transformers LlamaForCausalLM (eager attention, fp32, untied head)",
                  "activation_checkpointing": a.activation_checkpointing},
        "blockshard_gradient_views": a.gradient_views,
        "optimizer": "torch.optim.AdamW(lr=1e-3), zero_grad(set_to_none=True)",
        "machine": machine_facts(load_before=load_before),
        **_aggregate(per_rank, opts),
        "wall_seconds": time.perf_counter() - t0,
    }  # fmt: skip
    return emit(report, render=render, out=a.out, as_json=a.json)


if __name__ == "__main__":
    main()
