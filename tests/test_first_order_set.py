"""torch.optim's remaining first-order set: RAdam, Adamax, AMSGrad (Adam's and AdamW's flag),
SGD's dampening equal torch.optim over 20 steps on drawn trees and hyperparameters (float32
<= 1e-5 relative to each leaf's magnitude, float64 <= 1e-10), through the functional path and
through `opttx.Optimizer`'s drop-in builder (torch's keyword names); AdaBelief, RAdam and
Adamax with optax's defaults equal optax (jax on CPU, float64 enabled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform
import optax_reference

STEPS = 20
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}

lr = st.floats(1e-4, 1e-1)
beta = st.floats(0.0, 0.99)
beta2 = st.floats(0.5, 0.9999)
eps = st.sampled_from([1e-8, 1e-6, 1e-3])
wd = st.sampled_from([0.0, 1e-3, 0.1])


@dataclass
class Case:
    name: str
    hparams: Any                                      # strategy of a dict
    ours: Callable[[dict], opttx.GradientTransformation]
    theirs: Callable[[list, dict], torch.optim.Optimizer]
    builder: Callable[[dict], tuple[Callable, dict]]  # (opttx factory, torch's keywords)


def with_l2(wd_value: float, tx: opttx.GradientTransformation) -> opttx.GradientTransformation:
    return opttx.chain(opttx.add_decayed_weights(wd_value), tx) if wd_value else tx


def _radam_torch_kwargs(h: dict) -> dict:
    return dict(lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], weight_decay=h["wd"],
                decoupled_weight_decay=h["decoupled"])


TORCH_CASES = [
    Case("radam",
         st.fixed_dictionaries({"lr": lr, "b1": beta, "b2": beta2, "eps": eps, "wd": wd,
                                "decoupled": st.booleans()}),
         lambda h: opttx.radam(h["lr"], h["b1"], h["b2"], h["eps"], weight_decay=h["wd"],
                               decoupled_weight_decay=h["decoupled"], eps_before_debias=True),
         lambda p, h: torch.optim.RAdam(p, **_radam_torch_kwargs(h)),
         lambda h: (opttx.radam, {**_radam_torch_kwargs(h), "eps_before_debias": True})),
    Case("adamax",
         st.fixed_dictionaries({"lr": lr, "b1": beta, "b2": beta2, "eps": eps, "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.adamax(h["lr"], h["b1"], h["b2"], h["eps"])),
         lambda p, h: torch.optim.Adamax(p, lr=h["lr"], betas=(h["b1"], h["b2"]),
                                         eps=h["eps"], weight_decay=h["wd"]),
         None),
    Case("adam_amsgrad",
         st.fixed_dictionaries({"lr": lr, "b1": beta, "b2": beta2, "eps": eps, "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.adam(h["lr"], h["b1"], h["b2"], h["eps"],
                                               amsgrad=True)),
         lambda p, h: torch.optim.Adam(p, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                       weight_decay=h["wd"], amsgrad=True),
         None),
    Case("adamw_amsgrad",
         st.fixed_dictionaries({"lr": lr, "b1": beta, "b2": beta2, "eps": eps, "wd": wd}),
         lambda h: opttx.adamw(h["lr"], h["b1"], h["b2"], h["eps"], weight_decay=h["wd"],
                               amsgrad=True),
         lambda p, h: torch.optim.AdamW(p, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                        weight_decay=h["wd"], amsgrad=True),
         lambda h: (opttx.adamw, dict(lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                      weight_decay=h["wd"], amsgrad=True))),
    Case("sgd_dampening",
         st.fixed_dictionaries({"lr": lr, "momentum": st.sampled_from([0.5, 0.9]),
                                "dampening": st.sampled_from([0.1, 0.5, 0.9, 1.0]), "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.sgd(h["lr"], momentum=h["momentum"],
                                              dampening=h["dampening"])),
         lambda p, h: torch.optim.SGD(p, lr=h["lr"], momentum=h["momentum"],
                                      dampening=h["dampening"], weight_decay=h["wd"]),
         lambda h: (opttx.sgd, dict(lr=h["lr"], momentum=h["momentum"],
                                    dampening=h["dampening"]))),
]


def run_torch(case: Case, hparams: dict, tree: dict, grads: list[dict]) -> dict:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = case.theirs(list(params.values()), hparams)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def run_builder(case: Case, hparams: dict, tree: dict, grads: list[dict]) -> dict:
    """``opttx.Optimizer(params, factory, **torch_keywords)``: the drop-in with torch's names."""
    factory, kwargs = case.builder(hparams)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = opttx.Optimizer(list(params.values()), factory, **kwargs)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def check_close(actual: dict, expected: dict, tree: dict, what: str) -> None:
    dtype = next(iter(tree.values())).dtype
    tol = TOLERANCE[dtype]
    if dtype == torch.float32:
        for k in tree:
            scale = max(float(tree[k].abs().max()), float(expected[k].abs().max()))
            assert_trees_close(actual[k], expected[k], rtol=tol, atol=tol * scale,
                               what=f"{what} params[{k}]")
    else:
        assert_trees_close(actual, expected, rtol=tol, what=f"{what} params")
        moved = {k: actual[k] - tree[k] for k in tree}
        moved_ref = {k: expected[k] - tree[k] for k in tree}
        assert_trees_close(moved, moved_ref, rtol=1e-9, what=f"{what} displacement")


@pytest.mark.parametrize("case", TORCH_CASES, ids=[c.name for c in TORCH_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_equals_torch_optim(case: Case, dtype: torch.dtype) -> None:
    @settings(max_examples=10, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,)), hparams=case.hparams)
    def prop(drawn, hparams):
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        expected = run_torch(case, hparams, drawn.tree, grads)
        actual, _ = run_transform(case.ours(hparams), drawn.tree, grads)
        check_close(actual, expected, drawn.tree, case.name)
    prop()


BUILDER_CASES = [c for c in TORCH_CASES if c.builder is not None]


@pytest.mark.parametrize("case", BUILDER_CASES, ids=[c.name for c in BUILDER_CASES])
def test_drop_in_builder_takes_torch_keywords(case: Case) -> None:
    """``opttx.Optimizer(params, opttx.adamw, amsgrad=True, ...)``,
    ``opttx.Optimizer(params, opttx.sgd, dampening=...)`` and RAdam's
    ``decoupled_weight_decay`` reach the alias and give torch's numbers (float64)."""
    hparams = {"radam": dict(lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, wd=0.1, decoupled=True),
               "adamw_amsgrad": dict(lr=1e-2, b1=0.8, b2=0.95, eps=1e-8, wd=0.1),
               "sgd_dampening": dict(lr=1e-2, momentum=0.9, dampening=0.5, wd=0.0)}[case.name]
    gen = torch.Generator().manual_seed(3)
    tree = {"w": torch.randn(4, 3, generator=gen, dtype=torch.float64),
            "b": torch.randn(3, generator=gen, dtype=torch.float64)}
    grads = gradient_stream(tree, STEPS, seed=4)
    check_close(run_builder(case, hparams, tree, grads), run_torch(case, hparams, tree, grads),
                tree, case.name + " (Optimizer)")


def test_amsgrad_state_is_torchs_max_exp_avg_sq() -> None:
    gen = torch.Generator().manual_seed(0)
    tree = {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64)}
    grads = gradient_stream(tree, STEPS, seed=1, scale=1.0)
    # gradients that shrink, so the running maximum differs from the current moment
    grads = [{k: v * 0.8 ** i for k, v in g.items()} for i, g in enumerate(grads)]
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    ref = torch.optim.Adam(params.values(), lr=1e-2, betas=(0.5, 0.9), amsgrad=True)
    for g in grads:
        params["w"].grad = g["w"].clone()
        ref.step()
    _, state = run_transform(opttx.adam(1e-2, b1=0.5, b2=0.9, amsgrad=True), tree, grads)
    adam_state = state[0]
    assert isinstance(adam_state, opttx.ScaleByAmsgradState)
    torch_state = ref.state[params["w"]]
    assert_trees_close(adam_state.nu_max["w"], torch_state["max_exp_avg_sq"], rtol=1e-12)
    assert_trees_close(adam_state.nu["w"], torch_state["exp_avg_sq"], rtol=1e-12)
    assert not torch.equal(adam_state.nu_max["w"], adam_state.nu["w"])


def test_flags_off_keep_the_plain_states() -> None:
    """amsgrad and dampening off: the states (and so checkpoints) of adam and sgd are those
    they always had (their numbers are pinned bitwise by tests/test_golden.py)."""
    tree = {"w": torch.zeros(2, 2)}
    assert type(opttx.adam(1e-2).init(tree)[0]) is opttx.ScaleByAdamState
    assert type(opttx.sgd(1e-2, momentum=0.9).init(tree)[0]) is opttx.TraceState
    assert type(opttx.sgd(1e-2, momentum=0.9, dampening=0.5).init(tree)[0]) is \
        opttx.DampedTraceState


def test_dampening_first_step_takes_the_whole_gradient() -> None:
    tree = {"w": torch.zeros(3, dtype=torch.float64)}
    g = {"w": torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)}
    tx = opttx.trace(0.9, dampening=0.75)
    state = tx.init(tree)
    u1, state = tx.update(g, state)
    assert torch.equal(u1["w"], g["w"])
    u2, state = tx.update(g, state)
    assert torch.allclose(u2["w"], 0.9 * g["w"] + 0.25 * g["w"], rtol=0, atol=1e-15)


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="dampening"):
        opttx.trace(0.9, dampening=1.5)
    with pytest.raises(ValueError, match="dampening"):
        opttx.sgd(0.1, dampening=0.5)
    with pytest.raises(ValueError, match="threshold"):
        opttx.scale_by_radam(threshold=-1.0)
    with pytest.raises(ValueError, match="b2"):
        opttx.scale_by_adamax(b2=1.0)
    with pytest.raises(ValueError, match="eps"):
        opttx.scale_by_belief(eps=-1.0)
    with pytest.raises(TypeError, match="amsgrad"):
        opttx.scale_by_adam(amsgrad="yes")


# ---------------------------------------------------------------------------------------------
# optax
# ---------------------------------------------------------------------------------------------

OPTAX_CASES = {
    "adabelief": (lambda o, h: o.adabelief(h["lr"], h["b1"], h["b2"], nesterov=h["nesterov"]),
                  lambda h: opttx.adabelief(h["lr"], h["b1"], h["b2"], nesterov=h["nesterov"])),
    "adabelief_paper_eps": (
        lambda o, h: o.adabelief(h["lr"], h["b1"], h["b2"], eps=1e-8, eps_root=0.0),
        lambda h: opttx.adabelief(h["lr"], h["b1"], h["b2"], eps=1e-8, eps_root=0.0)),
    "radam": (lambda o, h: o.radam(h["lr"], h["b1"], h["b2"], nesterov=h["nesterov"]),
              lambda h: opttx.radam(h["lr"], h["b1"], h["b2"], nesterov=h["nesterov"])),
    "adamax": (lambda o, h: o.adamax(h["lr"], h["b1"], h["b2"]),
               lambda h: opttx.adamax(h["lr"], h["b1"], h["b2"])),
}


def run_optax(tx: Any, tree: dict, grads: list[dict]) -> dict:
    return optax_reference.run_optax(tx, tree, grads, jit=False)[0]


@pytest.mark.parametrize("name", list(OPTAX_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_equals_optax(name: str, dtype: torch.dtype) -> None:
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)
    theirs, ours = OPTAX_CASES[name]
    # b1 >= 0.5: with b1 near 0 AdaBelief's prediction error g - m is a cancellation (m is
    # almost g), and optax's (1-b1)·g + b1·m and torch's lerp round it differently; the
    # belief then sits at eps_root and the step at g / 1e-8, amplifying that last-bit noise
    hparams = st.fixed_dictionaries({"lr": lr, "b1": st.floats(0.5, 0.99), "b2": beta2,
                                     "nesterov": st.booleans()})

    @settings(max_examples=5, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,)), h=hparams)
    def prop(drawn, h):
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        expected = run_optax(theirs(optax, h), drawn.tree, grads)
        actual, _ = run_transform(ours(h), drawn.tree, grads)
        check_close(actual, expected, drawn.tree, name)
    prop()
