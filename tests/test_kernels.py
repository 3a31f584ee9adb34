"""opttx.kernels: donation and scratch buffers are per thread (a context variable), and the
grouped-kernel helpers give the numbers of the plain ops."""

from __future__ import annotations

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
