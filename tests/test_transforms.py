"""Single transforms against float64 re-derivations of their formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform


def f64(drawn):
    return {k: v.double() for k, v in drawn.tree.items()}


@given(drawn=param_trees(dtypes=(torch.float64,)), b1=st.floats(0, 0.99),
       b2=st.floats(0, 0.999), wd=st.sampled_from([0.0, 0.1]))
def test_lion_equals_its_formula(drawn, b1, b2, wd) -> None:
    lr, params = 1e-3, drawn.tree
    grads = gradient_stream(params, 12, seed=drawn.seed)
    expected = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for g in grads:
        for k in params:
            c = b1 * m[k] + (1 - b1) * g[k]
            expected[k] = expected[k] - lr * (torch.sign(c) + wd * expected[k])
            m[k] = b2 * m[k] + (1 - b2) * g[k]
    actual, state = run_transform(opttx.lion(lr, b1=b1, b2=b2, weight_decay=wd), params, grads)
    assert_trees_close(actual, expected, rtol=1e-12)
    assert_trees_close(state[0].mu, m, rtol=1e-12)


@given(drawn=param_trees(dtypes=(torch.float64,)), max_norm=st.floats(0.1, 10.0))
def test_clip_by_global_norm_equals_its_formula(drawn, max_norm) -> None:
    g = drawn.tree
    norm = math.sqrt(sum(float((v**2).sum()) for v in g.values()))
    factor = 1.0 if norm < max_norm else max_norm / norm
    tx = opttx.clip_by_global_norm(max_norm)
    out, _ = tx.update(g, tx.init(g))
    assert_trees_close(out, {k: v * factor for k, v in g.items()}, rtol=1e-12)
    assert float(opttx.global_norm(g)) == pytest.approx(norm, rel=1e-12)
    # torch's utility agrees up to its 1e-6 in the denominator
    clipped = {k: v.clone() for k, v in g.items()}
    params = [torch.nn.Parameter(torch.zeros_like(v)) for v in clipped.values()]
    for p, v in zip(params, clipped.values()):
        p.grad = v
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    assert_trees_close(out, {k: p.grad for k, p in zip(g, params)}, rtol=1e-5)


@given(drawn=param_trees(dtypes=(torch.float64,)), threshold=st.floats(0.1, 2.0))
def test_clip_by_block_rms_equals_its_formula(drawn, threshold) -> None:
    g = drawn.tree
    tx = opttx.clip_by_block_rms(threshold)
    out, _ = tx.update(g, tx.init(g))
    expected = {k: v / max(1.0, math.sqrt(float((v**2).mean())) / threshold)
                for k, v in g.items()}
    assert_trees_close(out, expected, rtol=1e-12)


def test_clip_and_sign_and_scale() -> None:
    g = {"a": torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0])}
    assert torch.equal(opttx.clip(1.0).update(g, ())[0]["a"],
                       torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]))
    assert torch.equal(opttx.scale_by_sign().update(g, ())[0]["a"],
                       torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0]))
    assert torch.equal(opttx.scale(-2.0).update(g, ())[0]["a"], -2 * g["a"])


def test_zero_nans_replaces_and_records() -> None:
    g = {"a": torch.tensor([1.0, math.nan]), "b": torch.tensor([2.0])}
    tx = opttx.zero_nans()
    out, state = tx.update(g, tx.init(g))
    assert torch.equal(out["a"], torch.tensor([1.0, 0.0]))
    assert bool(state.found_nan["a"]) and not bool(state.found_nan["b"])


@given(drawn=param_trees(dtypes=(torch.float64,)), decay=st.floats(0, 0.99),
       debias=st.booleans())
def test_ema_equals_its_formula(drawn, decay, debias) -> None:
    grads = gradient_stream(drawn.tree, 6, seed=drawn.seed)
    tx = opttx.ema(decay, debias=debias)
    state = tx.init(drawn.tree)
    avg = {k: torch.zeros_like(v) for k, v in drawn.tree.items()}
    for t, g in enumerate(grads, start=1):
        out, state = tx.update(g, state)
        avg = {k: decay * avg[k] + (1 - decay) * g[k] for k in avg}
        expected = {k: v / (1 - decay**t) for k, v in avg.items()} if debias else avg
        assert_trees_close(out, expected, rtol=1e-12)


@given(drawn=param_trees(dtypes=(torch.float64,)))
def test_scale_by_adam_nesterov_and_eps_root_equal_their_formula(drawn) -> None:
    b1, b2, eps, eps_root = 0.9, 0.99, 1e-8, 1e-6
    grads = gradient_stream(drawn.tree, 8, seed=drawn.seed)
    tx = opttx.scale_by_adam(b1, b2, eps, eps_root, nesterov=True)
    state = tx.init(drawn.tree)
    m = {k: torch.zeros_like(v) for k, v in drawn.tree.items()}
    v = {k: torch.zeros_like(x) for k, x in drawn.tree.items()}
    for t, g in enumerate(grads, start=1):
        out, state = tx.update(g, state)
        for k in m:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
        denominator = {k: torch.sqrt(v[k] / (1 - b2**t) + eps_root) + eps for k in m}
        momentum = {k: b1 * m[k] / (1 - b1 ** (t + 1)) for k in m}
        gradient = {k: (1 - b1) * g[k] / (1 - b1**t) for k in m}
        for k in m:
            # the two terms of the numerator may cancel (a gradient against the momentum):
            # the rounding is relative to their magnitudes, not to their sum
            expected = (momentum[k] + gradient[k]) / denominator[k]
            scale = (momentum[k].abs() + gradient[k].abs()) / denominator[k]
            assert ((out[k] - expected).abs() <= 1e-12 * scale).all(), k


@pytest.mark.parametrize("factory", [
    lambda: opttx.adamw(1e-3), lambda: opttx.lion(1e-4), lambda: opttx.sgd(0.1, 0.9),
    lambda: opttx.rmsprop(1e-3, centered=True), lambda: opttx.adagrad(1e-2),
    lambda: opttx.nadam(1e-3), lambda: opttx.nadam(1e-3, momentum_decay=4e-3),
])
def test_16_bit_leaves_keep_fp32_statistics_and_get_16_bit_updates(factory) -> None:
    params = {"w": torch.randn(5, 4).to(torch.bfloat16), "b": torch.randn(4).half()}
    tx = factory()
    state = tx.init(params)
    grads = {k: torch.randn_like(v, dtype=torch.float32).to(v.dtype)
             for k, v in params.items()}
    updates, state = tx.update(grads, state, params)
    assert {k: u.dtype for k, u in updates.items()} == {k: p.dtype for k, p in params.items()}
    stats = [x for x in opttx.tree.tree_leaves(state)
             if x.dtype.is_floating_point and x.dim() > 0]
    assert stats and all(x.dtype == torch.float32 for x in stats)
    # the fp32 statistics match an fp32 run on the same (rounded) values
    ref_params = {k: v.float() for k, v in params.items()}
    ref_updates, _ = tx.update({k: g.float() for k, g in grads.items()}, tx.init(ref_params),
                               ref_params)
    assert_trees_close({k: u.float() for k, u in updates.items()},
                       {k: u.to(params[k].dtype).float() for k, u in ref_updates.items()},
                       rtol=1e-2)


def test_mu_dtype_is_honoured() -> None:
    params = {"w": torch.randn(3, 3)}
    state = opttx.scale_by_adam(mu_dtype=torch.bfloat16).init(params)
    assert state.mu["w"].dtype == torch.bfloat16 and state.nu["w"].dtype == torch.float32
    out, _ = opttx.scale_by_adam(mu_dtype=torch.bfloat16).update(params, state)
    assert out["w"].dtype == torch.float32


def test_donating_updates_state_in_place_with_the_same_numbers() -> None:
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    grads = gradient_stream(params, 3)
    for factory in (lambda: opttx.adamw(1e-2), lambda: opttx.sgd(0.1, 0.9, nesterov=True),
                    lambda: opttx.sgd(0.1, 0.9),     # trace's output aliases its state
                    lambda: opttx.chain(opttx.ema(0.9, debias=False), opttx.scale(-0.1)),
                    lambda: opttx.chain(opttx.clip_by_global_norm(0.1), opttx.adamw(1e-2)),
                    lambda: opttx.rmsprop(1e-2, centered=True, momentum=0.9),
                    lambda: opttx.adagrad(0.1), lambda: opttx.lion(1e-3)):
        tx = factory()
        pure_state, donated_state = tx.init(params), tx.init(params)
        pointers = [t.data_ptr() for t in opttx.tree.tree_leaves(donated_state) if t.dim()]
        for g in grads:
            g_before = {k: v.clone() for k, v in g.items()}
            pure_out, pure_state = tx.update(g, pure_state, params)
            with opttx.donating():
                out, donated_state = tx.update(g, donated_state, params)
            assert_trees_close(out, pure_out, rtol=0.0)
            assert_trees_close(g, g_before, rtol=0.0)        # the input is never overwritten
        assert_trees_close(donated_state, pure_state, rtol=0.0)
        assert pointers == [t.data_ptr() for t in opttx.tree.tree_leaves(donated_state)
                            if t.dim()]


def test_stateless_helpers_and_set_to_zero() -> None:
    g = {"a": torch.ones(2), "b": torch.full((3,), 2.0)}
    halve = opttx.stateless_with_tree_map(lambda u, p: u / 2)
    assert torch.equal(halve.update(g, halve.init(g))[0]["b"], torch.ones(3))
    zero = opttx.set_to_zero()
    assert all(torch.count_nonzero(v) == 0 for v in zero.update(g, ())[0].values())


def test_apply_updates_pure_and_in_place() -> None:
    params = {"w": torch.ones(2), "h": torch.ones(2, dtype=torch.bfloat16)}
    updates = {"w": torch.full((2,), 0.5), "h": torch.full((2,), 0.5)}
    new = opttx.apply_updates(params, updates)
    assert torch.equal(params["w"], torch.ones(2))          # pure
    assert torch.equal(new["w"], torch.full((2,), 1.5)) and new["h"].dtype == torch.bfloat16
    ptr = params["w"].data_ptr()
    opttx.apply_updates_(params, updates)
    assert params["w"].data_ptr() == ptr and torch.equal(params["w"], torch.full((2,), 1.5))


@pytest.mark.parametrize("make", [lambda: opttx.nadam(1e-2, momentum_decay=4e-3),
                                  lambda: opttx.schedule_free_adamw(1e-2)],
                         ids=["nadam", "schedule_free_adamw"])
def test_shared_scalars_move_on_a_tree_without_leaves(make) -> None:
    """A rank that holds no leaf (zero, on_owners, a partition label with no leaf there)
    steps its shared scalars as a rank with leaves does: Nadam's momentum product stayed 1.0
    there, and a DCP checkpoint could keep that rank's copy (world 4 -> 2 -> 1 off by 8e-3)."""
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    tx = make()
    full, empty = tx.init(params), tx.init({})
    for _ in range(3):
        full = tx.update(opttx.tree.tree_map(torch.ones_like, params), full, params)[1]
        empty = tx.update({}, empty, {})[1]
    _, shared_full = opttx.distributed.checkpoint_keys.keyed_state(full, params)
    _, shared_empty = opttx.distributed.checkpoint_keys.keyed_state(empty, {})
    assert shared_full.keys() == shared_empty.keys()
    for key, value in shared_full.items():
        assert torch.equal(value, shared_empty[key]), key
