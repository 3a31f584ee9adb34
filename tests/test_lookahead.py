"""`opttx.lookahead` against ``optax.lookahead`` (float64, jax x64): the parameters opttx
trains are optax's ``params.fast`` and its state's slow parameters are ``params.slow``, after
every step, for SGD with momentum and Adam, with and without ``reset_state``; plus the slow
parameters' dtype, the evaluation helper, an `opttx.Optimizer` loop and the errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opttx
from opttx.testing import gradient_stream, param_trees
from optax_reference import assert_params_close, to_torch

STEPS = 7


def _optax_lookahead_run(tx, tree: dict, grads: list[dict]) -> list[tuple[dict, dict]]:
    """optax's (fast, slow) parameters after every step."""
    import jax
    import jax.numpy as jnp
    import optax
    p0 = {k: jnp.asarray(v.numpy()) for k, v in tree.items()}
    params = optax.LookaheadParams.init_synced(p0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for g in grads:
        updates, state = update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, state,
                                params)
        params = optax.apply_updates(params, updates)
        out.append((to_torch(params.fast), to_torch(params.slow)))
    return out


@pytest.mark.parametrize("inner", ["sgd_momentum", "adam"])
def test_equal_optax_lookahead(inner: str) -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)

    @settings(max_examples=4, deadline=None)
    @given(drawn=param_trees(dtypes=(torch.float64,)), k=st.sampled_from([1, 2, 3]),
           alpha=st.floats(0.1, 0.9), reset=st.booleans())
    def prop(drawn, k, alpha, reset):
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        if inner == "adam":
            theirs, mine = optax.adam(0.05), opttx.adam(0.05)
        else:
            theirs, mine = optax.sgd(0.1, momentum=0.9), opttx.sgd(0.1, momentum=0.9)
        expected = _optax_lookahead_run(optax.lookahead(theirs, k, alpha, reset_state=reset),
                                        drawn.tree, grads)
        tx = opttx.lookahead(mine, k, alpha, reset_state=reset)
        params, state = drawn.tree, tx.init(drawn.tree)
        for step, (g, (fast, slow)) in enumerate(zip(grads, expected)):
            updates, state = tx.update(g, state, params)
            params = opttx.apply_updates(params, updates)
            assert_params_close(params, fast, drawn.tree, torch.float64,
                                f"{inner} k={k} step {step} fast")
            assert_params_close(opttx.lookahead_slow_params(state), slow, drawn.tree,
                                torch.float64, f"{inner} k={k} step {step} slow")
    prop()


def test_sync_pulls_fast_to_slow_by_hand() -> None:
    """Plain SGD, k = 2, alpha = 0.5, derived by hand: theta moves twice, then
    phi <- phi + alpha (theta - phi) and theta <- phi."""
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    g = torch.tensor([0.5, 1.0], dtype=torch.float64)
    tx = opttx.lookahead(opttx.sgd(0.1), sync_period=2, alpha=0.5)
    params, state = {"w": w}, tx.init({"w": w})
    theta, phi = w.clone(), w.clone()
    for step in range(1, 7):
        updates, state = tx.update({"w": g}, state, params)
        params = opttx.apply_updates(params, updates)
        theta = theta - 0.1 * g
        if step % 2 == 0:
            phi = phi + 0.5 * (theta - phi)
            theta = phi.clone()
        torch.testing.assert_close(params["w"], theta, rtol=0, atol=1e-15)
        torch.testing.assert_close(state.slow["w"], phi, rtol=0, atol=1e-15)


def test_alpha_one_is_the_inner_transform() -> None:
    tree = {"w": torch.randn(3, 2, dtype=torch.float64)}
    grads = gradient_stream(tree, 5, seed=3)
    a, b = tree, tree
    tx, inner = opttx.lookahead(opttx.adam(0.1), 2, alpha=1.0), opttx.adam(0.1)
    sa, sb = tx.init(a), inner.init(b)
    for g in grads:
        ua, sa = tx.update(g, sa, a)
        ub, sb = inner.update(g, sb, b)
        a, b = opttx.apply_updates(a, ua), opttx.apply_updates(b, ub)
    torch.testing.assert_close(a["w"], b["w"], rtol=0, atol=1e-14)


def test_slow_params_float32_for_bfloat16() -> None:
    params = {"w": torch.randn(4, 3).to(torch.bfloat16)}
    tx = opttx.lookahead(opttx.sgd(0.1), 2)
    state = tx.init(params)
    assert state.slow["w"].dtype == torch.float32
    updates, state = tx.update({"w": torch.ones(4, 3, dtype=torch.bfloat16)}, state, params)
    assert updates["w"].dtype == torch.bfloat16 and state.slow["w"].dtype == torch.float32


def test_drops_into_optimizer_and_torch_loop() -> None:
    """opttx.Optimizer on a module: the module's parameters are the fast ones, equal to the
    functional run; the slow ones are read from the optimizer's state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    names = [n for n, _ in model.named_parameters()]
    tree = {n: p.detach().clone() for n, p in model.named_parameters()}
    tx = opttx.lookahead(opttx.adam(0.05), sync_period=3, alpha=0.6)
    opt = opttx.Optimizer(model.parameters(), tx)
    assert opt.param_groups[0]["alpha"] == 0.6 and opt.param_groups[0]["lr"] == 0.05
    state = tx.init(tree)
    x = torch.randn(5, 3, dtype=torch.float64)
    for _ in range(7):
        opt.zero_grad()
        model(x).square().sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        updates, state = tx.update(grads, state, tree)
        tree = opttx.apply_updates(tree, updates)
    for n, p in zip(names, model.parameters()):
        assert torch.equal(p.detach(), tree[n]), n
    group_state = opt.state_dict()
    assert group_state  # a state dict exists (its round trip is a conformance property)


def test_lookahead_slow_params_needs_one_state() -> None:
    with pytest.raises(ValueError, match="LookaheadState"):
        opttx.lookahead_slow_params(opttx.adam(0.1).init({"w": torch.zeros(2)}))
    tx = opttx.chain(opttx.clip(1.0), opttx.lookahead(opttx.sgd(0.1), 2))
    params = {"w": torch.ones(2)}
    assert torch.equal(opttx.lookahead_slow_params(tx.init(params))["w"], params["w"])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="sync_period"):
        opttx.lookahead(opttx.sgd(0.1), 0)
    with pytest.raises(ValueError, match="sync_period"):
        opttx.lookahead(opttx.sgd(0.1), 2.0)
    with pytest.raises(ValueError, match="alpha"):
        opttx.lookahead(opttx.sgd(0.1), 2, alpha=1.5)
    with pytest.raises(TypeError, match="GradientTransformation"):
        opttx.lookahead(torch.optim.SGD, 2)
    tx = opttx.lookahead(opttx.sgd(0.1), 2)
    with pytest.raises(ValueError, match="params"):
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))
