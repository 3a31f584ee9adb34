"""`zero(tx, offload=...)` on 2 gloo ranks: every chunkable registry entry bitwise equal to
``zero(tx)`` without offload, chains refused on every rank, and checkpoints that move between
an offloaded world-2 run and a single-device run without offload (DCP, resharded).

One spawn runs everything (`opttx.testing.spawn_ranks`, with a timeout); each rank returns
what failed and the tests below assert on it. The single-device checkpoint the ranks load is
written here before the spawn, and the one they write is loaded here after it.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import opttx
from opttx.distributed import load_state_dict, state_dict
from opttx.testing import assert_trees_close, gradient_stream, run_transform
from opttx.tree import tree_map

from registry import CASES
from test_offload import REFUSED_AT_INIT, _all_started, _none_started, leaves_0d_to_4d

RUN = [c for c in CASES if c.distributed is None]
CHUNK_MB = 96 / (1 << 20)       # 96-byte chunks: a leaf or two per rank in each chunk
STEPS = 3
K, N = 3, 3                     # checkpoint after K steps, resume for N


def _checkpoint_params() -> dict[str, torch.Tensor]:
    return leaves_0d_to_4d()


def _checkpoint_grads() -> list[dict[str, torch.Tensor]]:
    return gradient_stream(_checkpoint_params(), K + N, seed=21)


def _adamw() -> opttx.GradientTransformation:
    return opttx.adamw(1e-2, weight_decay=0.1)


def _bf16(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bfloat16 parameters of magnitude 1 to 2, where the master copy keeps what they lose."""
    return {k: (1 + v.abs()).bfloat16() for k, v in params.items()}


def _bf16_grads() -> list[dict[str, torch.Tensor]]:
    return [{k: v.bfloat16() for k, v in g.items()} for g in _checkpoint_grads()]


def _compare(rank: int, world: int, errors: dict[str, str]) -> None:
    """Every registry entry: zero with half of each rank's state offloaded against zero
    without offload (the same gradients on both ranks), params and state bitwise."""
    from opttx.distributed import zero
    for case in RUN:
        params = leaves_0d_to_4d(case)
        grads = gradient_stream(params, STEPS, seed=13)
        try:
            if case.name in REFUSED_AT_INIT:
                try:
                    zero(case.make(), chunk_size_mb=CHUNK_MB, offload=0.5).init(params)
                    errors[case.name] = "not refused"
                except ValueError as e:
                    if "chunk by chunk" not in str(e) and "refused to offload" not in str(e):
                        errors[case.name] = f"unclear refusal: {e}"
                continue
            expected = run_transform(zero(case.make(), chunk_size_mb=CHUNK_MB), params, grads)
            got = run_transform(zero(case.make(), chunk_size_mb=CHUNK_MB, offload=0.5),
                                params, grads)
            assert_trees_close(got, expected, rtol=0.0, what=f"rank {rank} offload 0.5")
            with opttx.donating():
                got = run_transform(zero(case.make(), chunk_size_mb=CHUNK_MB, offload=True),
                                    params, grads)
            assert_trees_close(got, expected, rtol=0.0, what=f"rank {rank} offload 1, donated")
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[case.name] = f"{type(e).__name__}: {e}"


def _extras(rank: int, world: int, errors: dict[str, str]) -> None:
    """Global-norm clipping at the head of the chain (one all-reduce across ranks), "auto"
    with a budget, the plan each rank made of its own segments, and the master copy
    (``offload_master_params``)."""
    from opttx.distributed import OffloadStats, zero
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, STEPS, seed=14)

    def clipped():
        return opttx.chain(opttx.clip_by_global_norm(0.3), _adamw())
    try:
        expected = run_transform(clipped(), params, grads)
        got = run_transform(zero(clipped(), chunk_size_mb=CHUNK_MB, offload=0.5), params,
                            grads)
        assert_trees_close(got[0], expected[0], rtol=0.0, what=f"rank {rank} clipped")
        stats = OffloadStats()
        tx = zero(_adamw(), chunk_size_mb=CHUNK_MB, offload="auto",
                  device_budget_mb=200 / (1 << 20), offload_stats=stats)
        got = run_transform(tx, params, grads)
        assert_trees_close(got[0], run_transform(_adamw(), params, grads)[0], rtol=0.0)
        on_host = [c.on_host for c in stats.plan.chunks]
        assert stats.plan.device_bytes <= 200 and any(on_host) and on_host == sorted(on_host)
        plan = opttx.distributed.zero_plan(params, world, CHUNK_MB)
        mine = sorted(i for c in stats.plan.chunks for i in c.leaves)
        assert len(mine) == len(plan.owned(rank)), (mine, plan.owned(rank))
        # the master copy on each rank's host: the state of zero(tx) bit for bit, the
        # parameters within one rounding of a step (bitwise where no step crosses zero)
        expected = run_transform(zero(_adamw(), chunk_size_mb=CHUNK_MB), params, grads)
        got = run_transform(zero(_adamw(), chunk_size_mb=CHUNK_MB, offload=0.5,
                                 offload_master_params=True), params, grads)
        assert_trees_close(got[1].inner, expected[1], rtol=0.0,
                           what=f"rank {rank} master state")
        assert_trees_close(got[0], expected[0], rtol=1e-6, atol=0.0,
                           what=f"rank {rank} master params")
    except Exception:  # noqa: BLE001
        errors["extras"] = traceback.format_exc(limit=4)


def _checkpoints(rank: int, world: int, root: str, errors: dict[str, str]) -> None:
    """Load the single-device checkpoint (saved without offload) into zero with all state
    offloaded and finish the run; save an offloaded zero run's checkpoint after K steps."""
    from opttx.distributed import zero
    params, grads = _checkpoint_params(), _checkpoint_grads()
    try:
        expected = run_transform(_adamw(), params, grads)
        tx = zero(_adamw(), chunk_size_mb=CHUNK_MB, offload=True)
        mid = tree_map(torch.zeros_like, params)
        state = tx.init(mid)
        sd = {"params": mid, "optim": state_dict(state, mid)}
        dcp.load(sd, checkpoint_id=str(Path(root) / "single"))
        state = load_state_dict(state, sd["optim"], mid)
        got = run_transform(tx, mid, grads[K:], state=state)
        assert_trees_close(got[0], expected[0], rtol=0.0, what=f"rank {rank} 1 -> 2")
        tx = zero(_adamw(), chunk_size_mb=CHUNK_MB, offload=0.5)
        p, s = run_transform(tx, params, grads[:K])
        dcp.save({"params": p, "optim": state_dict(s, p)},
                 checkpoint_id=str(Path(root) / "offloaded"))
        # bfloat16 parameters, each rank's owned state and master copy on its host
        tx = zero(_adamw(), chunk_size_mb=CHUNK_MB, offload=True, offload_master_params=True)
        p, s = run_transform(tx, _bf16(params), _bf16_grads()[:K])
        dcp.save({"params": p, "optim": state_dict(s, p)},
                 checkpoint_id=str(Path(root) / "offloaded_master"))
    except Exception:  # noqa: BLE001
        errors["checkpoints"] = traceback.format_exc(limit=4)


def _worker(rank: int, world: int, root: str) -> dict[str, str]:
    errors: dict[str, str] = {}
    _compare(rank, world, errors)
    _extras(rank, world, errors)
    _checkpoints(rank, world, root, errors)
    return errors


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> tuple[list[dict[str, str]], Path]:
    from opttx.testing import spawn_ranks
    root = tmp_path_factory.mktemp("offload")
    params, grads = _checkpoint_params(), _checkpoint_grads()
    p, s = run_transform(_adamw(), params, grads[:K])
    dcp.save({"params": p, "optim": state_dict(s, p)}, checkpoint_id=str(root / "single"))
    return spawn_ranks(_worker, world_size=2, args=(str(root),), timeout=900), root


CHECKED = [c.name for c in RUN]


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", CHECKED)
def test_zero_offloaded_equals_zero_bitwise(name: str, world2) -> None:
    """Half of every rank's state offloaded, and all of it (donated): the parameters and the
    state of ``zero(tx)`` bit for bit; chains that cannot run chunk by chunk are refused on
    both ranks with the reason."""
    for rank, errors in enumerate(world2[0]):
        assert name not in errors, f"rank {rank}: {errors[name]}"


@pytest.mark.timeout(1000)
def test_clipping_auto_and_each_ranks_plan(world2) -> None:
    for rank, errors in enumerate(world2[0]):
        assert "extras" not in errors, f"rank {rank}: {errors['extras']}"


@pytest.mark.timeout(1000)
def test_checkpoints_move_between_offloaded_zero_and_one_device(world2) -> None:
    """1 -> 2: a single-device checkpoint without offload resumes under zero with all state
    offloaded (checked on the ranks); 2 -> 1: an offloaded world-2 checkpoint resumes on one
    device without offload. Both bitwise equal to the run never interrupted."""
    results, root = world2
    for rank, errors in enumerate(results):
        assert "checkpoints" not in errors, f"rank {rank}: {errors['checkpoints']}"
    params, grads = _checkpoint_params(), _checkpoint_grads()
    expected = run_transform(_adamw(), params, grads)
    mid = tree_map(torch.zeros_like, params)
    state = _adamw().init(mid)
    sd = {"params": mid, "optim": state_dict(state, mid)}
    dcp.load(sd, checkpoint_id=str(root / "offloaded"))
    state = load_state_dict(state, sd["optim"], mid)
    got = run_transform(_adamw(), mid, grads[K:], state=state)
    assert_trees_close(got, expected, rtol=0.0, what="2 -> 1")


def _loaded(tx: opttx.GradientTransformation, like: dict, path: str) -> tuple[dict, object]:
    """``tx``'s state for parameters shaped like ``like``, and those parameters, read from
    the DCP checkpoint at ``path`` after `check_checkpoint` compared it with the run."""
    from opttx.distributed import check_checkpoint, load_checkpoint
    mid = tree_map(torch.zeros_like, like)
    state = tx.init(mid)
    sd = {"params": mid, "optim": state_dict(state, mid)}
    check_checkpoint(sd["optim"], dcp.FileSystemReader(path).read_metadata(), "optim")
    load_checkpoint(sd, checkpoint_id=path)
    return mid, load_state_dict(state, sd["optim"], mid)


@pytest.mark.timeout(1000)
def test_the_master_copy_moves_from_world_two_to_one_device(world2) -> None:
    """2 -> 1 with the master copy: a world-2 zero run with all owned state and the float32
    master of bfloat16 parameters on each rank's host resumes on one device
    (`load_checkpoint`: the ranks' ``"~master"`` entries, resharded) bitwise as the
    single-device run with the master never interrupted. And a checkpoint without a master
    (the single-device one) loads into a run with it: the master starts from the parameters
    (``"~started"`` zero), as for a state without one."""
    from opttx.distributed import offload
    results, root = world2
    for rank, errors in enumerate(results):
        assert "checkpoints" not in errors, f"rank {rank}: {errors['checkpoints']}"
    params, grads = _bf16(_checkpoint_params()), _bf16_grads()

    def mastered():
        return offload(_adamw(), 1.0, chunk_size_mb=CHUNK_MB, master_params=True)
    expected = run_transform(mastered(), params, grads)
    tx = mastered()
    mid, state = _loaded(tx, params, str(root / "offloaded_master"))
    assert _all_started(state)
    without = run_transform(mastered(), mid, grads[K:], state=state.inner)[0]
    got = run_transform(tx, mid, grads[K:], state=state)
    assert_trees_close(got, expected, rtol=0.0, what="2 -> 1 with the master")
    assert any(not torch.equal(without[k], got[0][k]) for k in params)   # the master mattered
    # no master in the checkpoint: started afresh from the (float32) parameters
    params, grads = _checkpoint_params(), _checkpoint_grads()
    tx = mastered()
    mid, state = _loaded(tx, params, str(root / "single"))
    assert _none_started(state)
    got = run_transform(tx, mid, grads[K:], state=state)
    assert_trees_close(got[0], run_transform(_adamw(), params, grads)[0], rtol=0.0,
                       what="1 -> 1 into the master")
