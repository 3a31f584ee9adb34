"""Faults in the distributed layer, beyond tests/test_faults_distributed.py: each gives the
right numbers or the same clear error on every rank, never a silent wrong result, a hang or a
gloo abort. Overlapped gradient reduction (gradients edited in place after backward, a layer
unused on one rank or on all), the checking mode of ``consistency_checks`` (replicated leaves
that differ, a rank that skipped an update), and also ``schedule_free_eval_params`` under
``zero`` and ``on_owners`` and checkpoints with checksums on two ranks.

One spawn (gloo, world 2, a 20 s collective timeout so a regression that hangs fails fast);
each case records what every rank saw, and the tests read the records.
"""

from __future__ import annotations

from pathlib import Path
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

WORLD, STEPS = 2, 3


def _copy(leaf):
    """A leaf of a state dict kept for comparison: tensors cloned, the maker's record (the
    strings of ``made_by``) as it is."""
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b



def _healthy() -> bool:
    """Whether the process group still pairs collectives (after a case that raised)."""
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return float(x) == WORLD * (WORLD + 1) / 2


# ---------------------------------------------------------------------------------------------
# overlap: in-place edits of .grad, and a layer unused on one rank
# ---------------------------------------------------------------------------------------------


class _Net(torch.nn.Module):
    """Three layers; ``skip`` leaves the middle one out of this forward (unused)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = (torch.nn.Linear(6, 16), torch.nn.Linear(16, 16),
                                     torch.nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if not skip:
            h = torch.tanh(self.l2(h))
        return self.l3(h)


OVERLAP_TXS: dict[str, Callable[..., opttx.GradientTransformation]] = {
    "zero2": lambda **kw: zero(opttx.adamw(1e-2, weight_decay=0.1), stage=2,
                               chunk_size_mb=512 / 2**20, **kw),
    "zero1": lambda **kw: zero(opttx.adamw(1e-2, weight_decay=0.1), stage=1,
                               chunk_size_mb=512 / 2**20, **kw),
    "ddp": lambda **kw: opttx.chain(all_reduce_gradients(bucket_size_mb=512 / 2**20, **kw),
                                    opttx.adamw(1e-2, weight_decay=0.1)),
}


def _train(make: Callable[..., opttx.GradientTransformation], rank: int, *, overlap: bool,
           clip: float | None = None, skip: Callable[[int, int], bool] = lambda r, s: False,
           zeros: bool = False) -> list[list[float]]:
    """``STEPS`` steps on this rank's batches; ``clip``: ``clip_grad_norm_`` of the local
    gradients between backward and update; ``skip(rank, step)``: leave layer 2 unused;
    ``zeros``: pass zeros for a missing gradient (as `opttx.Optimizer` does), else None."""
    net = _Net()
    params = dict(net.named_parameters())
    tx = make(overlap=overlap)
    state = tx.init(params)
    for step in range(STEPS):
        net.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(1000 * step + 10 * rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        torch.nn.functional.mse_loss(net(x, skip(rank, step)), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        grads = {k: torch.zeros_like(p) if zeros and p.grad is None else p.grad
                 for k, p in params.items()}
        with torch.no_grad():
            updates, state = tx.update(grads, state, params)
            opttx.apply_updates_(params, updates)
    return [p.detach().flatten().tolist() for p in params.values()]


def _overlap_cases(rank: int) -> dict:
    out = {}
    for name, make in OVERLAP_TXS.items():
        case: dict[str, Any] = {}
        # clip_grad_norm_ edits .grad in place after backward launched its reductions
        case["clipped"] = _train(make, rank, overlap=True, clip=0.05) == \
            _train(make, rank, overlap=False, clip=0.05)
        case["clip_moves"] = _train(make, rank, overlap=False, clip=0.05) != \
            _train(make, rank, overlap=False)
        # layer 2 unused on rank 1 at step 1 only
        for via in ("none", "zeros"):
            got = outcome(lambda: _train(make, rank, overlap=True, zeros=via == "zeros",
                                          skip=lambda r, s: r == 1 and s == 1))
            got.pop("value", None)
            got["healthy"] = _healthy()
            case[f"unused_{via}"] = got
        # layer 2 unused on every rank at step 1, zeros passed: as without overlap
        every = lambda r, s: s == 1  # noqa: E731
        case["unused_everywhere"] = _train(make, rank, overlap=True, zeros=True, skip=every) \
            == _train(make, rank, overlap=False, zeros=True, skip=every)
        out[name] = case
    return out


# ---------------------------------------------------------------------------------------------
# the checking mode: replicated leaves that differ, a rank that skips an update
# ---------------------------------------------------------------------------------------------


def _initoutcome(make: Callable[[], opttx.GradientTransformation], params: dict) -> dict:
    def run() -> None:
        make().init(params)
    got = outcome(run)
    got["healthy"] = _healthy()
    return got


def _replicated_differs(rank: int) -> dict:
    """A Replicated leaf (and, under zero, any parameter) holding different values on the two
    ranks: refused at init with the checking mode on, and by sharded's own check without
    it."""
    params = {"w": torch.ones(2, 3), "b": torch.full((3,), float(rank))}
    specs = {"w": Shard(0), "b": Replicated()}
    out = {}
    with consistency_checks(1):
        out["sharded"] = _initoutcome(lambda: sharded(opttx.adamw(1e-2), specs), params)
        out["zero"] = _initoutcome(lambda: zero(opttx.adamw(1e-2)), params)
        out["same"] = _initoutcome(lambda: sharded(opttx.adamw(1e-2), specs),
                                    {"w": params["w"], "b": torch.zeros(3)})
    with consistency_checks(None):
        out["unchecked"] = _initoutcome(lambda: sharded(opttx.adamw(1e-2), specs), params)
    return out


def _train_skipping(rank: int, every: int | None, skip: bool) -> dict:
    """Four steps of sharded adamw (a Shard(0) matrix, a Replicated vector whose gradient
    depends on the step, alike on every rank); rank 1 skips the update of step 1."""
    params = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    calls = []

    def run() -> list[float]:
        nonlocal params
        tx = sharded(opttx.adamw(1e-1), {"w": Shard(0), "b": Replicated()})
        state = tx.init(params)
        for step in range(4):
            if skip and rank == 1 and step == 1:
                continue
            calls.append(step)
            grads = {"w": torch.full((2, 3), step + 1.0), "b": torch.full((3,), (step + 1.0) ** 2)}
            updates, state = tx.update(grads, state, params)
            params = opttx.apply_updates(params, updates)
        return params["b"].tolist()

    with consistency_checks(every):
        got = outcome(run)
    got["calls"] = calls
    got["healthy"] = _healthy()
    return got


def _checking_cases(rank: int) -> dict:
    return {"replicated": _replicated_differs(rank),
            "skip_every_1": _train_skipping(rank, 1, True),
            "skip_every_2": _train_skipping(rank, 2, True),
            "no_skip_every_1": _train_skipping(rank, 1, False),
            "skip_unchecked": _train_skipping(rank, None, True)}


# ---------------------------------------------------------------------------------------------
# Schedule-Free's evaluation parameters under zero and on_owners
# ---------------------------------------------------------------------------------------------


def _schedule_free_eval(rank: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen),
              "c": torch.randn(2, 2, generator=gen, dtype=torch.float64),
              "d": torch.randn(4, generator=gen)}
    txs = {"zero": zero(opttx.schedule_free_adamw(1e-2), chunk_size_mb=1e-4),
           "owners": sharded(opttx.schedule_free_adamw(1e-2), on_owners=True),
           "one": opttx.schedule_free_adamw(1e-2)}
    out: dict[str, Any] = {}
    for name, tx in txs.items():
        p = {k: v.clone() for k, v in params.items()}
        state = tx.init(p)
        for step in range(3):
            g = {k: v * (step + 1.0) - 0.1 for k, v in p.items()}
            updates, state = tx.update(g, state, p)
            p = opttx.apply_updates(p, updates)
        x = (opttx.schedule_free_eval_params(state, p) if name == "one"
             else opttx.distributed.schedule_free_eval_params(state, p))
        out[name] = {k: v.tolist() for k, v in x.items()}
        out[f"{name}_moved"] = any(not torch.equal(x[k], p[k]) for k in p)
        if name == "zero":
            out["single_device_function"] = outcome(
                lambda: opttx.schedule_free_eval_params(state, p) and None)
    return out


# ---------------------------------------------------------------------------------------------
# checkpoints with checksums on two ranks
# ---------------------------------------------------------------------------------------------


def _checksummed_checkpoint(rank: int, root: Path) -> dict:
    """zero(adam) saved by save_checkpoint: verified and loaded back on both ranks; with one
    bit flipped in one file (by rank 0), refused on both ranks, nothing loaded."""
    import struct

    from opttx.distributed import load_checkpoint, save_checkpoint, state_dict, verify_checkpoint
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "u": torch.randn(5), "v": torch.randn(3, 2)}
    tx = zero(opttx.adam(1e-2))
    state = tx.init(params)
    updates, state = tx.update({k: torch.ones_like(v) for k, v in params.items()}, state, params)
    params = opttx.apply_updates(params, updates)
    path = root / "checksummed"
    save_checkpoint({"params": params, "optim": state_dict(state, params)}, path)
    saved = {k: v.clone() for k, v in params.items()}
    out: dict[str, Any] = {"verified": verify_checkpoint(path)}
    live = {"params": {k: v + 1 for k, v in params.items()},
            "optim": state_dict(tx.init(params), params)}
    out["clean"] = outcome(lambda: load_checkpoint(live, checkpoint_id=str(path)))
    out["clean_equal"] = all(torch.equal(live["params"][k], saved[k]) for k in saved)
    dist.barrier()
    if rank == 0:
        target = sorted(path.glob("*.distcp"))[-1]
        data = bytearray(target.read_bytes())
        value = struct.pack("<f", float(saved["w"][0, 0]))
        at = data.find(value)
        data[at if at >= 0 else len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    dist.barrier()
    live = {"params": {k: v + 1 for k, v in params.items()},
            "optim": state_dict(tx.init(params), params)}
    before = [_copy(x) for x in opttx.tree.tree_leaves(live)]
    out["flipped"] = outcome(lambda: load_checkpoint(live, checkpoint_id=str(path)))
    out["untouched"] = all(_same(a, b) for a, b in
                           zip(before, opttx.tree.tree_leaves(live)))
    out["healthy"] = _healthy()
    return out


def _worker(rank: int, world: int, store: str, out: str) -> None:
    run_cases(rank, world, store, out, {
        "overlap": lambda: _overlap_cases(rank),
        "checking": lambda: _checking_cases(rank),
        "schedule_free": lambda: _schedule_free_eval(rank),
        "checkpoint": lambda: _checksummed_checkpoint(rank, Path(out).parent),
    })


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_worker, WORLD, tmp_path_factory.mktemp("faults30"))


def _case(results: list[dict], name: str) -> list[Any]:
    got = [r[name] for r in results]
    assert all("crash" not in g for g in got), got
    return got


@pytest.mark.parametrize("name", list(OVERLAP_TXS))
def test_overlap_sees_gradients_clipped_in_place_after_backward(results, name) -> None:
    """``clip_grad_norm_`` between backward and update modifies the ``.grad`` tensors that
    backward's launches already read: those launches are discarded (their version counters
    moved) and the clipped gradients reduced again, bitwise as without overlap (before: the
    unclipped reduction was used, parameters 0.097 off)."""
    for res in _case(results, "overlap"):
        assert res[name]["clipped"] and res[name]["clip_moves"], res[name]


@pytest.mark.parametrize("via", ["none", "zeros"])
@pytest.mark.parametrize("name", list(OVERLAP_TXS))
def test_overlap_names_a_parameter_unused_on_one_rank_on_every_rank(results, name, via) -> None:
    """A layer unused on rank 1 for one step ended the run in a gloo SIGABRT (the chunks'
    reductions paired out of order); now a ValueError on every rank names the parameter and
    the rank, whether update gets None or zeros for the missing gradient, and the process
    group still works afterwards."""
    got = [res[name][f"unused_{via}"] for res in _case(results, "overlap")]
    for g in got:
        assert g["type"] == "ValueError", got
        assert "l2." in g["error"] and "rank 1" in g["error"], got
        assert "got no gradient" in g["error"], got
        assert g["healthy"], got


@pytest.mark.parametrize("name", list(OVERLAP_TXS))
def test_overlap_with_a_layer_unused_on_every_rank_equals_no_overlap(results, name) -> None:
    for res in _case(results, "overlap"):
        assert res[name]["unused_everywhere"], res[name]


@pytest.mark.parametrize("how", ["sharded", "zero"])
def test_checking_mode_refuses_replicated_leaves_that_differ_on_every_rank(results, how) -> None:
    """A Replicated leaf (under zero: any parameter, all are replicated) holding other values
    on rank 1 was accepted; with the checking mode on, init raises on every rank naming it."""
    got = [r["replicated"][how] for r in _case(results, "checking")]
    for g in got:
        assert g["type"] == "ValueError" and g["healthy"], got
        assert "['b'] holds different values on different ranks" in g["error"], got
        assert "consistency check at init" in g["error"], got
    assert all(r["replicated"]["same"]["error"] is None for r in _case(results, "checking"))


def test_without_the_checking_mode_differing_replicated_leaves_are_refused_too(results) -> None:
    """With the mode off (the default outside tests) sharded's init still compares a
    checksum of every replicated leaf across the ranks (one all-gather) and raises on every
    rank (tests/test_faults_ranks_agree_distributed.py); it passed silently before."""
    for r in _case(results, "checking"):
        error = r["replicated"]["unchecked"]["error"]
        assert error is not None and "the replicated leaf ['b'] holds different values" \
            in error, r["replicated"]


@pytest.mark.parametrize("every", [1, 2])
def test_checking_mode_catches_a_rank_that_skipped_an_update(results, every) -> None:
    """Rank 1 skips step 1: its next update pairs with the others' step 1, its replicated
    leaf falls behind. Checked every update (or every other), the next check whose
    parameters differ raises on both ranks (the third update; before: the run ended with
    different replicated values, below)."""
    got = [r[f"skip_every_{every}"] for r in _case(results, "checking")]
    for g in got:
        assert g["type"] == "ValueError" and g["healthy"], got
        assert "consistency check at update 3" in g["error"], got
        assert "['b'] holds different values" in g["error"], got
    assert [g["calls"] for g in got] == [[0, 1, 2], [0, 2, 3]], got
    clean = [r["no_skip_every_1"] for r in _case(results, "checking")]
    assert clean[0]["error"] is None and clean[0]["value"] == clean[1]["value"], clean
    silent = [r["skip_unchecked"] for r in _case(results, "checking")]
    assert silent[0]["error"] is None and silent[1]["error"] is None, silent
    assert silent[0]["value"] != silent[1]["value"], silent


@pytest.mark.parametrize("how", ["zero", "owners"])
def test_schedule_free_eval_params_under_zero_and_on_owners(results, how) -> None:
    """Under zero (or on_owners) a rank's state holds z of its own leaves only, and there was
    no way to get the evaluation parameters. opttx.distributed.schedule_free_eval_params
    gathers them from the owners: on every rank, bitwise the single-device ones."""
    for res in _case(results, "schedule_free"):
        assert res[how] == res["one"] and res["one_moved"], res
        assert "call opttx.distributed.schedule_free_eval_params on every rank" in \
            res["single_device_function"]["error"], res


def test_save_checkpoint_round_trip_and_a_flipped_bit_on_two_ranks(results) -> None:
    """save_checkpoint writes SHA-256 checksums of every file of the DCP checkpoint;
    load_checkpoint verifies them first (hashing split over the ranks): a clean checkpoint
    loads back bitwise, one flipped bit is refused with the same ValueError on both ranks
    naming the file, and nothing is written (before: loaded silently)."""
    got = _case(results, "checkpoint")
    for g in got:
        assert g["verified"] is True and g["clean"]["error"] is None and g["clean_equal"], g
        assert g["flipped"]["type"] == "ValueError", g
        assert ".distcp does not have the SHA-256 it was saved with" in g["flipped"]["error"], g
        assert g["untouched"] and g["healthy"], g
    assert got[0]["flipped"]["error"] == got[1]["flipped"]["error"]
