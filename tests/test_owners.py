"""opttx.distributed.on_owners: matrix transforms (Shampoo, GaLore, 8-bit states) on sharded
leaves, each leaf brought whole to one owner rank, equal the single-device run exactly.

Multi-process on CPU with gloo, in the pattern of tests/test_distributed.py (one spawn per
fixture, derandomized hypothesis draws looped inside the workers, results written as JSON).
Parameters are compared with the single-device run on this rank's slice; the optimizer state
a rank holds (its owned leaves only) is compared with the single-device state of those leaves
(`opttx.masked` over the owned leaves, run on the same gradients).
"""

from __future__ import annotations

import json
import traceback
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
import pytest
import torch
import torch.distributed as dist

import opttx
from opttx.distributed import (CollectiveStats, Replicated, Shard, all_reduce_gradients,
                               on_owners, plan_owners, sharded)
from opttx.tree import tree_flatten, tree_map
from test_distributed import (ATOL, HPARAMS, RTOL, _finish, _init, _problem, _shard_tree,
                              _slicer, _spawn, hparams, shape_trees)

pytestmark = pytest.mark.timeout(300)


def _transforms(hp: dict | None = None) -> dict[str, Callable[[], Any]]:
    """Transforms that need whole leaves (and two that do not, run on owners anyway)."""
    hp = hp or {k: v[0] for k, v in HPARAMS.items()}
    lr, b1, b2, wd, clip = hp["lr"], hp["b1"], hp["b2"], hp["wd"], hp["clip"]

    def shampoo(epsilon: float = 1e-10) -> opttx.GradientTransformation:
        # blocks of at most 4: the 9-wide dims are split, as Meta's blocking does
        return opttx.shampoo(lr, betas=(b1, b2), weight_decay=wd, max_preconditioner_dim=4,
                             precondition_frequency=2, start_preconditioning_step=2,
                             grafting="adam", epsilon=epsilon)

    def conditioned_shampoo() -> opttx.GradientTransformation:
        # Where the sharded run's inputs differ from the single-device ones by rounding (a
        # global norm summed in another order), the factors of these few
        # steps are rank-deficient and (L + eps I)^(-1/4) with eps = 1e-10 amplifies 1 ulp to
        # ~1e-3: a larger eps keeps that a float32-rounding comparison
        return shampoo(epsilon=1e-3)

    def clip_shampoo() -> opttx.GradientTransformation:
        return opttx.chain(opttx.clip_by_global_norm(clip), conditioned_shampoo())
    # the global norm looks across leaves: the owned leaves' state is the single-device state
    # of shampoo fed the gradients clipped with the norm over all leaves
    clip_shampoo.split = (lambda: opttx.clip_by_global_norm(clip), conditioned_shampoo)
    clip_shampoo.rtol = 1e-4     # the inverse roots in the state still amplify 1 ulp ~10x

    def galore() -> opttx.GradientTransformation:
        return opttx.galore_adamw(lr, rank=2, update_proj_gap=2, weight_decay=wd, b1=b1, b2=b2)

    def clip_galore() -> opttx.GradientTransformation:
        return opttx.chain(opttx.clip_by_global_norm(clip), galore())
    clip_galore.split = (lambda: opttx.clip_by_global_norm(clip), galore)

    return {
        "shampoo": shampoo,
        "galore_adamw": galore,
        "clip_galore": clip_galore,
        "galore_left": lambda: opttx.galore_adamw(lr, rank=3, update_proj_gap=3,
                                                  proj_type="left"),
        "adamw_8bit": lambda: opttx.adamw_8bit(lr, b1, b2, weight_decay=wd, block_size=16,
                                               min_size=16),
        "clip_shampoo": clip_shampoo,
        "adafactor": lambda: opttx.adafactor(lr, min_dim_size_to_factor=1,
                                             factor_axes="largest"),
    }


def _run_case(make: Callable[[], Any], full: dict, grads: list[dict], specs: dict, *,
              local_grads: list[dict] | None = None, first: Callable | None = None,
              owner_group: Any = None, compiled: bool = False) -> dict[str, Any]:
    """The single-device run against the on-owners run of ``make()``; returns the collectives
    per step, the owned leaves and (compiled) the number of graphs."""
    p_loc = _shard_tree(full, specs)
    plan = plan_owners(p_loc, specs, owner_group, tx=make())
    treespec = tree_flatten(full)[1]
    mask = treespec.unflatten(plan.owned())
    prefix, suffix = getattr(make, "split", (opttx.identity, make))
    tx_full, tx_pre, tx_mine = make(), prefix(), opttx.masked(suffix(), mask)
    p_full, s_full, s_mine = full, tx_full.init(full), tx_mine.init(full)
    stats = CollectiveStats()
    if first is not None:
        tx = sharded(opttx.chain(first(stats), on_owners(make(), owner_group)), specs,
                     stats=stats)
    else:
        tx = sharded(make(), specs, on_owners=True, owner_group=owner_group, stats=stats)
    s_loc = tx.init(p_loc)
    step, graphs = tx.update, None
    if compiled:
        from torch._dynamo.testing import CompileCounterWithBackend
        counter = CompileCounterWithBackend("aot_eager")
        step = torch.compile(tx.update, backend=counter, fullgraph=True)
    counts = []
    for g, g_loc in zip(grads, local_grads or grads):
        u, s_full = tx_full.update(g, s_full, p_full)
        _, s_mine = tx_mine.update(tx_pre.update(g, tx_pre.init(full), p_full)[0], s_mine,
                                   p_full)
        p_full = opttx.apply_updates(p_full, u)
        stats.reset()
        u, s_loc = step(_shard_tree(g_loc, specs), s_loc, p_loc)
        counts.append(stats.collectives)
        p_loc = opttx.apply_updates(p_loc, u)
    if compiled:
        graphs = counter.frame_count
    expected = _slicer(full, specs)
    for k in full:
        torch.testing.assert_close(p_loc[k], expected(p_full[k], p_loc[k]), rtol=RTOL,
                                   atol=ATOL, msg=lambda m: f"param {k}: {m}")
    held = s_loc[1] if first is not None else s_loc
    fa, fb = tree_flatten(s_mine.inner_state)[0], tree_flatten(held)[0]
    assert len(fa) == len(fb), f"state: {len(fa)} vs {len(fb)} leaves"
    rtol = getattr(make, "rtol", RTOL)
    for i, (x, y) in enumerate(zip(fa, fb)):
        torch.testing.assert_close(y, x, rtol=rtol, atol=ATOL * rtol / RTOL,
                                   msg=lambda m: f"state leaf {i}: {m}")
    return {"counts": counts, "owned": sum(plan.owned()), "graphs": graphs,
            "loads": list(plan.loads)}


def _record(results: dict, key: str, fn: Callable[[], dict]) -> None:
    try:
        results["cases"].setdefault(key, []).append(fn())
    except AssertionError:
        results["errors"].append(f"{key}: {traceback.format_exc(limit=2)}")


def _tp_worker(rank: int, world: int, store: str, out: str, n_draws: int) -> None:
    """World 2: drawn shapes (dims not divisible by 2, empty shards) and hyperparameters,
    leaves sharded on dim 0, then on dim 1; then the leaf-count independence."""
    _init(rank, world, store)
    results: dict[str, Any] = {"errors": [], "cases": {}}

    @settings(max_examples=n_draws, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(shapes=shape_trees, hp=hparams, seed=st.integers(0, 2**16))
    def run(shapes: dict, hp: dict, seed: int) -> None:
        case = json.dumps([shapes, hp, seed], sort_keys=True)
        every = [None] * world
        dist.all_gather_object(every, case)
        assert len(set(every)) == 1, f"ranks drew different cases: {every}"
        full, grads = _problem(seed, shapes)
        for dim in (0, 1):
            specs = {"w": Shard(dim), "u": Shard(dim), "t": Shard(dim),
                     "b": Shard(0) if dim == 0 else Replicated()}
            for name, make in _transforms(hp).items():
                _record(results, f"{name}/dim{dim}",
                        lambda: _run_case(make, full, grads, specs))
    run()
    # collectives per step do not grow with the number of leaves
    for key, n in (("few", 1), ("many", 6)):
        shapes = {f"{k}{i}": s for i in range(n) for k, s in (("w", (7, 5)), ("t", (3, 5, 4)),
                                                               ("b", (5,)))}
        full, grads = _problem(99, shapes)
        specs = {k: Shard(1) if k[0] == "t" else Shard(0) if k[0] == "w" else Replicated()
                 for k in shapes}
        for name in ("shampoo", "clip_shampoo"):
            _record(results, f"{key}/{name}",
                    lambda: _run_case(_transforms()[name], full, grads[:3], specs))
    # compiled: one graph, no recompiles, the eager numbers (compared inside _run_case). Not
    # clip_shampoo: compiled and eager sums of squares round differently (1 ulp), and
    # Shampoo's inverse roots of its near-singular early factors amplify that to ~1e-5
    full, grads = _problem(5, {"w": (7, 5), "u": (5, 3), "b": (7,)})
    specs = {"w": Shard(0), "u": Shard(1), "b": Replicated()}
    torch._dynamo.config.error_on_recompile = True
    for name in ("shampoo", "clip_galore"):
        torch._dynamo.reset()        # each transform compiles its own code once
        try:
            _record(results, f"compiled/{name}",
                    lambda: _run_case(_transforms()[name], full, grads[:4], specs,
                                      compiled=True))
        except Exception:  # noqa: BLE001 - reported by the test
            results["errors"].append(f"compiled/{name}: {traceback.format_exc(limit=4)}")
    torch._dynamo.config.error_on_recompile = False
    # DTensor leaves: specs read from the placements, updates come back as DTensors
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor
        from torch.distributed.tensor import Shard as DShard
        mesh = init_device_mesh("cpu", (world,))
        placements = {"w": [DShard(0)], "u": [DShard(1)], "b": [Replicate()]}

        def dt(tree: dict) -> dict:
            return {k: distribute_tensor(v, mesh, placements[k]) for k, v in tree.items()}
        full, grads = _problem(8, {"w": (7, 5), "u": (5, 9), "b": (7,)})
        make = _transforms()["shampoo"]
        tx, tx_full = sharded(make(), on_owners=True), make()
        p, pf = dt(full), full
        s, sf = tx.init(p), tx_full.init(full)
        for g in grads:
            u, s = tx.update(dt(g), s, p)
            p = opttx.apply_updates(p, u)
            u, sf = tx_full.update(g, sf, pf)
            pf = opttx.apply_updates(pf, u)
        results["dtensor"] = max(float((p[k].full_tensor() - pf[k]).abs().max()) for k in pf)
    except Exception:  # noqa: BLE001 - reported by the test
        results["dtensor"] = traceback.format_exc(limit=4)
    # apply_if_finite decides for all ranks: a NaN in rank 1's shard (sharded) or in the
    # leaf rank 1 owns (on_owners) skips the step everywhere, as on one device
    full, grads = _problem(9, {"w": (6, 5), "u": (5, 3), "b": (6,)})
    grads[1]["w"][-1, 0] = float("nan")          # in rank 1's rows of w
    specs = {"w": Shard(0), "u": Shard(1), "b": Replicated()}
    skipped = {}
    for mode in ("sharded", "on_owners"):
        make = lambda: opttx.apply_if_finite(opttx.lamb(1e-2), 3)  # noqa: E731
        tx = sharded(make(), specs, on_owners=mode == "on_owners")
        tx_full = make()
        p, pf, sf = _shard_tree(full, specs), full, tx_full.init(full)
        s = tx.init(p)
        for g in grads[:3]:
            u, s = tx.update(_shard_tree(g, specs), s, p)
            p = opttx.apply_updates(p, u)
            u, sf = tx_full.update(g, sf, pf)
            pf = opttx.apply_updates(pf, u)
        expected = _slicer(full, specs)
        skipped[mode] = {
            "same": all(torch.allclose(p[k], expected(pf[k], p[k]), rtol=RTOL, atol=ATOL)
                        for k in full)}
    results["finite"] = skipped
    # bad input: an owner group that does not match the leaves' split, on every rank alike
    singles = [dist.new_group([r]) for r in range(world)]      # every rank creates every group
    p = _shard_tree({"w": torch.ones(6, 4)}, {"w": Shard(0)})
    try:
        sharded(opttx.shampoo(1e-2), {"w": Shard(0)}, on_owners=True,
                owner_group=singles[rank]).init(p)
        results["bad_group"] = None
    except ValueError as e:
        results["bad_group"] = str(e)
    # without on_owners, matrix transforms refuse local shards
    refused = {}
    for name in ("shampoo", "galore_adamw", "adamw_8bit"):
        specs = {"w": Shard(0)}
        p = _shard_tree({"w": torch.ones(64, 40)}, specs)
        tx = sharded(_transforms()[name](), specs)
        try:
            tx.update(p, tx.init(p), p)
            refused[name] = None
        except ValueError as e:
            refused[name] = str(e)
    results["refused"] = refused
    _finish(out, rank, results)


def _mesh_worker(rank: int, world: int, store: str, out: str) -> None:
    """World 4 on a 2x2 mesh: leaves split over both mesh dims (different dims, and nested
    on one dim), owners spread over all four ranks; then TP x DP with owners per TP group."""
    _init(rank, world, store)
    results: dict[str, Any] = {"errors": [], "cases": {}}
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tps[rank // 2], dps[rank % 2]
    shapes = {"w": (7, 10), "u": (6, 5), "t": (3, 7, 10), "b": (7,), "n": (9, 4)}
    specs = {"w": (Shard(0, tp), Shard(1, dp)), "u": (Shard(1, tp), Shard(0, dp)),
             "t": (Shard(1, tp), Shard(-1, dp)), "b": Replicated(),
             "n": (Shard(0, tp), Shard(0, dp))}
    full, grads = _problem(7, shapes)
    for name in ("shampoo", "galore_adamw", "adamw_8bit", "clip_shampoo"):
        _record(results, f"mesh/{name}",
                lambda: _run_case(_transforms()[name], full, grads, specs))
    # TP x DP: gradients differ across DP, averaged on the local shards by
    # all_reduce_gradients(dp); Shampoo then runs on owners within each TP group
    tp_specs = {"w": Shard(0, tp), "u": Shard(1, tp), "t": Shard(1, tp), "b": Replicated(),
                "n": Shard(1, tp)}
    noise = [_problem(100 + j, shapes)[1] for j in range(2)]
    mine = [tree_map(lambda a, b: a + b, g, n) for g, n in zip(grads, noise[rank // 2])]
    # the mean exactly as the bucketed all-reduce (sum, then / 2) rounds it
    mean = [tree_map(lambda a, x, y: ((a + x) + (a + y)) / 2, g, n0, n1)
            for g, n0, n1 in zip(grads, *noise)]
    _record(results, "tpdp/shampoo", lambda: _run_case(
        _transforms()["shampoo"], full, mean, tp_specs, local_grads=mine, owner_group=tp,
        first=lambda stats: all_reduce_gradients(dp, stats=stats)))
    _finish(out, rank, results)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_tp_worker, 2, tmp_path_factory.mktemp("owners_tp"), 3)


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_mesh_worker, 4, tmp_path_factory.mktemp("owners_mesh"))


NAMES = list(_transforms())


@pytest.mark.parametrize("name", NAMES)
def test_on_owners_equals_single_device(tp_results: list[dict], name: str) -> None:
    for r, res in enumerate(tp_results):
        mine = [e for e in res["errors"] if e.startswith(f"{name}/")]
        assert not mine, f"rank {r}:\n" + "\n".join(mine)
        for dim in (0, 1):
            assert len(res["cases"][f"{name}/dim{dim}"]) == 3


def test_owners_hold_the_state_of_their_leaves_only(tp_results: list[dict]) -> None:
    for name in NAMES:
        for dim in (0, 1):
            owned = [res["cases"][f"{name}/dim{dim}"][0]["owned"] for res in tp_results]
            assert sum(owned) == 4, (name, dim, owned)   # each of the 4 leaves on one rank
            assert min(owned) >= 1, (name, dim, owned)   # balanced: both ranks work


def test_two_collectives_per_step_whatever_the_leaf_count(tp_results: list[dict]) -> None:
    for res in tp_results:
        for key, want in (("shampoo", 2), ("clip_shampoo", 3)):
            few, many = (res["cases"][f"{n}/{key}"][0] for n in ("few", "many"))
            assert few["counts"] == many["counts"] == [want] * 3, (key, few, many)
            assert many["owned"] >= 8                      # 18 leaves over 2 ranks
        for name in NAMES:
            counts = res["cases"][f"{name}/dim0"][0]["counts"]
            assert counts == [3 if name.startswith("clip") else 2] * 5, (name, counts)


def test_compiled_on_owners_step_is_one_graph(tp_results: list[dict]) -> None:
    for r, res in enumerate(tp_results):
        errors = [e for e in res["errors"] if e.startswith("compiled/")]
        assert not errors, f"rank {r}:\n" + "\n".join(errors)
        for name in ("shampoo", "clip_galore"):
            assert res["cases"][f"compiled/{name}"][0]["graphs"] == 1


def test_dtensor_leaves_on_owners(tp_results: list[dict]) -> None:
    for res in tp_results:
        assert res["dtensor"] == 0.0, res["dtensor"]


def test_apply_if_finite_decides_for_every_rank(tp_results: list[dict]) -> None:
    for res in tp_results:
        for mode, out in res["finite"].items():
            assert out["same"], (mode, out)


def test_mismatched_owner_group_raises_on_every_rank(tp_results: list[dict]) -> None:
    messages = [res["bad_group"] for res in tp_results]
    assert all(m is not None for m in messages), messages
    assert any("owner group" in m for m in messages), messages


def test_matrix_transforms_refuse_local_shards(tp_results: list[dict]) -> None:
    for res in tp_results:
        for name, message in res["refused"].items():
            assert message is not None, f"{name} ran on a local shard"
            assert "on_owners" in message and "whole matrices" in message, message


def test_mesh_and_tp_dp_on_owners_equal_single_device(mesh_results: list[dict]) -> None:
    for r, res in enumerate(mesh_results):
        assert not res["errors"], f"rank {r}:\n" + "\n".join(res["errors"])
        for name in ("shampoo", "galore_adamw", "adamw_8bit", "clip_shampoo"):
            assert res["cases"][f"mesh/{name}"][0]["counts"][0] == \
                (3 if name.startswith("clip") else 2)
        # TP x DP: one bucket all-reduce + two all_to_all per step
        assert res["cases"]["tpdp/shampoo"][0]["counts"] == [3] * 5
    owned = [res["cases"]["mesh/shampoo"][0]["owned"] for res in mesh_results]
    assert sum(owned) == 5 and max(owned) <= 2, owned


def test_on_owners_outside_sharded_is_the_transform_itself() -> None:
    """on_owners outside sharded raised, so one factory could not serve both the
    single-device reference and the sharded run. Now it is tx itself there: the same state
    and bitwise the same updates."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    owned, plain = on_owners(opttx.shampoo(1e-2)), opttx.shampoo(1e-2)
    s_owned, s_plain = owned.init(params), plain.init(params)
    assert tree_flatten(s_owned)[1] == tree_flatten(s_plain)[1]
    for _ in range(3):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        u_owned, s_owned = owned.update(g, s_owned, params)
        u_plain, s_plain = plain.update(g, s_plain, params)
        assert all(torch.equal(u_owned[k], u_plain[k]) for k in params)


def clip_then_shampoo_on_owners() -> opttx.GradientTransformation:
    """One factory for both runs of assert_shard_invariant (importable by its ranks); the
    larger epsilon keeps the global norm's rounding (summed in another order when sharded)
    from being amplified by rank-deficient factors (see conditioned_shampoo above)."""
    return opttx.chain(opttx.clip_by_global_norm(1.0),
                       on_owners(opttx.shampoo(1e-2, epsilon=1e-3)))


@pytest.mark.timeout(300)
def test_one_factory_with_on_owners_serves_assert_shard_invariant() -> None:
    """The factory holds on_owners itself: no hand-written owners_if_sharded is needed for
    the single-device reference."""
    from opttx.testing import assert_shard_invariant
    report = assert_shard_invariant(clip_then_shampoo_on_owners, {"w": (6, 4), "b": (4,)},
                                    specs=[{"w": Shard(0), "b": Replicated()}], steps=3,
                                    rtol=1e-4)    # the roots amplify 1 ulp ~10x, as above
    assert report["cases"] == 1 and report["compared"] > 0, report


def test_default_cost_weighs_matrices_by_their_decompositions() -> None:
    from opttx.distributed import default_cost
    assert default_cost((5,)) == 5
    assert default_cost((4, 3)) == 12 + 64 + 27
    assert default_cost((2, 4, 3)) == 24 + 2 * (64 + 27)
    assert default_cost((0, 3)) == 0
