"""opttx.testing: its strategies draw what they promise, and its equivalence assertions pass
known-equal pairs and catch a planted difference of 1e-3 in one leaf after 3 steps, in one
process (`assert_equivalent`) and sharded over two gloo processes (`assert_shard_invariant`).

Each `assert_shard_invariant` or `spawn_ranks` call spawns fresh processes (several seconds on
a small CPU), so the multi-process tests are few and each runs several spec trees in one spawn.
"""

from __future__ import annotations

import os
import re
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import opttx
from opttx.base import REDUCER_KEY, TOTALS_KEY
from opttx.distributed import Replicated, Shard
from opttx.testing import (MeshDim, assert_equivalent, assert_shard_invariant, bind_mesh,
                           gradient_stream, hyperparameters, log_uniform, one_ulp,
                           param_trees, run_transform, sharding_specs, spawn_ranks)

SHAPES = {"w": (9, 6), "u": (6, 5), "t": (3, 5, 4), "b": (5,), "s": ()}

# ---------------------------------------------------------------------------------------------
# transforms with a planted difference (top level: the spawned ranks import them)
# ---------------------------------------------------------------------------------------------


def plant(leaf: str = "w", at_step: int = 3, amount: float = 1e-3,
          rank: int | None = None) -> opttx.GradientTransformation:
    """Adds ``amount`` to the update of ``leaf`` at step ``at_step``: always (``rank`` None),
    or only when run sharded and on rank ``rank``."""
    def init(params):
        return torch.zeros((), dtype=torch.int32)

    def update(updates, state, params=None, **extra_args):
        sharded_run = REDUCER_KEY in extra_args or TOTALS_KEY in extra_args
        here = rank is None or (sharded_run and dist.get_rank() == rank)
        if int(state) + 1 == at_step and here:
            updates = {**updates, leaf: updates[leaf] + amount}
        return updates, state + 1
    return opttx.GradientTransformation(init, update)


def planted_lamb(rank: int | None = None) -> opttx.GradientTransformation:
    return opttx.chain(opttx.lamb(1e-2, weight_decay=0.01), plant(rank=rank))


def conditioned_shampoo() -> opttx.GradientTransformation:
    # eps 1e-3: the factors of a few steps are rank-deficient, and a tiny eps would amplify
    # float32 rounding (a sum in another order) far beyond rtol
    return opttx.shampoo(1e-2, max_preconditioner_dim=4, precondition_frequency=2,
                         start_preconditioning_step=2, epsilon=1e-3)


def _sleep_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _environment_mark(rank: int, world: int) -> str | None:
    return os.environ.get("OPTTX_TEST_SPAWN_MARK")


def test_spawn_ranks_gives_the_ranks_the_environment_of_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks fork from a server started at the first call, with that moment's
    environment; a variable set afterwards still reaches the ranks' ``os.environ``."""
    from opttx.testing import spawn_ranks
    monkeypatch.delenv("OPTTX_TEST_SPAWN_MARK", raising=False)
    assert spawn_ranks(_environment_mark, 2) == [None, None]     # the server runs from here
    monkeypatch.setenv("OPTTX_TEST_SPAWN_MARK", "set after the first call")
    assert spawn_ranks(_environment_mark, 2) == ["set after the first call"] * 2


def test_spawn_ranks_imports_the_function_with_the_path_of_the_call(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module importable only from a folder put on ``sys.path`` after the fork server
    started: its function still reaches the ranks (multiprocessing sends each new process
    the caller's path before it unpickles the function; the environment it does not send,
    see the test above)."""
    import sys

    from opttx.testing import spawn_ranks
    spawn_ranks(_environment_mark, 2)                            # the server runs from here
    (tmp_path / "opttx_module_added_late.py").write_text(
        "def twice_the_rank(rank, world):\n    return 2 * rank\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import opttx_module_added_late
    try:
        assert spawn_ranks(opttx_module_added_late.twice_the_rank, 2) == [0, 2]
    finally:
        del sys.modules["opttx_module_added_late"]


def _draw_in_every_rank(rank: int, world: int) -> list[dict]:
    """Spec trees drawn inside a rank with the real group (hypothesis derandomized, so every
    rank draws the same ones), written as ``{leaf: [(dim, is the world group), ...]}``."""
    from hypothesis import HealthCheck, Phase
    drawn = []

    @settings(max_examples=8, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(specs=sharding_specs(SHAPES, groups=[dist.group.WORLD]))
    def draw(specs: dict) -> None:
        drawn.append({k: [(s.dim, s.group is dist.group.WORLD) for s in _shards(v)]
                      for k, v in specs.items()})
    draw()
    return drawn


# ---------------------------------------------------------------------------------------------
# strategies (one process)
# ---------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(hp=hyperparameters("learning_rate", "b1", "b2", "eps", "nesterov",
                          weight_decay=(0.0, 0.5), momentum=[0.0, 0.9]))
def test_hyperparameters_in_range(hp: dict) -> None:
    assert list(hp) == ["learning_rate", "b1", "b2", "eps", "nesterov", "weight_decay",
                        "momentum"]
    assert 1e-4 <= hp["learning_rate"] <= 1e-1
    assert 0.0 <= hp["b1"] <= 0.99 and 0.5 <= hp["b2"] < 1.0
    assert 1e-10 <= hp["eps"] <= 1e-6
    assert isinstance(hp["nesterov"], bool)
    assert 0.0 <= hp["weight_decay"] <= 0.5 and hp["momentum"] in (0.0, 0.9)
    opttx.adamw(hp["learning_rate"], hp["b1"], hp["b2"], hp["eps"], nesterov=hp["nesterov"],
                weight_decay=hp["weight_decay"])          # valid arguments of the alias


def test_learning_rates_are_log_uniform() -> None:
    # log-uniform over [1e-4, 1e-1]: a third of the draws below 1e-3 (a uniform draw: 1%)
    draws = []

    @settings(max_examples=300, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(hp=hyperparameters("learning_rate"))
    def collect(hp: dict) -> None:
        draws.append(hp["learning_rate"])
    collect()
    below = sum(x < 1e-3 for x in draws) / len(draws)
    assert len(draws) >= 200 and 0.15 < below < 0.6, (len(draws), below)
    assert all(1e-4 <= x <= 1e-1 for x in draws)
    assert find(log_uniform(1e-6, 1.0), lambda x: x < 1e-5) >= 1e-6
    with pytest.raises(ValueError, match="no default range for 'gamma'"):
        hyperparameters("gamma")
    with pytest.raises(ValueError, match="0 < low <= high"):
        log_uniform(0.0, 1.0)


def _shards(spec) -> tuple:
    return () if isinstance(spec, Replicated) else (spec,) if isinstance(spec, Shard) else spec


@settings(max_examples=60, deadline=None)
@given(specs=sharding_specs(SHAPES), even=sharding_specs(SHAPES, uneven=False,
                                                         replicated=False),
       mesh=sharding_specs(SHAPES, mesh=(2, 3)))
def test_sharding_specs_are_valid(specs: dict, even: dict, mesh: dict) -> None:
    for tree in (specs, even, mesh):
        assert set(tree) == set(SHAPES)
        assert isinstance(tree["s"], Replicated)               # 0-dim: replicated
        for name, spec in tree.items():
            for s in _shards(spec):
                assert -len(SHAPES[name]) <= s.dim < len(SHAPES[name])
    for spec in specs.values():
        assert all(s.group is None for s in _shards(spec))     # 1-D: the default group
    for name, spec in even.items():
        if any(d % 2 == 0 for d in SHAPES[name]):
            assert _shards(spec), name                         # replicated=False
        for s in _shards(spec):
            assert SHAPES[name][s.dim] % 2 == 0                # uneven=False
    for spec in mesh.values():
        groups = [s.group for s in _shards(spec)]
        assert all(isinstance(g, MeshDim) for g in groups)
        assert len({g.index for g in groups}) == len(groups)   # a group per mesh dim


def test_sharding_specs_draw_uneven_and_empty_pieces_and_bind() -> None:
    def has(pred):
        return lambda tree: any(pred(name, s) for name, spec in tree.items()
                                for s in _shards(spec))
    # an odd dim over 2 ranks, a dim of size 1 (an empty piece), one dim split twice
    find(sharding_specs(SHAPES), has(lambda n, s: SHAPES[n][s.dim] % 2 == 1))
    find(sharding_specs({"x": (1, 4)}), has(lambda n, s: s.dim % 2 == 0))
    nested = find(sharding_specs({"x": (8, 3)}, mesh=(2, 2)),
                  lambda t: isinstance(t["x"], tuple) and t["x"][0].dim % 2 == t["x"][1].dim % 2)
    bound = bind_mesh(nested, ["tp", "dp"])
    assert [s.group for s in bound["x"]] == ["tp", "dp"]
    assert all(isinstance(s.group, MeshDim) for s in nested["x"])   # the input is unchanged


# ---------------------------------------------------------------------------------------------
# assert_equivalent (one process)
# ---------------------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(tree=param_trees(min_leaves=2), hp=hyperparameters("learning_rate", "b1", "b2"))
def test_assert_equivalent_passes_equal_pairs(tree, hp: dict) -> None:
    mine = opttx.chain(opttx.scale_by_adam(hp["b1"], hp["b2"]),
                       opttx.scale(-hp["learning_rate"]))
    assert_equivalent(mine, opttx.adam(**hp), tree.tree, steps=5)


def test_assert_equivalent_catches_a_planted_difference() -> None:
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    assert_equivalent(planted_lamb(), planted_lamb(), params, steps=3)
    with pytest.raises(AssertionError, match=r"after step 3: \['w'\]: .*relative error") as e:
        assert_equivalent(planted_lamb(), opttx.lamb(1e-2, weight_decay=0.01), params, steps=3)
    rel = float(str(e.value).split("relative error ")[1].split()[0])
    assert 1e-4 < rel < 1e-3       # 1e-3 against params of size ~2
    # two steps only: the difference is not there yet
    assert_equivalent(planted_lamb(), opttx.lamb(1e-2, weight_decay=0.01), params, steps=2)


# ---------------------------------------------------------------------------------------------
# assert_shard_invariant and spawn_ranks (two processes each)
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_shard_invariant_passes_and_compares_state() -> None:
    """LAMB (one collective per step) on four drawn spec trees, plus a given one."""
    given_specs = {"w": Shard(1), "u": Shard(-2), "t": Shard(2), "b": Replicated(),
                   "s": Replicated()}
    drawn = find(st.lists(sharding_specs(SHAPES), min_size=3, max_size=3),
                 lambda cases: sum(not isinstance(c["w"], Replicated) for c in cases) >= 2)
    report = assert_shard_invariant(partial(opttx.lamb, 1e-2, weight_decay=0.01), SHAPES,
                                    [given_specs, *drawn], steps=3)
    assert report["cases"] == 4
    # per rank, step and case: 5 params and LAMB's mu and nu of each, and the count
    assert report["compared"] >= 2 * 3 * 4 * 5 * 3
    assert report["state_left_out"] == []


@pytest.mark.timeout(240)
def test_shard_invariant_catches_a_planted_difference_on_one_rank() -> None:
    specs = {"w": Shard(0), "u": Shard(1), "t": Replicated(), "b": Shard(0), "s": Replicated()}
    with pytest.raises(AssertionError) as e:
        assert_shard_invariant(partial(planted_lamb, rank=1), SHAPES, specs, steps=3)
    message = str(e.value)
    assert "params['w'] on rank 1 of 2 after step 3" in message, message
    assert "['w']: Shard(0)" in message, message
    rel = float(message.split("max relative error ")[1].split()[0])
    assert 1e-4 < rel < 1e-2, message


@pytest.mark.timeout(240)
def test_shard_invariant_on_owners() -> None:
    """Shampoo on whole leaves at owner ranks: parameters and the owned leaves' state."""
    report = assert_shard_invariant(conditioned_shampoo, {"w": (7, 5), "u": (4, 6), "b": (5,)},
                                    on_owners=True, n_specs=3, steps=4, seed=1)
    assert report["cases"] == 3 and report["compared"] > 2 * 3 * 4 * 3


@pytest.mark.timeout(240)
def test_a_rank_exception_is_raised_in_the_parent() -> None:
    """Shampoo without on_owners refuses local shards on every rank: the parent gets the
    ValueError itself, with the traceback of the rank whose error reached it first (either
    rank: both raise, and which one is first depends on the scheduler)."""
    with pytest.raises(ValueError, match="on_owners") as e:
        assert_shard_invariant(partial(opttx.shampoo, 1e-2), {"w": (6, 4)}, {"w": Shard(0)})
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert re.search(r"raised on rank [01] of 2", notes) and "Traceback" in notes, notes


@pytest.mark.timeout(240)
def test_spawn_ranks_returns_results_and_stops_hangs() -> None:
    with pytest.raises(TypeError, match="picklable"):
        spawn_ranks(lambda rank, world: rank)
    with pytest.raises(TypeError, match="picklable"):
        assert_shard_invariant(lambda: opttx.sgd(1.0))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[.*1\] of 2 still running"):
        spawn_ranks(_sleep_on_rank_one, 2, timeout=6)
    assert time.monotonic() - start < 60


def _abort_when_leaving(rank: int, world: int) -> int:
    """Returns its rank, then dies by SIGABRT on the way out (as a gloo thread aborting at
    interpreter shutdown would)."""
    import os

    def leave(code: int = 0) -> None:
        dist.barrier()                # every rank has written its result by now
        os.abort()
    opttx.testing.exit_rank = leave
    return rank


def _abort_before_returning(rank: int, world: int) -> int:
    import os
    os.abort()


@pytest.mark.timeout(240)
def test_spawn_ranks_keeps_results_of_ranks_killed_while_leaving() -> None:
    """Every rank wrote its result, then was killed: the results stand (with a warning); a
    rank killed before its result is still an error."""
    with pytest.warns(RuntimeWarning, match="every rank returned its result"):
        assert spawn_ranks(_abort_when_leaving, 2) == [0, 1]
    with pytest.raises(RuntimeError, match="died without raising"):
        spawn_ranks(_abort_before_returning, 2)


@pytest.mark.timeout(240)
def test_sharding_specs_drawn_alike_in_every_rank() -> None:
    """Drawn inside the ranks with the real group (its size read from it): the same specs."""
    first, second = spawn_ranks(_draw_in_every_rank, 2)
    assert first == second and len(first) == 8
    shards = [s for tree in first for spec in tree.values() for s in spec]
    assert shards and all(is_world for _, is_world in shards)


def test_one_ulp_moves_every_nonzero_entry_by_one_ulp_and_keeps_zeros() -> None:
    g = torch.tensor([0.0, -0.0, 1.0, -3.5, 1e-30])
    (moved,) = one_ulp([{"g": g}])
    m = moved["g"]
    assert torch.equal(m[:2], g[:2]) and not m.isnan().any()
    assert torch.equal(m[2:], torch.nextafter(g[2:], g[2:].sign() * torch.inf))
    assert (m[2:].abs() > g[2:].abs()).all()


def test_run_transform_continues_from_a_given_state() -> None:
    params = {"w": torch.randn(3, 2)}
    grads = gradient_stream(params, 4, seed=2)
    tx = opttx.adam(1e-2)
    whole = run_transform(tx, params, grads)
    half_params, half_state = run_transform(tx, params, grads[:2])
    rest = run_transform(tx, half_params, grads[2:], half_state)
    assert torch.equal(rest[0]["w"], whole[0]["w"])


# ---------------------------------------------------------------------------------------------
# the registry properties of degenerate inputs catch transforms planted to break them
# ---------------------------------------------------------------------------------------------


def _guide_adan(keeps_a_copy: bool) -> dict:
    """docs/guide/writing.md's Adan, executed as written, or with its state storing the
    caller's gradient itself (``prev=g``, what the guide warns against)."""
    import pathlib
    import re
    import sys
    import types
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide" / "writing.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    block = next(b for b in blocks if "class AdanState" in b).split("\nadan = ")[0]
    if not keeps_a_copy:
        assert "extend.keep_copy(g, state.prev)" in block
        block = block.replace("extend.keep_copy(g, state.prev)", "g")
    first = next(b for b in blocks if "class SignumState" in b)      # the imports
    module = types.ModuleType(f"guide_adan_{keeps_a_copy}")
    sys.modules[module.__name__] = module
    exec(first, module.__dict__)
    exec(block, module.__dict__)
    return module.__dict__


def test_no_aliasing_catches_the_guide_adan_storing_the_callers_gradient() -> None:
    from opttx.conformance import check_no_aliasing
    from opttx.testing import check_transform
    aliasing = _guide_adan(keeps_a_copy=False)["scale_by_adan"]
    with pytest.raises(AssertionError, match=r"shares memory with the updates"):
        check_no_aliasing(lambda: aliasing())
    with pytest.raises(AssertionError, match=r"no_aliasing: AssertionError"):
        check_transform(lambda: aliasing(), skip=tuple(set(opttx.conformance.CHECKS)
                                                      - {"no_aliasing"}))
    check_no_aliasing(lambda: _guide_adan(keeps_a_copy=True)["scale_by_adan"]())


def _optimizer_drift(scale_by_adan) -> float:
    """Largest parameter difference after 5 steps of `opttx.Optimizer` whose gradients are
    written into the same ``.grad`` buffers every step (``zero_grad(set_to_none=False)``, as
    torch's default before 2.0 and many trainers do), against the functional path of the
    same transform on the same gradients."""
    make = lambda: opttx.chain(scale_by_adan(), opttx.scale_by_learning_rate(1e-2))
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    grads = gradient_stream(params, 5, seed=1)
    tx, expected = make(), params
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, expected)
        expected = opttx.apply_updates(expected, updates)
    model = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    optimizer = opttx.Optimizer(list(model.items()), make())
    for g in grads:
        optimizer.zero_grad(set_to_none=False)
        for k, p in model.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(g[k])
        optimizer.step()
    return max(float((model[k].detach() - expected[k]).abs().max()) for k in params)


def test_a_state_aliasing_the_gradient_drifts_under_the_optimizer_and_keep_copy_does_not(
        ) -> None:
    """The guide's Adan storing ``g`` itself: through `opttx.Optimizer` with reused gradient
    buffers its previous gradient is zeroed before it is read, and the parameters drift from
    the functional path; with `opttx.extend.keep_copy` they do not."""
    drift = _optimizer_drift(_guide_adan(keeps_a_copy=False)["scale_by_adan"])
    kept = _optimizer_drift(_guide_adan(keeps_a_copy=True)["scale_by_adan"])
    print(f"drift after 5 steps: aliasing {drift:.3g}, keep_copy {kept:.3g}")
    assert drift > 1e-4
    assert kept <= 1e-6


def _nan_to_num_then_adam() -> opttx.GradientTransformation:
    """Adam behind a `nan_to_num` of the gradients: a NaN becomes 0, unseen."""
    return opttx.chain(opttx.stateless_with_tree_map(lambda g, p: torch.nan_to_num(g)),
                       opttx.adam(1e-2))


def test_nonfinite_property_catches_a_transform_that_swallows_a_nan() -> None:
    from opttx.conformance import check_nonfinite_gradients
    from opttx.testing import check_transform
    with pytest.raises(AssertionError, match="it hid the NaN"):
        check_nonfinite_gradients(_nan_to_num_then_adam)
    with pytest.raises(AssertionError, match="nonfinite_gradients: AssertionError"):
        check_transform(_nan_to_num_then_adam, skip=tuple(set(opttx.conformance.CHECKS)
                                                          - {"nonfinite_gradients"}))
    check_nonfinite_gradients(lambda: opttx.adam(1e-2))
    # a declared behaviour is checked too: Adam does not skip, zero_nans does not propagate
    with pytest.raises(AssertionError, match="not skipped"):
        check_nonfinite_gradients(lambda: opttx.adam(1e-2), behaviour="skips")
    with pytest.raises(AssertionError, match="it hid the NaN"):
        check_nonfinite_gradients(opttx.zero_nans)
    check_nonfinite_gradients(opttx.zero_nans, behaviour="zeroes")
    check_nonfinite_gradients(lambda: opttx.apply_if_finite(opttx.adam(1e-2), 3), None, "skips")
    with pytest.raises(ValueError, match="behaviour must be one of"):
        check_nonfinite_gradients(opttx.zero_nans, behaviour="hides")


def _scaled_by_its_max() -> opttx.GradientTransformation:
    """Each leaf divided by its largest magnitude: ``amax`` fails on a zero-size leaf."""
    return opttx.stateless_with_tree_map(lambda g, p: g / g.abs().amax())


def _scaled_by_its_size_minus_one() -> opttx.GradientTransformation:
    """Each leaf divided by (number of elements - 1): inf for a 0-D leaf."""
    return opttx.stateless_with_tree_map(lambda g, p: g / (g.numel() - 1))


def test_degenerate_shapes_property_catches_crashes_and_non_finite_updates() -> None:
    from opttx.conformance import check_degenerate_shapes
    from opttx.testing import check_transform
    with pytest.raises(RuntimeError, match="amax"):
        check_degenerate_shapes(_scaled_by_its_max)
    with pytest.raises(AssertionError, match=r"leaf \['s'\] \(\): a non-finite update"):
        check_degenerate_shapes(_scaled_by_its_size_minus_one)
    with pytest.raises(AssertionError, match="degenerate_shapes: RuntimeError"):
        check_transform(_scaled_by_its_max, skip=tuple(set(opttx.conformance.CHECKS)
                                                       - {"degenerate_shapes"}))
    check_degenerate_shapes(lambda: opttx.muon(0.02))


def test_keep_copy_copies_into_the_buffers_dtype_and_into_them_when_donating() -> None:
    g = {"w": torch.randn(3, 2, dtype=torch.bfloat16), "b": torch.randn(2)}
    buffers = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    kept = opttx.extend.keep_copy(g, buffers)
    assert kept["w"].dtype == torch.float32 and torch.equal(kept["w"], g["w"].float())
    assert all(kept[k].data_ptr() not in (g[k].data_ptr(), buffers[k].data_ptr()) for k in g)
    with opttx.donating():
        donated = opttx.extend.keep_copy(list(g.values()), list(buffers.values()))
    assert [d.data_ptr() for d in donated] == [b.data_ptr() for b in buffers.values()]
    assert torch.equal(buffers["b"], g["b"])
    plain = opttx.extend.keep_copy([g["b"]])
    assert isinstance(plain, list) and plain[0].data_ptr() != g["b"].data_ptr()
    with pytest.raises(ValueError, match="2 values but 1 buffers"):
        opttx.extend.keep_copy(list(g.values()), [buffers["w"]])
