"""Validation of hyperparameters and inputs, run once at construction or first use.

Hyperparameters may be Python numbers, 0-dim tensors (injected with
`opttx.inject_hyperparams`) or schedules; only Python numbers can be checked up front.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ._tracing import is_tracing
from .tree import PyTree, keystr, tree_flatten_with_path


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_FINITE = frozenset({"learning_rate", "weight_decay"})
"""Hyperparameters for which inf is never meaningful (an infinite step moves every
parameter to inf or NaN on the first update); others (a clipping threshold, a block size)
may take inf to mean "no limit"."""


def check_number(name: str, value: Any) -> None:
    """Refuse a value that is neither a number, a 0-dim tensor nor a schedule; a schedule is
    evaluated once at step 0 to check that it returns a number or a 0-dim real tensor."""
    if callable(value):
        check_schedule(name, value)
        return
    if _is_number(value):
        if math.isnan(value):
            raise ValueError(f"{name} must be a number, got nan.")
        if math.isinf(value) and name in _FINITE:
            raise ValueError(f"{name} must be finite, got {value}.")
        return
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a 0-dim tensor, got shape {tuple(value.shape)}.")
        number = tensor_value(value)
        if number is not None and math.isnan(number):
            raise ValueError(f"{name} must be a number, got a tensor holding nan.")
        if number is not None and math.isinf(number) and name in _FINITE:
            raise ValueError(f"{name} must be finite, got a tensor holding {number}.")
        return
    raise TypeError(f"{name} must be a number, a 0-dim tensor or a schedule, "
                    f"got {type(value).__name__}.")


def tensor_value(value: torch.Tensor) -> float | None:
    """The number a 0-dim hyperparameter tensor holds, where reading it costs no device
    synchronisation: a real CPU tensor, outside a compiled region (None otherwise: a tensor
    on an accelerator, a traced or batched one). About 0.3 us on CPU, so the 0-dim tensors
    `opttx.inject_hyperparams` passes the factory at every step are checked at every step."""
    if (is_tracing() or not value.is_cpu or value.is_complex()
            or value.dtype == torch.bool):
        return None
    try:
        return float(value.item())
    except (RuntimeError, TypeError):        # a functorch-wrapped or fake tensor
        return None


def _value(value: Any) -> Any:
    """A hyperparameter as a number where it can be read (Python numbers; CPU tensors, see
    `tensor_value`), else None."""
    if _is_number(value):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return tensor_value(value)
    return None


def check_schedule(name: str, fn: Any) -> None:
    """Evaluate the schedule ``fn`` at step 0 (a 0-dim int32 tensor) and refuse a value that
    is not a number or a 0-dim real tensor (a schedule that forgot to return, returns a
    string or a tensor of shape (1,)). A schedule that raises on the probe is left to fail
    where it is used."""
    try:
        value = fn(torch.zeros((), dtype=torch.int32))
    except Exception:  # noqa: BLE001 - not ours to judge here; update will raise it
        return
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"the {name} schedule returned a tensor of shape "
                             f"{tuple(value.shape)} at step 0; a schedule returns a number or "
                             "a 0-dim tensor (use x.reshape(()) or x[0]).")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"the {name} schedule returned a {value.dtype} tensor at step 0; "
                            "expected a real number.")
        return
    if not _is_number(value):
        raise TypeError(f"the {name} schedule returned {type(value).__name__} "
                        f"({value!r:.40}) at step 0; a schedule is a function of the 0-dim "
                        "integer step count returning a number or a 0-dim tensor (did it "
                        "forget to return?).")


def check_nonnegative(name: str, value: Any) -> None:
    """``value >= 0`` (a number, or a 0-dim CPU tensor's value)."""
    check_number(name, value)
    number = _value(value)
    if number is not None and number < 0:
        raise ValueError(f"{name} must be >= 0, got {_shown(value, number)}.")


def check_positive(name: str, value: Any) -> None:
    """``value > 0`` (a number, or a 0-dim CPU tensor's value)."""
    check_number(name, value)
    number = _value(value)
    if number is not None and number <= 0:
        raise ValueError(f"{name} must be > 0, got {_shown(value, number)}.")


def _shown(value: Any, number: float) -> str:
    return f"a tensor holding {number}" if isinstance(value, torch.Tensor) else str(value)


def check_unit_interval(name: str, value: Any, closed_right: bool = False) -> None:
    """``0 <= value < 1`` (``<= 1`` with ``closed_right``; a number, or a 0-dim CPU tensor's
    value)."""
    check_number(name, value)
    number = _value(value)
    if number is None:
        return
    value = number
    ok = 0 <= value <= 1 if closed_right else 0 <= value < 1
    if not ok:
        interval = "[0, 1]" if closed_right else "[0, 1)"
        raise ValueError(f"{name} must be in {interval}, got {value}.")


def check_learning_rate(value: Any) -> None:
    """A learning rate is a number >= 0 or a schedule."""
    check_nonnegative("learning_rate", value)


def check_positive_int(name: str, value: Any) -> None:
    """An integer >= 1 (a Python int, not a tensor)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def check_floating(tree: PyTree, what: str = "params") -> None:
    """Every leaf of ``tree`` is a floating-point tensor; the error names the first one that
    is not."""
    for path, leaf in tree_flatten_with_path(tree)[0]:
        where = keystr(path) or "<root>"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what}{where} is a {type(leaf).__name__}, not a tensor. opttx "
                            "transforms take pytrees of tensors; use opttx.MaskedNode, not "
                            "None, to leave a position empty.")
        if not leaf.is_floating_point():
            raise TypeError(f"{what}{where} has dtype {leaf.dtype}; opttx optimizes real "
                            "floating-point tensors only. Keep integer buffers out of the parameter "
                            "tree or freeze them with opttx.masked/opttx.freeze.")


def check_gradient_leaves(grads: list, like: list | None, tree: PyTree, what: str) -> None:
    """Every leaf of ``grads`` (the flattened ``tree``) is a dense real floating-point tensor
    with the shape of the same leaf of ``like`` (the state's or the params' leaves; None: no
    shape to compare with). One test per leaf; in a compiled step it runs while tracing
    only (shapes and dtypes are static). The error names the leaf's path and what was
    expected; ``what`` names the transform or state for the message."""
    for i, g in enumerate(grads):
        x = like[i] if like is not None else g
        if (not isinstance(g, torch.Tensor) or g.layout != torch.strided
                or not g.is_floating_point() or g.shape != x.shape):
            _gradient_error(grads, like, tree, i, what)


def _gradient_error(grads: list, like: list | None, tree: PyTree, i: int, what: str) -> None:
    g = grads[i]
    paths = [keystr(p) for p, _ in tree_flatten_with_path(tree)[0]]
    where = f"gradient{paths[i] if i < len(paths) else f' leaf {i}'}"
    expected = f" of shape {tuple(like[i].shape)}" if like is not None else ""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{what}: the {where} is {type(g).__name__}, expected a floating-point "
                        f"tensor{expected}. A parameter that got no gradient needs a zero "
                        "gradient (torch.zeros_like), or leave it out with opttx.masked / "
                        "opttx.freeze (MaskedNode marks an absent leaf, None does not).")
    if g.layout != torch.strided:
        raise TypeError(f"{what}: the {where} is a {g.layout} tensor; opttx transforms with "
                        "state take dense gradients only (only stateless element-wise scaling, "
                        "e.g. opttx.sgd without momentum, passes sparse gradients through). "
                        "Densify it with .to_dense(), or use torch.optim.SparseAdam.")
    if g.is_complex():
        raise TypeError(f"{what}: the {where} is complex ({g.dtype}); opttx optimizes real "
                        "parameters only. Optimize complex parameters as real views "
                        "(torch.view_as_real) with real gradients.")
    if not g.is_floating_point():
        raise TypeError(f"{what}: the {where} has dtype {g.dtype}, expected a floating-point "
                        f"tensor{expected}: an integer gradient would be silently truncated "
                        "(zero updates). Pass the gradient in the parameters' dtype.")
    raise ValueError(f"{what}: the {where} has shape {tuple(g.shape)}, expected "
                     f"{tuple(like[i].shape)}: gradients must have the shapes of the params, "
                     "and the state must come from init on these params (a broadcastable shape "
                     "is not accepted: it would silently update every row alike).")


def matrix_axes_of(axes: tuple[int, int], shape: Sequence[int], where: str) -> tuple[int, int]:
    """The two axes of a leaf of ``shape`` that hold its matrices, as non-negative indices;
    ``ValueError`` naming ``where`` when they are out of range or the same axis."""
    a, b = axes
    n = len(shape)
    if not (-n <= a < n and -n <= b < n):
        raise ValueError(f"{where}: matrix_axes {axes} out of range for shape {tuple(shape)}.")
    a, b = a % n, b % n
    if a == b:
        raise ValueError(f"{where}: matrix_axes {axes} names the same axis twice.")
    return a, b
