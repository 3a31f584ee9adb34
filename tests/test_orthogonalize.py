"""Fast and exact orthogonalization: Polar Express, Gram Newton–Schulz,
batching across leaves, row-block splits, output layout, an overflow-free norm, and
`muon`'s default mask.

* every iterative method keeps the polar factor of the SVD and maps the singular values into
  its band (normalised singular values >= 2e-3, float64: Newton–Schulz [0.68, 1.21], Polar
  Express [0.85, 1.15], its composed polynomials' range there being [0.859, 1.141]);
* Gram Newton–Schulz is the Newton–Schulz iterate (float64, <= 1e-12 relative; measured
  ~4e-15 on 64 x 64 to 256 x 1024);
* batched over same-shaped matrices (across leaves, heads and batch axes) equals one matrix
  at a time (float64 <= 1e-12; float32 <= 1e-4);
* ``split`` orthogonalizes each row block as a separate matrix, and `scale_by_shape` scales
  each block by its own shape factor;
* a tall matrix comes back contiguous, a leaf with other matrix axes in its own strides, so
  ``MultiSteps(muon)`` and ``apply_if_finite(muon)`` compile with a tall matrix (they failed
  with "The sorted order of strides of the two branches' output doesn't match");
* one gradient of 1e30 no longer stops Muon: the norm is taken of the matrix scaled by a
  power of two (before, 452 of the next 599 updates were exactly 0);
* embeddings named ``tok_emb``/``pos_emb`` go to AdamW.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import functional_call, grad_and_value

import opttx
from dion_reference import dion
from opttx.testing import assert_trees_close
from opttx.transforms.orthogonalize import (NS_COEFFS, POLAR_EXPRESS_COEFFS,
                                            gram_newton_schulz, newton_schulz,
                                            normalize_frobenius, polar_factor)

NS5 = [NS_COEFFS] * 5
METHODS = ["newton_schulz", "polar_express", "gram_newton_schulz", "svd"]


def ortho(x: dict, **kw) -> dict:
    return opttx.orthogonalize(**kw).update(x, opttx.EmptyState())[0]


@st.composite
def conditioned(draw, max_dim: int = 24, scales=(1e-3, 1.0, 1e3, 1e30)):
    """U diag(s) Vᵀ (float64), singular values in [0.01, 1] times a scale: every normalised
    singular value s / ||s|| is at least 2e-3 (scales above eps = 1e-7, which would shrink
    the result, unless given)."""
    m, n = draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from(scales))
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    s = 10 ** (-2 * torch.rand(k, generator=gen, dtype=torch.float64))
    return scale * (u * s) @ v.T


# ---------------------------------------------------------------------------------------------
# each method against SVD's exact polar factor
# ---------------------------------------------------------------------------------------------

# the composed polynomials' range over normalised singular values in [2e-3, 1] (evaluated on
# 20,001 points): Newton–Schulz [0.682, 1.202], Polar Express [0.859, 1.141]
BANDS = {"newton_schulz": (0.68, 1.21), "polar_express": (0.85, 1.15),
         "gram_newton_schulz": (0.68, 1.21)}


@settings(max_examples=40, deadline=None)
@given(g=conditioned(), method=st.sampled_from(list(BANDS)))
def test_each_method_keeps_the_polar_factor_in_its_band(g, method) -> None:
    exact = polar_factor(g)
    out = ortho({"g": g}, method=method)["g"]
    sv = torch.linalg.svdvals(out)
    lo, hi = BANDS[method]
    assert sv.min() >= lo and sv.max() <= hi, (method, sv)
    # U p(Σ) Vᵀ: its own polar factor is the exact one
    assert torch.allclose(polar_factor(out), exact, atol=1e-9), method


@settings(max_examples=30, deadline=None)
@given(g=conditioned(32), coeffs=st.sampled_from([NS5, POLAR_EXPRESS_COEFFS]),
       restarts=st.sampled_from([(), (2,), (1, 3)]))
def test_gram_newton_schulz_is_the_newton_schulz_iterate(g, coeffs, restarts) -> None:
    ns = newton_schulz(g, coeffs, 1e-7)
    gram = gram_newton_schulz(g, coeffs, 1e-7, restarts=restarts)
    assert_trees_close(gram, ns, rtol=1e-12, atol=1e-12, what=str(restarts))


def test_polar_express_is_the_dion_packages_iteration_in_float64() -> None:
    """The coefficients and the 1.02 safety factor of Microsoft's dion package (read from
    its module); its loop, transcribed without the bfloat16 cast, gives our numbers."""
    dion_pe = dion("dion.polar_express")
    assert tuple(map(tuple, dion_pe._POLAR_EXPRESS_COEFFS)) == POLAR_EXPRESS_COEFFS
    gen = torch.Generator().manual_seed(0)
    for shape in [(6, 10), (10, 6), (7, 7)]:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        y = x / (x.norm() * 1.02 + 1e-7)
        for a, b, c in dion_pe._POLAR_EXPRESS_COEFFS:
            A = y @ y.mT if shape[0] <= shape[1] else y.mT @ y
            B = b * A + c * (A @ A)
            y = a * y + (B @ y if shape[0] <= shape[1] else y @ B)
        ours = ortho({"x": x}, method="polar_express")["x"]
        assert_trees_close(ours, y, rtol=1e-13, atol=1e-14, what=str(shape))


# ---------------------------------------------------------------------------------------------
# batched = per matrix; splits
# ---------------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 9), count=st.integers(1, 4),
       method=st.sampled_from(METHODS), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
def test_batched_equals_per_matrix(m, n, count, method, dtype, seed) -> None:
    """Leaves of one shape, a 4-D leaf of that matrix shape and another shape: one batched
    product per shape group equals one matrix at a time."""
    gen = torch.Generator().manual_seed(seed)
    tree = {f"w{i}": torch.randn(m, n, generator=gen, dtype=dtype) for i in range(count)}
    tree["stack"] = torch.randn(2, 3, m, n, generator=gen, dtype=dtype)
    tree["other"] = torch.randn(n + 1, m, generator=gen, dtype=dtype)
    batched = ortho(tree, method=method)
    single = ortho(tree, method=method, batched=False)
    # float32: Polar Express's first polynomial (coefficients up to 22) turns float32 rounding
    # into differences of ~2e-5 between two summation orders (measured on 2 x 1 matrices)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert_trees_close(batched, single, rtol=tol, atol=tol, what=method)
    for k, x in tree.items():   # and each is the function on its matrices
        if method != "svd":
            fn = {"newton_schulz": lambda a: newton_schulz(a, NS5),
                  "polar_express": lambda a: newton_schulz(a, POLAR_EXPRESS_COEFFS,
                                                           norm_scale=1.02),
                  "gram_newton_schulz": lambda a: gram_newton_schulz(a, NS5)}[method]
            assert_trees_close(batched[k], fn(x), rtol=tol, atol=tol, what=k)


def test_one_batched_product_per_shape_group() -> None:
    """Six same-shaped leaves and a stack of four take the matrix products of one matrix
    (3 per Newton–Schulz step); one matrix at a time, ten times as many."""
    calls = {"n": 0}

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul,
                        torch.baddbmm, torch.addmm, torch.bmm, torch.mm):
                calls["n"] += 1
            return func(*args, **(kwargs or {}))

    def count(tree, **kw):
        calls["n"] = 0
        with Count():
            ortho(tree, **kw)
        return calls["n"]

    tree = {f"w{i}": torch.randn(8, 16) for i in range(6)}
    tree["stack"] = torch.randn(4, 8, 16)
    one = count({"w0": tree["w0"]})
    assert one == 15
    assert count(tree) == one
    assert count(tree, batched=False) == 10 * one


@pytest.mark.parametrize("method", METHODS)
def test_split_orthogonalizes_each_block(method) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(4 + 2 + 2, 6, generator=gen, dtype=torch.float64)   # GQA-like
    heads = torch.randn(3, 12, 5, generator=gen, dtype=torch.float64)     # 4 heads of 3 rows
    out = ortho({"qkv": qkv, "heads": heads}, method=method,
                split={"qkv": (4, 2, 2), "heads": 4})
    one = lambda x: ortho({"x": x}, method=method)["x"]   # noqa: E731
    expected_qkv = torch.cat([one(b) for b in qkv.split([4, 2, 2])])
    expected_heads = torch.stack([torch.cat([one(b) for b in h.split(3)]) for h in heads])
    assert_trees_close(out["qkv"], expected_qkv, rtol=1e-12, atol=1e-12)
    assert_trees_close(out["heads"], expected_heads, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out["qkv"], one(qkv))


def test_scale_by_shape_takes_each_blocks_factor() -> None:
    x = {"qkv": torch.ones(8, 4, dtype=torch.float64)}
    out = opttx.scale_by_shape(split={"qkv": (4, 2, 2)}).update(x, opttx.EmptyState())[0]
    assert torch.equal(out["qkv"][:4], torch.ones(4, 4, dtype=torch.float64))   # 4 x 4: 1
    assert torch.equal(out["qkv"][4:], torch.ones(4, 4, dtype=torch.float64))   # 2 x 4: 1
    out = opttx.scale_by_shape(split=2, convention="spectral").update(
        {"w": torch.ones(8, 2, dtype=torch.float64)}, opttx.EmptyState())[0]
    assert torch.allclose(out["w"], torch.full((8, 2), math.sqrt(4 / 2), dtype=torch.float64))
    out = opttx.scale_by_shape(split=(2, 6), convention="spectral").update(
        {"w": torch.ones(8, 2, dtype=torch.float64)}, opttx.EmptyState())[0]
    assert torch.allclose(out["w"][:2], torch.ones(2, 2, dtype=torch.float64))
    assert torch.allclose(out["w"][2:], torch.full((6, 2), math.sqrt(3.0), dtype=torch.float64))


def test_split_errors_name_the_leaf() -> None:
    with pytest.raises(ValueError, match=r"\['w'\].*split=3.*7 rows"):
        opttx.orthogonalize(split=3).init({"w": torch.zeros(7, 2)})
    with pytest.raises(ValueError, match=r"split sizes \(3, 3\) add up to 6"):
        opttx.orthogonalize(split={"w": (3, 3)}).init({"w": torch.zeros(7, 2)})
    with pytest.raises(ValueError, match="split"):
        opttx.orthogonalize(split=0)
    with pytest.raises(ValueError, match="polar_express"):
        opttx.orthogonalize(method="polar_express", ns_coeffs=(1.0, 2.0, 3.0))


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_outputs_have_the_inputs_layout(method) -> None:
    gen = torch.Generator().manual_seed(0)
    tree = {"tall": torch.randn(9, 4, generator=gen), "wide": torch.randn(4, 9, generator=gen),
            "conv": torch.randn(6, 3, 2, 2, generator=gen),
            "t_view": torch.randn(4, 9, generator=gen).T}     # a transposed input stays so
    out = ortho(tree, method=method, matrix_axes={"tall": (-2, -1), "wide": (-2, -1),
                                                  "conv": (0, 1), "t_view": (-2, -1)})
    for k, x in tree.items():
        assert out[k].stride() == x.stride(), (k, out[k].stride(), x.stride())


@pytest.mark.parametrize("wrapper", ["MultiSteps", "apply_if_finite"])
def test_muon_with_a_tall_matrix_compiles_under_a_cond_wrapper(wrapper) -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.ReLU(), torch.nn.Linear(9, 3))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    inner = opttx.muon(0.02, weight_decay=0.01)
    tx = (opttx.MultiSteps(inner, 2).gradient_transformation() if wrapper == "MultiSteps"
          else opttx.apply_if_finite(inner, 3))
    x, y = torch.randn(5, 4), torch.randn(5, 3)

    def step(p, s):
        g, _ = grad_and_value(lambda q: ((functional_call(model, q, (x,)) - y) ** 2).mean())(p)
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
    assert not torch.equal(pe["0.weight"], params["0.weight"])
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# the norm
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(g=conditioned(scales=(1e-20, 1e-3, 1.0, 1e3, 1e30)),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_normalization_is_the_naive_formula_where_that_does_not_overflow(g, dtype) -> None:
    x = g.to(dtype)
    finfo = torch.finfo(torch.float32 if dtype == torch.bfloat16 else dtype)
    ours = normalize_frobenius(x, 1e-7)
    assert torch.isfinite(ours).all()
    naive_norm = x.float().norm() if dtype == torch.bfloat16 else x.norm()
    if math.isfinite(float(naive_norm)) and float(naive_norm) > finfo.tiny * 1e8:
        naive = x / (x.norm() + 1e-7)
        assert torch.equal(ours, naive), dtype
    # and |X / ||X||| has Frobenius norm 1 wherever eps is negligible
    if float(x.abs().max()) > 1e-3:
        assert abs(float(ours.double().norm()) - 1) < 0.02


def test_one_huge_gradient_does_not_stop_muon() -> None:
    """A gradient of 1e30 in float32: before, the norm overflowed to inf and the update was
    exactly 0 for hundreds of steps (while the momentum decayed); now every update moves."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=gen)}
    grads = [{"w": torch.randn(16, 8, generator=gen)} for _ in range(60)]
    grads[0] = {"w": grads[0]["w"] * 1e30}
    tx = opttx.muon(0.02, muon_mask=True, bias_correction=False)
    state = tx.init(params)
    zero_updates = 0
    for g in grads:
        u, state = tx.update(g, state, params)
        assert torch.isfinite(u["w"]).all()
        zero_updates += int(bool((u["w"] == 0).all()))
        params = opttx.apply_updates(params, u)
    assert zero_updates == 0
    # the direction of the huge step is the orthogonalized gradient, as for any scale
    out = ortho({"w": grads[0]["w"]})["w"]
    assert_trees_close(out, ortho({"w": grads[0]["w"] / 1e30})["w"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the default mask
# ---------------------------------------------------------------------------------------------


def test_token_and_position_embeddings_are_not_hidden_matrices() -> None:
    from opttx.bench.model import GPT, GPTConfig
    params = dict(GPT(GPTConfig(n_layers=1)).named_parameters())
    mask = opttx.muon_hidden_matrices(params)
    assert mask["tok_emb.weight"] is False and mask["pos_emb.weight"] is False
    assert mask["blocks.0.attn.qkv.weight"] is True and mask["blocks.0.mlp.fc.weight"] is True
    assert opttx.muon_hidden_matrices({"token_embedding": torch.zeros(3, 2),
                                       "wpos": torch.zeros(3, 2)}) == {
        "token_embedding": False, "wpos": True}
