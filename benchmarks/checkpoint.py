"""Checkpoint save / load time and bytes per rank, blockshard vs FSDP2 + DCP, saved at W and loaded at W'.

    python benchmarks/checkpoint.py --json --out docs/results/checkpoint.json

The same Hugging Face Llama (``blockshard._tiny.tiny_llama`` at ``--hidden`` / ``--layers`` /
``--vocab``, fp32) is sharded bottom-up (each decoder layer, then the root) by each engine and
trained one AdamW step on W = ``--world-size`` spawned gloo ranks (one torch thread each):

* **save** (at W): blockshard ``save_checkpoint(model, path, opt)`` (atomic: a partial directory, a
  record, a rename; see [Note: atomic checkpoints]) against FSDP2's recipe ``dcp.save({"model":
  get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)})``. Time: the slowest
  rank's, after a barrier, median of ``--repeats``; bytes written per rank: the sizes of the
  ``__<rank>_*.distcp`` files (and the whole directory).
* **load** (at W' = ``--load-world-size``, fresh model and optimizer): ``load_checkpoint`` against
  ``dcp.load`` + ``set_state_dict``; each engine loads its own checkpoint. blockshard's load is
  timed twice: as users run it (checksums verified, [Note: checkpoint integrity]) and with
  ``verify=False`` (``load_s_verify_false``), so their ratio is the cost of the check.
* **Hugging Face export** (blockshard, at W): the peak of torch's CPU allocator total during
  ``blockshard.save_pretrained(model, path)`` (streamed: one group gathered at a time) and during
  ``model.save_pretrained(path, state_dict=blockshard.full_state_dict(model))``, relative to just
  before the export, next to the rank's shard and the largest group's gathered bytes (the target:
  extra <= one gathered group). ``--export-only`` measures the export alone. Measured with the profiler's allocation events and c10's
  ``caffe2_report_cpu_memory_usage`` flag, as ``engine_vs_fsdp2.py`` does.

Times on a loaded 2-core machine are indicative only; bytes and memory do not depend on load.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from _common import add_output_args, command, emit, machine_facts, parser

ENGINES = ("blockshard", "fsdp2")


def _parser():
    p = parser(__doc__, world_size=4, steps=None, warmup=None)
    p.add_argument("--load-world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--export-only", action="store_true", help="measure the Hugging Face export alone (no timing)")
    return add_output_args(p, timeout=900.0)


def _setup(engine: str, cfg: dict):
    from blockshard._tiny import tiny_llama

    model = tiny_llama(0, vocab_size=cfg["vocab"], hidden_size=cfg["hidden"],
                       intermediate_size=cfg["hidden"] * 8 // 3, num_hidden_layers=cfg["layers"])  # fmt: skip
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from blockshard import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(64).view(2, 32) % cfg["vocab"]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save(engine: str, model, opt, path: str) -> None:
    if engine == "blockshard":
        from blockshard.runtime import save_checkpoint

        save_checkpoint(model, path, opt)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _load(engine: str, model, opt, path: str, *, verify: bool = True) -> None:
    if engine == "blockshard":
        from blockshard.runtime import load_checkpoint

        load_checkpoint(model, path, opt, verify=verify)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def _rank_bytes(path: str, rank: int) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(f"__{rank}_"))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _peak_extra_bytes(fn) -> int:
    """Peak of torch's CPU allocator total while ``fn`` runs, minus the total just before."""
    from torch.profiler import ProfilerActivity, profile

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(1)  # an allocation event that fixes the baseline total
        fn()
    events = sorted(walk(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e.start_time_ns)
    allocs = [e.extra_fields for e in events if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"]
    base = allocs[0].total_allocated - allocs[0].alloc_size
    return max(a.total_allocated for a in allocs) - base


def _export_memory(model, root: str, rank: int) -> dict:
    import blockshard
    from blockshard.runtime import local_buffers
    from blockshard.runtime.core._inspect import states_under

    streamed = _peak_extra_bytes(lambda: blockshard.save_pretrained(model, f"{root}/hf-streamed"))
    dist.barrier()

    def full():
        sd = blockshard.full_state_dict(model)
        if rank == 0:
            model.save_pretrained(f"{root}/hf-full", state_dict=sd)

    gathered = _peak_extra_bytes(full)
    dist.barrier()
    groups = [st.buffers for _, st in states_under(model) if st.buffers.layout is not None]
    largest = max(g.world_size * g.layout.segment_numel * g.local.element_size() for g in groups)
    shard = sum(b["local"].numel() * b["local"].element_size() for b in local_buffers(model).values())
    return {
        "streamed_peak_extra_bytes": streamed,
        "full_state_dict_peak_extra_bytes": gathered,
        "shard_bytes": shard,
        "largest_group_gathered_bytes": largest,
        "model_bytes": sum(g.layout.total_numel * g.local.element_size() for g in groups),
        "streamed_over_largest_group": streamed / largest,
        "streamed_within_target": streamed <= largest,  # extra <= one group: the rank holds <= shard + one group
    }  # fmt: skip


def _save_times(engine: str, model, opt, path: str, rank: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        times.append(_timed(lambda: _save(engine, model, opt, path)))
    dist.barrier()
    return times


def _save_main(rank: int, world: int, opts: dict) -> dict:
    os.dup2(2, 1)  # keep the parent's stdout for the JSON report
    out: dict = {}
    for engine in ENGINES:
        model, opt = _setup(engine, opts["model"])
        path = os.path.join(opts["root"], engine)
        times = _save_times(engine, model, opt, path, rank, opts["repeats"])
        out[engine] = {"save_s": statistics.median(times), "save_s_all": times, "rank_bytes": _rank_bytes(path, rank)}
        out[engine]["dir_bytes"] = _dir_bytes(path)
        if engine == "blockshard":
            out["hf_export"] = _export_memory(model, opts["root"], rank)
    return out


def _export_main(rank: int, world: int, opts: dict) -> dict:
    os.dup2(2, 1)
    model, _ = _setup("blockshard", opts["model"])
    return _export_memory(model, opts["root"], rank)


def _load_main(rank: int, world: int, opts: dict) -> dict:
    os.dup2(2, 1)
    out: dict = {}
    for engine in ENGINES:
        model, opt = _setup(engine, opts["model"])
        path = os.path.join(opts["root"], engine)
        times = [_timed(lambda: _load(engine, model, opt, path)) for _ in range(opts["repeats"])]  # noqa: B023
        out[engine] = {"load_s": statistics.median(times), "load_s_all": times}
        if engine == "blockshard":  # the same load without checking the files' checksums
            bare = [_timed(lambda: _load(engine, model, opt, path, verify=False)) for _ in range(opts["repeats"])]  # noqa: B023
            out[engine] |= {"load_s_verify_false": statistics.median(bare), "load_s_verify_false_all": bare}
    return out


def main(argv: list[str] | None = None) -> dict:
    from blockshard._launch import spawn_gloo

    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parser().parse_args(argv)
    load_before = os.getloadavg()
    root = tempfile.mkdtemp(prefix="blockshard-ckpt-bench-")
    opts = {"root": root, "repeats": a.repeats, "model": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab}}
    if a.export_only:
        try:
            exported = spawn_gloo(_export_main, a.world_size, args=(opts,), timeout=a.timeout)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        report = {
            "benchmark": "checkpoint (Hugging Face export only)",
            "command": command("checkpoint.py", argv),
            "machine": machine_facts(load_before=load_before),
            "model": opts["model"] | {"world_size": a.world_size},
            "hf_export_per_rank": exported,
        }
        return emit(report, render=_render, out=a.out, as_json=a.json)
    try:
        saved = spawn_gloo(_save_main, a.world_size, args=(opts,), timeout=a.timeout)
        loaded = spawn_gloo(_load_main, a.load_world_size, args=(opts,), timeout=a.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "benchmark": "checkpoint",
        "command": command("checkpoint.py", argv),
        "machine": machine_facts(load_before=load_before),
        "model": opts["model"] | {"save_world_size": a.world_size, "load_world_size": a.load_world_size},
        "engines": {
            e: {
                "save_s": saved[0][e]["save_s"],
                "load_s": loaded[0][e]["load_s"],
                "bytes_written_per_rank": [r[e]["rank_bytes"] for r in saved],
                "checkpoint_bytes": saved[0][e]["dir_bytes"],
                "save_s_all": saved[0][e]["save_s_all"],
                "load_s_all": loaded[0][e]["load_s_all"],
            }
            | ({"load_s_verify_false": loaded[0][e]["load_s_verify_false"]} if e == "blockshard" else {})
            for e in ENGINES
        },
        "hf_export_per_rank": [r["hf_export"] for r in saved],
    }
    return emit(report, render=_render, out=a.out, as_json=a.json)


def _render(report: dict) -> None:
    for e, r in report.get("engines", {}).items():
        print(f"{e:10s} save {r['save_s']:.3f} s  load {r['load_s']:.3f} s  bytes/rank {r['bytes_written_per_rank']}",
              file=sys.stderr)  # fmt: skip
    for i, m in enumerate(report["hf_export_per_rank"]):
        print(f"rank {i}: HF export extra peak streamed {m['streamed_peak_extra_bytes']:,} B, full_state_dict "
              f"{m['full_state_dict_peak_extra_bytes']:,} B (largest group {m['largest_group_gathered_bytes']:,} B, "
              f"model {m['model_bytes']:,} B; streamed / group {m.get('streamed_over_largest_group', 0):.3f})",
              file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
