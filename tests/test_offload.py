"""opttx.distributed.offload on one process: the placement plan, every chunkable chain of the
conformance registry bitwise equal to the transform without offload, the refusals, the
wrappers around and inside it, checkpoints between offloaded runs and runs without offload,
and (CUDA only) where the state lives and which stream the copies take.

On a CPU-only machine "host" and "device" are the same memory: what these tests check there
is the machinery (chunks, staging copies, the maps between the whole state and each chunk's,
the placement and its bookkeeping) and that it changes no number; the CUDA test at the end
checks the placement and the streams where a GPU is present. The world-2 tests (`zero` with
``offload``) are in tests/test_offload_distributed.py.
"""

from __future__ import annotations

import io

import pytest
import torch

import opttx
from opttx.base import traits_of
from opttx.distributed import (OffloadStats, check_offloadable, load_state_dict, offload,
                               offload_plan, place_chunks, state_dict)
from opttx.testing import assert_trees_close, gradient_stream, run_transform
from opttx.tree import tree_leaves

from registry import CASES, Case

MIB = 1 << 20
CHUNK_MB = 200 / MIB            # 200-byte chunks: a few leaves per chunk, several chunks
STEPS = 6


def leaves_0d_to_4d(case: Case | None = None, zero_dim: bool = True) -> dict[str, torch.Tensor]:
    """The conformance suite's leaves: 0-D to 4-D, two matrices of one shape, a tall one."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"s": (), "b": (5,), "w": (6, 5), "v": (6, 5), "tall": (7, 3), "t": (2, 3, 4),
              "q": (2, 3, 2, 2)}
    if case is not None and case.matrices_only:
        del shapes["s"], shapes["b"]
    if not zero_dim:
        shapes.pop("s", None)
    return {k: torch.randn(s, generator=gen, dtype=torch.float64).float()
            for k, s in shapes.items()}


def chunk_count(params: dict, tx: opttx.GradientTransformation) -> int:
    return len(offload_plan(params, tx, 0.5, chunk_size_mb=CHUNK_MB).chunks)


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, fraction, expected", [
    ([4, 4, 4, 4], 0.0, [False, False, False, False]),
    ([4, 4, 4, 4], 0.25, [False, False, False, True]),
    ([4, 4, 4, 4], 0.5, [False, False, True, True]),
    ([4, 4, 4, 4], 0.6, [False, True, True, True]),     # at least the fraction: 12 of 16
    ([4, 4, 4, 4], 1.0, [True, True, True, True]),
    ([10, 1, 1], 0.1, [False, True, True]),              # 2 of 12 >= 1.2
    ([10, 1, 1], 0.2, [True, True, True]),               # 2 < 2.4: the large one too
    ([0, 0], 0.5, [False, False]),                       # no state: nothing to move ...
    ([0, 0], 1.0, [True, True]),                         # ... except when all is asked for
])
def test_a_fraction_offloads_the_fewest_last_chunks_holding_it(sizes, fraction, expected):
    assert place_chunks(sizes, fraction=fraction) == expected


@pytest.mark.parametrize("sizes, budget, expected", [
    ([4, 4, 4, 4], 9, [False, False, True, True]),
    ([4, 4, 4, 4], 16, [False, False, False, False]),
    ([4, 4, 4, 4], 0, [True, True, True, True]),
    ([20, 1, 1], 5, [True, True, True]),      # the first chunk does not fit: all on the host
])
def test_a_budget_keeps_the_first_chunks_that_fit_on_the_device(sizes, budget, expected):
    assert place_chunks(sizes, budget_bytes=budget) == expected


def test_place_chunks_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        place_chunks([1, 2])
    with pytest.raises(ValueError, match="exactly one"):
        place_chunks([1, 2], fraction=0.5, budget_bytes=3)
    with pytest.raises(ValueError, match="fraction"):
        place_chunks([1, 2], fraction=1.5)


def test_the_plan_counts_the_transforms_state_bytes() -> None:
    """AdamW keeps two float32 moments: 8 bytes per parameter element; Adafactor's factored
    second moment of a (64, 32) matrix is 64 + 32 floats, of a vector the vector; the last
    chunks go to the host: the fewest holding half of the state."""
    params = {"w": torch.empty(64, 32), "b": torch.empty(32), "u": torch.empty(32, 64)}
    plan = offload_plan(params, opttx.adamw(1e-3), 0.5, chunk_size_mb=8 * 1024 / MIB)
    assert [c.leaves for c in plan.chunks] == [(0,), (1,), (2,)]
    assert [c.state_bytes for c in plan.chunks] == [8 * 2048, 8 * 32, 8 * 2048]
    assert [c.on_host for c in plan.chunks] == [False, True, True]
    assert plan.host_bytes == 8 * 2080 and plan.device_bytes == 8 * 2048
    assert "host" in plan.summary() and "['w']" in plan.summary()
    factored = offload_plan(params, opttx.adafactor(1e-3, min_dim_size_to_factor=2), 1.0,
                            chunk_size_mb=1.0)
    (chunk,) = factored.chunks
    assert chunk.state_bytes == 4 * ((64 + 32) + 32 + (32 + 64))
    assert factored.host_fraction == 1.0
    # without a transform the parameters' bytes stand for the state
    assert offload_plan(params, None, 1.0, chunk_size_mb=1.0).chunks[0].state_bytes == \
        4 * (64 * 32 + 32 + 32 * 64)


def test_auto_with_a_budget_and_without_one() -> None:
    params = {f"l{i}": torch.empty(256) for i in range(4)}        # 1 KiB each, 2 KiB of state
    budget = 5 * 1024 / MIB                                       # two chunks' state fit
    plan = offload_plan(params, opttx.adam(1e-3), "auto", chunk_size_mb=1024 / MIB,
                        device_budget_mb=budget)
    assert [c.on_host for c in plan.chunks] == [False, False, True, True]
    assert plan.budget_bytes == 5 * 1024 and plan.device_bytes == 4096
    unmeasured = offload_plan(params, opttx.adam(1e-3), "auto", chunk_size_mb=1024 / MIB)
    assert all(c.on_host for c in unmeasured.chunks)
    with pytest.raises(ValueError, match="device_budget_mb goes with fraction='auto'"):
        offload_plan(params, opttx.adam(1e-3), 0.5, device_budget_mb=1.0)


def test_auto_measures_at_the_first_step_and_moves_what_fits() -> None:
    """With a fake probe (peak 1000 bytes in use of 10,000): the budget is 90 % of the
    capacity less the peak, 8,000 bytes; the first chunks whose Adam state fits move to the
    device after the warm-up step, the numbers stay bitwise those of Adam."""
    params = {f"l{i}": torch.randn(128, generator=torch.Generator().manual_seed(i))
              for i in range(8)}                                # 1 KiB of Adam state each
    stats = OffloadStats()
    tx = offload(opttx.adam(1e-2), "auto", chunk_size_mb=512 / MIB, stats=stats,
                 memory_probe=lambda: (1000, 10_000))
    grads = gradient_stream(params, 4, seed=2)
    state = tx.init(params)
    assert all(c.on_host for c in stats.plan.chunks)
    expected = run_transform(opttx.adam(1e-2), params, grads)
    got = run_transform(tx, params, grads, state=state)
    assert_trees_close(got, expected, rtol=0.0, what="auto")
    on_host = [c.on_host for c in stats.plan.chunks]
    assert on_host == place_chunks([1024] * 8, budget_bytes=8000) == [False] * 7 + [True]
    assert stats.plan.budget_bytes == 8000
    stats.reset()
    tx.update(grads[0], got[1], got[0])
    assert stats.host_chunk_steps == 1 and stats.device_chunk_steps == 7


# ---------------------------------------------------------------------------------------------
# the registry, bitwise
# ---------------------------------------------------------------------------------------------


def _leaf_by_leaf(case: Case) -> bool:
    """What the traits say: every link per-leaf, or only stateless ones ahead of them."""
    try:
        check_offloadable(case.make())
    except ValueError:
        return False
    return True


RUN = [c for c in CASES if c.distributed is None]
# refused at init, not from the traits alone: a statistic across leaves that keeps state
# (Prodigy's estimate, the injected max_norm of a global-norm clip at the head of
# inject_all_hyperparams's chain; muon_clip's QK-clip reads the whole tree after the step),
# and flatten's state packed across leaves. apply_if_finite is declared to wrap its inner
# transform (opttx.extend.declare's wraps): offload runs the chunks inside it
REFUSED_AT_INIT = {"prodigy", "scale_by_prodigy", "flatten", "inject_all_hyperparams",
                   "muon_clip"}


def test_the_traits_accept_every_registry_entry_that_is_not_refused_at_init() -> None:
    """Every entry's traits pass `check_offloadable` except those taking statistics across
    leaves; the entries whose traits pass but that init refuses are those above."""
    refused = {c.name for c in RUN if not _leaf_by_leaf(c)}
    assert refused == set()          # the across-leaves ones lead their chain: checked at init
    assert {c.name for c in RUN if traits_of(c.make()).across_leaves} == {
        "prodigy", "scale_by_prodigy", "apply_if_finite", "apply_if_finite/check_state",
        "clip_by_global_norm", "guide/scale_to_global_rms", "inject_all_hyperparams"}


def mixed_fraction(params: dict, tx: opttx.GradientTransformation) -> float | None:
    """A fraction that puts some chunks on the host and some on the device (None for a
    transform without state: every fraction below 1 keeps all of it on the device)."""
    for fraction in (0.5, 0.3, 0.7, 0.1, 0.9):
        plan = offload_plan(params, tx, fraction, chunk_size_mb=CHUNK_MB)
        if 0 < sum(c.on_host for c in plan.chunks) < len(plan.chunks):
            return fraction
    return None


# transforms that declare Traits.batched_across_leaves (orthogonalized in one batched product
# per shape, across leaves): a chunk's batch is smaller, and rounds differently
# (test_orthogonalized_one_matrix_at_a_time_offloads_bitwise)


@pytest.mark.parametrize("case", RUN, ids=[c.name for c in RUN])
def test_offloaded_equals_not_offloaded_bitwise(case: Case) -> None:
    """In chunks of about 50 floats on 0-D to 4-D leaves, all of the state on the host, and
    part of it (a fraction that splits the chunks, when the transform has state): 6 steps
    give the parameters and state of ``tx`` bit for bit (to 1e-5 where matrices are
    orthogonalized in batches across leaves: ``Traits.batched_across_leaves``), through the
    functional path and the donating one (what `opttx.Optimizer` runs). A chain that cannot
    run chunk by chunk is refused at init with its reason."""
    params = leaves_0d_to_4d(case)
    grads = gradient_stream(params, STEPS, seed=3)
    if case.name in REFUSED_AT_INIT:
        with pytest.raises(ValueError, match="cannot run chunk by chunk|does not match"):
            offload(case.make(), 0.5, chunk_size_mb=CHUNK_MB).init(params)
        return
    assert chunk_count(params, case.make()) >= 3
    expected = run_transform(case.make(), params, grads)
    rtol = 1e-5 if traits_of(case.make()).batched_across_leaves else 0.0
    chunked = check_offloadable(case.make()) < len(opttx.chain_links(case.make()) or (0,))
    fractions = [1.0] + [f for f in [mixed_fraction(params, case.make())] if f is not None]
    for fraction in fractions:
        stats = OffloadStats()
        tx = offload(case.make(), fraction, chunk_size_mb=CHUNK_MB, stats=stats)
        got = run_transform(tx, params, grads)
        assert_trees_close(got, expected, rtol=rtol, what=f"{case.name} offloaded {fraction}")
        host = sum(c.on_host for c in stats.plan.chunks)
        assert host == len(stats.plan.chunks) if fraction == 1.0 else 0 < host
        if chunked:                           # the host chunks ran their update there
            assert stats.host_chunk_steps == host * STEPS
        with opttx.donating():
            got = run_transform(offload(case.make(), fraction, chunk_size_mb=CHUNK_MB),
                                params, grads)
        assert_trees_close(got, expected, rtol=rtol,
                           what=f"{case.name} offloaded {fraction}, donated")


# per-leaf transforms that read their leaves' sizes in Python: sorted by size (adafactor,
# kron), blocks of quantized states (adamw_8bit), projections and eigenbases of matrices
COMPILED_PER_LEAF = ["adafactor", "adamw_8bit", "galore_adamw", "kron", "soap"]


@pytest.mark.parametrize("name", COMPILED_PER_LEAF)
def test_compiled_host_step_of_per_leaf_transforms(name: str, monkeypatch) -> None:
    """``compile=True`` with ``layout="leaves"`` traces these transforms' steps in one graph
    per chunk (``fullgraph``): their shapes are static there (with symbolic sizes Dynamo
    refused to sort Adafactor's axes and failed on the others' fake-tensor calls). Traced
    with Dynamo's eager backend (Inductor's builds are not what this checks), the numbers are
    those of the eager host step."""
    compile_ = torch.compile

    def eager_backend(fn, **kwargs):
        kwargs.pop("options", None)
        return compile_(fn, **kwargs, backend="eager")
    monkeypatch.setattr(torch, "compile", eager_backend)
    case = next(c for c in CASES if c.name == name)
    params = leaves_0d_to_4d(case)
    grads = gradient_stream(params, 3, seed=5)
    expected = run_transform(offload(case.make(), 1.0, chunk_size_mb=CHUNK_MB), params, grads)
    stats = OffloadStats()
    tx = offload(case.make(), 1.0, chunk_size_mb=CHUNK_MB, compile=True, stats=stats)
    got = run_transform(tx, params, grads)
    assert stats.host_chunk_steps == len(stats.plan.chunks) * 3
    assert_trees_close(got, expected, rtol=1e-5, atol=1e-6, what=f"{name} compiled")


def test_orthogonalized_one_matrix_at_a_time_offloads_bitwise() -> None:
    """The Muon family orthogonalizes every matrix of one shape in one batched product, across
    leaves: a chunk batches fewer matrices than the whole tree, and a batched product rounds
    with its batch (measured up to 5e-6 absolute on Polar Express, 1.2e-7 on muon over 6
    steps). One matrix at a time (``batched=False``), offloading is bitwise."""
    params = leaves_0d_to_4d(zero_dim=False)
    params = {k: v for k, v in params.items() if v.ndim >= 2}
    grads = gradient_stream(params, STEPS, seed=3)
    make = lambda: opttx.orthogonalize(batched=False)     # noqa: E731
    expected = run_transform(make(), params, grads)
    got = run_transform(offload(make(), 1.0, chunk_size_mb=CHUNK_MB), params, grads)
    assert_trees_close(got, expected, rtol=0.0, what="one matrix at a time")


def test_a_partitions_step_count_comes_from_a_chunk_that_holds_its_leaves() -> None:
    """muon's 8-bit momentum keeps its step count only where the muon partition has leaves: a
    chunk of vectors alone holds none. The count comes back from a chunk that holds it, at
    every fraction (it stayed 0 when taken from the first device chunk)."""
    params = {"b": torch.randn(12), "c": torch.randn(12), "w": torch.randn(6, 5)}
    grads = gradient_stream(params, STEPS, seed=5)
    make = lambda: opttx.muon(1e-2, momentum_8bit=True)     # noqa: E731
    expected = run_transform(make(), params, grads)
    for fraction in (0.0, 0.3, 0.5, 1.0):
        got = run_transform(offload(make(), fraction, chunk_size_mb=CHUNK_MB), params, grads)
        assert_trees_close(got, expected, rtol=0.0, what=f"fraction {fraction}")


ELEMENTWISE = [c for c in RUN if traits_of(c.make()).elementwise
               and not traits_of(c.make()).across_leaves]
# the mask of freeze selects matrices by their number of dims: in a flat chunk (one 1-D
# leaf) it selects nothing, as documented for layout="flat" and opttx.flatten
SHAPE_MASKS = {"freeze"}


@pytest.mark.parametrize("case", ELEMENTWISE, ids=[c.name for c in ELEMENTWISE])
def test_flat_layout_equals_per_leaf_on_leaves_of_one_dim_or_more(case: Case) -> None:
    """``layout="flat"``: each chunk one flat vector. On leaves of 1 to 4 dims the results
    are bitwise those of ``tx``; chains whose state over one flat vector is not laid out as
    over the leaves (masks or partitions that keep state, a mask function that reads dict
    keys, per-leaf flags) are refused at init; a stateless mask by shape is the documented
    exception (it differs)."""
    params = leaves_0d_to_4d(case, zero_dim=False)
    grads = gradient_stream(params, STEPS, seed=4)
    expected = run_transform(case.make(), params, grads)
    tx = offload(case.make(), 0.5, chunk_size_mb=CHUNK_MB, layout="flat")
    try:
        got = run_transform(tx, params, grads)
    except ValueError as e:
        assert "cannot be run chunk by chunk" in str(e) and "layout='leaves'" in str(e)
        return
    if case.name in SHAPE_MASKS:
        assert not torch.equal(got[0]["w"], expected[0]["w"])
        return
    assert_trees_close(got, expected, rtol=0.0, what=f"{case.name} flat")


def test_flat_layout_on_a_zero_dim_leaf_is_within_two_ulp() -> None:
    """Eager kernels round a 0-dim tensor (scalar path) and the same element inside a flat
    vector (vectorized path, fused multiply-adds) differently in some chains: measured
    1.4e-7 relative for ema with Nesterov over 6 steps, 0 for adamw."""
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, STEPS, seed=4)
    for make, bitwise in [(lambda: opttx.adamw(1e-2, weight_decay=0.1), True),
                          (lambda: opttx.ema(0.9, nesterov=True), False)]:
        expected = run_transform(make(), params, grads)
        got = run_transform(offload(make(), 0.5, chunk_size_mb=CHUNK_MB, layout="flat"),
                            params, grads)
        assert_trees_close(got, expected, rtol=0.0 if bitwise else 2.4e-7, atol=0.0)


def test_bfloat16_parameters_keep_float32_state_and_the_same_numbers() -> None:
    params = {k: v.bfloat16() for k, v in leaves_0d_to_4d().items()}
    grads = gradient_stream(params, STEPS, seed=5)
    expected = run_transform(opttx.adamw(1e-2, weight_decay=0.1), params, grads)
    got = run_transform(offload(opttx.adamw(1e-2, weight_decay=0.1), 0.5,
                                chunk_size_mb=CHUNK_MB), params, grads)
    assert_trees_close(got, expected, rtol=0.0)
    assert {x.dtype for x in tree_leaves(got[1]) if x.is_floating_point()} == {torch.float32}


def test_bytes_copied_per_step() -> None:
    """All on the host, with params: each step copies 4 bytes of gradient and 4 of parameter
    per element down and 4 bytes of update up; nothing at fraction 0."""
    params = leaves_0d_to_4d()
    n = sum(x.numel() for x in params.values())
    g = gradient_stream(params, 1, seed=6)[0]
    for fraction, down, up in [(1.0, 8 * n, 4 * n), (0.0, 0, 0)]:
        stats = OffloadStats()
        tx = offload(opttx.lion(1e-3), fraction, chunk_size_mb=CHUNK_MB, stats=stats)
        tx.update(g, tx.init(params), params)
        assert (stats.bytes_to_host, stats.bytes_to_device, stats.steps) == (down, up, 1)


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------


def test_a_chain_with_a_stateful_statistic_across_leaves_is_refused_with_its_reason() -> None:
    params = leaves_0d_to_4d()
    with pytest.raises(ValueError, match=r"takes a statistic across leaves.*apply_if_finite\("
                                         r"offload\(adamw"):
        offload(opttx.prodigy(1.0), 0.5).init(params)
    with pytest.raises(ValueError, match="link 1 of the chain cannot run chunk by chunk"):
        offload(opttx.chain(opttx.scale_by_adam(),
                            opttx.apply_if_finite(opttx.sgd(1e-2), 3)), 0.5)


def test_undeclared_or_whole_tensor_transforms_are_refused() -> None:
    params = {"w": torch.ones(3, 2)}

    def init(p):
        return {"m": torch.zeros(3, 2)}

    def update(u, s, p=None):
        return u, s
    with pytest.raises(ValueError, match=r"Traits.per_leaf"):
        offload(opttx.GradientTransformation(init, update), 1.0).init(params)
    with pytest.raises(ValueError, match="layout='flat' needs an element-wise chain"):
        offload(opttx.adafactor(1e-2), 1.0, layout="flat")
    with pytest.raises(ValueError, match="packed across parameters"):
        offload(opttx.flatten(opttx.adamw(1e-2)), 0.5, chunk_size_mb=CHUNK_MB).init(
            leaves_0d_to_4d())


def test_bad_arguments_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="fraction"):
        offload(opttx.adam(1e-3), 1.5)
    with pytest.raises(ValueError, match="fraction"):
        offload(opttx.adam(1e-3), "half")
    with pytest.raises(ValueError, match="device_budget_mb goes with"):
        offload(opttx.adam(1e-3), 0.5, device_budget_mb=10)
    with pytest.raises(ValueError, match="layout"):
        offload(opttx.adam(1e-3), 0.5, layout="rows")
    with pytest.raises(TypeError, match="forget to call"):
        offload(opttx.adam, 0.5)


# ---------------------------------------------------------------------------------------------
# clipping, apply_if_finite, MultiSteps, Optimizer
# ---------------------------------------------------------------------------------------------


def test_global_norm_clipping_inside_and_outside() -> None:
    """clip_by_global_norm at the head of the chain runs on every leaf first; in front of an
    offloaded transform it is an ordinary link: both bitwise equal to the plain chain."""
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, STEPS, seed=7)

    def plain():
        return opttx.chain(opttx.clip_by_global_norm(0.5), opttx.adamw(1e-2))
    expected = run_transform(plain(), params, grads)
    inside = offload(plain(), 0.5, chunk_size_mb=CHUNK_MB)
    assert_trees_close(run_transform(inside, params, grads), expected, rtol=0.0)
    outside = opttx.chain(opttx.clip_by_global_norm(0.5),
                          offload(opttx.adamw(1e-2), 0.5, chunk_size_mb=CHUNK_MB))
    assert_trees_close(run_transform(outside, params, grads), expected, rtol=0.0)


@pytest.mark.parametrize("check_state", [False, True])
def test_apply_if_finite_around_offload_skips_the_same_steps(check_state: bool) -> None:
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, STEPS, seed=8)
    grads[2] = dict(grads[2], w=torch.full((6, 5), float("nan")))
    grads[3] = dict(grads[3], b=torch.full((5,), float("inf")))
    expected = run_transform(opttx.apply_if_finite(opttx.adam(1e-2), 3,
                                                   check_state=check_state), params, grads)
    tx = opttx.apply_if_finite(offload(opttx.adam(1e-2), 0.5, chunk_size_mb=CHUNK_MB), 3,
                               check_state=check_state)
    got = run_transform(tx, params, grads)
    assert_trees_close(got, expected, rtol=0.0)
    assert int(got[1].total_notfinite) == 2


def test_multi_steps_around_and_inside_offload() -> None:
    """MultiSteps(offload(adamw)) accumulates on the device and steps the chunks every third
    call; offload(MultiSteps(adamw)) keeps the accumulators in the chunks too. Both equal
    MultiSteps(adamw) bitwise."""
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, 9, seed=9)
    expected = run_transform(opttx.MultiSteps(opttx.adamw(1e-2), 3).gradient_transformation(),
                             params, grads)
    around = opttx.MultiSteps(offload(opttx.adamw(1e-2), 0.5, chunk_size_mb=CHUNK_MB),
                              3).gradient_transformation()
    assert_trees_close(run_transform(around, params, grads), expected, rtol=0.0)
    inside = offload(opttx.MultiSteps(opttx.adamw(1e-2), 3).gradient_transformation(), 0.5,
                     chunk_size_mb=CHUNK_MB)
    assert_trees_close(run_transform(inside, params, grads), expected, rtol=0.0)


def test_optimizer_over_an_offloaded_transform() -> None:
    """opttx.Optimizer (in place, donated state) over a small model: the parameters of
    Optimizer(adamw) bit for bit, with the injected learning rate changed through the param
    groups (it is shared state: every chunk reads it)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(5)]
    results = []
    def adamw():
        return opttx.inject_hyperparams(opttx.adamw)(learning_rate=1e-2, weight_decay=0.1)
    for tx in [adamw(), offload(adamw(), 0.5, chunk_size_mb=256 / MIB)]:
        m = model()
        opt = opttx.Optimizer(m.parameters(), tx)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if i == 3:
                for group in opt.param_groups:
                    group["lr"] = 5e-3
            opt.step()
        results.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------------------------------------
# overlap with backward, and the delayed update
# ---------------------------------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train_functionally(tx: opttx.GradientTransformation, steps: int = 6,
                        pass_clones: bool = False) -> list[torch.Tensor]:
    """The functional loop over the model's own parameters (hookable), donating."""
    model = _mlp()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen))
            for _ in range(steps)]
    params = dict(model.named_parameters())
    state = tx.init(params)
    for x, y in data:
        for p in params.values():
            p.grad = None
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = {k: (p.grad.clone() if pass_clones else p.grad) for k, p in params.items()}
        with torch.no_grad(), opttx.donating():
            updates, state = tx.update(grads, state, params)
            opttx.apply_updates_(params, updates)
    return [p.detach().clone() for p in params.values()]


def test_overlap_starts_the_host_steps_in_backward_with_the_same_numbers() -> None:
    """overlap=True: each host chunk's copy and step start from backward's hooks when its
    gradients are there (counted), and the parameters are those of AdamW bit for bit; with
    gradients that are not the ``.grad`` tensors backward left (clones), the started steps
    are dropped and the chunks run in ``update``, with the same numbers."""
    expected = _train_functionally(opttx.adamw(1e-2, weight_decay=0.1))
    stats = OffloadStats()
    tx = offload(opttx.adamw(1e-2, weight_decay=0.1), 0.5, chunk_size_mb=300 / MIB,
                 overlap=True, stats=stats)
    got = _train_functionally(tx)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    host = sum(c.on_host for c in stats.plan.chunks)
    assert host >= 2 and stats.started_in_backward == host * 6
    assert stats.host_chunk_steps == host * 6
    stats.reset()
    tx = offload(opttx.adamw(1e-2, weight_decay=0.1), 0.5, chunk_size_mb=300 / MIB,
                 overlap=True, stats=stats)
    got = _train_functionally(tx, pass_clones=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert stats.host_chunk_steps == 2 * host * 6      # started in backward, then again


def test_overlap_drops_the_steps_started_before_a_checkpoint_was_loaded_into_the_state(
        ) -> None:
    """A checkpoint loaded into the live state in place after backward started the host
    chunks' steps (from the values it replaced): ``update`` drops those steps (the state's
    version counters moved) and runs the chunks itself, from the loaded values, equal to the
    transform without overlap on them."""
    model = _mlp()
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen))
            for _ in range(4)]
    stats = OffloadStats()

    def make(**kw):
        return offload(opttx.adamw(1e-2, weight_decay=0.1), 0.5, chunk_size_mb=300 / MIB,
                       **kw)
    tx = make(overlap=True, stats=stats)
    state, saved = tx.init(params), None
    for step, (x, y) in enumerate(data):
        for p in params.values():
            p.grad = None
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = {k: p.grad for k, p in params.items()}
        if step == 3:                  # the steps started; now the checkpoint goes in
            load_state_dict(state, saved, params)
            plain = make()
            expected = plain.update({k: g.clone() for k, g in grads.items()},
                                    load_state_dict(plain.init(params), saved, params),
                                    {k: p.detach() for k, p in params.items()})
        with torch.no_grad(), opttx.donating():
            updates, state = tx.update(grads, state, params)
            if step == 3:
                assert_trees_close((updates, state), expected, rtol=0.0)
            opttx.apply_updates_(params, updates)
        if step == 1:
            saved = _through_bytes(state_dict(state, params))
    host = sum(c.on_host for c in stats.plan.chunks)
    assert host >= 2 and stats.started_in_backward == host * 4   # step 3's too, then dropped


def test_overlap_with_the_master_copy_equals_the_master_copy_alone() -> None:
    """overlap=True with master_params=True: the steps started in backward write the chunk's
    second master buffer, which ``update`` swaps in when it takes them; the parameters equal
    those of master_params without overlap bit for bit, eagerly and compiled, and when the
    started steps are dropped (clones passed) the master is as if they never ran."""
    def master(**kw):
        return offload(opttx.adamw(1e-2, weight_decay=0.1), 0.5, chunk_size_mb=300 / MIB,
                       master_params=True, **kw)
    for compile in (False, True):
        expected = _train_functionally(master(compile=compile))
        stats = OffloadStats()
        got = _train_functionally(master(overlap=True, stats=stats, compile=compile))
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), compile
        host = sum(c.on_host for c in stats.plan.chunks)
        assert host >= 2 and stats.started_in_backward == host * 6
        assert stats.host_chunk_steps == host * 6          # every started step taken
        got = _train_functionally(master(overlap=True, compile=compile), pass_clones=True)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), compile


def test_tracing_is_refused_but_a_compile_on_the_worker_thread_is_not_tracing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile(fullgraph=True)`` of a step with offload inside is refused with the
    reason. Dynamo's "compiling" flag is one per process: while a host step compiles on
    offload's worker thread it is raised for the caller's thread too (set here by hand, as
    that compile leaves it), and the caller's eager ``update`` still runs (it refused itself
    before, and the overlap test with compile=True failed one run in two)."""
    params = {"w": torch.randn(4)}
    tx = offload(opttx.adamw(1e-2), 1.0)
    state = tx.init(params)
    with pytest.raises(Exception, match="offload runs eagerly"):
        torch.compile(lambda g, s, p: tx.update(g, s, p), fullgraph=True)(
            {"w": torch.randn(4)}, state, params)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    updates, _ = tx.update({"w": torch.ones(4)}, state, params)
    assert updates["w"].shape == (4,)


def test_overlap_refusals() -> None:
    with pytest.raises(ValueError, match="statistic across leaves"):
        offload(opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adam(1e-3)), overlap=True)
    with pytest.raises(ValueError, match="do not go together"):
        offload(opttx.adam(1e-3), overlap=True, delayed=True)
    with pytest.raises(ValueError, match="model's parameters themselves"):
        offload(opttx.adam(1e-3), overlap=True).init({"w": torch.ones(3)})


def test_the_delayed_update_applies_each_host_step_one_step_late() -> None:
    """delayed=True: at step t the host chunks' parameters move by AdamW's update computed
    at step t-1 (from that step's gradients and parameters; zero at the first step), the
    device chunks' by step t's own: bitwise the reference written out below."""
    gen = torch.Generator().manual_seed(2)
    params = {f"l{i}": torch.randn(16, 4, generator=gen) for i in range(6)}
    grads = gradient_stream(params, 7, seed=13)
    plan = offload_plan(params, opttx.adamw(1e-2), 0.5, chunk_size_mb=256 / MIB)
    host = {f"l{i}" for c in plan.chunks if c.on_host for i in c.leaves}
    assert 0 < len(host) < len(params)
    tx = opttx.adamw(1e-2, weight_decay=0.1)
    p_ref, s_ref = dict(params), tx.init(params)
    late = {k: torch.zeros_like(v) for k, v in params.items()}
    delayed = offload(opttx.adamw(1e-2, weight_decay=0.1), 0.5, chunk_size_mb=256 / MIB,
                      delayed=True)
    p, s = dict(params), delayed.init(params)
    for g in grads:
        u, s_ref = tx.update(g, s_ref, p_ref)
        p_ref = {k: p_ref[k] + (late[k] if k in host else u[k]) for k in p_ref}
        late = u
        updates, s = delayed.update(g, s, p)
        p = opttx.apply_updates(p, updates)
    assert_trees_close(p, p_ref, rtol=0.0)
    assert not torch.equal(p_ref[sorted(host)[0]], run_transform(tx, params, grads)[0][
        sorted(host)[0]])


def test_the_delayed_update_drops_its_step_in_flight_when_a_checkpoint_is_loaded() -> None:
    """opttx.Optimizer loads a state dict into its live buffers, so the state object stays
    the same: the step in flight (started before the load, from the replaced state) is
    dropped all the same (the state's tensors were written since: their version counters
    moved), and the next step equals that of an optimizer built afresh from the checkpoint
    (it once applied the stale step and wrote its moments over the loaded ones)."""
    def build(model):
        return opttx.Optimizer(model.parameters(), offload(opttx.adamw(1e-1), 1.0,
                                                          delayed=True))

    def step(model, opt):
        opt.zero_grad()
        model(torch.ones(2, 8)).square().sum().backward()
        opt.step()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = build(model)
    for _ in range(3):
        step(model, opt)
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    opt_sd = _through_bytes(opt.state_dict())
    for _ in range(3):
        step(model, opt)
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    step(model, opt)
    step(model, opt)
    fresh_model = torch.nn.Linear(8, 4)
    fresh_model.load_state_dict(model_sd)
    fresh = build(fresh_model)
    fresh.load_state_dict(opt_sd)
    step(fresh_model, fresh)
    step(fresh_model, fresh)
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    assert_trees_close(opt.tx_states, fresh.tx_states, rtol=0.0)


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


CHECKPOINTED = {
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9),
    "adamw_8bit": lambda: opttx.adamw_8bit(1e-2, min_size=8, block_size=8),
}


def _through_bytes(sd: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", list(CHECKPOINTED))
def test_checkpoints_move_between_offloaded_runs_and_runs_without(name: str) -> None:
    """A checkpoint of an offloaded run (half of the state on the host) has the keys of one
    without offload; it resumes without offload, and the reverse, and at another fraction,
    each bitwise equal to the run never interrupted."""
    make = CHECKPOINTED[name]
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, 2 * STEPS, seed=10)
    expected = run_transform(make(), params, grads)

    def offloaded(fraction):
        return offload(make(), fraction, chunk_size_mb=CHUNK_MB)
    for first, second in [(offloaded(0.5), make()), (make(), offloaded(0.5)),
                          (offloaded(0.5), offloaded(1.0))]:
        mid_params, mid_state = run_transform(first, params, grads[:STEPS])
        saved = _through_bytes(state_dict(mid_state, mid_params))
        template = second.init(params)
        assert saved.keys() == state_dict(template, params).keys()
        assert {k: set(v) for k, v in saved["state"].items()} == \
            {k: set(v) for k, v in state_dict(template, params)["state"].items()}
        resumed = load_state_dict(template, saved, mid_params)
        got = run_transform(second, mid_params, grads[STEPS:], state=resumed)
        assert_trees_close(got, expected, rtol=0.0, what=f"{name}: {first} -> {second}")


def test_a_state_without_init_is_adopted() -> None:
    """A fresh offloaded transform given a state it did not make (a restored one) plans its
    chunks from the first updates and places that state's chunks: the same numbers."""
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, STEPS, seed=11)
    mid_params, mid_state = run_transform(opttx.adamw(1e-2), params, grads[:3])
    expected = run_transform(opttx.adamw(1e-2), mid_params, grads[3:], state=mid_state)
    restored = torch.load(io.BytesIO(_saved(mid_state)), weights_only=True)
    got = run_transform(offload(opttx.adamw(1e-2), 0.5, chunk_size_mb=CHUNK_MB),
                        mid_params, grads[3:], state=restored)
    assert_trees_close(got, expected, rtol=0.0)


def _saved(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# master_params: the host chunks' parameters kept and stepped on the host
# ---------------------------------------------------------------------------------------------


MASTERED = {
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: opttx.lion(1e-3, weight_decay=0.1),
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9),
    "came": lambda: opttx.came(1e-2),
    "adamw_8bit": lambda: opttx.adamw_8bit(1e-2, min_size=8, block_size=8),
}


def _check_reached(got: dict, old: dict, new: dict, what: str) -> None:
    """``got`` (old + fl(new' - old) on the device) equals the master's ``new`` bitwise where
    the step stays within a factor 2 (Sterbenz: the difference is exact), and within one
    rounding of the difference elsewhere (a parameter crossing zero)."""
    for k in new:
        exact = (new[k] / old[k] >= 0.5) & (new[k] / old[k] <= 2.0)
        diff = (got[k] - new[k]).abs()
        assert torch.equal(got[k][exact], new[k][exact]), f"{what}: {k}"
        assert bool((diff <= (new[k] - old[k]).abs() * 2.0 ** -23).all()), f"{what}: {k}"


@pytest.mark.parametrize("name", list(MASTERED))
def test_master_params_reach_the_parameters_of_the_transform(name: str) -> None:
    """``master_params=True``, float32: the host chunks step their master copy in place and
    the device gets the updates reaching its values. Step by step, the state equals the
    transform's bitwise (it saw the same parameters), and the parameters do wherever a step
    stays within a factor 2, at every fraction and through the donating path."""
    make = MASTERED[name]
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, STEPS, seed=14)
    for fraction in (1.0, 0.5):
        for donate in (False, True):
            tx, ref = offload(make(), fraction, chunk_size_mb=CHUNK_MB, master_params=True), make()
            p, state = dict(params), tx.init(params)
            p_ref, s_ref = dict(params), ref.init(params)
            for step, g in enumerate(grads):
                with opttx.donating(donate):
                    u, state = tx.update(g, state, p)
                u_ref, s_ref = ref.update(g, s_ref, p_ref)
                new_ref = opttx.apply_updates(p_ref, u_ref)
                p = opttx.apply_updates(p, u)
                _check_reached(p, p_ref, new_ref, f"{name} {fraction} step {step}")
                assert_trees_close(state.inner, s_ref, rtol=0.0,
                                   what=f"{name} state, step {step}")
                # the state's master copy of the host chunks' leaves: their new values
                host = {k for k, x in state.master.items() if isinstance(x, torch.Tensor)}
                assert host and (fraction == 1.0) == (host == set(params)), host
                for k in host:
                    assert torch.equal(state.master[k], new_ref[k]), (name, k, step)
                assert _all_started(state)
                p, p_ref = new_ref, new_ref     # the next step from the same parameters


def test_master_params_keep_bfloat16_updates_below_half_an_ulp() -> None:
    """bfloat16 parameters: the master is float32, so the parameters are the float32 run's
    rounded to bfloat16 (AdamW from the same bfloat16 gradients, widened to float32: the
    update is not rounded to bfloat16 before the master takes it), and steps of 1e-3 on
    parameters of magnitude 1 to 2 (half a bf16 ulp: 3.9e-3) add up to moves that the
    parameters updated in bfloat16 lose."""
    gen = torch.Generator().manual_seed(15)
    params = {"w": (1 + torch.rand(8, 16, generator=gen)).bfloat16(),
              "b": (1 + torch.rand(16, generator=gen)).bfloat16()}
    grads = gradient_stream(params, STEPS, seed=15)
    make = lambda: opttx.adamw(1e-3, weight_decay=0.1)     # noqa: E731
    stats = OffloadStats()
    tx = offload(make(), 1.0, master_params=True, stats=stats)
    got = run_transform(tx, params, grads)
    wide = {k: v.float() for k, v in params.items()}
    wide_grads = [{k: v.float() for k, v in g.items()} for g in grads]
    reference = run_transform(make(), wide, wide_grads, state=make().init(params))
    assert_trees_close(got[1].inner, reference[1], rtol=0.0)
    for k in params:
        assert torch.equal(got[0][k], reference[0][k].bfloat16()), k
        assert torch.equal(got[1].master[k], reference[0][k]), k     # the float32 values
    plain = run_transform(make(), params, grads)[0]
    assert all(torch.equal(plain[k], params[k]) for k in params)    # every step rounded away
    assert all(not torch.equal(got[0][k], params[k]) for k in params)
    n = sum(x.numel() for x in params.values())
    assert (stats.bytes_to_host, stats.bytes_to_device) == (2 * n * STEPS, 2 * n * STEPS)
    # opttx.Optimizer hands back the state it got, so the master lives across its steps too
    model = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = opttx.Optimizer(model.items(), offload(make(), 1.0, master_params=True))
    for g in grads:
        for k, p in model.items():
            p.grad = g[k]
        opt.step()
    for k in params:
        assert torch.equal(model[k].detach(), got[0][k]), k


def _all_started(state) -> bool:
    """Whether every host leaf's master in an OffloadMasterState holds its value."""
    flags = [x for x in tree_leaves(state.started) if isinstance(x, torch.Tensor)]
    return bool(flags) and all(bool(x) for x in flags)


def _none_started(state) -> bool:
    flags = [x for x in tree_leaves(state.started) if isinstance(x, torch.Tensor)]
    return bool(flags) and not any(bool(x) for x in flags)


def _bf16_leaves() -> dict[str, torch.Tensor]:
    """bfloat16 parameters of magnitude 1 to 2 (a step of 1e-3 is below half an ulp)."""
    return {k: (1 + v.abs()).bfloat16() for k, v in leaves_0d_to_4d().items()}


def test_the_master_copy_is_in_checkpoints_and_optional() -> None:
    """The master copy travels in checkpoints (``"~master"`` entries of the host chunks'
    parameters, ``"~started"``): a bfloat16 run resumed from one equals the run never
    interrupted bit for bit. A checkpoint without it (a run without offload or without the
    master) loads, and the master starts from the parameters; a checkpoint with it loads
    into a run without it (entries skipped)."""
    params = _bf16_leaves()
    grads = gradient_stream(params, 2 * STEPS, seed=16)
    make = lambda: opttx.adamw(1e-3, weight_decay=0.1)     # noqa: E731

    def mastered():           # 50-byte chunks of bfloat16 parameters: some on the device
        return offload(make(), 0.5, chunk_size_mb=CHUNK_MB / 4, master_params=True)
    expected = run_transform(mastered(), params, grads)
    mid_params, mid_state = run_transform(mastered(), params, grads[:STEPS])
    saved = _through_bytes(state_dict(mid_state, mid_params))
    host = {k for k, x in mid_state.master.items() if isinstance(x, torch.Tensor)}
    assert 0 < len(host) < len(params)
    assert {k for k, v in saved["state"].items() if "~master" in v} == host
    assert {k for k, v in saved["state"].items() if "~started" in v} == host
    plain_keys = state_dict(make().init(params), params)
    assert {k: set(v) - {"~master", "~started"} for k, v in saved["state"].items()} == \
        {k: set(v) for k, v in plain_keys["state"].items()}
    tx = mastered()
    resumed = load_state_dict(tx.init(params), saved, mid_params)
    assert_trees_close(run_transform(tx, mid_params, grads[STEPS:], state=resumed), expected,
                       rtol=0.0, what="resumed with the master")
    # without the master: zeros, not started; the master starts from the bf16 parameters
    without = _through_bytes(state_dict(mid_state.inner, mid_params))
    tx = mastered()
    resumed = load_state_dict(tx.init(params), without, mid_params)
    assert _none_started(resumed)
    got = run_transform(tx, mid_params, grads[STEPS:], state=resumed)
    restarted = run_transform(mastered(), mid_params, grads[STEPS:], state=mid_state.inner)
    assert_trees_close(got, restarted, rtol=0.0, what="resumed without the master")
    assert any(not torch.equal(got[0][k], expected[0][k]) for k in host)    # bits dropped
    # into a run without the master (strict: the optional entries are skipped)
    plain = load_state_dict(make().init(params), saved, mid_params)
    assert_trees_close(plain, mid_state.inner, rtol=0.0, what="loaded without the master")
    # into a run with every chunk on the host: the leaves saved with a master go on from it,
    # the others start theirs from the parameters (each leaf's own "~started")
    def everything():
        return offload(make(), 1.0, chunk_size_mb=CHUNK_MB / 4, master_params=True)
    tx = everything()
    resumed = load_state_dict(tx.init(params), saved, mid_params)
    got = run_transform(tx, mid_params, grads[STEPS:], state=resumed)
    restarted = run_transform(everything(), mid_params, grads[STEPS:], state=mid_state.inner)
    for k in params:
        assert torch.equal(got[0][k], (expected if k in host else restarted)[0][k]), k


def test_a_state_given_back_keeps_its_own_master() -> None:
    """The master is part of the state: a state given to update again (a step dropped by
    apply_if_finite, a functional caller going back) steps from its own master, which the
    functional update left intact; the donating one steps it in place."""
    params = _bf16_leaves()
    grads = gradient_stream(params, 3, seed=17)
    tx = offload(opttx.adamw(1e-3), 1.0, chunk_size_mb=CHUNK_MB, master_params=True)
    state = tx.init(params)
    _, state = tx.update(grads[0], state, params)
    before = {k: v.clone() for k, v in state.master.items()}
    u1, s1 = tx.update(grads[1], state, params)
    assert all(torch.equal(state.master[k], before[k]) for k in params)   # intact
    u2, s2 = tx.update(grads[1], state, params)                          # the same step again
    assert_trees_close((u1, s1), (u2, s2), rtol=0.0)
    with opttx.donating():
        u3, s3 = tx.update(grads[1], state, params)
    assert_trees_close((u3, s3), (u1, s1), rtol=0.0)
    assert all(s3.master[k].data_ptr() == state.master[k].data_ptr()     # stepped in place
               for k in params)
    grads[1] = dict(grads[1], w=torch.full((6, 5), float("nan")))
    make = lambda: opttx.adamw(1e-3, weight_decay=0.1)     # noqa: E731
    skipped = opttx.apply_if_finite(offload(make(), 0.5, chunk_size_mb=CHUNK_MB,
                                            master_params=True), 3)
    wide = {k: v.float() for k, v in params.items()}
    wide_grads = [{k: v.float() for k, v in g.items()} for g in grads]
    reference = run_transform(opttx.apply_if_finite(make(), 3), wide, wide_grads,
                              state=opttx.apply_if_finite(make(), 3).init(params))
    got = run_transform(skipped, params, grads)
    for k in params:
        assert torch.equal(got[0][k], reference[0][k].bfloat16()), k


def test_an_optimizer_rolled_back_to_a_checkpoint_resumes_from_its_master() -> None:
    """opttx.Optimizer loads a state dict into its live buffers: the master copy comes back
    with the rest (it once kept stepping from the master of the run it replaced), and a
    state dict without one restarts it from the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = opttx.Optimizer(model.parameters(), offload(opttx.adamw(1e-2), 1.0,
                                                      master_params=True))

    def step():
        opt.zero_grad()
        model(torch.ones(2, 8, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
    for _ in range(3):
        step()
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    opt_sd = _through_bytes(opt.state_dict())
    assert "~master" in opt_sd["state"][0] and "~started" in opt_sd["state"][0]
    step()
    first = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        step()
    model.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), first))
    # a state dict without the master (an optimizer without offload): started afresh
    plain = opttx.Optimizer(model.parameters(), opttx.adamw(1e-2))
    model.load_state_dict(model_sd)
    plain.load_state_dict({"state": {i: {k: v for k, v in e.items() if "~" not in k}
                                     for i, e in opt_sd["state"].items()},
                           "param_groups": opt_sd["param_groups"]})
    without = plain.state_dict()
    model.load_state_dict(model_sd)
    opt.load_state_dict(without)
    assert _none_started(opt.tx_states[0])
    step()
    restarted = opttx.Optimizer(model.parameters(), offload(opttx.adamw(1e-2), 1.0,
                                                            master_params=True))
    restarted.load_state_dict(without)
    after = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(model_sd)
    opt = restarted
    step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), after))
    # and the optimizer without offload loads the one with the master (entries skipped)
    plain.load_state_dict(opt_sd)


def test_master_params_under_clipping_and_multi_steps() -> None:
    """Global-norm clipping at the head of the chain (on every leaf first), and MultiSteps
    around the offloaded transform (the master waits with the state between real steps):
    the numbers of the plain chains (no step of these seeds crosses zero, so bitwise)."""
    params = leaves_0d_to_4d()
    grads = gradient_stream(params, 9, seed=17)

    def clipped():
        return opttx.chain(opttx.clip_by_global_norm(0.5), opttx.adamw(1e-2))
    expected = run_transform(clipped(), params, grads)
    got = run_transform(offload(clipped(), 0.5, chunk_size_mb=CHUNK_MB, master_params=True),
                        params, grads)
    assert_trees_close((got[0], got[1].inner), expected, rtol=0.0)
    expected = run_transform(opttx.MultiSteps(opttx.adamw(1e-2), 3).gradient_transformation(),
                             params, grads)
    around = opttx.MultiSteps(offload(opttx.adamw(1e-2), 0.5, chunk_size_mb=CHUNK_MB,
                                      master_params=True), 3).gradient_transformation()
    got = run_transform(around, params, grads)
    assert_trees_close(got[0], expected[0], rtol=0.0)
    assert_trees_close(got[1].inner_opt_state.inner, expected[1].inner_opt_state, rtol=0.0)


def test_master_params_refusals_and_bytes() -> None:
    """Refused with delayed, and without params; all on the host, a step copies
    the gradients down and the new values up (the parameters no longer go down)."""
    with pytest.raises(ValueError, match="master_params is not implemented with delayed"):
        offload(opttx.adam(1e-3), delayed=True, master_params=True)
    params = leaves_0d_to_4d()
    g = gradient_stream(params, 1, seed=6)[0]
    tx = offload(opttx.lion(1e-3), 1.0, chunk_size_mb=CHUNK_MB, master_params=True)
    with pytest.raises(ValueError, match=r"update needs the parameters"):
        tx.update(g, tx.init(params))
    stats = OffloadStats()
    tx = offload(opttx.lion(1e-3), 1.0, chunk_size_mb=CHUNK_MB, master_params=True,
                 stats=stats)
    tx.update(g, tx.init(params), params)
    n = sum(x.numel() for x in params.values())
    assert (stats.bytes_to_host, stats.bytes_to_device) == (4 * n, 4 * n)


# ---------------------------------------------------------------------------------------------
# the compiled host step (Inductor, CPU): one small test
# ---------------------------------------------------------------------------------------------


def test_compiled_flat_host_step_is_close_and_writes_in_place() -> None:
    """``layout="flat", compile=True``: Inductor compiles each host chunk's AdamW into one
    loop, its multiply-adds contracted into FMAs. Its numbers are within a few ulp of
    eager's (measured: 3.1e-7 relative on the parameters over 6 steps), and inside `donating`
    the state is written in place (the same buffers before and after)."""
    params = leaves_0d_to_4d(zero_dim=False)
    grads = gradient_stream(params, STEPS, seed=12)
    expected = run_transform(opttx.adamw(1e-2, weight_decay=0.1), params, grads)
    tx = offload(opttx.adamw(1e-2, weight_decay=0.1), 1.0, chunk_size_mb=CHUNK_MB,
                 layout="flat", compile=True)
    got = run_transform(tx, params, grads)
    assert_trees_close(got, expected, rtol=1e-6, atol=1e-7)
    state = tx.init(params)
    before = [x.data_ptr() for x in tree_leaves(state) if x.dim() > 0]
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        with opttx.donating():
            u, state = tx.update(g, state, p)
        opttx.apply_updates_(p, u)
    assert [x.data_ptr() for x in tree_leaves(state) if x.dim() > 0] == before
    assert_trees_close((p, state), expected, rtol=1e-6, atol=1e-7)
    # master_params: the update added to the master copy in the same loop, as close
    tx = offload(opttx.adamw(1e-2, weight_decay=0.1), 1.0, chunk_size_mb=CHUNK_MB,
                 layout="flat", compile=True, master_params=True)
    with opttx.donating():
        got = run_transform(tx, params, grads)
    assert_trees_close((got[0], got[1].inner), expected, rtol=1e-6, atol=1e-7)
    # functionally (a new master buffer each step, written by the same compiled loop): the
    # same numbers as in place
    functional = run_transform(offload(opttx.adamw(1e-2, weight_decay=0.1), 1.0,
                                       chunk_size_mb=CHUNK_MB, layout="flat", compile=True,
                                       master_params=True), params, grads)
    assert_trees_close(functional, got, rtol=0.0)


def test_more_compiled_host_chunks_than_dynamos_recompile_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``layout="leaves", compile=True``: each chunk's tree (its masked positions) is a graph
    of its own, and each chunk compiles under a code object of its own: ten host chunks,
    more than Dynamo's limit of 8 graphs per code object, all run (one code object shared by
    the chunks made the ninth a hard failure under ``fullgraph``, on the tree before this
    test), with the master copy and without. The limit is Dynamo's, whatever the backend:
    the host steps compile with Dynamo's eager backend here (30 s for the 20 graphs, 40 s
    with Inductor's builds)."""
    compile_ = torch.compile

    def eager_backend(fn, **kwargs):
        kwargs.pop("options", None)
        return compile_(fn, **kwargs, backend="eager")
    monkeypatch.setattr(torch, "compile", eager_backend)
    gen = torch.Generator().manual_seed(18)
    params = {f"l{i}": torch.randn(4, 3, generator=gen) for i in range(10)}
    grads = gradient_stream(params, 2, seed=18)
    expected = run_transform(opttx.adamw(1e-2), params, grads)
    for master in (False, True):
        stats = OffloadStats()
        tx = offload(opttx.adamw(1e-2), 1.0, chunk_size_mb=48 / MIB, compile=True,
                     master_params=master, stats=stats)
        got = run_transform(tx, params, grads)
        assert len(stats.plan.chunks) == 10
        if master:
            got = (got[0], got[1].inner)
        assert_trees_close(got, expected, rtol=1e-6, atol=1e-7, what=f"master {master}")


def test_host_groups_step_several_chunks_in_one_compiled_call() -> None:
    """``host_group_mb``: consecutive host chunks (four here, under 1 MiB) go through one
    compiled call per group (one graph each: 1 for the group, 4 without), with the numbers
    of the chunks stepped one call each, bit for bit: with and without the master copy, in
    both layouts, at fraction 0.5 (device chunks beside the group), the steps donated, and
    not donated."""
    import contextlib

    from torch._dynamo.utils import counters
    params = leaves_0d_to_4d(zero_dim=False)
    grads = gradient_stream(params, STEPS, seed=21)
    for master, layout, fraction, donate in [
            (False, "flat", 1.0, True), (True, "flat", 0.5, True), (True, "leaves", 1.0, True),
            (False, "leaves", 0.5, True), (False, "flat", 1.0, False), (True, "flat", 1.0, False)]:
        got, graphs = [], []
        for group in (None, 1.0):
            stats = OffloadStats()
            tx = offload(opttx.adamw(1e-2, weight_decay=0.1), fraction,
                         chunk_size_mb=CHUNK_MB, layout=layout, compile=True,
                         master_params=master, host_group_mb=group, stats=stats)
            counters.clear()
            with opttx.donating() if donate else contextlib.nullcontext():
                got.append(run_transform(tx, params, grads))
            graphs.append(counters["stats"]["unique_graphs"])
        host = sum(c.on_host for c in stats.plan.chunks)
        what = f"master {master}, {layout}, fraction {fraction}, donated {donate}"
        assert host >= 2, what
        assert graphs == [host, 1], (what, graphs)
        assert stats.host_chunk_steps == host * STEPS, what
        assert all(torch.equal(a, b) for a, b in
                   zip(tree_leaves(got[0]), tree_leaves(got[1]))), what


def test_host_group_computes_its_shared_scalar_work_once() -> None:
    """A group's chunks share one step count, so their bias corrections are computed once
    per group: AdamW's two opaque coefficient calls per step, whatever the number of chunks
    in the group (two per chunk before), counted by the profiler on a compiled step; and
    the count advances once per step."""
    from torch.profiler import ProfilerActivity, profile
    params = leaves_0d_to_4d(zero_dim=False)
    grads = gradient_stream(params, 3, seed=22)
    stats = OffloadStats()
    tx = offload(opttx.adamw(1e-2, weight_decay=0.1), 1.0, chunk_size_mb=CHUNK_MB,
                 layout="flat", compile=True, host_group_mb=1.0, stats=stats)
    state = tx.init(params)
    with opttx.donating():
        for g in grads[:2]:
            _, state = tx.update(g, state, params)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _, state = tx.update(grads[2], state, params)
    assert sum(c.on_host for c in stats.plan.chunks) >= 3
    calls = sum(e.count for e in prof.key_averages() if e.key == "opttx::computed_once")
    assert calls == 2
    assert int(state[0].count) == 3


def test_host_groups_refusals() -> None:
    with pytest.raises(ValueError, match="needs compile=True"):
        offload(opttx.adamw(1e-3), host_group_mb=64)
    with pytest.raises(ValueError, match="not implemented with delayed"):
        offload(opttx.adamw(1e-3), compile=True, delayed=True, host_group_mb=64)
    with pytest.raises(ValueError, match="host_group_mb must be > 0"):
        offload(opttx.adamw(1e-3), compile=True, host_group_mb=0)
    from opttx.distributed import zero
    with pytest.raises(ValueError, match="offload_host_group_mb groups compiled host steps"):
        zero(opttx.adamw(1e-3), offload=0.5, offload_host_group_mb=64)
    with pytest.raises(ValueError, match="goes with offload"):
        zero(opttx.adamw(1e-3), offload_compile=True, offload_host_group_mb=64)


# ---------------------------------------------------------------------------------------------
# CUDA only: where the state lives, and no blocking copy on the device's stream
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_on_the_host_and_copies_off_the_compute_stream(tmp_path) -> None:
    """On CUDA, half of AdamW's state offloaded: the host chunks' state tensors are in pinned
    host memory and the device chunks' on the device; in a profiled step every copy between host
    and device goes through pinned memory (``Pinned`` in the CUDA copy's name, so it is
    asynchronous) on a stream other than the one the model's kernels run on; the numbers
    are close to AdamW on the device (CPU and CUDA kernels round differently)."""
    import json
    from torch.profiler import ProfilerActivity, profile
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    params = {f"l{i}": torch.randn(256, 256, generator=gen).to(dev) for i in range(8)}
    grads = [{k: torch.randn(v.shape, generator=gen).to(dev) for k, v in params.items()}
             for _ in range(3)]
    tx = offload(opttx.adamw(1e-2), 0.5, chunk_size_mb=0.5)
    state = tx.init(params)
    plan = offload_plan(params, opttx.adamw(1e-2), 0.5, chunk_size_mb=0.5)
    keys = state_dict(state, params)["state"]
    for c in plan.chunks:
        for i in c.leaves:
            for x in keys[f"l{i}"].values():
                assert x.device.type == ("cpu" if c.on_host else "cuda")
                assert x.is_pinned() == c.on_host      # page-locked host memory
    p = dict(params)
    u, state = tx.update(grads[0], state, p)              # warm: buffers, streams
    p = opttx.apply_updates(p, u)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        u, state = tx.update(grads[1], state, p)
        p = opttx.apply_updates(p, u)
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    kernels = {e["args"]["stream"] for e in events if e.get("cat") == "kernel"}
    assert copies, "no copy between host and device was profiled"
    for e in copies:
        assert "Pinned" in e["name"], e["name"]
        assert e["args"]["stream"] not in kernels, e
    expected = run_transform(opttx.adamw(1e-2), params, grads[:2])
    assert_trees_close(p, expected[0], rtol=1e-5, atol=1e-6)
    # master_params: the values come back through pinned memory, the same numbers
    tx = offload(opttx.adamw(1e-2), 0.5, chunk_size_mb=0.5, master_params=True)
    got = run_transform(tx, params, grads[:2])
    assert_trees_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
