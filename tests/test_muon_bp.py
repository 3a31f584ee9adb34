"""MuonBP (`opttx.muon_bp`, `opttx.orthogonalize_block_periodic`): the paper's algorithm
re-derived plainly in float64, the step kinds in one compiled graph, and on two gloo ranks
the block steps without a collective and every step equal to one device."""

from __future__ import annotations

import math

import pytest
import torch

import opttx
from opttx.transforms.block_periodic import block_sizes
from opttx.transforms.orthogonalize import NS_COEFFS

MATRICES = lambda p: {k: v.ndim >= 2 for k, v in p.items()}


# ---------------------------------------------------------------------------------------------
# the paper's algorithm, written plainly (float64)
# ---------------------------------------------------------------------------------------------


def _orth(g: torch.Tensor) -> torch.Tensor:
    """Keller Jordan's quintic Newton–Schulz, five steps, on the wide orientation."""
    a, b, c = NS_COEFFS
    x = g / g.norm()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def _rms_matched(u: torch.Tensor) -> torch.Tensor:
    """The paper's RMS matching: 0.2 sqrt(max(rows, cols)) for the matrix orthogonalized."""
    return 0.2 * math.sqrt(max(u.shape)) * u


def _reference(params: dict, grads: list[dict], grids: dict, lr: float, block_lr: float,
               wd: float, mu: float, period: int) -> dict:
    """MuonBP: M_t = mu M_{t-1} + G_t; step t (from 0) with t mod P = 0 orthogonalizes M_t
    whole and moves by lr_full, every other step orthogonalizes each block of the grid on its
    own and moves by lr_block; decoupled weight decay lr_full * wd."""
    x = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    for t, g in enumerate(grads):
        for k in x:
            m[k] = mu * m[k] + g[k]
            mats = m[k].reshape(-1, *m[k].shape[-2:])
            outs = []
            for mat in mats:
                if t % period == 0:
                    outs.append(lr * _rms_matched(_orth(mat)))
                    continue
                rows, cols = grids[k]
                rs = block_sizes(rows, mat.shape[0])
                cs = block_sizes(cols, mat.shape[1])
                out = torch.empty_like(mat)
                r0 = 0
                for r in rs:
                    c0 = 0
                    for c in cs:
                        out[r0:r0 + r, c0:c0 + c] = block_lr * _rms_matched(
                            _orth(mat[r0:r0 + r, c0:c0 + c]))
                        c0 += c
                    r0 += r
                outs.append(out)
            step = torch.stack(outs).reshape(x[k].shape)
            x[k] = x[k] - step - lr * wd * x[k]
    return x


def _problem(dtype=torch.float64, seed=0, steps=7):
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(6, 5, generator=gen, dtype=torch.float64),
              "v": torch.randn(5, 7, generator=gen, dtype=torch.float64),
              "t": torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)}
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=torch.float64)
              for k, v in params.items()} for _ in range(steps)]
    cast = lambda tree: {k: v.to(dtype) for k, v in tree.items()}
    return cast(params), [cast(g) for g in grads]


GRIDS = {"w": (2, 1), "v": (1, (3, 4)), "t": (2, 3)}


def _run(tx, params, grads, step=None):
    state = tx.init(params)
    step = step or tx.update
    for g in grads:
        updates, state = step(g, state, params)
        params = opttx.apply_updates(params, updates)
    return params, state


def test_muon_bp_equals_the_papers_algorithm_in_float64() -> None:
    """Seven steps with P = 3 (full at 0, 3, 6; block steps between, with row, column and
    2-D grids and a batch of matrices): the alias equals the plain derivation. The paper's
    momentum sums gradients (M = mu M + G) where opttx averages them; with eps = 0 the
    orthogonalization does not see the scale, so the two agree to float64 rounding."""
    params, grads = _problem()
    lr, rho, wd, mu = 0.02, 0.7, 0.1, 0.9
    tx = opttx.muon_bp(lr, full_every=3, blocks=lambda p: {k: GRIDS[k] for k in p},
                       block_scale=rho, beta=mu, eps=0.0, weight_decay=wd, nesterov=False,
                       bias_correction=False, muon_mask=MATRICES)
    got, _ = _run(tx, params, grads)
    want = _reference(params, grads, GRIDS, lr, rho * lr, wd, mu, period=3)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=k)
    # and the block steps matter: with every step full the result is another one
    full = _reference(params, grads, GRIDS, lr, rho * lr, wd, mu, period=1)
    assert (got["w"] - full["w"]).abs().max() > 1e-4


def test_full_every_one_is_muon_and_blocks_none_on_one_device_is_whole() -> None:
    """P = 1 is Muon with the same shape scaling, and on one device ``blocks=None`` (each
    shard one block) orthogonalizes the whole matrix on block steps too (to float32
    rounding: Muon scales in its own link)."""
    params, grads = _problem(torch.float32, seed=1, steps=4)
    muon = opttx.muon(0.02, consistent_rms=0.2, weight_decay=0.1, muon_mask=MATRICES)
    want, _ = _run(muon, params, grads)
    got, _ = _run(opttx.muon_bp(0.02, full_every=1, blocks=(2, 2), weight_decay=0.1,
                                muon_mask=MATRICES), params, grads)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)
    got, _ = _run(opttx.muon_bp(0.02, full_every=3, blocks=None, weight_decay=0.1,
                                muon_mask=MATRICES), params, grads)
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


def test_the_step_kinds_are_one_compiled_graph() -> None:
    """Traced with fullgraph: one graph for block and full steps alike (a torch.cond on the
    step counter; no recompile when the kind changes), equal to eager. (Inductor's compiled
    step against eager: the conformance suite.)"""
    from torch._dynamo.testing import CompileCounter
    params, grads = _problem(torch.float32, seed=2, steps=5)
    tx = opttx.muon_bp(0.02, full_every=2, blocks=lambda p: {k: GRIDS[k] for k in p},
                       block_scale=0.5, muon_mask=MATRICES)
    want, _ = _run(tx, params, grads)
    torch._dynamo.reset()
    counter = CompileCounter()
    got, _ = _run(tx, params, grads,
                  torch.compile(tx.update, backend=counter, fullgraph=True))
    assert counter.frame_count == 1
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


def test_arguments_are_checked_at_construction_and_blocks_at_init() -> None:
    for bad in ({"full_every": 0}, {"blocks": 0}, {"blocks": (2, (0, 3))}, {"blocks": True},
                {"block_scale": -1.0}, {"method": "qr"}):
        with pytest.raises(ValueError):
            opttx.orthogonalize_block_periodic(**bad)
    tx = opttx.orthogonalize_block_periodic(blocks=((2, 2), 1))
    with pytest.raises(ValueError, match=r"add up to 4, not 6"):
        tx.init({"w": torch.zeros(6, 5)})
    assert block_sizes(3, 7) == (3, 2, 2) and block_sizes((4, 3), 7) == (4, 3)


# ---------------------------------------------------------------------------------------------
# sharded on two gloo ranks
# ---------------------------------------------------------------------------------------------

STEPS = 4


def _tp_problem():
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(7, 5, generator=gen, dtype=torch.float64),     # rows 4 + 3
              "v": torch.randn(6, 9, generator=gen, dtype=torch.float64),     # cols 5 + 4
              "e": torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)}  # experts 1 + 1
    grads = [{k: torch.randn(v.shape, generator=gen, dtype=torch.float64)
              for k, v in params.items()} for _ in range(STEPS)]
    return params, grads


def _chain(blocks):
    return opttx.chain(opttx.trace(0.9),
                       opttx.orthogonalize_block_periodic(full_every=2, blocks=blocks,
                                                          block_scale=0.5),
                       opttx.scale_by_learning_rate(0.05))


def _sharded_worker(rank: int, world: int) -> dict:
    from opttx.distributed import CollectiveStats, Shard, local_shard, sharded
    params, grads = _tp_problem()
    specs = {"w": Shard(0), "v": Shard(1), "e": Shard(0)}
    local = {k: local_shard(v, specs[k]) for k, v in params.items()}
    local_grads = [{k: local_shard(v, specs[k]) for k, v in g.items()} for g in grads]
    mine = lambda tree: {k: local_shard(v, specs[k]) for k, v in tree.items()}
    out: dict = {}
    # the shards as blocks: a grid that one device runs too, and blocks=None (each shard)
    shard_grid = {"w": (2, 1), "v": (1, 2), "e": None}
    fine_grid = {"w": (4, 1), "v": (1, (3, 2, 4)), "e": (2, 1)}
    for name, grid, sharded_grid in (("grid", shard_grid, shard_grid),
                                     ("shards", shard_grid, None),
                                     ("fine", fine_grid, fine_grid)):
        want, _ = _run(_chain(lambda p, g=grid: {k: g[k] for k in p}), params, grads)
        stats = CollectiveStats()
        tx = sharded(_chain(sharded_grid if sharded_grid is None
                            else (lambda p, g=sharded_grid: {k: g[k] for k in p})), specs,
                     stats=stats)
        state = tx.init(local)
        p, per_step = local, []
        for g in local_grads:
            stats.reset()
            u, state = tx.update(g, state, p)
            per_step.append((stats.calls, stats.collectives, stats.bytes))
            p = opttx.apply_updates(p, u)
        out[name] = {"diff": max(float((p[k] - v).abs().max()) for k, v in mine(want).items()),
                     "counts": per_step}
    # zero with split_above_mb: row segments of w (3 + 4 rows) and v (3 + 3) per rank
    from opttx.distributed import zero
    two = {k: params[k] for k in ("w", "v")}
    two_grads = [{k: g[k] for k in ("w", "v")} for g in grads]
    segments = {"w": ((3, 4), 1), "v": (2, 1)}
    want, _ = _run(_chain(lambda p: {k: segments[k] for k in p}), two, two_grads)
    for name, grid in (("zero_grid", segments), ("zero_shards", None)):
        tx = zero(_chain(grid if grid is None else (lambda p, g=grid: {k: g[k] for k in p})),
                  split_above_mb=1e-6)
        got, _ = _run(tx, two, two_grads)
        out[name] = max(float((got[k] - want[k]).abs().max()) for k in want)
    # a grid whose blocks straddle the two shards is refused
    bad = sharded(_chain((3, 1)), {"w": Shard(0)})
    try:
        _run(bad, {"w": local["w"]}, [{"w": local_grads[0]["w"]}])
        out["straddle"] = "ran"
    except ValueError as e:
        out["straddle"] = str(e)
    return out


@pytest.fixture(scope="module")
def sharded_results() -> list[dict]:
    from opttx.testing import spawn_ranks
    return spawn_ranks(_sharded_worker, world_size=2, timeout=240)


@pytest.mark.timeout(300)
def test_sharded_equals_one_device(sharded_results) -> None:
    """Rows split 4 + 3 (TP column-parallel), columns 5 + 4 (row-parallel) and an expert
    stack split on its batch axis: with the shards as blocks (given as a grid, or as
    blocks=None) and with a finer grid, every rank holds its piece of the single-device
    result after block and full steps; `zero` with ``split_above_mb`` (row segments per rank)
    gives every rank the whole of it (float64; bitwise here, asserted to rounding)."""
    for rank, res in enumerate(sharded_results):
        for name in ("grid", "shards", "fine"):
            assert res[name]["diff"] < 1e-12, (rank, name, res[name]["diff"])
        for name in ("zero_grid", "zero_shards"):
            assert res[name] < 1e-12, (rank, name, res[name])


@pytest.mark.timeout(300)
def test_block_steps_need_no_collective_and_full_steps_one(sharded_results) -> None:
    """Steps 0 and 2 are full: one reduction-hook call, one all-reduce over the group of the
    zero-padded shards of w and v (the whole matrices, float64, and the state's step counter
    that an eager `sharded` update sends along with its first reduction: 2 more float64);
    steps 1 and 3 are block steps: nothing."""
    whole = (7 * 5 + 6 * 9 + 2) * 8
    for res in sharded_results:
        for name in ("grid", "shards", "fine"):
            assert res[name]["counts"] == [(1, 1, whole), (0, 0, 0)] * 2, (name, res[name])


@pytest.mark.timeout(300)
def test_a_block_across_two_shards_is_refused(sharded_results) -> None:
    for res in sharded_results:
        assert "cuts a block" in res["straddle"], res["straddle"]
