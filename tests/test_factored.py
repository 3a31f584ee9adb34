"""Adafactor, CAME, LAMB and LARS against their references: transformers.Adafactor,
torch.optim.Adafactor and came_pytorch.CAME over 30 steps (parameters and factored
statistics, float32 relative error <= 1e-5), and float64 re-derivations of LAMB and LARS."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform

STEPS = 30
SHAPES = st.one_of(
    st.lists(st.integers(1, 7), min_size=1, max_size=1),                      # vectors
    st.tuples(st.just(1), st.integers(2, 7)), st.tuples(st.integers(2, 7), st.just(1)),
    st.lists(st.integers(1, 6), min_size=2, max_size=4),                      # 2-D to 4-D
).map(tuple)
TREES = param_trees(min_leaves=1, max_leaves=3, shape_strategy=SHAPES)


def run_reference(make_opt, tree: dict, grads: list[dict]):
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = make_opt(list(params.values()))
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}, {k: opt.state[p] for k, p in params.items()}


def factored_stats(state, tree: dict) -> dict:
    """Our statistics per leaf under the reference's names."""
    out = {}
    for k, p in tree.items():
        if p.dim() >= 2:
            out[k] = {"exp_avg_sq_row": state.v_row[k], "exp_avg_sq_col": state.v_col[k]}
        else:
            out[k] = {"exp_avg_sq": state.v[k]}
    return out


# ---------------------------------------------------------------------------------------------
# Adafactor
# ---------------------------------------------------------------------------------------------

HF_CONFIGS = [dict(relative_step=rs, warmup_init=wi, scale_parameter=sp, beta1=b1, wd=wd)
              for rs, wi, sp, b1, wd in itertools.product([True, False], [False, True],
                                                          [True, False], [None, 0.9],
                                                          [0.0, 0.1])
              if rs or not wi]


def hf_id(c: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in c.items())


@pytest.mark.parametrize("config", HF_CONFIGS, ids=[hf_id(c) for c in HF_CONFIGS])
def test_adafactor_equals_transformers(config: dict) -> None:
    Adafactor = pytest.importorskip("transformers.optimization").Adafactor

    lr = None if config["relative_step"] else 1e-2

    @given(drawn=TREES)
    def prop(drawn):
        tree = drawn.tree
        grads = gradient_stream(tree, STEPS, seed=drawn.seed + 1)
        expected, ref_state = run_reference(
            lambda ps: Adafactor(ps, lr=lr, relative_step=config["relative_step"],
                                 warmup_init=config["warmup_init"],
                                 scale_parameter=config["scale_parameter"],
                                 beta1=config["beta1"], weight_decay=config["wd"]),
            tree, grads)
        tx = opttx.adafactor(lr, min_dim_size_to_factor=1, momentum=config["beta1"],
                             weight_decay_rate=config["wd"],
                             multiply_by_parameter_scale=config["scale_parameter"],
                             relative_step=config["relative_step"],
                             warmup_init=config["warmup_init"], factor_axes="last",
                             weight_decay_scaled_by_lr=True)
        actual, state = run_transform(tx, tree, grads)
        assert_trees_close(actual, expected, rtol=1e-5, what="params")
        ours = factored_stats(state[0], tree)
        theirs = {k: {name: ref_state[k][name] for name in ours[k]} for k in tree}
        assert_trees_close(ours, theirs, rtol=1e-5, what="statistics")
        if config["beta1"] is not None:
            momentum = next(s for s in state if isinstance(s, opttx.EmaState)).ema
            # the momentum averages steps of size ~1e-2·|x| whose signs cancel; where they do,
            # float32 rounding of the parameters shows as relative noise: bound it absolutely
            assert_trees_close(momentum, {k: ref_state[k]["exp_avg"] for k in tree},
                               rtol=1e-5, atol=1e-9, what="momentum")

    prop()


@pytest.mark.parametrize("wd", [0.0, 0.1])
@given(drawn=TREES)
def test_adafactor_equals_torch_optim_adafactor(wd, drawn) -> None:
    tree, lr = drawn.tree, 1e-2
    grads = gradient_stream(tree, STEPS, seed=drawn.seed + 1)
    expected, ref_state = run_reference(
        lambda ps: torch.optim.Adafactor(ps, lr=lr, weight_decay=wd, foreach=False), tree, grads)
    tx = opttx.adafactor(opttx.relative_step_schedule(lr), min_dim_size_to_factor=1,
                         weight_decay_rate=lr * wd, eps=0.0,
                         eps_clamp=torch.finfo(torch.float32).eps, factor_axes="last")
    actual, state = run_transform(tx, tree, grads)
    assert_trees_close(actual, expected, rtol=1e-5, what="params")
    for k, p in tree.items():
        if p.dim() >= 2:
            assert_trees_close(state[0].v_row[k], ref_state[k]["row_var"].squeeze(-1),
                               rtol=1e-5, what=f"row_var[{k}]")
            assert_trees_close(state[0].v_col[k], ref_state[k]["col_var"].squeeze(-2),
                               rtol=1e-5, what=f"col_var[{k}]")
        else:
            assert_trees_close(state[0].v[k], ref_state[k]["variance"], rtol=1e-5)


def test_adafactor_factors_as_optax_by_default() -> None:
    params = {"emb": torch.zeros(300, 128), "small": torch.zeros(64, 200),
              "conv": torch.zeros(256, 3, 3, 512), "bias": torch.zeros(512)}
    # (second largest, largest) as optax: rows average over the largest dim
    assert opttx.factored_axes(params) == [(1, 0), None, (0, 3), None]
    assert opttx.factored_axes(params, "last", 1) == [(0, 1), (0, 1), (2, 3), None]
    state = opttx.adafactor(1e-2).init(params)[0]
    assert state.v_row["emb"].shape == (128,) and state.v_col["emb"].shape == (300,)
    assert state.v["small"].shape == (64, 200) and state.v_row["small"].numel() == 0
    assert state.v_row["conv"].shape == (256, 3, 3) and state.v_col["conv"].shape == (3, 3, 512)


def test_factored_statistics_are_fp32_for_bf16() -> None:
    params = {"w": torch.randn(8, 6).bfloat16(), "b": torch.randn(6).bfloat16()}
    tx = opttx.adafactor(1e-2, min_dim_size_to_factor=1, momentum=0.9)
    state = tx.init(params)
    updates, state = tx.update({k: torch.randn_like(v) for k, v in params.items()}, state,
                               params)
    assert all(u.dtype == torch.bfloat16 for u in updates.values())
    assert state[0].v_row["w"].dtype == torch.float32 and state[0].v["b"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# CAME
# ---------------------------------------------------------------------------------------------

CAME_SHAPES = st.one_of(st.lists(st.integers(1, 7), min_size=1, max_size=1),
                        st.lists(st.integers(1, 7), min_size=2, max_size=2)).map(tuple)


@pytest.mark.parametrize("wd", [0.0, 0.1])
@given(drawn=param_trees(min_leaves=1, max_leaves=3, shape_strategy=CAME_SHAPES))
def test_came_equals_came_pytorch(wd, drawn) -> None:
    CAME = pytest.importorskip("came_pytorch").CAME

    tree, lr = drawn.tree, 1e-3
    grads = gradient_stream(tree, STEPS, seed=drawn.seed + 1)
    expected, ref_state = run_reference(lambda ps: CAME(ps, lr=lr, weight_decay=wd), tree,
                                        grads)
    actual, state = run_transform(opttx.came(lr, weight_decay=wd), tree, grads)
    assert_trees_close(actual, expected, rtol=1e-5, what="params")
    came_state = state[0]
    for k, p in tree.items():
        names = {"mu": "exp_avg"}
        if p.dim() >= 2:
            names.update(v_row="exp_avg_sq_row", v_col="exp_avg_sq_col",
                         r_row="exp_avg_res_row", r_col="exp_avg_res_col")
        else:
            names.update(v="exp_avg_sq")
        for ours, theirs in names.items():
            # mu is an EMA of updates whose RMS CAME clips to 1: its float32 rounding is
            # absolute (terms of order 1), not relative to a final value the terms may cancel
            # down to (a drawn 1-D leaf of mu at 7e-3 was 1.07e-7 from came_pytorch, itself
            # 8.3e-8 from a float64 run, and opttx's 2.4e-8): atol 1e-6 there
            assert_trees_close(getattr(came_state, ours)[k], ref_state[k][theirs], rtol=1e-5,
                               atol=1e-6 if ours == "mu" else 0.0, what=f"{ours}[{k}]")


def test_came_keeps_instability_statistics_apart_from_the_second_moment() -> None:
    params = {"w": torch.randn(5, 4)}
    tx = opttx.came(1e-3)
    state = tx.init(params)
    for g in gradient_stream(params, 3):
        _, state = tx.update(g, state, params)
    s = state[0]
    assert s.r_row["w"].data_ptr() != s.v_row["w"].data_ptr()
    assert not torch.allclose(s.r_row["w"], s.v_row["w"])


# ---------------------------------------------------------------------------------------------
# LAMB and LARS against float64 re-derivations
# ---------------------------------------------------------------------------------------------


def lamb_reference(tree, grads, lr, b1, b2, eps, wd, bias_correction, excluded=()):
    x = {k: v.clone() for k, v in tree.items()}
    m = {k: torch.zeros_like(v) for k, v in tree.items()}
    v = {k: torch.zeros_like(t) for k, t in tree.items()}
    for t, g in enumerate(grads, start=1):
        for k in x:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mh = m[k] / (1 - b1**t) if bias_correction else m[k]
            vh = v[k] / (1 - b2**t) if bias_correction else v[k]
            r = mh / (vh.sqrt() + eps) + wd * x[k]
            pn, rn = x[k].norm(), r.norm()
            ratio = 1.0 if (k in excluded or pn == 0 or rn == 0) else pn / rn
            x[k] = x[k] - lr * ratio * r
    return x


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("exclude", [False, True])
@given(drawn=param_trees(dtypes=(torch.float64,)), wd=st.sampled_from([0.0, 0.01]))
def test_lamb_equals_the_paper(bias_correction, exclude, drawn, wd) -> None:
    tree = drawn.tree
    grads = gradient_stream(tree, 10, seed=drawn.seed + 1)
    excluded = {k for k, v in tree.items() if v.dim() <= 1} if exclude else set()
    mask = {k: k not in excluded for k in tree}
    expected = lamb_reference(tree, grads, 1e-2, 0.9, 0.999, 1e-6, wd, bias_correction,
                              excluded)
    tx = opttx.lamb(1e-2, weight_decay=wd, bias_correction=bias_correction,
                    trust_ratio_mask=mask)
    actual, _ = run_transform(tx, tree, grads)
    assert_trees_close(actual, expected, rtol=1e-10)


@pytest.mark.parametrize("nesterov", [False, True])
@given(drawn=param_trees(dtypes=(torch.float64,)), wd=st.sampled_from([0.0, 1e-4]))
def test_lars_equals_its_formula(nesterov, drawn, wd) -> None:
    tree, lr, tc, mom = drawn.tree, 0.1, 0.001, 0.9
    grads = gradient_stream(tree, 10, seed=drawn.seed + 1)
    x = {k: v.clone() for k, v in tree.items()}
    buf = {k: torch.zeros_like(v) for k, v in tree.items()}
    for g in grads:
        for k in x:
            d = g[k] + wd * x[k]
            pn, dn = x[k].norm(), d.norm()
            ratio = 1.0 if (pn == 0 or dn == 0) else tc * pn / dn
            u = -lr * ratio * d
            buf[k] = u + mom * buf[k]
            x[k] = x[k] + (u + mom * buf[k] if nesterov else buf[k])
    actual, _ = run_transform(opttx.lars(lr, weight_decay=wd, nesterov=nesterov), tree, grads)
    assert_trees_close(actual, x, rtol=1e-10)


def test_trust_ratio_is_one_for_zero_norms_and_clips_phi() -> None:
    params = {"zero": torch.zeros(3), "w": torch.full((4,), 10.0)}
    updates = {"zero": torch.ones(3), "w": torch.ones(4)}
    tx = opttx.scale_by_trust_ratio(phi_bounds=(0.0, 2.0))
    out, _ = tx.update(updates, tx.init(params), params)
    assert torch.equal(out["zero"], torch.ones(3))
    assert torch.allclose(out["w"], torch.full((4,), 2.0 / 2.0))   # phi = min(20, 2), |u| = 2


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build,match", [
    (lambda: opttx.scale_by_factored_rms(decay_rate=0.0), r"decay_rate must be in \(0, 1\]"),
    (lambda: opttx.scale_by_factored_rms(decay_rate=-0.8), "transformers' -0.8 is 0.8"),
    (lambda: opttx.adafactor(decay_rate=1.5), r"decay_rate must be in \(0, 1\]"),
    (lambda: opttx.clip_by_rms(-1.0), "threshold must be > 0"),
    (lambda: opttx.adafactor(clipping_threshold=0.0), "threshold must be > 0"),
    (lambda: opttx.came(1e-3, clip_threshold=-1.0), "clip_threshold must be > 0"),
    (lambda: opttx.came(1e-3, b3=1.0), r"b3 must be in \[0, 1\)"),
    (lambda: opttx.adafactor(1e-2, relative_step=True), "do not also pass learning_rate"),
    (lambda: opttx.adafactor(1e-2, warmup_init=True), "requires relative_step"),
    (lambda: opttx.scale_by_trust_ratio(phi_bounds=(2.0, 1.0)), "phi_bounds"),
    (lambda: opttx.scale_by_param_block_rms(-1.0), "min_scale must be >= 0"),
])
def test_invalid_factored_hyperparameters_raise(build, match) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_factoring_a_0d_tensor_raises() -> None:
    params = {"scale": torch.tensor(1.0), "w": torch.ones(4, 4)}
    tx = opttx.scale_by_factored_rms(factor_axes={"scale": (0, 1), "w": (0, 1)})
    with pytest.raises(ValueError, match=r"Cannot factor the 0-d tensor params\['scale'\]"):
        tx.init(params)
    with pytest.raises(ValueError, match="factor_axes must be"):
        opttx.scale_by_factored_rms(factor_axes="first").init(params)


def test_axes_order_by_comparisons_equals_a_stable_sort() -> None:
    """Adafactor's "largest" axes come from an order built by comparisons alone (Dynamo
    refuses symbolic sizes as sort keys): the order of a stable sort by size, ties in dim
    order, on every shape of up to 5 dims with sizes 1 to 3."""
    from opttx.transforms.factored import _ascending
    for n in range(6):
        for shape in itertools.product((1, 2, 3), repeat=n):
            assert _ascending(shape) == sorted(range(n), key=lambda i: shape[i]), shape
