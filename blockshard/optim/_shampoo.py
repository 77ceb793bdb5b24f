"""A reference blocked Shampoo whose every step is local to ``D x D`` blocks.

Blocking (``D = max_preconditioner_dim``)
    A tensor of shape ``(rows, cols)`` (more than 2-D: the view ``(shape[0], prod(shape[1:]))``) is
    tiled into ``D x D`` blocks starting at ``(0, 0)``, with smaller blocks at the right and bottom
    edges; a 1-D tensor (and a 0-d one, as ``(1,)``) is cut into runs of ``D``. Every block has its
    own factors, cached inverse roots, Adam moments and grafting norm, and nothing in a step looks at
    more than one block (no global norms). So a stripe of whole ``D``-row blocks, given to the
    optimizer as a parameter of its own, is updated bitwise as it is inside the full tensor: this is
    what blockshard's ``shampoo:D`` semantics (stripes of ``D`` rows) relies on. To make "bitwise"
    hold with MKL, every block is copied into a fresh (aligned, contiguous) tensor before any math.

One step of one block (``t`` = the parameter's step count, from 1; ``G`` = the block of the gradient,
``P`` = the block of the parameter; ``beta1, beta2 = betas``; ``gb2 = grafting_beta2``)
    Moments and factors are updated every step, also before preconditioning starts::

        M = beta1 M + (1 - beta1) G                 first moment ("filtered gradient", betas[0])
        V = gb2 V + (1 - gb2) G * G                 Adam grafting second moment
        L = beta2 L + (1 - beta2) G G^T             left factor,  r x r   (betas[1], as in
        R = beta2 R + (1 - beta2) G^T G             right factor, c x c    Distributed Shampoo)
        M^ = M / (1 - beta1^t);  V^ = V / (1 - gb2^t)                      (bias corrections)
        A = M^ / (sqrt(V^) + grafting_epsilon)      Adam direction (the grafting direction)

    Inverse roots are recomputed at steps ``t = s, s + f, s + 2f, ...`` (``s`` =
    ``start_preconditioning_step``, ``f`` = ``precondition_frequency``) and reused in between::

        X^ = X / (1 - beta2^t);  X^ = Q diag(lam) Q^T  (torch.linalg.eigh, float32 or float64)
        X^(-e) = Q diag((max(lam, 0) + epsilon)^(-e)) Q^T,   e = 1/4 for L and R of a 2-D block

    A 1-D block ``g`` is order-1 Shampoo with a single full-matrix factor: ``L = beta2 L + (1 - beta2)
    g g^T`` and ``e = 1/2``, i.e. the direction is ``L^(-1/2) m``. (In general ``e = 1 / (2 * order)``
    with order = number of factors; ``inverse_root_exponent`` overrides ``e`` for every factor.) Then::

        t <  s:  U = A                                     (grafting direction only)
        t >= s:  S = L^(-1/4) M^ R^(-1/4)                  (1-D: S = L^(-1/2) M^)
                 U = S * ||A||_F / ||S||_F                 grafting="adam" (U = 0 where S = 0)
                 U = S                                     grafting="none"
        P = P * (1 - lr * weight_decay) - lr * U           (decoupled weight decay, as AdamW)

    Before ``start_preconditioning_step`` the update is exactly AdamW with ``betas = (betas[0],
    grafting_beta2)`` and ``eps = grafting_epsilon``. There is no separate momentum on top of ``U``:
    ``betas[0]`` is the single first-moment beta, shared by Shampoo (which preconditions ``M^``) and
    the Adam grafting.

Precision: moments and the block arithmetic are float32 (float64 for float64 parameters); factors
and inverse roots are ``factor_dtype`` (float32 or float64). All per-block state lives in the
parameter's state (``state[p]["blocks"]``, a list in row-major block order) so ``state_dict()`` and
``load_state_dict()`` round-trip it exactly, dtypes included.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from blockshard._errors import BlockshardError
from blockshard.optim._shampoo_codec import ShampooBlocksCodec
from blockshard.optim._step import closure_loss
from blockshard.planner._units import rows_cols

__all__ = ["BlockedShampoo"]

_GRAFTINGS = ("adam", "none")
_FACTOR_DTYPES = (torch.float32, torch.float64)
_FACTOR_KEYS = ("factor_0", "factor_1", "inv_root_0", "inv_root_1")


def _bad(name: str, value: Any, constraint: str, fix: str) -> BlockshardError:
    return BlockshardError(f"BlockedShampoo: {name}={value!r} {constraint}; {fix}")


def _real(name: str, value: Any, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, value, "must be a finite real number", fix)
    return float(value)


def _beta(name: str, value: Any) -> float:
    fix = "pass a value in [0, 1), e.g. 0.9 or 0.999"
    if not 0.0 <= _real(name, value, fix) < 1.0:
        raise _bad(name, value, "must be in [0, 1)", fix)
    return float(value)


def _count(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(name, value, "must be an integer >= 1", fix)
    return value


def _validate(group: dict[str, Any]) -> None:
    """Check one ``param_group``'s hyperparameters; raise a ValueError naming the bad one."""
    if _real("lr", group["lr"], "pass a learning rate such as lr=1e-3") < 0:
        raise _bad("lr", group["lr"], "must be >= 0", "pass a learning rate such as lr=1e-3")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise _bad("betas", betas, "must be a pair (beta1, beta2)", "pass e.g. betas=(0.9, 0.999)")
    _beta("betas[0]", betas[0])
    _beta("betas[1]", betas[1])
    for name in ("epsilon", "grafting_epsilon"):
        if _real(name, group[name], f"pass a small positive {name}, e.g. 1e-12") <= 0:
            raise _bad(name, group[name], "must be > 0", f"pass a small positive {name}, e.g. 1e-12")
    if _real("weight_decay", group["weight_decay"], "pass e.g. weight_decay=0.01") < 0:
        raise _bad("weight_decay", group["weight_decay"], "must be >= 0", "pass 0.0 to disable it")
    _beta("grafting_beta2", group["grafting_beta2"])
    _count("max_preconditioner_dim", group["max_preconditioner_dim"], "pass the tile size, e.g. 1024")
    _count("precondition_frequency", group["precondition_frequency"], "pass 1 to recompute every step")
    _count("start_preconditioning_step", group["start_preconditioning_step"], "pass 1 to start at once")
    if group["grafting"] not in _GRAFTINGS:
        raise _bad("grafting", group["grafting"], f"must be one of {_GRAFTINGS}", "pass grafting='adam'")
    e = group["inverse_root_exponent"]
    if e is not None:
        fix = "pass None for 1/(2*order) (1/4 for matrices, 1/2 for vectors)"
        if not 0.0 < _real("inverse_root_exponent", e, fix) <= 1.0:
            raise _bad("inverse_root_exponent", e, "must be in (0, 1]", fix)
    if group["factor_dtype"] not in _FACTOR_DTYPES:
        raise _bad(
            "factor_dtype",
            group["factor_dtype"],
            "must be torch.float32 or torch.float64",
            "pass factor_dtype=torch.float32",
        )


def _matrix_shape(shape: torch.Size) -> tuple[int, ...]:
    """The shape the blocking works on: 1-D for 0-d/1-D tensors, ``(shape[0], prod(rest))`` else."""
    if len(shape) <= 1:
        return (math.prod(shape),)
    return rows_cols(shape)


def _block_slices(shape: tuple[int, ...], d: int) -> list[tuple[slice, ...]]:
    """Row-major ``d x d`` tiles (runs of ``d`` for 1-D) with smaller tiles at the far edges."""
    runs = [[slice(i, min(i + d, n)) for i in range(0, n, d)] for n in shape]
    if len(shape) == 1:
        return [(r,) for r in runs[0]]
    return [(r, c) for r in runs[0] for c in runs[1]]


def _tile_dims(shape: tuple[int, ...], d: int) -> list[tuple[int, ...]]:
    """The dims of the tiles of a tensor of ``shape``, row-major."""
    return [tuple(s.stop - s.start for s in idx) for idx in _block_slices(_matrix_shape(torch.Size(shape)), d)]


def _take(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous copy of ``view`` (same alignment and layout for the same block anywhere)."""
    out = torch.empty(view.shape, dtype=dtype, device=view.device)
    out.copy_(view)
    return out


def _inverse_root(factor: torch.Tensor, exponent: float, epsilon: float) -> torch.Tensor:
    """``Q diag((max(lam, 0) + epsilon)^(-exponent)) Q^T`` for the symmetric ``factor``."""
    lam, q = torch.linalg.eigh(factor)
    lam = lam.clamp_min(0.0).add_(epsilon).pow_(-exponent)
    root: torch.Tensor = (q * lam) @ q.T
    return root


class BlockedShampoo(torch.optim.Optimizer):
    """Blocked Shampoo with Adam grafting, local to ``D x D`` blocks (the math: the module docstring).

    Args (keyword-only after ``params``):
        lr: learning rate.
        betas: ``(beta1, beta2)``: ``beta1`` is the first-moment ("filtered gradient") EMA beta, used
            by both Shampoo and the Adam grafting (no separate momentum); ``beta2`` is the EMA beta of
            the factor matrices, as in Distributed Shampoo.
        epsilon: added to the factors' eigenvalues (after clamping negatives to 0) before the root.
        weight_decay: decoupled (AdamW-style) weight decay.
        max_preconditioner_dim: ``D``, the tile size.
        precondition_frequency: recompute inverse roots every this many steps; reuse them between.
        start_preconditioning_step: before this step (counting from 1), use the grafting direction.
        grafting: ``"adam"`` (rescale each block's Shampoo direction to the Frobenius norm of that
            block's Adam update) or ``"none"`` (raw Shampoo direction; Adam still before the start).
        grafting_epsilon, grafting_beta2: the Adam grafting's ``eps`` and second-moment beta.
        inverse_root_exponent: ``None`` for ``1/(2*order)`` (``L^-1/4 G R^-1/4``; ``L^-1/2 g`` for 1-D
            blocks) or a value in ``(0, 1]`` used for every factor.
        factor_dtype: ``torch.float32`` or ``torch.float64`` for factors and inverse roots.
    """

    def __init__(
        self,
        params: ParamsT,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = 1,
        grafting: str = "adam",
        grafting_epsilon: float = 1e-8,
        grafting_beta2: float = 0.999,
        inverse_root_exponent: float | None = None,
        factor_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            epsilon=epsilon,
            weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            grafting=grafting,
            grafting_epsilon=grafting_epsilon,
            grafting_beta2=grafting_beta2,
            inverse_root_exponent=inverse_root_exponent,
            factor_dtype=factor_dtype,
        )
        _validate(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _validate(self.param_groups[-1])  # per-group overrides are checked too

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, p.grad, group)
        return loss

    def _step_param(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        if grad.is_sparse or p.is_complex():
            raise BlockshardError(
                f"BlockedShampoo: parameter of shape {tuple(p.shape)} has a sparse or complex "
                "gradient; only dense real tensors are supported (use a dense optimizer for it)"
            )
        shape = _matrix_shape(p.shape)
        slices = _block_slices(shape, group["max_preconditioner_dim"])
        sdt = torch.promote_types(p.dtype, torch.float32)
        fdt = group["factor_dtype"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["blocks"] = [self._new_block(p, idx, sdt, fdt) for idx in slices]
        if len(state["blocks"]) != len(slices):
            raise BlockshardError(
                f"BlockedShampoo: parameter of shape {tuple(p.shape)} has state for "
                f"{len(state['blocks'])} blocks but max_preconditioner_dim="
                f"{group['max_preconditioner_dim']} gives {len(slices)}; keep D fixed during training"
            )
        state["step"] += 1
        t = state["step"]
        work = p if p.is_contiguous() else p.contiguous()
        mat, grad = work.view(shape), grad.reshape(shape)
        for idx, block in zip(slices, state["blocks"], strict=True):
            update = self._block_update(_take(grad[idx], sdt), block, group, t)
            new = _take(mat[idx], sdt)
            if group["weight_decay"] != 0:
                new.mul_(1.0 - group["lr"] * group["weight_decay"])
            new.add_(update, alpha=-group["lr"])
            mat[idx].copy_(new)
        if work is not p:
            p.copy_(work)

    @staticmethod
    def _new_block(
        p: torch.Tensor, idx: tuple[slice, ...], sdt: torch.dtype, fdt: torch.dtype
    ) -> dict[str, torch.Tensor]:
        dims = [s.stop - s.start for s in idx]
        block = {
            "exp_avg": torch.zeros(dims, dtype=sdt, device=p.device),
            "exp_avg_sq": torch.zeros(dims, dtype=sdt, device=p.device),
        }
        for k, n in enumerate(dims):
            block[f"factor_{k}"] = torch.zeros((n, n), dtype=fdt, device=p.device)
        return block

    @staticmethod
    def _block_update(g: torch.Tensor, block: dict[str, torch.Tensor], group: dict[str, Any], t: int) -> torch.Tensor:
        """Update one block's state with its gradient ``g``; return the direction ``U``."""
        beta1: float
        beta2: float
        beta1, beta2 = group["betas"]
        gb2: float = group["grafting_beta2"]
        m, v = block["exp_avg"], block["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(gb2).addcmul_(g, g, value=1.0 - gb2)
        gf = g.to(group["factor_dtype"])
        if g.dim() == 1:
            outer = [torch.outer(gf, gf)]
        else:
            outer = [gf @ gf.T, gf.T @ gf]
        for k, gg in enumerate(outer):
            block[f"factor_{k}"].mul_(beta2).add_(gg, alpha=1.0 - beta2)

        m_hat = m / (1.0 - beta1**t)
        adam = m_hat / (v / (1.0 - gb2**t)).sqrt_().add_(group["grafting_epsilon"])
        start, freq = group["start_preconditioning_step"], group["precondition_frequency"]
        if t < start:
            return adam

        order = len(outer)
        if (t - start) % freq == 0 or "inv_root_0" not in block:  # (missing: start moved)
            e = group["inverse_root_exponent"] or 1.0 / (2 * order)
            bc2 = 1.0 - beta2**t
            for k in range(order):
                block[f"inv_root_{k}"] = _inverse_root(block[f"factor_{k}"] / bc2, e, group["epsilon"])
        s = block["inv_root_0"] @ m_hat.to(group["factor_dtype"])
        if order == 2:
            s = s @ block["inv_root_1"]
        s = s.to(g.dtype)
        if group["grafting"] == "none":
            return s
        s_norm = torch.linalg.vector_norm(s)
        scale = torch.where(s_norm > 0, torch.linalg.vector_norm(adam) / s_norm, 0.0)
        return s.mul_(scale)

    def blockshard_state_codecs(self) -> dict[str, ShampooBlocksCodec]:
        """How blockshard's checkpoints place ``state[p]["blocks"]`` (``HasStateCodecs``)."""
        return {"blocks": ShampooBlocksCodec(_tile_dims)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()``; per-block tensors keep their dtypes (factors: ``factor_dtype``).

        The base class would cast every floating-point state tensor to its parameter's dtype (and
        alias the caller's tensors); the per-block state is taken out, the rest loaded by the base
        class, and the blocks put back as copies in the group's dtypes.
        """
        _check_state_dict(state_dict)
        state_dict = copy.deepcopy(state_dict)
        blocks = {pid: st.pop("blocks") for pid, st in state_dict["state"].items() if "blocks" in st}
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        targets = chain.from_iterable(((p, g) for p in g["params"]) for g in self.param_groups)
        for pid, (p, group) in zip(saved_ids, targets, strict=True):
            if pid not in blocks:
                continue
            sdt = torch.promote_types(p.dtype, torch.float32)
            self.state[p]["blocks"] = [
                {
                    k: v.to(device=p.device, dtype=group["factor_dtype"] if k in _FACTOR_KEYS else sdt)
                    for k, v in block.items()
                }
                for block in blocks[pid]
            ]


def _check_state_dict(state_dict: object) -> None:
    """What :meth:`BlockedShampoo.load_state_dict` reads: ``state`` (per parameter, ``blocks`` a list of
    dicts of tensors) and ``param_groups``; anything else raises naming the entry."""
    fix = "pass what BlockedShampoo.state_dict() returned, unchanged"
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise BlockshardError(f"BlockedShampoo.load_state_dict got {got}; it needs 'state' and 'param_groups': {fix}")
    if not isinstance(state_dict["state"], Mapping):
        raise BlockshardError(f"BlockedShampoo state_dict['state'] is {type(state_dict['state']).__name__}: {fix}")
    for pid, st in state_dict["state"].items():
        blocks = st.get("blocks", []) if isinstance(st, Mapping) else None
        ok = isinstance(blocks, list) and all(
            isinstance(b, Mapping) and all(isinstance(v, torch.Tensor) for v in b.values()) for b in blocks
        )
        if not ok:
            raise BlockshardError(
                f"BlockedShampoo state_dict['state'][{pid!r}] is not a dict whose 'blocks' is a list of dicts of "
                f"tensors (got {type(st).__name__}): {fix}"
            )
