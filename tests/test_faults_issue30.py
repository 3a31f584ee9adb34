"""Bad input and faults on one process, issue 30 (Reliability III): each case gives the right
numbers or a clear error naming what is wrong, never silently wrong numbers. The
multi-process cases are in tests/test_faults_issue30_distributed.py; the table of outcomes is
docs/guide/faults.md.
"""

from __future__ import annotations

import math

import pytest
import torch

import opttx

# ---------------------------------------------------------------------------------------------
# hyperparameters given as 0-dim tensors are checked like numbers
# ---------------------------------------------------------------------------------------------

TENSOR_LR_FACTORIES = {
    "adam": lambda lr: opttx.adam(lr),
    "sgd": lambda lr: opttx.sgd(lr, momentum=0.9),
    "lion": lambda lr: opttx.lion(lr),
    "muon": lambda lr: opttx.muon(lr),
    "injected adamw": lambda lr: opttx.inject_hyperparams(opttx.adamw)(learning_rate=lr),
}


@pytest.mark.parametrize("name", list(TENSOR_LR_FACTORIES))
@pytest.mark.parametrize("value, text", [
    (math.nan, "learning_rate must be a number, got a tensor holding nan"),
    (-1.0, "learning_rate must be >= 0, got a tensor holding -1.0"),
    (math.inf, "learning_rate must be finite, got a tensor holding inf"),
])
def test_a_tensor_learning_rate_is_refused_where_the_float_is(name, value, text) -> None:
    """torch.tensor(nan) and torch.tensor(-1.) were accepted where nan and -1.0 are refused."""
    make = TENSOR_LR_FACTORIES[name]
    with pytest.raises(ValueError, match="learning_rate must"):
        make(value)                                   # the float: refused before, too
    with pytest.raises(ValueError, match=text):
        make(torch.tensor(value))
    with pytest.raises(ValueError, match=text):
        make(torch.tensor(value, dtype=torch.float64))


def test_tensor_betas_and_decays_are_checked_like_numbers() -> None:
    with pytest.raises(ValueError, match=r"b1 must be in \[0, 1\), got 1.5"):
        opttx.adamw(1e-3, b1=torch.tensor(1.5))
    with pytest.raises(ValueError, match="weight_decay must be a number, got a tensor holding nan"):
        opttx.adamw(1e-3, weight_decay=torch.tensor(math.nan))


def test_a_valid_tensor_learning_rate_gives_the_floats_numbers() -> None:
    params = {"w": torch.linspace(-1, 1, 5)}
    grads = {"w": torch.linspace(0.5, -0.3, 5)}
    by_float = opttx.adam(1e-2).update(grads, opttx.adam(1e-2).init(params), params)[0]
    tx = opttx.adam(torch.tensor(1e-2))
    by_tensor = tx.update(grads, tx.init(params), params)[0]
    assert torch.equal(by_float["w"], by_tensor["w"])


def test_an_injected_learning_rate_set_to_nan_is_refused_at_the_next_update() -> None:
    """`set_hyperparams_` writes the state; the factory sees the tensor at the next update."""
    tx = opttx.inject_hyperparams(opttx.adam)(learning_rate=1e-3)
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    _, state = tx.update({"w": torch.ones(3)}, state, params)
    opttx.set_hyperparams_(state, learning_rate=-0.5)
    with pytest.raises(ValueError, match="learning_rate must be >= 0, got a tensor holding -0.5"):
        tx.update({"w": torch.ones(3)}, state, params)
