"""`opttx.optim`'s torch.optim classes: a one-word swap from ``torch.optim``.

* every class has torch's constructor signature (names, order, kinds, defaults);
* every configuration of torch's OptimizerInfo database (differentiable excluded) gives
  torch.optim's numbers over 20 steps with an LR scheduler, within float32 rounding
  (``rtol=1e-5``): the opttx links round ``lr * update``, the bias corrections and the
  decoupled decay as separate float32 products where torch fuses them into one ``addcdiv_``
  with a Python-double step size (some configurations are bitwise, e.g. Adam with amsgrad,
  RAdam and Adamax without a scheduler, but not as a rule, so none is asserted bitwise);
* the param groups hold torch's keys (plus opttx's ``tx`` and ``transform``) and
  ``defaults`` is torch's dict;
* Muon (2-D parameters only, not run by tests/test_torch_generic.py) against
  ``torch.optim.Muon``, with its errors;
* the existing forms keep opttx's defaults: ``opttx.Optimizer(p, opttx.adamw, lr=...)`` has
  optax's weight decay 1e-4, ``opttx.optim.AdamW`` torch's 1e-2.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import opttx
import opttx.optim
from opttx.optim import torch_names

common = pytest.importorskip("torch.testing._internal.common_optimizers",
                             reason="torch's OptimizerInfo database (needs expecttest)")

NAMES = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "NAdam", "RAdam", "Adamax",
         "Adafactor", "Muon"]
INFOS = {info.optim_cls.__name__: info for info in common.optim_db
         if info.optim_cls.__name__ in NAMES}

@pytest.mark.parametrize("name", NAMES)
def test_signature_is_torchs(name: str) -> None:
    ours = inspect.signature(getattr(opttx.optim, name).__init__).parameters
    theirs = inspect.signature(getattr(torch.optim, name).__init__).parameters
    assert list(ours) == list(theirs)
    for key, p in theirs.items():
        assert ours[key].kind == p.kind, key
        assert ours[key].default == p.default, key
        assert type(ours[key].default) is type(p.default), key


def _shapes(name: str) -> list[tuple[int, ...]]:
    return [(6, 5), (4, 3)] if name == "Muon" else [(6, 5), (7,), (2, 3, 4)]


@pytest.mark.parametrize("name", NAMES)
def test_numbers_are_torchs(name: str) -> None:
    for optim_input in INFOS[name].optim_inputs_func(device="cpu"):
        kwargs = optim_input.kwargs
        if kwargs.get("differentiable", False):
            continue
        ours, ref, ps, qs = _side_by_side(name, kwargs, steps=20, gamma=0.5)
        assert sorted(set(ours.param_groups[0]) - {"tx", "transform"}) == \
            sorted(ref.param_groups[0])
        assert ours.defaults.keys() == ref.defaults.keys()
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=kwargs: f"{name} {k}: {m}")


def _side_by_side(name: str, kwargs: dict, steps: int, gamma: float) -> tuple:
    """``opttx.optim.<name>`` and ``torch.optim.<name>`` built with ``kwargs`` on the same
    parameters, stepped ``steps`` times on the same gradients with a StepLR(4, ``gamma``)
    each: (ours, theirs, our params, their params)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in _shapes(name)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = getattr(opttx.optim, name)(ps, **copy.deepcopy(kwargs))
    ref = getattr(torch.optim, name)(qs, **copy.deepcopy(kwargs))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=gamma) for o in (ours, ref)]
    for _ in range(steps):
        for p, q in zip(ps, qs):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        for s in scheds:
            s.step()
    return ours, ref, ps, qs


def test_sgd_is_torchs_bit_for_bit() -> None:
    """``opttx.optim.SGD`` writes ``p.add_(b, alpha=-lr)`` as torch does (the learning rate
    folded into the write, `opttx.update_deferring_scale`) and forms Nesterov's
    ``g + momentum·b`` in one fused add: every configuration of torch's database
    (differentiable excluded), and momentum 0.95 with lr 3e-4, give torch.optim.SGD's numbers
    bit for bit over 30 eager steps with a scheduler."""
    inputs = [o.kwargs for o in INFOS["SGD"].optim_inputs_func(device="cpu")
              if not o.kwargs.get("differentiable", False)]
    inputs += [{"lr": 3e-4, "momentum": 0.95, "nesterov": nesterov, "weight_decay": 0.1}
               for nesterov in (False, True)]
    inputs += [{"lr": 3e-4, "momentum": 0.999, "dampening": 0.3, "maximize": True}]
    for kwargs in inputs:
        _, _, ps, qs = _side_by_side("SGD", kwargs, steps=30, gamma=0.7)
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, rtol=0, atol=0,
                                       msg=lambda m, k=kwargs: f"SGD {k}: {m}")


def test_muon_errors_are_torchs() -> None:
    for bad, message in [({"lr": -1.0}, "Learning rate should be >= 0 but is: -1.0"),
                         ({"momentum": -0.5}, "momentum should be >= 0 but is: -0.5"),
                         ({"adjust_lr_fn": "x"}, "Adjust learning rate function x is not")]:
        for cls in (torch.optim.Muon, opttx.optim.Muon):
            with pytest.raises(ValueError, match=message):
                cls([torch.nn.Parameter(torch.randn(3, 2))], **bad)
    for cls in (torch.optim.Muon, opttx.optim.Muon):
        with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
            cls([torch.nn.Parameter(torch.randn(3))])
        p = torch.nn.Parameter(torch.randn(3, 2))
        opt = cls([p])
        p.grad = torch.randn(3, 2).to_sparse()
        with pytest.raises(RuntimeError, match="Muon does not support sparse gradients"):
            opt.step()


def test_refusals_are_torchs() -> None:
    """Sparse gradients where torch refuses them, complex parameters for Adafactor, a tensor
    lr with foreach: the same error types and messages as torch's classes."""
    cases = [("Adam", {}, "sparse"), ("AdamW", {}, "sparse"), ("RMSprop", {}, "sparse"),
             ("Adagrad", {"weight_decay": 0.1}, "sparse"), ("Adafactor", {}, "sparse"),
             ("Adafactor", {}, "complex"), ("NAdam", {}, "sparse")]
    for name, kwargs, what in cases:
        messages = []
        for module in (torch.optim, opttx.optim):
            if what == "complex":
                p = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.complex64))
                p.grad = torch.randn_like(p)
            else:
                p = torch.nn.Parameter(torch.randn(3, 2))
                p.grad = torch.randn(3, 2).to_sparse()
            opt = getattr(module, name)([p], **kwargs)
            with pytest.raises(RuntimeError) as raised:
                opt.step()
            messages.append(str(raised.value))
        assert messages[0] == messages[1], (name, messages)
    for module in (torch.optim, opttx.optim):
        with pytest.raises(ValueError, match="lr as a Tensor is not supported for "
                                             "capturable=False and foreach=True"):
            module.Adam([torch.nn.Parameter(torch.randn(2))], lr=torch.tensor(1e-3),
                        foreach=True)
    with pytest.raises(NotImplementedError, match="differentiable=True"):
        opttx.optim.SGD([torch.nn.Parameter(torch.randn(2))], differentiable=True)


def test_existing_forms_keep_opttx_defaults() -> None:
    p = [torch.nn.Parameter(torch.randn(3))]
    assert opttx.Optimizer(p, opttx.adamw, lr=1e-3).param_groups[0]["weight_decay"] == 1e-4
    assert opttx.optim.AdamW(p).param_groups[0]["weight_decay"] == 1e-2
    assert opttx.Optimizer(p, opttx.rmsprop, lr=1e-3).param_groups[0]["alpha"] == 0.9
    assert opttx.optim.RMSprop(p).param_groups[0]["alpha"] == 0.99
    assert opttx.optim.Optimizer is opttx.Optimizer


def test_scheduled_momentum_and_group_keys_follow_torch() -> None:
    """OneCycleLR cycles lr and momentum (SGD) / betas (AdamW) in both: same numbers."""
    for name, kwargs in [("SGD", {"lr": 0.1, "momentum": 0.9}), ("AdamW", {"lr": 1e-2})]:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(4, 3))]
        qs = [torch.nn.Parameter(ps[0].detach().clone())]
        ours, ref = getattr(opttx.optim, name)(ps, **kwargs), getattr(torch.optim, name)(
            qs, **kwargs)
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=12)
                  for o in (ours, ref)]
        for _ in range(10):
            g = torch.randn(4, 3)
            ps[0].grad, qs[0].grad = g.clone(), g.clone()
            ours.step()
            ref.step()
            for s in scheds:
                s.step()
        key = "momentum" if name == "SGD" else "betas"
        assert ours.param_groups[0][key] == ref.param_groups[0][key]
        torch.testing.assert_close(ps[0], qs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["SGD", "AdamW", "Adagrad", "Adafactor", "Muon"])
def test_compiled_step_is_one_graph(name: str) -> None:
    """``torch.compile(opt.step)`` of a torch-named class is one graph with an LR scheduler
    attached, recompiled never over scheduled steps, and equals the eager step."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    torch.manual_seed(0)
    shapes = [(4, 3), (3, 2)] if name == "Muon" else [(4, 3), (3,)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    cls = getattr(opttx.optim, name)
    compiled, eager = cls(ps, lr=1e-2), cls(qs, lr=1e-2)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (compiled, eager)]
    counter = CompileCounter()
    step = torch.compile(compiled.step, backend=counter)
    for _ in range(5):
        for p, q in zip(ps, qs):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        step()
        eager.step()
        for s in scheds:
            s.step()
    assert counter.frame_count == 1, counter.frame_count
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


FACTORIES = {
    "SGD": (lambda: torch_names.torch_sgd(1e-2, 0.9, weight_decay=0.01), {}),
    "Adam": (lambda: torch_names.torch_adam(1e-3, weight_decay=0.01, amsgrad=True), {}),
    "AdamW": (lambda: torch_names.torch_adam(1e-3, weight_decay=0.01,
                                             decoupled_weight_decay=True), {}),
    "RMSprop": (lambda: torch_names.torch_rmsprop(1e-2, momentum=0.9, centered=True), {}),
    "Adagrad": (lambda: torch_names.torch_adagrad(1e-2, lr_decay=0.1), {}),
    "NAdam": (lambda: torch_names.torch_nadam(2e-3, weight_decay=0.01), {}),
    "RAdam": (lambda: torch_names.torch_radam(1e-3, weight_decay=0.01), {}),
    "Adamax": (lambda: torch_names.torch_adamax(2e-3), {}),
    "Adafactor": (lambda: torch_names.torch_adafactor(1e-2, weight_decay=0.01), {}),
    # bfloat16 Newton-Schulz rounds with the batch under vmap (as opttx.muon's)
    "Muon": (lambda: torch_names.torch_muon(1e-2), {"matrices_only": True,
                                                    "skip": ("stacked",)}),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factories_keep_the_transform_contract(name: str) -> None:
    """The chains behind the classes pass opttx's conformance checks (purity, donation, no
    aliasing, checkpoint and optimizer resume, one compiled graph, injected
    hyperparameters, ...)."""
    from opttx.conformance import check_transform
    make, options = FACTORIES[name]
    tx = make()
    check_transform(make, factory=tx.recipe.factory,
                    kwargs={"learning_rate": tx.recipe.arguments["learning_rate"]}, **options)
