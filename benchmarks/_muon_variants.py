"""The Muon-step variants of ``benchmarks/muon_step.py`` (see its docstring): one model and its
optimizers per variant on this rank, and the gather-everywhere Muon of Moonshot / DeepSpeed ZeRO-1/2."""

from __future__ import annotations

import fnmatch
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import BlockStack  # benchmarks/_common.py (scripts run with benchmarks/ on sys.path)

VARIANTS = (
    "ragged",
    "fsdp2+owner",
    "fsdp2+plain-muon",
    "gather-everywhere",
    "ragged+owner",
    "ragged+owner (momentum-sharded)",
)
MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)  # ns_steps=5, torch's coefficients
ADAMW = dict(lr=1e-3)
MATRIX_SEMANTICS = {"*_proj.weight": "matrix"}  # q/k/v/o and the MLP; the RMSNorm weights stay element-wise


def is_muon(name: str) -> bool:
    """Muon's matrices, by name (a ragged piece's ndim is not its tensor's)."""
    return any(fnmatch.fnmatchcase(name, g) for g in MATRIX_SEMANTICS)


def build(cfg: dict) -> BlockStack:
    torch.manual_seed(0)
    return BlockStack(cfg)


def ns_flops(shapes) -> float:
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

            for b in model.blocks:  # whole matrices on one rank each (the default, auto, may cut some)
                blockshard.fully_shard(b, semantics=MATRIX_SEMANTICS, policy="whole")
            blockshard.fully_shard(model, policy="whole")
            named = [(n, p) for n, p in model.named_parameters() if p.numel() > 0]  # ranks may hold empty pieces
            mats = [(n, p) for n, p in named if is_muon(n)]
            self.muon = torch.optim.Muon([p for _, p in mats], **MUON) if mats else None
            rest = [p for n, p in named if not is_muon(n)]
            self.adamw = torch.optim.AdamW(rest, **ADAMW) if rest else None
            self.ns_matrices = [(n, tuple(p.shape)) for n, p in mats]
        elif name.startswith("ragged+owner"):
            self._ragged_owner(name)
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

    def _ragged_owner(self, name: str) -> None:
        """The ragged engine with ``policy="owner"``: matrices cut anywhere, computed at owners by
        ``OwnerComputeOptimizer(torch.optim.Muon)`` or ``blockshard.optim.Muon`` (momentum on the shards)."""
        import blockshard
        from blockshard.optim import Muon, OwnerComputeOptimizer
        from blockshard.runtime import global_shapes

        model = self.model
        for b in model.blocks:
            blockshard.fully_shard(b, semantics=MATRIX_SEMANTICS, policy="owner")
        blockshard.fully_shard(model, policy="owner")
        named = list(model.named_parameters())
        mats = [(n, p) for n, p in named if is_muon(n)]
        full = global_shapes(model)
        if name == "ragged+owner":
            self.muon = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, **MUON), mats)
        else:
            self.muon = Muon(mats, **MUON)
        rest = [p for n, p in named if not is_muon(n) and p.numel() > 0]
        self.adamw = torch.optim.AdamW(rest, **ADAMW) if rest else None
        whole_here = [(n, full[n]) for n, p in mats if p.numel() == math.prod(full[n])]
        self.ns_matrices = [(n, full[n]) for n, _, _ in self.muon.owned_units()] + whole_here
        ex = self.muon._exchanges.get("float32")
        nbytes = 4 * (sum(ex.send_sizes) + sum(ex.recv_sizes)) if ex is not None else 0
        self.planned = (nbytes, nbytes)  # fp32 pieces in, the same counts back

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
        if self.name.startswith("ragged"):
            import blockshard

            return {k: v.clone() for k, v in blockshard.full_state_dict(self.model).items()}
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
