"""Muon's optimizer step, four ways: ragged engine, FSDP2 + owner-compute, FSDP2 + plain Muon, gather-everywhere.

    python benchmarks/muon_step.py --world-size 4 --json --out docs/results/muon_step.json

One run spawns W gloo ranks (``blockshard._launch.spawn_gloo``, ``torch.set_num_threads(1)`` on every
rank). Every rank builds one model per variant (same seed: a stack of transformer-like blocks whose 2-D
weights -- q/k/v/o and a SwiGLU MLP -- get Muon and whose RMSNorm weights get AdamW) and trains all of
them in the same processes, step by step, the variants alternating (the order rotates every step, so
drift of the machine hits all alike):

1. **ragged**: ``blockshard.fully_shard`` with ``matrix`` semantics on the 2-D weights. Each rank's
   parameters are whole matrices (or empty pieces), so unmodified ``torch.optim.Muon`` steps the local
   whole matrices: no communication in the step.
2. **fsdp2+owner**: stock FSDP2 (``blockshard.integrations.fsdp2.fully_shard``: FSDP2's ``Shard(0)``,
   which splits every matrix here) and ``fsdp2.OwnerComputeOptimizer`` with inner ``torch.optim.Muon``:
   one ``all_to_all_single`` moves the gradient pieces of each matrix to its owner (owners chosen by
   ``blockshard.planner.plan_owners``, balancing Newton-Schulz FLOPs), Muon runs there on whole
   matrices, a second ``all_to_all_single`` moves the new values back.
3. **fsdp2+plain-muon**: stock ``torch.distributed.fsdp.fully_shard`` and ``torch.optim.Muon`` directly
   on the DTensor parameters. What happens is recorded; if the step raises, the error is reported and
   the variant has no numbers.
4. **gather-everywhere**: the Moonshot / DeepSpeed ZeRO-1/2 way, on stock FSDP2's row shards: each rank
   updates the momentum of its shard, all-gathers every matrix's (Nesterov) update direction
   (``all_gather_into_tensor``, issued asynchronously for all matrices at once), runs Newton-Schulz on
   every whole matrix and keeps its own rows of the result. Numerically the same as Muon on one process.

Timing: forward and backward are not timed. A ``dist.barrier()`` precedes every timed Muon step; a
step's time is the slowest rank's ``muon.step()``; medians are over the timed steps (after
``--warmup`` untimed ones). The AdamW step on the norms and ``zero_grad`` follow, untimed. Every rank
gets the same batch, so all variants train the same model (the average of W equal gradients is exact
at W in {2, 4}); the report gives each variant's largest parameter difference from the ragged one.

Counted, not timed (one more step per variant under a ``TorchDispatchMode``):

* **Newton-Schulz FLOPs per rank**: ``blockshard.semantics.newton_schulz_flops`` summed over the
  matrices the rank orthogonalizes (from shapes), cross-checked against the FLOPs of the ``mm`` /
  ``addmm`` ops the step dispatched.
* **bytes per rank in the step**: the ``c10d`` collectives the step issued (``all_to_all_single``:
  bytes to / from other ranks, self entries excluded; ``all_gather_into_tensor``: (W-1) x the input
  out, output - input in), next to what the owner plan (``plan.all_to_all_splits``) or the shapes
  predict. Every variant also reduce-scatters gradients in backward and all-gathers parameters in
  forward (the engine's or FSDP2's, the same bytes for all): only the step's own communication is
  compared here.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _report import emit  # benchmarks/_report.py (scripts run with benchmarks/ on sys.path)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

VARIANTS = ("ragged", "fsdp2+owner", "fsdp2+plain-muon", "gather-everywhere")
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)  # ns_steps=5, torch's coefficients
ADAMW = dict(lr=1e-3)
MODEL_DEFAULTS = dict(blocks=4, hidden=256, kv_dim=64, intermediate=704, heads=4, seq_len=32, batch_size=2)
MATRIX_SEMANTICS = {"*_proj.weight": "matrix"}  # q/k/v/o and the MLP; the RMSNorm weights stay element-wise


# -- model ------------------------------------------------------------------------------------------
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


class Model(nn.Module):
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


def build(cfg: dict) -> Model:
    torch.manual_seed(0)
    return Model(cfg)


def check_config(cfg: dict) -> None:
    h, kv, heads = cfg["hidden"], cfg["kv_dim"], cfg["heads"]
    if min(cfg.values()) < 1 or h % heads or kv % (h // heads) or heads % (kv // (h // heads)):
        raise SystemExit(
            f"bad model sizes {cfg}: need hidden % heads == 0, kv_dim a multiple of the head "
            "dim (hidden / heads) and heads a multiple of the KV heads, all sizes >= 1"
        )


def matrix_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The Muon matrices (full shapes), in the model's parameter order."""
    return [(n, tuple(p.shape)) for n, p in build(cfg).named_parameters() if p.ndim == 2]


def ragged_packing(cfg: dict, world_sizes) -> dict:
    """Newton-Schulz FLOPs per rank that the ragged engine's layouts give, from the planner alone.

    Mirrors ``blockshard.fully_shard`` on this model: one group per block (``plan_group``), each group
    rotated by whole segments to balance the cost accumulated over the groups before it (the
    engine's cross-group balance, ``blockshard.planner._balance``); the root group (the final norm)
    has no matrices. Also: without the rotation, and with all blocks in one group. Per W:
    ``max rank / (total / W)`` and the number of ranks that orthogonalize anything.
    """
    import numpy as np

    from blockshard.planner import plan_group, resolve_items
    from blockshard.planner._balance import balance, rank_costs
    from blockshard.semantics import TensorSpec

    model = build(cfg)

    def items(block: nn.Module, prefix: str = ""):
        specs = [TensorSpec(name=prefix + n, shape=tuple(p.shape), dtype="float32",
                            module_type=type(block.get_submodule(n.rpartition(".")[0])).__name__)
                 for n, p in block.named_parameters()]  # fmt: skip
        return resolve_items(specs, MATRIX_SEMANTICS)

    def ns(it) -> float:
        return it.cost if it.label == "matrix" else 0.0

    per_block = [items(b) for b in model.blocks]
    total = sum(ns(it) for its in per_block for it in its)
    out = {}
    for w in world_sizes:
        running, plain, rotated = np.zeros(w), np.zeros(w), np.zeros(w)
        for its in per_block:
            layout = plan_group(its, w, name="Block")
            plain += rank_costs(layout, {it.name: ns(it) for it in its})
            layout = balance(layout, {it.name: it.cost for it in its}, running)
            rotated += rank_costs(layout, {it.name: ns(it) for it in its})
        whole = [it for i, b in enumerate(model.blocks) for it in items(b, f"blocks.{i}.")]
        one = rank_costs(plan_group(whole, w, name="Blocks"), {it.name: ns(it) for it in whole})
        out[str(w)] = {name: {"ns_flops_max_rank_over_total_per_rank": float(c.max() / (total / w)),
                              "ranks_with_ns_work": int((c > 0).sum())}
                       for name, c in (("per_block_groups_rotated", rotated), ("per_block_groups_no_rotation", plain),
                                       ("one_group_all_blocks", one))}  # fmt: skip
        out[str(w)]["per_block_groups_rotated"]["ns_flops_per_rank"] = rotated.tolist()
    return out


def _batch(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    shape = (cfg["batch_size"], cfg["seq_len"], cfg["hidden"])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- variants ---------------------------------------------------------------------------------------
def _ns_flops(shapes) -> float:
    from blockshard.semantics import newton_schulz_flops

    return float(sum(newton_schulz_flops(tuple(s)) for s in shapes))


class GatherEverywhereMuon:
    """Distributed Muon as in Moonshot's "Muon is Scalable" and DeepSpeed ZeRO-1/2: momentum sharded
    by FSDP2's ``Shard(0)`` rows, every whole matrix's update direction all-gathered to every rank,
    Newton-Schulz on every matrix everywhere, each rank keeps its own rows.

    Same arithmetic as ``torch.optim.Muon`` on one process (its own ``_zeropower_via_newtonschulz``
    and ``_adjust_lr``), so with the same gradients it gives the same parameters bitwise.
    """

    def __init__(
        self,
        named_params,
        *,
        lr,
        momentum,
        nesterov,
        weight_decay,
        ns_steps=5,
        ns_coefficients=(3.4445, -4.7750, 2.0315),
        eps=1e-7,
    ) -> None:
        from torch.distributed.tensor import DTensor, Shard

        self.opts = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps)  # fmt: skip
        self.params = []
        for name, p in named_params:
            if not (isinstance(p, DTensor) and p.placements == (Shard(0),) and p.ndim == 2):
                raise ValueError(f"{name}: gather-everywhere expects FSDP2 Shard(0) 2-D DTensors, got {type(p)}")
            w, r = p.device_mesh.size(), p.device_mesh.get_local_rank()
            rows = p.shape[0]
            c = -(-rows // w)
            lo, hi = min(r * c, rows), min((r + 1) * c, rows)
            local = p.to_local()
            self.params.append(
                dict(
                    name=name,
                    p=p,
                    shape=tuple(p.shape),
                    c=c,
                    lo=lo,
                    hi=hi,
                    w=w,
                    group=p.device_mesh.get_group(),
                    buf=torch.zeros_like(local),
                )
            )

    def ns_shapes(self) -> list[tuple[int, ...]]:
        return [q["shape"] for q in self.params]

    def planned_bytes(self) -> tuple[int, int]:
        """(sent, received) per rank per step: (W-1) copies of this rank's padded shard out, W-1 in."""
        n = sum((q["w"] - 1) * q["c"] * q["shape"][1] * q["buf"].element_size() for q in self.params)
        return n, n

    @torch.no_grad()
    def step(self) -> None:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        o = self.opts
        pending = []
        for q in self.params:  # momentum on the shard, then all-gather the update direction
            g = q["p"].grad.to_local()
            buf = q["buf"]
            buf.lerp_(g, 1 - o["momentum"])
            upd = g.lerp(buf, o["momentum"]) if o["nesterov"] else buf
            send = upd.new_zeros((q["c"], q["shape"][1]))
            send[: q["hi"] - q["lo"]].copy_(upd)
            out = upd.new_empty((q["w"] * q["c"], q["shape"][1]))
            pending.append((q, out, dist.all_gather_into_tensor(out, send, group=q["group"], async_op=True)))
        for q, out, work in pending:  # Newton-Schulz on every whole matrix, keep this rank's rows
            work.wait()
            full = _zeropower_via_newtonschulz(out[: q["shape"][0]], o["ns_coefficients"], o["ns_steps"], o["eps"])
            local = q["p"].to_local()
            local.mul_(1 - o["lr"] * o["weight_decay"])
            local.add_(full[q["lo"] : q["hi"]], alpha=-_adjust_lr(o["lr"], None, torch.Size(q["shape"])))

    def zero_grad(self) -> None:
        for q in self.params:
            q["p"].grad = None


class Variant:
    """One model and its optimizers on this rank."""

    def __init__(self, name: str, cfg: dict) -> None:
        self.name, self.error, self.times = name, None, []
        self.model = model = build(cfg)
        rank = dist.get_rank()
        self.planned = (0, 0)  # bytes (sent, received) per rank that the step's collectives should move
        if name == "ragged":
            import blockshard

            for b in model.blocks:
                blockshard.fully_shard(b, semantics=MATRIX_SEMANTICS)
            blockshard.fully_shard(model)
            named = [(n, p) for n, p in model.named_parameters() if p.numel() > 0]  # ranks may hold empty pieces
            mats = [(n, p) for n, p in named if p.ndim == 2]
            self.muon = torch.optim.Muon([p for _, p in mats], **MUON) if mats else None
            rest = [p for _, p in named if p.ndim != 2]
            self.adamw = torch.optim.AdamW(rest, **ADAMW) if rest else None
            self.ns_matrices = [(n, tuple(p.shape)) for n, p in mats]
        elif name == "fsdp2+owner":
            from blockshard.integrations import fsdp2

            for b in model.blocks:
                fsdp2.fully_shard(b, semantics=MATRIX_SEMANTICS, root=model)
            fsdp2.fully_shard(model, semantics=MATRIX_SEMANTICS)
            named = list(model.named_parameters())
            mats = [(n, p) for n, p in named if p.ndim == 2]
            self.muon = fsdp2.OwnerComputeOptimizer(
                lambda g: torch.optim.Muon(g, **MUON), mats, semantics="matrix", model=model
            )
            self.adamw = fsdp2.OwnerComputeOptimizer(
                lambda g: torch.optim.AdamW(g, **ADAMW), [(n, p) for n, p in named if p.ndim != 2], model=model
            )
            # What the inner Muon orthogonalizes here: its compute tensors (owned whole matrices and
            # whole matrices inside this rank's shard), named where they are owned whole matrices.
            computed = [tuple(t.shape) for g in self.muon.inner.param_groups for t in g["params"] if t.numel() > 0]
            full = {n: tuple(p.shape) for n, p in mats}
            owned = [n for n, _, numel in self.muon.owned_units() if numel == math.prod(full[n])]
            named_ok = sorted(full[n] for n in owned) == sorted(computed)
            self.ns_matrices = [(n, full[n]) for n in owned] if named_ok else [("(unnamed)", s) for s in computed]
            send, recv = self.muon.plan.all_to_all_splits(rank)  # elements, gradient direction
            nbytes = 4 * (sum(send) + sum(recv))  # fp32; the update direction swaps send and recv
            self.planned = (nbytes, nbytes)
            self.plan = self.muon.plan.to_json()
        else:
            from torch.distributed.fsdp import fully_shard

            for b in model.blocks:
                fully_shard(b)
            fully_shard(model)
            named = list(model.named_parameters())
            mats = [(n, p) for n, p in named if p.ndim == 2]
            self.adamw = torch.optim.AdamW([p for n, p in named if p.ndim != 2], **ADAMW)
            if name == "fsdp2+plain-muon":
                self.muon = torch.optim.Muon([p for _, p in mats], **MUON)
                self.ns_matrices = None  # DTensor splits each matmul: counted from the dispatched mm/addmm
                self.planned = None  # whatever collectives DTensor's sharding propagation issues: counted
            else:
                self.muon = GatherEverywhereMuon(mats, **MUON)
                self.ns_matrices = [(n, tuple(p.shape)) for n, p in mats]
                self.planned = self.muon.planned_bytes()

    def forward_backward(self, batch) -> float:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss.item()

    def step(self, timed: bool) -> None:
        """The Muon step (timed, after a barrier), then AdamW and zero_grad (untimed)."""
        dist.barrier()
        t0 = time.perf_counter()
        if self.muon is not None:
            self.muon.step()
        t1 = time.perf_counter()
        if timed:
            self.times.append(t1 - t0)
        if self.adamw is not None:
            self.adamw.step()
        for o in (self.muon, self.adamw):
            if o is not None:
                o.zero_grad()

    def full_params(self) -> dict[str, torch.Tensor]:
        """Full parameters by name (collective)."""
        if self.name == "ragged":
            import blockshard

            return {k: v.clone() for k, v in blockshard.full_state_dict(self.model).items()}
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}


# -- counting ---------------------------------------------------------------------------------------
class StepCounter(TorchDispatchMode):
    """c10d collectives (bytes to / from other ranks) and matmul FLOPs dispatched in one step."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.w = rank, world_size
        self.collectives: dict[str, dict[str, int]] = {}
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
            sent = recv = 0
            if kind == "_allgather_base_":  # (output, input, ...)
                out, inp = args[0], args[1]
                sent = (self.w - 1) * _nbytes(inp)
                recv = _nbytes(out) - _nbytes(inp)
            elif kind == "alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes, ...)
                out, inp, osplit, isplit = args[0], args[1], args[3], args[4]
                sent = _nbytes(inp) - _split_bytes(inp, isplit, self.rank, self.w)
                recv = _nbytes(out) - _split_bytes(out, osplit, self.rank, self.w)
            elif kind == "all_gather_into_tensor":  # functional (DTensor): (input, group_size, group)
                sent = recv = (self.w - 1) * _nbytes(args[0])
            elif kind in ("all_reduce", "allreduce_"):  # ring all-reduce: 2 (W-1)/W of the tensor each way
                sent = recv = 2 * (self.w - 1) * _nbytes(args[0]) // self.w
            elif kind in ("reduce_scatter_tensor", "_reduce_scatter_base_"):  # (W-1)/W of the input each way
                inp = args[0] if kind == "reduce_scatter_tensor" else args[1]
                sent = recv = (self.w - 1) * _nbytes(inp) // self.w
            elif kind == "all_to_all_single":  # functional: (input, output_split_sizes, input_split_sizes, group)
                inp, osplit, isplit = args[0], args[1], args[2]
                sent = _nbytes(inp) - _split_bytes(inp, isplit, self.rank, self.w)
                recv = sum(osplit) * (_nbytes(inp) // max(1, sum(isplit))) - _split_bytes(
                    inp, isplit, self.rank, self.w
                )
            elif kind in ("wait_tensor", "barrier", "_wrap_tensor_autograd"):  # no data of their own
                return func(*args, **kwargs)
            else:  # not expected in a step: counted by size, direction unknown
                sent = recv = sum(_nbytes(a) for a in args if isinstance(a, torch.Tensor))
            rec = self.collectives.setdefault(kind, {"count": 0, "bytes_sent": 0, "bytes_received": 0})
            rec["count"] += 1
            rec["bytes_sent"] += sent
            rec["bytes_received"] += recv
        return func(*args, **kwargs)

    def totals(self) -> tuple[int, int]:
        return (
            sum(c["bytes_sent"] for c in self.collectives.values()),
            sum(c["bytes_received"] for c in self.collectives.values()),
        )


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _split_bytes(t: torch.Tensor, splits, rank: int, w: int) -> int:
    """Bytes of ``t``'s split for ``rank`` (the self entry of an all_to_all)."""
    if t.numel() == 0:
        return 0
    per_row = t[0].numel() * t.element_size() if t.ndim > 1 else t.element_size()
    if not splits:
        return t.numel() * t.element_size() // w
    return int(splits[rank]) * per_row


# -- one rank ---------------------------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, opts: dict) -> dict:
    os.dup2(2, 1)  # keep the parent's stdout for the JSON report
    torch.set_num_threads(1)
    cfg, warmup, steps = opts["model"], opts["warmup"], opts["steps"]
    variants = [Variant(n, cfg) for n in VARIANTS]
    errors: dict[str, dict] = {}
    for i in range(warmup + steps):
        batch = _batch(cfg, i)
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            if v.error is not None:
                continue
            v.forward_backward(batch)
            try:
                v.step(timed=i >= warmup)
            except Exception as e:
                if v.name != "fsdp2+plain-muon":
                    raise
                tb = traceback.extract_tb(e.__traceback__)
                muon_frames = [
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.line}" for f in tb if "_muon" in f.filename
                ]
                v.error = {"type": type(e).__name__, "message": str(e).strip().splitlines()[0],
                           "at_step": i, "where": muon_frames[-1] if muon_frames else None}  # fmt: skip
                errors[v.name] = v.error
                dist.barrier()  # every rank fails alike (same shapes); resynchronize
    counted = {}
    batch = _batch(cfg, warmup + steps)
    for v in variants:  # one more step each, counted (not timed)
        if v.error is not None:
            continue
        v.forward_backward(batch)
        dist.barrier()
        counter = StepCounter(rank, world_size)
        with counter:
            if v.muon is not None:
                v.muon.step()
        if v.adamw is not None:
            v.adamw.step()
        for o in (v.muon, v.adamw):
            if o is not None:
                o.zero_grad()
        sent, recv = counter.totals()
        counted[v.name] = {"collectives": counter.collectives, "bytes_sent": sent, "bytes_received": recv,
                           "matmul_flops": counter.matmul_flops}  # fmt: skip
    ok = [v for v in variants if v.error is None]
    params = {v.name: v.full_params() for v in ok}
    ref = params["ragged"]
    diffs = {n: max(float((p[k] - ref[k]).abs().max()) for k in ref) for n, p in params.items()}
    out = {}
    for v in variants:
        out[v.name] = {"times": v.times, "error": v.error, "planned_bytes": v.planned,
                       "ns_matrices": v.ns_matrices, "counted": counted.get(v.name),
                       "param_max_abs_diff_vs_ragged": diffs.get(v.name), "plan": getattr(v, "plan", None)}  # fmt: skip
    del variants, params
    gc.collect()
    return out


# -- report -----------------------------------------------------------------------------------------
def _aggregate(per_rank: list[dict], opts: dict) -> dict:
    w = len(per_rank)
    shapes = matrix_shapes(opts["model"])
    total_flops = _ns_flops(s for _, s in shapes)
    grad_bytes = 4 * sum(math.prod(s) for _, s in shapes)
    packing = ragged_packing(opts["model"], sorted({2, 4, 8, 16, 32, w}))
    variants = {}
    for name in VARIANTS:
        rk = [r[name] for r in per_rank]
        err = next((x["error"] for x in rk if x["error"] is not None), None)
        rec: dict = {"status": "error" if err else "ok"}
        if err:
            rec["error"] = err
            variants[name] = rec
            continue
        slowest = [max(ts) for ts in zip(*(x["times"] for x in rk), strict=True)]
        counted = [x["counted"] for x in rk]
        from_shapes = rk[0]["ns_matrices"] is not None
        flops = [
            _ns_flops(s for _, s in x["ns_matrices"]) if from_shapes else c["matmul_flops"]
            for x, c in zip(rk, counted, strict=True)
        ]
        rec.update({
            "step_time_s": {"median": statistics.median(slowest), "min": min(slowest), "max": max(slowest),
                            "per_step_slowest_rank": slowest,
                            "per_rank_median": [statistics.median(x["times"]) for x in rk]},
            "ns_flops_per_rank": flops,
            "ns_flops_source": "newton_schulz_flops of the whole matrices the rank orthogonalizes" if from_shapes
                               else "mm/addmm FLOPs the rank dispatched in the step (DTensor splits the matmuls)",
            "ns_flops_sum_over_ranks": sum(flops),
            "ns_flops_max_over_total_per_rank": max(flops) / (total_flops / w),
            "matmul_flops_dispatched_per_rank": [c["matmul_flops"] for c in counted],
            "ns_matrices_per_rank": [[f"{n} {list(s)}" for n, s in x["ns_matrices"]] for x in rk] if from_shapes else None,
            "step_bytes_sent_per_rank": [c["bytes_sent"] for c in counted],
            "step_bytes_received_per_rank": [c["bytes_received"] for c in counted],
            "step_bytes_planned_per_rank": [x["planned_bytes"][0] for x in rk] if rk[0]["planned_bytes"] else None,
            "step_collectives_rank0": counted[0]["collectives"],
            "param_max_abs_diff_vs_ragged": max(x["param_max_abs_diff_vs_ragged"] for x in rk),
        })  # fmt: skip
        if name == "fsdp2+plain-muon":
            colls = rec["step_collectives_rank0"]
            rec["what_happens"] = (
                "torch.optim.Muon ran on the DTensor parameters: DTensor's sharding propagation redistributes "
                "inside Newton-Schulz, issuing "
                + ", ".join(f"{c['count']} {k}" for k, c in sorted(colls.items()))
                + f" per step on rank 0; the parameters differ from the ragged run (= Muon on one process) by up "
                f"to {rec['param_max_abs_diff_vs_ragged']:.1e}"
            )
        if name == "ragged":
            pred = packing[str(w)]["per_block_groups_rotated"]["ns_flops_per_rank"]
            rec["ns_flops_per_rank_planner_prediction"] = pred
            rec["planner_prediction_matches"] = pred == flops
        if rk[0]["plan"] is not None:
            p = rk[0]["plan"]
            rec["owner_plan"] = {"straddling_units": len(p["straddling_units"]),
                                 "max_cost_over_mean": p["max_cost_over_mean"],
                                 "send_numel_per_rank": p["send_numel_per_rank"],
                                 "recv_numel_per_rank": p["recv_numel_per_rank"]}  # fmt: skip
        variants[name] = rec
    r, o, g = variants["ragged"], variants["fsdp2+owner"], variants["gather-everywhere"]

    def step_bytes(v: dict) -> int:  # the busiest rank, the larger of its two directions
        return max(
            max(a, b) for a, b in zip(v["step_bytes_sent_per_rank"], v["step_bytes_received_per_rank"], strict=True)
        )

    ratios = {
        "gather_everywhere_over_ragged_step_time": g["step_time_s"]["median"] / r["step_time_s"]["median"],
        "owner_over_ragged_step_time": o["step_time_s"]["median"] / r["step_time_s"]["median"],
        "ragged_ns_flops_max_rank_over_total_per_rank": r["ns_flops_max_over_total_per_rank"],
        "owner_ns_flops_max_rank_over_total_per_rank": o["ns_flops_max_over_total_per_rank"],
        "gather_ns_flops_max_rank_over_total_per_rank": g["ns_flops_max_over_total_per_rank"],
        "owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank": step_bytes(o) / (2 * grad_bytes / w),
        "gather_step_bytes_max_rank_over_2x_grad_bytes_per_rank": step_bytes(g) / (2 * grad_bytes / w),
    }
    targets = {
        "ragged_step_at_least_2x_faster_than_gather_everywhere": {
            "value": ratios["gather_everywhere_over_ragged_step_time"], "target": ">= 2",
            "met": ratios["gather_everywhere_over_ragged_step_time"] >= 2.0},
        "ragged_ns_flops_max_rank_le_1.1x_total_over_W": {
            "value": ratios["ragged_ns_flops_max_rank_over_total_per_rank"], "target": "<= 1.1",
            "met": ratios["ragged_ns_flops_max_rank_over_total_per_rank"] <= 1.1},
        "owner_step_bytes_max_rank_le_2x_grad_bytes_over_W": {
            "value": ratios["owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank"], "target": "<= 1",
            "met": ratios["owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank"] <= 1.0},
    }  # fmt: skip
    return {"totals": {"ns_flops_total": total_flops, "ns_flops_total_over_W": total_flops / w,
                       "muon_grad_bytes": grad_bytes, "muon_grad_bytes_over_W": grad_bytes / w},
            "variants": variants, "ratios": ratios, "targets": targets,
            "ragged_packing_from_planner": packing}  # fmt: skip


def _gflop(x: float) -> str:
    return f"{x / 1e9:,.3f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:,.3f}"


def render(report: dict) -> None:
    """The side-by-side table, to stderr."""
    from rich.console import Console
    from rich.table import Table

    vs, tot = report["variants"], report["totals"]
    m = report["model"]
    t = Table(title=f"Muon optimizer step — W={report['world_size']}, {m['blocks']} blocks, "
                    f"{m['num_matrices']} matrices, {report['steps']} timed steps (gloo, CPU)")  # fmt: skip
    t.add_column("metric")
    for name in VARIANTS:
        t.add_column(name, justify="right")

    def row(label, fn):
        cells = []
        for name in VARIANTS:
            v = vs[name]
            cells.append(fn(v) if v["status"] == "ok" else "error")
        t.add_row(label, *cells)

    row("step time, median (s)", lambda v: f"{v['step_time_s']['median']:.4f}")
    row("step time, min (s)", lambda v: f"{v['step_time_s']['min']:.4f}")
    row("NS GFLOP / rank (max)", lambda v: _gflop(max(v["ns_flops_per_rank"])))
    row("NS GFLOP / rank (min)", lambda v: _gflop(min(v["ns_flops_per_rank"])))
    row("NS max rank / (total / W)", lambda v: f"{v['ns_flops_max_over_total_per_rank']:.3f}")
    row("matmul GFLOP dispatched (max)", lambda v: _gflop(max(v["matmul_flops_dispatched_per_rank"])))
    row("step MiB sent / rank (max)", lambda v: _mib(max(v["step_bytes_sent_per_rank"])))
    row("step MiB received / rank (max)", lambda v: _mib(max(v["step_bytes_received_per_rank"])))
    row(
        "step MiB planned / rank (max)",
        lambda v: _mib(max(v["step_bytes_planned_per_rank"])) if v["step_bytes_planned_per_rank"] else "—",
    )
    row(
        "collectives in the step (rank 0)", lambda v: str(sum(c["count"] for c in v["step_collectives_rank0"].values()))
    )
    row("max |param - ragged|", lambda v: f"{v['param_max_abs_diff_vs_ragged']:.1e}")
    r = report["ratios"]
    err = vs["fsdp2+plain-muon"].get("error")
    t.caption = (f"NS total {_gflop(tot['ns_flops_total'])} GFLOP, total/W {_gflop(tot['ns_flops_total_over_W'])}; "
                 f"Muon grads {_mib(tot['muon_grad_bytes'])} MiB, 2 x grads/W {_mib(2 * tot['muon_grad_bytes_over_W'])} MiB. "
                 f"gather/ragged step time {r['gather_everywhere_over_ragged_step_time']:.2f}x; "
                 f"owner bytes / (2 x grads/W) {r['owner_step_bytes_max_rank_over_2x_grad_bytes_per_rank']:.3f}"
                 + (f"\nfsdp2+plain-muon: {err['type']}: {err['message']} ({err['where']})" if err else ""))  # fmt: skip
    Console(stderr=True, width=140).print(t)
    pk = Table(title="ragged engine: NS FLOPs of the busiest rank / (total / W), from the planner "
                     "(ranks with NS work in parentheses)")  # fmt: skip
    pk.add_column("W", justify="right")
    kinds = ("per_block_groups_rotated", "per_block_groups_no_rotation", "one_group_all_blocks")
    for k in kinds:
        pk.add_column(k.replace("_", " "), justify="right")
    for w, row_ in report["ragged_packing_from_planner"].items():
        pk.add_row(w, *(f"{row_[k]['ns_flops_max_rank_over_total_per_rank']:.3f} ({row_[k]['ranks_with_ns_work']})"
                        for k in kinds))  # fmt: skip
    Console(stderr=True, width=140).print(pk)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    for key, val in MODEL_DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=val, help=f"model size (default {val})")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    p.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the report (also printed as JSON with --json, written with --out)."""
    from blockshard._launch import spawn_gloo

    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parser().parse_args(argv)
    if a.world_size < 2 or a.steps < 1 or a.warmup < 0:
        raise SystemExit("need --world-size >= 2, --steps >= 1, --warmup >= 0")
    cfg = {k: getattr(a, k) for k in MODEL_DEFAULTS}
    check_config(cfg)
    opts = {"model": cfg, "steps": a.steps, "warmup": a.warmup}
    t0, load_before = time.perf_counter(), os.getloadavg()
    per_rank = spawn_gloo(_rank_main, a.world_size, args=(opts,), timeout=a.timeout, threads=1)
    shapes = matrix_shapes(cfg)
    report = {
        "benchmark": "muon_step",
        "command": shlex.join(["python", "benchmarks/muon_step.py", *argv]),
        "world_size": a.world_size, "steps": a.steps, "warmup": a.warmup,
        "model": {**cfg, "num_matrices": len(shapes),
                  "matrices": [{"name": n, "shape": list(s), "ns_flops": _ns_flops([s])} for n, s in shapes],
                  "num_params": sum(p.numel() for p in build(cfg).parameters()),
                  "architecture": "blocks of RMSNorm + causal GQA attention (q/k/v/o) + RMSNorm + SwiGLU MLP "
                                  "(gate/up/down), no biases, final RMSNorm; fp32; MSE to a random target"},
        "optimizer": {"muon": f"torch.optim.Muon({', '.join(f'{k}={v}' for k, v in MUON.items())}), ns_steps=5, "
                              "bf16 Newton-Schulz (torch's), on every 2-D weight",
                      "adamw": f"torch.optim.AdamW(lr={ADAMW['lr']}) on the RMSNorm weights, not timed"},
        "timing": "median over timed steps of the slowest rank's Muon step (a barrier before each); forward, "
                  "backward, AdamW and zero_grad untimed; variants alternate in the same processes, order "
                  "rotating every step; every rank gets the same batch",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "backend": "gloo", "threads_per_rank": 1,
                    "oversubscribed": a.world_size > (os.cpu_count() or 1),
                    "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg()},
        **_aggregate(per_rank, opts),
        "notes": [
            "Step communication only: every variant also all-gathers parameters in forward and reduce-scatters "
            "gradients in backward (blockshard's engine or FSDP2, the same bytes), which is not counted here.",
            "ragged: 0 bytes in the step by construction (each rank steps the whole matrices it holds); its NS "
            "balance depends on how the planner packs whole matrices into equal per-rank segments (bytes, not "
            "FLOPs), one group per block.",
            "Bytes per rank: sent = bytes to other ranks, received = bytes from other ranks (self parts excluded); "
            "for the owner all_to_alls and the all-gathers the two are equal on every rank.",
        ],
        "wall_seconds": time.perf_counter() - t0,
    }  # fmt: skip
    return emit(report, render=render, out=a.out, as_json=a.json)


if __name__ == "__main__":
    main()
