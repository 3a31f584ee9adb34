"""PyTorch's generic optimizer tests, run against `opttx.optim`'s torch.optim classes.

torch's own test suite checks every ``torch.optim`` class with the same generic tests
(``TestOptimRenewed`` in torch's ``test/test_optim.py``) over the configurations of its
OptimizerInfo database (``torch.testing._internal.common_optimizers.optim_db``, which the
installed torch ships). This file takes the configurations and error inputs from that database
as they are and runs the tests that apply to a CPU optimizer against ``opttx.optim.SGD``,
``Adam``, ``AdamW``, ``RMSprop``, ``Adagrad``, ``NAdam``, ``RAdam``, ``Adamax``,
``Adafactor`` and ``Muon`` (torch's classes of the same names, built on opttx transforms): each test's
class is ``opttx.optim.X`` where torch's is ``torch.optim.X``. The test bodies are written here
(torch's test file is not installed); each makes the assertions torch's test of the same name
makes, and skips what torch's database skips on CPU.

Not run here, and why (torch's test name: reason):

* test_optim_infos_do_not_specify_global_cliquey_kwargs: checks torch's database, not an
  optimizer.
* test_fused_error_on_params_on_meta: an optimizer built on meta-device parameters keeps a
  meta-device state here (torch builds its state lazily at the first step), so it cannot
  step after ``to_empty``; fused or not, build the optimizer after materializing the model.
* test_state_dict_with_cuda_params, test_forloop_goes_right_direction_multigpu,
  test_cpu_load_state_dict, test_fused_large_tensor, test_fused_does_not_step_if_foundinf,
  test_foreach_large_tensor, test_peak_memory_foreach,
  test_mixed_device_dtype, test_defaults_changed_to_foreach, test_fused_cpu_matches_cuda:
  CUDA-only or about torch's three implementations (forloop/foreach/fused); opttx has one
  (grouped kernels), and ``foreach``/``fused``/``capturable`` are accepted, checked as torch
  checks them, and change no number.
* test_rosenbrock_sparse with an LR scheduler: only without (the sparse equality is the
  point; the scheduler path is the dense one, tested above).
* test_adamw_serialization: loading AdamW's state dict into Adam (and back) is refused here:
  ``decoupled_weight_decay`` is a configuration of the group's transform, whose state has
  another structure, and `opttx.Optimizer.load_state_dict` refuses a state made by another
  transform (torch flips the group's flag).
* test_second_order_optims_return_consistent_types: LBFGS only (not in opttx.optim).
* test_set_default_dtype_works_with_foreach, test_differentiable_*: ``differentiable=True``
  raises NotImplementedError (opttx steps under no_grad); its configurations are skipped.

``Muon`` (2-D parameters only) runs every test with a second weight where the others have
a bias, and torch's bias-free ``Linear`` where they have a convolution model, as torch's
tests give it. ``Adadelta``, ``ASGD``, ``Rprop``, ``LBFGS`` and ``SparseAdam`` have no opttx
counterpart. Each optimizer's numbers against torch.optim itself are in
``tests/test_torch_optim_names.py``.
"""

from __future__ import annotations

import copy
import functools
import tempfile
import unittest
from typing import Any

import pytest
import torch
from torch.nn import Parameter

import opttx
import opttx.optim

common = pytest.importorskip("torch.testing._internal.common_optimizers",
                             reason="torch's OptimizerInfo database (needs expecttest)")
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

# ---------------------------------------------------------------------------------------------
# the classes under test: opttx.optim's, where torch's tests take torch.optim's
# ---------------------------------------------------------------------------------------------

OURS = {name: getattr(opttx.optim, name)
        for name in ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax",
                     "Adafactor", "Muon")}
INFOS = {info.optim_cls.__name__: info for info in common.optim_db
         if info.optim_cls.__name__ in OURS}
NAMES = sorted(OURS)


def _second(name: str, rows: int = 10, cols: int = 5, noncontiguous: bool = False
            ) -> Parameter:
    """The tests' second parameter: a bias of ``rows``, or for Muon (2-D parameters only, as
    torch's tests treat it) a second ``(rows, cols)`` weight."""
    shape = (rows, cols) if name == "Muon" else (rows,)
    if noncontiguous:
        return Parameter(torch.randn(*shape, 2)[..., 0])
    return Parameter(torch.randn(*shape))


def _out(w: torch.Tensor, b: torch.Tensor, inpt: torch.Tensor) -> torch.Tensor:
    """``w x + b`` (a second weight ``b``: ``w x + b x``)."""
    return w.mv(inpt) + (b.mv(inpt) if b.dim() == 2 else b)


def _skips(info: Any) -> bool:
    """Whether a ``DecorateInfo`` skips its test (a ``unittest.skip``; not a tolerance
    override) when active on CPU."""
    active = getattr(info, "active_if", True)
    if callable(active):
        try:
            active = active({"device": "cpu", "dtype": torch.float32})
        except Exception:  # noqa: BLE001 - a condition on other inputs: not for this run
            active = False
    if not active:
        return False
    for decorator in getattr(info, "decorators", ()):
        try:
            decorator(lambda *args, **kwargs: None)()
        except unittest.SkipTest:
            return True
        except Exception:  # noqa: BLE001, S112 - a wrapper that wants a test's arguments
            continue
    return False


def skipped_by_torch(name: str, test: str) -> bool:
    """Whether torch's database skips ``test`` for optimizer ``name`` on CPU (its
    ``DecorateInfo`` skips for TestOptimRenewed that apply to every device or to CPU)."""
    for decorator in INFOS[name].decorators or ():
        if (getattr(decorator, "test_name", None) == test
                and getattr(decorator, "cls_name", None) in (None, "TestOptimRenewed")
                and getattr(decorator, "device_type", None) in (None, "cpu")
                and _skips(decorator)):
            return True
    return False


def applies(name: str, test: str) -> None:
    if skipped_by_torch(name, test):
        pytest.skip(f"torch's OptimizerInfo skips {test} for {name}")


@pytest.fixture(autouse=True)
def _skips_of_torch(request: pytest.FixtureRequest) -> None:
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "name" in callspec.params:
        applies(callspec.params["name"], request.node.originalname)


def configurations(name: str, *, cliquey: bool = True, skip: tuple = ("differentiable",),
                   dtype: torch.dtype = torch.float32) -> list[tuple[type, dict]]:
    """torch's configurations of optimizer ``name`` (with the global flags foreach/fused/...
    as torch's tests add them): (our class, kwargs)."""
    info = INFOS[name]
    if cliquey:
        inputs = common._get_optim_inputs_including_global_cliquey_kwargs(
            "cpu", dtype, info, skip=skip)
    else:
        inputs = info.optim_inputs_func(device="cpu")
    out = [(OURS[name], optim_input.kwargs) for optim_input in inputs
           if not optim_input.kwargs.get("differentiable", False)]
    assert out, f"no configuration of {name}"
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


@pytest.mark.parametrize("name", NAMES)
def test_errors(name: str) -> None:
    """torch's test_errors: every error input of torch's database raises the error type torch
    raises, with a message matching torch's regex (or warns as torch warns)."""
    import re
    import warnings
    info = INFOS[name]
    checked = 0
    for error_input in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        optim_input = error_input.optimizer_error_input
        regex = error_input.error_regex
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                optimizer = OURS[name](optim_input.params, **optim_input.kwargs)
                if error_input.error_on == common.OptimizerErrorEnum.STEP_ERROR:
                    optimizer.step()
            except Exception as e:  # noqa: BLE001 - compared below
                assert isinstance(e, error_input.error_type), (regex, e)
                assert re.search(regex, str(e)), (regex, e)
                checked += 1
                continue
        assert issubclass(error_input.error_type, Warning), f"no error: {regex}"
        assert any(isinstance(w.message, error_input.error_type) and
                   re.search(regex, str(w.message)) for w in caught), regex
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("with_lrsched", [True, False])
def test_forloop_goes_right_direction(name: str, contiguous: bool, with_lrsched: bool) -> None:
    info = INFOS[name]
    for schedulers_c in (info.scheduler_inputs if with_lrsched else [None]):
        for cls, kwargs in configurations(name, cliquey=False):
            torch.manual_seed(0)
            if contiguous:
                weight, bias = Parameter(torch.randn(10, 5)), _second(name)
            else:
                weight = Parameter(torch.randn(10, 5, 2)[..., 0])
                bias = _second(name, noncontiguous=True)
            inpt = torch.randn(5)
            optimizer = cls([weight, bias], **fresh(kwargs))
            schedulers = [s(optimizer) for s in (schedulers_c or [])]

            def closure():
                optimizer.zero_grad()
                loss = _out(weight, bias, inpt).pow(2).sum()
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
        weight, bias = Parameter(torch.randn(10, 5)), _second(name)
        inpt = torch.randn(5)
        optimizer = OURS[name]([{"params": [weight]}, {"params": [bias], "lr": 0.01}])
        schedulers = [s(optimizer) for s in schedulers_c]

        def closure():
            optimizer.zero_grad()
            loss = _out(weight, bias, inpt).pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(20):
            loss = optimizer.step(closure)
            for s in schedulers:
                s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
        assert closure().item() < initial


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("num_dim", [0, 1, 2])
def test_tensor_lr(name: str, num_dim: int) -> None:
    for cls, kwargs in configurations(name):
        torch.manual_seed(0)
        weight, bias = Parameter(torch.randn(10, 5)), _second(name)
        weight_c = weight.detach().clone().requires_grad_(True)
        bias_c = bias.detach().clone().requires_grad_(True)
        inpt = torch.randn(5)
        kwargs = fresh(kwargs)
        kwargs["lr"] = 1e-3
        optimizer_r = cls([weight, bias], **kwargs)
        kwargs["lr"] = torch.tensor(1e-3).reshape([1] * num_dim)
        try:
            optimizer = cls([weight_c, bias_c], **kwargs)
        except ValueError as e:      # torch's refusal (foreach=True without capturable)
            assert "lr as a Tensor is not supported" in str(e)
            continue

        def closure(optim, w, b, i):
            optim.zero_grad()
            loss = _out(w, b, i).pow(2).sum()
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
        weight, bias = Parameter(torch.randn(10, 5)), _second(name)
        inpt = torch.randn(5)
        optimizer = cls([dict(params=[weight], **fresh(kwargs)),
                         dict(params=[bias], **bias_kwargs)])
        loss = _out(weight, bias, inpt).pow(2).sum()
        initial = loss.item()
        for _ in range(20):
            optimizer.zero_grad()
            loss = _out(weight, bias, inpt).pow(2).sum()
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
        weight, bias = Parameter(torch.randn(10, 5)), _second(name)
        irrelevant = Parameter(torch.randn(2, 2) if name == "Muon" else torch.randn(2))
        irrelevant_clone = irrelevant.clone()
        inpt = torch.randn(5)
        optimizer = cls([dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])],
                        lr=1e-28)
        loss = _out(weight, bias, inpt).pow(2).sum()
        initial = loss.item()
        for _ in range(20):
            optimizer.zero_grad()
            loss = _out(weight, bias, inpt).pow(2).sum()
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
        if name == "Muon":
            kwargs["weight_decay"] = 0.0    # Muon decays by default (0.1)
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
    bias = _second(name, 2, 3)
    inpt = torch.randn(3, requires_grad=True)

    def fwd_bwd(optim, w, b, i):
        optim.zero_grad()
        loss = _out(w, b, i).pow(2).sum()
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


def _conv_model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """torch's model and input for the state-dict tests (Muon: a bias-free Linear, as
    torch's tests give it)."""
    torch.manual_seed(1)
    if name == "Muon":
        return torch.nn.Linear(10, 4, bias=False), torch.rand(10)
    return (torch.nn.Sequential(torch.nn.Conv2d(4, 2, 1, stride=2),
                                torch.nn.BatchNorm2d(2, eps=1e-05, momentum=0.1)),
            torch.rand(1, 4, 16, 16))


@pytest.mark.parametrize("name", NAMES)
def test_can_load_older_state_dict(name: str) -> None:
    for cls, kwargs in configurations(name):
        model, inpt = _conv_model(name)
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
        model, inpt = _conv_model(name)

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
            assert optimizer2.state_dict()["param_groups"][0]["param_names"] == (
                ["weight"] if name == "Muon" else ["0.weight", "0.bias", "1.weight", "1.bias"])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("named", [True, False])
def test_save_load_equality_with_weights_only(name: str, named: bool) -> None:
    torch.manual_seed(0)
    weight, bias = Parameter(torch.randn(2, 3)), _second(name, 2, 3)
    inpt = torch.randn(3, requires_grad=True)
    for cls, kwargs in configurations(name):
        optimizer = cls(_named([weight, bias], named), **fresh(kwargs))

        def closure():
            optimizer.zero_grad()
            loss = _out(weight, bias, inpt).pow(2).sum()
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
    params = [torch.tensor([[1.0, 1.0]]) if name == "Muon" else torch.tensor([1.0, 1.0])]
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
    model = torch.nn.Linear(5, 5, bias=name != "Muon")
    inpt = torch.rand(2, 5)
    for cls, kwargs in configurations(name, cliquey=False):
        optim = cls(model.parameters(), **fresh(kwargs))
        optim.zero_grad()
        model(inpt).sum().backward()
        optim.step()
        for state in optim.state.values():
            assert len(state) > 0


FOREACH = [n for n in NAMES if "foreach" in INFOS[n].supported_impls]
FUSED_ON_CPU = [n for n in NAMES if "fused" in INFOS[n].supported_impls
                and "cpu" in INFOS[n].supports_fused_on]


def _derived_matches_forloop(name: str, flag: str, dtype: torch.dtype) -> None:
    """torch's ``_test_derived_optimizers``: ``flag=True`` and ``False`` give the same
    parameters and states over 7 steps of a small MLP plus a 0-dim parameter, with a layer
    frozen for two steps and a step without gradients. One implementation here, so this
    checks that the flag changes nothing and that those steps (a 0-dim leaf, gradients set
    to None) run."""
    for optim_input in INFOS[name].optim_inputs_func(device="cpu"):
        models, optimizers = [], []
        for value in (False, True):
            kwargs = dict(fresh(optim_input.kwargs), **{flag: value})
            torch.manual_seed(1)
            model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(),
                                        torch.nn.Linear(3, 1), torch.nn.Sigmoid()).to(dtype)
            empty = torch.empty((), dtype=dtype, requires_grad=True)
            empty.grad = torch.rand_like(empty)
            models.append(model)
            optimizers.append(OURS[name](list(model.parameters()) + [empty], **kwargs))
        inpt = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=dtype).reshape(3, 2)
        for i in range(7):
            for model, optimizer in zip(models, optimizers):
                optimizer.zero_grad()
                if i == 3:
                    model[2].requires_grad_(False)
                if i == 5:
                    model[2].requires_grad_(True)
                if i != 2:
                    model(inpt).sum().backward()
                optimizer.step()
            for p, q in zip(models[0].parameters(), models[1].parameters()):
                assert torch.equal(p, q), (name, optim_input.kwargs, i)
                mine, theirs = optimizers[0].state[p], optimizers[1].state[q]
                assert mine.keys() == theirs.keys()
                for key in mine:
                    assert torch.equal(mine[key], theirs[key]), (name, key)


@pytest.mark.parametrize("name", FOREACH)
def test_foreach_matches_forloop(name: str) -> None:
    """torch's test: ``foreach`` on and off, float64 (see `_derived_matches_forloop`)."""
    _derived_matches_forloop(name, "foreach", torch.float64)


@pytest.mark.parametrize("name", FUSED_ON_CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16], ids=["f32", "f64", "bf16", "f16"])
def test_fused_matches_forloop(name: str, dtype: torch.dtype) -> None:
    """torch's test on CPU: ``fused`` on and off (see `_derived_matches_forloop`)."""
    _derived_matches_forloop(name, "fused", dtype)


@pytest.mark.parametrize("name", NAMES)
def test_load_nontensor_step(name: str) -> None:
    """torch's test: a state dict whose per-parameter ``"step"`` entries are Python numbers
    loads and steps. opttx keeps no per-parameter step (one int32 count per group, under
    ``"shared."``), so the state dict has none to convert; the load and step must work."""
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
    for cls, kwargs in configurations(name):
        optimizer = cls(params, **fresh(kwargs))
        for _ in range(3):
            optimizer.step()
        state_dict = copy.deepcopy(optimizer.state_dict())
        for entries in state_dict["state"].values():
            assert "step" not in entries
        optimizer.load_state_dict(state_dict)
        optimizer.step()

# ---------------------------------------------------------------------------------------------
# complex parameters and sparse gradients (torch's test_complex, test_complex_2d,
# test_rosenbrock_sparse)
# ---------------------------------------------------------------------------------------------


COMPLEX = [n for n in NAMES if INFOS[n].supports_complex]
SPARSE = [n for n in NAMES if INFOS[n].supports_sparse]


@pytest.mark.parametrize("name", COMPLEX)
def test_complex(name: str) -> None:
    """A complex parameter steps as its real view does in the same optimizer, every step."""
    for cls, kwargs in configurations(name, skip=("differentiable", "fused"),
                                      dtype=torch.complex64):
        torch.manual_seed(0)
        complex_params = [torch.randn(10, 5, dtype=torch.complex64, requires_grad=True),
                          torch.randn(10, dtype=torch.complex64, requires_grad=True),
                          torch.randn(10, 5, dtype=torch.float32, requires_grad=True)]
        real_params = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone()
                       .requires_grad_() for p in complex_params]
        complex_opt = cls(complex_params, **fresh(kwargs))
        real_opt = cls(real_params, **fresh(kwargs))
        for _ in range(3):
            grads = [torch.randn_like(p) for p in real_params]
            for p, g in zip(real_params, grads):
                p.grad = g.clone()
            for p, g in zip(complex_params, grads):
                p.grad = torch.view_as_complex(g.clone()) if p.is_complex() else g.clone()
            real_opt.step()
            complex_opt.step()
            as_real = [torch.view_as_real(p) if p.is_complex() else p for p in complex_params]
            for a, b in zip(as_real, real_params):
                torch.testing.assert_close(a, b, msg=lambda m: f"{name} {kwargs}: {m}")


@pytest.mark.parametrize("name", COMPLEX)
def test_complex_2d(name: str) -> None:
    """A complex 2-vector steps as its real and imaginary parts given as two real parameters:
    the same losses and gradients before each step, the same values after it (torch's test,
    on Rosenbrock's function of the complex vector)."""
    for cls, kwargs in configurations(name, skip=("differentiable", "fused"),
                                      dtype=torch.complex64):
        torch.manual_seed(0)
        a1 = torch.randn(2, dtype=torch.complex64, requires_grad=True)
        a1_real = a1.real.detach().clone().requires_grad_()
        a1_imag = a1.imag.detach().clone().requires_grad_()
        optim1 = cls([a1], **fresh(kwargs))
        optim2 = cls([a1_real, a1_imag], **fresh(kwargs))
        for _ in range(3):
            optim1.zero_grad()
            loss1 = _rosenbrock(a1).abs()
            loss1.backward()
            optim2.zero_grad()
            torch.testing.assert_close(a1.real, a1_real)
            torch.testing.assert_close(a1.imag, a1_imag)
            loss2 = _rosenbrock(torch.complex(a1_real, a1_imag)).abs()
            torch.testing.assert_close(loss1, loss2)
            loss2.backward()
            torch.testing.assert_close(a1.grad.real, a1_real.grad)
            torch.testing.assert_close(a1.grad.imag, a1_imag.grad)
            optim1.step()
            optim2.step()
            torch.testing.assert_close(a1.real, a1_real, msg=lambda m: f"{name} {kwargs}: {m}")
            torch.testing.assert_close(a1.imag, a1_imag)


def _rosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2


def _drosenbrock(t: torch.Tensor) -> torch.Tensor:
    x, y = t
    return torch.stack((-400 * x * (y - x ** 2) - 2 * (1 - x), 200 * (y - x ** 2)))


ROSENBROCK_STEPS = 1800     # torch's (the final direction check needs them all)


@pytest.mark.parametrize("name", SPARSE)
def test_rosenbrock_sparse(name: str) -> None:
    """Cyclic coordinate descent on Rosenbrock's function with uncoalesced sparse gradients
    equals the same optimizer on the dense gradients, step by step, and ends closer to the
    minimum (torch's test). Over torch's configurations without the global flags (the
    ``foreach`` variants change no number here, only the test's parameter count): the test is
    1800 steps of two optimizers per configuration."""
    info = INFOS[name]
    kwarg_updates, _ = info.metadata_for_sparse
    inputs = info.optim_inputs_func(device="cpu")
    supported, seen = [], set()
    for optim_input in inputs:
        kwargs = dict(optim_input.kwargs)
        for k in kwarg_updates:
            kwargs.pop(k, None)
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if kwargs and key not in seen:
            seen.add(key)
            if "lr" in kwarg_updates:
                kwargs["lr"] = kwarg_updates["lr"]
            supported.append(kwargs)
    assert supported
    for kwargs in supported:
        multi = kwargs.get("foreach", False)
        params_t = [torch.tensor([1.5, 1.5]), torch.tensor([1.5, 1.5], dtype=torch.float64)] \
            if multi else [torch.tensor([1.5, 1.5])]
        params = [Parameter(t) for t in params_t]
        params_c = [Parameter(t.clone()) for t in params_t]
        optimizer = OURS[name](params, **fresh(kwargs))
        optimizer_c = OURS[name](params_c, **fresh(kwargs))
        solution = torch.tensor([1, 1])
        with torch.no_grad():
            initial = sum(p.dist(solution) for p in params)

        def grad_of(param, sparse, w):
            grad = _drosenbrock(param)
            if sparse:
                if w:
                    i, x = torch.tensor([[0, 0]]), grad[0]
                    v = torch.tensor([x / 4.0, x - x / 4.0])
                else:
                    i, y = torch.tensor([[1, 1]]), grad[1]
                    v = torch.tensor([y - y / 4.0, y / 4.0])
                return torch.sparse_coo_tensor(i, v, (2,), dtype=v.dtype)
            return torch.tensor([grad[0], 0] if w else [0, grad[1]], dtype=param.dtype)

        def closure(ps, sparse, w, opt):
            opt.zero_grad()
            loss = sum(_rosenbrock(p) for p in ps) if multi else _rosenbrock(ps[0])
            loss.backward()
            grads = [grad_of(p, sparse, w) for p in ps]
            with torch.no_grad():
                ps[0].grad = grads[0]
                if multi:
                    ps[1].grad = grads[1].to(dtype=torch.float64)
            return loss

        for i in range(ROSENBROCK_STEPS):
            w = i % 2
            optimizer.step(functools.partial(closure, params, True, w, optimizer))
            optimizer_c.step(functools.partial(closure, params_c, False, w, optimizer_c))
            for p, q in zip(params, params_c):
                torch.testing.assert_close(p, q, atol=5e-6, rtol=5e-6)
        with torch.no_grad():
            if not kwargs.get("maximize", False):
                assert sum(p.dist(solution) for p in params) <= initial
            else:
                assert sum(_rosenbrock(p) for p in params) >= \
                    sum(_rosenbrock(t) for t in params_t)
