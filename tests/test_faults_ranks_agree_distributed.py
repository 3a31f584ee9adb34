"""Decisions taken from rank-local data agree across the ranks (docs/guide/faults.md, "Decisions
that agree across ranks"): `apply_if_finite` skips on every rank together wherever it is
placed (around or inside `zero`, with or without offload, around `sharded` or a data-parallel
chain), `MultiSteps` ends its accumulations together, a replicated leaf that differs per rank
is refused at init, and a rank whose state skipped an update is named at the next collective
on every rank, all with the checking mode off.

One spawn (gloo, world 2, a 20 s collective timeout so a regression that hangs fails fast);
each case records what every rank saw, and the tests read the records.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import opttx
from opttx.distributed import (Replicated, Shard, all_reduce_gradients, consistency_checks,
                               sharded, zero)
from fault_cases import outcome, run_cases
from test_distributed import _spawn

pytestmark = pytest.mark.timeout(300)

WORLD, STEPS, NAN_STEP = 2, 4, 1
CHUNK_MB = 64 / 2**20            # 16 floats: several chunks, some on the host with offload


def _healthy() -> bool:
    """Whether the process group still pairs collectives (after a case that raised)."""
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return float(x) == WORLD * (WORLD + 1) / 2


def _params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen),
            "v": torch.randn(5, generator=gen)}


def _grads(step: int, nan: bool) -> dict[str, torch.Tensor]:
    """The same gradients on every rank (so the mean is the single-process gradient), with a
    NaN in one element where ``nan``."""
    gen = torch.Generator().manual_seed(100 + step)
    g = {k: torch.randn(x.shape, generator=gen) for k, x in _params().items()}
    if nan:
        g["v"][2] = float("nan")
    return g


def _run(tx: opttx.GradientTransformation, rank: int, *,
         local: Callable[[dict], dict] = lambda t: t,
         whole: Callable[[dict, dict], dict] | None = None) -> tuple[dict, Any]:
    """``STEPS`` steps, a NaN on rank 1 at ``NAN_STEP``: the final parameters (``local``
    takes this rank's part of a tree; ``whole`` puts the rank's parameters back together
    with the full ones) and state."""
    params = local(_params())
    state = tx.init(params)
    for step in range(STEPS):
        grads = local(_grads(step, nan=rank == 1 and step == NAN_STEP))
        updates, state = tx.update(grads, state, params)
        params = opttx.apply_updates(params, updates)
    return params, state


def _reference(make: Callable[[], opttx.GradientTransformation]) -> dict:
    """The single-process run of ``make()`` on the mean gradients: the NaN step is skipped."""
    params = _params()
    tx = make()
    state = tx.init(params)
    for step in range(STEPS):
        updates, state = tx.update(_grads(step, nan=step == NAN_STEP), state, params)
        params = opttx.apply_updates(params, updates)
    return params


def _rows(rank: int) -> Callable[[dict], dict]:
    """This rank's shard of every tree: rows ``2 rank : 2 rank + 2`` of ``w`` (Shard(0)),
    ``b`` and ``v`` whole (Replicated)."""
    return lambda t: {"w": t["w"][2 * rank:2 * rank + 2].clone(), "b": t["b"].clone(),
                      "v": t["v"].clone()}


SPECS = {"w": Shard(0), "b": Replicated(), "v": Replicated()}


def _placement(rank: int, name: str) -> dict:
    """One placement of apply_if_finite: the final parameters equal (bitwise) those of the
    single-process run that skips the NaN step, on every rank, and the skip is counted once."""
    adamw = lambda: opttx.adamw(1e-2, weight_decay=0.1)          # noqa: E731
    finite = lambda tx, **kw: opttx.apply_if_finite(tx, 3, **kw)  # noqa: E731
    local = _rows(rank) if "sharded" in name else (lambda t: t)
    make, single = {
        "outer_zero": (lambda: finite(zero(adamw(), chunk_size_mb=CHUNK_MB)),
                       lambda: finite(adamw())),
        "outer_zero_stage1": (lambda: finite(zero(adamw(), stage=1, chunk_size_mb=CHUNK_MB)),
                              lambda: finite(adamw())),
        "outer_zero_offload": (lambda: finite(zero(adamw(), chunk_size_mb=CHUNK_MB,
                                                   offload=0.5)),
                               lambda: finite(adamw())),
        "inner_zero": (lambda: zero(finite(adamw()), chunk_size_mb=CHUNK_MB),
                       lambda: finite(adamw())),
        "inner_zero_offload": (lambda: zero(finite(adamw()), chunk_size_mb=CHUNK_MB,
                                            offload=0.5),
                               lambda: finite(adamw())),
        "inner_zero_offload_all": (lambda: zero(finite(adamw()), chunk_size_mb=CHUNK_MB,
                                                offload=True),
                                   lambda: finite(adamw())),
        "outer_zero_check_state": (lambda: finite(zero(adamw(), chunk_size_mb=CHUNK_MB),
                                                  check_state=True),
                                   lambda: finite(adamw(), check_state=True)),
        "outer_ddp": (lambda: finite(opttx.chain(all_reduce_gradients(), adamw())),
                      lambda: finite(adamw())),
        "outer_sharded": (lambda: finite(sharded(opttx.lamb(1e-2), SPECS)),
                          lambda: finite(opttx.lamb(1e-2))),
        "inner_sharded": (lambda: sharded(finite(opttx.lamb(1e-2)), SPECS),
                          lambda: finite(opttx.lamb(1e-2))),
        "outer_sharded_owners": (lambda: finite(sharded(adamw(), SPECS, on_owners=True)),
                                 lambda: finite(adamw())),
        "inner_sharded_owners": (lambda: sharded(finite(adamw()), SPECS, on_owners=True),
                                 lambda: finite(adamw())),
    }[name]
    with consistency_checks(None):
        got, state = _run(make(), rank, local=local)
    want = local(_reference(single))
    skips = [int(s.total_notfinite) for s in opttx.tree.find_instances(
        state, opttx.ApplyIfFiniteState)]
    return {"equal": all(torch.equal(got[k], want[k]) for k in want),
            "error": max(float(((got[k] - want[k]).abs() / want[k].abs().clamp(min=1e-3)).max())
                         for k in want),
            "finite": all(bool(torch.isfinite(x).all()) for x in got.values()),
            "skips": skips, "healthy": _healthy()}


PLACEMENTS = ["outer_zero", "outer_zero_stage1", "outer_zero_offload", "inner_zero",
              "inner_zero_offload", "inner_zero_offload_all", "outer_zero_check_state",
              "outer_ddp", "outer_sharded", "inner_sharded", "outer_sharded_owners",
              "inner_sharded_owners"]


# ---------------------------------------------------------------------------------------------
# MultiSteps
# ---------------------------------------------------------------------------------------------


def _multi_steps_equal(rank: int) -> dict:
    """MultiSteps around zero, k from a schedule, and apply_if_finite around both with a NaN
    on rank 1: every rank accumulates, skips and steps together; the numbers are the single
    process's."""
    k = lambda n: torch.where(n < 1, 2, 3)                      # noqa: E731
    make = lambda inner: opttx.apply_if_finite(                 # noqa: E731
        opttx.MultiSteps(inner, k).gradient_transformation(), 3)
    with consistency_checks(None):
        got, _ = _run(make(zero(opttx.adamw(1e-2), chunk_size_mb=CHUNK_MB)), rank)
        inner, _ = _run(zero(opttx.MultiSteps(opttx.adamw(1e-2), k).gradient_transformation(),
                             chunk_size_mb=CHUNK_MB), 0)
    want = _reference(lambda: make(opttx.adamw(1e-2)))
    plain = _params()
    tx = opttx.MultiSteps(opttx.adamw(1e-2), k).gradient_transformation()
    state = tx.init(plain)
    for step in range(STEPS):
        updates, state = tx.update(_grads(step, nan=False), state, plain)
        plain = opttx.apply_updates(plain, updates)
    return {"equal": all(torch.equal(got[n], want[n]) for n in want),
            "inner_equal": all(torch.equal(inner[n], plain[n]) for n in plain),
            "moved": not torch.equal(got["w"], _params()["w"]), "healthy": _healthy()}


def _keeps_old_state(rank: int, make: Callable[[], opttx.GradientTransformation],
                     local: Callable[[dict], dict] = lambda t: t) -> dict:
    """Rank 1 calls update at step 1 but keeps its old state (a local check threw the step
    away): its state is a step behind the others'."""
    def run() -> list[int]:
        params = local(_params())
        tx = make()
        state = tx.init(params)
        for step in range(STEPS):
            grads = local(_grads(step, nan=False))
            updates, new_state = tx.update(grads, state, params)
            if rank == 1 and step == 1:
                continue
            state = new_state
            params = opttx.apply_updates(params, updates)
        return [step]
    with consistency_checks(None):
        got = outcome(run)
    got["healthy"] = _healthy()
    return got


def _replicated_differs(rank: int) -> dict:
    """A Replicated leaf (under zero: any parameter) holding other values on rank 1, with the
    checking mode off: refused at init on every rank, naming the leaf."""
    params = {"w": torch.ones(2, 3), "b": torch.full((3,), float(rank)), "c": torch.ones(2)}
    specs = {"w": Shard(0), "b": Replicated(), "c": Replicated()}
    out = {}
    with consistency_checks(None):
        for name, make in (("sharded", lambda: sharded(opttx.lamb(1e-2), specs)),
                           ("zero", lambda: zero(opttx.adamw(1e-2))),
                           ("same", lambda: sharded(opttx.lamb(1e-2), specs))):
            given = params if name != "same" else {**params, "b": torch.zeros(3)}
            out[name] = outcome(lambda: make().init(given) and None)
            out[name]["healthy"] = _healthy()
    return out


def _fsdp2(rank: int) -> dict:
    """FSDP2 (``fully_shard``, DTensor parameters and gradients): a NaN in rank 1's local
    gradient at step 1, apply_if_finite around and inside ``sharded(adamw)``. Every rank skips
    that step: the parameters equal, bit for bit, a run that leaves the step out."""
    import torch.nn.functional as F
    from test_fsdp import _batches, _fsdp_model

    def train(make: Callable[[], opttx.GradientTransformation] | None) -> list[torch.Tensor]:
        model = _fsdp_model(WORLD)
        named = dict(model.named_parameters())
        params = {k: p.detach() for k, p in named.items()}
        tx = make() if make is not None else sharded(opttx.adamw(1e-2))
        state = tx.init(params)
        for step, (x, y) in enumerate(_batches()):
            F.mse_loss(model(x.tensor_split(WORLD)[rank]), y.tensor_split(WORLD)[rank]).backward()
            grads = {k: p.grad for k, p in named.items()}
            if step == NAN_STEP:
                if make is None:                  # the reference leaves the step out
                    model.zero_grad()
                    continue
                if rank == 1:
                    local = next(g.to_local() for g in grads.values() if g.to_local().numel())
                    local.view(-1)[0] = float("nan")
            updates, state = tx.update(grads, state, params)
            opttx.apply_updates_(params, updates)
            model.zero_grad()
        return [p.detach().full_tensor() for p in model.parameters()]

    with consistency_checks(None):
        want = train(None)
        got = {"outer": train(lambda: opttx.apply_if_finite(sharded(opttx.adamw(1e-2)), 3)),
               "inner": train(lambda: sharded(opttx.apply_if_finite(opttx.adamw(1e-2), 3)))}
    return {name: all(torch.equal(a, b) for a, b in zip(ps, want)) for name, ps in got.items()}


def _worker(rank: int, world: int, store: str, out: str) -> None:
    cases: dict[str, Callable[[], Any]] = {
        f"placement/{name}": (lambda name=name: _placement(rank, name)) for name in PLACEMENTS}
    k2 = lambda: opttx.MultiSteps(zero(opttx.adamw(1e-2), chunk_size_mb=CHUNK_MB),  # noqa: E731
                                  2).gradient_transformation()
    cases.update({
        "multi_steps": lambda: _multi_steps_equal(rank),
        "multi_steps_behind": lambda: _keeps_old_state(rank, k2),
        "zero_behind": lambda: _keeps_old_state(
            rank, lambda: zero(opttx.adamw(1e-2), chunk_size_mb=CHUNK_MB)),
        "zero_behind_bf16": lambda: _keeps_old_state(
            rank, lambda: zero(opttx.adamw(1e-2), chunk_size_mb=CHUNK_MB,
                               communication_dtype=torch.bfloat16)),
        "sharded_behind": lambda: _keeps_old_state(
            rank, lambda: sharded(opttx.lamb(1e-2), SPECS), _rows(rank)),
        "sharded_behind_adafactor": lambda: _keeps_old_state(
            rank, lambda: sharded(opttx.adafactor(1e-2, factor_axes="last"), SPECS),
            _rows(rank)),
        "replicated": lambda: _replicated_differs(rank),
        "compiled": lambda: _compiled(rank),
        "fsdp2": lambda: _fsdp2(rank),
    })
    run_cases(rank, world, store, out, cases)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_worker, WORLD, tmp_path_factory.mktemp("agree"))


def _case(results: list[dict], name: str) -> list[Any]:
    got = [r[name] for r in results]
    assert all(not (isinstance(g, dict) and "crash" in g) for g in got), got
    return got


@pytest.mark.parametrize("name", PLACEMENTS)
def test_apply_if_finite_skips_on_every_rank_in_every_placement(results, name: str) -> None:
    """A NaN in rank 1's gradient at one step: every rank skips it (before: around zero,
    rank 0 stepped and rank 1 skipped, so their collectives paired across steps until a gloo
    abort; inside zero with offload it was refused), and the run equals, bit for bit, the
    single-process run that skips that step (under sharded to rounding: LAMB's norms are
    sums of the shards' partial sums)."""
    got = _case(results, f"placement/{name}")
    for g in got:
        assert g["finite"] and g["healthy"], got
        assert g["equal"] if "sharded" not in name else g["error"] < 1e-6, got
        assert g["skips"] and all(s == 1 for s in g["skips"]), got


def test_multi_steps_accumulates_and_steps_together(results) -> None:
    for g in _case(results, "multi_steps"):
        assert g["equal"] and g["inner_equal"] and g["moved"] and g["healthy"], g


def test_multi_steps_boundary_that_differs_per_rank_raises_on_every_rank(results) -> None:
    """Rank 1 kept its old state for one micro-step, so its accumulation ends a call later:
    the ranks agree on every boundary with one all-reduce, and when they differ every rank
    raises the same error (before: rank 0 alone ran zero's collectives)."""
    got = _case(results, "multi_steps_behind")
    for g in got:
        assert g["type"] == "ValueError" and g["healthy"], got
        assert "MultiSteps: the ranks disagree on whether this call ends an accumulation" \
            in g["error"], got


@pytest.mark.parametrize("case", ["zero_behind", "zero_behind_bf16", "sharded_behind",
                                  "sharded_behind_adafactor"])
def test_a_rank_whose_state_skipped_an_update_is_named_on_every_rank(results, case) -> None:
    """Rank 1's state is a step behind (it kept its old state once): at the next update the
    step counters, sent along with zero's all-gather of updates or with the first all-reduce
    of sharded's statistics (LAMB's sums, Adafactor's), differ, and every rank raises naming
    the counter, with the checking mode off (before: only the checking mode saw it)."""
    got = _case(results, case)
    for g in got:
        assert g["type"] == "ValueError" and g["healthy"], got
        assert "the ranks' states are at different steps: the step counter" in g["error"], got
        assert ".count" in g["error"], got
    if case.startswith("zero"):                  # every rank's value, gathered
        assert "rank 0: 2, rank 1: 1" in got[0]["error"], got
        assert got[0]["error"] == got[1]["error"], got


@pytest.mark.parametrize("name", ["outer", "inner", "multi_steps"])
def test_compiled_agreement_is_in_the_one_graph(results, name: str) -> None:
    """Compiled with fullgraph: one frame (the agreement's all-reduce traced, no graph
    break), the NaN step skipped on every rank, the eager run's numbers (before: a torch.cond
    around or inside zero refused zero's views of one buffer)."""
    for g in _case(results, "compiled"):
        assert g["healthy"], g
        assert g[name]["frames"] == 1 and g[name]["skips"] == [1], g
        assert g[name]["equal"] and g[name]["moved"], g


def test_apply_if_finite_under_fsdp2_skips_on_every_rank(results) -> None:
    """FSDP2's DTensor gradients, a NaN in rank 1's shard: around ``sharded`` (the local
    counts summed over the default group, which ``sharded`` declares) and inside it, every
    rank skips; the same parameters as a run without that step."""
    for g in _case(results, "fsdp2"):
        assert g == {"outer": True, "inner": True}, g


@pytest.mark.parametrize("how", ["sharded", "zero"])
def test_replicated_leaves_that_differ_per_rank_are_refused_at_init(results, how) -> None:
    got = _case(results, "replicated")
    for g in got:
        assert g[how]["type"] == "ValueError" and g[how]["healthy"], got
        assert f"opttx.distributed.{how}: the replicated leaf ['b'] holds different values" \
            in g[how]["error"], got
        assert g["same"]["error"] is None, got
    assert got[0][how]["error"] == got[1][how]["error"], got


def _compiled(rank: int) -> dict:
    """apply_if_finite around and inside zero, and MultiSteps around it, compiled (fullgraph,
    aot_eager): the agreement is a functional all-reduce inside the one graph, and the run
    equals the eager one."""
    from torch._dynamo.testing import CompileCounterWithBackend
    makes = {
        "outer": lambda: opttx.apply_if_finite(zero(opttx.adamw(1e-2), chunk_size_mb=CHUNK_MB),
                                               3),
        "inner": lambda: zero(opttx.apply_if_finite(opttx.adamw(1e-2), 3),
                              chunk_size_mb=CHUNK_MB),
        "multi_steps": lambda: opttx.apply_if_finite(opttx.MultiSteps(
            zero(opttx.adamw(1e-2), chunk_size_mb=CHUNK_MB), 2).gradient_transformation(), 3),
    }
    out = {}
    with consistency_checks(None):
        for name, make in makes.items():
            eager, _ = _run(make(), rank)
            tx = make()
            counter = CompileCounterWithBackend("aot_eager")
            torch._dynamo.reset()
            step = torch.compile(tx.update, backend=counter, fullgraph=True)
            params = _params()
            state = tx.init(params)
            for s in range(STEPS):
                updates, state = step(_grads(s, nan=rank == 1 and s == NAN_STEP), state, params)
                params = opttx.apply_updates(params, updates)
            skips = [int(x.total_notfinite) for x in opttx.tree.find_instances(
                state, opttx.ApplyIfFiniteState)]
            out[name] = {"frames": counter.frame_count, "skips": skips,
                         "moved": not torch.equal(params["w"], _params()["w"]),
                         "equal": all(torch.allclose(params[k], eager[k], rtol=1e-6, atol=1e-7)
                                      for k in eager)}
    out["healthy"] = _healthy()
    return out


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_step_counters_survive_a_reduction_exactly(op: str, dtype: torch.dtype,
                                                   world: int) -> None:
    """The counters a reduction carries (`StepCounters.reduction_tail`), reduced as the
    collective would (sum or max over the ranks, in the buffer's dtype): equal counters pass,
    and one rank a step behind or ahead raises, at counts near the modulus too."""
    from opttx.base import Role, declare_roles
    from opttx.distributed.consistency import StepCounters
    from typing import NamedTuple

    class S(NamedTuple):
        count: torch.Tensor
        __roles__ = declare_roles(count=Role.COUNT)

    def reduced(counts: list[int]) -> tuple[StepCounters, torch.Tensor]:
        per_rank = [StepCounters("t", S(torch.tensor(c)), [".count"]) for c in counts]
        tails = torch.stack([c.reduction_tail(op, dtype, world, torch.device("cpu"))
                             for c in per_rank])
        out = tails.sum(0) if op == "sum" else tails.max(0).values
        return per_rank[0], out.to(dtype)

    modulus = StepCounters._reduction_modulus(op, dtype, world)
    for base in (0, 1, 7, modulus - 2, 123456):
        mine, out = reduced([base] * world)
        mine.check_reduced(op, out, dtype, world)                  # all equal: no error
        for delta in (1, -1):
            if base + delta < 0:
                continue
            counts = [base] * world
            counts[world - 1] = base + delta
            mine, out = reduced(counts)
            with pytest.raises(ValueError, match="the ranks' states are at different steps"):
                mine.check_reduced(op, out, dtype, world)
