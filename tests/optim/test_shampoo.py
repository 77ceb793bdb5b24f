"""BlockedShampoo: textbook math (an independent NumPy float64 reference), stripe invariance
(bitwise), cached roots, the Adam phase before preconditioning, state_dict round trip, validation."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch

from blockshard.optim import BlockedShampoo

# ---------------------------------------------------------------------------------------------
# Independent dense reference: NumPy float64, one dict of state per tile, written from the math.
# ---------------------------------------------------------------------------------------------


def _np_inv_root(x: np.ndarray, exponent: float, eps: float) -> np.ndarray:
    w, q = np.linalg.eigh(x)
    w = (np.maximum(w, 0.0) + eps) ** (-exponent)
    return q @ np.diag(w) @ q.T


def reference_shampoo(
    p0,
    grads,
    *,
    lr,
    betas=(0.9, 0.999),
    epsilon=1e-12,
    weight_decay=0.0,
    D=1024,
    precondition_frequency=1,
    start_preconditioning_step=1,
    grafting="adam",
    grafting_epsilon=1e-8,
    grafting_beta2=0.999,
    inverse_root_exponent=None,
):
    """Run the textbook blocked Shampoo on ``p0`` with the gradients ``grads``; return the params."""
    b1, b2 = betas
    p = np.array(p0, dtype=np.float64)
    shape = p.shape
    vector = p.ndim <= 1
    mat = p.reshape(-1) if vector else p.reshape(shape[0], -1)  # a view: updates go into p
    tiles = {}
    for t, g_full in enumerate(grads, start=1):
        g_full = np.asarray(g_full, dtype=np.float64)
        gm = g_full.reshape(-1) if vector else g_full.reshape(shape[0], -1)
        row_starts = range(0, mat.shape[0], D)
        col_starts = [0] if vector else range(0, mat.shape[1], D)
        for r0 in row_starts:
            for c0 in col_starts:
                key = (r0, c0)
                sl = (slice(r0, r0 + D),) if vector else (slice(r0, r0 + D), slice(c0, c0 + D))
                g = gm[sl].copy()
                if key not in tiles:
                    st = tiles[key] = {"m": np.zeros_like(g), "v": np.zeros_like(g)}
                    st["L"] = np.zeros((g.shape[0], g.shape[0]))
                    if not vector:
                        st["R"] = np.zeros((g.shape[1], g.shape[1]))
                st = tiles[key]
                st["m"] = b1 * st["m"] + (1 - b1) * g
                st["v"] = grafting_beta2 * st["v"] + (1 - grafting_beta2) * g * g
                if vector:
                    st["L"] = b2 * st["L"] + (1 - b2) * np.outer(g, g)
                else:
                    st["L"] = b2 * st["L"] + (1 - b2) * (g @ g.T)
                    st["R"] = b2 * st["R"] + (1 - b2) * (g.T @ g)
                m_hat = st["m"] / (1 - b1**t)
                v_hat = st["v"] / (1 - grafting_beta2**t)
                adam = m_hat / (np.sqrt(v_hat) + grafting_epsilon)
                if t < start_preconditioning_step:
                    u = adam
                else:
                    if (t - start_preconditioning_step) % precondition_frequency == 0:
                        e = inverse_root_exponent or (0.5 if vector else 0.25)
                        bc2 = 1 - b2**t
                        st["QL"] = _np_inv_root(st["L"] / bc2, e, epsilon)
                        if not vector:
                            st["QR"] = _np_inv_root(st["R"] / bc2, e, epsilon)
                    s = st["QL"] @ m_hat if vector else st["QL"] @ m_hat @ st["QR"]
                    if grafting == "adam":
                        ns = np.linalg.norm(s)
                        u = s * (np.linalg.norm(adam) / ns) if ns > 0 else np.zeros_like(s)
                    else:
                        u = s
                mat[sl] = mat[sl] * (1 - lr * weight_decay) - lr * u
    return p


def run_blocked(p0: torch.Tensor, grads, **kw) -> torch.Tensor:
    p = torch.nn.Parameter(p0.clone())
    opt = BlockedShampoo([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _data(shape, steps, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(steps)]
    return p0, grads


CASES = {
    # (shape, D, extra hyperparameters)
    "one_block_7x5": ((7, 5), 8, {}),
    "one_block_exact_D": ((7, 5), 7, {"weight_decay": 0.1}),
    "3x2_blocks_with_edges": ((10, 6), 4, {}),
    "edges_wd_freq3_start2": (
        (10, 6),
        4,
        {"weight_decay": 0.1, "precondition_frequency": 3, "start_preconditioning_step": 2},
    ),
    "no_grafting": ((10, 6), 4, {"grafting": "none", "epsilon": 1e-6}),
    "exponent_half_betas": ((10, 6), 4, {"inverse_root_exponent": 0.5, "betas": (0.5, 0.9), "grafting_beta2": 0.99}),
    "vector_9_D4": ((9,), 4, {}),
    "vector_freq2_start3": ((9,), 4, {"precondition_frequency": 2, "start_preconditioning_step": 3}),
    "3d_as_rows_by_rest": ((5, 3, 2), 3, {"weight_decay": 0.05}),
}


# Tolerances. float64 (params, moments, factors, eigh) against the float64 reference: the only
# differences are BLAS/LAPACK rounding (torch and NumPy call different kernels), amplified where a
# factor is still rank-deficient: the inverse root multiplies ~1e-16 noise in its null space by up
# to epsilon**-e (1e3 for e=1/4, 1e6 for e=1/2, epsilon=1e-12). Measured worst case 1.6e-11 (e=1/2),
# 1e-14 otherwise; a real mistake moves parameters by ~1e-3 or more (updates here are ~1e-2/step).
TOL64 = 1e-10
# float32 (the default) against the float64 reference, preconditioning from step 5 so that every
# factor is full rank (float32 eigh returns ~1e-7*lambda_max "null" eigenvalues instead of ~0, and
# epsilon=1e-12 cannot regularize them, so with rank-deficient factors float32 and float64 Shampoo
# legitimately differ by up to ~1e-2). With full-rank factors float32 eigh is accurate to
# ~cond*6e-8: measured worst 9e-7 after 8 steps of lr=1e-2, i.e. ~1e-4 of one step's update.
TOL32 = 5e-6


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_numpy_reference_float64(name):
    """float64 params and factors vs the float64 reference, many block layouts and options."""
    shape, d, kw = CASES[name]
    p0, grads = _data(shape, steps=7, dtype=torch.float64)
    got = run_blocked(p0, grads, lr=0.01, max_preconditioner_dim=d, factor_dtype=torch.float64, **kw)
    ref = reference_shampoo(p0.numpy(), [g.numpy() for g in grads], lr=0.01, D=d, **kw)
    np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=TOL64)
    # The preconditioned steps really moved the parameters differently from plain Adam.
    adam = reference_shampoo(
        p0.numpy(), [g.numpy() for g in grads], lr=0.01, D=d, **{**kw, "start_preconditioning_step": 100}
    )
    assert np.abs(adam - ref).max() > 1e-4


@pytest.mark.parametrize(
    "name", ["one_block_7x5", "3x2_blocks_with_edges", "vector_9_D4", "3d_as_rows_by_rest", "exponent_half_betas"]
)
def test_matches_numpy_reference_float32(name):
    """Default precision (float32 params, moments, factors and eigh) vs the float64 reference."""
    shape, d, kw = CASES[name]
    p0, grads = _data(shape, steps=8, dtype=torch.float32)
    kw = {**kw, "start_preconditioning_step": 5}
    got = run_blocked(p0, grads, lr=0.01, max_preconditioner_dim=d, **kw)
    ref = reference_shampoo(p0.double().numpy(), [g.double().numpy() for g in grads], lr=0.01, D=d, **kw)
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=0, atol=TOL32)


# ---------------------------------------------------------------------------------------------
# Stripe invariance: the property blockshard's ``shampoo:D`` semantics relies on.
# ---------------------------------------------------------------------------------------------

STRIPES = {
    "single_D_rows_last_partial": ((10, 6), 4, [(0, 4), (4, 8), (8, 10)]),
    "two_stripes_and_partial": ((10, 6), 4, [(0, 8), (8, 10)]),
    "3d_stripes": ((10, 3, 2), 4, [(0, 4), (4, 10)]),
    "vector_runs": ((9,), 4, [(0, 4), (4, 8), (8, 9)]),
    "larger": ((37, 45), 16, [(0, 16), (16, 32), (32, 37)]),
}
STRIPE_OPTIONS = [
    {},
    {"weight_decay": 0.1, "precondition_frequency": 2, "start_preconditioning_step": 2},
    {"grafting": "none", "epsilon": 1e-4, "factor_dtype": torch.float64},
]


def _full_and_stripes(shape, d, cuts, steps, opts, seed=1):
    p0, grads = _data(shape, steps, torch.float32, seed=seed)
    full = torch.nn.Parameter(p0.clone())
    parts = [torch.nn.Parameter(p0[a:b].clone()) for a, b in cuts]
    opt_full = BlockedShampoo([full], lr=0.05, max_preconditioner_dim=d, **opts)
    opt_parts = BlockedShampoo(parts, lr=0.05, max_preconditioner_dim=d, **opts)
    for g in grads:
        full.grad = g.clone()
        for part, (a, b) in zip(parts, cuts, strict=True):
            part.grad = g[a:b].clone()
        opt_full.step()
        opt_parts.step()
    return p0, full.detach(), torch.cat([part.detach() for part in parts])


@pytest.mark.parametrize("opts", STRIPE_OPTIONS, ids=["default", "wd_freq2_start2", "nograft_f64"])
@pytest.mark.parametrize("name", sorted(STRIPES))
def test_stripes_of_whole_blocks_are_bitwise_equal_to_the_full_tensor(name, opts):
    shape, d, cuts = STRIPES[name]
    p0, full, stitched = _full_and_stripes(shape, d, cuts, steps=5, opts=opts)
    assert not torch.equal(full, p0)
    assert torch.equal(full, stitched)


def test_control_stripes_that_cut_blocks_differ():
    """Cutting at a row that is not a multiple of D changes the blocks, hence the update."""
    _, full, stitched = _full_and_stripes((10, 6), 4, [(0, 3), (3, 10)], steps=5, opts={})
    assert (full - stitched).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------
# Cached roots, start of preconditioning.
# ---------------------------------------------------------------------------------------------


def test_roots_are_recomputed_every_frequency_steps_and_reused_between():
    p0, grads = _data((10, 6), 7, torch.float32)
    p = torch.nn.Parameter(p0.clone())
    opt = BlockedShampoo([p], lr=0.01, max_preconditioner_dim=4, precondition_frequency=3)
    roots, factors = [], []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        blocks = opt.state[p]["blocks"]
        roots.append([b[k].clone() for b in blocks for k in ("inv_root_0", "inv_root_1")])
        factors.append([b["factor_0"].clone() for b in blocks])

    def same(xs, ys):
        return all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))

    # Recomputed at steps 1, 4, 7 (1-based), reused at 2, 3, 5, 6; factors change every step.
    assert same(roots[0], roots[1]) and same(roots[1], roots[2])
    assert not same(roots[2], roots[3])
    assert same(roots[3], roots[4]) and same(roots[4], roots[5])
    assert not same(roots[5], roots[6])
    assert not any(same(factors[i], factors[i + 1]) for i in range(6))


def test_frequency_only_matters_between_recomputations():
    p0, grads = _data((10, 6), 4, torch.float32)
    f1 = torch.nn.Parameter(p0.clone())
    f3 = torch.nn.Parameter(p0.clone())
    o1 = BlockedShampoo([f1], lr=0.01, max_preconditioner_dim=4, precondition_frequency=1)
    o3 = BlockedShampoo([f3], lr=0.01, max_preconditioner_dim=4, precondition_frequency=3)
    diffs = []
    for g in grads:
        f1.grad, f3.grad = g.clone(), g.clone()
        o1.step()
        o3.step()
        diffs.append(torch.equal(f1, f3))
    assert diffs == [True, False, False, False]  # step 1 identical, then stale roots differ


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-13), (torch.float32, 1e-6)])
def test_before_start_the_update_is_adamw(dtype, atol):
    """Before start_preconditioning_step: AdamW(betas=(betas[0], grafting_beta2), eps=grafting_eps).

    AdamW computes lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) in a different order: ulp-level
    differences only (a few ulps of O(1) parameters after 3 steps)."""
    p0, grads = _data((10, 6), 4, dtype)
    p = torch.nn.Parameter(p0.clone())
    q = torch.nn.Parameter(p0.clone())
    opt = BlockedShampoo(
        [p],
        lr=0.01,
        betas=(0.8, 0.95),
        grafting_beta2=0.99,
        grafting_epsilon=1e-6,
        weight_decay=0.1,
        max_preconditioner_dim=4,
        start_preconditioning_step=4,
    )
    adamw = torch.optim.AdamW([q], lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for t, g in enumerate(grads, start=1):
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
        has_roots = "inv_root_0" in opt.state[p]["blocks"][0]
        if t < 4:
            torch.testing.assert_close(p, q, rtol=0, atol=atol)
            assert not has_roots
        else:
            assert has_roots
            assert (p - q).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------
# state_dict round trip.
# ---------------------------------------------------------------------------------------------


def _model_params(seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(10, 6), (9,), (5, 3, 2)]]


def _make_opt(params, factor_dtype):
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1, "max_preconditioner_dim": 3}]
    return BlockedShampoo(
        groups,
        lr=0.02,
        max_preconditioner_dim=4,
        precondition_frequency=3,
        start_preconditioning_step=2,
        factor_dtype=factor_dtype,
    )


def _train(params, opt, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.float64])
def test_state_dict_round_trip_continues_bitwise(factor_dtype):
    gen = torch.Generator().manual_seed(3)
    shapes = [p.shape for p in _model_params()]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(7)]

    ref = _model_params()
    _train(ref, _make_opt(ref, factor_dtype), grads)

    first = _model_params()
    opt = _make_opt(first, factor_dtype)
    _train(first, opt, grads[:3])  # roots from step 2 are cached; step 4 reuses them
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)  # weights_only: the state is plain tensors, ints, lists and dicts
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = _make_opt(resumed, factor_dtype)
    opt2.load_state_dict(saved)
    block = opt2.state[resumed[0]]["blocks"][0]
    assert block["factor_0"].dtype == block["inv_root_1"].dtype == factor_dtype
    assert block["exp_avg"].dtype == torch.float32
    _train(resumed, opt2, grads[3:])
    for a, b in zip(ref, resumed, strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_does_not_alias_the_source():
    params = _model_params()
    opt = _make_opt(params, torch.float32)
    gen = torch.Generator().manual_seed(4)
    _train(params, opt, [[torch.randn(p.shape, generator=gen) for p in params]])
    before = opt.state[params[0]]["blocks"][0]["factor_0"].clone()
    other = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = _make_opt(other, torch.float32)
    opt2.load_state_dict(opt.state_dict())
    _train(other, opt2, [[torch.randn(p.shape, generator=gen) for p in params]])
    assert torch.equal(opt.state[params[0]]["blocks"][0]["factor_0"], before)


# ---------------------------------------------------------------------------------------------
# Odd inputs and validation.
# ---------------------------------------------------------------------------------------------


def test_zero_gradient_non_contiguous_and_bf16_params():
    p = torch.nn.Parameter(torch.randn(6, 5))
    opt = BlockedShampoo([p], lr=0.1, max_preconditioner_dim=4)
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    opt.step()  # Shampoo direction 0: the grafting scale is defined as 0, no NaN
    assert torch.equal(p, before)

    base = torch.randn(5, 6)
    t = torch.nn.Parameter(base.clone().t())  # non-contiguous leaf
    c = torch.nn.Parameter(base.t().contiguous())
    g = torch.randn(6, 5)
    for q in (t, c):
        q.grad = g.clone()
        BlockedShampoo([q], lr=0.1, max_preconditioner_dim=4).step()
    assert not t.is_contiguous() and torch.equal(t, c)

    b = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.bfloat16))
    b.grad = torch.randn(6, 5, dtype=torch.bfloat16)
    opt = BlockedShampoo([b], lr=0.1, max_preconditioner_dim=4)
    opt.step()
    assert opt.state[b]["blocks"][0]["exp_avg"].dtype == torch.float32
    assert torch.isfinite(b.float()).all()


BAD = [
    ({"lr": -1.0}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"betas": (0.9,)}, "betas"),
    ({"betas": (1.0, 0.999)}, "betas[0]"),
    ({"betas": (0.9, 1.5)}, "betas[1]"),
    ({"betas": (0.9, -0.1)}, "betas[1]"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"weight_decay": -0.01}, "weight_decay"),
    ({"max_preconditioner_dim": 0}, "max_preconditioner_dim"),
    ({"max_preconditioner_dim": 2.5}, "max_preconditioner_dim"),
    ({"max_preconditioner_dim": True}, "max_preconditioner_dim"),
    ({"precondition_frequency": 0}, "precondition_frequency"),
    ({"start_preconditioning_step": 0}, "start_preconditioning_step"),
    ({"grafting": "sgd"}, "grafting"),
    ({"grafting_epsilon": -1e-8}, "grafting_epsilon"),
    ({"grafting_beta2": 1.0}, "grafting_beta2"),
    ({"inverse_root_exponent": 0.0}, "inverse_root_exponent"),
    ({"inverse_root_exponent": 2.0}, "inverse_root_exponent"),
    ({"factor_dtype": torch.float16}, "factor_dtype"),
]


@pytest.mark.parametrize(("kw", "name"), BAD, ids=[f"{n}={next(iter(k.values()))}" for k, n in BAD])
def test_bad_hyperparameters_raise_naming_the_parameter(kw, name):
    p = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match=f"BlockedShampoo: {re.escape(name)}=") as info:
        BlockedShampoo([p], **{"lr": 0.1, **kw})
    assert "must" in str(info.value)  # the constraint, and a fix after it
    # The same check applies to a per-group override.
    with pytest.raises(ValueError, match=f"BlockedShampoo: {re.escape(name)}="):
        BlockedShampoo([{"params": [p], **kw}], lr=0.1)
