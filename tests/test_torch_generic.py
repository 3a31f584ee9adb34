"""PyTorch's generic optimizer tests, run against `opttx.Optimizer`-backed torch.optim classes.

torch's own test suite checks every ``torch.optim`` class with the same generic tests
(``TestOptimRenewed`` in torch's ``test/test_optim.py``) over the configurations of its
OptimizerInfo database (``torch.testing._internal.common_optimizers.optim_db``, which the
installed torch ships). This file takes the configurations from that database as they are and
runs the tests that apply to a CPU optimizer against drop-in classes built on opttx: each
class takes torch's constructor arguments and is `opttx.Optimizer` over an alias with torch's
numbers. The test bodies are written here; each makes the assertions torch's test of the same
name makes.

Not applicable here, and why (torch's test name: reason):

* test_optim_infos_do_not_specify_global_cliquey_kwargs: checks torch's database, not an
  optimizer.
* test_errors (adapted): the checks of torch.optim.Optimizer itself (params, duplicate
  parameters, names) keep torch's messages and are asserted as torch does; the
  hyperparameter checks are opttx's own, with its own messages (tests/test_errors.py), so
  only the error type is asserted; torch's refusals of configurations opttx supports (a
  tensor ``lr`` with ``foreach`` and no ``capturable``, ``betas`` mixing floats and tensors)
  do not apply.
* test_rosenbrock_sparse: sparse gradients are not supported by opttx (dense leaves only).
* test_complex, test_complex_2d: complex parameters are not supported by opttx.
* test_load_nontensor_step: opttx keeps no per-parameter ``"step"``; the step count is one
  int32 tensor per group (``"shared.<path>.count"``), so there is no float step to load.
* test_state_dict_with_cuda_params, test_forloop_goes_right_direction_multigpu,
  test_cpu_load_state_dict, test_fused_*, test_foreach_*, test_peak_memory_foreach,
  test_mixed_device_dtype, test_defaults_changed_to_foreach, test_fused_cpu_matches_cuda:
  CUDA-only or about torch's three implementations (forloop/foreach/fused); opttx has one
  (grouped kernels), and ``foreach``/``fused``/``capturable`` are accepted and ignored.
* test_second_order_optims_return_consistent_types: LBFGS only.
* test_set_default_dtype_works_with_foreach, test_differentiable_*: ``differentiable=True``
  is refused (opttx steps under no_grad).

Configurations that do not apply (skipped input by input): ``amsgrad=True`` (Adam/AdamW),
SGD ``dampening != 0``, Adagrad ``lr_decay != 0``, ``differentiable=True``: opttx has no
such option yet.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from typing import Any

import pytest
import torch
from torch.nn import Parameter

import opttx
from opttx.optim.optimizer import _torch_arguments

common = pytest.importorskip("torch.testing._internal.common_optimizers",
                             reason="torch's OptimizerInfo database (needs expecttest)")
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# ---------------------------------------------------------------------------------------------
# the opttx-backed classes: torch's arguments, opttx's aliases with torch's numbers
# ---------------------------------------------------------------------------------------------


# the roles of the test factories' hyperparameters: torch's param-group keys (opttx.declare)
LR, B1, B2 = opttx.HyperRole.LEARNING_RATE, opttx.HyperRole.B1, opttx.HyperRole.B2
MOM, WD, EPS = opttx.HyperRole.MOMENTUM, opttx.HyperRole.WEIGHT_DECAY, opttx.HyperRole.EPS


class NotApplicable(Exception):
    """A configuration opttx has no counterpart for."""


def _maximized(links: list, maximize: bool) -> opttx.GradientTransformation:
    # torch negates the gradient first (weight decay then adds to the negated gradient)
    return opttx.chain(opttx.scale(-1.0), *links) if maximize else opttx.chain(*links)


@opttx.declare(hyperparams={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS,
                            "weight_decay": WD})
def adamw_torch(learning_rate: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 1e-2, maximize: bool = False):
    return _maximized([opttx.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)],
                      maximize)


@opttx.declare(hyperparams={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS,
                            "weight_decay": WD})
def adam_torch(learning_rate: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.0, maximize: bool = False,
               decoupled_weight_decay: bool = False):
    if decoupled_weight_decay:
        return adamw_torch(learning_rate, b1, b2, eps, weight_decay, maximize)
    return _maximized([opttx.add_decayed_weights(weight_decay),
                       opttx.adam(learning_rate, b1, b2, eps)], maximize)


@opttx.declare(hyperparams={"learning_rate": LR, "momentum": MOM, "weight_decay": WD})
def sgd_torch(learning_rate: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
              nesterov: bool = False, maximize: bool = False):
    return _maximized([opttx.add_decayed_weights(weight_decay),
                       opttx.sgd(learning_rate, momentum, nesterov=nesterov)], maximize)


@opttx.declare(hyperparams={"learning_rate": LR, "weight_decay": WD, "eps": EPS,
                            "initial_accumulator_value": None})
def adagrad_torch(learning_rate: float = 1e-2, weight_decay: float = 0.0,
                  initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                  maximize: bool = False):
    return _maximized([opttx.add_decayed_weights(weight_decay),
                       opttx.adagrad(learning_rate, initial_accumulator_value, eps,
                                     eps_in_sqrt=False)], maximize)


@opttx.declare(hyperparams={"learning_rate": LR, "decay": opttx.HyperRole.RMS_DECAY, "eps": EPS,
                            "weight_decay": WD, "momentum": MOM})
def rmsprop_torch(learning_rate: float = 1e-2, decay: float = 0.99, eps: float = 1e-8,
                  weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False,
                  maximize: bool = False):
    # torch's order: the momentum buffer holds g / sqrt(v) and the learning rate scales it
    # afterwards (opttx.rmsprop, as optax's, puts the momentum after the learning rate: the
    # same numbers while lr is constant, not under a scheduler)
    direction = (opttx.scale_by_stddev if centered else opttx.scale_by_rms)(
        decay, eps, eps_in_sqrt=False)
    return _maximized([opttx.add_decayed_weights(weight_decay), direction,
                       opttx.trace(decay=momentum),
                       opttx.scale_by_learning_rate(learning_rate)], maximize)


@opttx.declare(hyperparams={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD,
                            "momentum_decay": None})
def nadam_torch(learning_rate: float = 2e-3, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, momentum_decay: float = 4e-3,
                decoupled_weight_decay: bool = False, maximize: bool = False):
    direction = opttx.scale_by_nadam(b1, b2, eps, momentum_decay)
    if decoupled_weight_decay:
        links = [direction, opttx.add_decayed_weights(weight_decay),
                 opttx.scale_by_learning_rate(learning_rate)]
    else:
        links = [opttx.add_decayed_weights(weight_decay), direction,
                 opttx.scale_by_learning_rate(learning_rate)]
    return _maximized(links, maximize)


# OPTTX_GENERIC_FORM=built runs every test on the built form (Optimizer(params,
# factory(...)) with the groups' keys as torch gives them) instead of the factory form
BUILT = os.environ.get("OPTTX_GENERIC_FORM", "factory") == "built"

_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable")
_STATIC = ("maximize", "nesterov", "centered", "decoupled_weight_decay")
_TORCH_NAMES = {"lr": "learning_rate", "alpha": "decay"}


class _TorchLike(opttx.Optimizer):
    """torch.optim's constructor over an opttx factory (class attribute ``factory``)."""

    factory: Any = None
    refused: dict[str, Any] = {}          # argument -> the only value opttx supports

    @classmethod
    def _translate(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in kwargs.items():
            if key in _IMPLEMENTATION_FLAGS:
                continue                    # one implementation: grouped kernels
            if key == "differentiable":
                if value:
                    raise NotApplicable("differentiable=True")
                continue
            if key in cls.refused:
                if value != cls.refused[key]:
                    raise NotApplicable(f"{key}={value!r}")
                continue
            if key == "alpha":
                key = "decay"
            out[key] = value
        return out

    def __init__(self, params: Any, **kwargs: Any) -> None:
        outer = self._translate(kwargs)
        if BUILT:
            # the built form: the transform built with the constructor's arguments, the
            # groups' keys (lr, betas, maximize, nesterov, ...) left to opttx.Optimizer
            if params is not None and not isinstance(params, torch.Tensor):
                params = [self._built_group(g) if isinstance(g, dict) else g
                          for g in list(params)]
            factory = type(self).factory
            super().__init__(params, factory(**_torch_arguments(factory, outer)))
            return
        if params is not None and not isinstance(params, torch.Tensor):
            params = list(params)
            if params and isinstance(params[0], dict):
                params = [self._group(g, outer) for g in params]
        super().__init__(params, type(self).factory, **outer)

    @classmethod
    def _built_group(cls, group: dict) -> dict:
        cls._translate({k: v for k, v in group.items() if k not in ("params", "param_names")})
        return {k: v for k, v in group.items() if k not in cls.refused}

    @classmethod
    def _group(cls, group: dict, outer: dict) -> dict:
        group = dict(group)
        own = cls._translate({k: v for k, v in group.items()
                              if k not in ("params", "param_names")})
        for key in list(group):
            if key in _IMPLEMENTATION_FLAGS or key in cls.refused or key == "differentiable":
                del group[key]
        if "alpha" in group:
            group["decay"] = group.pop("alpha")
        static = {k: v for k, v in own.items() if k in _STATIC}
        if any(outer.get(k, False) != v for k, v in static.items()):
            # another structure (maximize, nesterov, ...): the group gets its own transform
            args = {**outer, **own}
            if "betas" in args:
                args["b1"], args["b2"] = args.pop("betas")
            args = {_TORCH_NAMES.get(k, k): v for k, v in args.items()}
            group["tx"] = opttx.inject_hyperparams(cls.factory,
                                                   hyperparam_dtype=torch.float32)(**args)
        for key in static:
            group.pop(key)
        return group


class AdamW(_TorchLike):
    factory = staticmethod(adamw_torch)
    refused = {"amsgrad": False}


class Adam(_TorchLike):
    factory = staticmethod(adam_torch)
    refused = {"amsgrad": False}


class SGD(_TorchLike):
    factory = staticmethod(sgd_torch)
    refused = {"dampening": 0}


class Adagrad(_TorchLike):
    factory = staticmethod(adagrad_torch)
    refused = {"lr_decay": 0}


class RMSprop(_TorchLike):
    factory = staticmethod(rmsprop_torch)


class NAdam(_TorchLike):
    factory = staticmethod(nadam_torch)


OURS = {cls.__name__: cls for cls in (AdamW, Adam, SGD, Adagrad, RMSprop, NAdam)}
INFOS = {info.optim_cls.__name__: info for info in common.optim_db
         if info.optim_cls.__name__ in OURS}
NAMES = sorted(OURS)


def configurations(name: str, *, cliquey: bool = True, skip: tuple = ("differentiable",)
                   ) -> list[tuple[type, dict]]:
    """torch's configurations of optimizer ``name`` (with the global flags foreach/fused/...
    as torch's tests add them) that opttx supports: (our class, kwargs)."""
    info = INFOS[name]
    if cliquey:
        inputs = common._get_optim_inputs_including_global_cliquey_kwargs(
            "cpu", torch.float32, info, skip=skip)
    else:
        inputs = info.optim_inputs_func(device="cpu")
    out = []
    for optim_input in inputs:
        try:
            OURS[name]._translate(optim_input.kwargs)
        except NotApplicable:
            continue
        out.append((OURS[name], optim_input.kwargs))
    assert out, f"no configuration of {name} applies"
    return out


def assert_equal(a: Any, b: Any, path: str = "") -> None:
    """torch's TestCase.assertEqual on nested state dicts: same structure, tensors equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        torch.testing.assert_close(a, b, msg=lambda m: f"{path}: {m}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, a, b)
        for k in a:
            assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def fresh(kwargs: dict) -> dict:
    return copy.deepcopy(kwargs)    # tensor lrs are mutated by schedulers


# ---------------------------------------------------------------------------------------------
# the tests (torch's names; torch's assertions)
# ---------------------------------------------------------------------------------------------


# torch refuses these configurations; opttx supports them (tensor hyperparameters anywhere)
_SUPPORTED_HERE = ("as a Tensor is not supported", "betas must be either both floats")
# checks made by torch.optim.Optimizer itself: same messages
_TORCH_BASE_CHECKS = ("params argument given", "duplicate parameters",
                      "more than one parameter group", "with/without names")


@pytest.mark.parametrize("name", NAMES)
def test_errors(name: str) -> None:
    import re
    import warnings
    info = INFOS[name]
    checked = 0
    for error_input in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        optim_input = error_input.optimizer_error_input
        regex = error_input.error_regex
        if any(s in regex for s in _SUPPORTED_HERE):
            continue
        try:
            OURS[name]._translate(optim_input.kwargs)
        except NotApplicable:
            continue
        base = any(s in regex for s in _TORCH_BASE_CHECKS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                optimizer = OURS[name](optim_input.params, **optim_input.kwargs)
                if error_input.error_on == common.OptimizerErrorEnum.STEP_ERROR:
                    optimizer.step()
            except Exception as e:  # noqa: BLE001 - compared below
                assert isinstance(e, error_input.error_type), (regex, e)
                assert not base or re.search(regex, str(e)), (regex, e)
                checked += 1
                continue
        assert issubclass(error_input.error_type, Warning), f"no error: {regex}"
        assert any(isinstance(w.message, error_input.error_type) and
                   re.search(regex, str(w.message)) for w in caught), regex
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("with_lrsched", [True, False])
def test_forloop_goes_right_direction(name: str, contiguous: bool, with_lrsched: bool) -> None:
    info = INFOS[name]
    for schedulers_c in (info.scheduler_inputs if with_lrsched else [None]):
        for cls, kwargs in configurations(name, cliquey=False):
            torch.manual_seed(0)
            if contiguous:
                weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
            else:
                weight = Parameter(torch.randn(10, 5, 2)[..., 0])
                bias = Parameter(torch.randn(10, 2)[..., 0])
            inpt = torch.randn(5)
            optimizer = cls([weight, bias], **fresh(kwargs))
            schedulers = [s(optimizer) for s in (schedulers_c or [])]

            def closure():
                optimizer.zero_grad()
                loss = (weight.mv(inpt) + bias).pow(2).sum()
                loss.backward()
                return loss

            initial = closure().item()
            for _ in range(20):
                loss = closure()
                optimizer.step()
                for s in schedulers:
                    s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
            if kwargs.get("maximize", False):
                assert closure().item() > initial
            else:
                assert closure().item() < initial


@pytest.mark.parametrize("name", NAMES)
def test_param_group_with_lrscheduler_goes_right_direction(name: str) -> None:
    for schedulers_c in INFOS[name].scheduler_inputs:
        torch.manual_seed(0)
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        inpt = torch.randn(5)
        optimizer = OURS[name]([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
        schedulers = [s(optimizer) for s in schedulers_c]

        def closure():
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = optimizer.step(closure)
            for s in schedulers:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert closure().item() < initial


@pytest.mark.parametrize("name", NAMES)
def test_tensor_lr(name: str) -> None:
    for cls, kwargs in configurations(name):
        torch.manual_seed(0)
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        weight_c = weight.detach().clone().requires_grad_(True)
        bias_c = bias.detach().clone().requires_grad_(True)
        inpt = torch.randn(5)
        kwargs = fresh(kwargs)
        kwargs["lr"] = 1e-3
        optimizer_r = cls([weight, bias], **kwargs)
        kwargs["lr"] = torch.tensor(1e-3)
        optimizer = cls([weight_c, bias_c], **kwargs)

        def closure(optim, w, b, i):
            optim.zero_grad()
            loss = (w.mv(i) + b).pow(2).sum()
            loss.backward()
            return loss

        for _ in range(5):
            closure(optimizer_r, weight, bias, inpt)
            closure(optimizer, weight_c, bias_c, inpt)
            optimizer_r.step()
            optimizer.step()
            torch.testing.assert_close(weight, weight_c)
            torch.testing.assert_close(bias, bias_c)


@pytest.mark.parametrize("name", NAMES)
def test_param_groups_weight_decay(name: str) -> None:
    for cls, kwargs in configurations(name):
        torch.manual_seed(0)
        bias_kwargs = fresh(kwargs)
        bias_kwargs["weight_decay"] = 0.0
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        inpt = torch.randn(5)
        optimizer = cls([dict(params=[weight], **fresh(kwargs)),
                         dict(params=[bias], **bias_kwargs)])
        loss = (weight.mv(inpt) + bias).pow(2).sum()
        initial = loss.item()
        for _ in range(20):
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            optimizer.step()
        if kwargs.get("maximize", False):
            assert loss.item() > initial
        else:
            assert loss.item() < initial


@pytest.mark.parametrize("name", NAMES)
def test_param_groups_lr(name: str) -> None:
    for cls, kwargs in configurations(name):
        torch.manual_seed(0)
        kwargs = fresh(kwargs)
        if "lr" not in kwargs or kwargs["lr"] == 0:
            kwargs["lr"] = 1e-3
        weight, bias = Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))
        irrelevant = Parameter(torch.randn(2))
        irrelevant_clone = irrelevant.clone()
        inpt = torch.randn(5)
        optimizer = cls([dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])],
                        lr=1e-28)
        loss = (weight.mv(inpt) + bias).pow(2).sum()
        initial = loss.item()
        for _ in range(20):
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            irrelevant.grad = torch.rand_like(irrelevant)
            optimizer.step()
        if kwargs.get("maximize", False):
            assert loss.item() > initial
        else:
            assert loss.item() < initial
        torch.testing.assert_close(irrelevant, irrelevant_clone)


@pytest.mark.parametrize("name", NAMES)
def test_step_is_noop_when_params_have_no_grad(name: str) -> None:
    params = [torch.randn(2, 3) for _ in range(2)]
    old = [p.detach().clone() for p in params]
    for cls, kwargs in configurations(name, skip=()):
        optimizer = cls(params, **fresh(kwargs))
        optimizer.step(lambda: torch.tensor([1.0]))
        for p, o in zip(params, old):
            assert torch.equal(p, o)


@pytest.mark.parametrize("name", NAMES)
def test_step_is_noop_for_zero_grads(name: str) -> None:
    param = torch.randn(5, 1, requires_grad=True)
    old = param.detach().clone()
    for cls, kwargs in configurations(name, skip=()):
        kwargs = fresh(kwargs)
        if kwargs.get("weight_decay", 0) != 0:
            continue            # torch's test: weight decay moves params without gradients
        if name == "AdamW":
            kwargs["lr"] = torch.tensor(1e-5) if isinstance(kwargs.get("lr", 1e-5),
                                                            torch.Tensor) else 1e-5
        optimizer = cls([param], **kwargs)
        param.grad = torch.zeros_like(param)
        optimizer.step(lambda: torch.tensor([1.0]))
        torch.testing.assert_close(old, param.detach())


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_can_be_printed(name: str) -> None:
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for cls, kwargs in configurations(name, skip=()):
        assert type(cls(params, **fresh(kwargs)).__repr__()) is str


def _named(params: list, named: bool) -> list:
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _without_param_names(state_dict: dict) -> dict:
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        group.pop("param_names", None)
    return state_dict


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_state_dict_deterministic(name: str, named0: bool, named1: bool) -> None:
    torch.manual_seed(0)
    weight = Parameter(torch.randn(2, 3))
    bias = Parameter(torch.randn(2))
    inpt = torch.randn(3, requires_grad=True)

    def fwd_bwd(optim, w, b, i):
        optim.zero_grad()
        loss = (w.mv(i) + b).pow(2).sum()
        loss.backward()
        return loss

    for cls, kwargs in configurations(name):
        optimizer = cls(_named([weight, bias], named0), **fresh(kwargs))
        closure = functools.partial(fwd_bwd, optimizer, weight, bias, inpt)
        for _ in range(10):
            closure()
            optimizer.step()
        with torch.no_grad():
            weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
        optimizer_c = cls(_named([weight_c, bias_c], named1), **fresh(kwargs))
        closure_c = functools.partial(fwd_bwd, optimizer_c, weight_c, bias_c, inpt)
        optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        for _ in range(10):
            closure()
            closure_c()
            optimizer.step()
            optimizer_c.step()
            torch.testing.assert_close(weight, weight_c)
            torch.testing.assert_close(bias, bias_c)
        assert_equal(_without_param_names(optimizer.state_dict()),
                     _without_param_names(optimizer_c.state_dict()))
        # repeated parameters have identical representation
        optimizer_c.param_groups.extend(optimizer_c.param_groups)
        assert_equal(_without_param_names(optimizer.state_dict())["param_groups"][-1],
                     _without_param_names(optimizer_c.state_dict())["param_groups"][-1])


def _conv_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2),
                               torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1))


@pytest.mark.parametrize("name", NAMES)
def test_can_load_older_state_dict(name: str) -> None:
    for cls, kwargs in configurations(name):
        model = _conv_model()
        inpt = torch.rand(1, 4, 16, 16)
        optimizer = cls(model.parameters(), **fresh(kwargs))

        def fwd_bwd():
            optimizer.zero_grad()
            loss = model(inpt).sum()
            loss.backward()
            return loss

        for _ in range(3):
            fwd_bwd()
            optimizer.step()
        old = copy.deepcopy(optimizer.state_dict())
        for group in old["param_groups"]:
            for flag in INFOS[name].not_og_supported_flags:
                group.pop(flag, None)
        optimizer.load_state_dict(old)
        fwd_bwd()
        optimizer.step()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
def test_can_load_from_to_named_state_dict(name: str, named0: bool, named1: bool) -> None:
    for cls, kwargs in configurations(name):
        model = _conv_model()
        inpt = torch.rand(1, 4, 16, 16)

        def fwd_bwd(optim):
            optim.zero_grad()
            loss = model(inpt).sum()
            loss.backward()
            return loss

        optimizer = cls(model.named_parameters() if named0 else model.parameters(),
                        **fresh(kwargs))
        for _ in range(3):
            fwd_bwd(optimizer)
            optimizer.step()
        old = copy.deepcopy(optimizer.state_dict())
        optimizer2 = cls(model.named_parameters() if named1 else model.parameters(),
                         **fresh(kwargs))
        optimizer2.load_state_dict(old)
        fwd_bwd(optimizer2)
        optimizer2.step()
        if named0 or named1:
            assert optimizer2.state_dict()["param_groups"][0]["param_names"] == [
                "0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("named", [True, False])
def test_save_load_equality_with_weights_only(name: str, named: bool) -> None:
    torch.manual_seed(0)
    weight, bias = Parameter(torch.randn(2, 3)), Parameter(torch.randn(2))
    inpt = torch.randn(3, requires_grad=True)
    for cls, kwargs in configurations(name):
        optimizer = cls(_named([weight, bias], named), **fresh(kwargs))

        def closure():
            optimizer.zero_grad()
            loss = (weight.mv(inpt) + bias).pow(2).sum()
            loss.backward()
            return loss

        for _ in range(3):
            optimizer.step(closure)
        sd = optimizer.state_dict()
        with tempfile.TemporaryFile() as f:
            torch.save(sd, f)
            f.seek(0)
            assert_equal(torch.load(f, weights_only=False), sd)
            f.seek(0)
            assert_equal(torch.load(f, weights_only=True), sd)


def _state_dict_pre_hook(optimizer) -> None:
    optimizer.state["test"] = 1


def _state_dict_post_hook(optimizer, state_dict: dict) -> dict:
    if "test" in state_dict["state"]:
        state_dict["state"].pop("test")
        state_dict["ran_state_dict_pre_hook"] = True
    else:
        state_dict["ran_state_dict_pre_hook"] = False
    return state_dict


def _load_state_dict_pre_hook1(optimizer, state_dict: dict) -> None:
    state_dict["param_groups"][0]["lr"] = 0.002


def _load_state_dict_pre_hook2(optimizer, state_dict: dict) -> dict:
    mine = copy.deepcopy(state_dict)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_state_dict_post_hook(optimizer) -> None:
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_hooks(name: str) -> None:
    """torch's test_state_dict_pre_hook, _post_hook and _pre_post_hook."""
    for cls, kwargs in configurations(name, skip=()):
        param = torch.rand(2, 3, requires_grad=True)
        optim = cls([param], **fresh(kwargs))
        optim.register_state_dict_pre_hook(_state_dict_pre_hook)
        assert optim.state_dict()["state"]["test"] == 1
        optim = cls([param], **fresh(kwargs))
        optim.register_state_dict_post_hook(_state_dict_post_hook)
        assert not optim.state_dict()["ran_state_dict_pre_hook"]
        optim = cls([param], **fresh(kwargs))
        optim.register_state_dict_pre_hook(_state_dict_pre_hook)
        optim.register_state_dict_post_hook(_state_dict_post_hook)
        state_dict = optim.state_dict()
        assert "test" not in state_dict["state"]
        assert state_dict["ran_state_dict_pre_hook"]


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_hooks(name: str) -> None:
    """torch's test_load_state_dict_pre_hook_and_prepend, _post_hook and _pre_post_hook."""
    for cls, kwargs in configurations(name, skip=()):
        param = torch.rand(2, 3, requires_grad=True)
        optim = cls([param], **fresh(kwargs))
        state_dict = optim.state_dict()
        optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook1)
        optim.load_state_dict(state_dict)
        assert optim.param_groups[0]["lr"] == 0.002
        optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2, prepend=True)
        optim.load_state_dict(state_dict)
        assert optim.param_groups[0]["lr"] == 0.002

        optim = cls([param], **fresh(kwargs))
        optim.register_load_state_dict_post_hook(_load_state_dict_post_hook)
        optim.load_state_dict(optim.state_dict())
        assert not optim.state["ran_load_state_dict_pre_hook2"]
        assert optim.state["ran_load_state_dict_post_hook"]

        optim = cls([param], **fresh(kwargs))
        optim.register_load_state_dict_pre_hook(_load_state_dict_pre_hook2)
        optim.register_load_state_dict_post_hook(_load_state_dict_post_hook)
        optim.load_state_dict(optim.state_dict())
        assert optim.state["ran_load_state_dict_pre_hook2"]
        assert optim.state["ran_load_state_dict_post_hook"]


@pytest.mark.parametrize("name", NAMES)
def test_step_hooks(name: str) -> None:
    """torch's test_step_post_hook, test_step_pre_hook and test_step_all_hooks."""
    params = [torch.tensor([1.0, 1.0])]
    for cls, kwargs in configurations(name, skip=()):
        data = []
        optim = cls(params, **fresh(kwargs))
        pre = optim.register_step_pre_hook(lambda o, a, k: data.append("pre"))
        post = optim.register_step_post_hook(lambda o, a, k: data.append("post"))
        optim.step()
        optim.step()
        assert data == ["pre", "post"] * 2
        pre.remove()
        post.remove()
        optim.step()
        assert data == ["pre", "post"] * 2

        data = []
        optim2 = torch.optim.SGD(params)
        handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
                   register_optimizer_step_post_hook(lambda o, a, k: data.append(5))]
        for o in (optim, optim2):
            handles.append(o.register_step_pre_hook(lambda o, a, k: data.append(1)))
            handles.append(o.register_step_post_hook(lambda o, a, k: data.append(2)))
        optim.step()
        assert data == [0, 1, 2, 5]
        optim2.step()
        assert data == [0, 1, 2, 5] * 2
        optim.step()
        assert data == [0, 1, 2, 5] * 3
        for h in handles:
            h.remove()
        optim.step()
        optim2.step()
        assert data == [0, 1, 2, 5] * 3


@pytest.mark.parametrize("name", NAMES)
def test_deepcopy_copies_all_public_attrs(name: str) -> None:
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)

    def public(obj):
        return {k for k in obj.__dict__ if not k.startswith("_")}

    for cls, kwargs in configurations(name):
        optimizer = cls(params, **fresh(kwargs))
        for _ in range(3):
            optimizer.step()
        assert public(optimizer) == public(copy.deepcopy(optimizer))


@pytest.mark.parametrize("name", NAMES)
def test_non_empty_state(name: str) -> None:
    model = torch.nn.Linear(5, 5)
    inpt = torch.rand(2, 5)
    for cls, kwargs in configurations(name, cliquey=False):
        optim = cls(model.parameters(), **fresh(kwargs))
        optim.zero_grad()
        model(inpt).sum().backward()
        optim.step()
        for state in optim.state.values():
            assert len(state) > 0


@pytest.mark.parametrize("name", NAMES)
def test_matches_torch(name: str) -> None:
    """Not one of torch's tests: every applicable configuration against torch.optim's own
    class (the forloop implementation), 10 steps with a scheduler."""
    for cls, kwargs in configurations(name, cliquey=False):
        torch.manual_seed(0)
        params = [Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))]
        twins = [Parameter(p.detach().clone()) for p in params]
        ours = cls(params, **fresh(kwargs))
        ref = INFOS[name].optim_cls(twins, foreach=False, **fresh(kwargs))
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5)
                  for o in (ours, ref)]
        for _ in range(10):
            grads = [torch.randn_like(p) for p in params]
            for ps, o, s in ((params, ours, scheds[0]), (twins, ref, scheds[1])):
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
                o.step()
                s.step()
        for p, q in zip(params, twins):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} {kwargs}: {m}")
