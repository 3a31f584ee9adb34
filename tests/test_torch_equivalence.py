"""opttx's first-order aliases give torch.optim's numbers, over 20 steps, on drawn trees and
hyperparameters: float32 max relative error <= 1e-5 (relative to each leaf's magnitude over
the run) and float64 <= 1e-10 (relative to its final value) on the parameters,
through the functional path and through opttx.Optimizer. In float64 the displacement
(params after − params before) must agree to 1e-9 too, which checks the update itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform

STEPS = 20
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass
class Case:
    """One optimizer: how to build opttx's and torch's from the same drawn hyperparameters."""
    name: str
    hparams: Any                                  # hypothesis strategy of a dict
    ours: Callable[[dict], opttx.GradientTransformation]
    theirs: Callable[[list, dict], torch.optim.Optimizer]


lr = st.floats(1e-4, 1e-1)
beta = st.floats(0.0, 0.99)
beta2 = st.floats(0.9, 0.9999)
eps = st.sampled_from([1e-8, 1e-6, 1e-3])
wd = st.sampled_from([0.0, 1e-3, 0.1])


def with_l2(wd_value: float, tx: opttx.GradientTransformation) -> opttx.GradientTransformation:
    """torch.optim's coupled ``weight_decay``: add wd·p to the gradient first."""
    return opttx.chain(opttx.add_decayed_weights(wd_value), tx) if wd_value else tx


CASES = [
    Case("sgd", st.fixed_dictionaries({"lr": lr, "momentum": st.sampled_from([0.0, 0.5, 0.9]),
                                       "nesterov": st.booleans(), "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.sgd(h["lr"], momentum=h["momentum"] or None,
                                              nesterov=h["nesterov"] and h["momentum"] > 0)),
         lambda p, h: torch.optim.SGD(p, lr=h["lr"], momentum=h["momentum"],
                                      nesterov=h["nesterov"] and h["momentum"] > 0,
                                      weight_decay=h["wd"])),
    Case("adam", st.fixed_dictionaries({"lr": lr, "b1": beta, "b2": beta2, "eps": eps,
                                        "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.adam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"])),
         lambda p, h: torch.optim.Adam(p, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                       weight_decay=h["wd"])),
    Case("adamw", st.fixed_dictionaries({"lr": lr, "b1": beta, "b2": beta2, "eps": eps,
                                         "wd": wd}),
         lambda h: opttx.adamw(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                               weight_decay=h["wd"]),
         lambda p, h: torch.optim.AdamW(p, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                        weight_decay=h["wd"])),
    Case("nadam", st.fixed_dictionaries({"lr": lr, "b1": beta, "b2": beta2, "eps": eps,
                                         "md": st.sampled_from([4e-3, 1e-2]), "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.nadam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                                momentum_decay=h["md"])),
         lambda p, h: torch.optim.NAdam(p, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                                        momentum_decay=h["md"], weight_decay=h["wd"])),
    Case("adagrad", st.fixed_dictionaries({"lr": lr, "iav": st.sampled_from([0.0, 0.1]),
                                           "eps": st.sampled_from([1e-10, 1e-6]),
                                           "lr_decay": st.sampled_from([0.0, 0.01]), "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.adagrad(
             (lambda t: h["lr"] / (1 + t.double() * h["lr_decay"])) if h["lr_decay"] else h["lr"],
             initial_accumulator_value=h["iav"], eps=h["eps"], eps_in_sqrt=False)),
         lambda p, h: torch.optim.Adagrad(p, lr=h["lr"], lr_decay=h["lr_decay"],
                                          initial_accumulator_value=h["iav"], eps=h["eps"],
                                          weight_decay=h["wd"])),
    Case("rmsprop", st.fixed_dictionaries({"lr": st.floats(1e-4, 1e-2), "alpha": beta2,
                                           "eps": eps, "centered": st.booleans(),
                                           "momentum": st.sampled_from([0.0, 0.9]), "wd": wd}),
         lambda h: with_l2(h["wd"], opttx.rmsprop(
             h["lr"], decay=h["alpha"], eps=h["eps"], eps_in_sqrt=False,
             centered=h["centered"], momentum=h["momentum"] or None)),
         lambda p, h: torch.optim.RMSprop(p, lr=h["lr"], alpha=h["alpha"], eps=h["eps"],
                                          centered=h["centered"], momentum=h["momentum"],
                                          weight_decay=h["wd"])),
]
IDS = [c.name for c in CASES]


def run_torch(case: Case, hparams: dict, tree: dict, grads: list[dict]) -> dict:
    # torch.optim keeps scalar state (NAdam's mu_product) in the default dtype: make that
    # float64 for float64 runs so the reference is computed at the precision we test.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(next(iter(tree.values())).dtype)
    try:
        params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
        opt = case.theirs(list(params.values()), hparams)
        for g in grads:
            for k, p in params.items():
                p.grad = g[k].clone()
            opt.step()
    finally:
        torch.set_default_dtype(previous)
    return {k: p.detach() for k, p in params.items()}


def run_opttx_optimizer(case: Case, hparams: dict, tree: dict, grads: list[dict]) -> dict:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    opt = opttx.Optimizer(params.items(), case.ours(hparams))
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def check(case: Case, hparams: dict, drawn, path: str) -> None:
    tree = drawn.tree
    dtype = next(iter(tree.values())).dtype
    grads = gradient_stream(tree, STEPS, seed=drawn.seed + 1)
    expected = run_torch(case, hparams, tree, grads)
    if path == "functional":
        actual, _ = run_transform(case.ours(hparams), tree, grads)
    else:
        actual = run_opttx_optimizer(case, hparams, tree, grads)
    tol = TOLERANCE[dtype]
    if dtype == torch.float32:
        # relative to the leaf's magnitude over the run (start or end): a leaf that ends near
        # zero would turn last-bit float32 differences into large ratios
        for k in tree:
            scale = max(float(tree[k].abs().max()), float(expected[k].abs().max()))
            assert_trees_close(actual[k], expected[k], rtol=tol, atol=tol * scale,
                               what=f"{case.name} params[{k}]")
    else:
        assert_trees_close(actual, expected, rtol=tol, what=f"{case.name} params")
    if dtype == torch.float64:
        moved = {k: actual[k] - tree[k] for k in tree}
        moved_ref = {k: expected[k] - tree[k] for k in tree}
        assert_trees_close(moved, moved_ref, rtol=1e-9, what=f"{case.name} displacement")


@pytest.mark.parametrize("path", ["functional", "optimizer"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_equals_torch_optim(case: Case, dtype: torch.dtype, path: str) -> None:
    @given(drawn=param_trees(dtypes=(dtype,)), hparams=case.hparams)
    def prop(drawn, hparams):
        check(case, hparams, drawn, path)
    prop()


def test_adam_state_equals_torch_state() -> None:
    """Not only the parameters: Adam's moments equal torch's exp_avg and exp_avg_sq."""
    gen = torch.Generator().manual_seed(0)
    tree = {"w": torch.randn(5, 3, generator=gen, dtype=torch.float64),
            "b": torch.randn(3, generator=gen, dtype=torch.float64)}
    grads = gradient_stream(tree, STEPS, seed=1)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    ref = torch.optim.Adam(params.values(), lr=1e-2)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        ref.step()
    _, state = run_transform(opttx.adam(1e-2), tree, grads)
    adam_state = state[0]
    assert int(adam_state.count) == STEPS
    for k, p in params.items():
        assert_trees_close(adam_state.mu[k], ref.state[p]["exp_avg"], rtol=1e-12)
        assert_trees_close(adam_state.nu[k], ref.state[p]["exp_avg_sq"], rtol=1e-12)
