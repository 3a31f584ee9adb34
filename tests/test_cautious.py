"""Cautious optimizers: the wrapper `cautious`.

* ``chain(cautious(scale_by_lion(b1, b2), "gradient"), add_decayed_weights(wd),
  scale_by_learning_rate(lr))`` equals ``pytorch_optimizer.Lion(..., cautious=True)`` over 20
  steps on drawn trees and hyperparameters (float32, 1e-5 of each leaf's magnitude), and
  ``cautious(lion(lr, wd=0))`` ("descent": the mask flips with the sign convention) too;
* the kept entries, the rescaling n / (kept + 1) and ``min_fraction``'s n / max(kept, f n);
* run under `opttx.distributed.sharded` (tensor-parallel shards, gloo, world 2) it equals one
  device: the kept fraction is counted over the whole leaf through the reduction hook.
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
    from pytorch_optimizer import Lion
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = Lion(list(params.values()), cautious=True, **kwargs)
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
    "lr": st.sampled_from([1e-4, 1e-3]),
    "betas": st.tuples(st.floats(0.8, 0.95), st.floats(0.9, 0.999)),
    "weight_decay": st.sampled_from([0.0, 0.1]),
    "descent": st.booleans()})


def test_cautious_lion_equals_pytorch_optimizer() -> None:
    pytest.importorskip("pytorch_optimizer")

    @settings(max_examples=10, deadline=None)
    @given(drawn=param_trees(), h=hparams)
    def prop(drawn, h):
        b1, b2 = h["betas"]
        wd = 0.0 if h["descent"] else h["weight_decay"]
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        expected = run_reference(drawn.tree, grads, lr=h["lr"], betas=(b1, b2),
                                 weight_decay=wd)
        if h["descent"]:
            tx = opttx.cautious(opttx.lion(h["lr"], b1, b2, weight_decay=0.0))
        else:
            tx = opttx.chain(opttx.cautious(opttx.scale_by_lion(b1, b2), "gradient"),
                             opttx.add_decayed_weights(wd),
                             opttx.scale_by_learning_rate(h["lr"]))
        actual = run_ours(tx, drawn.tree, grads)
        for step, (a, e) in enumerate(zip(actual, expected)):
            for k, x0 in drawn.tree.items():
                scale = max(float(x0.abs().max()), float(e[k].abs().max()))
                assert_trees_close(a[k], e[k], rtol=1e-5, atol=1e-5 * scale,
                                   what=f"cautious lion step {step + 1} params[{k}]")
    prop()


def test_mask_and_rescaling() -> None:
    g = {"w": torch.tensor([1.0, -2.0, 3.0, -4.0, 0.5], dtype=torch.float64)}
    step = {"w": torch.tensor([-0.1, -0.2, 0.3, 0.4, 0.0], dtype=torch.float64)}
    inner = opttx.stateless(lambda updates, params: step)
    out, _ = opttx.cautious(inner).update(g, opttx.cautious(inner).init(g))
    # descent keeps u·g < 0: entries 0 and 3 (the zero entry is dropped); n/(k+1) = 5/3
    torch.testing.assert_close(out["w"], torch.tensor([-0.1, 0, 0, 0.4, 0],
                                                      dtype=torch.float64) * 5 / 3)
    tx = opttx.cautious(inner, "gradient", min_fraction=1e-3)
    out, _ = tx.update(g, tx.init(g))
    # gradient keeps u·g > 0: entries 1 and 2; n / max(2, 5e-3) = 2.5
    torch.testing.assert_close(out["w"], torch.tensor([0, -0.2, 0.3, 0, 0],
                                                      dtype=torch.float64) * 2.5)
    none_kept = {"w": -step["w"].abs() * g["w"].sign()}
    tx = opttx.cautious(opttx.stateless(lambda updates, params: none_kept), "gradient",
                        min_fraction=0.5)
    out, _ = tx.update(g, tx.init(g))
    assert torch.equal(out["w"], torch.zeros(5, dtype=torch.float64))
    assert not opttx.extend.traits_of(tx).elementwise


def make_cautious():
    return opttx.cautious(opttx.adamw(1e-2, weight_decay=0.01))


def test_sharded_equals_one_device() -> None:
    shapes = {"w": (6, 4), "u": (5, 3), "b": (5,)}
    assert_shard_invariant(make_cautious, shapes, steps=3, n_specs=3, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"direction": "up"}, "direction"), ({"min_fraction": 0.0}, "min_fraction"),
    ({"min_fraction": 2.0}, "min_fraction")])
def test_bad_arguments_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        opttx.cautious(opttx.sgd(0.1), **kwargs)
    with pytest.raises(TypeError, match="inner"):
        opttx.cautious(opttx.sgd)
