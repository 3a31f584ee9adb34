"""The Muon family distributed, on gloo ranks (one spawn per fixture, every case inside it).

* Dion under `opttx.distributed.sharded` tensor parallelism (leaves split over rows or over
  columns, unevenly, on 2 ranks) equals one device (float64, 10 steps, <= 1e-10 relative;
  only the r-column factors are reduced, through the hook: 6 hook calls per step, each one
  batched all-reduce per group, whatever the number of leaves; no whole matrix is gathered);
* Dion under `opttx.distributed.zero` (whole leaves on owner ranks) equals one device, and
  under tensor parallel x ZeRO (``sharded(zero(dion, dp), specs)``, 4 ranks) too;
* expert-parallel Muon: a 3-D expert stack sharded on its expert axis over 2 ranks is
  orthogonalized where it is, each rank its own experts, with no collective (float32,
  bitwise equal to one device); a dense matrix sharded over a matrix axis is refused on its
  shards (naming on_owners), and ``partition({"local": muon, "owners": on_owners(muon)})``
  gathers only it (<= 1e-6 from one device: its update comes from the owner's run).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import opttx
from opttx.distributed import CollectiveStats, Shard, local_shard, sharded, zero
from test_distributed import _finish, _init, _spawn

STEPS = 10
RTOL = 1e-10
F64 = torch.float64

LAYOUTS = {      # (shape, sharded dim or None)
    "tall_rows": ((9, 4), 0), "tall_cols": ((9, 5), 1), "wide_rows": ((5, 11), 0),
    "wide_cols": ((4, 9), 1), "square": ((6, 6), None), "one_row": ((1, 7), 1),
}


def _problem(seed: int) -> tuple[dict, list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=F64) for k, (s, _) in LAYOUTS.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=F64) for k, (s, _) in LAYOUTS.items()}
             for _ in range(STEPS)]
    return params, grads


def _run(tx, params, grads, state=None):
    state = tx.init(params) if state is None else state
    for g in grads:
        u, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, u)
    return params, state


def _close(ours: torch.Tensor, full: torch.Tensor, what: str) -> str | None:
    scale = max(float(full.abs().max()), 1e-30)
    err = float((ours - full).abs().max()) / scale
    return None if err <= RTOL else f"{what}: relative error {err:.2e}"


def _dion_worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    results: dict[str, Any] = {}
    try:
        specs = {k: (Shard(d) if d is not None else None) for k, (_, d) in LAYOUTS.items()}
        params, grads = _problem(0)
        for fraction, iters in [(0.5, 1), (1.0, 1), (0.25, 2)]:
            make = lambda fraction=fraction, iters=iters: opttx.chain(   # noqa: E731
                opttx.scale_by_dion(fraction, 0.9, power_iters=iters),
                opttx.scale_by_shape(convention="spectral"), opttx.add_decayed_weights(0.01),
                opttx.scale_by_learning_rate(0.02))
            full, _ = _run(make(), params, grads)
            # tensor parallel: each rank its piece of every leaf
            stats = CollectiveStats()
            tx = sharded(make(), specs, stats=stats)
            local = {k: local_shard(v, specs[k]) for k, v in params.items()}
            state = tx.init(local)
            stats.reset()
            for i, g in enumerate(grads):
                u, state = tx.update({k: local_shard(v, specs[k]) for k, v in g.items()},
                                     state, local)
                local = opttx.apply_updates(local, u)
                if i == 0:
                    results[f"calls/{fraction}/{iters}"] = stats.calls
                    results[f"collectives/{fraction}/{iters}"] = stats.collectives
                    results[f"bytes/{fraction}/{iters}"] = stats.bytes
            errors = [e for k in params for e in [_close(local[k], local_shard(full[k],
                                                                                 specs[k]),
                                                          f"sharded {fraction}/{iters} {k}")]
                      if e]
            # zero: whole leaves on owner ranks
            ztx = zero(make())
            zparams, _ = _run(ztx, params, grads)
            errors += [e for k in params for e in [_close(zparams[k], full[k],
                                                          f"zero {fraction}/{iters} {k}")] if e]
            results[f"errors/{fraction}/{iters}"] = errors
    except Exception:
        results["exception"] = traceback.format_exc()
    _finish(out, rank, results)


@pytest.fixture(scope="module")
def dion_results(tmp_path_factory) -> list[dict]:
    return _spawn(_dion_worker, 2, tmp_path_factory.mktemp("dion"))


@pytest.mark.timeout(600)
def test_dion_sharded_and_zero_equal_one_device(dion_results) -> None:
    for rank, res in enumerate(dion_results):
        assert "exception" not in res, res.get("exception")
        for key, errors in res.items():
            if key.startswith("errors/"):
                assert not errors, (rank, key, errors)


@pytest.mark.timeout(600)
def test_dion_reduces_only_its_factors_with_a_fixed_number_of_collectives(dion_results) -> None:
    """Per step: 6 hook calls for one power iteration (B Q with sum |M|, three Cholesky
    passes, B^T P, the column norms of R), 5 more per further iteration; one all-reduce per
    call that has a sharded leaf for it (the default group here): 6 (11) collectives for six
    leaves. The
    bytes are those of the r-column factors and r x r Gram matrices, less than one
    all-reduce of the gradients (1.3 KB of float64 here)."""
    grads_bytes = sum(8 * torch.Size(s).numel() for s, _ in LAYOUTS.values())
    for res in dion_results:
        assert res["calls/0.5/1"] == 6 and res["collectives/0.5/1"] == 6
        assert res["calls/0.25/2"] == 11 and res["collectives/0.25/2"] == 11
        assert res["bytes/0.25/2"] < grads_bytes, (res["bytes/0.25/2"], grads_bytes)


# ---------------------------------------------------------------------------------------------
# expert-parallel Muon
# ---------------------------------------------------------------------------------------------

EXPERT_SHAPES = {"experts": (4, 6, 5), "router": (6, 4), "attn": (8, 6), "norm": (6,)}


def _expert_problem() -> tuple[dict, list[dict]]:
    gen = torch.Generator().manual_seed(3)
    params = {k: torch.randn(s, generator=gen) for k, s in EXPERT_SHAPES.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in EXPERT_SHAPES.items()}
             for _ in range(STEPS)]
    return params, grads


def _matrices(tree):
    return opttx.tree.tree_map(lambda x: x.ndim >= 2, tree)


def _experts_worker(rank: int, world: int, store: str, out: str) -> None:
    from opttx.distributed import on_owners
    _init(rank, world, store)
    results: dict[str, Any] = {}
    try:
        params, grads = _expert_problem()
        make = lambda mask=_matrices: opttx.muon(   # noqa: E731
            0.02, weight_decay=0.01, method="polar_express", muon_mask=mask)
        full, _ = _run(make(), params, grads)
        # experts sharded on the expert axis, the rest replicated: no gather, no collective
        specs = {"experts": Shard(0), "router": None, "attn": None, "norm": None}
        stats = CollectiveStats()
        tx = sharded(make(), specs, stats=stats, check_sizes=False)
        local = {k: local_shard(v, specs[k]) for k, v in params.items()}
        state = tx.init(local)
        stats.reset()
        got, _ = _run(tx, local, [{k: local_shard(v, specs[k]) for k, v in g.items()}
                                  for g in grads], state)
        results["expert_collectives"] = stats.collectives
        results["expert_bitwise"] = all(torch.equal(got[k], local_shard(full[k], specs[k]))
                                        for k in params)
        results["expert_max_error"] = max(float((got[k] - local_shard(full[k], specs[k]))
                                                .abs().max()) for k in params)
        # a dense matrix sharded over a matrix axis is refused on local shards ...
        specs_tp = {**specs, "attn": Shard(0)}
        local_tp = {k: local_shard(v, specs_tp[k]) for k, v in params.items()}
        grads_tp = [{k: local_shard(v, specs_tp[k]) for k, v in g.items()} for g in grads]
        try:
            _run(sharded(make(), specs_tp), local_tp, grads_tp[:1])
            results["refused"] = ""
        except ValueError as e:
            results["refused"] = str(e)
        # ... and goes to an owner while the experts stay where they are
        mixed = opttx.partition(
            {"local": make(lambda p: {k: k == "experts" for k in p}),
             "owners": on_owners(make())},
            lambda p: {k: "local" if k == "experts" else "owners" for k in p})
        got, _ = _run(sharded(mixed, specs_tp), local_tp, grads_tp)
        results["mixed_max_error"] = max(
            float((got[k] - local_shard(full[k], specs_tp[k])).abs().max()) for k in params)
    except Exception:
        results["exception"] = traceback.format_exc()
    _finish(out, rank, results)


@pytest.fixture(scope="module")
def expert_results(tmp_path_factory) -> list[dict]:
    return _spawn(_experts_worker, 2, tmp_path_factory.mktemp("experts"))


@pytest.mark.timeout(600)
def test_expert_parallel_muon_runs_locally_and_equals_one_device(expert_results) -> None:
    for rank, res in enumerate(expert_results):
        assert "exception" not in res, res.get("exception")
        assert res["expert_collectives"] == 0, res
        assert res["expert_bitwise"], (rank, res["expert_max_error"])
        assert "on_owners" in res["refused"] and "matrix axes" in res["refused"], res
        assert res["mixed_max_error"] <= 1e-6, res


# ---------------------------------------------------------------------------------------------
# Dion under tensor parallel x ZeRO (4 ranks: TP groups {0, 1}, {2, 3}; DP groups {0, 2}, {1, 3})
# ---------------------------------------------------------------------------------------------


def _tp_zero_worker(rank: int, world: int, store: str, out: str) -> None:
    from opttx.distributed import Replicated
    from test_tp_zero import _groups, _layout, _problem
    _init(rank, world, store)
    results: dict[str, Any] = {"errors": []}
    try:
        tp, dp = _groups(rank)
        for draw in [(5, 7, 3, 0, 1, None, None, 1), (6, 4, 9, 1, 0, 0, 16, 2),
                     (3, 8, 5, None, 1, 1, 160, 3)]:
            shapes, tp_dims, chunk, seed = _layout(draw)
            full, grads = _problem(shapes, seed)
            specs = {k: Replicated() if d is None else Shard(d, tp) for k, d in tp_dims.items()}
            shard = lambda tree: {k: local_shard(v, specs[k])   # noqa: E731
                                  for k, v in tree.items()}
            make = lambda: opttx.dion(0.02, rank_fraction=0.5, weight_decay=0.01)  # noqa: E731
            kw = ({"chunk_size_mb": chunk / 2**20} if chunk else {})
            tx = sharded(zero(make(), dp, **kw), specs)
            ref = make()
            p, p_ref = shard(full), full
            s, s_ref = tx.init(p), ref.init(full)
            for per_replica in grads:
                mean = opttx.tree.tree_map(lambda *g: sum(g) / len(g), *per_replica)
                u, s_ref = ref.update(mean, s_ref, p_ref)
                p_ref = opttx.apply_updates(p_ref, u)
                u, s = tx.update(shard(per_replica[rank // 2]), s, p)
                p = opttx.apply_updates(p, u)
            for k in full:
                want = local_shard(p_ref[k], specs[k])
                err = float((p[k] - want).abs().max()) / max(float(want.abs().max()), 1e-30)
                if err > 1e-5:
                    results["errors"].append(f"{draw} {k}: relative error {err:.2e}")
    except Exception:
        results["exception"] = traceback.format_exc()
    _finish(out, rank, results)


@pytest.mark.timeout(600)
def test_dion_under_tensor_parallel_zero_equals_one_device(tmp_path) -> None:
    """``sharded(zero(dion, dp), specs)`` on a 2 x 2 mesh (float32, 5 steps, <= 1e-5 relative,
    the bound of tests/test_tp_zero.py): the owners of each leaf's TP shards reduce Dion's
    factors over the TP group, as under ``sharded`` alone."""
    for rank, res in enumerate(_spawn(_tp_zero_worker, 4, tmp_path)):
        assert "exception" not in res, res.get("exception")
        assert not res["errors"], (rank, res["errors"])
