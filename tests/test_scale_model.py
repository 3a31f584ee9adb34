"""The cost model of the optimizer step (`opttx.distributed.cost_model`, printed by
benchmarks/scale_model.py): its byte and call counts equal what gloo runs at world 2 and 4
issue, counted per rank by `opttx.distributed.counting.count_collectives` (a dispatch mode
that sees every functional collective), for the modes opttx runs: AdamW under ZeRO-2
(`zero`), Muon and Shampoo on owners (`on_owners`, the owners and pieces of odd shapes as the
plan makes them, with and without the parameters travelling), and Muon on owners in buckets.
"""

from __future__ import annotations

import pytest
import torch

import opttx
from opttx.distributed import Replicated, Shard, local_shard, on_owners, sharded, zero
from opttx.distributed.cost_model import (bucket_count, gram_traffic, model_shapes,
                                          muonbp_full_traffic, owners_traffic, step_costs,
                                          zero_traffic)
from opttx.distributed.counting import count_collectives
from opttx.testing import spawn_ranks

pytestmark = pytest.mark.timeout(300)

SHAPES = {"a": (7, 5), "b": (6, 9), "c": (9, 6), "d": (5,), "e": (3, 4), "f": (7, 5)}
DIMS = {"a": 0, "b": 1, "c": 0, "d": None, "e": 0, "f": 0}
TXS = {"muon": lambda: opttx.muon(1e-2),
       "shampoo": lambda: opttx.shampoo(1e-2, max_preconditioner_dim=4,
                                        precondition_frequency=2, epsilon=1e-6)}


def _records(tx, grads, params) -> list:
    """The collectives of the second step (the first eager step of a plan adds the ranks'
    agreement on its pieces, one all-reduce of an int64, which the model leaves out)."""
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    with count_collectives() as counts:
        tx.update(grads, state, params)
    return counts.records


def worker(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    specs = {k: Replicated() if d is None else Shard(d) for k, d in DIMS.items()}
    local = {k: local_shard(v, specs[k]) for k, v in full.items()}
    out = {}
    for name, make in TXS.items():
        out[name, 2] = _records(sharded(on_owners(make()), specs), local, local)
    tx = sharded(on_owners(TXS["shampoo"]()), specs)
    _, state = tx.update(local, tx.init(local))
    with count_collectives() as counts:                # without params: gradients only
        tx.update(local, state)
    out["shampoo", 1] = counts.records
    out["muon", "buckets"] = _records(sharded(on_owners(TXS["muon"](), buckets=3), specs),
                                      local, local)
    out["adamw", "zero2"] = _records(zero(opttx.adamw(1e-2), stage=2), full, full)
    # on the shards: Gram-space orthogonalization and MuonBP (row- and column-sharded matrices)
    mats = {k: v for k, v in local.items() if DIMS[k] is not None}
    mat_specs = {k: specs[k] for k in mats}
    for method in ("newton_schulz", "gram_newton_schulz"):
        out["gram", method] = _records(sharded(opttx.orthogonalize(
            method=method, sharded_mode="gram"), mat_specs), mats, mats)
    tx = sharded(opttx.orthogonalize_block_periodic(full_every=2), mat_specs)
    state = tx.init(mats)
    steps = []
    for _ in range(3):                       # full, block, full
        with count_collectives() as counts:
            _, state = tx.update(mats, state, mats)
        steps.append(counts.records)
    out["muonbp"] = steps
    return out


@pytest.fixture(scope="module", params=[2, 4])
def measured(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, spawn_ranks(worker, request.param, timeout=240,
                                      consistency_checks=None)


def _check(records_by_rank: list[list], model, kind: str) -> None:
    for r, records in enumerate(records_by_rank):
        assert len(records) == model.calls, (r, records)
        assert all(k == kind for k, *_ in records), records
        assert sum(s for _, _, s, _ in records) == model.sent[r], (r, records, model)
        assert sum(x for _, _, _, x in records) == model.received[r], (r, records, model)


def test_owners_counts_match_the_model(measured) -> None:
    world, ranks = measured
    shapes, dims = list(SHAPES.values()), list(DIMS.values())
    for name, block in (("muon", None), ("shampoo", 4)):
        for trees in (2, 1) if name == "shampoo" else (2,):
            model = owners_traffic(shapes, dims, world, trees=trees, block_rows=block)
            assert model.calls == 2
            _check([r[name, trees] for r in ranks], model, "all_to_all")
    n = bucket_count(shapes, 4, buckets=3, by_shape=True)
    assert n == 3
    model = owners_traffic(shapes, dims, world, buckets=n)
    _check([r["muon", "buckets"] for r in ranks], model, "all_to_all")


def test_zero2_counts_match_the_model(measured) -> None:
    world, ranks = measured
    model = zero_traffic(list(SHAPES.values()), world)
    records = [r["adamw", "zero2"] for r in ranks]
    for r, rec in enumerate(records):
        assert [k for k, *_ in rec] == ["reduce_scatter", "all_gather"] * (model.calls // 2)
        assert sum(s for _, _, s, _ in rec) == model.sent[r]
        assert sum(x for _, _, _, x in rec) == model.received[r]


def test_model_rows_for_a_named_model() -> None:
    leaves = model_shapes("llama3-8b")
    assert sum(torch.Size(lf.shape).numel() for lf in leaves) == 8_030_261_248
    rows = {r.mode: r for r in step_costs(model_shapes("gpt-1.3b"), 64)}
    assert rows["muon_owners"].calls == 2 and rows["adamw_fsdp"].calls == 0
    # the overlapped path moves the same bytes in more collectives, and hides the shorter
    # of communication and computation behind the longer
    over, plain = rows["muon_owners_overlap"], rows["muon_owners"]
    assert (over.sent, over.received) == (plain.sent, plain.received)
    assert over.time_s < over.comm_s + over.compute_s


def test_shard_modes_match_the_model(measured) -> None:
    """Gram-space orthogonalization (Newton–Schulz: the Gram of every iterate, 5 exchanges;
    Gram Newton–Schulz: 1 + one restart) and MuonBP's full step, counted on gloo."""
    world, ranks = measured
    mats = [(k, s) for k, s in SHAPES.items() if DIMS[k] is not None]
    shapes, dims = [s for _, s in mats], [DIMS[k] for k, _ in mats]
    for method, exchanges in (("newton_schulz", 5), ("gram_newton_schulz", 2)):
        model = gram_traffic(shapes, dims, world, exchanges)
        assert model.calls == 1 + exchanges
        _check([r["gram", method] for r in ranks], model, "all_reduce")
    full = muonbp_full_traffic(shapes, world)
    for r in ranks:
        assert r["muonbp"][1] == []                       # a block step sends nothing
    for step in (0, 2):
        _check([r["muonbp"][step] for r in ranks], full, "all_reduce")
