"""ADOPT: `scale_by_adopt` and the alias `adopt`.

* ``adopt`` (weight_decay=0) equals ``optax.contrib.adopt`` over 24 steps on drawn trees and
  drawn hyperparameters (b1, b2, eps, Nesterov, clipping on or off, a clipping function, a
  learning-rate schedule): parameters within float32 1e-5 of each leaf's magnitude, float64
  1e-10 of the distance travelled;
* with decoupled weight decay it equals ``pytorch_optimizer.ADOPT(weight_decouple=True)``
  given the 0-based step in its ``clip_lambda`` (float64, 1e-10);
* the first step records v = g^2 and moves nothing (but the decay);
* the roles are declared, so `opttx.quantize_state` stores mu signed and nu unsigned;
* bad hyperparameters are refused at construction.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform
from optax_reference import assert_params_close, run_optax

STEPS = 24


hparams = st.fixed_dictionaries({
    "b1": st.floats(0.5, 0.95), "b2": st.sampled_from([0.9, 0.999, 0.9999]),
    "eps": st.sampled_from([1e-6, 1e-3]), "nesterov": st.booleans(),
    "use_clipping": st.booleans(), "clip": st.sampled_from(["default", "linear"]),
    "schedule": st.booleans(), "scale": st.sampled_from([1.0, 1e-3])})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_adopt_equals_optax_contrib_adopt(dtype: torch.dtype) -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    @settings(max_examples=8, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,)), h=hparams)
    def prop(drawn, h):
        h = dict(h)
        theirs_lr = ours_lr = 1e-2
        if h.pop("schedule"):     # a linear decay, computed in float64 on both sides
            def theirs_lr(c):
                return 1e-2 * (1.0 - jnp.asarray(c, jnp.float64) / 40)

            def ours_lr(c):
                return 1e-2 * (1.0 - c.to(torch.float64) / 40)
        ours_clip, theirs_clip = {}, {}
        if h.pop("clip") == "linear":       # a bound that grows from 0.5 by 0.1 a step
            ours_clip = {"clip_value_fn": lambda c: 0.5 + 0.1 * c.to(torch.float64)}
            theirs_clip = {"clip_value_fn": lambda c: 0.5 + 0.1 * jnp.asarray(c, jnp.float64)}
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1, scale=h.pop("scale"))
        expected = run_optax(optax.contrib.adopt(theirs_lr, **h, **theirs_clip), drawn.tree,
                             grads)[0]
        actual, _ = run_transform(opttx.adopt(ours_lr, **h, **ours_clip), drawn.tree, grads)
        assert_params_close(actual, expected, drawn.tree, dtype,
                            "adopt vs optax.contrib.adopt")
    prop()


@settings(max_examples=6, deadline=None)
@given(drawn=param_trees(dtypes=(torch.float64,)),
       wd=st.sampled_from([0.0, 0.1, 1.0]), b1=st.floats(0.5, 0.95),
       use_clipping=st.booleans())
def test_decoupled_weight_decay_equals_pytorch_optimizer_adopt(drawn, wd, b1, use_clipping
                                                               ) -> None:
    """pytorch_optimizer's ADOPT(weight_decouple=True) multiplies p by 1 - lr·wd (the first
    step included), then subtracts lr·m: the chain scale_by_adopt, add_decayed_weights,
    scale_by_learning_rate. Its clip_lambda takes the 1-based step; given step - 1 it is
    optax's (and our) default bound."""
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    lr = 1e-2
    grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
    actual, _ = run_transform(opttx.adopt(lr, b1=b1, weight_decay=wd,
                                          use_clipping=use_clipping), drawn.tree, grads)
    params = [torch.nn.Parameter(x.clone()) for x in drawn.tree.values()]
    clip = (lambda step: (step - 1) ** 0.25) if use_clipping else None
    opt = pytorch_optimizer.ADOPT(params, lr=lr, betas=(b1, 0.9999), weight_decay=wd,
                                  weight_decouple=True, clip_lambda=clip)
    for g in grads:
        for p, gk in zip(params, g.values()):
            p.grad = gk.clone()
        opt.step()
    expected = {k: p.detach() for k, p in zip(drawn.tree, params)}
    assert_params_close(actual, expected, drawn.tree, torch.float64,
                        "adopt vs pytorch_optimizer.ADOPT(weight_decouple=True)")


def test_first_step_records_the_second_moment_and_moves_nothing() -> None:
    tree = {"w": torch.randn(4, 3, dtype=torch.float64)}
    g = {"w": torch.randn(4, 3, dtype=torch.float64)}
    tx = opttx.scale_by_adopt()
    u, state = tx.update(g, tx.init(tree), tree)
    assert torch.equal(u["w"], torch.zeros(4, 3, dtype=torch.float64))
    assert torch.equal(state.nu["w"], g["w"] ** 2) and int(state.count) == 1
    decayed, _ = run_transform(opttx.adopt(0.1, weight_decay=0.5), tree, [g])
    assert torch.allclose(decayed["w"], tree["w"] * (1 - 0.1 * 0.5), rtol=1e-15)
    # the second step: the gradient normalised by |g_1|, clipped to [-1, 1] (1 = 1 ** 0.25)
    g2 = {"w": torch.randn(4, 3, dtype=torch.float64)}
    u2, _ = tx.update(g2, state, tree)
    expected = 0.1 * torch.clamp(g2["w"] / torch.clamp(g["w"].abs(), min=1e-6), -1.0, 1.0)
    assert torch.allclose(u2["w"], expected, rtol=1e-14, atol=0)


def test_roles_give_quantize_state_its_maps() -> None:
    state = opttx.scale_by_adopt().init({"w": torch.zeros(2, 3, dtype=torch.bfloat16)})
    assert state.mu["w"].dtype == torch.float32 and state.nu["w"].dtype == torch.float32
    roles = opttx.extend.state_roles(state)
    assert roles == {"count": opttx.extend.Role.COUNT, "mu": opttx.extend.Role.FIRST_MOMENT,
                     "nu": opttx.extend.Role.SECOND_MOMENT}
    tx = opttx.quantize_state(opttx.scale_by_adopt(), min_size=16, block_size=8)
    q = tx.init({"w": torch.zeros(8, 4)}).quantized[0]
    assert q.mu.codes.dtype == torch.uint8 and q.nu.codes.dtype == torch.uint8
    assert opttx.extend.traits_of(opttx.scale_by_adopt()).elementwise


@pytest.mark.parametrize("kwargs, match", [
    ({"b1": 1.0}, "b1"), ({"b2": -0.1}, "b2"), ({"eps": 0.0}, "eps"),
    ({"weight_decay": -1.0}, "weight_decay"), ({"learning_rate": -1.0}, "learning_rate")])
def test_bad_hyperparameters_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        opttx.adopt(**{"learning_rate": 1e-3, **kwargs})


def test_clip_value_fn_is_a_schedule_or_a_bound() -> None:
    """A number is a constant bound: what inject_hyperparams passes (the schedule's value at
    the step), so injected and plain give the same numbers."""
    with pytest.raises(TypeError, match="clip_value_fn"):
        opttx.scale_by_adopt(clip_value_fn="1")
    with pytest.raises(ValueError, match="clip_value_fn"):
        opttx.scale_by_adopt(clip_value_fn=-1.0)
    tree = {"w": torch.randn(5, 3, dtype=torch.float64)}
    grads = gradient_stream(tree, 6, seed=4)
    constant, _ = run_transform(opttx.adopt(1e-2, clip_value_fn=0.5), tree, grads)
    as_fn, _ = run_transform(opttx.adopt(1e-2, clip_value_fn=lambda c: 0.5), tree, grads)
    assert_trees_close(constant, as_fn, rtol=0.0)
    plain, _ = run_transform(opttx.scale_by_adopt(b1=0.8), tree, grads)
    injected, _ = run_transform(opttx.inject_hyperparams(opttx.scale_by_adopt)(b1=0.8), tree,
                                grads)
    assert_trees_close(injected, plain, rtol=1e-15)
