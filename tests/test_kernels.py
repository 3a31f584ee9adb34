"""opttx.kernels: donation and scratch buffers are per thread (a context variable), and the
grouped-kernel helpers give the numbers of the plain ops."""

from __future__ import annotations

import re
import threading

import pytest
import torch

import opttx
from opttx.kernels import (coefficient, donating, foreach, foreach_, foreach_ema, is_donating,
                           is_scratch, mark_scratch)


def test_donation_is_not_seen_by_another_thread() -> None:
    inside, checked = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def donor() -> None:
        with donating():
            seen["donor"] = is_donating()
            inside.set()
            checked.wait(10)

    def other() -> None:
        inside.wait(10)
        seen["other"] = is_donating()
        checked.set()

    threads = [threading.Thread(target=donor), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"donor": True, "other": False}
    assert not is_donating()


def test_scratch_buffers_are_per_thread() -> None:
    x = torch.zeros(3)
    with donating():
        mark_scratch([x])
        assert is_scratch([x])
        result: list[bool] = []
        t = threading.Thread(target=lambda: result.append(is_scratch([x])))
        t.start()
        t.join(10)
        assert result == [False]
    assert not is_scratch([x])


def _setup(make_tx, seed: int, steps: int):
    """A model, its optimizer and its batches (built in the calling thread: the global RNG
    that initialises modules is shared by threads)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(5, 6, generator=gen), torch.randn(5, 2, generator=gen))
               for _ in range(steps)]
    return model, opttx.Optimizer(model.parameters(), make_tx()), batches


def _train(model, opt, batches, barrier: threading.Barrier | None = None):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if barrier is not None:
            barrier.wait(10)            # both threads step at the same time
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_two_optimizers_in_two_threads_give_their_results_alone() -> None:
    """`opttx.Optimizer` steps inside `donating` (in-place state updates, scratch buffers);
    two of them stepping at once in two threads give bitwise the results they give alone."""
    makes = [lambda: opttx.adamw(1e-2, weight_decay=0.1),
             lambda: opttx.chain(opttx.clip_by_global_norm(0.5), opttx.lion(1e-3))]
    alone = [_train(*_setup(make, seed, 8)) for seed, make in enumerate(makes)]
    runs = [_setup(make, seed, 8) for seed, make in enumerate(makes)]
    barrier = threading.Barrier(2)
    together: list = [None, None]

    def run(i: int) -> None:
        together[i] = _train(*runs[i], barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for a, b in zip(alone, together):
        assert b is not None
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_grouped_helpers_equal_the_plain_ops() -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 2, generator=gen), torch.randn(4, generator=gen)]
    ys = [torch.randn(3, 2, generator=gen), torch.randn(4, generator=gen)]
    scale = torch.tensor(0.3, dtype=torch.float64)
    for out, x, y in zip(foreach("add", xs, ys, alpha=2.0), xs, ys):
        assert torch.equal(out, x + 2.0 * y)
    for out, x in zip(foreach("mul", xs, scale), xs):
        assert torch.equal(out, x * scale)
    for out, m, g in zip(foreach_ema([x.clone() for x in xs], ys, 0.9), xs, ys):
        torch.testing.assert_close(out, 0.9 * m + 0.1 * g, rtol=1e-6, atol=1e-7)
    copies = [x.clone() for x in xs]
    assert foreach_("mul", copies, 2.0)[0] is copies[0]
    assert torch.equal(copies[1], xs[1] * 2.0)
    assert coefficient(scale, xs, "mul") is scale            # eager: passed through


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_in_place_grouped_multiply_rounds_as_the_out_of_place_one(dtype) -> None:
    """torch's CPU ``_foreach_mul_`` by a Python number rounds the number to a 16-bit
    tensor's dtype first (``_foreach_mul`` and ``x.mul_`` do not); `foreach_` and
    `foreach_op_` pass it as a 0-dim tensor instead, so the donating path of a chain (in
    place on the updates) equals the functional one."""
    from opttx.kernels import foreach_op_
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 5, generator=gen).to(dtype), torch.randn(1000, generator=gen).to(dtype),
          torch.randn((), generator=gen).to(dtype)]
    for factor in (0.3337, -1e-3, [0.3337, -1e-3, 7.1]):
        expected = foreach("mul", xs, factor)
        for inplace in (foreach_, foreach_op_):
            got = inplace("mul", [x.clone() for x in xs], factor)
            assert all(torch.equal(a, b) and a.dtype == dtype for a, b in zip(got, expected))
    if dtype != torch.float32 and torch.__version__.startswith("2.13"):
        raw = [x.clone() for x in xs]                    # torch's own in-place op differs
        torch._foreach_mul_(raw, 0.3337)
        assert not all(torch.equal(a, b) for a, b in zip(raw, foreach("mul", xs, 0.3337)))
    # AdamW on bfloat16 updates of float32 parameters, donated and not: bitwise the same
    params = {"s": torch.tensor(1.5), "w": torch.randn(6, 5, generator=gen).abs() + 1}
    grads = [{k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in params.items()}
             for _ in range(3)]
    tx = opttx.adamw(1e-3, weight_decay=0.1)
    functional, donated = tx.init(params), tx.init(params)
    for g in grads:
        u, functional = tx.update(g, functional, params)
        with donating():
            v, donated = tx.update({k: x.clone() for k, x in g.items()}, donated, params)
        assert all(torch.equal(u[k], v[k]) for k in params)


def _two_chunks(c1: torch.Tensor, x1: torch.Tensor, c2: torch.Tensor,
                x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two chunks' steps traced one after the other, as offload's host groups are: each
    chunk's bias correction (a 0-dim computation through `_computed_once`) then its loop."""
    from opttx.kernels import _computed_once
    y1 = x1 * 2.0 + _computed_once(1 - 0.9 ** (c1 + 1))
    y2 = x2 * 2.0 + _computed_once(1 - 0.9 ** (c2 + 1))
    return y1, y2


def test_coefficients_first_moves_every_chunks_scalar_work_ahead_of_the_loops() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from opttx.kernels import coefficients_first
    args = (torch.tensor(3.0), torch.randn(64), torch.tensor(5.0), torch.randn(64))
    gm = make_fx(_two_chunks)(*args)
    expected = gm(*args)

    def positions(graph: torch.fx.Graph) -> tuple[list[int], list[int]]:
        nodes = list(graph.nodes)
        once = [i for i, n in enumerate(nodes)
                if n.target is torch.ops.opttx.computed_once.default]
        loops = [i for i, n in enumerate(nodes) if n.op == "call_function"
                 and n.meta["val"].dim() == 1]         # the chunks' element-wise work
        return once, loops

    once, loops = positions(gm.graph)
    assert once[1] > loops[0]                  # as traced: chunk 2's scalar after chunk 1's loop
    assert coefficients_first(gm.graph) > 0
    gm.graph.lint()
    gm.recompile()
    once, loops = positions(gm.graph)
    assert max(once) < min(loops)
    for a, b in zip(gm(*args), expected):
        assert torch.equal(a, b)
    assert coefficients_first(gm.graph) == 0   # nothing left to move


def test_coefficients_first_leaves_a_graph_with_a_mutating_ancestor_alone() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from opttx.kernels import _computed_once, coefficients_first

    def f(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2.0
        return y, _computed_once(c.add_(1))    # an in-place op feeds the scalar

    gm = make_fx(f)(torch.tensor(1.0), torch.randn(8))
    before = [n.name for n in gm.graph.nodes]
    assert coefficients_first(gm.graph) == 0
    assert [n.name for n in gm.graph.nodes] == before


def test_coefficients_first_leaves_a_graph_alone_where_an_input_is_written_before_its_read(
        ) -> None:
    """An input written in place mid-graph, then read by the scalar work: moved ahead of the
    write, the read would see the old value, so nothing moves (built by hand: a
    functionalized graph keeps its input writes at the end)."""
    from opttx.kernels import coefficients_first
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    c, x = graph.placeholder("c"), graph.placeholder("x")
    y = graph.call_function(aten.mul.Tensor, (x, 2.0))
    graph.call_function(aten.add_.Tensor, (c, 1.0))            # c written in place
    scalar = graph.call_function(aten.mul.Tensor, (c, 3.0))     # ... then read
    once = graph.call_function(torch.ops.opttx.computed_once.default, (scalar,))
    graph.output((y, once))
    before = [n.name for n in graph.nodes]
    assert coefficients_first(graph) == 0
    assert [n.name for n in graph.nodes] == before
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert float(gm(torch.tensor(1.0), torch.ones(2))[1]) == 6.0     # (1 + 1) * 3


def test_merge_coefficients_computes_the_work_of_one_shared_count_once() -> None:
    """Offload's grouped step gives its chunks one step count: their scalar work is the same
    ops on the same input, and is merged into one chain ending in one opaque call, with the
    same values. The count's write at the end (a ``copy_`` reading the new count) does not
    keep its source from being merged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from opttx.kernels import coefficients_first, merge_coefficients

    from opttx.kernels import _computed_once

    def chunk(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = torch.where(c < 100, c + 1, c)           # the count advanced
        return x * 2.0 + _computed_once(1 - 0.9 ** count), count

    def f(c: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y1, count = chunk(c, x1)
        y2, _ = chunk(c, x2)
        c.copy_(count)                                    # written once, at the end
        return y1, y2

    def once(graph: torch.fx.Graph) -> int:
        return sum(n.target is torch.ops.opttx.computed_once.default for n in graph.nodes)

    args = (torch.tensor(3.0), torch.randn(64), torch.randn(32))
    gm = make_fx(f)(*(a.clone() for a in args))
    expected = gm(*(a.clone() for a in args))
    assert once(gm.graph) == 2
    assert merge_coefficients(gm.graph) > 0
    assert coefficients_first(gm.graph) > 0
    gm.graph.lint()
    gm.recompile()
    assert once(gm.graph) == 1
    inputs = [a.clone() for a in args]
    for a, b in zip(gm(*inputs), expected):
        assert torch.equal(a, b)
    assert float(inputs[0]) == 4.0
    assert merge_coefficients(gm.graph) == 0          # nothing left to merge


def test_merge_coefficients_leaves_a_node_written_in_place_alone() -> None:
    """Two equal scalar computations, one of them then written in place: merged, the other
    would read the write (built by hand, as a functionalized graph has no such write)."""
    from opttx.kernels import merge_coefficients
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    c = graph.placeholder("c")
    a = graph.call_function(aten.mul.Tensor, (c, 3.0))
    b = graph.call_function(aten.mul.Tensor, (c, 3.0))
    graph.call_function(aten.add_.Tensor, (b, 1.0))             # b written in place
    once_a = graph.call_function(torch.ops.opttx.computed_once.default, (a,))
    once_b = graph.call_function(torch.ops.opttx.computed_once.default, (b,))
    graph.output((once_a, once_b))
    assert merge_coefficients(graph) == 0
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert [float(x) for x in gm(torch.tensor(1.0))] == [3.0, 4.0]


def test_coefficients_first_keeps_its_order_through_inductor() -> None:
    """What the pass is for: in the compiled code, both chunks' opaque scalar calls come
    before the first element loop (without it, chunk 2's comes after chunk 1's loop)."""
    from torch._inductor.utils import run_and_get_code

    from opttx.kernels import CoefficientsFirst
    # two sizes, as two chunks have: two element loops (one size would fuse them)
    args = (torch.tensor(3.0), torch.randn(4096), torch.tensor(5.0), torch.randn(3000))

    def order(options: dict) -> list[str]:
        torch._dynamo.reset()
        fn = torch.compile(_two_chunks, fullgraph=True, options=options)
        out, (code, *_) = run_and_get_code(fn, *args)
        for a, b in zip(out, _two_chunks(*args)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        vectors, calls = set(), []      # names of 1-d buffers and inputs; the call order
        for line in code[code.index("def call("):].splitlines():
            m = re.match(r"\s*(buf\d+) = empty_strided_cpu\(\((\d+), \)", line)
            m = m or re.match(r"\s*assert_size_stride\((\w+), \((\d+), \)", line)
            if m:
                vectors.add(m.group(1))
            elif "computed_once.default(" in line:
                calls.append("once")
            elif re.match(r"\s*cpp_fused\w*\(", line):
                names = set(re.findall(r"\w+", line.split("(", 1)[1]))
                calls.append("loop" if names & vectors else "scalar")
        return calls

    plain = order({})
    first = order({"post_grad_custom_pre_pass": CoefficientsFirst()})
    assert plain.count("once") == first.count("once") == 2
    assert plain.count("loop") == 2 and "loop" in first    # (moved, Inductor may fuse them)
    last_once = len(first) - 1 - first[::-1].index("once")
    assert last_once < first.index("loop"), first
    assert len(plain) - 1 - plain[::-1].index("once") > plain.index("loop"), plain
