"""`on_owners(tx, buckets=...)` / ``bucket_mb=`` / ``overlap=True``: the leaves travel to the
owners and back in buckets, one bucket's ``all_to_all`` overlapping another's computation.
Bitwise the plain owners path (updates, parameters, the state each rank holds) at world 2
(tensor-parallel Shard(0)/Shard(1) and replicated leaves of odd shapes) and world 4 (a 2x2
mesh, leaves split over both dims), for transforms that need whole leaves (Shampoo, GaLore,
8-bit states, Muon's batched Newton-Schulz) and two that do not; two collectives per bucket;
one graph under ``torch.compile`` (aot_eager, fullgraph) as the plain path (AdamW on three
leaves: the bucketing is the transform's own business); transforms with
statistics across leaves refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import opttx
from opttx.base import traits_of
from opttx.distributed import (CollectiveStats, Replicated, Shard, on_owners, plan_owners,
                               sharded)
from opttx.distributed.owners_overlap import make_buckets
from opttx.testing import gradient_stream, spawn_ranks
from opttx.tree import tree_flatten

from test_distributed import _shard_tree

pytestmark = pytest.mark.timeout(300)

STEPS = 3

TXS = {
    "shampoo": lambda: opttx.shampoo(1e-2, max_preconditioner_dim=4, precondition_frequency=2,
                                     start_preconditioning_step=2, epsilon=1e-6,
                                     grafting="adam"),
    "muon": lambda: opttx.muon(1e-2),
    "galore_adamw": lambda: opttx.galore_adamw(1e-2, rank=2, update_proj_gap=2,
                                               weight_decay=0.01),
    "adamw_8bit": lambda: opttx.adamw_8bit(1e-2, weight_decay=0.01, block_size=16,
                                           min_size=16),
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=1, factor_axes="largest"),
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.01),
}
# (buckets, bucket_mb): three, one leaf (or shape group) per bucket; overlap=True (4) below
BUCKETS = ((3, None), (None, 0.0))


def model(world: int) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(world)
    shapes = {"a": (7, 5), "b": (7, 5), "c": (9, 6), "d": (5, 9), "e": (7, 5), "bias": (5,),
              "t": (3, 7, 5)}
    full = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    if world == 2:
        specs = {"a": Shard(0), "b": Shard(1), "c": Shard(0), "d": Shard(1), "e": Replicated(),
                 "bias": Replicated(), "t": Shard(1)}
    else:                               # a 2x2 mesh: every rank creates every group
        tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        rank = dist.get_rank()
        tp, dp = tps[rank // 2], dps[rank % 2]
        specs = {"a": (Shard(0, tp), Shard(1, dp)), "b": (Shard(1, tp), Shard(0, dp)),
                 "c": (Shard(0, tp), Shard(0, dp)), "d": (Shard(1, tp), Shard(1, dp)),
                 "e": Replicated(), "bias": Replicated(), "t": (Shard(1, tp), Shard(-1, dp))}
    return full, specs


def _run(tx, local: dict, grads: list[dict], specs: dict, stats: CollectiveStats,
         step=None) -> tuple[dict, list, list[int], list[dict]]:
    p, state, counts, updates = local, tx.init(local), [], []
    step = step or tx.update
    for g in grads:
        stats.reset()
        u, state = step(_shard_tree(g, specs), state, p)
        counts.append(stats.collectives)
        updates.append(u)
        p = opttx.apply_updates(p, u)
    return p, tree_flatten(state)[0], counts, updates


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b))


def worker(rank: int, world: int) -> dict:
    full, specs = model(world)
    grads = gradient_stream(full, STEPS, seed=world + 11)
    local = _shard_tree(full, specs)
    out = {}
    for name, make in TXS.items():
        stats = CollectiveStats()
        plain = _run(sharded(on_owners(make()), specs, stats=stats), local, grads, specs,
                     stats)
        for buckets, mb in BUCKETS:
            stats = CollectiveStats()
            tx = sharded(on_owners(make(), buckets=buckets, bucket_mb=mb), specs, stats=stats)
            got = _run(tx, local, grads, specs, stats)
            plan = plan_owners(local, specs, tx=make())
            nbytes = [0 if leaf is None else leaf.numel() * 4 for leaf in plan.leaves]
            n = len(make_buckets(plan, nbytes, buckets, mb,
                                 traits_of(make()).batched_across_leaves))
            out[name, buckets, mb] = {"n": n,
                "params": all(torch.equal(got[0][k], plain[0][k]) for k in full),
                "updates": all(torch.equal(a[k], b[k]) for a, b in zip(got[3], plain[3])
                               for k in full),
                "state": _same(got[1], plain[1]),
                "counts": got[2], "plain_counts": plain[2]}
    # the default bucket size (overlap=True): the same numbers
    stats = CollectiveStats()
    got = _run(sharded(on_owners(TXS["shampoo"](), overlap=True), specs, stats=stats), local,
               grads, specs, stats)
    stats = CollectiveStats()
    plain = _run(sharded(on_owners(TXS["shampoo"]()), specs, stats=stats), local, grads, specs,
                 stats)
    out["default"] = all(torch.equal(got[0][k], plain[0][k]) for k in full) \
        and _same(got[1], plain[1])
    if world == 2:                     # compiled: one graph, no recompile, the eager numbers
        from torch._dynamo.testing import CompileCounterWithBackend
        torch._dynamo.config.error_on_recompile = True
        small = {k: full[k] for k in ("a", "d", "bias")}
        specs = {k: specs[k] for k in small}
        counter = CompileCounterWithBackend("aot_eager")
        stats = CollectiveStats()
        tx = sharded(on_owners(TXS["adamw"](), buckets=2), specs, stats=stats)
        step = torch.compile(tx.update, backend=counter, fullgraph=True)
        got = _run(tx, _shard_tree(small, specs), [{k: g[k] for k in small} for g in grads],
                   specs, stats, step)
        stats = CollectiveStats()
        plain = _run(sharded(on_owners(TXS["adamw"]()), specs, stats=stats),
                     _shard_tree(small, specs), [{k: g[k] for k in small} for g in grads],
                     specs, stats)
        out["compiled"] = {"frames": counter.frame_count,
                           "close": max(float((got[0][k] - plain[0][k]).abs().max())
                                        for k in small)}
        torch._dynamo.config.error_on_recompile = False
    return out


@pytest.fixture(scope="module", params=[2, 4])
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, spawn_ranks(worker, request.param, timeout=240)


@pytest.mark.parametrize("name", list(TXS))
def test_overlapped_owners_equal_plain_bitwise(results, name: str) -> None:
    world, res = results
    for rank, r in enumerate(res):
        for buckets, mb in BUCKETS:
            case = r[name, buckets, mb]
            assert case["params"] and case["updates"] and case["state"], (world, rank, buckets,
                                                                          mb, case)
            assert case["plain_counts"] == [2] * STEPS
            # one bucket per leaf (per shape for Muon: 5 shapes of 7 leaves) with bucket_mb=0
            units = 5 if name == "muon" else 7
            assert case["n"] == (buckets if buckets is not None else units)
            assert case["counts"] == [2 * case["n"]] * STEPS, case


def test_overlap_default_and_compiled(results) -> None:
    """overlap=True (4 buckets) is the plain path bit for bit; compiled (world 2), one graph
    with the eager numbers."""
    world, res = results
    for r in res:
        assert r["default"]
        if world == 2:
            assert r["compiled"]["frames"] == 1, r["compiled"]
            assert r["compiled"]["close"] <= 1e-6, r["compiled"]


def test_buckets_refuse_statistics_across_leaves() -> None:
    with pytest.raises(ValueError, match="across leaves"):
        on_owners(opttx.chain(opttx.clip_by_global_norm(1.0), opttx.shampoo(1e-2)), buckets=2)
    with pytest.raises(ValueError, match="per_leaf"):
        on_owners(opttx.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s)),
                  overlap=True)
    with pytest.raises(ValueError, match="split_above_mb"):
        on_owners(opttx.shampoo(1e-2), buckets=2, split_above_mb=1.0)
    with pytest.raises(ValueError, match="buckets"):
        on_owners(opttx.shampoo(1e-2), buckets=0)


def test_make_buckets_keep_shapes_together_for_batched_transforms() -> None:
    from opttx.distributed.owners import OwnerPlan
    from opttx.distributed.owners_overlap import make_buckets
    shapes = [(4, 4), (4, 8), (4, 4), (2,), (4, 8)]
    plan = OwnerPlan.of_whole_leaves(shapes)
    nbytes = [4 * torch.Size(s).numel() for s in shapes]
    # leaf by leaf: a bucket closes at 100 bytes (64, 128 | 64, 8 | 128)
    assert make_buckets(plan, nbytes, None, 100 / 2**20, False) == [[0], [1], [2, 3], [4]]
    assert make_buckets(plan, nbytes, 2, None, False) == [[0, 1], [2, 3, 4]]
    # by shape: (4,4) twice, (4,8) twice, (2,) once, each group whole in one bucket
    assert make_buckets(plan, nbytes, None, 0.0, True) == [[0, 2], [1, 4], [3]]
    assert make_buckets(plan, nbytes, 2, None, True) == [[0, 2], [1, 3, 4]]
