"""NorMuon, AdaMuon, Dion and Dion2 against their reference code, over 20 steps on
hypothesis-drawn trees of matrices (and a vector, which runs AdamW in both).

References: Microsoft's ``dion`` package (``NorMuon``, ``DionReference``, ``Dion2``; from
``../shared/refs/dion``, skipped where absent) and ``pytorch_optimizer.AdaMuon``. The
references' ``torch.compile`` decorations are bypassed (their functions run eagerly: Inductor
on this CPU would compile every shape), and their hard-coded bfloat16 casts before the
orthogonalization are undone, so that float64 compares the algorithms:

Hyperparameters are drawn among values the reference's float32 scalar tensors hold exactly
(it makes ``torch.tensor(mu)`` etc. and computes ``1 - lr * weight_decay``, ``1 - muon_beta2``
and AdamW's ``beta ** step`` in float32), and opttx gets those same values.

* NorMuon, float64: <= 1e-8 relative to each leaf's magnitude (measured 2.8e-9); the
  reference's ``U.to(bfloat16)`` after the momentum step is replaced by the same momentum in
  float64, and its Polar Express runs with ``Tensor.bfloat16`` as the identity;
* Dion2, float64: <= 1e-8 (measured 4.1e-9); the selected submatrix is taken, by the
  reference's own indices, from its momentum in float64 instead of its bfloat16 copy;
* AdaMuon, float64: <= 1e-8 (measured 1.2e-15); the reference's Newton–Schulz runs with
  ``dtype=torch.float64`` and a norm floor of 1e-30 (it clamps the norm at ``eps``, opttx
  adds ``ns_eps``, set to 0 here);
* Dion, float64: <= 1e-6 (measured 2.7e-7): the reference orthonormalizes ``P`` (a random
  sketch, then QR and Cholesky QR) and normalizes ``R``'s columns in float32 even for
  float64 parameters, so agreement is to float32's resolution; its random sketch changes
  nothing in exact arithmetic (the same ``P`` up to column signs, which cancel). Both start
  from the same ``Q`` (opttx's, put into the reference's state before its first step).
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opttx
from dion_reference import dion
from opttx.testing import assert_trees_close, gradient_stream, run_transform

STEPS = 20
F64 = torch.float64


def f32(lo: float, hi: float):
    """Floats in [lo, hi] that float32 represents exactly: the dion package makes 0-dim
    float32 tensors of its hyperparameters (``torch.tensor(group["mu"])``), so a float64
    run there uses the float32 value of 0.95 (a 1e-8 relative difference that 20 steps of
    momentum carry into the parameters at ~1e-7)."""
    return st.floats(lo, hi).map(lambda x: float(torch.tensor(x, dtype=torch.float32)))


# the values the dion package's defaults take as its float32 tensors (AdamW's betas, epsilon)
F32_DEFAULTS = {k: float(torch.tensor(v, dtype=torch.float32)) for k, v in
                {"adam_b1": 0.9, "adam_b2": 0.95, "eps": 1e-8}.items()}

# powers of two: the reference computes its decay factor 1 - lr * weight_decay from a float32
# weight decay tensor, in float32 (a 6e-8 error per step otherwise); with these it is exact
LRS = st.sampled_from([2.0**-5, 2.0**-7, 2.0**-9])
DECAYS = st.sampled_from([0.0, 2.0**-7, 2.0**-4])


@st.composite
def trees(draw, min_side: int = 1, max_side: int = 9):
    """1-3 matrices of drawn shapes and a vector, float64."""
    n = draw(st.integers(1, 3))
    side = st.integers(min_side, max_side)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    tree = {f"w{i}": torch.randn(draw(side), draw(side), generator=gen, dtype=F64)
            for i in range(n)}
    tree["bias"] = torch.randn(draw(side), generator=gen, dtype=F64)
    return tree, draw(st.integers(0, 2**16))


def matrices(tree: dict) -> dict:
    return {k: v.ndim == 2 for k, v in tree.items()}


def check(actual: dict, expected: dict, tree: dict, tol: float, what: str) -> float:
    """Each leaf within ``tol`` relative to its magnitude over the run; returns the largest
    relative difference seen."""
    worst = 0.0
    for k in tree:
        scale = max(float(tree[k].abs().max()), float(expected[k].abs().max()))
        diff = float((actual[k] - expected[k]).abs().max()) / scale
        worst = max(worst, diff)
        assert_trees_close(actual[k], expected[k], rtol=tol, atol=tol * scale,
                           what=f"{what} params[{k}]")
    return worst


@pytest.fixture
def eager_dion(monkeypatch):
    """The dion package with its torch.compile'd functions replaced by the originals."""
    dion("dion")
    for name, module in list(sys.modules.items()):
        if name == "dion" or name.startswith("dion."):
            for attr, value in list(vars(module).items()):
                orig = getattr(value, "_torchdynamo_orig_callable", None)
                if orig is not None:
                    monkeypatch.setattr(module, attr, orig)
    return sys.modules["dion"]


def float64_polar_express(monkeypatch):
    """The dion package's Polar Express with its bfloat16 cast as the identity."""
    from dion.polar_express import polar_express
    orig = getattr(polar_express, "_torchdynamo_orig_callable", polar_express)
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self)
    return lambda x, epsilon=None: orig(x, epsilon)


def run_reference(opt_factory, tree: dict, grads: list[dict]) -> dict:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = opt_factory(params)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def groups(params: dict, matrix_group: dict, vector_group: dict) -> list[dict]:
    mats = [p for p in params.values() if p.ndim == 2]
    vecs = [p for p in params.values() if p.ndim != 2]
    return [{"params": mats, **matrix_group}, {"params": vecs, **vector_group}]


# ---------------------------------------------------------------------------------------------
# NorMuon
# ---------------------------------------------------------------------------------------------

normuon_hparams = st.fixed_dictionaries({
    # 1 - 2^-k: the reference's lerp weight 1 - muon_beta2 is computed in float32
    "lr": LRS, "mu": f32(0.5, 0.99), "muon_beta2": st.sampled_from([0.5, 0.75, 0.875, 0.9375]),
    "weight_decay": DECAYS, "nesterov": st.booleans(),
    "adjust_lr": st.sampled_from(["spectral_norm", "rms_norm", None])})


def test_normuon_equals_the_dion_packages(eager_dion, monkeypatch) -> None:
    import dion.normuon as ref
    pre = ref.muon_update_pre_orthogonalize

    def pre_in_float64(G, M, momentum, nesterov):      # the reference's step, without the cast
        pre(G, M, momentum, nesterov)
        return [m * momentum + g if nesterov else m.clone() for m, g in zip(M, G)]

    monkeypatch.setattr(ref, "muon_update_pre_orthogonalize", pre_in_float64)
    ns = float64_polar_express(monkeypatch)
    worst = [0.0]

    @settings(max_examples=8, deadline=None)
    @given(drawn=trees(), h=normuon_hparams)
    def prop(drawn, h):
        tree, seed = drawn
        grads = gradient_stream(tree, STEPS, seed=seed)
        expected = run_reference(lambda p: eager_dion.NorMuon(
            groups(p, {}, {"algorithm": "adamw"}), newton_schulz_func=ns, **h), tree, grads)
        ours = opttx.normuon(h["lr"], h["mu"], h["muon_beta2"], h["weight_decay"],
                             nesterov=h["nesterov"], adjust_lr=h["adjust_lr"],
                             muon_mask=matrices, **F32_DEFAULTS)
        actual, _ = run_transform(ours, tree, grads)
        worst[0] = max(worst[0], check(actual, expected, tree, 1e-8, "normuon"))
    prop()
    print(f"normuon: largest relative difference {worst[0]:.1e}")


# ---------------------------------------------------------------------------------------------
# Dion2
# ---------------------------------------------------------------------------------------------

dion2_hparams = st.fixed_dictionaries({
    "lr": LRS, "fraction": st.sampled_from([0.25, 0.5, 1.0]),
    "ef_decay": f32(0.5, 0.99), "weight_decay": DECAYS,
    "adjust_lr": st.sampled_from(["spectral_norm", "rms_norm", None])})


def test_dion2_equals_the_dion_packages(eager_dion, monkeypatch) -> None:
    import dion.dion2 as ref
    pre = ref.dion2_pre_orthogonalize

    def pre_in_float64(G, M, fraction, ef_decay, select_dim, k_override=None):
        summed = [m + g.to(m.dtype) for m, g in zip(M, G)]    # what the reference selects from
        _, indices = pre(G, M, fraction, ef_decay, select_dim, k_override)
        out = []
        for s, idx in zip(summed, indices):
            if select_dim == -2:
                out.append(s.gather(-2, idx.unsqueeze(-1).expand(*idx.shape, s.size(-1))))
            else:
                out.append(s.gather(-1, idx.unsqueeze(-2).expand(s.size(-2), *idx.shape)))
        return out, indices

    monkeypatch.setattr(ref, "dion2_pre_orthogonalize", pre_in_float64)
    ns = float64_polar_express(monkeypatch)
    worst = [0.0]

    @settings(max_examples=8, deadline=None)
    @given(drawn=trees(), h=dion2_hparams)
    def prop(drawn, h):
        tree, seed = drawn
        grads = gradient_stream(tree, STEPS, seed=seed)
        expected = run_reference(lambda p: eager_dion.Dion2(
            groups(p, {}, {"algorithm": "adamw"}), newton_schulz_func=ns, **h), tree, grads)
        ours = opttx.dion2(h["lr"], h["fraction"], h["ef_decay"], h["weight_decay"],
                           adjust_lr=h["adjust_lr"], muon_mask=matrices, **F32_DEFAULTS)
        actual, _ = run_transform(ours, tree, grads)
        worst[0] = max(worst[0], check(actual, expected, tree, 1e-8, "dion2"))
    prop()
    print(f"dion2: largest relative difference {worst[0]:.1e}")


# ---------------------------------------------------------------------------------------------
# Dion
# ---------------------------------------------------------------------------------------------

dion_hparams = st.fixed_dictionaries({
    "lr": LRS, "rank_fraction": st.sampled_from([0.25, 0.5, 1.0]),
    "mu": f32(0.5, 0.99), "weight_decay": DECAYS})


def test_dion_equals_the_dion_packages_reference(eager_dion) -> None:
    worst = [0.0]

    @settings(max_examples=8, deadline=None)
    @given(drawn=trees(), h=dion_hparams)
    def prop(drawn, h):
        tree, seed = drawn
        grads = gradient_stream(tree, STEPS, seed=seed)
        ours = opttx.dion(h["lr"], h["rank_fraction"], h["mu"], h["weight_decay"],
                          muon_mask=matrices, **F32_DEFAULTS)
        state = ours.init(tree)
        q0 = state.inner_states["dion"].inner_state[0].q

        def reference(p):
            opt = eager_dion.DionReference(groups(p, {}, {"algorithm": "adamw"}),
                                           lr=h["lr"], mu=h["mu"],
                                           rank_fraction=h["rank_fraction"],
                                           weight_decay=h["weight_decay"])
            for k, x in p.items():      # the same starting Q
                if x.ndim == 2:
                    opt.state[x]["momentum"] = torch.zeros_like(x)
                    opt.state[x]["Q"] = q0[k].clone()
            return opt

        expected = run_reference(reference, tree, grads)
        actual, _ = run_transform(ours, tree, grads, state=state)
        worst[0] = max(worst[0], check(actual, expected, tree, 1e-6, "dion"))
    prop()
    print(f"dion: largest relative difference {worst[0]:.1e}")


# ---------------------------------------------------------------------------------------------
# AdaMuon
# ---------------------------------------------------------------------------------------------

adamuon_hparams = st.fixed_dictionaries({
    "lr": st.floats(1e-3, 0.05), "betas": st.tuples(st.floats(0.5, 0.99), st.floats(0.5, 0.99)),
    "weight_decay": st.sampled_from([0.0, 0.01, 0.1]), "ns_steps": st.integers(3, 6),
    "use_adjusted_lr": st.booleans(), "adamw_lr": st.sampled_from([1e-3, 3e-4]),
    "adamw_wd": st.sampled_from([0.0, 0.01])})


def test_adamuon_equals_pytorch_optimizers(monkeypatch) -> None:
    po = pytest.importorskip("pytorch_optimizer")
    from pytorch_optimizer.optimizer.muon import adamuon as ref
    monkeypatch.setattr(ref, "zero_power_via_newton_schulz_5", functools.partial(
        ref.zero_power_via_newton_schulz_5, dtype=F64, eps=1e-30))
    worst = [0.0]

    @settings(max_examples=8, deadline=None)
    @given(drawn=trees(), h=adamuon_hparams)
    def prop(drawn, h):
        tree, seed = drawn
        grads = gradient_stream(tree, STEPS, seed=seed)
        expected = run_reference(lambda p: po.AdaMuon(
            groups(p, {"use_muon": True}, {"use_muon": False}), **h), tree, grads)
        ours = opttx.adamuon(h["lr"], *h["betas"], h["weight_decay"], ns_steps=h["ns_steps"],
                             ns_eps=0.0, consistent_rms=0.2 if h["use_adjusted_lr"] else None,
                             adam_learning_rate=h["adamw_lr"],
                             adam_weight_decay=h["adamw_wd"], muon_mask=matrices)
        actual, _ = run_transform(ours, tree, grads)
        worst[0] = max(worst[0], check(actual, expected, tree, 1e-8, "adamuon"))
    prop()
    print(f"adamuon: largest relative difference {worst[0]:.1e}")


def test_adamuon_sign_orthogonalizes_the_sign_of_the_momentum() -> None:
    """The paper's sign-stabilized step: with b1 = 0 the momentum is the gradient, so the
    first update is AdaMuon's rescaling of NS(sign(g))."""
    gen = torch.Generator().manual_seed(0)
    tree = {"w": torch.randn(5, 7, generator=gen, dtype=F64)}
    g = {"w": torch.randn(5, 7, generator=gen, dtype=F64)}
    signed, _ = opttx.adamuon(0.1, b1=0.0, sign=True, muon_mask=True).update(
        g, opttx.adamuon(0.1, b1=0.0, sign=True, muon_mask=True).init(tree), tree)
    plain, _ = opttx.adamuon(0.1, b1=0.0, muon_mask=True).update(
        {"w": torch.sign(g["w"])}, opttx.adamuon(0.1, b1=0.0, muon_mask=True).init(tree), tree)
    assert_trees_close(signed, plain, rtol=1e-14)
    # the update's RMS is 0.2 times the learning rate (AdaMuon's RMS alignment)
    rms = float(signed["w"].pow(2).mean().sqrt())
    assert math.isclose(rms, 0.2 * 0.1, rel_tol=1e-6)


def test_dion_turns_a_matrix_with_a_nan_gradient_element_nan(eager_dion) -> None:
    """One NaN element in a matrix's gradient: our update of that matrix is NaN, every
    element, at that step and after. The dion package (its ``fix_all_zero_or_nan`` applies
    ``nan_to_num`` to the factors, meant for an all-zero momentum) keeps the parameters
    finite with the NaN held in the momentum for good: the matrix stops moving, unseen, as
    ours did. The vector (AdamW) is untouched by it in both."""
    gen = torch.Generator().manual_seed(0)
    tree = {"w": torch.randn(8, 6, generator=gen), "b": torch.randn(6, generator=gen)}
    grads = gradient_stream(tree, 3, seed=1)
    grads[1]["w"][2, 3] = float("nan")
    ours = opttx.dion(0.01, rank_fraction=1.0, muon_mask=matrices)
    state = ours.init(tree)
    q0 = state.inner_states["dion"].inner_state[0].q

    def reference(p):
        opt = eager_dion.DionReference(groups(p, {}, {"algorithm": "adamw"}), lr=0.01,
                                       rank_fraction=1.0)
        opt.state[p["w"]]["momentum"] = torch.zeros_like(p["w"])
        opt.state[p["w"]]["Q"] = q0["w"].clone()
        return opt

    ref = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = reference(ref)
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
    assert torch.isfinite(ref["w"]).all() and opt.state[ref["w"]]["momentum"].isnan().any()
    actual, _ = run_transform(ours, tree, grads, state=state)
    assert torch.isnan(actual["w"]).all()
    assert torch.isfinite(actual["b"]).all() and torch.isfinite(ref["b"]).all()
    _, state = ours.update(grads[0], ours.init(tree), tree)
    for g in grads[1:]:
        updates, state = ours.update(g, state, tree)
        assert torch.isnan(updates["w"]).all()
