"""opttx.distributed: sharded runs equal single-device runs, with a bounded number of collectives.

Multi-process on CPU with gloo (torch.multiprocessing spawn). Spawning is slow, so each
module-scoped fixture spawns its ranks once and loops over many cases inside the workers
(hypothesis draws, derandomized and without shrinking, so every rank draws the same cases);
each rank writes what it found to a JSON file and the tests below assert on it. Every rank
computes the single-device run itself from the same seeded full parameters and gradients and
compares its shard of the parameters and of every state tensor (factored row/column
statistics on the matching slice).
"""

from __future__ import annotations

import datetime
import json
import traceback
from pathlib import Path
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opttx
from opttx.distributed import (CollectiveStats, Replicated, Shard, all_reduce_gradients,
                               global_factor_axes, global_shapes, local_shard, sharded)
from opttx.transforms.factored import factored_axes
from opttx.testing import _start_method, exit_rank
from opttx.tree import tree_flatten, tree_map

STEPS = 5
RTOL, ATOL = 1e-5, 1e-6

# ---------------------------------------------------------------------------------------------
# helpers run inside the workers
# ---------------------------------------------------------------------------------------------


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _finish(out: str, rank: int, results: dict) -> None:
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    exit_rank()


HPARAMS = {"lr": [1e-2, 1e-3, 3e-2], "b1": [0.9, 0.8], "b2": [0.999, 0.95],
           "wd": [0.01, 0.0, 0.1], "clip": [0.5, 0.1, 10.0], "d": [1.0, 0.5], "decay": [0.8, 0.5]}

hparams = st.fixed_dictionaries({k: st.sampled_from(v) for k, v in HPARAMS.items()})
size = st.integers(1, 9)   # 1 leaves one rank an empty shard; odd sizes split unevenly
shape_trees = st.tuples(size, size, size, st.tuples(size, size, size)).map(
    lambda t: {"w": (t[0], t[1]), "u": (t[1], t[2]), "t": t[3], "b": (t[0],)})


def _transforms(hp: dict | None = None) -> dict[str, Callable]:
    """``name -> make(axes)``, where ``axes[rule]`` is the tree of factoring axes that "last"
    or "largest" gives on the global shapes: on a local shard the named rules could decide
    differently (a dim ranked differently, an empty shard below ``min_dim_size_to_factor``);
    see `opttx.distributed.global_factor_axes`."""
    hp = hp or {k: v[0] for k, v in HPARAMS.items()}
    lr, b1, b2, wd, clip, d, decay = (hp[k] for k in ("lr", "b1", "b2", "wd", "clip", "d",
                                                       "decay"))
    return {
        "adam": lambda ax: opttx.adam(lr, b1, b2),
        "adamw": lambda ax: opttx.adamw(lr, b1, b2, weight_decay=wd),
        "lion": lambda ax: opttx.lion(lr / 10, b1, b2, weight_decay=wd),
        "adafactor_last": lambda ax: opttx.adafactor(
            lr, min_dim_size_to_factor=1, decay_rate=decay, clipping_threshold=d,
            factor_axes=ax["last"]),
        "adafactor_largest": lambda ax: opttx.adafactor(
            lr, min_dim_size_to_factor=1, decay_rate=decay, clipping_threshold=d,
            weight_decay_rate=wd, momentum=b1, factor_axes=ax["largest"]),
        "came": lambda ax: opttx.came(lr / 10, b1, b2, clip_threshold=d, weight_decay=wd,
                                      factor_axes=ax["last"]),
        "lamb": lambda ax: opttx.lamb(lr, b1, b2, weight_decay=wd),
        "lars": lambda ax: opttx.lars(lr * 10, weight_decay=wd / 10, momentum=b1),
        "clip_adam": lambda ax: opttx.chain(opttx.clip_by_global_norm(clip),
                                            opttx.adam(lr, b1, b2)),
    }


def _problem(seed: int, shapes: dict[str, tuple[int, ...]]) -> tuple[dict, list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(STEPS)]
    return params, grads


def _shard_tree(tree: dict, specs: dict) -> dict:
    return {k: local_shard(v, specs[k]) for k, v in tree.items()}


def _slicer(full: dict, specs: dict) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``expected(full_leaf, local_leaf)``: the slice of a single-device tensor that this rank's
    tensor should equal; a dim whose sizes differ is split like the param dim it comes from
    (found by its (global size, local size)), by every group that shards it, in spec order."""
    splits: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k, p in full.items():
        spec = specs[k]
        shards = () if isinstance(spec, Replicated) else (spec,) if isinstance(spec, Shard) \
            else spec
        local, seq = p, {}
        for s in shards:
            g, d = s.group, s.dim % p.dim()
            r, w = dist.get_rank(g), dist.get_world_size(g)
            local = torch.tensor_split(local, w, dim=d)[r]
            seq.setdefault(d, []).append((r, w))
        for d, steps in seq.items():
            splits[(p.shape[d], local.shape[d])] = steps

    def expected(f: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        assert f.dim() == loc.dim(), (f.shape, loc.shape)
        for j, (a, b) in enumerate(zip(f.shape, loc.shape)):
            if a != b:
                for r, w in splits[(a, b)]:
                    f = torch.tensor_split(f, w, dim=j)[r]
        return f
    return expected


def _run_case(make: Callable, full: dict, grads: list[dict], specs: dict,
              compare: bool = True, local_grads: list[dict] | None = None,
              first: Callable | None = None) -> list[int]:
    """Run ``make()`` single-device (on ``grads``) and sharded (on this rank's shard of
    ``local_grads``, default ``grads``, with ``first(stats)`` as the chain's first link when
    given) for all steps; compare; return the collectives per step."""
    p_loc = _shard_tree(full, specs)
    tx_full = make({rule: dict(zip(full, factored_axes(full, rule, 1)))
                    for rule in ("last", "largest")})
    p_full, s_full = full, tx_full.init(full)
    stats = CollectiveStats()
    inner = make({rule: global_factor_axes(p_loc, specs, rule, 1)
                  for rule in ("last", "largest")})
    tx = sharded(opttx.chain(first(stats), inner) if first else inner, specs, stats=stats)
    s_loc = tx.init(p_loc)        # with ``first``: (EmptyState(), ...), the same leaves
    counts = []
    for g, g_loc in zip(grads, local_grads or grads):
        u, s_full = tx_full.update(g, s_full, p_full)
        p_full = opttx.apply_updates(p_full, u)
        stats.reset()
        u, s_loc = tx.update(_shard_tree(g_loc, specs), s_loc, p_loc)
        counts.append(stats.collectives)
        p_loc = opttx.apply_updates(p_loc, u)
    if compare:
        expected = _slicer(full, specs)
        for what, a, b in (("params", p_full, p_loc), ("state", s_full, s_loc)):
            fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
            assert len(fa) == len(fb), f"{what}: {len(fa)} vs {len(fb)} leaves"
            for i, (x, y) in enumerate(zip(fa, fb)):
                torch.testing.assert_close(y, expected(x, y), rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{what} leaf {i}: {m}")
    return counts


def _run_all(cases: list[tuple[str, Callable, dict, list, dict]]) -> dict:
    results: dict[str, Any] = {"errors": [], "counts": {}}
    for key, make, full, grads, specs in cases:
        try:
            results["counts"].setdefault(key, []).append(_run_case(make, full, grads, specs))
        except AssertionError:
            results["errors"].append(f"{key}: {traceback.format_exc(limit=1)}")
    return results


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------


def _tp_worker(rank: int, world: int, store: str, out: str, n_draws: int) -> None:
    """World 2: every transform on drawn shapes and hyperparameters, params sharded on dim 0
    then on dim 1. Hypothesis is derandomized with no shrinking and never sees a failure (the
    worker records it), so every rank draws the same cases; a gathered digest checks that."""
    _init(rank, world, store)
    results: dict[str, Any] = {"errors": [], "counts": {}, "drawn": []}

    @settings(max_examples=n_draws, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(shapes=shape_trees, hp=hparams, seed=st.integers(0, 2**16))
    def run(shapes: dict, hp: dict, seed: int) -> None:
        case = json.dumps([shapes, hp, seed], sort_keys=True)
        every = [None] * world
        dist.all_gather_object(every, case)
        assert len(set(every)) == 1, f"ranks drew different cases: {every}"
        results["drawn"].append(case)
        full, grads = _problem(seed, shapes)
        for dim in (0, 1):
            specs = {"w": Shard(dim), "u": Shard(dim), "t": Shard(dim),
                     "b": Shard(0) if dim == 0 else Replicated()}
            cases = [(f"{name}/dim{dim}", make, full, grads, specs)
                     for name, make in _transforms(hp).items()]
            part = _run_all(cases)
            results["errors"] += [f"{e}\n  case: {case}" for e in part["errors"]]
            for k, v in part["counts"].items():
                results["counts"].setdefault(k, []).extend(v)
    run()
    # the number of collectives does not grow with the number of leaves
    for key, n in (("few_leaves", 1), ("many_leaves", 8)):
        shapes = {f"{k}{i}": s for i in range(n) for k, s in (("w", (7, 5)), ("t", (3, 5, 4)),
                                                               ("b", (5,)))}
        full, grads = _problem(99, shapes)
        specs = {k: Shard(1) if k[0] == "t" else Shard(0) for k in shapes}
        results[key] = {name: _run_case(make, full, grads[:2], specs, compare=False)
                        for name, make in _transforms().items()}
    _finish(out, rank, results)


def _mesh_worker(rank: int, world: int, store: str, out: str) -> None:
    """World 4 on a 2x2 mesh: leaves sharded over both mesh dims at once."""
    _init(rank, world, store)
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, dp = tps[rank // 2], dps[rank % 2]
    # tp-sharded sizes in {5, 7}, dp-sharded sizes in {6, 10}: a (global, local) pair names its
    # group unambiguously for the comparison
    # "n": FSDP-on-TP, both groups split dim 0 (9 -> 5|4 over TP -> 3|2 or 2|2 over DP)
    shapes = {"w": (7, 10), "u": (6, 5), "t": (3, 7, 10), "b": (7,), "n": (9, 4)}
    specs = {"w": (Shard(0, tp), Shard(1, dp)), "u": (Shard(1, tp), Shard(0, dp)),
             "t": (Shard(1, tp), Shard(-1, dp)), "b": Shard(0, tp),
             "n": (Shard(0, tp), Shard(0, dp))}
    full, grads = _problem(7, shapes)
    txs = _transforms()
    names = ["adafactor_last", "adafactor_largest", "came", "lamb", "clip_adam"]
    results = _run_all([(n, txs[n], full, grads, specs) for n in names])
    results["global_shapes"] = [list(s) for s in global_shapes(_shard_tree(full, specs), specs)]
    # TP x DP: leaves sharded over TP only, gradients differing across the DP group, averaged
    # by all_reduce_gradients(dp) as the first link of the sharded chain
    tp_specs = {"w": Shard(0, tp), "u": Shard(1, tp), "t": Shard(1, tp), "b": Replicated(),
                "n": Shard(1, tp)}
    noise = [_problem(100 + j, shapes)[1] for j in range(2)]
    mine = [tree_map(lambda a, b: a + b, g, n) for g, n in zip(grads, noise[rank // 2])]
    mean = [tree_map(lambda a, x, y: a + (x + y) / 2, g, n0, n1)
            for g, n0, n1 in zip(grads, *noise)]
    for n in ("adafactor_last", "lamb"):
        try:
            results["counts"][f"tpdp/{n}"] = [_run_case(
                txs[n], full, mean, tp_specs, local_grads=mine,
                first=lambda stats: all_reduce_gradients(dp, stats=stats))]
        except AssertionError:
            results["errors"].append(f"tpdp/{n}: {traceback.format_exc(limit=1)}")
    _finish(out, rank, results)


def _misc_worker(rank: int, world: int, store: str, out: str) -> None:
    """World 2: data-parallel averaging, bad specs, a compiled sharded step, DTensor leaves."""
    _init(rank, world, store)
    results: dict[str, Any] = {}

    # all_reduce_gradients: the mean over ranks, one collective per bucket
    gen = torch.Generator().manual_seed(rank)
    grads = {f"g{i}": torch.randn(64, 64, generator=gen) for i in range(6)}   # 16 KiB each
    stats = CollectiveStats()
    tx = opttx.chain(all_reduce_gradients(bucket_size_mb=40 / 1024, stats=stats),
                     opttx.sgd(1.0))
    u, _ = tx.update(grads, tx.init(grads), grads)
    results["dp_buckets"] = stats.collectives
    expected = {}
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        for i in range(6):
            x = torch.randn(64, 64, generator=g)
            expected[f"g{i}"] = expected.get(f"g{i}", 0) + x / world
    results["dp_mean_ok"] = all(torch.allclose(-u[k], expected[k], rtol=1e-5, atol=1e-6)
                                for k in expected)

    # bad input: clear errors, raised alike on every rank
    params = {"w": local_shard(torch.ones(5, 3), Shard(0)), "b": torch.ones(3)}
    errors = {}
    for name, specs in (("structure", {"w": Shard(0)}),
                        ("dim", {"w": Shard(2), "b": Replicated()}),
                        ("size", {"w": Shard(0, size=6), "b": Replicated()}),
                        ("group", {"w": Shard(0, dist.new_group([0])), "b": Replicated()})):
        try:
            sharded(opttx.lamb(1e-3), specs).init(params)
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    results["errors"] = errors

    # ranks that decide differently (here an explicit factor_axes that differs by rank: w
    # factored on rank 0 only): a clear error with check_collectives, not a gloo abort. (The
    # named rules cannot do this any more: they read the global shapes.)
    specs = {"w": Shard(0), "v": Shard(1)}
    p = _shard_tree({"w": torch.ones(3, 4), "v": torch.ones(4, 6)}, specs)
    axes = {"w": (0, 1) if rank == 0 else None, "v": (0, 1)}
    tx = sharded(opttx.adafactor(1e-2, factor_axes=axes), specs, check_collectives=True)
    try:
        tx.update(p, tx.init(p), p)
        results["mismatch"] = None
    except ValueError as e:
        results["mismatch"] = str(e)

    # compiled sharded step: one graph (fullgraph), same numbers as eager
    full, grads = _problem(3, {"w": (7, 5), "u": (5, 3), "b": (7,)})
    specs = {"w": Shard(0), "u": Shard(1), "b": Shard(0)}
    try:
        tx = sharded(opttx.chain(opttx.clip_by_global_norm(0.5), opttx.lamb(1e-2)), specs)
        p = _shard_tree(full, specs)
        s = tx.init(p)
        torch._dynamo.config.error_on_recompile = True
        step = torch.compile(tx.update, backend="aot_eager", fullgraph=True)
        p_e, s_e, p_c, s_c = p, s, p, s
        for g in grads[:3]:
            gl = _shard_tree(g, specs)
            u, s_e = tx.update(gl, s_e, p_e)
            p_e = opttx.apply_updates(p_e, u)
            u, s_c = step(gl, s_c, p_c)
            p_c = opttx.apply_updates(p_c, u)
        results["compiled"] = all(torch.allclose(p_e[k], p_c[k], rtol=1e-6, atol=1e-7)
                                  for k in p_e)
    except Exception:  # noqa: BLE001 - reported by the test
        results["compiled"] = traceback.format_exc(limit=3)

    # DTensor leaves: specs read from the placements
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor
        from torch.distributed.tensor import Shard as DShard
        mesh = init_device_mesh("cpu", (world,))
        placements = {"w": [DShard(0)], "u": [DShard(1)], "b": [Replicate()]}

        def dt(tree: dict) -> dict:
            return {k: distribute_tensor(v, mesh, placements[k]) for k, v in tree.items()}
        tx = sharded(opttx.adafactor(1e-2, min_dim_size_to_factor=1, factor_axes="last"))
        tx_full = opttx.adafactor(1e-2, min_dim_size_to_factor=1, factor_axes="last")
        p, pf = dt(full), full
        s, sf = tx.init(p), tx_full.init(full)
        for g in grads:
            u, s = tx.update(dt(g), s, p)
            p = tree_map(lambda a, b: a + b, p, u)
            u, sf = tx_full.update(g, sf, pf)
            pf = opttx.apply_updates(pf, u)
        results["dtensor"] = all(torch.allclose(p[k].full_tensor(), pf[k], rtol=RTOL, atol=ATOL)
                                 for k in pf)
    except Exception:  # noqa: BLE001
        results["dtensor"] = traceback.format_exc(limit=3)
    _finish(out, rank, results)


def _spawn(fn: Callable, world: int, tmp: Path, *args: Any) -> list[dict]:
    store, out = tmp / "store", tmp / "out"
    mp.start_processes(fn, args=(world, str(store), str(out), *args), nprocs=world, join=True,
                       start_method=_start_method())
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------------------------
# fixtures: one spawn each
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_tp_worker, 2, tmp_path_factory.mktemp("tp"), 4)


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_mesh_worker, 4, tmp_path_factory.mktemp("mesh"))


@pytest.fixture(scope="module")
def misc_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_misc_worker, 2, tmp_path_factory.mktemp("misc"))


NAMES = ["adam", "adamw", "lion", "adafactor_last", "adafactor_largest", "came", "lamb", "lars",
         "clip_adam"]

# collectives per step, single group: what each transform must not exceed
BOUNDS = {"adam": 0, "adamw": 0, "lion": 0, "lamb": 1, "lars": 1, "clip_adam": 1,
          "adafactor_last": 2, "adafactor_largest": 2, "came": 3}


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", NAMES)
def test_sharded_equals_single_device(tp_results: list[dict], name: str) -> None:
    """World 2, sharded on dim 0 and on dim 1, odd sizes: params and every state tensor equal
    the single-device run over 5 steps, on every rank."""
    for rank, res in enumerate(tp_results):
        errors = [e for e in res["errors"] if e.startswith(f"{name}/")]
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)
        assert {f"{name}/dim0", f"{name}/dim1"} <= set(res["counts"])
        assert len(res["drawn"]) == 4                       # the hypothesis draws all ran
        assert len(res["counts"][f"{name}/dim0"]) == 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", NAMES)
def test_collectives_do_not_grow_with_leaves(tp_results: list[dict], name: str) -> None:
    """Twenty-four sharded leaves need as many collectives per step as three."""
    res = tp_results[0]
    assert res["many_leaves"][name] == res["few_leaves"][name]
    for counts in res["counts"][f"{name}/dim0"]:
        assert len(set(counts)) == 1, f"collectives per step vary: {counts}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", NAMES)
def test_collectives_within_bounds(tp_results: list[dict], name: str) -> None:
    """Per step and per group: clip_by_global_norm 1, LAMB/LARS 1, Adafactor 2, CAME 3."""
    for dim in (0, 1):
        for counts in tp_results[0]["counts"][f"{name}/dim{dim}"]:
            assert max(counts) <= BOUNDS[name], (dim, counts)


@pytest.mark.timeout(240)
def test_exact_collective_counts(tp_results: list[dict]) -> None:
    """Elementwise transforms need none; LAMB, LARS and a global norm exactly one."""
    counts = {k: v[0][0] for k, v in tp_results[0]["counts"].items()}
    for name in ("adam", "adamw", "lion"):
        assert counts[f"{name}/dim0"] == counts[f"{name}/dim1"] == 0
    for name in ("lamb", "lars", "clip_adam"):
        assert counts[f"{name}/dim0"] == counts[f"{name}/dim1"] == 1
    # Adafactor: rows, columns and the row statistic's mean in one reduction, the update's
    # and the parameter's RMS in another; CAME: its two factored phases and the clipping RMS
    for name in ("adafactor_last", "adafactor_largest"):
        assert counts[f"{name}/dim0"] == counts[f"{name}/dim1"] == 2
    assert counts["came/dim0"] == counts["came/dim1"] == 3


@pytest.mark.timeout(240)
def test_two_dim_mesh_equals_single_device(mesh_results: list[dict]) -> None:
    """World 4 on a 2x2 mesh, leaves sharded over both mesh dims (uneven; two groups on one
    dim, as FSDP on a TP shard): exact. And TP x DP:
    sharded over TP, gradients averaged over DP by the chain's first link: exact on the mean
    gradient."""
    for rank, res in enumerate(mesh_results):
        assert not res["errors"], f"rank {rank}:\n" + "\n".join(res["errors"])
        assert res["global_shapes"] == [[7, 10], [6, 5], [3, 7, 10], [7], [9, 4]]
    # a leaf on two groups costs one collective per group, still batched across leaves
    counts = mesh_results[0]["counts"]
    assert counts["lamb"][0][0] == 2
    assert counts["clip_adam"][0][0] == 2
    # TP x DP: one bucket over DP, then LAMB's one reduction over TP
    assert counts["tpdp/lamb"][0][0] == 2


@pytest.mark.timeout(240)
def test_all_reduce_gradients_averages_in_buckets(misc_results: list[dict]) -> None:
    for res in misc_results:
        assert res["dp_mean_ok"]
        assert res["dp_buckets"] == 3      # six 16 KiB leaves in 40 KiB buckets


@pytest.mark.timeout(240)
def test_bad_specs_raise_clear_errors_on_every_rank(misc_results: list[dict]) -> None:
    for res in misc_results:
        errors = res["errors"]
        assert "structure of the params" in errors["structure"]
        assert "shards dim 2" in errors["dim"]
        assert "global size 6" in errors["size"] and "add up to 5" in errors["size"]
    # rank 1 is not in the group: it says so, and rank 0 is told instead of hanging
    assert "is not in" in misc_results[1]["errors"]["group"]
    assert "rank 1 rejected" in misc_results[0]["errors"]["group"]
    # ranks built with different factor_axes: the configuration agreement of init names the
    # setting on every rank, before any collective of the step could be paired wrongly
    for res in misc_results:
        assert "built different transforms or settings" in res["mismatch"]
        assert "factor_axes" in res["mismatch"] and "on rank 1" in res["mismatch"]


@pytest.mark.timeout(240)
def test_compiled_sharded_step_is_one_graph(misc_results: list[dict]) -> None:
    for res in misc_results:
        assert res["compiled"] is True, res["compiled"]


@pytest.mark.timeout(240)
def test_dtensor_leaves(misc_results: list[dict]) -> None:
    for res in misc_results:
        assert res["dtensor"] is True, res["dtensor"]


def test_specs_are_validated_without_a_process_group() -> None:
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard("0")
    with pytest.raises(ValueError, match="size must be >= 0"):
        Shard(0, size=-1)


# ---------------------------------------------------------------------------------------------
# the reducer's routing, in process (a world of one: every collective is real but trivial)
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_reducer_routes_by_reduced_dims(world_of_one: None) -> None:
    """A statistic over an unsharded dim needs no collective; all leaves bound for a group
    share one; a tuple of trees is still one call."""
    from opttx.base import REDUCER_KEY, reduce_statistics
    from opttx.tree import MaskedNode
    params = {"a": torch.ones(4, 3), "b": torch.ones(5, 2), "c": torch.ones(3)}
    specs = {"a": Shard(0), "b": Shard(-1), "c": Replicated()}
    stats = CollectiveStats()
    seen = {}

    def probe(updates, state, params=None, **extra):
        seen["reducer"] = extra[REDUCER_KEY]
        return updates, state
    tx = sharded(opttx.GradientTransformation(lambda p: (), probe), specs, stats=stats)
    tx.update(params, tx.init(params), params)
    red = {REDUCER_KEY: seen["reducer"]}
    ones = {k: torch.ones(()) for k in params}

    def count(partials, dims=None) -> int:
        stats.reset()
        reduce_statistics(partials, red, dims=dims)
        return stats.collectives
    assert count(ones) == 1                                          # a and b batched, c none
    assert count(ones, {"a": (1,), "b": (0,), "c": None}) == 0       # unsharded dims only
    assert count(ones, {"a": (0,), "b": (1,), "c": None}) == 1
    assert count(ones, {"a": (-2,), "b": (0,), "c": None}) == 1      # negative dims resolved
    assert count({"a": MaskedNode(), "b": MaskedNode(), "c": torch.ones(())}) == 0
    assert count((ones, ones), ({"a": (1,), "b": (1,), "c": None}, None)) == 1
    stats.reset()
    reduce_statistics(ones, red, op="max")
    assert stats.collectives == 1
    out = reduce_statistics((ones, ones), red)
    assert isinstance(out, tuple) and torch.equal(out[1]["b"], torch.ones(()))


@pytest.mark.timeout(60)
def test_sharded_wraps_masked_and_partitioned_chains(world_of_one: None) -> None:
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    specs = {"w": Shard(1), "b": Shard(0)}
    # with one rank the numbers cannot differ; what this checks is that the statistics of
    # the masked-in / partitioned leaves reach the reducer (LAMB 1 collective, CAME 3 + LARS 1)
    for make, want in ((lambda: opttx.masked(opttx.lamb(1e-2), {"w": True, "b": False}), 1),
                       (lambda: opttx.partition({"m": opttx.came(1e-3), "v": opttx.lars(1e-1)},
                                                {"w": "m", "b": "v"}), 4)):
        stats = CollectiveStats()
        single, dist_tx = make(), sharded(make(), specs, stats=stats)
        s1, s2 = single.init(params), dist_tx.init(params)
        u1, _ = single.update(params, s1, params)
        stats.reset()
        u2, _ = dist_tx.update(params, s2, params)
        assert stats.collectives == want, (want, stats)
        for k in params:
            torch.testing.assert_close(u1[k], u2[k])


def test_buckets_follow_tree_order_and_capacity() -> None:
    from opttx.distributed import plan_buckets
    leaves = [torch.zeros(256), torch.zeros(256), torch.zeros(1024), torch.zeros(8,
              dtype=torch.float64), torch.zeros(10)]
    # 1 KiB, 1 KiB, 4 KiB, fp64, 40 B with 2 KiB buckets
    assert plan_buckets(leaves, 2048) == [[0, 1], [2], [4], [3]]


@pytest.mark.timeout(60)
def test_apply_updates_mixes_dtensor_and_plain_leaves(world_of_one: None) -> None:
    """A tree under parallelize_module holds DTensor and plain leaves; one grouped kernel
    cannot take both, so they are added per kind."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor import Shard as DShard
    mesh = init_device_mesh("cpu", (1,))
    params = {"w": distribute_tensor(torch.ones(4, 4), mesh, [DShard(0)]), "b": torch.ones(4)}
    updates = {"w": distribute_tensor(torch.full((4, 4), 0.5), mesh, [DShard(0)]),
               "b": torch.full((4,), 2.0)}
    new = opttx.apply_updates(params, updates)
    assert isinstance(new["w"], DTensor)
    torch.testing.assert_close(new["w"].full_tensor(), torch.full((4, 4), 1.5))
    torch.testing.assert_close(new["b"], torch.full((4,), 3.0))
    opttx.apply_updates_(params, updates)
    torch.testing.assert_close(params["w"].full_tensor(), torch.full((4, 4), 1.5))
    torch.testing.assert_close(params["b"], torch.full((4,), 3.0))


@pytest.mark.timeout(300)
def test_drawn_specs_on_a_two_dim_mesh() -> None:
    """Hypothesis-drawn spec trees on a 2x2 mesh (a leaf split over both mesh dims, on two
    dims or twice on one, uneven and empty pieces) for CAME, whose three reductions cover
    rows, columns and whole leaves: the single-device result on every rank."""
    from functools import partial

    from opttx.testing import assert_shard_invariant
    shapes = {"w": (7, 10), "u": (5, 6), "t": (3, 4, 5), "b": (7,)}
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    axes = dict(zip(meta, factored_axes(meta, "last", 1)))
    summary = assert_shard_invariant(partial(opttx.came, 1e-3, factor_axes=axes), shapes,
                                     mesh=(2, 2), n_specs=4, steps=5, seed=3)
    assert summary["cases"] == 4 and summary["compared"] > 0


@pytest.mark.timeout(300)
def test_factoring_rules_read_the_global_shapes() -> None:
    """The named factoring rules ("largest", "last", min_dim_size_to_factor) decide on the
    global shape under sharded, with no global_factor_axes: here the shards of w rank their
    dims differently and rank 1's shard is below the minimum, yet both ranks factor w as the
    whole tensor is, for Adafactor and CAME."""
    from functools import partial

    from opttx.testing import assert_shard_invariant
    shapes = {"w": (9, 6), "u": (6, 8), "t": (3, 10, 4), "b": (9,)}
    specs = {"w": Shard(0), "u": Shard(1), "t": Shard(1), "b": Shard(0)}
    for make in (partial(opttx.adafactor, 1e-2, min_dim_size_to_factor=5),
                 partial(opttx.came, 1e-3, min_dim_size_to_factor=5)):
        summary = assert_shard_invariant(make, shapes, specs=specs, steps=5)
        assert summary["cases"] == 1
