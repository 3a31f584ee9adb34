"""FusedBackward on sharded models: updates inside backward, ZeRO-style and under FSDP2.

Multi-process on CPU with gloo (pattern of tests/test_distributed.py): one spawn per world size
(2 and 4), every case looped inside the workers, results written as JSON and asserted below.
Each rank trains on its part of every global batch; every rank also runs the single-device
`FusedBackward` on the whole batch (so on the mean gradient) and compares its parameters after
every step. The model's leaves split unevenly over 2 and 4 ranks (7 and 9 rows), one has fewer
rows than 4 ranks (an empty piece), one is a vector and one a 0-dim scalar.

Run as a script it prints the state bytes per rank and the collectives per step recorded in
benchmarks/RESULTS.md: ``python tests/test_backward_distributed.py``.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_distributed import _finish, _init, _spawn
from torch import nn

import opttx
from opttx.bench.memory import tensor_bytes
from opttx.distributed import CollectiveStats

pytestmark = pytest.mark.timeout(120)

STEPS = 5
RTOL = 1e-5
BATCH = 8


class Net(nn.Module):
    """fc1 (7, 6), fc2 (9, 7), head (3, 9) with biases, and a 0-dim output gain."""

    def __init__(self, gain: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(6, 7), nn.Linear(7, 9), nn.Linear(9, 3)
        self.gain = nn.Parameter(torch.tensor(1.2)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return y * self.gain if self.gain is not None else y


def _net(gain: bool = True) -> Net:
    torch.manual_seed(0)
    return Net(gain)


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen))
            for _ in range(n)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()


TXS: dict[str, Callable[[], opttx.GradientTransformation]] = {
    "adalomo": lambda: opttx.adalomo(1e-2, weight_decay=0.1),
    # min_dim_size_to_factor=4: fc1's (7, 6) is factored; its (2, 6) piece at world 4 would
    # not be if the decision were taken on the piece
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=4),
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
}
CLIPS = {"none": {}, "previous": {"clip_grad_norm": 0.05, "clip_mode": "previous"},
         "two_pass": {"clip_grad_norm": 0.05, "clip_mode": "two_pass"}}


def _reference(name: str, clip: str, batches: list, gain: bool = True
               ) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Single-device FusedBackward on the whole batches: params after every step, and the
    bytes of its state."""
    model = _net(gain)
    runner = opttx.FusedBackward(model, TXS[name](), **CLIPS[clip])
    out = []
    for x, y in batches:
        runner.backward(_loss(model, x, y))
        out.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return out, tensor_bytes(runner.states)


def _rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest per-leaf max |got - want| / max |want|."""
    return max(float((got[k].detach() - w).abs().max() / w.abs().max().clamp_min(1e-12))
               for k, w in want.items())


def _replicated(model: nn.Module, world: int) -> bool:
    """Whether every rank holds bit-identical parameters (one all_gather)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    return all(torch.equal(e, every[0]) for e in every)


def _run_zero(name: str, clip: str, batches: list, expected: list, rank: int, world: int,
              live: list | None = None) -> dict[str, Any]:
    """FusedBackward(group=WORLD) on this rank's part of every batch."""
    model = _net()
    params = list(model.parameters())

    def counter(seen: list) -> Callable:
        return lambda p: seen.append(sum(q.grad is not None for q in params))

    # hooks run in registration order: one registered before the runner's sees the gradient
    # it is about to take, one registered after sees what it left behind
    handles = ([p.register_post_accumulate_grad_hook(counter(live[0])) for p in params]
               if live is not None else [])
    stats = CollectiveStats()
    runner = opttx.FusedBackward(model, TXS[name](), group=dist.group.WORLD, stats=stats,
                                 **CLIPS[clip])
    handles += ([p.register_post_accumulate_grad_hook(counter(live[1])) for p in params]
                if live is not None else [])
    errors, counts = [], []
    for (x, y), want in zip(batches, expected):
        stats.reset()
        runner.backward(_loss(model, x.tensor_split(world)[rank], y.tensor_split(world)[rank]))
        counts.append(stats.collectives)
        errors.append(_rel_error(dict(model.named_parameters()), want))
    for h in handles:
        h.remove()
    return {"errors": errors, "counts": counts, "state_bytes": tensor_bytes(runner.states),
            "replicated": _replicated(model, world), "steps": runner.steps,
            "grads_left": sum(p.grad is not None for p in params),
            "norm": float(runner.grad_norm)}


def _accumulated(rank: int, world: int, batches: list, expected: list) -> dict[str, Any]:
    """FusedBackward(group=WORLD, accumulate=2) on two micro-batches of this rank's part of
    every batch: the collectives of each backward and the error after each step."""
    model = _net()
    stats = CollectiveStats()
    runner = opttx.FusedBackward(model, TXS["adalomo"](), group=dist.group.WORLD, stats=stats,
                                 accumulate=2, **CLIPS["previous"])
    errors, counts = [], []
    for (x, y), want in zip(batches, expected):
        mine = zip(x.tensor_split(world)[rank].tensor_split(2),
                   y.tensor_split(world)[rank].tensor_split(2))
        for xm, ym in mine:
            stats.reset()
            runner.backward(_loss(model, xm, ym))
            counts.append(stats.collectives)
        errors.append(_rel_error(dict(model.named_parameters()), want))
    return {"errors": errors, "counts": counts, "replicated": _replicated(model, world)}


def _resume(rank: int, world: int, batches: list) -> bool:
    """state_dict after 2 steps into a fresh runner over a copy: the rest bit-identical."""
    def step(model: Net, runner: opttx.FusedBackward, x: torch.Tensor, y: torch.Tensor) -> None:
        runner.backward(_loss(model, x.tensor_split(world)[rank], y.tensor_split(world)[rank]))

    a = _net()
    ra = opttx.FusedBackward(a, TXS["adalomo"](), group=dist.group.WORLD, clip_grad_norm=0.05)
    for x, y in batches[:2]:
        step(a, ra, x, y)
    b = copy.deepcopy(a)
    rb = opttx.FusedBackward(b, TXS["adalomo"](), group=dist.group.WORLD, clip_grad_norm=0.05)
    rb.load_state_dict(copy.deepcopy(ra.state_dict()))
    for x, y in batches[2:]:
        step(a, ra, x, y)
        step(b, rb, x, y)
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _overflow(rank: int, world: int, batches: list) -> dict[str, Any]:
    """Dynamic loss scale with an inf only in rank 0's gradient of fc1.weight's last row (the
    last rank's piece): the whole leaf is skipped on every rank, the others are updated."""
    model = _net()
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    w = model.fc1.weight

    def poison(p: torch.Tensor) -> None:
        if rank == 0:
            p.grad[-1, 0] = float("inf")

    handle = w.register_post_accumulate_grad_hook(poison)      # runs before the runner's
    runner = opttx.FusedBackward(model, TXS["adamw"](), group=dist.group.WORLD,
                                 loss_scale="dynamic", init_scale=2.0**8)
    x, y = batches[0]
    runner.backward(_loss(model, x.tensor_split(world)[rank], y.tensor_split(world)[rank]))
    handle.remove()
    changed = {k: (~torch.eq(p.detach(), before[k])).sum().item()
               for k, p in model.named_parameters()}
    return {"changed": changed, "scale": float(runner.scale),
            "replicated": _replicated(model, world)}


FSDP_CASES = [("adalomo", "previous"), ("adalomo", "two_pass"), ("adafactor", "none"),
              ("adamw", "none")]


def _fsdp_model(world: int) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    model = _net(gain=False)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _run_fsdp(name: str, clip: str, batches: list, expected: list, rank: int, world: int
              ) -> dict[str, Any]:
    """FusedBackward on an FSDP2 model: the hook gets FSDP2's reduce-scattered shard."""
    model = _fsdp_model(world)
    params = list(model.parameters())
    live: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(
        lambda p: live.append(sum(q.grad is not None for q in params))) for p in params]
    stats = CollectiveStats()
    runner = opttx.FusedBackward(model, TXS[name](), stats=stats, **CLIPS[clip])
    errors, counts = [], []
    for (x, y), want in zip(batches, expected):
        stats.reset()
        runner.backward(_loss(model, x.tensor_split(world)[rank], y.tensor_split(world)[rank]))
        counts.append(stats.collectives)
        whole = {k: p.detach().full_tensor() for k, p in model.named_parameters()}
        errors.append(_rel_error(whole, want))
    for h in handles:
        h.remove()
    return {"errors": errors, "counts": counts, "live": live,
            "state_bytes": tensor_bytes(runner.states),
            "grads_left": sum(p.grad is not None for p in params)}


def _guard(results: dict, key: str, fn: Callable, *args: Any) -> None:
    try:
        results["cases"][key] = fn(*args)
    except Exception:  # noqa: BLE001 - reported by the tests
        results["errors"][key] = traceback.format_exc(limit=4)


def _worker(rank: int, world: int, store: str, out: str) -> None:
    _init(rank, world, store)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    results: dict[str, Any] = {"cases": {}, "errors": {}, "single_bytes": {}}
    batches = _batches()
    for name in TXS:
        for clip in CLIPS:
            expected, nbytes = _reference(name, clip, batches)
            results["single_bytes"][name] = nbytes
            live = ([], []) if (name, clip) == ("adalomo", "previous") else None
            _guard(results, f"zero/{name}/{clip}", _run_zero, name, clip, batches, expected,
                   rank, world, live)
            if live is not None:
                results["live"] = live
    expected, _ = _reference("adalomo", "previous", batches)
    _guard(results, "accumulated", _accumulated, rank, world, batches, expected)
    _guard(results, "resume", _resume, rank, world, batches)
    _guard(results, "overflow", _overflow, rank, world, batches)
    for name, clip in FSDP_CASES:
        expected, nbytes = _reference(name, clip, batches, gain=False)
        results["single_bytes"][f"fsdp/{name}"] = nbytes
        _guard(results, f"fsdp/{name}/{clip}", _run_fsdp, name, clip, batches, expected, rank,
               world)
    _finish(out, rank, results)


# ---------------------------------------------------------------------------------------------
# one spawn per world size
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[int, list[dict]]:
    n = request.param
    return n, _spawn(_worker, n, tmp_path_factory.mktemp(f"fused{n}"))


def _case(results: list[dict], key: str) -> list[dict]:
    for rank, res in enumerate(results):
        assert key not in res["errors"], f"rank {rank}: {res['errors'][key]}"
    return [res["cases"][key] for res in results]


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("name", list(TXS))
def test_zero_equals_single_device(world: tuple[int, list[dict]], name: str, clip: str
                                   ) -> None:
    """Every rank's parameters equal single-device FusedBackward on the mean gradient after
    each of 5 steps (max per-leaf relative error <= 1e-5), stay bit-identical across ranks,
    and no gradient is left; collectives per step: one reduce-scatter (an all-reduce for the
    0-dim leaf) and one all-gather per parameter, the reducer's statistics, and one
    all-reduce of the squared norm per backward when clipping."""
    _, results = world
    cases = _case(results, f"zero/{name}/{clip}")
    n_params, n_vectors = 7, 6            # the scalar gain is all-reduced, not gathered
    for rank, case in enumerate(cases):
        assert max(case["errors"]) <= RTOL, f"rank {rank}: {case['errors']}"
        assert case["replicated"] and case["steps"] == STEPS and case["grads_left"] == 0
        base = n_params + n_vectors + {"none": 0, "previous": 1, "two_pass": n_params + 1}[clip]
        assert min(case["counts"]) >= base, case["counts"]
    if clip != "none":
        assert len({c["norm"] for c in cases}) == 1      # the same norm on every rank


def test_accumulation_communicates_on_the_last_micro_batch(world: tuple[int, list[dict]]
                                                            ) -> None:
    """accumulate=2 under group=WORLD: two micro-batches per rank and step
    equal one single-device step on the whole batch (1e-5), the first backward of each step
    issues no collective, the second all of them."""
    _, results = world
    for case in _case(results, "accumulated"):
        assert max(case["errors"]) <= RTOL and case["replicated"], case
        assert case["counts"][0::2] == [0] * STEPS and min(case["counts"][1::2]) > 0, case


def test_at_most_one_live_gradient_per_rank(world: tuple[int, list[dict]]) -> None:
    """A hook registered before the runner's sees, at every parameter, only the gradient the
    runner is about to take; one registered after it sees none (7 parameters x 5 steps)."""
    _, results = world
    for res in results:
        before, after = res["live"]
        assert len(before) == len(after) == 7 * STEPS
        assert max(before) == 1 and max(after) == 0


@pytest.mark.parametrize("name", list(TXS))
def test_state_is_split_across_ranks(world: tuple[int, list[dict]], name: str) -> None:
    """Each rank holds the state of its rows only: adamw's moments add up exactly to the
    single-device state (plus the replicated scalars on every rank); Adafactor and AdaLomo
    keep their column statistics whole on every rank, so their pieces are larger."""
    n, results = world
    single = results[0]["single_bytes"][name]
    per_rank = [c["state_bytes"] for c in _case(results, f"zero/{name}/none")]
    if name == "adamw":
        # on every rank: an int32 step count per parameter, and the 0-dim gain's mu and nu
        assert sum(per_rank) == single + (7 * 4 + 2 * 4) * (n - 1)
    assert max(per_rank) <= single / n * 1.6 + 7 * 16, (per_rank, single)
    assert max(per_rank) < single


def test_state_dict_round_trip_continues_identically(world: tuple[int, list[dict]]) -> None:
    _, results = world
    assert all(c is True for c in _case(results, "resume"))


def test_overflow_skips_the_whole_leaf_on_every_rank(world: tuple[int, list[dict]]) -> None:
    """One rank's inf in one row: fc1.weight is left as it was on every rank (not only the
    piece that holds the inf), the other leaves are updated, the scale halves everywhere."""
    _, results = world
    for case in _case(results, "overflow"):
        assert case["replicated"] and case["scale"] == 2.0**7
        assert case["changed"]["fc1.weight"] == 0
        assert case["changed"]["fc2.weight"] == 9 * 7


@pytest.mark.parametrize("key", [f"fsdp/{n}/{c}" for n, c in FSDP_CASES])
def test_fsdp2_equals_single_device(world: tuple[int, list[dict]], key: str) -> None:
    """FSDP2 (fully_shard) runs the hooks on its sharded parameters after its reduce-scatter:
    the runner updates the local shard with the averaged gradient shard; equal to one device
    after each of 5 steps, at most one live gradient at any hook, none left."""
    _, results = world
    for rank, case in enumerate(_case(results, key)):
        assert max(case["errors"]) <= RTOL, f"rank {rank}: {case['errors']}"
        assert max(case["live"]) <= 1 and case["grads_left"] == 0


def test_rejects_a_group_with_dtensor_parameters() -> None:
    """group= and FSDP2's DTensors are two ways of saying how to shard: both is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            p = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
            with pytest.raises(ValueError, match="group=None"):
                opttx.FusedBackward([("w", p)], opttx.adalomo(), group=dist.group.WORLD)
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the figures of benchmarks/RESULTS.md
# ---------------------------------------------------------------------------------------------


def _big_worker(rank: int, world: int, store: str, out: str) -> None:
    """State bytes and collectives of one step on a 2.1M-parameter MLP (RESULTS.md)."""
    _init(rank, world, store)
    results: dict[str, Any] = {}
    for name, make in TXS.items():
        for group in (None, dist.group.WORLD):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 1024),
                                  nn.Tanh(), nn.Linear(1024, 513))
            stats = CollectiveStats()
            runner = opttx.FusedBackward(model, make(), group=group, stats=stats,
                                         clip_grad_norm=1.0)
            x = torch.randn(4, 512, generator=torch.Generator().manual_seed(rank))
            runner.backward(model(x).square().mean())
            results[f"{name}/{'zero' if group is not None else 'single'}"] = {
                "state_bytes": tensor_bytes(runner.states), "collectives": stats.collectives,
                "bytes": stats.bytes}
    _finish(out, rank, results)


def _report() -> None:
    for n in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            results = _spawn(_big_worker, n, Path(tmp))
        for name in TXS:
            single = results[0][f"{name}/single"]["state_bytes"]
            zero = [r[f"{name}/zero"] for r in results]
            most = max(z["state_bytes"] for z in zero)
            print(f"2.1M-param MLP, world {n}, {name} + clip 'previous': state bytes per rank "
                  f"{[z['state_bytes'] for z in zero]} = {most / single:.3f} of one device "
                  f"({single}); collectives per step {zero[0]['collectives']} "
                  f"({zero[0]['bytes'] / 2**20:.2f} MiB sent by rank 0)")
    for n in (2, 4):
        with tempfile.TemporaryDirectory() as tmp:
            results = _spawn(_worker, n, Path(tmp))
        for key in sorted(results[0]["cases"]):
            if key in ("resume", "overflow"):
                continue
            cases = [r["cases"][key] for r in results]
            name = key.split("/")[1]
            single = results[0]["single_bytes"][f"fsdp/{name}" if key.startswith("fsdp")
                                                else name]
            print(f"world {n} {key:24s} state bytes per rank "
                  f"{[c['state_bytes'] for c in cases]} (one device {single}), collectives "
                  f"per step {cases[0]['counts']}, max rel. error "
                  f"{max(max(c['errors']) for c in cases):.1e}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _report()
