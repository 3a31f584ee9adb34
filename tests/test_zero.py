"""opttx.distributed.zero: ZeRO stage 1/2 over chunks equals the single-device run on the mean
gradient, with 2 collectives per chunk; and zero_plan's layout.

Multi-process on CPU with gloo, as tests/test_distributed.py: each module-scoped fixture spawns
its ranks once and loops over the cases inside the workers (hypothesis derandomized and without
shrinking, so every rank draws the same cases; a gathered digest checks that); each rank writes
what it found to a JSON file and the tests below assert on it. Every rank computes every rank's
gradients (dyadic values, so their mean is exact in float32) and runs the single-device
transform on the mean itself.
"""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import opttx
from opttx.distributed import CollectiveStats, ZeroPlan, state_costs, zero, zero_plan
from opttx.tree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_paths
from test_distributed import _finish, _init
from test_distributed import _spawn as spawn

STEPS = 5
RTOL, ATOL = 1e-5, 1e-6
MIB = 1 << 20

# ---------------------------------------------------------------------------------------------
# the transforms, the problems
# ---------------------------------------------------------------------------------------------

TXS: dict[str, Callable[[], opttx.GradientTransformation]] = {
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.01),
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=1, momentum=0.9),
    "came": lambda: opttx.came(1e-3, weight_decay=0.01),
    "lamb": lambda: opttx.lamb(1e-2, weight_decay=0.01),
    "galore_adamw": lambda: opttx.galore_adamw(1e-2, rank=2, update_proj_gap=2),
    "shampoo": lambda: opttx.shampoo(1e-2, max_preconditioner_dim=6),
    "adamw_8bit": lambda: opttx.adamw_8bit(1e-3, min_size=12, block_size=16),
    "clip_adamw": lambda: opttx.chain(opttx.clip_by_global_norm(0.5), opttx.adamw(1e-2)),
}
CROSS_LEAF = {"clip_adamw"}          # one statistic across leaves: one more collective

size = st.integers(1, 9)
# a small model: an embedding, 1 to 4 layers, a 3-d head; odd sizes, some of 1
shape_trees = st.tuples(size, size, size, st.integers(1, 4)).map(
    lambda t: {"embed": (t[0], t[1]),
               "layers": [{"w": (t[1], t[1]), "u": (t[1], t[2]), "n": (t[2],)}
                          for _ in range(t[3])],
               "head": (t[2], 2, t[0])})
# chunk capacity in bytes (None: searched over 16 B .. 528 B)
chunk_configs = st.sampled_from([None, 16, 48, 160, 4096])


def _plan_kwargs(chunk: int | None) -> dict:
    if chunk is None:
        return {"chunk_size_mb": None, "min_chunk_size_mb": 16 / MIB,
                "search_range_mb": 512 / MIB}
    return {"chunk_size_mb": chunk / MIB}


def _build(shapes: Any, make: Callable[[tuple], torch.Tensor]) -> Any:
    """A tree like ``shapes`` (dicts and lists of shape tuples) of ``make(shape)``."""
    if isinstance(shapes, dict):
        return {k: _build(v, make) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [_build(v, make) for v in shapes]
    return make(tuple(shapes))


def _problem(seed: int, shapes: dict, world: int, steps: int = STEPS
             ) -> tuple[dict, list[list[dict]]]:
    """Full params, and per step the gradients of every rank: multiples of 1/64, so their sum
    and their mean (world a power of two) are exact in float32 whatever the order."""
    gen = torch.Generator().manual_seed(seed)
    params = _build(shapes, lambda s: torch.randn(s, generator=gen))
    grads = [[_build(shapes, lambda s: (torch.randn(s, generator=gen) * 64).round() / 64)
              for _ in range(world)] for _ in range(steps)]
    return params, grads


def _mean(per_rank: list[dict]) -> dict:
    return tree_map(lambda *g: sum(g) / len(g), *per_rank)


# ---------------------------------------------------------------------------------------------
# comparing a rank's state with the single-device state
# ---------------------------------------------------------------------------------------------

_LISTED = re.compile(r"(\.quantized|\.dense\.mu|\.dense\.nu)\[(\d+)\]")


def _full_path(name: str, path: str, full: dict, plan: ZeroPlan, rank: int) -> str:
    """The path in the single-device state of a state leaf of ``rank``. Tree-shaped states
    keep their paths (the other ranks' leaves are just absent); adamw_8bit keeps lists in leaf
    order (the quantized leaves, and the others), so the k-th owned entry is mapped to its
    index among all."""
    if name != "adamw_8bit":
        return path
    leaves = tree_flatten(full)[0]
    big = [i for i, x in enumerate(leaves) if x.dim() >= 1 and x.numel() >= 12]
    small = [i for i in range(len(leaves)) if i not in big]
    owned = set(plan.owned(rank))

    def remap(m: re.Match) -> str:
        pool = big if m.group(1) == ".quantized" else small
        mine = [i for i in pool if i in owned]
        return f"{m.group(1)}[{pool.index(mine[int(m.group(2))])}]"
    return _LISTED.sub(remap, path)


def _compare_state(name: str, s_full: Any, s_zero: Any, full: dict, plan: ZeroPlan,
                   rank: int) -> list[str]:
    ref = {keystr(k): v for k, v in tree_flatten_with_path(s_full)[0]}
    paths = []
    for k, v in tree_flatten_with_path(s_zero)[0]:
        path = _full_path(name, keystr(k), full, plan, rank)
        assert path in ref, f"state leaf {path} is not in the single-device state"
        torch.testing.assert_close(v, ref[path], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, path=path: f"state {path}: {m}")
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# helpers run inside the workers
# ---------------------------------------------------------------------------------------------


def _run_case(name: str, full: dict, grads: list[list[dict]], rank: int, world: int,
              chunk: int | None, stage: int, offload: bool = False) -> dict:
    """``zero(TXS[name]())`` on this rank's gradients against the single-device transform on
    the mean gradient: params every step's end, state at the end; collectives per step."""
    kwargs = _plan_kwargs(chunk)
    stats = CollectiveStats()
    # Adafactor and Shampoo balance their state (not proportional to the parameters)
    balance = "state" if name in ("adafactor", "shampoo") else "params"
    tx = zero(TXS[name](), stage=stage, offload=offload, stats=stats, balance=balance,
              **kwargs)
    s, s_ref, counts = _steps_against_mean(tx, TXS[name](), full, grads, rank, stats)
    # the plan zero made
    costs = state_costs(TXS[name](), full) if balance == "state" else None
    plan = zero_plan(full, world, costs=costs, **kwargs)
    paths = _compare_state(name, s_ref, s, full, plan, rank)
    return {"counts": counts, "chunks": sum(c.segment > 0 for c in plan.chunks),
            "paths": paths, "param_paths": tree_paths(full),
            "all_paths": [keystr(k) for k, _ in tree_flatten_with_path(s_ref)[0]]}


def _steps_against_mean(tx: opttx.GradientTransformation, ref: opttx.GradientTransformation,
                        full: dict, grads: list, rank: int, stats: CollectiveStats
                        ) -> tuple[Any, Any, list[int]]:
    """``tx`` on this rank's gradients against ``ref`` on the mean gradient, the parameters
    compared after every step; the two final states and the collectives of each step."""
    p, s = full, tx.init(full)
    p_ref, s_ref = full, ref.init(full)
    counts = []
    for per_rank in grads:
        u, s_ref = ref.update(_mean(per_rank), s_ref, p_ref)
        p_ref = opttx.apply_updates(p_ref, u)
        stats.reset()
        u, s = tx.update(per_rank[rank], s, p)
        counts.append(stats.collectives)
        p = opttx.apply_updates(p, u)
        for k, a, b in zip(tree_paths(full), tree_flatten(p)[0], tree_flatten(p_ref)[0]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"params {k}: {m}")
    return s, s_ref, counts


def _equivalence(rank: int, world: int, n_draws: int, results: dict) -> None:
    """Every transform at stage 1 and 2 on drawn shapes, chunk sizes and seeds."""
    results.setdefault("errors", [])
    results.setdefault("cases", {})

    @settings(max_examples=n_draws, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(shapes=shape_trees, chunk=chunk_configs, seed=st.integers(0, 2**16))
    def run(shapes: dict, chunk: int | None, seed: int) -> None:
        case = json.dumps([shapes, chunk, seed], sort_keys=True)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, case)
        assert len(set(every)) == 1, f"ranks drew different cases: {every}"
        full, grads = _problem(seed, shapes, world)
        for name in TXS:
            for stage in (1, 2):
                key = f"{name}/stage{stage}"
                try:
                    out = _run_case(name, full, grads, rank, world, chunk, stage)
                    results["cases"].setdefault(key, []).append(out)
                except Exception:  # noqa: BLE001 - reported by the tests
                    results["errors"].append(f"{key}: {traceback.format_exc(limit=2)}\n"
                                             f"  case: {case}")
    run()


def _leaf_independence(rank: int, world: int, results: dict) -> None:
    """One chunk either way: 3 leaves or 24 leaves cost the same collectives per step."""
    out = {}
    for key, n in (("few", 1), ("many", 8)):
        shapes = {f"{k}{i}": s for i in range(n) for k, s in (("w", (7, 5)), ("t", (3, 5, 4)),
                                                               ("b", (5,)))}
        full, grads = _problem(5, shapes, world, steps=2)
        out[key] = {name: _run_case(name, full, grads, rank, world, 1 << 16, 2)["counts"]
                    for name in ("adamw", "lamb", "clip_adamw")}
    results["leaves"] = out


def _compiled(rank: int, world: int, results: dict) -> None:
    """A compiled zero step at stage 1 and 2: one graph each (fullgraph, aot_eager), no
    recompile over the steps, eager's numbers."""
    from torch._dynamo.testing import CompileCounterWithBackend
    results["compiled"] = {}
    for stage in (1, 2):
        try:
            # 64 bytes over 2 ranks: w and u fill the first chunk, b and c the second
            full, grads = _problem(3, {"w": (3, 4), "u": (4, 3), "b": (7,), "c": (5,)},
                                   world, 3)
            make = lambda stage=stage: zero(
                opttx.chain(opttx.clip_by_global_norm(0.5), opttx.adamw(1e-2)), stage=stage,
                chunk_size_mb=64 / MIB)
            tx_e, tx_c = make(), make()
            s_e, s_c = tx_e.init(full), tx_c.init(full)
            counter = CompileCounterWithBackend("aot_eager")
            torch._dynamo.reset()
            torch._dynamo.config.error_on_recompile = True
            step = torch.compile(tx_c.update, backend=counter, fullgraph=True)
            p_e = p_c = full
            for per_rank in grads:
                u, s_e = tx_e.update(per_rank[rank], s_e, p_e)
                p_e = opttx.apply_updates(p_e, u)
                u, s_c = step(per_rank[rank], s_c, p_c)
                p_c = opttx.apply_updates(p_c, u)
            results["compiled"][str(stage)] = {
                "frames": counter.frame_count,
                "same": all(torch.allclose(p_e[k], p_c[k], rtol=1e-6, atol=1e-7)
                            for k in full),
                "chunks": len(zero_plan(full, world, 64 / MIB).chunks)}
        except Exception:  # noqa: BLE001
            results["compiled"][str(stage)] = traceback.format_exc(limit=3)
        finally:
            torch._dynamo.config.error_on_recompile = False


def _restored(rank: int, world: int, results: dict) -> None:
    """A fresh zero transform given a saved state (no init: the plan is resolved from the
    gradients at the first update) continues exactly where the first left off."""
    try:
        full, grads = _problem(12, {"w": (6, 5), "b": (6,), "t": (2, 3, 4)}, world, 4)
        make = lambda: zero(opttx.lamb(1e-2), chunk_size_mb=64 / MIB)
        tx = make()
        p, s = full, tx.init(full)
        for per_rank in grads[:2]:
            u, s = tx.update(per_rank[rank], s, p)
            p = opttx.apply_updates(p, u)
        p2, s2, fresh = p, s, make()
        for per_rank in grads[2:]:
            u, s = tx.update(per_rank[rank], s, p)
            p = opttx.apply_updates(p, u)
            u, s2 = fresh.update(per_rank[rank], s2, p2)
            p2 = opttx.apply_updates(p2, u)
        results["restored"] = all(torch.equal(p[k], p2[k]) for k in full)
    except Exception:  # noqa: BLE001
        results["restored"] = traceback.format_exc(limit=3)


def _errors(rank: int, world: int, results: dict) -> None:
    """Bad input: clear errors, raised alike on every rank (no rank left hanging)."""
    errors: dict[str, str | None] = {}

    def attempt(key: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            errors[key] = None
        except (ValueError, TypeError) as e:
            errors[key] = str(e)

    good = {"w": torch.ones(5, 3), "b": torch.ones(3)}
    # rank 1's parameters differ in shape: every rank is told
    odd = {"w": torch.ones(5, 3 + (rank == 1)), "b": torch.ones(3)}
    attempt("shapes", lambda: zero(opttx.adamw(1e-3)).init(odd))
    # rank 1 passes an integer leaf: it says so, the others are told it rejected its tree
    bad = {"w": torch.ones(5, 3, dtype=torch.int64 if rank == 1 else torch.float32),
           "b": torch.ones(3)}
    attempt("dtype", lambda: zero(opttx.adamw(1e-3)).init(bad))
    # fewer parameters than ranks: a rank owns nothing and runs tx on a tree without leaves
    one = {"w": torch.arange(3.0)}
    tx_one, tx_ref = zero(opttx.chain(opttx.clip_by_global_norm(0.1), opttx.adamw(1e-2))), \
        opttx.chain(opttx.clip_by_global_norm(0.1), opttx.adamw(1e-2))
    s_one, s_ref, p_one, p_ref = tx_one.init(one), tx_ref.init(one), one, one
    for step in range(3):
        g = {"w": torch.full((3,), float(step + 1))}
        u, s_one = tx_one.update(g, s_one, p_one)
        p_one = opttx.apply_updates(p_one, u)
        u, s_ref = tx_ref.update(g, s_ref, p_ref)
        p_ref = opttx.apply_updates(p_ref, u)
    results["too_few"] = bool(torch.equal(p_one["w"], p_ref["w"]))
    tx = zero(opttx.adamw(1e-3))
    s = tx.init(good)
    attempt("structure", lambda: tx.update({"w": torch.ones(5, 3)}, s, good))
    attempt("grad_shape", lambda: tx.update({"w": torch.ones(3, 5), "b": torch.ones(3)}, s,
                                            good))
    results["bad_input"] = errors


def _offload(rank: int, world: int, results: dict) -> None:
    """offload=True (a no-op move on CPU) gives the same numbers; the state stays on the CPU."""
    try:
        full, grads = _problem(11, {"w": (6, 5), "b": (6,), "t": (2, 3, 4)}, world)
        out = _run_case("adamw", full, grads, rank, world, 256, 2, offload=True)
        results["offload"] = {"counts": out["counts"], "chunks": out["chunks"]}
    except Exception:  # noqa: BLE001
        results["offload"] = traceback.format_exc(limit=3)


def _mixed_dtypes(rank: int, world: int, results: dict) -> None:
    """float32 and bfloat16 parameters: one set of chunks per dtype, updates in each
    gradient's dtype, the same numbers as one device (multiples of 1/8: exact bf16 means)."""
    try:
        dtypes = {"w": torch.float32, "h": torch.bfloat16, "b": torch.float32,
                  "g": torch.bfloat16}
        shapes = {"w": (5, 3), "h": (4, 4), "b": (3,), "g": (6,)}
        gen = torch.Generator().manual_seed(4)
        full = {k: torch.randn(shapes[k], generator=gen).to(dtypes[k]) for k in shapes}
        grads = [[{k: ((torch.randn(shapes[k], generator=gen) * 8).round() / 8).to(dtypes[k])
                   for k in shapes} for _ in range(world)] for _ in range(3)]
        make = lambda: opttx.chain(opttx.clip_by_global_norm(0.5), opttx.adamw(1e-2))
        stats = CollectiveStats()
        tx, ref = zero(make(), chunk_size_mb=64 / MIB, stats=stats), make()
        p, s, p_ref, s_ref = full, tx.init(full), full, ref.init(full)
        counts = []
        for per_rank in grads:
            u_ref, s_ref = ref.update(_mean(per_rank), s_ref, p_ref)
            p_ref = opttx.apply_updates(p_ref, u_ref)
            stats.reset()
            u, s = tx.update(per_rank[rank], s, p)
            counts.append(stats.collectives)
            p = opttx.apply_updates(p, u)
            for k in shapes:
                assert u[k].dtype == dtypes[k]
                torch.testing.assert_close(p[k], p_ref[k], rtol=RTOL, atol=ATOL)
        plan = zero_plan(full, world, 64 / MIB)
        results["mixed"] = {"counts": counts, "chunks": [str(c.dtype) for c in plan.chunks]}
    except Exception:  # noqa: BLE001
        results["mixed"] = traceback.format_exc(limit=3)


def _worker(rank: int, world: int, store: str, out: str, n_draws: int, extras: bool) -> None:
    _init(rank, world, store)
    results: dict[str, Any] = {}
    _equivalence(rank, world, n_draws, results)
    if extras:
        _leaf_independence(rank, world, results)
        _errors(rank, world, results)
        _offload(rank, world, results)
        _mixed_dtypes(rank, world, results)
        _restored(rank, world, results)
        _compiled(rank, world, results)
    _finish(out, rank, results)


def _spawn(world: int, tmp: Path, *args: Any) -> list[dict]:
    return spawn(_worker, world, tmp, *args)


# ---------------------------------------------------------------------------------------------
# fixtures: one spawn each
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(2, tmp_path_factory.mktemp("zero2"), 3, True)


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(4, tmp_path_factory.mktemp("zero4"), 2, False)


# ---------------------------------------------------------------------------------------------
# tests: multi-process
# ---------------------------------------------------------------------------------------------


def _check_equivalence(results: list[dict], name: str) -> None:
    for rank, res in enumerate(results):
        errors = [e for e in res["errors"] if e.startswith(f"{name}/")]
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)
        assert {f"{name}/stage1", f"{name}/stage2"} <= set(res["cases"])


def _check_counts(results: list[dict], name: str) -> None:
    """Per step: exactly two collectives per chunk (reduce, gather), plus one for a statistic
    across leaves, the same every step and on every rank."""
    extra = 1 if name in CROSS_LEAF else 0
    for res in results:
        for stage in (1, 2):
            for case in res["cases"][f"{name}/stage{stage}"]:
                assert case["counts"] == [2 * case["chunks"] + extra] * STEPS, case["counts"]


def _check_state_partition(results: list[dict], name: str) -> None:
    """Each state leaf of a parameter is held by its owner only: the ranks' state leaves
    together are the single-device state, every per-parameter leaf on exactly one rank."""
    for stage in (1, 2):
        for cases in zip(*(res["cases"][f"{name}/stage{stage}"] for res in results)):
            everything = set(cases[0]["all_paths"])
            held = [set(c["paths"]) for c in cases]
            assert set().union(*held) == everything
            per_param = [p for p in everything
                         if any(q in p for q in cases[0]["param_paths"])]
            assert per_param
            for path in per_param:
                assert sum(path in h for h in held) == 1, path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(TXS))
def test_zero_equals_single_device_world2(world2: list[dict], name: str) -> None:
    """World 2, stages 1 and 2, drawn shapes and chunk sizes: params after each of 5 steps and
    the owned state equal the single-device run on the mean gradient."""
    _check_equivalence(world2, name)
    _check_counts(world2, name)
    if name != "adamw_8bit":
        _check_state_partition(world2, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(TXS))
def test_zero_equals_single_device_world4(world4: list[dict], name: str) -> None:
    _check_equivalence(world4, name)
    _check_counts(world4, name)
    if name != "adamw_8bit":
        _check_state_partition(world4, name)


@pytest.mark.timeout(300)
def test_collectives_do_not_grow_with_leaves(world2: list[dict]) -> None:
    """Three leaves or twenty-four in one chunk: 2 collectives per step (3 with a global
    norm)."""
    leaves = world2[0]["leaves"]
    assert leaves["few"] == leaves["many"]
    assert leaves["few"] == {"adamw": [2, 2], "lamb": [2, 2], "clip_adamw": [3, 3]}


@pytest.mark.timeout(300)
def test_bad_input_raises_on_every_rank(world2: list[dict]) -> None:
    for res in world2:
        errors = res["bad_input"]
        assert "different parameter trees" in errors["shapes"]
        assert "(5, 3)" in errors["shapes"] and "(5, 4)" in errors["shapes"]
        assert "different structures" in errors["structure"]
        assert "keys ['w'] vs dict with keys ['w', 'b']" in errors["structure"]
        assert "has shape (3, 5)" in errors["grad_shape"]
        assert res["too_few"], "a rank owning no parameter broke the step"
    assert "dtype torch.int64" in world2[1]["bad_input"]["dtype"]
    assert "rank 1 rejected its parameter tree" in world2[0]["bad_input"]["dtype"]


@pytest.mark.timeout(300)
def test_offload_gives_the_same_numbers(world2: list[dict]) -> None:
    for res in world2:     # _run_case compared params and state with one device
        out = res["offload"]
        assert isinstance(out, dict), out
        assert out["counts"] == [2 * out["chunks"]] * len(out["counts"]) and out["chunks"]


@pytest.mark.timeout(300)
def test_mixed_dtypes(world2: list[dict]) -> None:
    for res in world2:
        out = res["mixed"]
        assert isinstance(out, dict), out
        # float32: w grows the chunk, b goes beside it; bfloat16: h fills rank 1's segment, g
        # goes to rank 0's
        assert out["chunks"] == ["torch.float32", "torch.bfloat16"]
        assert out["counts"] == [2 * 2 + 1] * 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_step_is_one_graph(world2: list[dict], stage: int) -> None:
    for res in world2:
        out = res["compiled"][str(stage)]
        assert isinstance(out, dict), out
        assert out["frames"] == 1 and out["same"], out
        assert out["chunks"] >= 2          # several chunks, still one graph


@pytest.mark.timeout(300)
def test_restored_state_continues(world2: list[dict]) -> None:
    for res in world2:
        assert res["restored"] is True, res["restored"]


# ---------------------------------------------------------------------------------------------
# tests: the plan, without processes
# ---------------------------------------------------------------------------------------------

dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float64])
plan_trees = st.lists(st.tuples(st.lists(st.integers(0, 12), min_size=0, max_size=3), dtypes),
                      min_size=1, max_size=16)


def _meta_tree(spec: list) -> dict:
    return {f"p{i}": torch.empty(shape, dtype=dtype, device="meta")
            for i, (shape, dtype) in enumerate(spec)}


def _check_layout(plan: ZeroPlan, params: dict) -> None:
    leaves = list(params.values())
    nbytes = [x.numel() * x.element_size() for x in leaves]
    seen = [0] * len(leaves)
    for k, c in enumerate(plan.chunks):
        used = [0] * plan.world
        for i, r, o, n in zip(c.leaves, c.owners, c.offsets, c.sizes):
            seen[i] += 1
            assert plan.owners[i] == r and plan.chunk_of[i] == k
            assert leaves[i].dtype == c.dtype and n == leaves[i].numel()
            # rank r's parameters fill its segment from the start, back to back, in tree order
            assert o == r * c.segment + used[r]
            used[r] += n
        for r in range(plan.world):
            mine = [i for i, q in zip(c.leaves, c.owners) if q == r]
            assert mine == sorted(mine)
        assert c.segment == max(used)            # trimmed to the fullest segment
        assert c.padding == c.world * c.segment - sum(used)
    assert seen == [1] * len(leaves)             # every parameter in exactly one chunk
    owned = [sum(b for b, r in zip(nbytes, plan.owners) if r == q) for q in range(plan.world)]
    assert owned == list(plan.owned_bytes)
    assert max(owned) - min(owned) <= max(nbytes)   # balanced within the largest parameter
    assert plan.padding_bytes == sum(c.padding * c.element_size for c in plan.chunks)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(spec=plan_trees, world=st.integers(1, 6), chunk=st.integers(8, 2048))
def test_plan_layout(spec: list, world: int, chunk: int) -> None:
    params = _meta_tree(spec)
    _check_layout(zero_plan(params, world, chunk / MIB), params)
    searched = zero_plan(params, world, None, min_chunk_size_mb=chunk / MIB,
                         search_range_mb=4 * chunk / MIB)
    _check_layout(searched, params)
    assert searched.searched
    # the searched size has the least padding of every size in the range
    for size, padding, n_chunks in searched.candidates:
        fixed = zero_plan(params, world, size / MIB)
        assert (fixed.padding_bytes, len(fixed.chunks)) == (padding, n_chunks)
        assert searched.padding_bytes <= padding


def test_plan_example() -> None:
    """Capacity 64 floats over 2 ranks (segments of 32): the 40-float parameter grows the
    first chunk, which rank 0 fills with the next two; the last starts a new chunk."""
    params = {"a": torch.empty(10), "big": torch.empty(40), "c": torch.empty(20),
              "d": torch.empty(5), "e": torch.empty(30)}
    plan = zero_plan(params, 2, 64 * 4 / MIB)
    assert plan.owners == (0, 1, 0, 0, 0)
    assert [c.leaves for c in plan.chunks] == [(0, 2, 3, 1), (4,)]
    assert [c.segment for c in plan.chunks] == [40, 30]
    assert [c.capacity for c in plan.chunks] == [40, 32]
    assert plan.chunks[0].offsets == (0, 10, 30, 40)
    assert [c.padding for c in plan.chunks] == [5, 30]
    assert plan.owned_bytes == (4 * 65, 4 * 40)
    assert plan.padding_bytes == 4 * 35
    assert "rank 1: ['big']" in plan.summary()


def test_plan_search_on_a_deep_model() -> None:
    """300 layers of 1M, 1K and 4M floats (5.9 GiB) over 8 ranks: the searched size pads under
    2.5% with a few dozen chunks; a size too small for the largest parameter pads more than
    the model itself (each 16 MiB parameter then takes a grown chunk of its own, nearly)."""
    params = {f"l{i}": {"w": torch.empty(1024, 1024, device="meta"),
                        "b": torch.empty(1024, device="meta"),
                        "u": torch.empty(4096, 1024, device="meta")} for i in range(300)}
    total = 300 * (1024 * 1024 + 1024 + 4096 * 1024) * 4
    plan = zero_plan(params, 8)
    _check_layout(plan, {p: x for p, x in zip(tree_paths(params), tree_flatten(params)[0])})
    assert plan.searched and plan.padding_bytes < 0.025 * total and len(plan.chunks) <= 40
    assert zero_plan(params, 8, 32).padding_bytes > total


def test_plan_groups_dtypes_and_fills_every_rank_first() -> None:
    params = {"a": torch.empty(4), "h": torch.empty(6, dtype=torch.bfloat16),
              "b": torch.empty(0), "c": torch.empty(3), "d": torch.empty(2)}
    plan = zero_plan(params, 3, 1.0)
    assert [c.dtype for c in plan.chunks] == [torch.float32, torch.bfloat16]
    assert len({plan.owners[i] for i in (0, 2, 3)}) == 3   # first float leaves: 3 ranks


def test_a_parameter_outside_every_chunk_is_an_error() -> None:
    """A plan that leaves a parameter out (or packs it twice) is rejected, never skipped."""
    import dataclasses

    from opttx.distributed.chunk_plan import check_cover
    plan = zero_plan({"a": torch.empty(3), "b": torch.empty(4)}, 2, 1.0)
    chunk = plan.chunks[0]
    j = chunk.leaves.index(1)
    keep = [k for k in range(len(chunk.leaves)) if k != j]
    dropped = dataclasses.replace(chunk, **{f: tuple(getattr(chunk, f)[k] for k in keep)
                                            for f in ("leaves", "owners", "offsets", "sizes")})
    with pytest.raises(ValueError, match=r"\['b'\] is not covered by any chunk"):
        check_cover(dataclasses.replace(plan, chunks=(dropped,)))
    with pytest.raises(ValueError, match="is in 2 chunks"):
        check_cover(dataclasses.replace(plan, chunks=(chunk, chunk)))


def test_plan_and_zero_validate_arguments() -> None:
    params = {"w": torch.empty(3)}
    with pytest.raises(ValueError, match="world must be an integer"):
        zero_plan(params, 0)
    with pytest.raises(ValueError, match="chunk_size_mb"):
        zero_plan(params, 2, 0)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        zero_plan({"i": torch.zeros(3, dtype=torch.int64)}, 2)
    with pytest.raises(ValueError, match="stage must be 1 or 2"):
        zero(opttx.adamw(1e-3), stage=3)
    with pytest.raises(ValueError, match="chunk_size_mb"):
        zero(opttx.adamw(1e-3), chunk_size_mb=-1)
    with pytest.raises(TypeError, match="GradientTransformation"):
        zero(opttx.adamw)


@pytest.mark.timeout(60)
def test_world_of_one_is_the_plain_transform(world_of_one: None) -> None:
    """One rank owns everything: the same updates and state as the plain transform, including
    an empty parameter (a chunk of nothing needs no collective)."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "e": torch.zeros(0, 2),
              "b": torch.randn(3, generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    stats = CollectiveStats()
    tx, ref = zero(opttx.lamb(1e-2), stats=stats, chunk_size_mb=1.0), opttx.lamb(1e-2)
    u, s = tx.update(grads, tx.init(params), params)
    u_ref, s_ref = ref.update(grads, ref.init(params), params)
    for k in params:
        torch.testing.assert_close(u[k], u_ref[k])
    for a, b in zip(tree_flatten(s)[0], tree_flatten(s_ref)[0]):
        torch.testing.assert_close(a, b)
    assert stats.collectives == 2


@pytest.mark.parametrize("name", ["adafactor", "shampoo", "adamw"])
def test_owners_balance_optimizer_state(name: str) -> None:
    """Balanced by state bytes (``balance="state"``), no rank holds more than 1/W of the state
    plus one leaf's state, and never more than when balanced by parameter bytes; for
    Adafactor (vectors whole, matrices factored) strictly less."""
    from opttx.bench.model import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=8, n_heads=4))
    params = dict(model.named_parameters())
    tx = {"adafactor": lambda: opttx.adafactor(1e-2),
          "shampoo": lambda: opttx.shampoo(1e-3, max_preconditioner_dim=256),
          "adamw": lambda: opttx.adamw(1e-3)}[name]()
    costs = state_costs(tx, params)
    assert costs is not None and len(costs) == len(params)
    for world in (2, 4):
        by_state, by_params = (zero_plan(params, world, costs=c) for c in (costs, None))
        held, held_params = ([sum(c for c, r in zip(costs, plan.owners) if r == q)
                              for q in range(world)] for plan in (by_state, by_params))
        assert max(held) <= sum(costs) / world + max(costs), (world, held)
        assert max(held) <= max(held_params) * (1 + 1e-9), (world, held, held_params)
        if name == "adafactor":
            assert max(held) < 0.95 * max(held_params), (world, held, held_params)
