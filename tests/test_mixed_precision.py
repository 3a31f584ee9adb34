"""Mixed precision: bf16 parameters with fp32 state, stochastic rounding of the bf16 write,
bf16 moments as an option."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.base import round_stochastic_
from opttx.testing import assert_trees_close, gradient_stream, run_transform


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and above each float32 value (by truncation)."""
    bits = x.view(torch.int32)
    low = (bits & -65536).view(torch.float32)
    high = ((bits & -65536) + 65536).view(torch.float32)
    return torch.minimum(low, high), torch.maximum(low, high)


@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 1e4]))
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(seed, scale) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, generator=gen) * scale
    reps = 4000
    xs = x.repeat(reps, 1)
    out = torch.empty_like(xs, dtype=torch.bfloat16)
    round_stochastic_(out, xs, gen)
    low, high = _neighbours(x)
    got = out.float()
    assert bool(((got == low) | (got == high)).all())
    # the mean over the repetitions estimates x: its error is within 5 standard errors of a
    # two-point distribution on [low, high]
    spacing = high - low
    mean = got.mean(0)
    assert bool(((mean - x).abs() <= 5 * spacing / (2 * reps ** 0.5) + 1e-30).all())


def test_stochastic_rounding_keeps_representable_values_and_specials() -> None:
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, float("inf"), float("-inf"), float("nan")])
    out = torch.empty_like(x, dtype=torch.bfloat16)
    for seed in range(5):
        round_stochastic_(out, x, torch.Generator().manual_seed(seed))
        assert torch.equal(out[:4].float(), x[:4])
        assert out[5].item() == float("inf") and out[6].item() == float("-inf")
        assert torch.isnan(out[7])


def test_small_updates_move_bf16_parameters_only_with_stochastic_rounding() -> None:
    # 1e-4 per step is far below bfloat16's spacing at 1.0 (2^-7 = 0.0078): round to nearest
    # loses every step, stochastic rounding accumulates them on average
    results = {}
    for sr in (False, True):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = opttx.Optimizer([p], opttx.sgd(1e-4), stochastic_rounding=sr,
                              generator=torch.Generator().manual_seed(0))
        for _ in range(200):
            p.grad = -torch.ones_like(p)
            opt.step()
        results[sr] = p.float().mean().item()
    assert results[False] == 1.0
    assert results[True] == pytest.approx(1.02, abs=2e-3)


def test_stochastic_rounding_leaves_float32_parameters_exact() -> None:
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    updates = {"w": torch.randn(5, 3) * 1e-3, "b": torch.randn(3) * 1e-3}
    plain = opttx.apply_updates(params, updates)
    sr = opttx.apply_updates(params, updates, stochastic_rounding=True)
    assert_trees_close(sr, plain, rtol=0)
    inplace = {k: v.clone() for k, v in params.items()}
    opttx.apply_updates_(inplace, updates, stochastic_rounding=True)
    assert_trees_close(inplace, plain, rtol=0)


def test_pure_and_in_place_stochastic_writes_agree_for_a_seed() -> None:
    params = {"w": torch.randn(7, 9).bfloat16(), "b": torch.randn(9)}
    updates = {"w": torch.randn(7, 9) * 1e-3, "b": torch.randn(9) * 1e-3}
    pure = opttx.apply_updates(params, updates, stochastic_rounding=True,
                               generator=torch.Generator().manual_seed(3))
    inplace = {k: v.clone() for k, v in params.items()}
    opttx.apply_updates_(inplace, updates, stochastic_rounding=True,
                         generator=torch.Generator().manual_seed(3))
    assert_trees_close(inplace, pure, rtol=0)
    assert pure["w"].dtype == torch.bfloat16 and pure["b"].dtype == torch.float32


def test_optimizer_stochastic_rounding_with_a_folded_learning_rate() -> None:
    # adamw's constant lr is folded into the write; the stochastic path must scale the same
    gen = torch.Generator().manual_seed(0)
    w32 = torch.randn(64, 32, generator=gen)
    p = torch.nn.Parameter(w32.bfloat16())
    ref = {"w": w32.bfloat16().float()}
    tx = opttx.adamw(1e-2, weight_decay=0.1)
    opt = opttx.Optimizer([("w", p)], tx, stochastic_rounding=True,
                          generator=torch.Generator().manual_seed(1))
    state = tx.init(ref)
    for g in gradient_stream({"w": w32}, 5, seed=2):
        p.grad = g["w"].bfloat16()
        opt.step()
        u, state = tx.update({"w": g["w"].bfloat16().float()}, state, ref)
        ref = opttx.apply_updates(ref, u)
    # the error against the float32 trajectory, in units of bf16's spacing at each value: a
    # random walk of a few unbiased roundings (a missing or doubled lr factor would put it
    # at hundreds of spacings)
    spacing = 2.0 ** (torch.floor(torch.log2(ref["w"].abs())) - 7)
    err = ((p.detach().float() - ref["w"]) / spacing).flatten()
    assert err.abs().mean() <= 1.0
    assert abs(err.mean()) <= 0.1


def test_bf16_parameters_keep_float32_state_and_bf16_moments_are_an_option() -> None:
    params = {"w": torch.randn(16, 8).bfloat16()}
    state = opttx.adamw(1e-3).init(params)
    adam_state = state[0]
    assert adam_state.mu["w"].dtype == torch.float32 and adam_state.nu["w"].dtype == torch.float32
    lean = opttx.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
    lean_state = lean.init({"w": torch.randn(16, 8)})[0]
    assert lean_state.mu["w"].dtype == torch.bfloat16 and lean_state.nu["w"].dtype == torch.bfloat16
    state_bytes = sum(t.numel() * t.element_size() for t in (lean_state.mu["w"], lean_state.nu["w"]))
    assert state_bytes / 128 == 4.0


def test_bf16_moments_track_float32_moments() -> None:
    params = {"w": torch.randn(32, 16), "b": torch.randn(16)}
    grads = gradient_stream(params, 20, seed=5)
    full, _ = run_transform(opttx.adamw(1e-2), params, grads)
    lean, _ = run_transform(opttx.adamw(1e-2, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
                            params, grads)
    moved = {k: (full[k] - params[k]).abs().max() for k in params}
    for k in params:   # the displacement agrees to bf16's ~3 significant digits
        assert (lean[k] - full[k]).abs().max() <= 2e-2 * moved[k]


def test_compiled_step_with_stochastic_rounding_is_one_graph() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    params = {"w": torch.randn(8, 4).bfloat16(), "b": torch.zeros(4)}
    tx = opttx.adamw(opttx.linear_schedule(1e-2, 1e-3, 5))
    state = tx.init(params)

    def step(params, state, grads):
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates, stochastic_rounding=True)
        opttx.tree_copy_(state, new_state)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    before = params["w"].clone()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for g in gradient_stream({"w": torch.zeros(8, 4), "b": torch.zeros(4)}, 4, seed=1):
            compiled(params, state, {"w": g["w"].bfloat16(), "b": g["b"]})
    assert counter.frame_count == 1
    assert params["w"].dtype == torch.bfloat16 and not torch.equal(params["w"], before)
    assert torch.isfinite(params["w"].float()).all()
    torch._dynamo.reset()
