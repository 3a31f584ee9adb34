"""`on_owners(tx, split_above_mb=...)` (and `sharded(..., on_owners=True, split_above_mb=...)`):
a large tensor-parallel leaf cut into one row segment per rank instead of one owner; each rank
receives only the rows of its segment from the pieces that hold them. Equal to one device,
Shampoo's blocks and state spread over the ranks.

Shapes: an embedding split Shard(0) over the tensor-parallel group (the segments cut across
the pieces when the sizes differ), a projection split Shard(1) (every piece holds some of
every segment's columns), a large replicated leaf (each rank takes its rows locally) and small
leaves that keep one owner. One spawn per world size (2 and 4), looping over transforms and
seeds; collectives counted per step; at world 2 Shampoo's split plan also runs compiled
(aot_eager, fullgraph).
"""

from __future__ import annotations

import pytest
import torch

import opttx
from opttx.distributed import (CollectiveStats, Replicated, Shard, local_shard, on_owners,
                               sharded)
from opttx.testing import gradient_stream, max_relative_error, spawn_ranks

from test_distributed import _shard_tree
from test_zero_split import _state_bytes

STEPS = 5

TXS = {
    # blocks of 8 rows: segments cut at multiples of 8, whole blocks on every rank
    "shampoo": lambda: opttx.shampoo(1e-2, max_preconditioner_dim=8, precondition_frequency=2,
                                     epsilon=1e-6, grafting="adam"),
    "shampoo_packed_newton": lambda: opttx.shampoo(
        1e-2, max_preconditioner_dim=8, precondition_frequency=2, epsilon=1e-6,
        grafting="adam", root_method="newton", use_symmetric_packing=True),
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.01),
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=1, factor_axes="last"),
    "lamb": lambda: opttx.lamb(1e-2, weight_decay=0.01),
}


def model(seed: int, vocab: int) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(seed)
    params = {"embed": torch.randn(vocab, 12, generator=gen),
              "proj": torch.randn(40, 10, generator=gen),
              "table": torch.randn(33, 6, generator=gen),
              "w": torch.randn(6, 5, generator=gen),
              "b": torch.randn(5, generator=gen)}
    specs = {"embed": Shard(0), "proj": Shard(1), "table": Replicated(), "w": Shard(0),
             "b": Replicated()}
    return params, specs


def worker(rank: int, world: int) -> dict:
    out = {}
    for name, make in TXS.items():
        for seed, vocab in ((0, 61), (1, 96)):
            full, specs = model(seed, vocab)
            grads = gradient_stream(full, STEPS, seed=seed + 7)
            local = _shard_tree(full, specs)
            ref, p_ref = make(), full
            s_ref = ref.init(full)
            results = {}
            for split in (None, 0.0):
                stats = CollectiveStats()
                tx = sharded(make(), specs, on_owners=True, split_above_mb=split, stats=stats)
                p, state, counts = local, tx.init(local), []
                for g in grads:
                    stats.reset()
                    u, state = tx.update(_shard_tree(g, specs), state, p)
                    counts.append(stats.collectives)
                    p = opttx.apply_updates(p, u)
                results[split] = (p, _state_bytes(state), counts)
            for g in grads:
                u, s_ref = ref.update(g, s_ref, p_ref)
                p_ref = opttx.apply_updates(p_ref, u)
            if name == "shampoo":                   # owners balanced by state bytes
                tx = sharded(on_owners(make(), cost="state", split_above_mb=0.0), specs)
                p, state = local, tx.init(local)
                for g in grads:
                    u, state = tx.update(_shard_tree(g, specs), state, p)
                    p = opttx.apply_updates(p, u)
                assert all(torch.equal(p[k], results[0.0][0][k]) for k in full)
                results["state"] = (p, _state_bytes(state), [])
                # updates sent back in bf16: one step against the float32 one
                g0 = _shard_tree(grads[0], specs)
                sent = {}
                for dtype in (None, torch.bfloat16):
                    stats = CollectiveStats()
                    tx = sharded(on_owners(make(), split_above_mb=0.0,
                                           communication_dtype=dtype), specs, stats=stats)
                    u, _ = tx.update(g0, tx.init(local), local)
                    sent[dtype] = (u, stats.bytes)
                (u32, bytes32), (u16, bytes16) = sent[None], sent[torch.bfloat16]
                bf16 = {"worst": max(float(((u16[k] - u32[k]).abs()
                                            / u32[k].abs().clamp_min(1e-30)).max())
                                     for k in full),
                        "bytes": (bytes32, bytes16),
                        "rounded": all(torch.equal(u16[k], u32[k].bfloat16().float())
                                       for k in full)}
            compiled = None
            if name == "shampoo" and seed == 0 and world == 2:   # the split plan, one graph
                from torch._dynamo.testing import CompileCounterWithBackend
                counter = CompileCounterWithBackend("aot_eager")
                tx = sharded(make(), specs, on_owners=True, split_above_mb=0.0)
                step = torch.compile(tx.update, backend=counter, fullgraph=True)
                p, state = local, tx.init(local)
                for g in grads:
                    u, state = step(_shard_tree(g, specs), state, p)
                    p = opttx.apply_updates(p, u)
                compiled = {"frames": counter.frame_count,
                            "error": max(max_relative_error(p[k], results[0.0][0][k])
                                         for k in full)}
                torch._dynamo.reset()
            p_split = results[0.0][0]
            out[name, seed] = {
                "error": max(max_relative_error(p_split[k], local_shard(p_ref[k], specs[k]))
                             for k in full),
                "same_as_whole_leaves": all(torch.equal(p_split[k], results[None][0][k])
                                            for k in full),
                "state": results[0.0][1], "state_whole_leaves": results[None][1],
                "single_device_state": _state_bytes(s_ref),
                "collectives": results[0.0][2], "collectives_whole_leaves": results[None][2],
                "state_balanced_by_state": results["state"][1] if "state" in results else None,
                "bf16": bf16 if name == "shampoo" else None, "compiled": compiled}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request) -> list[dict]:
    return spawn_ranks(worker, world_size=request.param, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", list(TXS))
def test_split_leaves_equal_one_device(runs, name) -> None:
    for per_rank in runs:
        for (tx_name, seed), res in per_rank.items():
            if tx_name != name:
                continue
            assert res["error"] <= 1e-5, (name, seed, res["error"])
            if res["compiled"] is not None:     # Shampoo, world 2: the split plan compiled
                # (aot_eager, fullgraph) is one graph equal to the eager run
                assert res["compiled"]["frames"] == 1 and res["compiled"]["error"] <= 1e-6


@pytest.mark.timeout(700)
def test_blocked_and_elementwise_chains_match_whole_leaves_bit_for_bit(runs) -> None:
    """Shampoo's blocks and Adam's entries are computed on the same numbers either way."""
    for per_rank in runs:
        for (name, seed), res in per_rank.items():
            if name in ("shampoo", "shampoo_packed_newton", "adamw"):
                assert res["same_as_whole_leaves"], (name, seed)


@pytest.mark.timeout(700)
def test_collectives_per_step(runs) -> None:
    """Two all_to_all per step with or without segments; a layer-wise or factored statistic
    of a split leaf adds one batched all-reduce per hook call (the same every step)."""
    for per_rank in runs:
        for (name, _), res in per_rank.items():
            assert len(set(res["collectives"])) == 1
            if name in ("shampoo", "shampoo_packed_newton", "adamw"):
                assert res["collectives"] == res["collectives_whole_leaves"] == [2] * STEPS
            else:
                assert res["collectives"][0] > 2


@pytest.mark.timeout(700)
def test_shampoo_state_spreads_over_the_ranks(runs) -> None:
    """Whole leaves put the embedding's blocks on one rank; segments spread them."""
    world = len(runs)
    for seed in (0, 1):
        split = [r["shampoo", seed]["state"] for r in runs]
        whole = [r["shampoo", seed]["state_whole_leaves"] for r in runs]
        single = runs[0]["shampoo", seed]["single_device_state"]
        by_state = [r["shampoo", seed]["state_balanced_by_state"] for r in runs]
        assert max(split) < max(whole)
        assert max(split) <= (1 / world + 0.25) * single, (split, single)
        assert max(by_state) <= (1 / world + 0.15) * single, (by_state, single)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="across"):
        opttx.distributed.on_owners(opttx.chain(opttx.clip_by_global_norm(1.0),
                                                opttx.adamw(1e-2)), split_above_mb=1.0)
    with pytest.raises(ValueError, match="split_above_mb"):
        sharded(opttx.adamw(1e-2), split_above_mb=1.0)


@pytest.mark.timeout(700)
def test_updates_in_bf16_on_the_wire(runs) -> None:
    """communication_dtype=bf16: each rank's update piece is the float32 one rounded to bf16
    (relative error <= 2^-8), and the bytes of the return all_to_all halve."""
    for per_rank in runs:
        for seed in (0, 1):
            res = per_rank["shampoo", seed]["bf16"]
            assert res["rounded"] and res["worst"] <= 2.0**-8
            bytes32, bytes16 = res["bytes"]
            assert bytes16 < bytes32

