"""Validation of hyperparameters and inputs, run once at construction or first use.

Hyperparameters may be Python numbers, 0-dim tensors (injected with
`opttx.inject_hyperparams`) or schedules; only Python numbers can be checked up front.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .tree import PyTree, keystr, tree_flatten_with_path


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_number(name: str, value: Any) -> None:
    """Refuse a value that is neither a number, a 0-dim tensor nor a schedule."""
    if _is_number(value) or callable(value):
        if _is_number(value) and math.isnan(value):
            raise ValueError(f"{name} must be a number, got nan.")
        return
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a 0-dim tensor, got shape {tuple(value.shape)}.")
        return
    raise TypeError(f"{name} must be a number, a 0-dim tensor or a schedule, "
                    f"got {type(value).__name__}.")


def check_nonnegative(name: str, value: Any) -> None:
    """``value >= 0``."""
    check_number(name, value)
    if _is_number(value) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}.")


def check_positive(name: str, value: Any) -> None:
    """``value > 0``."""
    check_number(name, value)
    if _is_number(value) and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}.")


def check_unit_interval(name: str, value: Any, closed_right: bool = False) -> None:
    """``0 <= value < 1`` (``<= 1`` with ``closed_right``)."""
    check_number(name, value)
    if not _is_number(value):
        return
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
