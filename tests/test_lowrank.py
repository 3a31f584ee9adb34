"""GaLore: `galore_adamw` against galore_torch.GaLoreAdamW over several basis refreshes (every
projection type, both matrix orientations, masks, weight decay), the full-rank law, bases
kept on non-finite gradients, masks and named axes, moment re-projection against a float64
hand derivation, and one compiled graph over three refresh periods."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.testing import (assert_trees_close, gradient_stream, max_relative_error,
                           param_trees, run_transform)

PROJ_TYPES = ["std", "reverse_std", "left", "right", "full"]


def galore_reference(tree: dict, grads: list[dict], projected: dict, decayed: dict, *,
                     lr: float, rank: int, gap: int, scale: float, proj_type: str,
                     weight_decay: float, **adam) -> dict:
    """galore_torch.GaLoreAdamW with the projected leaves in a GaLore group and the others in
    plain groups; leaves outside ``decayed`` get weight_decay 0."""
    GaLoreAdamW = pytest.importorskip("galore_torch").GaLoreAdamW
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    groups = []
    for proj in (True, False):
        for decay in (True, False):
            names = [k for k in tree if projected[k] == proj and decayed[k] == decay]
            if not names:
                continue
            group = {"params": [params[k] for k in names],
                     "weight_decay": weight_decay if decay else 0.0}
            if proj:
                group.update(rank=rank, update_proj_gap=gap, scale=scale, proj_type=proj_type)
            groups.append(group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = GaLoreAdamW(groups, lr=lr, no_deprecation_warning=True, **adam)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def random_tree(seed: int, **shapes: tuple) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


# ---------------------------------------------------------------------------------------------
# galore_adamw == galore_torch.GaLoreAdamW
# ---------------------------------------------------------------------------------------------

# "tall" m > n, "wide" m < n, "square"; "excluded" is a matrix kept out of the projection,
# "bias" a vector: both run the same Adam at full size (the reference's plain group)
SHAPES = dict(tall=(12, 7), wide=(6, 10), square=(5, 5), excluded=(4, 6), bias=(5,))
PROJECTED = dict(tall=True, wide=True, square=True, excluded=False, bias=False)
DECAYED = dict(tall=True, wide=True, square=False, excluded=True, bias=False)


@pytest.mark.parametrize("proj_type", PROJ_TYPES)
@pytest.mark.parametrize("rank,gap,scale,weight_decay,correct_bias", [
    (3, 4, 0.25, 0.1, True),
    (2, 3, 1.0, 0.0, False),
])
def test_galore_adamw_equals_galore_torch(proj_type, rank, gap, scale, weight_decay,
                                          correct_bias) -> None:
    tree = random_tree(0, **SHAPES)
    steps = 2 * gap + 3                       # three refreshes: steps 0, gap, 2·gap
    grads = gradient_stream(tree, steps, seed=1)
    expected = galore_reference(tree, grads, PROJECTED, DECAYED, lr=1e-2, rank=rank, gap=gap,
                                scale=scale, proj_type=proj_type, weight_decay=weight_decay,
                                betas=(0.8, 0.99), eps=1e-6, correct_bias=correct_bias)
    tx = opttx.galore_adamw(1e-2, rank=rank, update_proj_gap=gap, scale=scale,
                            proj_type=proj_type, b1=0.8, b2=0.99, eps=1e-6,
                            weight_decay=weight_decay, correct_bias=correct_bias,
                            mask=DECAYED, projection_mask=PROJECTED)
    actual, state = run_transform(tx, tree, grads)
    assert_trees_close(actual, expected, rtol=1e-6, what="params")
    # the displacement itself (|x_T - x_0| ~ 1e-1 of |x|): rounding of x dominates, 1e-4 is it
    for k in tree:
        assert max_relative_error(actual[k] - tree[k], expected[k] - tree[k]) < 1e-4, k
    # the state is the low-rank one (k = min(rank, m, n)) where projected
    mu = state[0].inner_state.mu
    sides = {"std": ("right", "left"), "reverse_std": ("left", "right"), "left": ("left",) * 2,
             "right": ("right",) * 2, "full": ("full",) * 2}[proj_type]
    for name, side in zip(("tall", "wide"), sides):
        m, n = SHAPES[name]
        k = min(rank, m, n)
        assert mu[name].shape == {"right": (m, k), "left": (k, n), "full": (k, k)}[side]
    assert mu["excluded"].shape == SHAPES["excluded"] and mu["bias"].shape == (5,)


def test_galore_adamw_with_rank_above_the_small_side_equals_galore_torch() -> None:
    tree = random_tree(2, tall=(9, 3), wide=(2, 8))
    grads = gradient_stream(tree, 7, seed=3)
    everything = dict(tall=True, wide=True)
    expected = galore_reference(tree, grads, everything, everything, lr=1e-2, rank=5, gap=3,
                                scale=0.5, proj_type="std", weight_decay=0.01)
    tx = opttx.galore_adamw(1e-2, rank=5, update_proj_gap=3, scale=0.5, weight_decay=0.01)
    assert_trees_close(run_transform(tx, tree, grads)[0], expected, rtol=1e-6)


def test_opttx_optimizer_runs_galore_adamw_as_galore_torch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    tree = {k: v.detach().clone() for k, v in model.named_parameters()}
    projected = {k: v.dim() == 2 for k, v in tree.items()}
    opt = opttx.Optimizer(model.named_parameters(),
                          opttx.galore_adamw(1e-2, rank=2, update_proj_gap=2,
                                             weight_decay=0.1))
    gen = torch.Generator().manual_seed(4)
    grads = []
    for _ in range(5):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    expected = galore_reference(tree, grads, projected, dict.fromkeys(tree, True), lr=1e-2,
                                rank=2, gap=2, scale=0.25, proj_type="std", weight_decay=0.1)
    assert_trees_close({k: p.detach() for k, p in model.named_parameters()}, expected,
                       rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# laws
# ---------------------------------------------------------------------------------------------


MATRIX = st.tuples(st.integers(2, 6), st.integers(2, 6))
MOSTLY_MATRICES = st.one_of(MATRIX, MATRIX, MATRIX, st.lists(st.integers(1, 6), min_size=0,
                                                             max_size=3).map(tuple))


@given(drawn=param_trees(max_leaves=3, shape_strategy=MOSTLY_MATRICES),
       gap=st.integers(1, 4), momentum=st.sampled_from([0.5, 0.9]))
def test_full_rank_projection_equals_the_inner_transform(drawn, gap, momentum) -> None:
    """At rank >= min(m, n), "std" projects on the small side with a square orthogonal basis:
    a transform that is linear in the gradient history (momentum) gives the same updates, with
    its moment carried into each new basis. (Adam is not: its elementwise second moment
    depends on the basis, so no law ties GaLore-Adam at full rank to Adam.)"""
    tree, inner = drawn.tree, lambda: opttx.chain(opttx.trace(momentum), opttx.scale(-0.1))
    grads = gradient_stream(tree, 7, seed=drawn.seed + 1)
    tx = opttx.project_lowrank(inner(), rank=6, update_proj_gap=gap, reproject_moments=True)
    expected = run_transform(inner(), tree, grads)[0]
    assert_trees_close(run_transform(tx, tree, grads)[0], expected, rtol=1e-5, atol=1e-5)


@given(drawn=param_trees(max_leaves=2, shape_strategy=MATRIX))
def test_full_rank_std_projection_with_one_refresh_equals_the_linear_inner(drawn) -> None:
    """Without re-projection the moments stay in the coordinates of the first basis, which is
    only right while that basis lasts: one refresh (a gap longer than the run) suffices."""
    tree = drawn.tree
    grads = gradient_stream(tree, 5, seed=drawn.seed)
    inner = lambda: opttx.sgd(0.1, momentum=0.9)
    tx = opttx.project_lowrank(inner(), rank=6, update_proj_gap=100)
    assert_trees_close(run_transform(tx, tree, grads)[0], run_transform(inner(), tree, grads)[0],
                       rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# bases: refresh, keep on failure
# ---------------------------------------------------------------------------------------------


def test_bases_are_the_svd_of_the_gradient_at_each_refresh_only() -> None:
    tree = random_tree(5, w=(6, 4), v=(3, 7))
    grads = gradient_stream(tree, 5, seed=6)
    tx = opttx.project_lowrank(opttx.identity(), rank=2, update_proj_gap=2)
    state = tx.init(tree)
    for t, g in enumerate(grads):
        _, state = tx.update(g, state)
        last = grads[t - t % 2]                          # the gradient of the last refresh
        assert torch.equal(state.right["w"], torch.linalg.svd(last["w"])[2][:2])
        assert torch.equal(state.left["v"], torch.linalg.svd(last["v"])[0][:, :2])
    assert state.left["w"].numel() == 0 and state.right["v"].numel() == 0
    assert int(state.count) == 5


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_at_a_refresh_keeps_the_old_bases(bad) -> None:
    tree = random_tree(7, w=(5, 3), stack=(2, 4, 6))
    tx = opttx.project_lowrank(opttx.identity(), rank=2, update_proj_gap=1, proj_type="full",
                               mask=dict(w=True, stack=True))
    state = tx.init(tree)
    g0 = gradient_stream(tree, 1, seed=8)[0]
    _, state = tx.update(g0, state)
    g1 = gradient_stream(tree, 1, seed=9)[0]
    g1["w"][1, 2] = bad
    g1["stack"][1, 0, 0] = bad                           # only the second matrix of the batch
    out, new = tx.update(g1, state)
    assert torch.equal(new.left["w"], state.left["w"])
    assert torch.equal(new.right["w"], state.right["w"])
    assert torch.equal(new.left["stack"][1], state.left["stack"][1])
    assert torch.equal(new.right["stack"][1], state.right["stack"][1])
    u, _, vh = torch.linalg.svd(g1["stack"][0])
    assert torch.equal(new.left["stack"][0], u[:, :2]) and torch.equal(new.right["stack"][0],
                                                                      vh[:2])
    assert torch.isfinite(out["stack"][0]).all()


def test_a_leaf_whose_first_refresh_failed_stays_still_until_the_next() -> None:
    tx = opttx.project_lowrank(opttx.sgd(1.0), rank=1, update_proj_gap=2)
    state = tx.init({"w": torch.zeros(3, 2)})
    _, state = tx.update({"w": torch.full((3, 2), float("nan"))}, state)  # NaN out: user's
    assert torch.equal(state.right["w"], torch.zeros(1, 2))             # to skip (apply_if_finite)
    out, state = tx.update({"w": torch.ones(3, 2)}, state)
    assert torch.equal(out["w"], torch.zeros(3, 2))
    out, state = tx.update({"w": torch.ones(3, 2)}, state)             # refresh: moves again
    assert_trees_close(out["w"], -torch.ones(3, 2), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# which leaves, which axes
# ---------------------------------------------------------------------------------------------


def test_masks_choose_the_projected_leaves_and_the_rest_runs_the_inner_at_full_size() -> None:
    tree = random_tree(10, a=(6, 4), b=(5, 3), c=(4,), d=(2, 3, 4))
    grads = gradient_stream(tree, 4, seed=11)
    low = lambda mask, axes=(-2, -1): opttx.project_lowrank(
        opttx.scale_by_adam(), rank=2, update_proj_gap=2, mask=mask, matrix_axes=axes)
    default = low(None).init(tree).inner_state.mu                 # 2-D leaves only
    assert {k: tuple(v.shape) for k, v in default.items()} == dict(a=(6, 2), b=(5, 2), c=(4,),
                                                                    d=(2, 3, 4))
    as_tree = dict(a=False, b=True, c=False, d=False)
    as_fn = lambda p: {k: k == "b" for k in p}
    as_axes = dict(a=None, b=(0, 1), c=None, d=None)               # per-leaf axes, no mask
    plain_adam = run_transform(opttx.scale_by_adam(), tree, grads)[0]
    results = [run_transform(low(as_tree), tree, grads), run_transform(low(as_fn), tree, grads),
               run_transform(low(None, as_axes), tree, grads)]
    for params, state in results:
        mu = state.inner_state.mu
        assert mu["b"].shape == (5, 2) and mu["a"].shape == (6, 4)
        for k in "acd":
            assert torch.equal(params[k], plain_adam[k]), k
        assert not torch.allclose(params["b"], plain_adam["b"])
    assert_trees_close(results[1][0], results[0][0], rtol=0)
    assert_trees_close(results[2][0], results[0][0], rtol=0)


@pytest.mark.parametrize("axes", [(0, 2), (2, 0), (-1, 1)])
def test_named_axes_project_every_matrix_of_the_batch_on_its_own(axes) -> None:
    """A (4, 3, 5) leaf with matrix axes ``axes`` equals the independent 2-D matrices obtained
    by moving those axes last, each run through galore_adamw as a leaf of its own."""
    tree = random_tree(12, x=(4, 3, 5))
    grads = gradient_stream(tree, 6, seed=13)
    tx = lambda **kw: opttx.galore_adamw(1e-2, rank=2, update_proj_gap=2, scale=0.5,
                                         weight_decay=0.1, **kw)
    actual, _ = run_transform(tx(projection_mask={"x": True}, matrix_axes=axes), tree, grads)
    a, b = (ax % 3 for ax in axes)
    split = lambda t: {f"x{i}": m for i, m in enumerate(t.movedim((a, b), (-2, -1)).unbind(0))}
    expected, _ = run_transform(tx(), split(tree["x"]), [split(g["x"]) for g in grads])
    assert_trees_close(split(actual["x"]), expected, rtol=1e-6, atol=1e-7)


def test_bad_configurations_fail_early_with_the_argument_named() -> None:
    adam = opttx.scale_by_adam()
    with pytest.raises(ValueError, match="rank"):
        opttx.project_lowrank(adam, rank=0)
    with pytest.raises(ValueError, match="update_proj_gap"):
        opttx.project_lowrank(adam, rank=2, update_proj_gap=0)
    with pytest.raises(ValueError, match="proj_type"):
        opttx.project_lowrank(adam, rank=2, proj_type="diagonal")
    with pytest.raises(TypeError, match="factory"):
        opttx.project_lowrank(opttx.scale_by_adam, rank=2)
    with pytest.raises(ValueError, match=r"\['v'\] has 1 dims"):
        opttx.project_lowrank(adam, 2, mask={"v": True}).init({"v": torch.zeros(3)})
    with pytest.raises(ValueError, match="out of range"):
        opttx.project_lowrank(adam, 2, matrix_axes=(0, 3)).init({"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="same axis twice"):
        opttx.project_lowrank(adam, 2, matrix_axes=(1, -1)).init({"w": torch.zeros(3, 2)})


def test_16_bit_leaves_keep_float32_bases_and_moments() -> None:
    tree = {"w": torch.randn(6, 4).to(torch.bfloat16)}
    tx = opttx.galore_adamw(1e-2, rank=2, update_proj_gap=2)
    state = tx.init(tree)
    for g in gradient_stream(tree, 3, seed=14):
        out, state = tx.update(g, state, tree)
        assert out["w"].dtype == torch.bfloat16 and torch.isfinite(out["w"]).all()
    low = state[0]
    assert low.right["w"].dtype == torch.float32 and low.inner_state.mu["w"].dtype == torch.float32
    expected = torch.linalg.svd(g["w"].float())[2][:2]       # the last refresh (step 2)
    assert torch.equal(low.right["w"], expected)


# ---------------------------------------------------------------------------------------------
# re-projection of the inner moments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("proj_type,shape", [("std", (5, 3)), ("std", (3, 6)),
                                             ("full", (5, 4))])
def test_reprojected_moments_equal_a_hand_derivation(proj_type, shape) -> None:
    """float64, gap 2, three steps: moments rotate at step 2 with C_L = P_L'ᵀ P_L,
    C_R = P_R P_R'ᵀ; the second moment with the squared entries of C."""
    b1, b2, eps = 0.9, 0.99, 1e-8
    gen = torch.Generator().manual_seed(15)
    g = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    k = 2
    m, n = shape
    side = "full" if proj_type == "full" else ("right" if m >= n else "left")

    def bases(x):
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        return u[:, :k], vh[:k]

    def project(x, pl, pr):
        return x @ pr.T if side == "right" else pl.T @ x if side == "left" else pl.T @ x @ pr.T

    pl, pr = bases(g[0])
    mu = torch.zeros_like(project(g[0], pl, pr))
    nu = torch.zeros_like(mu)
    for t in range(3):
        if t == 2:
            ql, qr = bases(g[2])
            cl, cr = ql.T @ pl, pr @ qr.T
            if side == "right":
                mu, nu = mu @ cr, nu @ (cr * cr)
            elif side == "left":
                mu, nu = cl @ mu, (cl * cl) @ nu
            else:
                mu, nu = cl @ mu @ cr, (cl * cl) @ nu @ (cr * cr)
            pl, pr = ql, qr
        r = project(g[t], pl, pr)
        mu = b1 * mu + (1 - b1) * r
        nu = b2 * nu + (1 - b2) * r * r
    tx = opttx.project_lowrank(opttx.scale_by_adam(b1, b2, eps), rank=k, update_proj_gap=2,
                               proj_type=proj_type, reproject_moments=True)
    state = tx.init({"w": g[0]})
    for gt in g:
        out, state = tx.update({"w": gt}, state)
    assert_trees_close(state.inner_state.mu["w"], mu, rtol=1e-12)
    assert_trees_close(state.inner_state.nu["w"], nu, rtol=1e-12)
    assert (state.inner_state.nu["w"] >= 0).all()
    step = (mu / (1 - b1**3)) / (torch.sqrt(nu / (1 - b2**3)) + eps)
    back = step @ pr if side == "right" else pl @ step if side == "left" else pl @ step @ pr
    assert_trees_close(out["w"], back, rtol=1e-10)


def test_reprojection_finds_moments_in_nested_states_and_leaves_the_rest() -> None:
    """Statistics trees anywhere in the inner state (a chain, a named_chain) are carried;
    counts and full-size statistics of unprojected leaves are not touched."""
    tree = random_tree(16, w=(6, 3), b=(3,))
    grads = gradient_stream(tree, 3, seed=17)
    inner = opttx.named_chain(("m", opttx.trace(0.9)),
                              ("adam", opttx.chain(opttx.scale_by_adam())))
    kw = dict(rank=2, update_proj_gap=2)
    on = opttx.project_lowrank(inner, reproject_moments=True, **kw)
    off = opttx.project_lowrank(inner, **kw)
    s_on, s_off = on.init(tree), off.init(tree)
    for g in grads[:2]:
        _, s_on = on.update(g, s_on)
        _, s_off = off.update(g, s_off)
    # no refresh after step 0 yet (the states differ only in their makers' records)
    assert s_on.made_by != s_off.made_by
    assert_trees_close(s_on._replace(made_by=s_off.made_by), s_off, rtol=0)
    _, s_on = on.update(grads[2], s_on)
    _, s_off = off.update(grads[2], s_off)
    old_r, new_r = s_off.right["w"], s_on.right["w"]
    assert torch.equal(old_r, new_r)                    # same bases either way
    trace_on, trace_off = s_on.inner_state["m"].trace, s_off.inner_state["m"].trace
    assert torch.equal(trace_on["b"], trace_off["b"])
    assert not torch.allclose(trace_on["w"], trace_off["w"])
    adam_on, adam_off = s_on.inner_state["adam"][0], s_off.inner_state["adam"][0]
    assert torch.equal(adam_on.count, adam_off.count) and torch.equal(adam_on.nu["b"],
                                                                      adam_off.nu["b"])
    assert not torch.allclose(adam_on.nu["w"], adam_off.nu["w"])


# ---------------------------------------------------------------------------------------------
# compile: the refresh lives inside one graph
# ---------------------------------------------------------------------------------------------


def test_galore_train_step_is_one_graph_over_three_refresh_periods() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.func import functional_call, grad_and_value
    torch._dynamo.reset()
    gap = 3
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    schedule = opttx.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=9)
    tx = opttx.galore_adamw(schedule, rank=3, update_proj_gap=gap, weight_decay=0.1,
                            mask=lambda p: {k: v.dim() == 2 for k, v in p.items()},
                            reproject_moments=True)
    state = tx.init(params)

    def loss_fn(params, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    def step(params, state, x, y):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return opttx.apply_updates(params, updates), state

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    eager_params, eager_state = params, state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3 * gap):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            params, state = compiled(params, state, x, y)
            eager_params, eager_state = step(eager_params, eager_state, x, y)
    cached = torch._dynamo.eval_frame._debug_get_cache_entry_list(step.__code__)
    assert len(cached) == 1 and counter.frame_count == 1
    assert_trees_close(params, eager_params, rtol=1e-5)
    assert_trees_close(state, eager_state, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_reproject_without_statistics_to_rotate_is_refused() -> None:
    params = {"w": torch.randn(8, 6)}
    with pytest.raises(ValueError, match="no statistic"):
        opttx.project_lowrank(opttx.quantize_state(opttx.scale_by_adam(), min_size=1), rank=2,
                              reproject_moments=True).init(params)
    with pytest.raises(ValueError, match="no statistic"):
        opttx.project_lowrank(opttx.scale_by_sign(), rank=2, reproject_moments=True).init(params)
