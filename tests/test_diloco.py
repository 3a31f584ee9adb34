"""`opttx.distributed.diloco` against torchft's ``DiLoCo`` on 2 gloo ranks (float64), its bytes
against plain data parallelism, its checkpoint, and a float64 derivation on one process.

torchft's ``DiLoCo`` runs under a fault-tolerant ``Manager`` (a lighthouse server, quorums,
its own process groups); here a stand-in ``Manager`` gives it what its algorithm calls: the
replica step, ``should_commit`` always true, and ``allreduce`` as torchft's (a sum over the
gloo group, then divided by the number of participants). The DiLoCo and streaming-DiLoCo code
that runs is torchft's. Each rank trains the same MLP (same init) on its own batches; the
parameters of opttx's replica must equal torchft's after every step.

Bytes are counted by a wrapper around ``torch.distributed._functional_collectives.all_reduce``
(what `pack_all_reduce` calls), for `all_reduce_gradients` + SGD (data parallel) and for
`diloco`: over the same steps DiLoCo moves exactly ``1/H`` of the bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.func import functional_call, grad

import opttx
from opttx.distributed import CollectiveStats, all_reduce_gradients, diloco
from test_distributed import _finish, _init, _spawn

WORLD, H, STEPS, LR = 2, 4, 12, 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return (torch.randn(6, 5, generator=g, dtype=torch.float64),
            torch.randn(6, 3, generator=g, dtype=torch.float64))


def _loss(model: torch.nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor):
    return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)


class _Work:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> bool:
        return True


class _Manager:
    """What torchft's DiLoCo calls on its Manager, on the default gloo group."""
    _use_async_quorum = False

    def __init__(self) -> None:
        self.step = 0

    def current_step(self) -> int:
        return self.step

    def start_quorum(self) -> None:
        pass

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> _Work:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)     # torchft: SUM, then / participants
        tensor /= dist.get_world_size()
        return _Work(tensor)

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def register_state_dict_fn(self, *args: Any) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass


def _torchft_run(rank: int, fragments: int, alpha: float) -> list[dict]:
    from torchft.local_sgd import DiLoCo
    model = _model()
    parts = [model] if fragments == 1 else [model[0], model[2]]
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    outers = [torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True)
              for p in parts]
    out = []
    with DiLoCo(_Manager(), parts, inner, outers, sync_every=H, backup_device=torch.device("cpu"),
                pin_memory=False, fragment_update_alpha=alpha):
        for step in range(STEPS):
            inner.zero_grad()
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            out.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out


def _opttx_run(rank: int, fragments: int, alpha: float, stats: CollectiveStats | None = None,
               steps: int = STEPS) -> tuple[list[dict], Any]:
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    labels = None if fragments == 1 else {k: int(k.startswith("2.")) for k in params}
    tx = diloco(opttx.sgd(LR, momentum=0.9), sync_every=H, fragments=labels,
                local_weight=alpha, stats=stats)
    state = tx.init(params)
    out = []
    for step in range(steps):
        g = grad(lambda p: _loss(model, p, *_batch(rank, step)))(params)
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
        out.append(params)
    return out, state


def _max_difference(a: list[dict], b: list[dict]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b) for k in x)


def _counting(counter: dict):
    """``funcol.all_reduce`` that adds each call and its bytes to ``counter``."""
    real = funcol.all_reduce

    def counted(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        counter["calls"] += 1
        counter["bytes"] += tensor.numel() * tensor.element_size()
        return real(tensor, op, group)
    return real, counted


def _bytes_of(rank: int, make: str) -> dict:
    counter = {"calls": 0, "bytes": 0}
    real, counted = _counting(counter)
    funcol.all_reduce = counted
    try:
        if make == "diloco":
            stats = CollectiveStats()
            _opttx_run(rank, 1, 0.0, stats)
            counter["stats_bytes"] = stats.bytes
        else:
            model = _model()
            params = {k: v.detach().clone() for k, v in model.named_parameters()}
            tx = opttx.chain(all_reduce_gradients(), opttx.sgd(LR, momentum=0.9))
            state = tx.init(params)
            for step in range(STEPS):
                g = grad(lambda p: _loss(model, p, *_batch(rank, step)))(params)
                updates, state = tx.update(g, state, params)
                params = opttx.apply_updates(params, updates)
    finally:
        funcol.all_reduce = real
    return counter


def _checkpoint(rank: int, directory: str) -> float:
    """Save after 6 steps (mid-period of fragment 1), load into a fresh state, finish: the
    parameters equal the uninterrupted run's bit for bit (returns the largest difference)."""
    import torch.distributed.checkpoint as dcp
    from opttx.distributed import load_checkpoint, state_dict
    full, _ = _opttx_run(rank, 2, 0.0)
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    labels = {k: int(k.startswith("2.")) for k in params}
    tx = diloco(opttx.sgd(LR, momentum=0.9), sync_every=H, fragments=labels)
    state = tx.init(params)
    # a replica's parameters and inner state are its own: each replica saves and loads its
    # own checkpoint, over a process group of its own ranks (here one)
    mine = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    directory = f"{directory}/replica{rank}"
    for step in range(STEPS):
        if step == 6:
            dcp.save({"params": params, "optim": state_dict(state, params)},
                     checkpoint_id=directory, process_group=mine)
            params = {k: torch.zeros_like(v) for k, v in params.items()}
            state = tx.init({k: v.clone() for k, v in params.items()})
            load_checkpoint({"params": params, "optim": state_dict(state, params)},
                            directory, group=mine)
        g = grad(lambda p: _loss(model, p, *_batch(rank, step)))(params)
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
    return max(float((params[k] - full[-1][k]).abs().max()) for k in params)


def _worker(rank: int, world: int, store: str, out: str, ckpt: str) -> None:
    _init(rank, world, store)
    results: dict = {}
    for name, fragments, alpha in (("diloco", 1, 0.0), ("streaming", 2, 0.0),
                                   ("streaming_mixed", 2, 0.3)):
        ours, _ = _opttx_run(rank, fragments, alpha)
        theirs = _torchft_run(rank, fragments, alpha)
        results[name] = _max_difference(ours, theirs)
        results[name + "_moved"] = _max_difference(ours[-1:], [dict(_model().named_parameters())])
        # the replicas agree right after a synchronization on what it synchronized (at step
        # H: everything, or the second fragment when streaming)
        last = torch.cat([v.reshape(-1) for k, v in ours[H - 1].items()
                          if fragments == 1 or k.startswith("2.")])
        every = [torch.empty_like(last) for _ in range(world)]
        dist.all_gather(every, last)
        results[name + "_replicas_after_sync"] = float((every[0] - every[1]).abs().max())
    results["bytes_dp"] = _bytes_of(rank, "dp")
    results["bytes_diloco"] = _bytes_of(rank, "diloco")
    results["checkpoint"] = _checkpoint(rank, ckpt)
    _finish(out, rank, results)


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    pytest.importorskip("torchft")
    tmp = tmp_path_factory.mktemp("diloco")
    return _spawn(_worker, WORLD, tmp, str(tmp / "ckpt"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["diloco", "streaming", "streaming_mixed"])
def test_equals_torchft_diloco_at_world_2(world2: list[dict], name: str) -> None:
    for r in world2:
        assert r[name] < 1e-13, (name, r[name])
        assert r[name + "_moved"] > 1e-2          # it trained: the comparison is not vacuous
    if name != "streaming_mixed":                 # replicas keep their own part when mixing
        assert world2[0][name + "_replicas_after_sync"] < 1e-15


@pytest.mark.timeout(300)
def test_diloco_moves_h_times_fewer_bytes_than_data_parallel(world2: list[dict]) -> None:
    for r in world2:
        dp, lo = r["bytes_dp"], r["bytes_diloco"]
        params = sum(p.numel() for p in _model().parameters())
        assert dp["bytes"] == STEPS * params * 8                  # every gradient, every step
        assert lo["bytes"] == STEPS // H * params * 8             # every parameter, every H
        assert dp["bytes"] == H * lo["bytes"]
        assert lo["calls"] == STEPS // H and dp["calls"] == STEPS  # one all-reduce per sync
        assert lo["stats_bytes"] == lo["bytes"]                   # its own count agrees


@pytest.mark.timeout(300)
def test_checkpoint_resumes_bitwise(world2: list[dict]) -> None:
    for r in world2:
        assert r["checkpoint"] == 0.0


# ---------------------------------------------------------------------------------------------
# one process: a float64 derivation, the schedule, the errors
# ---------------------------------------------------------------------------------------------


def test_one_replica_equals_a_derivation() -> None:
    """One replica (no process group): H inner Adam steps, then an outer Nesterov step on
    phi - theta, derived here step by step; streaming with 2 fragments staggered by H/2."""
    torch.manual_seed(1)
    tree = {"a": torch.randn(3, 2, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    grads = opttx.testing.gradient_stream(tree, 9, seed=2)
    h, lr_out, mom = 3, 0.5, 0.8
    for fragments in (None, {"a": 0, "b": 1}):
        tx = diloco(opttx.adam(0.1), opttx.sgd(lr_out, momentum=mom, nesterov=True),
                    sync_every=h if fragments is None else 2, fragments=fragments)
        state, params = tx.init(tree), tree
        inner = opttx.adam(0.1)
        istate = inner.init(tree)
        theta = {k: v.clone() for k, v in tree.items()}
        phi = {k: v.clone() for k, v in tree.items()}
        buf = {k: torch.zeros_like(v) for k, v in tree.items()}
        for t, g in enumerate(grads, start=1):
            updates, state = tx.update(g, state, params)
            params = opttx.apply_updates(params, updates)
            u, istate = inner.update(g, istate, theta)
            theta = opttx.apply_updates(theta, u)
            for k in tree:
                if fragments is None:
                    sync = t % h == 0
                else:   # fragment a at t = 1, 3, 5, ...; b at t = 2, 4, 6, ...
                    sync = t % 2 == (1 if k == "a" else 0)
                if sync:
                    delta = phi[k] - theta[k]
                    buf[k] = mom * buf[k] + delta
                    phi[k] = phi[k] - lr_out * (delta + mom * buf[k])
                    theta[k] = phi[k].clone()
            for k in tree:
                torch.testing.assert_close(params[k], theta[k], rtol=0, atol=1e-13)
                torch.testing.assert_close(state.global_params[k], phi[k], rtol=0, atol=1e-13)


def test_schedule_staggers_fragments() -> None:
    from opttx.distributed import diloco_schedule
    seen = []
    for t in range(1, 13):
        syncs = diloco_schedule(torch.tensor(t), 6, 3)
        seen.append([f for f, s in enumerate(syncs) if bool(s)])
    assert seen == [[], [0], [], [1], [], [2], [], [0], [], [1], [], [2]]


def test_fragments_by_count_are_contiguous_and_balanced() -> None:
    from opttx.distributed import diloco_fragments
    params = {f"l{i}": torch.zeros(10) for i in range(8)}
    labels, n = diloco_fragments(params, 4)
    assert n == 4 and labels == [0, 0, 1, 1, 2, 2, 3, 3]


def test_checkpoint_round_trip_on_one_process() -> None:
    from opttx.distributed import load_state_dict, state_dict
    tree = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    grads = opttx.testing.gradient_stream(tree, 8, seed=5)
    tx = diloco(opttx.adamw(0.01), sync_every=4, fragments=2)
    params, state = tree, tx.init(tree)
    for g in grads[:5]:
        u, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, u)
    fresh = load_state_dict(tx.init(params), state_dict(state, params), params)
    a, b = params, params
    for g in grads[5:]:
        ua, state = tx.update(g, state, a)
        ub, fresh = tx.update(g, fresh, b)
        a, b = opttx.apply_updates(a, ua), opttx.apply_updates(b, ub)
    for k in tree:
        assert torch.equal(a[k], b[k])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        diloco(opttx.sgd(0.1), sync_every=0)
    with pytest.raises(ValueError, match="multiple"):
        diloco(opttx.sgd(0.1), sync_every=5, fragments=2)
    with pytest.raises(ValueError, match="local_weight"):
        diloco(opttx.sgd(0.1), local_weight=1.0)
    with pytest.raises(TypeError, match="inner"):
        diloco(torch.optim.SGD)
    tx = diloco(opttx.sgd(0.1), sync_every=2, fragments={"a": 0, "b": 2})
    with pytest.raises(ValueError, match="multiple"):
        tx.init({"a": torch.zeros(2), "b": torch.zeros(2)})


def test_bench_row_is_diloco_around_adamw() -> None:
    """The demo's ``diloco_adamw`` row: DiLoCo (one replica) around the adamw alias, the
    sweep's learning rate reaching the inner AdamW."""
    from opttx.bench.optimizers import DILOCO_SYNC_EVERY, build, split_available
    assert split_available(["diloco_adamw"]) == (["diloco_adamw"], [])
    tree = {"w": torch.randn(3, 2, dtype=torch.float64)}
    grads = opttx.testing.gradient_stream(tree, 2 * DILOCO_SYNC_EVERY, seed=4)
    mine = build("diloco_adamw", learning_rate=3e-3)
    ref = diloco(opttx.adamw(3e-3), sync_every=DILOCO_SYNC_EVERY)
    a, sa, b, sb = tree, mine.init(tree), tree, ref.init(tree)
    for g in grads:
        ua, sa = mine.update(g, sa, a)
        ub, sb = ref.update(g, sb, b)
        a, b = opttx.apply_updates(a, ua), opttx.apply_updates(b, ub)
    assert torch.equal(a["w"], b["w"]) and not torch.equal(a["w"], tree["w"])
