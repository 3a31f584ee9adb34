"""Muon: `orthogonalize`, `scale_by_shape` and the alias `muon`.

* ``muon`` equals ``torch.optim.Muon`` over 20 steps on drawn trees of matrices and drawn
  hyperparameters (float32 <= 1e-5 relative to each leaf's magnitude, float64 <= 1e-10), and
  ``optax.contrib.muon`` on drawn trees of matrices and vectors (jax on CPU, float64 on);
* the Newton–Schulz iteration keeps the polar factor of the SVD and maps every singular
  value into the band its polynomial allows ([0.68, 1.21] for normalised singular values
  >= 2e-3 with the default coefficients and 5 steps);
* a leaf of 3 or more dims is orthogonalized matrix by matrix over ``matrix_axes``;
* vectors are refused with a clear error; the default rule routes embeddings, heads and
  vectors to AdamW;
* a train step with ``muon`` compiles with ``fullgraph=True`` to one graph, equal to eager.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import functional_call, grad_and_value

import opttx
from opttx.testing import (assert_trees_close, gradient_stream, param_trees, run_transform,
                           shapes)
from opttx.transforms.orthogonalize import NS_COEFFS, newton_schulz, polar_factor
from optax_reference import run_optax

STEPS = 20
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
NS5 = [NS_COEFFS] * 5


def check_close(actual: dict, expected: dict, tree: dict, what: str) -> None:
    dtype = next(iter(tree.values())).dtype
    tol = TOLERANCE[dtype]
    for k in tree:    # relative to the leaf's magnitude over the run
        scale = max(float(tree[k].abs().max()), float(expected[k].abs().max()))
        assert_trees_close(actual[k], expected[k], rtol=tol, atol=tol * scale,
                           what=f"{what} params[{k}]")


# ---------------------------------------------------------------------------------------------
# torch.optim.Muon
# ---------------------------------------------------------------------------------------------

torch_hparams = st.fixed_dictionaries({
    "lr": st.floats(1e-3, 0.1), "momentum": st.floats(0.0, 0.99), "nesterov": st.booleans(),
    "weight_decay": st.sampled_from([0.0, 0.01, 0.1]), "ns_steps": st.integers(1, 6),
    "adjust_lr_fn": st.sampled_from([None, "original", "match_rms_adamw"])})


def torch_muon_as_opttx(h: dict) -> opttx.GradientTransformation:
    """``torch.optim.Muon(**h)`` written with opttx (the recipe in `opttx.muon`'s docstring)."""
    return opttx.muon(h["lr"], ns_steps=h["ns_steps"], beta=h["momentum"], eps=1e-7,
                      weight_decay=h["weight_decay"], nesterov=h["nesterov"],
                      bias_correction=False, ns_dtype=torch.bfloat16,
                      consistent_rms=0.2 if h["adjust_lr_fn"] == "match_rms_adamw" else None,
                      muon_mask=True)


def run_torch_muon(h: dict, tree: dict, grads: list[dict]) -> dict:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = torch.optim.Muon(list(params.values()), **h)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_muon_equals_torch_optim_muon(dtype: torch.dtype) -> None:
    @settings(max_examples=10, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,), shape_strategy=shapes(2, 2, 1, 9)),
           h=torch_hparams)
    def prop(drawn, h):
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        expected = run_torch_muon(h, drawn.tree, grads)
        actual, _ = run_transform(torch_muon_as_opttx(h), drawn.tree, grads)
        check_close(actual, expected, drawn.tree, "muon vs torch.optim.Muon")
    prop()


def test_newton_schulz_in_bfloat16_is_torchs_bit_for_bit() -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz
    gen = torch.Generator().manual_seed(0)
    for shape in [(7, 4), (4, 7), (5, 5), (1, 6), (9, 1)]:
        g = torch.randn(shape, generator=gen)
        ours = newton_schulz(g, NS5, 1e-7, torch.bfloat16)
        theirs = _zeropower_via_newtonschulz(g, NS_COEFFS, 5, 1e-7).float()
        assert torch.equal(ours, theirs), shape


def test_shape_scaling_is_torchs_adjust_lr() -> None:
    from torch.optim._muon import _adjust_lr
    for shape in [(6, 3), (3, 6), (4, 4), (1, 9), (9, 1)]:
        g = {"w": torch.ones(shape, dtype=torch.float64)}
        for fn, rms in [(None, None), ("original", None), ("match_rms_adamw", 0.2)]:
            out, _ = opttx.scale_by_shape(rms).update(g, opttx.EmptyState())
            assert math.isclose(float(out["w"][0, 0]), _adjust_lr(1.0, fn, torch.Size(shape)),
                                rel_tol=1e-15), (shape, fn)
        # (in, out) layouts: the fan-out is the last axis
        out, _ = opttx.scale_by_shape(matrix_axes=(-1, -2)).update(g, opttx.EmptyState())
        assert math.isclose(float(out["w"][0, 0]), math.sqrt(max(1, shape[1] / shape[0])))


# ---------------------------------------------------------------------------------------------
# optax.contrib.muon
# ---------------------------------------------------------------------------------------------


optax_hparams = st.fixed_dictionaries({
    "beta": st.floats(0.5, 0.99), "nesterov": st.booleans(), "ns_steps": st.integers(3, 6),
    "weight_decay": st.sampled_from([0.0, 0.1]), "consistent_rms": st.sampled_from([None, 0.2]),
    "adam_weight_decay": st.sampled_from([0.0, 0.01]),
    "adam_learning_rate": st.sampled_from([None, 1e-3])})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_muon_equals_optax_contrib_muon(dtype: torch.dtype) -> None:
    """Matrices go to Muon, vectors to AdamW, in both; optax's weights are (in, out), so
    ours read the fan-out from the last axis (``matrix_axes=(-1, -2)``)."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)

    @settings(max_examples=4, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,), shape_strategy=shapes(1, 2, 1, 8)),
           h=optax_hparams)
    def prop(drawn, h):
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        expected = run_optax(optax.contrib.muon(0.02, **h), drawn.tree, grads)[0]
        actual, _ = run_transform(opttx.muon(0.02, matrix_axes=(-1, -2), **h), drawn.tree,
                                  grads)
        check_close(actual, expected, drawn.tree, "muon vs optax.contrib.muon")
    prop()


# ---------------------------------------------------------------------------------------------
# Newton–Schulz against the SVD
# ---------------------------------------------------------------------------------------------


@st.composite
def conditioned_matrices(draw):
    """A matrix U diag(s) Vᵀ (float64) with singular values in [0.01, 1] times a scale, so
    every normalised singular value s / ||s|| is at least 2.5e-3."""
    m, n = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    s = 10 ** (-2 * torch.rand(k, generator=gen, dtype=torch.float64))
    return scale * (u * s) @ v.T


@settings(max_examples=40, deadline=None)
@given(g=conditioned_matrices())
def test_newton_schulz_keeps_the_polar_factor_and_bounds_singular_values(g) -> None:
    ns = newton_schulz(g, NS5, eps=1e-7)
    svd = opttx.orthogonalize(method="svd").update({"g": g}, opttx.EmptyState())[0]["g"]
    # the exact reference: U Vᵀ, all singular values 1
    assert torch.allclose(torch.linalg.svdvals(svd), torch.ones(min(g.shape),
                                                                dtype=g.dtype), atol=1e-12)
    # Newton–Schulz: U p(Σ) Vᵀ, p(σ) in [0.68, 1.21] for these σ
    sv = torch.linalg.svdvals(ns)
    assert sv.min() >= 0.68 and sv.max() <= 1.21, sv
    assert torch.linalg.matrix_norm(ns - svd, ord=2) <= 0.32
    # same singular vectors: the polar factor of the iterate is the polar factor of g
    assert torch.allclose(polar_factor(ns), svd, atol=1e-10)
    # and the transform equals the function
    out, _ = opttx.orthogonalize().update({"g": g}, opttx.EmptyState())
    assert torch.equal(out["g"], ns)


def test_svd_maps_a_zero_matrix_and_null_directions_to_zero() -> None:
    assert torch.equal(polar_factor(torch.zeros(3, 4)), torch.zeros(3, 4))
    assert torch.equal(newton_schulz(torch.zeros(3, 4), NS5), torch.zeros(3, 4))
    rank_one = torch.outer(torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64),
                           torch.tensor([0.0, 3.0, 4.0, 0.0], dtype=torch.float64))
    q = polar_factor(rank_one)
    assert torch.allclose(q, rank_one / 15.0, atol=1e-12)   # u vᵀ with unit u, v


# ---------------------------------------------------------------------------------------------
# batched leaves and axes
# ---------------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=3, max_size=4).map(tuple),
       method=st.sampled_from(["newton_schulz", "svd"]), data=st.data())
def test_a_batched_leaf_is_orthogonalized_matrix_by_matrix(shape, method, data) -> None:
    ndim = len(shape)
    a, b = data.draw(st.lists(st.integers(0, ndim - 1), min_size=2, max_size=2,
                              unique=True).map(tuple), label="matrix_axes")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(ndim), dtype=torch.float64)
    out, _ = opttx.orthogonalize(method=method, matrix_axes=(a, b)).update(
        {"x": x}, opttx.EmptyState())
    moved = torch.movedim(x, (a, b), (-2, -1))
    one = polar_factor if method == "svd" else (lambda m: newton_schulz(m, NS5))
    expected = torch.stack([one(m) for m in moved.reshape(-1, *moved.shape[-2:])])
    expected = torch.movedim(expected.reshape(moved.shape), (-2, -1), (a, b))
    assert_trees_close(out["x"], expected, rtol=1e-12, what=f"axes {(a, b)}")


def test_per_leaf_matrix_axes_and_none_leaves_a_leaf_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    tree = {"conv": torch.randn(4, 3, 2, generator=gen, dtype=torch.float64),
            "w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
            "b": torch.randn(3, generator=gen, dtype=torch.float64)}
    axes = {"conv": (0, 1), "w": (-2, -1), "b": None}
    out, _ = opttx.orthogonalize(matrix_axes=axes).update(tree, opttx.EmptyState())
    assert out["b"] is tree["b"]
    assert_trees_close(out["w"], newton_schulz(tree["w"], NS5), rtol=0.0)
    per_matrix = torch.stack([newton_schulz(tree["conv"][:, :, i], NS5) for i in range(2)], -1)
    assert_trees_close(out["conv"], per_matrix, rtol=1e-12)


def test_vectors_are_refused_clearly() -> None:
    tree = {"w": torch.randn(3, 3), "bias": torch.randn(3)}
    with pytest.raises(ValueError, match=r"\['bias'\] has 1 dim.*muon"):
        opttx.orthogonalize().init(tree)
    with pytest.raises(ValueError, match=r"\['bias'\] has 1 dim"):
        opttx.orthogonalize().update(tree, opttx.EmptyState())
    with pytest.raises(ValueError, match=r"\['bias'\] has 1 dim"):
        opttx.scale_by_shape().init(tree)
    with pytest.raises(ValueError, match="method"):
        opttx.orthogonalize(method="qr")
    with pytest.raises(ValueError, match="ns_coeffs"):
        opttx.orthogonalize(ns_coeffs=(1.0, 2.0))
    with pytest.raises(ValueError, match="ns_steps"):
        opttx.orthogonalize(ns_steps=0)
    with pytest.raises(ValueError, match="matrix_axes"):
        opttx.orthogonalize(matrix_axes=(0, 0)).init({"w": torch.randn(2, 2)})


def test_declared_traits_and_empty_state() -> None:
    """orthogonalize needs whole matrices; scale_by_shape reads only the whole shapes (which
    `opttx.distributed.sharded` knows), so it runs on local shards."""
    for tx, whole in ((opttx.orthogonalize(), True), (opttx.scale_by_shape(), False)):
        traits = opttx.extend.traits_of(tx)
        assert traits.whole_leaves is whole and traits.per_leaf and not traits.elementwise
        assert tx.init({"w": torch.zeros(2, 3)}) == opttx.EmptyState()


def test_per_step_coefficients() -> None:
    """A sequence of triples gives one (a, b, c) per step (optax's 'dion' style)."""
    g = {"w": torch.randn(4, 6, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)}
    coeffs = [(3.0, -3.2, 1.2), (2.8, -3.1, 1.2), NS_COEFFS]
    out, _ = opttx.orthogonalize(ns_coeffs=coeffs).update(g, opttx.EmptyState())
    assert torch.equal(out["w"], newton_schulz(g["w"], coeffs))
    assert not torch.equal(out["w"], newton_schulz(g["w"], [NS_COEFFS] * 3))


# ---------------------------------------------------------------------------------------------
# the alias: routing, compile
# ---------------------------------------------------------------------------------------------


def test_default_rule_routes_embeddings_heads_and_vectors_to_adamw() -> None:
    tree = {"model.embed_tokens.weight": torch.zeros(10, 4),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
            "model.layers.0.mlp.up_proj.bias": torch.zeros(8),
            "model.layers.0.attn.num_heads.weight": torch.zeros(4, 4),
            "transformer.wte.weight": torch.zeros(10, 4),
            "lm_head.weight": torch.zeros(10, 4),
            "conv.weight": torch.zeros(3, 2, 2, 2)}
    assert opttx.muon_hidden_matrices(tree) == {
        "model.embed_tokens.weight": False, "model.layers.0.mlp.up_proj.weight": True,
        "model.layers.0.mlp.up_proj.bias": False, "model.layers.0.attn.num_heads.weight": True,
        "transformer.wte.weight": False, "lm_head.weight": False, "conv.weight": False}
    state = opttx.muon(0.02).init(tree)
    muon_state = state.inner_states["muon"].inner_state[0].ema
    assert [k for k, v in muon_state.items() if isinstance(v, torch.Tensor)] == [
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.attn.num_heads.weight"]


def test_muon_mask_overrides_the_rule_for_3d_weights() -> None:
    """Stacked experts (E, out, in) selected by muon_mask: each expert's matrix is
    orthogonalized; the others run AdamW."""
    gen = torch.Generator().manual_seed(0)
    tree = {"experts": torch.randn(3, 6, 4, generator=gen, dtype=torch.float64),
            "bias": torch.randn(4, generator=gen, dtype=torch.float64)}
    grads = gradient_stream(tree, 3, seed=1)
    mask = {"experts": True, "bias": False}
    ours, _ = run_transform(opttx.muon(0.02, muon_mask=mask, bias_correction=False,
                                       nesterov=False, beta=0.0), tree, grads)
    # beta = 0: every step is x - lr * sqrt(6/4) * NS(g) per expert
    expected = tree["experts"].clone()
    for g in grads:
        expected -= 0.02 * math.sqrt(6 / 4) * torch.stack(
            [newton_schulz(m, NS5, 1e-8) for m in g["experts"]])
    assert_trees_close(ours["experts"], expected, rtol=1e-12)
    adam, _ = run_transform(opttx.adamw(0.02, eps=1e-8, weight_decay=0.0, nesterov=False),
                            {"bias": tree["bias"]}, [{"bias": g["bias"]} for g in grads])
    assert_trees_close(ours["bias"], adam["bias"], rtol=0.0)


@pytest.mark.parametrize("variant", ["optax", "torch_bf16", "svd"])
def test_train_step_compiles_to_one_graph(variant: str) -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = {"optax": lambda: opttx.muon(0.02, weight_decay=0.01),
          "torch_bf16": lambda: opttx.muon(0.02, bias_correction=False, ns_dtype=torch.bfloat16,
                                           consistent_rms=0.2),
          "svd": lambda: opttx.muon(0.02, method="svd")}[variant]()
    x, y = torch.randn(5, 8), torch.randn(5, 4)

    def step(p, s):
        g, _ = grad_and_value(
            lambda q: ((functional_call(model, q, (x,)) - y) ** 2).mean())(p)
        u, s = tx.update(g, s, p)
        return opttx.apply_updates(p, u), s

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    pe, se = params, tx.init(params)
    pc, sc = params, tx.init(params)
    for _ in range(4):
        pe, se = step(pe, se)
        pc, sc = compiled(pc, sc)
    assert counter.frame_count == 1
    assert_trees_close(pc, pe, rtol=1e-5)
    torch._dynamo.reset()
