"""Tensor parallel x ZeRO: ``sharded(zero(tx, dp), specs)`` on a 2 x 2 mesh equals one device.

4 gloo ranks, rank = 2 * dp_index + tp_index: tensor-parallel groups {0, 1} and {2, 3}, data-
parallel groups {0, 2} and {1, 3}. Every rank holds its tensor-parallel shard of each
parameter (`local_shard`: uneven where the size does not divide) and the gradient of its
data-parallel replica's batch; the single-device run applies ``tx`` to the whole parameters
and the mean of the two replicas' gradients. As tests/test_zero.py, the ranks are spawned once
and loop over hypothesis-drawn shapes and specs (derandomized, so all ranks draw the same);
gradients are multiples of 1/64, so their mean is exact in float32.

Checked: the parameters after each of 5 steps (float32, 1e-5 relative), ZeRO stages 1 and 2;
the collectives per step (2 per chunk over the data-parallel group, plus one per statistic
across leaves; the tensor-parallel ones no more than ``sharded(tx)`` alone issues); both
shards of a parameter have the same owner; a compiled step is one graph and equals eager;
gradient accumulation (`opttx.MultiSteps` around ``zero``, inside ``sharded``) equals one step
on the mean gradient and communicates only on the last micro-step.
"""

from __future__ import annotations

import json
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import opttx
from opttx.distributed import CollectiveStats, Replicated, Shard, local_shard, on_owners, \
    sharded, zero
from opttx.tree import keystr, tree_flatten_with_path, tree_map
from test_distributed import _finish, _init, _spawn
from test_zero import TXS as ZERO_TXS

STEPS = 5
RTOL, ATOL = 1e-5, 1e-6
WORLD, TP, DP = 4, 2, 2
MIB = 1 << 20

# the transforms of tests/test_zero.py (same hyperparameters), and LARS
TXS: dict[str, Callable[[], opttx.GradientTransformation]] = {
    **{k: ZERO_TXS[k] for k in ("adamw", "adafactor", "came", "lamb")},
    "lars": lambda: opttx.lars(1e-2, weight_decay=0.01),
    **{k: ZERO_TXS[k] for k in ("clip_adamw", "galore_adamw", "shampoo")},
}
WHOLE = {"galore_adamw", "shampoo"}    # need whole matrices: on_owners over the TP group
CROSS_LEAF = {"clip_adamw": 1}         # statistics across leaves: one collective each

size = st.integers(1, 9)
dims = st.sampled_from([None, 0, 1])  # the tensor-parallel dim of a leaf (None: replicated)
cases = st.tuples(size, size, size, dims, dims, dims, st.sampled_from([None, 16, 160]),
                  st.integers(0, 2**16))


def _layout(draw: tuple) -> tuple[dict, dict, int | None, int]:
    """Shapes (an attention-like block: in and out projections, a 3-d head, a bias), the
    tensor-parallel dim of each leaf, the chunk capacity in bytes and a seed."""
    a, b, c, d_in, d_out, d_head, chunk, seed = draw
    shapes = {"w_in": (a, b), "w_out": (b, c), "head": (c, 2, a), "bias": (b,)}
    tp_dims = {"w_in": d_in, "w_out": d_out, "head": d_head, "bias": None}
    return shapes, tp_dims, chunk, seed


def _problem(shapes: dict, seed: int, steps: int = STEPS) -> tuple[dict, list[list[dict]]]:
    """Full params; per step, the full gradient of each data-parallel replica (dyadic)."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [[{k: (torch.randn(s, generator=gen) * 64).round() / 64 for k, s in shapes.items()}
              for _ in range(DP)] for _ in range(steps)]
    return params, grads


def _groups(rank: int) -> tuple[Any, Any]:
    """This rank's tensor-parallel and data-parallel groups (every rank creates all)."""
    tp = [dist.new_group([2 * i, 2 * i + 1]) for i in range(DP)]
    dp = [dist.new_group([j, j + 2]) for j in range(TP)]
    return tp[rank // 2], dp[rank % 2]


def _zero_kwargs(chunk: int | None) -> dict:
    if chunk is None:
        return {"chunk_size_mb": None, "min_chunk_size_mb": 16 / MIB,
                "search_range_mb": 512 / MIB}
    return {"chunk_size_mb": chunk / MIB}


def _distributed(name: str, tp: Any) -> opttx.GradientTransformation:
    return on_owners(TXS[name](), owner_group=tp) if name in WHOLE else TXS[name]()


def _run(name: str, draw: tuple, stage: int, tp: Any, dp: Any) -> dict:
    """``sharded(zero(tx, dp), specs)`` against ``tx`` on one device; returns the counts."""
    shapes, tp_dims, chunk, seed = _layout(draw)
    full, grads = _problem(shapes, seed)
    specs = {k: Replicated() if d is None else Shard(d, tp) for k, d in tp_dims.items()}
    shard = lambda tree: {k: local_shard(v, specs[k]) for k, v in tree.items()}  # noqa: E731
    dp_index = dist.get_rank() // 2
    zs, ts, alone = CollectiveStats(), CollectiveStats(), CollectiveStats()
    tx = sharded(zero(_distributed(name, tp), dp, stage=stage, stats=zs, **_zero_kwargs(chunk)),
                 specs, stats=ts)
    tp_only = sharded(_distributed(name, tp), specs, stats=alone)  # sharded(tx)'s TP collectives
    ref = TXS[name]()
    p, p_alone, p_ref = shard(full), shard(full), full
    s, s_alone, s_ref = tx.init(p), tp_only.init(p_alone), ref.init(full)
    counts = []
    for per_replica in grads:
        mean = tree_map(lambda *g: sum(g) / len(g), *per_replica)
        u, s_ref = ref.update(mean, s_ref, p_ref)
        p_ref = opttx.apply_updates(p_ref, u)
        for st_ in (zs, ts, alone):
            st_.reset()
        u, s = tx.update(shard(per_replica[dp_index]), s, p)
        p = opttx.apply_updates(p, u)
        u, s_alone = tp_only.update(shard(mean), s_alone, p_alone)
        p_alone = opttx.apply_updates(p_alone, u)
        counts.append((zs.collectives, ts.collectives, alone.collectives))
        for k in full:
            torch.testing.assert_close(p[k], local_shard(p_ref[k], specs[k]), rtol=RTOL,
                                       atol=ATOL, msg=lambda m, k=k: f"params {k}: {m}")
    return {"counts": counts, "owners": _held(s, list(full))}


def _held(state: Any, names: list[str]) -> list[str]:
    """The parameters this rank holds state tensors for."""
    paths = [keystr(k) for k, x in tree_flatten_with_path(state)[0]
             if isinstance(x, torch.Tensor) and x.ndim > 0]
    return sorted({n for n in names for p in paths if f"['{n}']" in p})


def _equivalence(rank: int, n_draws: int, results: dict) -> None:
    tp, dp = _groups(rank)
    results.setdefault("errors", [])
    results.setdefault("cases", {})

    @settings(max_examples=n_draws, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(draw=cases)
    def run(draw: tuple) -> None:
        every: list[Any] = [None] * WORLD
        dist.all_gather_object(every, json.dumps(draw))
        assert len(set(every)) == 1, f"ranks drew different cases: {every}"
        for name in TXS:
            for stage in (1, 2):
                key = f"{name}/stage{stage}"
                try:
                    results["cases"].setdefault(key, []).append(_run(name, draw, stage, tp, dp))
                except Exception:  # noqa: BLE001 - reported by the tests
                    results["errors"].append(f"{key}: {traceback.format_exc(limit=3)}\n"
                                             f"  case: {draw}")
    run()


def _compiled(rank: int, results: dict) -> None:
    """One compiled step of ``sharded(zero(adafactor))`` is one graph and equals eager."""
    tp, dp = _groups(rank)
    shapes, tp_dims, chunk, seed = _layout((6, 5, 3, 0, 1, None, 16, 7))
    full, grads = _problem(shapes, seed)
    specs = {k: Replicated() if d is None else Shard(d, tp) for k, d in tp_dims.items()}
    local = {k: local_shard(v, specs[k]) for k, v in full.items()}
    g = {k: local_shard(v, specs[k]) for k, v in grads[0][rank // 2].items()}

    def make() -> opttx.GradientTransformation:
        return sharded(zero(TXS["adafactor"](), dp, stage=2, **_zero_kwargs(chunk)), specs)
    tx_e, tx_c = make(), make()
    s_e, s_c = tx_e.init(local), tx_c.init(local)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(tx_c.update, backend=counter, fullgraph=True)
    for _ in range(3):
        u_e, s_e = tx_e.update(g, s_e, local)
        u_c, s_c = step(g, s_c, local)
    results["compiled"] = {"frames": counter.frame_count, "equal": all(
        torch.allclose(u_e[k], u_c[k], rtol=1e-6, atol=1e-7) for k in u_e)}


def _accumulated(rank: int, results: dict) -> None:
    """Gradient accumulation on the 2 x 2 mesh: ``sharded(MultiSteps(zero(tx, dp), k))`` over
    k micro-steps equals one single-device step on the mean of all k x dp gradients, and
    communicates (ZeRO chunks and TP statistics) only on the k-th micro-step, besides the
    boundary's agreement."""
    tp, dp = _groups(rank)
    k = 3
    shapes, tp_dims, chunk, seed = _layout((7, 5, 4, 0, 1, None, 160, 11))
    full, grads = _problem(shapes, seed, 2 * k)     # 2 k micro-steps x DP replicas
    specs = {n: Replicated() if d is None else Shard(d, tp) for n, d in tp_dims.items()}
    shard = lambda tree: {n: local_shard(v, specs[n]) for n, v in tree.items()}  # noqa: E731
    out = {}
    for name in ("adamw", "adafactor", "clip_adamw"):
        zs, ts = CollectiveStats(), CollectiveStats()
        tx = sharded(opttx.MultiSteps(zero(TXS[name](), dp, stats=zs, **_zero_kwargs(chunk)),
                                      k).gradient_transformation(), specs, stats=ts)
        ref = TXS[name]()
        p, p_ref = shard(full), full
        s, s_ref = tx.init(p), ref.init(full)
        counts, worst = [], 0.0
        for step in range(0, len(grads), k):
            micro = grads[step:step + k]
            mean = tree_map(lambda *g: sum(g) / len(g), *[g for m in micro for g in m])
            u, s_ref = ref.update(mean, s_ref, p_ref)
            p_ref = opttx.apply_updates(p_ref, u)
            for per_replica in micro:
                zs.reset(), ts.reset()
                u, s = tx.update(shard(per_replica[rank // 2]), s, p)
                p = opttx.apply_updates(p, u)
                counts.append(zs.collectives + ts.collectives)
            for n in full:
                expected = local_shard(p_ref[n], specs[n])
                worst = max(worst, float(((p[n] - expected).abs().max() /
                                          expected.abs().max().clamp(min=1e-30))))
        out[name] = {"counts": counts, "worst": worst}
    results["accumulated"] = out


def _worker(rank: int, world: int, store: str, out: str, n_draws: int) -> None:
    _init(rank, world, store)
    results: dict[str, Any] = {}
    _equivalence(rank, n_draws, results)
    _compiled(rank, results)
    _accumulated(rank, results)
    _finish(out, rank, results)


@pytest.fixture(scope="module")
def mesh4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_worker, WORLD, tmp_path_factory.mktemp("tpzero"), 3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(TXS))
def test_tp_zero_equals_single_device(mesh4: list[dict], name: str) -> None:
    """tp 2 x dp 2, stages 1 and 2, drawn shapes, specs and chunk sizes: the parameters after
    each of 5 steps equal the single-device run on the mean gradient."""
    for rank, res in enumerate(mesh4):
        errors = [e for e in res["errors"] if e.startswith(f"{name}/")]
        assert not errors, f"rank {rank}:\n" + "\n".join(errors)
        assert {f"{name}/stage1", f"{name}/stage2"} <= set(res["cases"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(TXS))
def test_tp_zero_collectives(mesh4: list[dict], name: str) -> None:
    """Per step: ZeRO's collectives are 2 per chunk plus one per statistic across leaves, the
    same every step; the tensor-parallel ones no more than `sharded(tx)` alone issues."""
    for res in mesh4:
        for stage in (1, 2):
            for case in res["cases"][f"{name}/stage{stage}"]:
                counts = case["counts"]
                assert len({c[0] for c in counts}) == 1, counts
                zero_count = counts[0][0] - CROSS_LEAF.get(name, 0)
                assert zero_count >= 2 and zero_count % 2 == 0, counts
                assert all(t <= a for _, t, a in counts), counts


@pytest.mark.timeout(600)
def test_tp_peers_own_the_same_parameters(mesh4: list[dict]) -> None:
    """Both tensor-parallel shards of a parameter are owned at the same data-parallel index:
    the ranks of a TP group hold state for the same parameters (decided on global shapes);
    under `on_owners` each of those parameters' state is on one rank of the TP group."""
    for key in mesh4[0]["cases"]:
        for i in range(len(mesh4[0]["cases"][key])):
            for dp_index in range(DP):
                a, b = (mesh4[2 * dp_index + t]["cases"][key][i]["owners"] for t in range(TP))
                if key.split("/")[0] in WHOLE:
                    assert not set(a) & set(b), (key, i, a, b)
                else:
                    assert a == b, (key, i, a, b)


@pytest.mark.timeout(600)
def test_tp_zero_compiles_to_one_graph(mesh4: list[dict]) -> None:
    for res in mesh4:
        assert res["compiled"] == {"frames": 1, "equal": True}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["adamw", "adafactor", "clip_adamw"])
def test_accumulation_communicates_on_the_last_micro_step(mesh4: list[dict], name: str) -> None:
    """``sharded(MultiSteps(zero(tx, dp), 3))`` on tp 2 x dp 2 equals one single-device step on
    the mean of the 3 x 2 micro-batch gradients (float32, 1e-5 of each leaf's magnitude), with
    one collective on the first two micro-steps of each step: the all-reduce of two numbers
    by which the ranks agree on the accumulation's boundary (`MultiSteps`)."""
    for res in mesh4:
        case = res["accumulated"][name]
        assert case["worst"] <= RTOL, case
        counts = case["counts"]
        assert len(counts) == 6 and counts[0] == counts[1] == counts[3] == counts[4] == 1, counts
        assert counts[2] == counts[5] > 0, counts
