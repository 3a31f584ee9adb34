"""AdEMAMix: `scale_by_ademamix` and the alias `ademamix`.

* ``ademamix`` equals ``optax.contrib.ademamix`` over 20 steps on drawn trees and drawn
  hyperparameters (b1, b2, b3 and alpha as numbers or schedules, eps, eps_root, weight decay,
  a learning-rate schedule): parameters within float32 1e-5 of each leaf's magnitude, float64
  1e-10 of the distance travelled; ``scale_by_ademamix`` equals optax's transform;
* with the paper's warm-ups of alpha and b3 written as schedules it equals
  ``pytorch_optimizer.AdEMAMix(weight_decouple=True, t_alpha_beta3=T)`` (float64, 1e-10);
* its roles (two first moments, one second moment) make `opttx.quantize_state` store m1 and
  m2 with the signed map and nu with the unsigned one, and the 8-bit run stays within 3% (L2,
  relative to the distance travelled) of the float32 run over 20 steps, no further than 8-bit
  Adam from float32 Adam;
* bad hyperparameters are refused at construction.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform
from opttx.transforms.quantized import (dequantize_blockwise, dynamic_map, quantization_map,
                                        quantize_blockwise)
from optax_reference import assert_params_close, run_optax

STEPS = 20
SIGNED, UNSIGNED = quantization_map(dynamic_map(True)), quantization_map(dynamic_map(False))


def paper_warmups(alpha: float, b1: float, b3: float, horizon: float, xp):
    """The paper's warm-ups (pytorch_optimizer's schedule_alpha / schedule_beta3) as
    schedules of the 0-based step (they take the 1-based one), in float64 with ``xp``'s ops:
    alpha linear from 0, b3 from b1 to b3 along the paper's log-log path."""
    ln1, ln3 = math.log(b1), math.log(b3)

    def alpha_t(count):
        return xp.minimum(xp.asarray(count + 1, xp.float64) * alpha / horizon, alpha)

    def b3_t(count):
        frac = xp.asarray(count + 1, xp.float64) / horizon
        return xp.minimum(xp.exp(ln1 * ln3 / ((1 - frac) * ln3 + frac * ln1)), b3)
    return alpha_t, b3_t


class TorchOps:
    """The few array functions `paper_warmups` needs, on torch tensors."""
    float64 = torch.float64

    @staticmethod
    def asarray(x, dtype):
        return x.to(dtype)

    @staticmethod
    def minimum(x, bound):
        return x.clamp(max=bound)

    exp = staticmethod(torch.exp)


hparams = st.fixed_dictionaries({
    "b1": st.floats(0.5, 0.95), "b2": st.sampled_from([0.99, 0.999]),
    "b3": st.sampled_from([0.99, 0.9999, "warmup"]), "alpha": st.sampled_from([0.0, 5.0, 8.0]),
    "alpha_warmup": st.booleans(), "eps": st.sampled_from([1e-8, 1e-3]),
    "eps_root": st.sampled_from([0.0, 1e-10]), "weight_decay": st.sampled_from([0.0, 0.1]),
    "schedule": st.booleans()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_ademamix_equals_optax_contrib_ademamix(dtype: torch.dtype) -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    @settings(max_examples=8, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,)), h=hparams)
    def prop(drawn, h):
        h = dict(h)
        ours, theirs = dict(h), dict(h)
        for d in (ours, theirs):
            d.pop("alpha_warmup"), d.pop("schedule")
        ours["learning_rate"] = theirs["learning_rate"] = 1e-2
        if h["schedule"]:     # a linear decay, computed in float64 on both sides
            theirs["learning_rate"] = lambda c: 1e-2 * (1.0 - jnp.asarray(c, jnp.float64) / 40)
            ours["learning_rate"] = lambda c: 1e-2 * (1.0 - c.to(torch.float64) / 40)
        warm = {xp: paper_warmups(max(h["alpha"], 1.0), h["b1"], 0.999, 8.0, xp)
                for xp in (jnp, TorchOps)}
        if h["b3"] == "warmup":
            theirs["b3"], ours["b3"] = warm[jnp][1], warm[TorchOps][1]
        if h["alpha_warmup"]:
            theirs["alpha"], ours["alpha"] = warm[jnp][0], warm[TorchOps][0]
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        expected = run_optax(optax.contrib.ademamix(**theirs), drawn.tree, grads)[0]
        actual, _ = run_transform(opttx.ademamix(**ours), drawn.tree, grads)
        assert_params_close(actual, expected, drawn.tree, dtype,
                            "ademamix vs optax.contrib.ademamix")
    prop()


def test_scale_by_ademamix_equals_optax_transform() -> None:
    """The bare transform, optax's defaults but alpha (optax's transform defaults to 6.0,
    its alias and ours to 5.0), float64: updates every step to 1e-12."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    tree = {"w": torch.randn(6, 5, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64)}
    theirs, ours = optax.contrib.scale_by_ademamix(), opttx.scale_by_ademamix(alpha=6.0)
    s_t, s_o = theirs.init({k: jnp.asarray(v.numpy()) for k, v in tree.items()}), ours.init(tree)
    for g in gradient_stream(tree, STEPS, seed=3):
        u_t, s_t = theirs.update({k: jnp.asarray(v.numpy()) for k, v in g.items()}, s_t)
        u_o, s_o = ours.update(g, s_o)
        for k in tree:
            assert_trees_close(u_o[k], torch.from_numpy(np.array(u_t[k])), rtol=1e-12,
                               what=f"scale_by_ademamix update[{k}]")
    assert int(s_o.count) == STEPS


@settings(max_examples=5, deadline=None)
@given(drawn=param_trees(dtypes=(torch.float64,)), wd=st.sampled_from([0.0, 0.1]),
       horizon=st.sampled_from([5, 12]))
def test_paper_warmups_equal_pytorch_optimizer_ademamix(drawn, wd, horizon) -> None:
    pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
    lr, alpha, b1, b3 = 1e-2, 5.0, 0.9, 0.999
    alpha_t, b3_t = paper_warmups(alpha, b1, b3, float(horizon), TorchOps)
    grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
    actual, _ = run_transform(opttx.ademamix(lr, b1=b1, b3=b3_t, alpha=alpha_t,
                                             weight_decay=wd), drawn.tree, grads)
    params = [torch.nn.Parameter(x.clone()) for x in drawn.tree.values()]
    opt = pytorch_optimizer.AdEMAMix(params, lr=lr, betas=(b1, 0.999, b3), alpha=alpha,
                                     t_alpha_beta3=horizon, weight_decay=wd,
                                     weight_decouple=True)
    for g in grads:
        for p, gk in zip(params, g.values()):
            p.grad = gk.clone()
        opt.step()
    expected = {k: p.detach() for k, p in zip(drawn.tree, params)}
    assert_params_close(actual, expected, drawn.tree, torch.float64,
                        "ademamix vs pytorch_optimizer.AdEMAMix(weight_decouple=True)")


def test_roles_give_quantize_state_its_maps() -> None:
    """After one step from the zero state, each quantized field is exactly the quantization
    of the float32 state: m1 and m2 (FIRST_MOMENT) on the signed map, nu (SECOND_MOMENT) on
    the unsigned one (and those codes differ from the other map's)."""
    inner = opttx.scale_by_ademamix(b3=0.99)
    roles = opttx.extend.state_roles(inner.init({"w": torch.zeros(2)}))
    assert roles == {"count": opttx.extend.Role.COUNT, "m1": opttx.extend.Role.FIRST_MOMENT,
                     "m2": opttx.extend.Role.FIRST_MOMENT, "nu": opttx.extend.Role.SECOND_MOMENT}
    params = {"w": torch.randn(64, 80), "b": torch.randn(10)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    tx = opttx.quantize_state(inner)
    _, state = tx.update(grads, tx.init(params), params)
    _, full = inner.update(grads["w"], inner.init(params["w"]), params["w"])
    q = state.quantized[0]
    assert len(state.quantized) == 1 and state.dense.m1[0].dtype == torch.float32
    for field, qmap, other in (("m1", SIGNED, UNSIGNED), ("m2", SIGNED, UNSIGNED),
                               ("nu", UNSIGNED, SIGNED)):
        codes = getattr(q, field)
        assert codes.codes.dtype == torch.uint8 and codes.codes.shape == (64, 80)
        expected = quantize_blockwise(getattr(full, field), qmap)
        assert torch.equal(codes.codes, expected.codes), field
        assert torch.equal(codes.absmax, expected.absmax), field
        assert not torch.equal(codes.codes, quantize_blockwise(getattr(full, field),
                                                               other).codes), field
        back = dequantize_blockwise(codes, qmap)
        assert float((back - getattr(full, field)).abs().max()) <= 0.02 * float(
            getattr(full, field).abs().max()), field


def eight_bit_deviation(make_inner) -> dict[str, float]:
    """||p_8bit - p_fp32|| / ||p_fp32 - p_0|| per large leaf after 20 steps of gradients with
    a constant direction plus noise (learning rate 1e-2)."""
    gen = torch.Generator().manual_seed(0)
    tree = {"w": torch.randn(64, 128, generator=gen), "v": torch.randn(80, 70, generator=gen),
            "b": torch.randn(64, generator=gen)}
    mean = gradient_stream(tree, 1, seed=1)[0]
    grads = [{k: g[k] + mean[k] for k in g} for g in gradient_stream(tree, STEPS, seed=2,
                                                                     scale=0.5)]

    def run(quantized: bool) -> dict:
        inner = opttx.quantize_state(make_inner()) if quantized else make_inner()
        return run_transform(opttx.chain(inner, opttx.scale_by_learning_rate(1e-2)), tree,
                             grads)[0]
    full, eight = run(False), run(True)
    return {k: float((eight[k] - full[k]).norm() / (full[k] - tree[k]).norm())
            for k in ("w", "v")}


def test_eight_bit_trajectory_stays_close_to_float32() -> None:
    """Measured (this tree, 5 seeds while writing): AdEMAMix 1.45-1.51%, Adam 1.50-1.56%:
    the error is the 8-bit map's, not AdEMAMix's. The bound, 3%, is twice that; a wrong map
    for a moment or a moment left unquantized would move it (the equality of the codes above
    pins the maps)."""
    ademamix = eight_bit_deviation(lambda: opttx.scale_by_ademamix(b3=0.999))
    adam = eight_bit_deviation(opttx.scale_by_adam)
    for k, dev in ademamix.items():
        assert 0 < dev <= 0.03, (k, dev)
        assert dev <= 1.25 * adam[k], (k, dev, adam[k])


@pytest.mark.parametrize("kwargs, match", [
    ({"b1": 1.0}, "b1"), ({"b2": -0.1}, "b2"), ({"b3": 1.0}, "b3"), ({"alpha": -1.0}, "alpha"),
    ({"eps": -1e-8}, "eps"), ({"eps_root": -1.0}, "eps_root"),
    ({"weight_decay": -1.0}, "weight_decay"), ({"learning_rate": -1.0}, "learning_rate"),
    ({"alpha": "5"}, "alpha")])
def test_bad_hyperparameters_are_refused(kwargs, match) -> None:
    error = TypeError if kwargs.get("alpha") == "5" else ValueError
    with pytest.raises(error, match=match):
        opttx.ademamix(**{"learning_rate": 1e-3, **kwargs})


def test_statistics_of_16_bit_params_are_float32() -> None:
    tree = {"w": torch.randn(3, 4).to(torch.bfloat16)}
    u, state = opttx.ademamix(1e-2).update({"w": torch.randn(3, 4).to(torch.bfloat16)},
                                           opttx.ademamix(1e-2).init(tree), tree)
    assert u["w"].dtype == torch.bfloat16
    assert all(getattr(state[0], f)["w"].dtype == torch.float32 for f in ("m1", "m2", "nu"))
