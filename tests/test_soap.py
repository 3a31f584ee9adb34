"""Eigenvalue-corrected Shampoo (SOAP) against Meta's DistributedShampoo, the SOAP reference code
(as ``pytorch_optimizer.SOAP``) and heavyball's ``SOAP``.

* ``shampoo(preconditioner="eigenvalue_corrected")`` equals Meta's
  ``EigenvalueCorrectedShampooPreconditionerConfig`` (eigh or QR basis, grafting or not, bias
  correction on/off, frequencies and start steps, blocking and merged dims, 1-D to 3-D
  leaves), measured bitwise equal in float64 and float32, rank-deficient factors at epsilon
  1e-12 included; asserted to 1e-8 (float64) and 1e-5 (float32).
* ``soap`` equals ``pytorch_optimizer.SOAP`` (the reference code) and heavyball's ``SOAP`` where
  their definitions agree: factors of full rank at the first step (the eigenbasis of a
  rank-deficient factor is arbitrary on its null space, and Adam is not invariant to it), a
  tiny ``eps`` (the reference folds the bias corrections into the step size, so its ``eps`` is
  ``eps / sqrt(1 - beta2^t)`` in the usual form), no weight decay (the reference decays the
  already-updated parameters), and for heavyball either no refresh within the run or a
  refresh every step (its refresh comes one step earlier than the reference's, and its QR
  step is lifted by ``max(eps, 64 n eps_dtype) |lambda|_max``). The differences are tested.
* ``soap(merge_dims=True)`` / ``merge_dims="heavyball"`` equal the reference code's and
  heavyball's ``merge_dims=True`` (their merging rules, ``merge_dims_soap`` and
  ``merge_dims_heavyball``, checked on drawn shapes).

Meta's package is read from ``shared/refs/meta-optimizers`` beside the repository; its tests
skip with a reason when it is absent.
"""

from __future__ import annotations

import io
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from hypothesis import HealthCheck, given, settings, strategies as st

import opttx
from opttx.testing import displacement_gaps, one_ulp, run_transform

META = Path(__file__).resolve().parents[2] / "shared" / "refs" / "meta-optimizers"
LR = 2.0**-7          # exact in float32 (Meta keeps its lr in a float32 tensor)

FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _meta():
    if not (META / "distributed_shampoo").is_dir():
        pytest.skip(f"Meta's distributed_shampoo is not at {META} (clone it beside the "
                    "repository as shared/refs/meta-optimizers)")
    if str(META) not in sys.path:
        sys.path.insert(0, str(META))
    ds = pytest.importorskip("distributed_shampoo", reason=f"cannot import it from {META}")
    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)
    return ds


def problem(shapes: dict, steps: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    tree = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=dtype) for k, v in tree.items()}
             for _ in range(steps)]
    return tree, grads


def run_torch(make, tree: dict, grads: list[dict]) -> dict:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = make(list(params.values()))
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def run_opttx(tx, tree: dict, grads: list[dict]) -> dict:
    """The parameters after every gradient of ``grads`` (`opttx.testing.run_transform`)."""
    return run_transform(tx, tree, grads)[0]


# ---------------------------------------------------------------------------------------------
# Meta's EigenvalueCorrectedShampooPreconditionerConfig
# ---------------------------------------------------------------------------------------------

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)
trees = st.lists(shapes, min_size=1, max_size=3).map(
    lambda ss: {f"p{i}": s for i, s in enumerate(ss)})


@st.composite
def meta_configs(draw):
    freq = draw(st.integers(1, 3))
    return dict(
        betas=(draw(st.sampled_from([0.0, 0.9])), draw(st.sampled_from([0.999, 0.95, 1.0]))),
        epsilon=draw(st.sampled_from([1e-12, 1e-8])),
        precondition_frequency=freq, start_preconditioning_step=freq + draw(st.integers(0, 2)),
        max_preconditioner_dim=draw(st.sampled_from([4, 8, 1024])),
        grafting=draw(st.sampled_from([None, "adam"])),
        use_bias_correction=draw(st.booleans()),
        weight_decay=draw(st.sampled_from([0.0, 0.01])),
        qr=draw(st.booleans()), qr_iterations=draw(st.sampled_from([1, 3])))


def meta_shampoo(ds, cfg: dict, dtype: torch.dtype, **extra):
    from distributed_shampoo.preconditioner.matrix_functions_types import (
        EighEigendecompositionConfig, QREigendecompositionConfig)
    amortized = QREigendecompositionConfig(max_iterations=cfg["qr_iterations"]) \
        if cfg["qr"] else EighEigendecompositionConfig()
    return lambda params: ds.DistributedShampoo(
        params, lr=LR, betas=cfg["betas"], epsilon=cfg["epsilon"],
        weight_decay=cfg["weight_decay"], max_preconditioner_dim=cfg["max_preconditioner_dim"],
        precondition_frequency=cfg["precondition_frequency"],
        start_preconditioning_step=cfg["start_preconditioning_step"],
        use_bias_correction=cfg["use_bias_correction"],
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8)
        if cfg["grafting"] else None,
        preconditioner_config=ds.EigenvalueCorrectedShampooPreconditionerConfig(
            amortized_computation_config=amortized, factor_matrix_dtype=dtype,
            factor_matrix_eigenvectors_dtype=dtype, corrected_eigenvalues_dtype=dtype,
            **extra))


def opttx_shampoo(cfg: dict, dtype: torch.dtype, **extra):
    cfg = dict(cfg)
    qr = cfg.pop("qr")
    return opttx.shampoo(LR, grafting_beta2=0.999, grafting_epsilon=1e-8,
                         preconditioner_dtype=dtype, inv_factor_matrix_dtype=dtype,
                         preconditioner="eigenvalue_corrected",
                         eigendecomposition="qr" if qr else "eigh", **cfg, **extra)


@FAST
@given(shapes_=trees, cfg=meta_configs(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_equals_meta_eigenvalue_corrected(shapes_, cfg, seed, dtype) -> None:
    """12 steps on drawn 1-D to 3-D trees and settings; rank-deficient factors at epsilon 1e-12
    included (measured: bitwise equal in both dtypes)."""
    ds = _meta()
    tree, grads = problem(shapes_, 12, seed, dtype)
    theirs = run_torch(meta_shampoo(ds, cfg, dtype), tree, grads)
    ours = run_opttx(opttx_shampoo(cfg, dtype), tree, grads)
    g = displacement_gaps(ours, theirs, tree)
    assert max(g.values()) <= (1e-8 if dtype == torch.float64 else 1e-5), (g, cfg)


def test_meta_ignored_dims_and_exponent_override() -> None:
    """Meta's ``ignored_basis_change_dims`` and ``inverse_exponent_override`` of the
    eigenvalue-corrected config (float64, to 1e-8)."""
    ds = _meta()
    cfg = dict(betas=(0.9, 0.99), epsilon=1e-10, precondition_frequency=2,
               start_preconditioning_step=2, max_preconditioner_dim=6, grafting=None,
               use_bias_correction=True, weight_decay=0.0, qr=False, qr_iterations=1)
    tree, grads = problem({"v": (5,), "m": (6, 4), "t": (3, 5, 6)}, 10, 3, torch.float64)
    ignored, override = {1: [0], 3: [0, 2]}, {2: 0.25}
    theirs = run_torch(meta_shampoo(ds, cfg, torch.float64, ignored_basis_change_dims=ignored,
                                    inverse_exponent_override=override), tree, grads)
    ours = run_opttx(opttx_shampoo(cfg, torch.float64, ignored_basis_change_dims=ignored,
                                   inverse_exponent_override=override), tree, grads)
    assert max(displacement_gaps(ours, theirs, tree).values()) <= 1e-8
    plain = run_opttx(opttx_shampoo(cfg, torch.float64), tree, grads)
    assert min(displacement_gaps(plain, theirs, tree).values()) > 1e-3      # the options matter here


def test_meta_first_step_is_adam_in_the_standard_basis() -> None:
    """Meta's schedule: before the first refresh (no grafting) the basis is the identity, so
    the first steps are Adam's (opttx.adam with the same settings, up to Meta's float32 bias
    corrections: measured 8e-6), not a zero update."""
    tree, grads = problem({"m": (4, 3)}, 2, 0, torch.float64)
    tx = opttx.shampoo(LR, betas=(0.9, 0.999), epsilon=1e-8, precondition_frequency=3,
                       preconditioner="eigenvalue_corrected",
                       preconditioner_dtype=torch.float64, inv_factor_matrix_dtype=torch.float64)
    adam = opttx.adam(LR, 0.9, 0.999, 1e-8)
    assert max(displacement_gaps(run_opttx(tx, tree, grads), run_opttx(adam, tree, grads),
                    tree).values()) <= 1e-4


# ---------------------------------------------------------------------------------------------
# The SOAP paper's algorithm: pytorch_optimizer.SOAP (its reference code) and heavyball.SOAP
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# first_moment_in_eigenbasis: the filtered gradient kept rotated into the eigenbasis
# ---------------------------------------------------------------------------------------------


@FAST
@given(shapes_=trees, cfg=meta_configs(), seed=st.integers(0, 2**16),
       beta3=st.sampled_from([None, 0.5]))
def test_first_moment_in_eigenbasis_equals_rotating_it_each_step(shapes_, cfg, seed,
                                                                   beta3) -> None:
    """Drawn trees and Meta settings (refreshes by eigh or QR every 1-3 steps, grafting or
    not, bias correction on/off, beta3), float64, 12 steps: the same parameters as the
    default path, which rotates the filtered gradient every step (and equals Meta's), up to
    the roundings along the null space of rank-deficient factors, divided by epsilon there.
    At epsilon 1e-8 within 1e-6; at 1e-12 within ten times the default path's own gap when
    its gradients move by one ulp (an absolute floor of 1e-6 and ceiling of 1e-2). Measured
    by this test with ``max_examples`` raised to 150 and then 300 (450 draws, at stop 24): up
    to 1.3e-7 at 1e-8, and up to 4 times the one-ulp gap at 1e-12 (4e-5 against 1e-5, without
    grafting); the largest gap at 1e-12 was 3.7e-4."""
    cfg = {**cfg, "betas": (0.9, cfg["betas"][1])}
    tree, grads = problem(shapes_, 12, seed, torch.float64)
    plain = run_opttx(opttx_shampoo(cfg, torch.float64, beta3=beta3), tree, grads)
    kept = run_opttx(opttx_shampoo(cfg, torch.float64, beta3=beta3,
                                   first_moment_in_eigenbasis=True), tree, grads)
    g = displacement_gaps(kept, plain, tree)
    if cfg["epsilon"] >= 1e-8:
        assert max(g.values()) <= 1e-6, (g, cfg)
        return
    spread = displacement_gaps(run_opttx(opttx_shampoo(cfg, torch.float64, beta3=beta3), tree,
                            one_ulp(grads)), plain, tree)
    for k in g:   # (the ceiling: a wrong basis change is O(1) away, whatever the spread)
        assert g[k] <= min(1e-2, max(1e-6, 10 * spread[k])), (k, g[k], spread[k], cfg)


@pytest.mark.parametrize("max_dim", [1024, 4], ids=["1d_blocks", "2d_blocks"])
def test_first_moment_in_eigenbasis_equals_meta_in_float32(max_dim) -> None:
    """Three matrices, epsilon 1e-12, refreshed every 3 steps, Adam grafting, float32: within
    1e-5 of Meta's EigenvalueCorrectedShampoo. Merged into 1-D blocks (Meta's default
    merging: 25-, 36- and 16-dim factors, rank-deficient for the 12 steps; measured 1.3e-6),
    and split into 2-D blocks of at most 4 x 4 (where the kept EMA is Q_L^T m Q_R; measured
    7.1e-7). The default path is bit for bit Meta's in both."""
    ds = _meta()
    cfg = dict(betas=(0.9, 0.999), epsilon=1e-12, precondition_frequency=3,
               start_preconditioning_step=3, max_preconditioner_dim=max_dim, grafting="adam",
               use_bias_correction=True, weight_decay=0.0, qr=False, qr_iterations=1)
    tree, grads = problem({"m": (5, 5), "t": (6, 6), "w": (4, 4)}, 12, 3, torch.float32)
    theirs = run_torch(meta_shampoo(ds, cfg, torch.float32), tree, grads)
    ours = run_opttx(opttx_shampoo(cfg, torch.float32, first_moment_in_eigenbasis=True),
                     tree, grads)
    assert max(displacement_gaps(ours, theirs, tree).values()) <= 1e-5


def test_first_moment_in_eigenbasis_state_is_the_rotated_filtered_gradient() -> None:
    """After a refresh (the bases changed twice), the kept EMA is Q_L^T m Q_R of the filtered
    gradient that graft keeps for the grafted method; without grafting graft keeps none."""
    tree, grads = problem({"m": (6, 4)}, 7, 5, torch.float64)
    kw = dict(betas=(0.9, 0.999), epsilon=1e-8, precondition_frequency=3,
              preconditioner="eigenvalue_corrected", preconditioner_dtype=torch.float64,
              inv_factor_matrix_dtype=torch.float64, target_parameter_dimensionality=2,
              first_moment_in_eigenbasis=True)
    tx = opttx.shampoo(LR, grafting="adam", **kw)
    _, state = run_transform(tx, tree, grads)
    graft_state = state[0]
    ec = graft_state.direction
    ((q_l, q_r),) = ec.bases["m"]            # one block (block_by_dims)
    (m,) = graft_state.filtered["m"]
    torch.testing.assert_close(ec.mu["m"][0], q_l.mT @ m @ q_r, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(q_l, torch.eye(6, dtype=torch.float64))
    _, state = run_transform(opttx.shampoo(LR, grafting=None, **kw), tree, grads)
    assert state[0].filtered == ()
    ec = state[0].direction
    ((q_l, q_r),) = ec.bases["m"]
    plain_kw = {**kw, "first_moment_in_eigenbasis": False}
    # the default path keeps the EMA only inside graft (beta1), unrotated
    (m,) = run_transform(opttx.shampoo(LR, grafting="adam", **plain_kw), tree, grads)[1][0] \
        .filtered["m"]
    torch.testing.assert_close(ec.mu["m"][0], q_l.mT @ m @ q_r, rtol=1e-12, atol=1e-14)


def _mm_count(tx, tree, grads) -> int:
    """The matrix products of the last of the eager updates, one per gradient of ``grads``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
                Count.n += 1
            return func(*args, **(kwargs or {}))
    state = run_transform(tx, tree, grads[:-1])[1]
    with Count():
        tx.update(grads[-1], state, tree)
    return Count.n


@pytest.mark.parametrize("alias", ["shampoo", "soap"])
def test_first_moment_in_eigenbasis_saves_two_products_per_matrix(alias) -> None:
    """A step without a refresh of one (6, 4) matrix: eight matrix products (two factors, the
    gradient and the filtered gradient into the eigenbasis, the result back), six with the
    EMA kept in the eigenbasis."""
    tree, grads = problem({"m": (6, 4)}, 5, 6, torch.float32)

    def make(keep):
        if alias == "soap":
            return opttx.soap(3e-3, 0.9, 0.95, weight_decay=0.0, precondition_frequency=100,
                              first_moment_in_eigenbasis=keep)
        return opttx.shampoo(LR, betas=(0.9, 0.999), grafting="adam",
                             preconditioner="eigenvalue_corrected", precondition_frequency=100,
                             start_preconditioning_step=2, target_parameter_dimensionality=2,
                             first_moment_in_eigenbasis=keep)
    assert _mm_count(make(False), tree, grads) == 8
    assert _mm_count(make(True), tree, grads) == 6


def test_first_moment_in_eigenbasis_soap_equals_rotating_it() -> None:
    """`opttx.soap` (power refreshes every 2 Adam steps, the second moment permuted with the
    columns), float64, 12 steps: the same parameters as rotating Adam's first moment."""
    tree, grads = problem(FULL_RANK, 12, 7, torch.float64)
    kw = dict(eps=1e-12, weight_decay=0.0, precondition_frequency=2, precondition_1d=True,
              preconditioner_dtype=torch.float64)
    plain = run_opttx(opttx.soap(3e-3, 0.95, 0.95, **kw), tree, grads)
    kept = run_opttx(opttx.soap(3e-3, 0.95, 0.95, first_moment_in_eigenbasis=True, **kw),
                     tree, grads)
    assert max(displacement_gaps(kept, plain, tree).values()) <= 1e-8


@pytest.mark.parametrize("keep", [False, True], ids=["rotated", "kept_in_eigenbasis"])
def test_soap_compiles_to_one_graph_with_one_cond_per_step(keep) -> None:
    """`opttx.soap` compiled (aot_eager, a 1-D leaf left in the standard basis): one graph,
    the eager numbers over 6 steps (the first step's bases, two power refreshes), and one
    ``torch.cond`` per step: the periodic refresh is nested in the first step's branch, so the
    bases are copied through one branch, not two. (With the EMA kept in the eigenbasis, the
    unrotated leaf's EMA once came out of the refresh as a view of its input, which
    ``torch.cond`` refuses.)"""
    tree, grads = problem({"m": (5, 5), "v": (7,)}, 6, 8, torch.float32)
    tx = opttx.soap(3e-3, 0.95, 0.95, weight_decay=0.0, precondition_frequency=2,
                    first_moment_in_eigenbasis=keep)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)
    compiled = torch.compile(tx.update, backend=backend, fullgraph=True)
    state, eager_state, params = tx.init(tree), tx.init(tree), dict(tree)
    for g in grads:
        u, state = compiled(g, state, params)
        v, eager_state = tx.update(g, eager_state, params)
        for k in u:
            torch.testing.assert_close(u[k], v[k], rtol=1e-5, atol=1e-8)
        params = opttx.apply_updates(params, v)
    assert len(graphs) == 1
    conds = [n for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.cond]
    assert len(conds) == 1


def test_first_moment_in_eigenbasis_needs_an_ema_and_the_ec_preconditioner() -> None:
    with pytest.raises(ValueError, match="beta1 > 0"):
        opttx.shampoo(LR, betas=(0.0, 0.999), preconditioner="eigenvalue_corrected",
                      first_moment_in_eigenbasis=True)
    with pytest.raises(ValueError, match="eigenvalue-corrected"):
        opttx.shampoo(LR, first_moment_in_eigenbasis=True)


# factors of full rank after the first gradient (square matrices; every unfolding of the 3-D
# leaf has at least as many columns as rows), plus a 1-D leaf (Adam unless precondition_1d)
FULL_RANK = {"m": (5, 5), "v": (7,), "t": (3, 4, 4)}


def soap_ref(freq: int, eps: float, **kw):
    po = pytest.importorskip("pytorch_optimizer")
    return lambda params: po.SOAP(params, lr=3e-3, betas=(0.95, 0.95), weight_decay=0.0,
                                  precondition_frequency=freq, eps=eps, **kw)


@pytest.mark.parametrize("freq", [1, 3, 100])
@pytest.mark.parametrize("precondition_1d", [False, True])
def test_soap_equals_reference_code(freq, precondition_1d) -> None:
    """float32, 12 steps, basis refreshed by the power/QR step (``freq`` < 12) or never:
    1e-5 (measured 2e-7 .. 4e-6). With ``precondition_1d`` the 1-D leaf's first factor has
    rank 1, so only the other leaves are compared then."""
    tree, grads = problem(FULL_RANK, 12, 0, torch.float32)
    theirs = run_torch(soap_ref(freq, 1e-12, precondition_1d=precondition_1d), tree, grads)
    ours = run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-12, weight_decay=0.0,
                                precondition_frequency=freq,
                                precondition_1d=precondition_1d), tree, grads)
    g = displacement_gaps(ours, theirs, tree)
    if precondition_1d:
        g.pop("v")                  # rank-1 first factor: its null basis is eigh's choice
    assert max(g.values()) <= 1e-5


@pytest.mark.parametrize("keep", [False, True])
def test_soap_through_the_optimizer_equals_reference_code(keep) -> None:
    """The bench's path: ``opttx.Optimizer(params, opttx.soap(...))``, which donates the state
    (in-place updates), over 30 steps with refreshes every 3, against the reference code:
    1e-5 as the functional path (the kept first moment was overwritten before SOAP's first
    step kept it at zero, and the second update of a 1-D leaf was -(b1 g1 + g2) / |g2|: 96
    away)."""
    tree, grads = problem(FULL_RANK, 30, 2, torch.float32)
    theirs = run_torch(soap_ref(3, 1e-12), tree, grads)
    ours = run_torch(lambda ps: opttx.Optimizer(ps, opttx.soap(
        3e-3, 0.95, 0.95, eps=1e-12, weight_decay=0.0, precondition_frequency=3,
        first_moment_in_eigenbasis=keep)), tree, grads)
    assert max(displacement_gaps(ours, theirs, tree).values()) <= 1e-5


def test_soap_float64_equals_reference_without_refresh() -> None:
    """float64 (the reference's QR runs in float32, so no refresh within the run): 1e-8."""
    tree, grads = problem(FULL_RANK, 10, 1, torch.float64)
    theirs = run_torch(soap_ref(100, 1e-12), tree, grads)
    ours = run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-12, weight_decay=0.0,
                                precondition_frequency=100,
                                preconditioner_dtype=torch.float64), tree, grads)
    assert max(displacement_gaps(ours, theirs, tree).values()) <= 1e-8


def test_soap_first_update_is_zero_and_eps_placement() -> None:
    """The first gradient only builds the factors and bases (as the reference and heavyball);
    the reference's eps is eps / sqrt(1 - beta2^t) in the usual form, visible at a large eps."""
    tree, grads = problem(FULL_RANK, 1, 2, torch.float64)
    tx = opttx.soap(weight_decay=0.0, preconditioner_dtype=torch.float64)
    updates, state = tx.update(grads[0], tx.init(tree), tree)
    assert all(float(u.abs().max()) == 0.0 for u in updates.values())
    assert float(state[0].bases["m"][0].abs().sum()) > 5.0          # a rotation, not I
    tree, grads = problem(FULL_RANK, 6, 2, torch.float64)
    kw = dict(eps=1e-2, weight_decay=0.0, precondition_frequency=100,
              preconditioner_dtype=torch.float64)
    theirs = run_torch(soap_ref(100, 1e-2), tree, grads)
    assert max(displacement_gaps(run_opttx(opttx.soap(3e-3, 0.95, 0.95, **kw), tree, grads),
                    theirs, tree).values()) > 1e-3


def test_soap_weight_decay_differs_from_the_reference() -> None:
    """opttx: x - lr (u + wd x) (AdamW's), from the first step on. The reference code skips the
    whole first step (no decay either) and then decays the updated parameters:
    (x - lr u)(1 - lr wd). Equal without weight decay, not with it."""
    tree, grads = problem(FULL_RANK, 6, 4, torch.float64)
    theirs = run_torch(soap_ref(100, 1e-12), tree, grads)
    ours = run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-12, weight_decay=0.0,
                                precondition_frequency=100,
                                preconditioner_dtype=torch.float64), tree, grads)
    wd = 0.5
    theirs_wd = run_torch(lambda p: pytest.importorskip("pytorch_optimizer").SOAP(
        p, lr=3e-3, betas=(0.95, 0.95), weight_decay=wd, precondition_frequency=100,
        eps=1e-12), tree, grads)
    ours_wd = run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-12, weight_decay=wd,
                                   precondition_frequency=100,
                                   preconditioner_dtype=torch.float64), tree, grads)
    assert max(displacement_gaps(ours, theirs, tree).values()) <= 1e-8
    diff = max(displacement_gaps(ours_wd, theirs_wd, tree).values())
    assert diff > 1e-3


def heavyball_soap(freq: int, max_precond_dim: int = 10000, merge_dims: bool = False):
    hb = pytest.importorskip("heavyball")
    return lambda params: hb.SOAP(params, lr=3e-3, betas=(0.95, 0.95), shampoo_beta=0.95,
                                  eps=1e-8, weight_decay=0.0, precondition_frequency=freq,
                                  max_precond_dim=max_precond_dim, merge_dims=merge_dims)


@pytest.mark.parametrize("keep", [False, True], ids=["rotated", "kept_in_eigenbasis"])
@pytest.mark.parametrize("freq, bound", [(100, 1e-5), (1, 5e-4)])
def test_soap_equals_heavyball(freq, bound, keep) -> None:
    """float32 (heavyball's compiled step does not take float64), 10 steps: without a refresh
    to 1e-5 (measured 3e-6); refreshed every step to heavyball's lifted QR (measured 7.5e-5);
    the first moment rotated every step or kept in the eigenbasis as heavyball keeps it."""
    tree, grads = problem(FULL_RANK, 10, 0, torch.float32)
    theirs = run_torch(heavyball_soap(freq), tree, grads)
    ours = run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-8, weight_decay=0.0,
                                precondition_frequency=freq, first_moment_in_eigenbasis=keep),
                     tree, grads)
    assert max(displacement_gaps(ours, theirs, tree).values()) <= bound


def test_heavyball_refreshes_one_step_earlier() -> None:
    """With frequency 2, heavyball refreshes at its calls 2, 4, ... and the reference (and opttx)
    after Adam steps 2, 4, ... (calls 3, 5, ...): opttx follows the reference, not heavyball."""
    tree, grads = problem(FULL_RANK, 10, 0, torch.float32)
    ours = run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-8, weight_decay=0.0,
                                precondition_frequency=2), tree, grads)
    reference = run_torch(soap_ref(2, 1e-8), tree, grads)
    heavy = run_torch(heavyball_soap(2), tree, grads)
    assert max(displacement_gaps(ours, reference, tree).values()) <= 1e-5
    assert max(displacement_gaps(ours, heavy, tree).values()) > 1e-2


def test_rank_deficient_first_factor_depends_on_the_implementation() -> None:
    """A (4, 6) gradient gives a rank-4 6x6 factor at the first step: its null-space basis is
    whatever eigh returns, and the implementations then differ by tens of percent (so the
    comparisons above use full-rank factors)."""
    tree, grads = problem({"r": (4, 6)}, 8, 0, torch.float64)
    theirs = run_torch(soap_ref(100, 1e-12), tree, grads)
    ours = run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-12, weight_decay=0.0,
                                precondition_frequency=100,
                                preconditioner_dtype=torch.float64), tree, grads)
    assert displacement_gaps(ours, theirs, tree)["r"] > 1e-2


# ---------------------------------------------------------------------------------------------
# merge_dims: the SOAP reference code's merging and heavyball's
# ---------------------------------------------------------------------------------------------

merge_shapes = st.lists(st.integers(1, 40), min_size=1, max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(shape=merge_shapes, max_dim=st.sampled_from([1, 8, 64, 1000]))
def test_merge_dims_heavyball_is_heavyballs_dim_merger(shape, max_dim) -> None:
    pytest.importorskip("heavyball")
    from heavyball.utils import dim_merger
    theirs = tuple(dim_merger(torch.empty(shape, device="meta"), max_dim).shape)
    assert opttx.merge_dims_heavyball(shape, max_dim) == theirs


@settings(max_examples=200, deadline=None)
@given(shape=merge_shapes, max_dim=st.sampled_from([8, 64, 1000]))
def test_merge_dims_soap_is_the_reference_merging(shape, max_dim) -> None:
    """``pytorch_optimizer``'s port of the reference's merging agrees where it is defined
    alike: no size-1 dim, none above ``max_dim``, two merged dims or more (it keeps size-1
    dims and maps a shape that merges into one dim to ``[1]``, which its SOAP cannot reshape
    to); elsewhere the reference code's own examples and rules."""
    pytest.importorskip("pytorch_optimizer")
    from pytorch_optimizer.optimizer.utils.shape import merge_small_dims
    ours = opttx.merge_dims_soap(shape, max_dim)
    assert math.prod(ours) == math.prod(shape)
    if all(1 < d <= max_dim for d in shape):
        theirs = tuple(merge_small_dims(shape, max_dim))
        assert ours == ((math.prod(shape),) if theirs == (1,) else theirs)
    assert all(d <= max_dim for d in ours if d not in shape)      # merged dims fit
    assert 1 not in ours or ours == (1,)


def test_merge_dims_examples() -> None:
    assert opttx.merge_dims_soap((1, 2, 512, 1, 2048, 1, 3, 4), 1024) == (1024, 2048, 12)
    assert opttx.merge_dims_soap((128, 64, 3, 3), 10000) == (8192, 9)
    assert opttx.merge_dims_soap((2048, 3), 1024) == (2048, 3)
    assert opttx.merge_dims_soap((4, 8), 10000) == (32,)
    assert opttx.merge_dims_soap((), 8) == (1,)
    assert opttx.merge_dims_heavyball((128, 64, 3, 3), 10000) == (128, 576)
    assert opttx.merge_dims_heavyball((128, 64, 3, 3), 100) == (128, 64, 9)
    assert opttx.merge_dims_heavyball((7,), 4) == (7,)


# full-rank factors once merged at max_precond_dim 8: (2, 4, 2, 4) -> (8, 8) by the reference's
# rule; (8, 2, 2, 2) -> (8, 8) and (4, 4, 2, 2) -> (4, 4, 4) by heavyball's (the reference's
# rule gives (4, 8, 2) for the latter); the other leaves keep their shapes
MERGED_REF = {"m": (5, 5), "t": (3, 4, 4), "c": (2, 4, 2, 4)}
MERGED_HEAVYBALL = {**FULL_RANK, "c": (8, 2, 2, 2), "d": (4, 4, 2, 2)}


@pytest.mark.parametrize("freq", [1, 3, 100])
def test_soap_merge_dims_equals_reference_code(freq) -> None:
    """``merge_dims=True`` against ``pytorch_optimizer.SOAP(merge_dims=True)``, float32,
    12 steps: 1e-5 (measured 1.1e-6 .. 2.2e-6), as unmerged. Without the merging the 4-D leaf
    is a different optimizer (four 2-4 dim factors instead of two 8-dim ones), 0.41-0.45
    away. No 1-D leaf: the port's merging cannot reshape one."""
    tree, grads = problem(MERGED_REF, 12, 0, torch.float32)
    theirs = run_torch(soap_ref(freq, 1e-12, merge_dims=True, max_precondition_dim=8),
                       tree, grads)
    kw = dict(eps=1e-12, weight_decay=0.0, precondition_frequency=freq, max_precond_dim=8)
    ours = run_opttx(opttx.soap(3e-3, 0.95, 0.95, merge_dims=True, **kw), tree, grads)
    assert max(displacement_gaps(ours, theirs, tree).values()) <= 1e-5
    unmerged = run_opttx(opttx.soap(3e-3, 0.95, 0.95, **kw), tree, grads)
    assert displacement_gaps(unmerged, theirs, tree)["c"] > 1e-3


@pytest.mark.parametrize("keep", [False, True], ids=["rotated", "kept_in_eigenbasis"])
def test_soap_merge_dims_heavyball_equals_heavyball(keep) -> None:
    """``merge_dims="heavyball"`` against heavyball's ``SOAP(merge_dims=True)`` (its default),
    float32, 10 steps, no refresh: 3e-5 (measured up to 9.3e-6, on the unmerged (5, 5)
    leaf with the moment kept in the eigenbasis; the merged leaves up to 4e-6; merging or not
    is 0.35 apart); the reference code's merging (``merge_dims=True``) is another optimizer on
    the (4, 4, 2, 2) leaf (0.45). Both contrasts are asserted."""
    tree, grads = problem(MERGED_HEAVYBALL, 10, 0, torch.float32)
    theirs = run_torch(heavyball_soap(100, max_precond_dim=8, merge_dims=True), tree, grads)

    def ours(**kw):
        return run_opttx(opttx.soap(3e-3, 0.95, 0.95, eps=1e-8, weight_decay=0.0,
                                    precondition_frequency=100, max_precond_dim=8, **kw),
                         tree, grads)
    gaps = displacement_gaps(ours(merge_dims="heavyball", first_moment_in_eigenbasis=keep),
                             theirs, tree)
    assert max(gaps.values()) <= 3e-5
    assert displacement_gaps(ours(first_moment_in_eigenbasis=keep), theirs, tree)["c"] > 1e-2
    assert displacement_gaps(ours(merge_dims=True, first_moment_in_eigenbasis=keep), theirs,
                             tree)["d"] > 1e-2


def test_heavyball_leaves_a_leaf_merged_into_one_dim_unrotated() -> None:
    """An ``(n, 1)`` leaf merges into one dim: heavyball keeps it in the standard basis (as a
    1-D leaf), opttx rotates it as the reference code rotates any merged leaf: another
    optimizer on that leaf (documented in `opttx.soap`)."""
    tree, grads = problem({"m": (5, 5), "n": (6, 1)}, 10, 0, torch.float32)
    theirs = run_torch(heavyball_soap(100, max_precond_dim=8, merge_dims=True), tree, grads)
    tx = opttx.soap(3e-3, 0.95, 0.95, eps=1e-8, weight_decay=0.0, precondition_frequency=100,
                    max_precond_dim=8, merge_dims="heavyball")
    gaps = displacement_gaps(run_opttx(tx, tree, grads), theirs, tree)
    assert gaps["m"] <= 3e-5 and gaps["n"] > 1e-3
    assert [tuple(q.shape) for q in tx.init(tree)[0].bases["n"]] == [(6, 6)]


def test_soap_merge_dims_state_layout() -> None:
    """Factors and bases are those of the merged dims, the moments keep the leaves' shapes; a
    matrix merged into one dim is rotated, a 1-D leaf is not (``precondition_1d=False``), as
    in the reference code; compiled, one graph and the eager numbers; a checkpoint
    (`opttx.distributed.state_dict`, ``torch.save``) resumes bitwise."""
    tree, grads = problem({"conv": (6, 2, 3, 3), "small": (2, 3), "bias": (4,)}, 4, 3,
                          torch.float32)
    tx = opttx.soap(merge_dims=True, max_precond_dim=16, precondition_frequency=2)
    params, state = run_transform(tx, tree, grads)
    ec = state[0]
    assert [tuple(f.shape) for f in ec.factors["conv"]] == [(12, 12), (9, 9)]
    assert [tuple(q.shape) for q in ec.bases["small"]] == [(6, 6)]
    assert [tuple(q.shape) for q in ec.bases["bias"]] == [(0, 0)]
    assert {k: tuple(v.shape) for k, v in ec.nu.items()} == {k: v.shape for k, v in tree.items()}
    assert float(ec.bases["small"][0].diagonal().abs().min()) < 0.99      # a rotation
    counter = CompileCounter()
    compiled = torch.compile(tx.update, backend=counter, fullgraph=True)
    st_ = tx.init(tree)
    eager_st = tx.init(tree)
    for g in grads:
        u, st_ = compiled(g, st_, tree)
        v, eager_st = tx.update(g, eager_st, tree)
        for k in u:
            torch.testing.assert_close(u[k], v[k], rtol=1e-5, atol=1e-7)
    assert counter.frame_count == 1
    saved = opttx.distributed.state_dict(state, params)
    fresh = opttx.distributed.state_dict(tx.init(tree), tree)
    assert set(saved["state"]) == set(tree)
    assert {p: set(f) for p, f in saved["state"].items()} == \
        {p: set(f) for p, f in fresh["state"].items()}
    assert set(saved["shared"]) == set(fresh["shared"])
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    resumed = opttx.distributed.load_state_dict(tx.init(tree), torch.load(buffer,
                                                                         weights_only=True),
                                                params)
    more = problem({k: v.shape for k, v in tree.items()}, 3, 4, torch.float32)[1]
    expected = run_transform(tx, params, more, state)[0]
    got = run_transform(tx, params, more, resumed)[0]
    assert all(torch.equal(got[k], expected[k]) for k in tree)


def test_soap_merge_dims_under_stacked_equals_per_leaf() -> None:
    """`opttx.stacked` runs the merged leaves slice by slice with the per-leaf numbers: 1e-5
    (measured 0.0 on the stacked merged leaves, 1.7e-6 on the (5, 5) one; unmerged, the
    merged leaves are 0.5 away, asserted). The leaves' merged factors have full rank: the conformance
    registry's (2, 3, 4) leaf merges into a rank-deficient first factor, whose null-space
    basis batched ``eigh`` picks differently, so the registry has no merged case."""
    tree, grads = problem({"c0": (2, 4, 2, 4), "c1": (2, 4, 2, 4), "c2": (2, 4, 2, 4),
                           "m": (5, 5)}, 6, 5, torch.float32)
    def make(merge_dims=True):
        return opttx.soap(3e-3, merge_dims=merge_dims, max_precond_dim=8,
                          precondition_frequency=2)
    per_leaf = run_opttx(make(), tree, grads)
    stack = opttx.StackedParams(tree)
    stacked_grads = [stack.stack(g) for g in grads]
    buffers = run_opttx(opttx.stacked(make()), stack.buffers, stacked_grads)
    assert max(displacement_gaps(stack.unstack(buffers), per_leaf, tree).values()) <= 1e-5
    unmerged = run_opttx(opttx.stacked(make(False)), stack.buffers, stacked_grads)
    assert displacement_gaps(stack.unstack(unmerged), per_leaf, tree)["c0"] > 1e-2


def test_soap_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="merge_dims"):
        opttx.soap(merge_dims="meta")
    with pytest.raises(ValueError, match="merge_dims"):
        opttx.precondition_eigenvalue_corrected(merge_dims=lambda s: (1,),
                                                ignored_basis_change_dims={2: [0]})
    with pytest.raises(ValueError, match="number of elements"):
        opttx.precondition_eigenvalue_corrected(merge_dims=lambda s: (1,)).init(
            {"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="eigendecomposition"):
        opttx.precondition_eigenvalue_corrected(eigendecomposition="svd")
    with pytest.raises(ValueError, match="preconditioner"):
        opttx.shampoo(preconditioner="kl")
    with pytest.raises(ValueError, match="ignored_basis_change_dims"):
        opttx.precondition_eigenvalue_corrected(ignored_basis_change_dims={2: [2]})
