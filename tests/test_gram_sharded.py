"""Gram-space orthogonalization on shards (``sharded_mode="gram"``), on gloo ranks.

One spawn per world size (2 and 4), every case inside it (hypothesis draws, derandomized and
without shrinking, so every rank draws the same shapes). In each worker:

* Muon (Newton–Schulz and Gram Newton–Schulz), NorMuon, AdaMuon and Dion2 on row- and
  column-sharded matrices of odd shapes (uneven splits, empty shards at world 4), sharded
  three ways: tensor parallel (`sharded` with `Shard` specs), ZeRO (`zero` with
  ``split_above_mb=0``: row segments) and FSDP2 (DTensor ``Shard(0)``/``Shard(1)``
  placements), equal one device in float64 (<= 1e-10 relative, 3 steps);
* the collectives of one step, counted by a wrapper around the functional all-reduce: the
  same number whatever the number of leaves and shape groups (one batched all-reduce per
  exchange: the max, the first Gram matrices, one per later segment), and no gather;
* ``sharded_mode="auto"``: a leaf whose Gram matrix (of the unsharded side) would be larger
  than the matrix is refused (naming ``on_owners``), the others run on their shards;
* a compiled sharded step (``fullgraph``) equals the eager one.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_distributed import _finish, _init, _spawn

import opttx
from opttx.distributed import CollectiveStats, Shard, local_shard, sharded, zero

STEPS = 3
RTOL = 1e-10
DRAWS = {2: 2, 4: 1}
F64 = torch.float64

size = st.integers(1, 9)          # odd sizes split unevenly; 1 leaves ranks empty shards
draws = st.tuples(size, size, size, size, size, st.integers(0, 2**16))


def _problem(shapes: dict, seed: int) -> tuple[dict, list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}
             for _ in range(STEPS)]
    return params, grads


def _run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        u, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, u)
    return params


def _matrices(p):
    return {k: v.ndim >= 2 for k, v in p.items()}


OPTIMIZERS = {
    "muon": lambda mode: opttx.muon(0.02, weight_decay=0.01, muon_mask=_matrices,
                                    sharded_mode=mode),
    "muon/gram_ns": lambda mode: opttx.muon(0.02, method="gram_newton_schulz",
                                            muon_mask=_matrices, sharded_mode=mode),
    "normuon": lambda mode: opttx.normuon(0.02, muon_mask=_matrices, sharded_mode=mode),
    "adamuon": lambda mode: opttx.adamuon(0.02, weight_decay=0.01, muon_mask=_matrices,
                                          sharded_mode=mode),
    "dion2": lambda mode: opttx.dion2(0.02, fraction=0.5, muon_mask=_matrices,
                                      sharded_mode=mode),
}


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-30)
    return float((got - want).abs().max()) / scale if want.numel() else 0.0


def _shapes_and_dims(a: int, b: int, c: int, d: int, e: int, name: str
                     ) -> tuple[dict, dict]:
    """Three matrices and a batch of them, with a vector (AdamW's), and the matrix axis each
    is sharded over: Dion2 selects the smaller side, so it is sharded over the other one."""
    shapes = {"w": (a, b), "u": (c, d + 1), "t": (2, e, a), "x": (b + c, a), "v": (c,)}
    dims = {"w": 0, "u": 1, "t": 2, "x": 0, "v": 0}
    if name == "dion2":     # the unselected side: rows of a tall matrix, columns of a wide one
        dims = {k: (len(s) - 2 if s[-2] > s[-1] else len(s) - 1) if len(s) >= 2 else 0
                for k, s in shapes.items()}
    return shapes, dims


def _fsdp(tree: dict, dims: dict, mesh) -> dict:
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor
    return {k: distribute_tensor(v, mesh, [DShard(dims[k])]) for k, v in tree.items()}


def _equality_errors(shapes: dict, dims: dict, seed: int, name: str, mesh) -> list[str]:
    """TP, ZeRO and FSDP2 runs of ``OPTIMIZERS[name]`` in Gram mode against one device."""
    make = OPTIMIZERS[name]
    params, grads = _problem(shapes, seed)
    full = _run(make("owners"), params, grads)
    errors = []

    def check(got: dict, want: dict, what: str) -> None:
        for k in want:
            err = _error(got[k], want[k])
            if not err <= RTOL:
                errors.append(f"{name}/{what} {k} {shapes[k]}: relative error {err:.2e}")

    # tensor parallel: Shard specs on plain local tensors
    specs = {k: Shard(d) for k, d in dims.items()}
    got = _run(sharded(make("gram"), specs),
               {k: local_shard(v, specs[k]) for k, v in params.items()},
               [{k: local_shard(v, specs[k]) for k, v in g.items()} for g in grads])
    check(got, {k: local_shard(v, specs[k]) for k, v in full.items()}, "tp")
    # ZeRO: every leaf of enough rows split into row segments (Dion2: tall matrices only)
    if name != "dion2" or all(s[-2] > s[-1] for s in shapes.values() if len(s) >= 2):
        check(_run(zero(make("gram"), split_above_mb=0.0), params, grads), full, "zero")
    # FSDP2: DTensor placements, the specs read from them
    got = _run(sharded(make("gram")), _fsdp(params, dims, mesh),
               [_fsdp(g, dims, mesh) for g in grads])
    want = _fsdp(full, dims, mesh)
    check({k: v.to_local() for k, v in got.items()}, {k: v.to_local() for k, v in want.items()},
          "fsdp2")
    return errors


class _CountCollectives:
    """Counts the functional all-reduces and every gather or all-to-all while active."""

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol
        self.funcol, self.all_reduces, self.gathers, self.saved = funcol, 0, 0, {}

    def __enter__(self) -> _CountCollectives:
        def wrap(module, name, field):
            original = getattr(module, name)

            def counted(*args, **kwargs):
                setattr(self, field, getattr(self, field) + 1)
                return original(*args, **kwargs)
            self.saved[(module, name)] = original
            setattr(module, name, counted)
        wrap(self.funcol, "all_reduce", "all_reduces")
        for name in ("all_gather_tensor", "all_to_all_single"):
            wrap(self.funcol, name, "gathers")
        for name in ("all_gather", "all_gather_into_tensor", "all_to_all_single",
                     "all_to_all"):
            wrap(dist, name, "gathers")
        return self

    def __exit__(self, *exc: object) -> None:
        for (module, name), original in self.saved.items():
            setattr(module, name, original)


def _count_worker_cases(world: int) -> dict[str, Any]:
    """All-reduces and gathers of one eager step of `orthogonalize` in Gram mode, for a
    tree of 2 leaves in 1 shape group and one of 9 leaves in 5 shape groups (with a batch of
    matrices and both sides sharded)."""
    out: dict[str, Any] = {}
    trees = {
        "small": ({"a": (7, 3), "b": (7, 3)}, {"a": 0, "b": 0}),
        "large": ({"a": (7, 3), "b": (7, 3), "c": (3, 9), "d": (3, 9), "e": (2, 5, 4),
                   "f": (9, 2), "g": (5, 5), "h": (4, 6), "i": (6, 4)},
                  {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1, "f": 0, "g": 1, "h": 1, "i": 0}),
    }
    for method in ("newton_schulz", "gram_newton_schulz"):
        for label, (shapes, dims) in trees.items():
            params, grads = _problem(shapes, 5)
            specs = {k: Shard(d) for k, d in dims.items()}
            stats = CollectiveStats()
            tx = sharded(opttx.orthogonalize(method=method, sharded_mode="gram"), specs,
                         stats=stats)
            local = {k: local_shard(v, specs[k]) for k, v in params.items()}
            state = tx.init(local)
            stats.reset()
            with _CountCollectives() as count:
                tx.update({k: local_shard(v, specs[k]) for k, v in grads[0].items()}, state)
            out[f"{method}/{label}"] = {"all_reduces": count.all_reduces,
                                        "gathers": count.gathers,
                                        "reducer": stats.collectives, "bytes": stats.bytes}
    return out


def _auto_and_compile(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # auto: "w" is sharded over rows, its Gram matrix (of the 3 columns) smaller: on shards;
    # "u" sharded over its 3 rows has a Gram matrix of its 8 columns: refused
    shapes = {"w": (8, 3), "u": (3, 8)}
    params, grads = _problem(shapes, 7)
    want = _run(opttx.orthogonalize(), params, grads)
    specs = {"w": Shard(0), "u": Shard(0)}
    local = {k: local_shard(v, specs[k]) for k, v in params.items()}
    lgrads = [{k: local_shard(v, specs[k]) for k, v in g.items()} for g in grads]
    try:
        _run(sharded(opttx.orthogonalize(sharded_mode="auto"), specs), local, lgrads)
        out["auto_refused"] = ""
    except ValueError as e:
        out["auto_refused"] = str(e)
    specs_ok = {"w": Shard(0), "u": Shard(1)}
    got = _run(sharded(opttx.orthogonalize(sharded_mode="auto"), specs_ok),
               {k: local_shard(v, specs_ok[k]) for k, v in params.items()},
               [{k: local_shard(v, specs_ok[k]) for k, v in g.items()} for g in grads])
    out["auto_error"] = max(_error(got[k], local_shard(want[k], specs_ok[k])) for k in want)
    # a compiled sharded step: one graph, the eager numbers
    tx = sharded(opttx.orthogonalize(method="gram_newton_schulz", sharded_mode="gram"),
                 specs_ok)
    lp = {k: local_shard(v.float(), specs_ok[k]) for k, v in params.items()}
    state = tx.init(lp)
    step = torch.compile(tx.update, backend="aot_eager", fullgraph=True)
    g = {k: local_shard(v.float(), specs_ok[k]) for k, v in grads[0].items()}
    eager, _ = tx.update(g, state)
    compiled, _ = step(g, state)
    out["compiled_error"] = max(float((eager[k] - compiled[k]).abs().max()) for k in eager)
    return out


def _worker(rank: int, world: int, store: str, out: str, n_draws: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    _init(rank, world, store)
    results: dict[str, Any] = {"errors": [], "drawn": []}
    try:
        mesh = init_device_mesh("cpu", (world,))

        @settings(max_examples=n_draws, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(drawn=draws)
        def run(drawn: tuple) -> None:
            case = json.dumps(drawn)
            every = [None] * world
            dist.all_gather_object(every, case)
            assert len(set(every)) == 1, f"ranks drew different cases: {every}"
            results["drawn"].append(case)
            *sizes, seed = drawn
            for name in OPTIMIZERS:
                shapes, dims = _shapes_and_dims(*sizes, name)
                try:
                    results["errors"] += [f"{e} (case {case})" for e in
                                          _equality_errors(shapes, dims, seed, name, mesh)]
                except Exception:  # noqa: BLE001 - reported by the test
                    results["errors"].append(f"{name} (case {case}): "
                                             f"{traceback.format_exc(limit=4)}")

        run()
        results["counts"] = _count_worker_cases(world)
        if world == 2:
            results.update(_auto_and_compile(world))
    except Exception:  # noqa: BLE001 - reported by the test
        results["exception"] = traceback.format_exc()
    _finish(out, rank, results)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param            # two draws at world 2, one at world 4 (the time budget)
    return world, _spawn(_worker, world, tmp_path_factory.mktemp(f"gram{world}"), DRAWS[world])


@pytest.mark.timeout(300)
def test_gram_mode_equals_one_device_under_tp_zero_and_fsdp2(results) -> None:
    """Muon, NorMuon, AdaMuon and Dion2 in Gram mode, on tensor-parallel, ZeRO and FSDP2
    shards of odd shapes, give every rank its piece of the single-device result."""
    world, ranks = results
    for rank, res in enumerate(ranks):
        assert "exception" not in res, res.get("exception")
        assert len(res["drawn"]) == DRAWS[world]
        assert not res["errors"], (world, rank, res["errors"][:5])


@pytest.mark.timeout(300)
def test_one_batched_all_reduce_per_exchange_whatever_the_leaves(results) -> None:
    """One step of `orthogonalize` in Gram mode: Newton–Schulz (5 steps) all-reduces the
    max, then one Gram matrix per step: 6; Gram Newton–Schulz (restart at step 2) the max,
    the first Gram matrices and one restart: 3. The same for 2 leaves of one shape as for 9
    leaves of 5 shape groups, sharded over rows or columns (each all-reduce carries every
    leaf's); no gather and no all-to-all."""
    world, ranks = results
    for res in ranks:
        assert "exception" not in res, res.get("exception")
        counts = res["counts"]
        for method, expected in (("newton_schulz", 6), ("gram_newton_schulz", 3)):
            for label in ("small", "large"):
                c = counts[f"{method}/{label}"]
                assert c["all_reduces"] == expected, (world, method, label, c)
                assert c["reducer"] == expected, (world, method, label, c)
                assert c["gathers"] == 0, (world, method, label, c)
        # the bytes are the Gram matrices' (of the small side), not the matrices'
        small = counts["gram_newton_schulz/small"]
        assert small["bytes"] == 8 * 2 * (1 + (1 + 9) + 9), small


@pytest.mark.timeout(300)
def test_auto_refuses_a_gram_larger_than_the_matrix_and_compiles(results) -> None:
    """``sharded_mode="auto"`` runs a leaf on its shards only when its Gram matrix (of the
    unsharded side) is no larger than the matrix, refusing the others with a message naming
    ``on_owners``; a compiled sharded step (``fullgraph``) equals the eager one."""
    world, ranks = results
    if world != 2:
        pytest.skip("checked at world 2")
    for res in ranks:
        assert "exception" not in res, res.get("exception")
        assert "on_owners" in res["auto_refused"] and "auto" in res["auto_refused"]
        assert res["auto_error"] <= RTOL
        assert res["compiled_error"] <= 1e-6


@pytest.mark.timeout(60)
def test_sharded_mode_is_checked_and_changes_nothing_on_one_device() -> None:
    """A mode other than the three is refused at construction; on one device (no reducer)
    every mode gives the default's numbers bit for bit, and only "owners" claims whole
    leaves."""
    with pytest.raises(ValueError, match="sharded_mode"):
        opttx.orthogonalize(sharded_mode="gather")
    params, grads = _problem({"w": (5, 3), "t": (2, 3, 4), "v": (4,)}, 1)
    for name, make in OPTIMIZERS.items():
        want = _run(make("owners"), params, grads)
        for mode in ("gram", "auto"):
            got = _run(make(mode), params, grads)
            assert all(torch.equal(got[k], want[k]) for k in want), (name, mode)
        assert opttx.base.traits_of(make("owners")).whole_leaves
        assert not opttx.base.traits_of(make("gram")).whole_leaves
