"""Laws of composition: identities that must hold for any transform and tree."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.testing import (assert_equivalent, assert_trees_close, gradient_stream, param_trees,
                           run_transform)

TRANSFORMS = {
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: opttx.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: opttx.lion(1e-3),
    "rmsprop": lambda: opttx.rmsprop(1e-2, centered=True),
    "clip_adam": lambda: opttx.chain(opttx.clip_by_global_norm(0.5), opttx.adam(1e-2)),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
@given(drawn=param_trees())
def test_chain_with_identity_is_the_transform(name, drawn) -> None:
    tx = TRANSFORMS[name]()
    wrapped = opttx.chain(opttx.identity(), tx, opttx.identity())
    grads = gradient_stream(drawn.tree, 5, seed=drawn.seed)
    pa, sa = run_transform(wrapped, drawn.tree, grads)
    pb, sb = run_transform(tx, drawn.tree, grads)
    assert_trees_close(pa, pb, rtol=0.0)           # bitwise: identity adds no arithmetic
    assert_trees_close(sa[1], sb, rtol=0.0)


@given(drawn=param_trees(min_leaves=2), data=st.data())
def test_masked_equals_partition_with_a_frozen_group(drawn, data) -> None:
    keys = list(drawn.tree)
    trained = data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))
    mask = {k: k in trained for k in keys}
    inverse = {k: not v for k, v in mask.items()}
    via_mask = opttx.chain(opttx.masked(opttx.adam(1e-2), mask), opttx.freeze(inverse))
    via_partition = opttx.partition({True: opttx.adam(1e-2), False: opttx.set_to_zero()}, mask)
    grads = gradient_stream(drawn.tree, 6, seed=drawn.seed)
    pa, _ = run_transform(via_mask, drawn.tree, grads)
    pb, _ = run_transform(via_partition, drawn.tree, grads)
    assert_trees_close(pa, pb, rtol=0.0)
    for k in keys:                      # the frozen leaves did not move
        if not mask[k]:
            assert torch.equal(pa[k], drawn.tree[k])


def test_masked_leaves_pass_through_and_hold_no_state() -> None:
    params = {"w": torch.ones(3, 2), "b": torch.ones(2)}
    tx = opttx.masked(opttx.scale_by_adam(), {"w": True, "b": False})
    state = tx.init(params)
    assert isinstance(state.inner_state.mu["b"], opttx.MaskedNode)
    grads = {"w": torch.full((3, 2), 2.0), "b": torch.full((2,), 3.0)}
    updates, _ = tx.update(grads, state, params)
    assert torch.equal(updates["b"], grads["b"])
    assert torch.allclose(updates["w"], torch.ones(3, 2), rtol=1e-6)   # Adam's first step: ±1


@pytest.mark.parametrize("factory,kwargs", [
    (opttx.adamw, dict(learning_rate=1e-2, b1=0.8, weight_decay=0.05)),
    (opttx.sgd, dict(learning_rate=0.1, momentum=0.9)),
    (opttx.lion, dict(learning_rate=1e-3, weight_decay=0.1)),
    (opttx.rmsprop, dict(learning_rate=1e-2, decay=0.95, momentum=0.5)),
    (opttx.nadam, dict(learning_rate=1e-2, momentum_decay=4e-3)),
])
@given(drawn=param_trees(dtypes=(torch.float64,)))
def test_inject_hyperparams_equals_the_plain_transform(factory, kwargs, drawn) -> None:
    """Equal to float64 rounding (in float32, last-bit differences in the order of the
    scalar arithmetic show up where a parameter crosses zero)."""
    injected = opttx.inject_hyperparams(factory)(**kwargs)
    assert_equivalent(injected, factory(**kwargs), drawn.tree, steps=10, rtol=1e-12,
                      seed=drawn.seed)


def test_inject_hyperparams_state_and_schedules() -> None:
    params = {"w": torch.ones(2, 2)}
    sched = opttx.linear_schedule(1.0, 0.0, 4)
    tx = opttx.inject_hyperparams(opttx.sgd)(learning_rate=sched, momentum=0.5)
    state = tx.init(params)
    assert set(state.hyperparams) == {"learning_rate", "momentum", "dampening"}   # floats
    seen = []
    for _ in range(3):
        updates, state = tx.update({"w": torch.ones(2, 2)}, state, params)
        seen.append(float(state.hyperparams["learning_rate"]))
    assert seen == pytest.approx([1.0, 0.75, 0.5])
    opttx.set_hyperparams_(state, momentum=0.0)
    assert float(state.hyperparams["momentum"]) == 0.0
    with pytest.raises(KeyError, match="b1"):
        opttx.set_hyperparams_(state, b1=0.5)


@pytest.mark.parametrize("k", [1, 2, 4])
@given(drawn=param_trees())
def test_multisteps_equals_one_step_on_the_mean_gradient(k, drawn) -> None:
    inner = opttx.adamw(1e-2, weight_decay=0.1)
    multi = opttx.MultiSteps(inner, every_k_schedule=k)
    micro = gradient_stream(drawn.tree, 3 * k, seed=drawn.seed)
    params, state = drawn.tree, multi.init(drawn.tree)
    for i, g in enumerate(micro):
        updates, state = multi.update(g, state, params)
        if (i + 1) % k:
            assert all(torch.count_nonzero(u) == 0 for u in updates.values())
            assert not bool(multi.has_updated(state))
        else:
            assert bool(multi.has_updated(state))
        params = opttx.apply_updates(params, updates)
    means = [{n: torch.stack([micro[j * k + i][n] for i in range(k)]).mean(0)
              for n in drawn.tree} for j in range(3)]
    expected, _ = run_transform(inner, drawn.tree, means)
    assert_trees_close(params, expected, rtol=1e-5)
    assert int(state.gradient_step) == 3


def test_apply_if_finite_skips_and_keeps_state() -> None:
    params = {"w": torch.ones(3), "b": torch.zeros(2)}
    tx = opttx.apply_if_finite(opttx.adam(0.1), max_consecutive_errors=2)
    good = {"w": torch.ones(3), "b": torch.ones(2)}
    _, state = tx.update(good, tx.init(params), params)
    before = opttx.tree.tree_map(torch.clone, state.inner_state)
    for bad_value in (math.inf, math.nan):
        bad = {"w": torch.tensor([1.0, bad_value, 1.0]), "b": torch.ones(2)}
        updates, state = tx.update(bad, state, params)
        assert all(torch.count_nonzero(u) == 0 for u in updates.values())
        assert_trees_close(state.inner_state, before, rtol=0.0)
        assert not bool(state.last_finite)
    assert int(state.notfinite_count) == 2 and int(state.total_notfinite) == 2
    # a third consecutive bad step exceeds max_consecutive_errors: it is applied
    updates, state = tx.update({"w": torch.tensor([1.0, math.nan, 1.0]), "b": torch.ones(2)},
                               state, params)
    assert torch.isnan(updates["w"]).any()
    assert int(state.total_notfinite) == 3
    # a finite step resets the consecutive count
    _, state = tx.update(good, state, params)
    assert int(state.notfinite_count) == 0 and bool(state.last_finite)


def test_apply_if_finite_equals_inner_on_finite_gradients() -> None:
    params = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    assert_equivalent(opttx.apply_if_finite(opttx.adamw(1e-2), 3), opttx.adamw(1e-2), params,
                      steps=8, rtol=0.0)


def test_named_chain_equals_chain() -> None:
    params = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    named = opttx.named_chain(("clip", opttx.clip_by_global_norm(1.0)),
                              ("adam", opttx.adam(1e-2)))
    plain = opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adam(1e-2))
    assert_equivalent(named, plain, params, steps=5, rtol=0.0)
    assert set(named.init(params)) == {"clip", "adam"}


def test_partition_routes_each_label() -> None:
    params = {"w": torch.ones(3, 2), "b": torch.ones(2)}
    labels = lambda p: {k: "matrix" if v.ndim > 1 else "vector" for k, v in p.items()}
    tx = opttx.partition({"matrix": opttx.sgd(1.0), "vector": opttx.sgd(10.0)}, labels)
    updates, _ = tx.update({"w": torch.ones(3, 2), "b": torch.ones(2)}, tx.init(params), params)
    assert torch.equal(updates["w"], -torch.ones(3, 2))
    assert torch.equal(updates["b"], -10 * torch.ones(2))
    assert opttx.multi_transform is opttx.partition


ALL_ALIASES = {
    "sgd": lambda: opttx.sgd(0.1, momentum=0.9),
    "adam": lambda: opttx.adam(1e-2),
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
    "nadam": lambda: opttx.nadam(1e-2),
    "rmsprop": lambda: opttx.rmsprop(1e-2),
    "adagrad": lambda: opttx.adagrad(1e-2),
    "lion": lambda: opttx.lion(1e-3),
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=1),
    "came": lambda: opttx.came(1e-3, min_dim_size_to_factor=1),
    "lamb": lambda: opttx.lamb(1e-2),
    "lars": lambda: opttx.lars(0.1),
    "shampoo": lambda: opttx.shampoo(1e-2, max_preconditioner_dim=4),
    "galore_adamw": lambda: opttx.galore_adamw(1e-2, rank=2, update_proj_gap=2),
    "adamw_8bit": lambda: opttx.adamw_8bit(1e-2, min_size=16, block_size=16),
    "adalomo": lambda: opttx.adalomo(1e-2),
}


@pytest.mark.parametrize("name", list(ALL_ALIASES))
def test_a_tree_without_leaves_only_advances_the_counters(name) -> None:
    """A rank that owns no leaf (zero, on_owners) or a label that matches nothing runs the
    chain on a tree without leaves: nothing to compute, and every step counter moves, as on
    the ranks that do have leaves."""
    empty = {"w": opttx.MaskedNode()}
    tx = opttx.chain(opttx.clip_by_global_norm(1.0), ALL_ALIASES[name]())
    state = tx.init(empty)
    for _ in range(3):
        updates, state = tx.update(empty, state, empty)
        assert list(updates) == ["w"] and isinstance(updates["w"], opttx.MaskedNode)
        assert not opttx.tree.tree_leaves(updates)
    full = {"w": torch.ones(5, 6)}
    reference = tx.init(full)
    for _ in range(3):
        _, reference = tx.update(full, reference, full)
    counts = [x for x in opttx.tree.tree_leaves(reference)
              if x.ndim == 0 and not x.dtype.is_floating_point]
    mine = [x for x in opttx.tree.tree_leaves(state)
            if x.ndim == 0 and not x.dtype.is_floating_point]
    if name == "adamw_8bit":      # quantize_state keeps its counters per leaf: none here
        assert not mine
    else:                         # every counter as far as on a tree with leaves
        assert [int(c) for c in mine] == [int(c) for c in counts]
        assert not counts or 3 in map(int, counts)
        if not counts:            # no counter at all: nothing else is held either
            assert not opttx.tree.tree_leaves(state)


@pytest.mark.parametrize("name", list(ALL_ALIASES))
def test_an_empty_leaf_changes_nothing_else(name) -> None:
    """A zero-size leaf (a rank's empty shard) is carried along without touching the others."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 6, generator=gen), "b": torch.randn(6, generator=gen)}
    grads = gradient_stream(params, 3, seed=1)
    with_empty = [{**g, "e": torch.zeros(0, 3)} for g in grads]
    got, _ = run_transform(ALL_ALIASES[name](), {**params, "e": torch.zeros(0, 3)}, with_empty)
    want, _ = run_transform(ALL_ALIASES[name](), params, grads)
    assert got["e"].shape == (0, 3)
    assert_trees_close({k: got[k] for k in params}, want, rtol=1e-6)


def test_per_leaf_values_skip_masked_positions() -> None:
    """Per-leaf values given as a tree (explicit factor_axes, masks, labels) line up with the
    leaves that are present when some are masked out (as on_owners and zero mask them)."""
    axes = {"a": (0, 1), "b": None, "w": (1, 0)}
    params = {"a": torch.ones(4, 2), "b": torch.ones(3), "w": torch.arange(20.0).view(4, 5)}
    keep = {"a": False, "b": True, "w": True}
    masked = opttx.masked(opttx.adafactor(1e-2, min_dim_size_to_factor=1, factor_axes=axes),
                          keep)
    whole = opttx.adafactor(1e-2, min_dim_size_to_factor=1,
                            factor_axes={"b": None, "w": (1, 0)})
    kept = {"b": params["b"], "w": params["w"]}
    got, _ = run_transform(masked, params, gradient_stream(params, 3, seed=2))
    want, _ = run_transform(whole, kept, [{k: g[k] for k in kept}
                                          for g in gradient_stream(params, 3, seed=2)])
    assert_trees_close({k: got[k] for k in kept}, want, rtol=1e-6)


def test_masks_and_labels_given_as_functions_see_masked_positions() -> None:
    """A mask or label function applied to a tree with masked positions (inside another mask,
    inside a partition group) returns MaskedNode there, as any tree_map does: nested callable
    masks equal the one mask that is their conjunction."""
    tm = opttx.tree.tree_map
    params = {"w": torch.randn(3, 2), "b": torch.randn(2), "c": torch.randn(4, 4)}
    rows3 = lambda t: tm(lambda x: x.shape[0] == 3, t)  # noqa: E731
    matrix = lambda t: tm(lambda x: x.ndim > 1, t)  # noqa: E731
    nested = opttx.masked(opttx.masked(opttx.adamw(1e-3), rows3), matrix)
    single = opttx.masked(opttx.adamw(1e-3), {"w": True, "b": False, "c": False})
    grads = gradient_stream(params, 3, seed=4)
    got, _ = run_transform(nested, params, grads)
    want, _ = run_transform(single, params, grads)
    assert_trees_close(got, want, rtol=0.0)
    assert not torch.equal(got["w"], params["w"])
    # a function label inside a partition group's mask
    inner = opttx.partition({"m": opttx.sgd(1.0), "v": opttx.set_to_zero()},
                            lambda t: tm(lambda x: "m" if x.ndim > 1 else "v", t))
    part, _ = run_transform(opttx.masked(inner, {"w": True, "b": True, "c": False}), params,
                            grads[:1])
    assert torch.equal(part["b"], params["b"])                       # "v": set to zero
    assert torch.equal(part["c"], params["c"] + grads[0]["c"])      # masked out: passed on
    assert torch.equal(part["w"], params["w"] - grads[0]["w"])


def test_a_mask_function_reading_leaves_directly_works_on_masked_positions() -> None:
    """The docs' mask, a dict comprehension over the leaves (``v.ndim > 1``), fails on a
    MaskedNode; on a tree with masked positions (a rank's part under zero or on_owners, a
    partition group) it gets 0-dim meta tensors there, whose values are dropped."""
    mask = lambda p: {k: v.ndim > 1 for k, v in p.items()}  # noqa: E731
    tree = {"w": opttx.MaskedNode(), "b": torch.zeros(3), "c": torch.zeros(2, 2)}
    assert opttx.tree.leaf_labels(mask, tree, "mask values") == [False, True]
    with pytest.raises(AttributeError):       # a real error on real leaves is not hidden
        opttx.tree.leaf_labels(lambda p: {k: v.no_such for k, v in p.items()},
                               {"b": torch.zeros(3)})
