"""Hyperball (`hyperball_step`, `opttx.hyperball` and its pairings) and cautious weight decay
(`add_decayed_weights(cautious=True)`, the aliases' ``cautious_weight_decay``).

* ``hyperball(scale_by_adam(), lr)`` equals the paper's rule written out in float64 below,
  with the radius measured at the first step, a given radius and a scheduled learning rate;
  every matrix keeps its norm and every pre-projection step has length lr·R;
* heavyball's ``HyperBallAdamW`` (float64 storage, no weight decay) equals the opttx chain
  its settings map to: an RMSprop direction on the hyperball for leaves of two or more dims,
  RMSprop's step on the others;
* `hyperball_muon` on its hidden matrices is MuonH: Newton-Schulz of the momentum on the
  hyperball (float64 derivation), the embeddings and vectors AdamW;
* run under `opttx.distributed.sharded` (gloo, world 2) the norms are whole: it equals one
  device;
* cautious weight decay equals the paper's rule 1[u·x >= 0] written out in float64, through
  `add_decayed_weights` and through `adamw`, `lion` and `muon`.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import opttx
from opttx.testing import assert_shard_invariant

STEPS = 6


def _grads(params: dict, steps: int, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
            for _ in range(steps)]


def _run(tx: opttx.GradientTransformation, params: dict, grads: list[dict]) -> list[dict]:
    state, out = tx.init(params), []
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
        out.append(params)
    return out


def _params(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 4, generator=gen, dtype=torch.float64),
            "v": torch.randn(3, 6, generator=gen, dtype=torch.float64)}


# ---------------------------------------------------------------------------------------------
# the paper's rule in float64
# ---------------------------------------------------------------------------------------------


def _adam_hyperball_by_hand(params: dict, grads: list[dict], lr, radius=None, b1=0.9,
                            b2=0.999, eps=1e-8) -> list[dict]:
    """W <- R (W - lr_t R u/|u|) / |W - lr_t R u/|u||, u = Adam's m̂/(sqrt(v̂)+eps), R = |W_0|
    (or ``radius``), lr_t = lr(t - 1) for a schedule."""
    w = dict(params)
    r = {k: (x.norm() if radius is None else torch.tensor(radius, dtype=x.dtype))
         for k, x in w.items()}
    m = {k: torch.zeros_like(x) for k, x in w.items()}
    v = {k: torch.zeros_like(x) for k, x in w.items()}
    out = []
    for t, g in enumerate(grads, 1):
        eta = lr(t - 1) if callable(lr) else lr
        new = {}
        for k in w:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] * g[k]
            u = (m[k] / (1 - b1 ** t)) / (torch.sqrt(v[k] / (1 - b2 ** t)) + eps)
            x = w[k] - eta * r[k] * u / u.norm()
            new[k] = r[k] * x / x.norm()
        w = new
        out.append(w)
    return out


def test_hyperball_adam_equals_the_paper_rule_float64() -> None:
    params, grads = _params(), _grads(_params(), STEPS)
    ours = _run(opttx.hyperball(opttx.scale_by_adam(), 0.05), params, grads)
    ref = _adam_hyperball_by_hand(params, grads, 0.05)
    for a, b in zip(ours, ref):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-12)
    for k in params:     # the norm never moves
        assert abs(float(ours[-1][k].norm() - params[k].norm())) < 1e-12


def test_hyperball_given_radius_and_schedule_float64() -> None:
    params, grads = _params(2), _grads(_params(2), STEPS, seed=3)
    sched = opttx.linear_schedule(0.1, 0.02, STEPS)
    ours = _run(opttx.hyperball(opttx.scale_by_adam(), sched, radius=2.5), params, grads)
    ref = _adam_hyperball_by_hand(params, grads, sched, radius=2.5)
    for a, b in zip(ours, ref):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-12)
    assert all(abs(float(x.norm()) - 2.5) < 1e-12 for x in ours[0].values())


def test_step_length_is_lr_times_radius() -> None:
    """Before the projection the step is lr·R long, whatever the size of the direction."""
    params = _params(4)
    g = {k: 1e3 * x for k, x in _grads(params, 1, seed=5)[0].items()}
    tx = opttx.hyperball_step(0.03)
    updates, state = tx.update(g, tx.init(params), params)
    for k, p in params.items():
        r = p.norm()
        new = p + updates[k]
        # new = R (p - a d) / |p - a d|, d = g/|g|, a = lr R: undo the projection
        d = g[k] / g[k].norm()
        x = p - 0.03 * r * d
        torch.testing.assert_close(new, r * x / x.norm(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state.radius[k], r, rtol=0, atol=0)


def test_zero_update_keeps_the_weight() -> None:
    params = _params(6)
    zeros = {k: torch.zeros_like(x) for k, x in params.items()}
    tx = opttx.hyperball_step(0.1)
    updates, _ = tx.update(zeros, tx.init(params), params)
    for k in params:
        torch.testing.assert_close(updates[k], torch.zeros_like(params[k]), rtol=0,
                                   atol=1e-15)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="radius"):
        opttx.hyperball_step(0.1, radius=0.0)
    with pytest.raises(ValueError, match="learning_rate"):
        opttx.hyperball_step(-0.1)
    with pytest.raises(TypeError, match="tx"):
        opttx.hyperball(opttx.scale_by_adam, 0.1)
    tx = opttx.hyperball_step(0.1)
    p = _params()
    with pytest.raises(Exception, match="params"):
        tx.update(p, tx.init(p))


# ---------------------------------------------------------------------------------------------
# heavyball's HyperBallAdamW
# ---------------------------------------------------------------------------------------------


def test_heavyball_hyperball_adamw_float64() -> None:
    """heavyball's HyperBallAdamW has no first moment: its direction is g / max(sqrt(v̂), eps)
    (RMSprop's, bias-corrected), on the hyperball for leaves of 2+ dims, a plain step on the
    others. eps = 0 on both sides (heavyball clamps where opttx adds); lr and beta2 are exact
    in float32 (heavyball keeps lr as a float32 tensor)."""
    heavyball = pytest.importorskip("heavyball")
    lr, b2 = 0.0625, 0.984375
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 4, generator=gen, dtype=torch.float64),
              "c": torch.randn(2, 3, 2, generator=gen, dtype=torch.float64),
              "b": torch.randn(4, generator=gen, dtype=torch.float64)}
    grads = _grads(params, STEPS, seed=7)
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = heavyball.HyperBallAdamW(list(ps.values()), lr=lr, betas=(0.9, b2), eps=0.0,
                                   weight_decay=0, compile_step=False, promote=False,
                                   storage_dtype="float64")
    ref = []
    for g in grads:
        for k, p in ps.items():
            p.grad = g[k].clone()
        opt.step()
        ref.append({k: p.detach().clone() for k, p in ps.items()})

    rms = functools.partial(opttx.scale_by_rms, b2, 0.0, eps_in_sqrt=False,
                            bias_correction=True)
    tx = opttx.partition(
        {"ball": opttx.hyperball(rms(), lr),
         "flat": opttx.chain(rms(), opttx.scale_by_learning_rate(lr))},
        lambda p: {k: "ball" if x.ndim >= 2 else "flat" for k, x in p.items()})
    ours = _run(tx, params, grads)
    for a, b in zip(ours, ref):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# MuonH
# ---------------------------------------------------------------------------------------------


def _newton_schulz(x: torch.Tensor, steps: int = 5, eps: float = 1e-8) -> torch.Tensor:
    a, b, c = opttx.NS_COEFFS
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / (y.norm() + eps)
    for _ in range(steps):
        s = y @ y.T
        y = a * y + (b * s + c * s @ s) @ y
    return y.T if tall else y


def test_hyperball_muon_equals_muonh_float64() -> None:
    gen = torch.Generator().manual_seed(8)
    params = {"layers.0.fc.weight": torch.randn(6, 4, generator=gen, dtype=torch.float64),
              "embed.weight": torch.randn(5, 4, generator=gen, dtype=torch.float64),
              "norm.scale": torch.randn(4, generator=gen, dtype=torch.float64)}
    grads = _grads(params, STEPS, seed=9)
    lr, alr, beta = 0.05, 1e-2, 0.95
    ours = _run(opttx.hyperball_muon(lr, beta=beta, adam_learning_rate=alr), params, grads)
    adam = _run(opttx.adamw(alr, eps=1e-8, weight_decay=0.0, nesterov=True),
                {k: params[k] for k in ("embed.weight", "norm.scale")},
                [{k: g[k] for k in ("embed.weight", "norm.scale")} for g in grads])
    w = params["layers.0.fc.weight"]
    r = w.norm()
    m = torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        gw = g["layers.0.fc.weight"]
        m = beta * m + (1 - beta) * gw
        # optax's Nesterov with bias correction: beta m̂_t + (1 - beta) ĝ_t
        look = beta * m / (1 - beta ** (t + 1)) + (1 - beta) * gw / (1 - beta ** t)
        o = _newton_schulz(look)
        x = w - lr * r * o / o.norm()
        w = r * x / x.norm()
        torch.testing.assert_close(ours[t - 1]["layers.0.fc.weight"], w, rtol=1e-10,
                                   atol=1e-10)
        for k in ("embed.weight", "norm.scale"):
            torch.testing.assert_close(ours[t - 1][k], adam[t - 1][k], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["hyperball_adamw", "hyperball_normuon", "hyperball_soap"])
def test_pairings_hold_the_hidden_matrices_norm(name: str) -> None:
    gen = torch.Generator().manual_seed(10)
    params = {"layers.0.fc.weight": torch.randn(6, 4, generator=gen),
              "embed.weight": torch.randn(5, 4, generator=gen), "bias": torch.randn(4)}
    tx = getattr(opttx, name)(0.05, adam_learning_rate=1e-2)
    out = _run(tx, params, _grads(params, 4, seed=11))
    w0, w = params["layers.0.fc.weight"], out[-1]["layers.0.fc.weight"]
    assert abs(float(w.norm() / w0.norm()) - 1) < 1e-5
    assert (w - w0).norm() > 1e-3 * w0.norm() or name == "hyperball_soap"
    assert not torch.equal(out[-1]["bias"], params["bias"])


# ---------------------------------------------------------------------------------------------
# sharded: whole norms
# ---------------------------------------------------------------------------------------------


def make_hyperball_adam():
    return opttx.hyperball(opttx.scale_by_adam(), 0.05)


def test_sharded_equals_one_device() -> None:
    shapes = {"w": (6, 4), "u": (5, 3), "t": (2, 4, 3)}
    assert_shard_invariant(make_hyperball_adam, shapes, steps=3, n_specs=3, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# cautious weight decay
# ---------------------------------------------------------------------------------------------


def _adamw_cwd_by_hand(params: dict, grads: list[dict], lr: float, wd: float, b1=0.9,
                       b2=0.999, eps=1e-8) -> list[dict]:
    """x <- x - lr (u + wd 1[u x >= 0] x), u = m̂/(sqrt(v̂)+eps) (Chen et al., Algorithm 1)."""
    x = dict(params)
    m = {k: torch.zeros_like(v) for k, v in x.items()}
    v = {k: torch.zeros_like(t) for k, t in x.items()}
    out = []
    for t, g in enumerate(grads, 1):
        new = {}
        for k in x:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            u = (m[k] / (1 - b1 ** t)) / (torch.sqrt(v[k] / (1 - b2 ** t)) + eps)
            mask = (u * x[k] >= 0).to(x[k].dtype)
            new[k] = x[k] - lr * (u + wd * mask * x[k])
        x = new
        out.append(x)
    return out


def test_cautious_adamw_equals_the_paper_rule_float64() -> None:
    params = {**_params(12), "b": torch.randn(7, dtype=torch.float64)}
    grads = _grads(params, STEPS, seed=13)
    ref = _adamw_cwd_by_hand(params, grads, 1e-2, 0.5)
    for tx in (opttx.adamw(1e-2, weight_decay=0.5, cautious_weight_decay=True),
               opttx.chain(opttx.scale_by_adam(), opttx.add_decayed_weights(0.5, cautious=True),
                           opttx.scale_by_learning_rate(1e-2))):
        ours = _run(tx, params, grads)
        for a, b in zip(ours, ref):
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-13, atol=1e-13)
    plain = _run(opttx.adamw(1e-2, weight_decay=0.5), params, grads)
    assert not torch.allclose(plain[-1]["w"], ref[-1]["w"], rtol=0, atol=1e-6)


def test_cautious_lion_equals_the_paper_rule_float64() -> None:
    params = _params(14)
    grads = _grads(params, STEPS, seed=15)
    lr, wd, b1, b2 = 1e-2, 0.3, 0.9, 0.99
    ours = _run(opttx.lion(lr, b1, b2, weight_decay=wd, cautious_weight_decay=True), params,
                grads)
    x, m = dict(params), {k: torch.zeros_like(v) for k, v in params.items()}
    for t, g in enumerate(grads):
        for k in x:
            u = torch.sign(b1 * m[k] + (1 - b1) * g[k])
            m[k] = b2 * m[k] + (1 - b2) * g[k]
            x[k] = x[k] - lr * (u + wd * (u * x[k] >= 0).to(x[k].dtype) * x[k])
            torch.testing.assert_close(ours[t][k], x[k], rtol=1e-13, atol=1e-13)


def test_cautious_muon_masks_the_orthogonalized_update() -> None:
    gen = torch.Generator().manual_seed(16)
    params = {"layers.0.fc.weight": torch.randn(6, 4, generator=gen, dtype=torch.float64)}
    g = _grads(params, 1, seed=17)[0]
    lr, wd = 0.02, 0.5
    ours = _run(opttx.muon(lr, weight_decay=wd, cautious_weight_decay=True), params, [g])[0]
    direction = _run(opttx.muon(1.0, weight_decay=0.0), params, [g])[0]
    w = params["layers.0.fc.weight"]
    u = w - direction["layers.0.fc.weight"]        # Muon's scaled orthogonalized update
    want = w - lr * (u + wd * (u * w >= 0).to(w.dtype) * w)
    torch.testing.assert_close(ours["layers.0.fc.weight"], want, rtol=1e-12, atol=1e-12)


def test_cautious_decay_of_a_zero_update_and_a_nan() -> None:
    p = {"w": torch.tensor([1.0, -1.0, 2.0, -2.0])}
    g = {"w": torch.tensor([0.0, 0.0, -1.0, float("nan")])}
    tx = opttx.add_decayed_weights(0.5, cautious=True)
    out, _ = tx.update(g, tx.init(p), p)
    # u = 0: decayed (0·x >= 0); u·x < 0: not decayed; a NaN update stays NaN
    assert out["w"][:3].tolist() == [0.5, -0.5, -1.0]
    assert math.isnan(out["w"][3])
