"""Schedules take a 0-dim integer tensor, return a 0-dim tensor, and follow optax's formulas."""

from __future__ import annotations

import math

import pytest
import torch

import opttx


def values(schedule, steps: int) -> list[float]:
    out = []
    for t in range(steps):
        v = schedule(torch.tensor(t, dtype=torch.int32))
        assert isinstance(v, torch.Tensor) and v.dim() == 0
        out.append(float(v))
    return out


def test_constant_linear_polynomial() -> None:
    assert values(opttx.constant_schedule(0.3), 3) == pytest.approx([0.3] * 3)
    assert values(opttx.linear_schedule(1.0, 0.0, 4), 6) == pytest.approx(
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert values(opttx.linear_schedule(1.0, 0.0, 4, transition_begin=2), 4) == pytest.approx(
        [1.0, 1.0, 1.0, 0.75])
    poly = opttx.polynomial_schedule(2.0, 0.5, power=2, transition_steps=10)
    assert values(poly, 12) == pytest.approx(
        [(2.0 - 0.5) * (1 - min(t, 10) / 10) ** 2 + 0.5 for t in range(12)], rel=1e-6)


def test_exponential_decay() -> None:
    sched = opttx.exponential_decay(1.0, transition_steps=2, decay_rate=0.5)
    assert values(sched, 5) == pytest.approx([0.5 ** (t / 2) for t in range(5)], rel=1e-6)
    stair = opttx.exponential_decay(1.0, 2, 0.5, staircase=True, end_value=0.3)
    assert values(stair, 7) == pytest.approx([1, 1, 0.5, 0.5, 0.3, 0.3, 0.3], rel=1e-6)
    late = opttx.exponential_decay(1.0, 2, 0.5, transition_begin=3)
    assert values(late, 5) == pytest.approx([1, 1, 1, 1, 0.5**0.5], rel=1e-6)


def test_cosine_and_warmup_cosine() -> None:
    cos = opttx.cosine_decay_schedule(1.0, decay_steps=10, alpha=0.1)
    expected = [1.0 * ((1 - 0.1) * 0.5 * (1 + math.cos(math.pi * min(t, 10) / 10)) + 0.1)
                for t in range(13)]
    assert values(cos, 13) == pytest.approx(expected, rel=1e-6)
    wc = opttx.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14,
                                            end_value=0.1)
    v = values(wc, 16)
    assert v[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert v[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)), rel=1e-6)
    assert v[14:] == pytest.approx([0.1, 0.1], rel=1e-6)


def test_warmup_constant_piecewise_join() -> None:
    assert values(opttx.warmup_constant_schedule(0.0, 2.0, 2), 4) == pytest.approx(
        [0.0, 1.0, 2.0, 2.0])
    pc = opttx.piecewise_constant_schedule(1.0, {2: 0.5, 4: 0.1})
    assert values(pc, 6) == pytest.approx([1, 1, 0.5, 0.5, 0.05, 0.05])
    joined = opttx.join_schedules([opttx.constant_schedule(1.0),
                                   opttx.linear_schedule(1.0, 0.0, 2)], [3])
    assert values(joined, 6) == pytest.approx([1, 1, 1, 1, 0.5, 0.0])


@pytest.mark.parametrize("decay_type,mid", [
    ("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_warmup_stable_decay(decay_type, mid) -> None:
    wsd = opttx.warmup_stable_decay_schedule(0.0, 1.0, warmup_steps=2, stable_steps=3,
                                             decay_steps=4, decay_type=decay_type)
    v = values(wsd, 11)
    assert v[:2] == pytest.approx([0.0, 0.5])
    assert v[2:5] == pytest.approx([1.0] * 3)
    assert v[5] == pytest.approx(1.0) and v[7] == pytest.approx(mid, rel=1e-6)
    assert v[9:] == pytest.approx([0.0, 0.0], abs=1e-7)
    with pytest.raises(ValueError, match="decay_type"):
        opttx.warmup_stable_decay_schedule(0.0, 1.0, 1, 1, 1, decay_type="step")


def test_scale_by_schedule_uses_the_zero_based_count() -> None:
    tx = opttx.scale_by_learning_rate(opttx.linear_schedule(1.0, 0.0, 2))
    params = {"w": torch.ones(1)}
    state = tx.init(params)
    seen = []
    for _ in range(3):
        out, state = tx.update({"w": torch.ones(1)}, state, params)
        seen.append(float(out["w"]))
    assert seen == pytest.approx([-1.0, -0.5, 0.0])
