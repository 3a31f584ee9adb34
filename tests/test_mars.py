"""MARS: `scale_by_mars` and the alias `mars`.

* ``mars`` equals ``pytorch_optimizer.MARS`` (``mars_type="adamw"`` and ``"lion"``, with and
  without ``optimize_1d``) over 20 steps on drawn trees and hyperparameters, with gradients
  large enough that the per-leaf clipping of :math:`c_t` acts and small enough that it does
  not: parameters within float32 1e-5 of each leaf's magnitude, every step;
* the first step scales the gradient by :math:`1 + \\gamma\\beta_1/(1-\\beta_1)`; the state is
  the raw gradient;
* run under `opttx.distributed.sharded` (tensor-parallel shards, gloo, world 2) it equals one
  device: the clipping norm goes through the reduction hook;
* bad hyperparameters are refused at construction.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opttx
from opttx.testing import (assert_shard_invariant, assert_trees_close, gradient_stream,
                           param_trees)

STEPS = 20


def run_reference(tree: dict, grads: list[dict], **kwargs) -> list[dict]:
    """``pytorch_optimizer.MARS`` from ``tree`` on ``grads``: the parameters after each step."""
    from pytorch_optimizer import MARS
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = MARS(list(params.values()), **kwargs)
    out = []
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
        out.append({k: p.detach().clone() for k, p in params.items()})
    return out


def run_ours(tx: opttx.GradientTransformation, tree: dict, grads: list[dict]) -> list[dict]:
    params, state, out = tree, tx.init(tree), []
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
        out.append(params)
    return out


hparams = st.fixed_dictionaries({
    "lr": st.sampled_from([1e-3, 3e-3, 1e-2]),
    "betas": st.tuples(st.floats(0.8, 0.97), st.floats(0.9, 0.999)),
    "gamma": st.sampled_from([0.0, 0.025, 0.1]),
    "weight_decay": st.sampled_from([0.0, 0.1]),
    "optimize_1d": st.booleans(),
    "grad_scale": st.sampled_from([0.01, 1.0, 10.0])})


@pytest.mark.parametrize("mars_type", ["adamw", "lion"])
def test_mars_equals_pytorch_optimizer(mars_type: str) -> None:
    pytest.importorskip("pytorch_optimizer")

    @settings(max_examples=8, deadline=None)
    @given(drawn=param_trees(), h=hparams)
    def prop(drawn, h):
        b1, b2 = h["betas"]
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1, scale=h["grad_scale"])
        expected = run_reference(drawn.tree, grads, lr=h["lr"], betas=(b1, b2),
                                 gamma=h["gamma"], mars_type=mars_type,
                                 optimize_1d=h["optimize_1d"], weight_decay=h["weight_decay"],
                                 lr_1d=h["lr"], weight_decay_1d=0.05, betas_1d=(0.9, 0.95))
        tx = opttx.mars(h["lr"], b1, b2, gamma=h["gamma"], weight_decay=h["weight_decay"],
                        optimizer=mars_type, optimize_1d=h["optimize_1d"],
                        weight_decay_1d=0.05, betas_1d=(0.9, 0.95))
        actual = run_ours(tx, drawn.tree, grads)
        for step, (a, e) in enumerate(zip(actual, expected)):
            for k, x0 in drawn.tree.items():
                scale = max(float(x0.abs().max()), float(e[k].abs().max()))
                assert_trees_close(a[k], e[k], rtol=1e-5, atol=1e-5 * scale,
                                   what=f"mars({mars_type}) step {step + 1} params[{k}]")
    prop()


def test_first_step_and_state() -> None:
    """g_0 = 0: c_1 = (1 + gamma b1 / (1 - b1)) g_1 (unclipped here); then the correction
    uses the stored raw gradient; and the per-leaf norm of c is at most max_norm."""
    gamma, b1 = 0.1, 0.9
    coef = gamma * b1 / (1 - b1)
    tx = opttx.scale_by_mars(gamma, b1, max_norm=None)
    g1 = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    g2 = {k: torch.randn_like(v) for k, v in g1.items()}
    state = tx.init(g1)
    c1, state = tx.update(g1, state)
    for k, g in g1.items():
        torch.testing.assert_close(c1[k], (1 + coef) * g, rtol=1e-14, atol=0)
        assert torch.equal(state.prev_grad[k], g)
        assert state.prev_grad[k] is not g      # a copy, not the caller's tensor
    c2, state = tx.update(g2, state)
    for k, g in g1.items():
        torch.testing.assert_close(c2[k], g2[k] + coef * (g2[k] - g), rtol=1e-14, atol=0)
    clipped = opttx.scale_by_mars(gamma, b1, max_norm=0.5)
    big = {k: 100 * v for k, v in g1.items()}
    out, _ = clipped.update(big, clipped.init(big))
    for k, g in g1.items():
        assert float(out[k].norm()) == pytest.approx(0.5, rel=1e-12)
        torch.testing.assert_close(out[k] / out[k].norm(), g / g.norm())


def test_bf16_keeps_float32_state_and_returns_bf16() -> None:
    tree = {"w": torch.randn(3, 2).to(torch.bfloat16)}
    tx = opttx.scale_by_mars()
    state = tx.init(tree)
    assert state.prev_grad["w"].dtype == torch.float32
    out, state = tx.update(tree, state)
    assert out["w"].dtype == torch.bfloat16
    assert opttx.extend.state_roles(state)["prev_grad"] is opttx.extend.Role.FIRST_MOMENT
    assert opttx.extend.traits_of(tx).per_leaf and not opttx.extend.traits_of(tx).elementwise
    assert opttx.extend.traits_of(opttx.scale_by_mars(max_norm=None)).elementwise


def make_mars():
    return opttx.mars(1e-2, weight_decay=0.01, optimize_1d=True)


def test_sharded_equals_one_device() -> None:
    """Tensor-parallel shards: each leaf's norm is summed over its shards, so the clipping
    (active: gradients of norm > 1) is the single-device one."""
    shapes = {"w": (6, 4), "u": (5, 3), "b": (5,)}
    assert_shard_invariant(make_mars, shapes, steps=3, n_specs=3, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"gamma": -1.0}, "gamma"), ({"b1": 1.0}, "b1"), ({"max_norm": 0.0}, "max_norm"),
    ({"optimizer": "sgd"}, "optimizer"), ({"betas_1d": 0.9}, "betas_1d"),
    ({"learning_rate": -1.0}, "learning_rate")])
def test_bad_hyperparameters_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        opttx.mars(**kwargs)
