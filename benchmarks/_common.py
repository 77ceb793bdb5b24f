"""What the benchmarks share: arguments, machine facts and load, the report, byte and op counting, models.

Scripts run with ``benchmarks/`` on ``sys.path`` (``python benchmarks/<name>.py``; the smoke tests
prepend it), so they import this module as ``_common``; their spawned ranks inherit that path.

* :func:`parser`, :func:`add_output_args`, :func:`command`: the flags every benchmark takes
  (``--world-size``, ``--steps``, ``--warmup``, ``--timeout``, ``--json``, ``--out``) and the command
  line recorded in the report.
* :func:`machine_facts`: the ``"machine"`` entry (CPUs, platform, versions, backend, threads per rank
  and the load average before and after the run).
* :func:`emit`: print the table, write ``--out``, print ``--json``.
* :func:`nbytes`, :class:`CollectiveCounter`, :class:`StepCounter`: bytes of tensors (a DTensor
  counts its local shard), per-kind tallies of ``c10d`` collectives, and a ``TorchDispatchMode`` that
  counts one step's collectives (bytes to / from *other* ranks) and matmul FLOPs.
* :class:`BlockStack`: the tiny Llama-like stack of blocks (GQA attention + SwiGLU MLP) of the Muon
  benchmarks; Hugging Face Llamas come from :func:`blockshard._tiny.tiny_llama`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from blockshard.runtime.core._collectives import issuing_header


# -- arguments and the report -----------------------------------------------------------------------
def parser(doc: str | None, *, world_size: int | None = 4, steps: int | None = None, warmup: int | None = 2):
    """An ``ArgumentParser`` described by the first line of ``doc``, with the common run flags.

    Flags given ``None`` are left out (a benchmark that spells one differently adds its own).
    """
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    if world_size is not None:
        p.add_argument("--world-size", type=int, default=world_size)
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help="timed steps")
    if warmup is not None:
        p.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    return p


def add_output_args(p: argparse.ArgumentParser, *, timeout: float | None = 1800.0) -> argparse.ArgumentParser:
    """``--timeout`` (unless ``timeout`` is None), ``--json`` and ``--out``."""
    if timeout is not None:
        p.add_argument("--timeout", type=float, default=timeout, help="seconds before the ranks are killed")
    p.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    return p


def command(script: str, argv: Sequence[str]) -> str:
    """The command line that reproduces the run, as recorded under ``"command"``."""
    return shlex.join(["python", f"benchmarks/{script}", *argv])


def machine_facts(*, load_before: Sequence[float] | None = None, versions: dict | None = None, **extra) -> dict:
    """CPUs, platform, Python and torch (then ``versions``), gloo, one thread per rank, ``extra``, and
    the 1/5/15-minute load average before (``load_before``, from ``os.getloadavg()``) and now."""
    facts = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
             "torch": torch.__version__, **(versions or {}), "backend": "gloo", "threads_per_rank": 1, **extra}  # fmt: skip
    if load_before is not None:
        facts["loadavg_1_5_15_before"] = load_before
        facts["loadavg_1_5_15_after"] = os.getloadavg()
    return facts


def emit(report: dict, *, render: Callable[[dict], None] | None, out: str | None, as_json: bool) -> dict:
    """Render the report (if ``render``), write it to ``out`` (if given), print it with ``as_json``."""
    if render is not None:
        render(report)
    text = json.dumps(report, indent=2)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            fh.write(text + "\n")
    if as_json:
        print(text)
    return report


# -- counting ---------------------------------------------------------------------------------------
def nbytes(obj) -> int:
    """Bytes of every tensor in ``obj`` (nested lists, tuples, dicts); a DTensor counts its local shard."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tree_leaves(obj):
        if isinstance(t, torch.Tensor):
            t = t._local_tensor if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def split_bytes(t: torch.Tensor, splits, rank: int, w: int) -> int:
    """Bytes of ``t``'s split for ``rank`` (the self entry of an all_to_all; equal splits if none given)."""
    if t.numel() == 0:
        return 0
    per_row = t[0].numel() * t.element_size() if t.ndim > 1 else t.element_size()
    if not splits:
        return t.numel() * t.element_size() // w
    return int(splits[rank]) * per_row


HEADER = "header_allgather"  # blockshard's headers ([Note: collective headers]), counted apart


class CollectiveCounter(TorchDispatchMode):
    """A dispatch mode with a per-kind tally of collectives: ``{kind: {count, bytes_sent, bytes_received}}``."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: dict[str, dict[str, int]] = {}

    def record(self, kind: str, sent: int, received: int) -> None:
        rec = self.collectives.setdefault(kind, {"count": 0, "bytes_sent": 0, "bytes_received": 0})
        rec["count"] += 1
        rec["bytes_sent"] += sent
        rec["bytes_received"] += received

    def totals(self) -> tuple[int, int]:
        """``(bytes sent, bytes received)`` over every collective counted but the headers."""
        data = [c for kind, c in self.collectives.items() if kind != HEADER]
        return sum(c["bytes_sent"] for c in data), sum(c["bytes_received"] for c in data)


class StepCounter(CollectiveCounter):
    """c10d collectives (bytes to / from *other* ranks) and matmul FLOPs dispatched in one step."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.w = rank, world_size
        self.matmul_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives, then count those
        kwargs = kwargs or {}
        name = func._schema.name
        if name in ("aten::mm", "aten::addmm"):
            a, b = (args[0], args[1]) if name == "aten::mm" else (args[1], args[2])
            self.matmul_flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif func.namespace in ("c10d", "_c10d_functional"):
            kind = name.split("::", 1)[1]
            if kind in ("wait_tensor", "barrier", "_wrap_tensor_autograd"):  # no data of their own
                return func(*args, **kwargs)
            sent_received = self._directions(kind, args)
            self.record(HEADER if kind == "_allgather_base_" and issuing_header() else kind, *sent_received)
        return func(*args, **kwargs)

    def _directions(self, kind: str, args) -> tuple[int, int]:
        """``(sent, received)`` bytes of one collective, to and from other ranks."""
        w, rank = self.w, self.rank
        if kind == "_allgather_base_":  # (output, input, ...)
            out, inp = args[0], args[1]
            return (w - 1) * nbytes(inp), nbytes(out) - nbytes(inp)
        if kind == "alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes, ...)
            out, inp, osplit, isplit = args[0], args[1], args[3], args[4]
            return nbytes(inp) - split_bytes(inp, isplit, rank, w), nbytes(out) - split_bytes(out, osplit, rank, w)
        if kind == "all_gather_into_tensor":  # functional (DTensor): (input, group_size, group)
            n = (w - 1) * nbytes(args[0])
            return n, n
        if kind in ("all_reduce", "allreduce_"):  # ring all-reduce: 2 (W-1)/W of the tensor each way
            n = 2 * (w - 1) * nbytes(args[0]) // w
            return n, n
        if kind in ("reduce_scatter_tensor", "_reduce_scatter_base_"):  # (W-1)/W of the input each way
            n = (w - 1) * nbytes(args[0] if kind == "reduce_scatter_tensor" else args[1]) // w
            return n, n
        if kind == "all_to_all_single":  # functional: (input, output_split_sizes, input_split_sizes, group)
            inp, osplit, isplit = args[0], args[1], args[2]
            own = split_bytes(inp, isplit, rank, w)
            return nbytes(inp) - own, sum(osplit) * (nbytes(inp) // max(1, sum(isplit))) - own
        n = sum(nbytes(a) for a in args if isinstance(a, torch.Tensor))  # not expected: by size, direction unknown
        return n, n


# -- models -----------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm attention with grouped KV heads and a SwiGLU MLP (Llama-like), no biases."""

    def __init__(self, hidden: int, kv_dim: int, intermediate: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.kv_heads = kv_dim // self.head_dim
        self.attn_norm = nn.RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class BlockStack(nn.Module):
    """``cfg["blocks"]`` :class:`Block` s and a final RMSNorm (``cfg``: hidden, kv_dim, intermediate, heads)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(cfg["hidden"], cfg["kv_dim"], cfg["intermediate"], cfg["heads"]) for _ in range(cfg["blocks"])
        )
        self.norm = nn.RMSNorm(cfg["hidden"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def check_block_config(cfg: dict) -> None:
    """Exit with the constraint unless ``cfg`` gives a valid :class:`BlockStack`."""
    h, kv, heads = cfg["hidden"], cfg["kv_dim"], cfg["heads"]
    if min(cfg.values()) < 1 or h % heads or kv % (h // heads) or heads % (kv // (h // heads)):
        raise SystemExit(
            f"bad model sizes {cfg}: need hidden % heads == 0, kv_dim a multiple of the head "
            "dim (hidden / heads) and heads a multiple of the KV heads, all sizes >= 1"
        )
