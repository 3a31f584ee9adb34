"""The batched refresh of Shampoo and SOAP: same-size factors of all leaves and blocks are
decomposed by one batched ``eigh`` (or ``qr``) call per size group, with the numbers of one
call per factor (bitwise on CPU), the failures still judged factor by factor, and one call
per size group counted by the profiler and in the compiled graph."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import opttx
from opttx.transforms.matrix_functions import grouped_eigh, grouped_qr, size_groups

# factor sizes: 8 (x4: three (8, 12) leaves and the (16, 8) one), 12 (x3 + two (12,) leaves),
# 16 (x1), 7 (x2, not a multiple of 64 bytes: decomposed one by one on CPU)
SHAPES = {"a": (8, 12), "b": (8, 12), "c": (8, 12), "d": (16, 8), "e": (12,), "f": (12,),
          "g": (7, 7)}
GROUP_CALLS = 5        # sizes 8, 12, 16 batched; two 7 x 7 alone
FACTOR_CALLS = 4 + 5 + 1 + 2

CONFIGS = {
    "root_inverse": lambda b: opttx.precondition_shampoo(0.9, 1e-6, 2, 2, batched_refresh=b),
    "root_inverse_packed_float64": lambda b: opttx.precondition_shampoo(
        0.9, 1e-6, 2, 2, preconditioner_dtype=torch.float64,
        inv_factor_matrix_dtype=torch.float64, use_symmetric_packing=True, batched_refresh=b),
    "eigendecomposed": lambda b: opttx.precondition_shampoo(
        0.9, 1e-6, 2, 2, eigendecomposed=True, batched_refresh=b),
    "eigendecomposed_qr": lambda b: opttx.precondition_shampoo(
        0.9, 1e-6, 2, 2, eigendecomposed=True, eigendecomposition="qr", qr_iterations=2,
        eigendecomposition_tolerance=0.01, batched_refresh=b),
    "eigendecomposed_tolerance": lambda b: opttx.precondition_shampoo(
        0.9, 1e-6, 2, 2, eigendecomposed=True, eigendecomposition_tolerance=0.05,
        batched_refresh=b),
    "ec_eigh": lambda b: opttx.precondition_eigenvalue_corrected(
        0.95, 1e-8, 2, beta1=0.9, batched_refresh=b),
    "ec_qr": lambda b: opttx.precondition_eigenvalue_corrected(
        0.95, 1e-8, 2, eigendecomposition="qr", batched_refresh=b),
    "soap_power": lambda b: opttx.precondition_eigenvalue_corrected(
        0.95, 1e-8, 2, beta1=0.9, schedule="soap", eigendecomposition="power",
        batched_refresh=b),
    "kl_soap": lambda b: opttx.precondition_eigenvalue_corrected(
        0.95, 1e-8, 2, kl_shampoo=True, batched_refresh=b),
}


def tree(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def run(tx, steps: int = 5, poison: dict | None = None):
    """Updates and states of ``steps`` eager steps; ``poison`` = {step: leaf} puts an inf
    in that leaf's gradient at that step."""
    params = tree()
    state = tx.init(params)
    g = torch.Generator().manual_seed(1)
    outs = []
    for t in range(steps):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        if poison and t in poison:
            grads[poison[t]][0] = float("inf")
        updates, state = tx.update(grads, state, params)
        outs.append((updates, state))
    return outs


def tensors(x) -> list[torch.Tensor]:
    return [t for t in opttx.tree.tree_leaves(x) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_refresh_is_bitwise_the_per_factor_one(name: str) -> None:
    batched, single = run(CONFIGS[name](True)), run(CONFIGS[name](False))
    for (u1, s1), (u2, s2) in zip(batched, single):
        for a, b in zip(tensors((u1, s1)), tensors((u2, s2)), strict=True):
            assert torch.equal(a, b), name


def test_blocks_of_a_leaf_are_batched_with_other_leaves() -> None:
    """`block_by_dims` cuts a (24, 12) leaf into (8, 12) blocks: their factors join the
    other leaves' size groups; bitwise the per-factor numbers."""
    params = {"big": torch.randn(24, 12), "a": torch.randn(8, 12)}
    make = lambda b: opttx.block_by_dims(opttx.precondition_shampoo(  # noqa: E731
        1.0, 1e-6, 1, 1, batched_refresh=b), max_preconditioner_dim=8)
    outs = []
    for b in (True, False):
        tx = make(b)
        state = tx.init(params)
        with torch.profiler.profile() as prof:
            u, state = tx.update({k: torch.randn(v.shape, generator=torch.Generator()
                                                 .manual_seed(3)) for k, v in params.items()},
                                 state, params)
        outs.append((tensors((u, state)), eigh_calls(prof)))
    assert all(torch.equal(a, b) for a, b in zip(outs[0][0], outs[1][0], strict=True))
    # blocks: "big" 3 x (8, 8) and 3 x (8, 4), "a" (8, 8) and (8, 4): 12 factors of size 8
    # and 4 of size 4 (64 bytes in float32: batched too), so 2 calls, or 16 one by one
    assert (outs[0][1], outs[1][1]) == (2, 16)


def eigh_calls(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.key == "aten::linalg_eigh")


def qr_calls(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.key == "aten::linalg_qr")


@pytest.mark.parametrize("name", ["root_inverse", "eigendecomposed", "ec_eigh", "kl_soap"])
def test_one_eigh_call_per_size_group(name: str) -> None:
    """The profiler counts one ``aten::linalg_eigh`` per size group in a refresh step (two
    steps, the second refreshes), one per factor with ``batched_refresh=False``."""
    counts = []
    for b in (True, False):
        tx = CONFIGS[name](b)
        params = tree()
        state = tx.init(params)
        g = torch.Generator().manual_seed(1)
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        _, state = tx.update(grads, state, params)
        with torch.profiler.profile() as prof:
            tx.update(grads, state, params)
        counts.append(eigh_calls(prof))
    assert counts == [GROUP_CALLS, FACTOR_CALLS]


def test_one_qr_call_per_size_group_in_soaps_power_refresh() -> None:
    counts = []
    for b in (True, False):
        tx = CONFIGS["soap_power"](b)
        params = tree()
        state = tx.init(params)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):                       # step 1 initialises (eigh); 2 refreshes
            grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
            _, state = tx.update(grads, state, params)
        with torch.profiler.profile() as prof:
            tx.update(grads, state, params)
        counts.append(qr_calls(prof))
    assert counts == [GROUP_CALLS, FACTOR_CALLS]


def test_size_groups_and_grouped_calls_equal_single_calls() -> None:
    g = torch.Generator().manual_seed(0)
    ms = [(lambda x: x @ x.mT)(torch.randn(n, n, generator=g, dtype=dt))
          for n, dt in [(8, torch.float32), (8, torch.float64), (8, torch.float32), (5, torch.float32),
                        (5, torch.float32), (12, torch.float32)]]
    # float32 8 x 8 together; the 5 x 5 (100 bytes) alone each on CPU
    assert size_groups(ms) == [[0, 2], [1], [3], [4], [5]]
    for (w, v), m in zip(grouped_eigh(ms), ms):
        w1, v1 = torch.linalg.eigh(m)
        assert torch.equal(w, w1) and torch.equal(v, v1) and v.stride() == v1.stride()
    for (q, r), m in zip(grouped_qr(ms), ms):
        q1, r1 = torch.linalg.qr(m)
        assert torch.equal(q, q1) and torch.equal(r, r1)


@pytest.mark.parametrize("name", ["root_inverse", "eigendecomposed", "ec_eigh"])
def test_a_failed_factor_keeps_its_previous_result_alone(name: str) -> None:
    """An inf in leaf "a"'s gradient at the refresh step 4: a's factors are not finite, so a
    keeps its previous roots (bases); the other leaves of its size group refresh as without
    the inf; batched and per-factor agree bitwise."""
    poisoned = run(CONFIGS[name](True), poison={3: "a"})
    single = run(CONFIGS[name](False), poison={3: "a"})
    for a, b in zip(tensors(poisoned), tensors(single), strict=True):
        assert torch.equal(a, b) or (torch.isnan(a) == torch.isnan(b)).all() and torch.equal(
            torch.nan_to_num(a), torch.nan_to_num(b))
    clean = run(CONFIGS[name](True))
    field = "roots" if name != "ec_eigh" else "bases"
    before, after, ok = (getattr(poisoned[2][1], field), getattr(poisoned[3][1], field),
                         getattr(clean[3][1], field))
    assert all(torch.equal(x, y) for x, y in zip(before["a"], after["a"]))   # kept
    assert all(torch.equal(x, y) for x, y in zip(after["b"], ok["b"]))       # unaffected
    assert not all(torch.equal(x, y) for x, y in zip(before["b"], after["b"]))


def _eigh_nodes(gm: torch.fx.GraphModule) -> int:
    n = 0
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            n += sum(1 for node in mod.graph.nodes if node.op == "call_function"
                     and node.target in (torch.linalg.eigh, torch._C._linalg.linalg_eigh))
    return n


@pytest.mark.parametrize("name", ["root_inverse", "ec_eigh"])
def test_compiled_refresh_is_one_graph_with_one_eigh_per_size_group(name: str) -> None:
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counter = CompileCounterWithBackend(backend)
    tx = CONFIGS[name](True)
    params = tree()

    def step(grads, state):
        return tx.update(grads, state, params)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager = run(tx, steps=4)
    state = tx.init(params)
    g = torch.Generator().manual_seed(1)
    for t in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        updates, state = compiled(grads, state)
        for a, b in zip(tensors(updates), tensors(eager[t][0]), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert counter.frame_count == 1 and len(graphs) == 1
    # the refresh (and Shampoo's float64 retry, one more group call each) in the graph
    expected = 2 * GROUP_CALLS if name == "root_inverse" else GROUP_CALLS
    assert _eigh_nodes(graphs[0]) == expected
    torch._dynamo.reset()
