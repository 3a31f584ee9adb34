"""Bad input gets a clear error, early (docs/design.md, rule 7)."""

from __future__ import annotations

import pytest
import torch

import opttx


@pytest.mark.parametrize("build,match", [
    (lambda: opttx.adam(-1e-3), "learning_rate must be >= 0"),
    (lambda: opttx.adam(1e-3, b1=1.0), r"b1 must be in \[0, 1\)"),
    (lambda: opttx.adam(1e-3, b2=-0.1), r"b2 must be in \[0, 1\)"),
    (lambda: opttx.adamw(1e-3, eps=-1e-8), "eps must be >= 0"),
    (lambda: opttx.adamw(1e-3, weight_decay=-0.1), "weight_decay must be >= 0"),
    (lambda: opttx.sgd(0.1, momentum=-0.9), "decay must be >= 0"),
    (lambda: opttx.lion(1e-4, b2=1.5), r"b2 must be in \[0, 1\)"),
    (lambda: opttx.rmsprop(1e-3, decay=1.0), r"decay must be in \[0, 1\)"),
    (lambda: opttx.adagrad(1e-2, initial_accumulator_value=-1.0),
     "initial_accumulator_value must be >= 0"),
    (lambda: opttx.nadam(1e-3, momentum_decay=-1.0), "momentum_decay must be >= 0"),
    (lambda: opttx.clip_by_global_norm(0.0), "max_norm must be > 0"),
    (lambda: opttx.clip_by_block_rms(-1.0), "threshold must be > 0"),
    (lambda: opttx.clip(-1.0), "max_delta must be >= 0"),
    (lambda: opttx.adam(float("nan")), "nan"),
    (lambda: opttx.MultiSteps(opttx.sgd(0.1), 0), "every_k_schedule must be an integer >= 1"),
    (lambda: opttx.apply_if_finite(opttx.sgd(0.1), -1), "max_consecutive_errors"),
    (lambda: opttx.inject_hyperparams(opttx.adam)(learning_rate=1e-3, b1=2.0),
     r"b1 must be in \[0, 1\)"),
    (lambda: opttx.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5), "must be larger"),
    (lambda: opttx.join_schedules([opttx.constant_schedule(1.0)], [3]), "one boundary fewer"),
])
def test_invalid_hyperparameters_raise_at_construction(build, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_chain_refuses_a_factory_that_was_not_called() -> None:
    with pytest.raises(TypeError, match="forget to call"):
        opttx.chain(opttx.scale_by_adam)


def test_mismatched_trees_name_the_first_differing_path() -> None:
    params = {"encoder": {"w": torch.ones(2, 2), "b": torch.ones(2)}, "head": torch.ones(2)}
    tx = opttx.adam(1e-3)
    state = tx.init(params)
    grads = {"encoder": {"w": torch.ones(2, 2), "bias": torch.ones(2)}, "head": torch.ones(2)}
    with pytest.raises(ValueError, match=r"\['encoder'\]"):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match="first difference"):
        opttx.apply_updates(params, {"encoder": {"w": torch.ones(2, 2)}, "head": torch.ones(2)})


def test_missing_params_raise_a_clear_error() -> None:
    params = {"w": torch.ones(2)}
    tx = opttx.adamw(1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="add_decayed_weights needs the current parameters"):
        tx.update({"w": torch.ones(2)}, tx.init(params))


def test_integer_tensors_are_refused_with_their_path() -> None:
    params = {"w": torch.ones(2), "steps": torch.zeros(3, dtype=torch.int64)}
    with pytest.raises(TypeError, match=r"params\['steps'\] has dtype torch.int64"):
        opttx.adam(1e-3).init(params)
    with pytest.raises(TypeError, match="not a tensor"):
        opttx.sgd(0.1, momentum=0.9).init({"w": torch.ones(2), "nothing": None})


def test_malformed_masks_and_labels_are_refused() -> None:
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    with pytest.raises(ValueError, match="mask values do not match"):
        opttx.masked(opttx.sgd(0.1), {"w": True}).init(params)
    with pytest.raises(TypeError, match="Python booleans"):
        opttx.masked(opttx.sgd(0.1), {"w": torch.tensor(True), "b": False}).init(params)
    with pytest.raises(ValueError, match="no transform"):
        opttx.partition({"a": opttx.sgd(0.1)}, {"w": "a", "b": "c"}).init(params)


def test_optimizer_refuses_a_non_transform() -> None:
    with pytest.raises(TypeError, match="GradientTransformation"):
        opttx.Optimizer([torch.nn.Parameter(torch.ones(2))], opttx.adam)
