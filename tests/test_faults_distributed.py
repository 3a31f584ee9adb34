"""Faults in the distributed layer: each gives the same clear error on every rank, or
the right numbers, instead of a hang, a silent wrong result or a half-loaded state.

One spawn (gloo, world 2, a short collective timeout so a regression that hangs fails fast);
each case records what every rank saw, and the tests read the records.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import opttx
from opttx.distributed import (Replicated, Shard, all_reduce_gradients, load_checkpoint,
                               sharded, state_dict, zero)
from fault_cases import outcome, run_cases
from test_distributed import _spawn
from opttx.tree import tree_leaves, tree_map

pytestmark = pytest.mark.timeout(300)

WORLD = 2



def _replicated_nan(rank: int) -> dict:
    """apply_if_finite(adam) under sharded: a NaN in a Replicated leaf's gradient on rank 1
    only must skip the step on both ranks (the replicated leaf stays the same everywhere)."""
    torch.manual_seed(0)
    params = {"w": torch.randn(2, 3), "b": torch.randn(3)}      # w: this rank's rows
    specs = {"w": Shard(0), "b": Replicated()}
    tx = sharded(opttx.apply_if_finite(opttx.adam(1e-1), 3), specs)
    state = tx.init(params)
    grads = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    if rank == 1:
        grads["b"][0] = float("nan")
    updates, state = tx.update(grads, state, params)
    params = opttx.apply_updates(params, updates)
    return {"b": params["b"].tolist(), "moved": bool((updates["w"] != 0).any())}


def _replicated_overflow(rank: int) -> dict:
    """apply_if_finite(adam, check_state=True) under sharded: a finite 1e30 in a Replicated
    leaf's gradient on rank 1 only overflows Adam's second moment there; every rank skips."""
    torch.manual_seed(0)
    params = {"w": torch.randn(2, 3), "b": torch.randn(3)}
    tx = sharded(opttx.apply_if_finite(opttx.adam(1e-1), 3, check_state=True),
                 {"w": Shard(0), "b": Replicated()})
    state = tx.init(params)
    grads = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    if rank == 1:
        grads["b"][0] = 1e30
    updates, state = tx.update(grads, state, params)
    return {"moved": bool(any((u != 0).any() for u in updates.values())),
            "skipped": int(state.total_notfinite),
            "nu_finite": all(bool(torch.isfinite(x).all()) for x in tree_leaves(state)
                             if x.is_floating_point())}


def _empty_tree_on_one_rank(rank: int) -> dict:
    params = {"w": torch.ones(2, 3)} if rank == 0 else {}
    specs = {"w": Shard(0)} if rank == 0 else {}
    return outcome(lambda: sharded(opttx.adam(1e-2), specs).init(params) and None)


def _different_shard_dims(rank: int) -> dict:
    params = {"w": torch.ones(2, 2)}
    specs = {"w": Shard(0) if rank == 0 else Shard(1)}
    return outcome(lambda: sharded(opttx.lamb(1e-2), specs).init(params) and None)


def _on_owners_wrong_shape(rank: int) -> dict:
    """Rank 1 passes its (2, 6) shard's update as (6, 2): same size, wrong layout."""
    params = {"w": torch.ones(2, 6)}
    tx = sharded(opttx.shampoo(1e-2), {"w": Shard(0)}, on_owners=True)
    state = tx.init(params)
    grads = {"w": torch.ones(2, 6) if rank == 0 else torch.ones(6, 2)}
    return outcome(lambda: tx.update(grads, state, params) and None)


def _different_chains(rank: int) -> dict:
    """adamw on rank 0, lamb on rank 1: lamb's trust-ratio all-reduce would meet nothing on
    rank 0 (a gloo abort or a hang at the first update); now both ranks raise at init."""
    params = {"w": torch.ones(4, 3)}
    make = opttx.adamw if rank == 0 else opttx.lamb
    return {"sharded": outcome(lambda: sharded(make(1e-2), {"w": Shard(0)}).init(params)
                                and None),
            "zero": outcome(lambda: zero(make(1e-2)).init(params) and None)}


def _zero_outside_group(rank: int) -> dict:
    only0 = dist.new_group([0])                  # every rank creates every group
    params = {"w": torch.ones(4, 3)}
    return outcome(lambda: zero(opttx.adam(1e-2), only0).init(params) and None)


def _reduce(grads: dict) -> dict:
    tx = all_reduce_gradients()
    return tx.update(grads, tx.init(grads))[0]


def _all_reduce_mismatch(rank: int) -> dict:
    dtype = torch.float32 if rank == 0 else torch.float64
    by_dtype = outcome(lambda: _reduce({"a": torch.ones(3, dtype=dtype)})["a"].tolist())
    key = "a" if rank == 0 else "b"                # same shapes, other trees
    by_tree = outcome(lambda: _reduce({key: torch.ones(3)})[key].tolist())
    return {"dtype": by_dtype, "tree": by_tree}


def _missing_shard_file(rank: int, root: Path) -> dict:
    """A checkpoint one of whose shard files is gone: load_checkpoint raises on every rank and
    leaves the live parameters and state as they were."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "u": torch.randn(5), "v": torch.randn(3, 2)}
    tx = zero(opttx.adam(1e-2))
    state = tx.init(params)
    updates, state = tx.update(tree_map(torch.ones_like, params), state, params)
    params = opttx.apply_updates(params, updates)
    path = root / "ckpt"
    dcp.save({"params": params, "optim": state_dict(state, params)}, checkpoint_id=str(path))
    dist.barrier()
    if rank == 0:
        files = sorted(p.name for p in path.glob("*.distcp"))
        os.remove(path / files[-1])
    dist.barrier()
    # the live run has moved on since the save
    updates, state = tx.update(tree_map(torch.ones_like, params), state, params)
    params = opttx.apply_updates(params, updates)
    sd = {"params": params, "optim": state_dict(state, params)}
    # the tensors, and the maker's record (strings) beside them
    before = [x.clone() if isinstance(x, torch.Tensor) else x for x in tree_leaves(sd)]
    out = outcome(lambda: load_checkpoint(sd, checkpoint_id=str(path)))
    out["untouched"] = all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                           for a, b in zip(before, tree_leaves(sd)))
    return out


def _worker(rank: int, world: int, store: str, out: str) -> None:
    run_cases(rank, world, store, out, {
        "replicated_nan": lambda: _replicated_nan(rank),
        "replicated_overflow": lambda: _replicated_overflow(rank),
        "empty_tree": lambda: _empty_tree_on_one_rank(rank),
        "shard_dims": lambda: _different_shard_dims(rank),
        "owners_shape": lambda: _on_owners_wrong_shape(rank),
        "zero_group": lambda: _zero_outside_group(rank),
        "different_chains": lambda: _different_chains(rank),
        "all_reduce": lambda: _all_reduce_mismatch(rank),
        "missing_file": lambda: _missing_shard_file(rank, Path(out).parent),
    })


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_worker, WORLD, tmp_path_factory.mktemp("faults"))


def _errors(results: list[dict], case: str, key: str | None = None) -> list[str | None]:
    got = [r[case] if key is None else r[case][key] for r in results]
    assert all("crash" not in g for g in got), got
    return [g["error"] for g in got]


def test_apply_if_finite_skips_on_every_rank_for_a_replicated_leaf(results: list[dict]) -> None:
    got = [r["replicated_nan"] for r in results]
    assert all("crash" not in g for g in got), got
    assert not any(g["moved"] for g in got), got
    assert got[0]["b"] == got[1]["b"], got


def test_apply_if_finite_check_state_skips_on_every_rank(results: list[dict]) -> None:
    got = [r["replicated_overflow"] for r in results]
    assert all("crash" not in g for g in got), got
    assert got == [{"moved": False, "skipped": 1, "nu_finite": True}] * 2, got


def test_sharded_refuses_an_empty_tree_on_one_rank(results: list[dict]) -> None:
    errors = _errors(results, "empty_tree")
    assert all(e is not None and "different parameter trees or specs" in e for e in errors), \
        errors


def test_sharded_refuses_shard_dims_that_differ_per_rank(results: list[dict]) -> None:
    errors = _errors(results, "shard_dims")
    assert all(e is not None and "different parameter trees or specs" in e for e in errors), \
        errors
    assert "['w']" in errors[0], errors


def test_on_owners_checks_update_shapes_against_its_plan(results: list[dict]) -> None:
    errors = _errors(results, "owners_shape")
    assert all(e is not None for e in errors), errors
    assert "local shape (6, 2)" in errors[1] and "(2, 6)" in errors[1], errors
    assert "rank 1" in errors[0], errors


def test_zero_with_a_group_without_this_rank_is_a_clear_error(results: list[dict]) -> None:
    errors = _errors(results, "zero_group")
    assert errors[0] is None, errors
    assert errors[1] is not None and "ValueError" in errors[1], errors
    assert "not in the given process group" in errors[1], errors


@pytest.mark.parametrize("key", ["dtype", "tree"])
def test_all_reduce_gradients_refuses_trees_that_differ_per_rank(results: list[dict],
                                                                  key: str) -> None:
    errors = _errors(results, "all_reduce", key)
    assert all(e is not None and "different gradient trees" in e for e in errors), errors


def test_failed_checkpoint_load_leaves_everything_as_it_was(results: list[dict]) -> None:
    got = [r["missing_file"] for r in results]
    assert all("crash" not in g for g in got), got
    assert all(g["error"] is not None for g in got), got
    assert all(g["untouched"] for g in got), got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["sharded", "zero"])
def test_different_chains_on_different_ranks_raise_at_init(results: list[dict],
                                                          where: str) -> None:
    errors = _errors(results, "different_chains", where)
    assert all(e is not None and "built different transforms or settings" in e
               for e in errors), errors
