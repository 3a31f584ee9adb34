"""Communication overlapped with backward, and its dtype (`zero` and `all_reduce_gradients`).

2 gloo ranks, one spawn; each rank trains a copy of the same small MLP on its own batches.
``overlap=True`` starts each ZeRO chunk's reduction (stage 1 and 2) or each bucket's
all-reduce from the parameters' post-accumulate-grad hooks during backward; the runs must give
bitwise the parameters of the same transform without overlap, launch every chunk or bucket
once per step from backward, launch nothing inside `no_sync`, and fall back to the synchronous
path when ``update`` gets other tensors than the ``.grad`` backward left. bf16 communication
halves the bytes and stays within its documented bound of the float32 result.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import opttx
from opttx.distributed import CollectiveStats, all_reduce_gradients, no_sync, zero
from test_distributed import _finish, _init, _spawn

WORLD, STEPS, MIB = 2, 3, 1 << 20
U = 2.0 ** -8                     # bf16's unit roundoff


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batch(rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _backward(model: torch.nn.Module, rank: int, step: int, micro: int = 0) -> None:
    x, y = _batch(rank, step, micro)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _train(make: Callable[[], opttx.GradientTransformation], rank: int, *,
           micro: int = 1, other_tensors: bool = False) -> tuple[dict, Any, list[int]]:
    """``STEPS`` steps of ``make(stats)`` on this rank's batches: the final params and the
    collectives of each step (counted from backward to the end of update)."""
    model = _model()
    params = dict(model.named_parameters())
    stats = CollectiveStats()
    tx = make(stats)
    state = tx.init(params)
    counts = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        stats.reset()
        for m in range(micro):
            if m < micro - 1:
                with no_sync():
                    _backward(model, rank, step, m)
            else:
                _backward(model, rank, step, m)
        grads = {k: p.grad * 1.0 if other_tensors else p.grad for k, p in params.items()}
        with torch.no_grad():
            updates, state = tx.update(grads, state, params)
            opttx.apply_updates_(params, updates)
        counts.append(stats.collectives)
    return {k: p.detach().clone() for k, p in params.items()}, counts


TXS: dict[str, Callable[..., opttx.GradientTransformation]] = {
    "zero2": lambda stats, **kw: zero(opttx.adamw(1e-2, weight_decay=0.1), stage=2, stats=stats,
                                     chunk_size_mb=512 / MIB, **kw),
    "zero1": lambda stats, **kw: zero(opttx.adamw(1e-2, weight_decay=0.1), stage=1, stats=stats,
                                     chunk_size_mb=512 / MIB, **kw),
    "ddp": lambda stats, **kw: opttx.chain(
        all_reduce_gradients(bucket_size_mb=512 / MIB, stats=stats, **kw),
        opttx.adamw(1e-2, weight_decay=0.1)),
}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _overlap_cases(rank: int, results: dict) -> None:
    for name, make in TXS.items():
        plain, plain_counts = _train(make, rank)
        over, counts = _train(lambda s, make=make: make(s, overlap=True), rank)
        acc_plain, _ = _train(make, rank, micro=2)
        acc_over, acc_counts = _train(lambda s, make=make: make(s, overlap=True), rank, micro=2)
        other, _ = _train(lambda s, make=make: make(s, overlap=True), rank, other_tensors=True)
        results[name] = {"equal": _equal(over, plain), "accumulated": _equal(acc_over, acc_plain),
                         "other_tensors": _equal(other, plain),
                         "counts": counts, "plain_counts": plain_counts,
                         "accumulated_counts": acc_counts}
    # launched from backward: the collectives counted during backward, before update
    model = _model()
    params = dict(model.named_parameters())
    stats = CollectiveStats()
    tx = TXS["zero2"](stats, overlap=True)
    state = tx.init(params)
    stats.reset()
    _backward(model, rank, 0)
    results["launched_in_backward"] = stats.collectives
    with torch.no_grad():
        tx.update({k: p.grad for k, p in params.items()}, state, params)
    results["collectives_after_update"] = stats.collectives
    try:
        zero(opttx.adamw(1e-2), overlap=True).init({k: p.detach() for k, p in params.items()})
        results["detached"] = "no error"
    except ValueError as e:
        results["detached"] = str(e)


def _bf16_cases(rank: int, results: dict) -> None:
    """One step of sgd(1) (the update is minus the mean gradient) in bf16 and fp32."""
    model = _model()
    params = dict(model.named_parameters())
    _backward(model, rank, 0)
    grads = {k: p.grad.detach().clone() for k, p in params.items()}
    every = [None] * WORLD
    dist.all_gather_object(every, {k: v.tolist() for k, v in grads.items()})
    abs_mean = {k: sum(torch.tensor(e[k]).abs() for e in every) / WORLD for k in grads}
    out = {}
    for name, make in (("zero2", lambda s, **kw: zero(opttx.sgd(1.0), stats=s, **kw)),
                       ("ddp", lambda s, **kw: opttx.chain(all_reduce_gradients(stats=s, **kw),
                                                           opttx.sgd(1.0)))):
        runs = {}
        for dtype in (None, torch.bfloat16):
            stats = CollectiveStats()
            tx = make(stats, communication_dtype=dtype)
            state = tx.init({k: p.detach() for k, p in params.items()})
            stats.reset()
            u, _ = tx.update(grads, state, {k: p.detach() for k, p in params.items()})
            runs[dtype] = (u, stats.bytes)
        (u32, b32), (u16, b16) = runs[None], runs[torch.bfloat16]
        # |error| <= (W + 1) u mean|g| for the mean, plus u |update| for the gathered update
        excess = max(float(((u16[k] - u32[k]).abs() - (WORLD + 1) * U * abs_mean[k]
                            - U * u32[k].abs()).max()) for k in grads)
        worst = max(float(((u16[k] - u32[k]).abs() / abs_mean[k].clamp(min=1e-30)).max())
                    for k in grads)
        out[name] = {"excess": excess, "worst_relative": worst, "bytes": [b32, b16]}
    results["bf16"] = out


def _worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    results: dict[str, Any] = {}
    _overlap_cases(rank, results)
    _bf16_cases(rank, results)
    _finish(out, rank, results)


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_worker, WORLD, tmp_path_factory.mktemp("overlap"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(TXS))
def test_overlap_gives_the_same_bits(world2: list[dict], name: str) -> None:
    """Overlapped with backward or not, the same parameters bit for bit, the same number of
    collectives per step plus the one small all-reduce that agrees on which launches stand;
    also with two micro-batches (the first inside no_sync), and when update gets copies of the
    gradients (the synchronous path)."""
    for res in world2:
        case = res[name]
        assert case["equal"] and case["accumulated"] and case["other_tensors"], case
        assert case["counts"] == case["accumulated_counts"] \
            == [c + 1 for c in case["plain_counts"]], case


@pytest.mark.timeout(300)
def test_reductions_start_during_backward(world2: list[dict]) -> None:
    """After backward, before update, every chunk's gradient reduction has been launched (the
    small chunk size gives several); update adds only the agreement on them and the gathers
    of the updates."""
    for res in world2:
        launched = res["launched_in_backward"]
        assert launched >= 2 and res["collectives_after_update"] == 2 * launched + 1, res


@pytest.mark.timeout(300)
def test_overlap_needs_the_model_parameters(world2: list[dict]) -> None:
    for res in world2:
        assert "needs the model's parameters" in res["detached"], res["detached"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero2", "ddp"])
def test_bf16_communication_halves_the_bytes_within_its_bound(world2: list[dict],
                                                               name: str) -> None:
    for res in world2:
        case = res["bf16"][name]
        assert case["excess"] <= 0.0, case
        assert 0.0 < case["worst_relative"], case            # bf16 did round something
        b32, b16 = case["bytes"]
        assert b16 * 2 == b32, case
