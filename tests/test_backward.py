"""AdaLomo and the in-backward runner: a float64 re-derivation of AdaLomo's update, the
reference package itself (lomo_optim, run on CPU), the runner against the same transform run
after backward, gradient-norm clipping in both modes, loss scaling, and a memory test that
counts live gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, shapes


# ---------------------------------------------------------------------------------------------
# the update, against a float64 derivation from the paper / reference code
# ---------------------------------------------------------------------------------------------


def adalomo_float64(params: dict, grads: list[dict], lr: float, eps: tuple[float, float],
                    clip_threshold: float, decay_rate: float, weight_decay: float) -> dict:
    """AdaLomo written from its update rule, in float64, one leaf at a time."""
    out = {}
    for name, p in params.items():
        x = p.double().clone()
        row = col = v = None
        for t, g_tree in enumerate(grads, start=1):
            g = g_tree[name].double()
            beta = 1.0 - t ** (-decay_rate)
            q = g * g + eps[0]
            if x.dim() >= 2:
                r_new, c_new = q.mean(-1), q.mean(-2)
                row = r_new if row is None else beta * row + (1 - beta) * r_new
                col = c_new if col is None else beta * col + (1 - beta) * c_new
                r_fac = (row / row.mean(-1, keepdim=True)).rsqrt().unsqueeze(-1)
                u = r_fac * col.unsqueeze(-2).rsqrt() * g
            else:
                v = q if v is None else beta * v + (1 - beta) * q
                u = v.rsqrt() * g
            rms_u = u.norm() / math.sqrt(u.numel())
            u = u / max(1.0, float(rms_u) / clip_threshold)
            step = lr * max(eps[1], float(x.norm() / math.sqrt(x.numel())))
            x = x * (1 - step * weight_decay) - step * u
        out[name] = x.to(p.dtype)
    return out


@given(tree=param_trees(shape_strategy=shapes(1, 2, 1, 6)),
       lr=st.sampled_from([1e-3, 1e-2, 0.1]), wd=st.sampled_from([0.0, 0.01, 0.5]),
       clip=st.sampled_from([0.5, 1.0]), decay=st.sampled_from([0.8, 0.5]))
def test_adalomo_equals_float64_derivation(tree, lr, wd, clip, decay) -> None:
    params = tree.tree
    grads = gradient_stream(params, 20, seed=tree.seed)
    tx = opttx.adalomo(lr, clip_threshold=clip, decay_rate=decay, weight_decay=wd)
    ours, _ = opttx.testing.run_transform(tx, params, grads)
    expected = adalomo_float64(params, grads, lr, (1e-30, 1e-3), clip, decay, wd)
    assert_trees_close(ours, expected, rtol=1e-5)


def _mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)


def _batches(n: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 6, generator=gen).to(dtype), torch.randn(12, 3, generator=gen)
             .to(dtype)) for _ in range(n)]


def _loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def test_fused_backward_equals_lomo_optim_adalomo(monkeypatch) -> None:
    lomo_optim = pytest.importorskip("lomo_optim")
    # the reference allocates its state with .cuda(); on a CPU machine make that the identity
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    ref_model, our_model = _mlp(), _mlp()
    ref = lomo_optim.AdaLomo(ref_model, lr=1e-2, loss_scale=2**10, weight_decay=0.05,
                             clip_grad_norm=1.0)
    ours = opttx.FusedBackward(our_model, opttx.adalomo(1e-2, weight_decay=0.05),
                               loss_scale=2**10, clip_grad_norm=1.0, clip_mode="two_pass")
    for batch in _batches(25):
        ref.grad_norm(_loss(ref_model, batch))
        ref.fused_backward(_loss(ref_model, batch), 1e-2)
        ours.backward(_loss(our_model, batch))
    assert_trees_close(dict(our_model.named_parameters()), dict(ref_model.named_parameters()),
                       rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the runner: the same numbers as after backward, and never all gradients at once
# ---------------------------------------------------------------------------------------------


def _after_backward(model, tx, batches, clip=None, previous=False):
    """The transform run the ordinary way: full backward, then one update of the whole tree,
    with LOMO's global-norm coefficient min(1, c / (norm + 1e-6))."""
    params = dict(model.named_parameters())
    state = tx.init({n: p.detach() for n, p in params.items()})
    prev_coef = torch.tensor(1.0)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        _loss(model, batch).backward()
        grads = {n: p.grad for n, p in params.items()}
        if clip is not None:
            norm = torch.sqrt(sum(g.float().square().sum() for g in grads.values()))
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            use = prev_coef if previous else coef
            grads = {n: g * use for n, g in grads.items()}
            prev_coef = coef
        with torch.no_grad():
            updates, state = tx.update(grads, state, {n: p.detach() for n, p in params.items()})
            opttx.apply_updates_(params, updates)
    return params


@pytest.mark.parametrize("name", ["adalomo", "adamw", "lion", "adafactor"])
def test_fused_backward_equals_the_transform_after_backward(name) -> None:
    make = {"adalomo": lambda: opttx.adalomo(1e-2, weight_decay=0.1),
            "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
            "lion": lambda: opttx.lion(1e-3),
            "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=4)}[name]
    batches = _batches(10)
    expected = _after_backward(_mlp(), make(), batches)
    model = _mlp()
    runner = opttx.FusedBackward(model, make())
    for batch in batches:
        _loss(model, batch).backward()       # plain backward: the hooks do the work
    assert runner.steps == 10
    assert all(p.grad is None for p in model.parameters())
    assert_trees_close(dict(model.named_parameters()), expected, rtol=1e-6)


@pytest.mark.parametrize("mode", ["previous", "two_pass"])
def test_global_norm_clipping_modes(mode) -> None:
    batches = _batches(8)
    tx = lambda: opttx.adalomo(1e-2)  # noqa: E731
    expected = _after_backward(_mlp(), tx(), batches, clip=0.05, previous=mode == "previous")
    model = _mlp()
    runner = opttx.FusedBackward(model, tx(), clip_grad_norm=0.05, clip_mode=mode)
    for batch in batches:
        runner.backward(_loss(model, batch))
    assert_trees_close(dict(model.named_parameters()), expected, rtol=1e-6)
    unclipped = _after_backward(_mlp(), tx(), batches)
    assert not torch.allclose(unclipped["0.weight"], expected["0.weight"])  # clipping bites


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", ["adalomo", "adamw"])
def test_accumulation_equals_one_step_on_the_mean(name: str, k: int) -> None:
    """accumulate=k over k micro-batches of a batch (each loss a mean over its micro-batch)
    equals one step on the whole batch, with 'previous' clipping: nothing moves before the
    k-th backward, whose hooks take the mean of the accumulated gradients."""
    make = {"adalomo": lambda: opttx.adalomo(1e-2, weight_decay=0.1),
            "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1)}[name]
    batches = _batches(4)
    whole, micro = _mlp(), _mlp()
    ref = opttx.FusedBackward(whole, make(), clip_grad_norm=0.05)
    runner = opttx.FusedBackward(micro, make(), clip_grad_norm=0.05, accumulate=k)
    for x, y in batches:
        ref.backward(_loss(whole, (x, y)))
        before = {n: p.detach().clone() for n, p in micro.named_parameters()}
        for i, (xm, ym) in enumerate(zip(x.tensor_split(k), y.tensor_split(k))):
            runner.backward(_loss(micro, (xm, ym)))
            if i < k - 1:
                assert all(torch.equal(p, before[n]) for n, p in micro.named_parameters())
        assert all(p.grad is None for p in micro.parameters())
        assert_trees_close(dict(micro.named_parameters()), dict(whole.named_parameters()),
                           rtol=1e-6, atol=1e-7)
    assert runner.steps == ref.steps == len(batches)


def test_accumulation_refuses_two_pass_clipping() -> None:
    with pytest.raises(ValueError, match="two_pass"):
        opttx.FusedBackward(_mlp(), opttx.adalomo(1e-2), clip_grad_norm=1.0,
                            clip_mode="two_pass", accumulate=2)
    with pytest.raises(ValueError, match="accumulate must be an integer"):
        opttx.FusedBackward(_mlp(), opttx.adalomo(1e-2), accumulate=0)


def test_in_backward_mode_never_holds_all_gradients() -> None:
    model = _mlp()
    n_params = len(list(model.parameters()))
    before, after = [], []

    def live() -> int:
        return sum(q.grad is not None for q in model.parameters())

    # hooks run in registration order: one registered before the runner's sees the gradient
    # the runner is about to take, one registered after sees what the runner left behind
    handles = [p.register_post_accumulate_grad_hook(lambda p: before.append(live()))
               for p in model.parameters()]
    runner = opttx.FusedBackward(model, opttx.adalomo(1e-2))
    handles += [p.register_post_accumulate_grad_hook(lambda p: after.append(live()))
                for p in model.parameters()]
    for batch in _batches(3):
        runner.backward(_loss(model, batch))
    assert len(before) == len(after) == 3 * n_params
    assert max(before) == 1          # only the gradient being consumed exists
    assert max(after) == 0           # and it is gone right after its update
    for h in handles:
        h.remove()
    # the ordinary path, for contrast, holds every gradient at the end of backward
    plain = _mlp()
    _loss(plain, _batches(1)[0]).backward()
    assert sum(p.grad is not None for p in plain.parameters()) == n_params


def test_static_loss_scale_changes_nothing_in_float32() -> None:
    batches = _batches(6)
    a, b = _mlp(), _mlp()
    ra = opttx.FusedBackward(a, opttx.adalomo(1e-2))
    rb = opttx.FusedBackward(b, opttx.adalomo(1e-2), loss_scale=2.0**10)
    for batch in batches:
        ra.backward(_loss(a, batch))
        rb.backward(_loss(b, batch))
    assert_trees_close(dict(b.named_parameters()), dict(a.named_parameters()), rtol=1e-6)


def test_dynamic_loss_scale_skips_overflowing_leaves_and_halves() -> None:
    model = _mlp(dtype=torch.float16)
    runner = opttx.FusedBackward(model, opttx.adamw(1e-2), loss_scale="dynamic",
                                 init_scale=2.0**15, growth_interval=2)
    before = copy.deepcopy(dict(model.named_parameters()))
    x = torch.full((4, 6), 300.0, dtype=torch.float16)   # (y * 2^15)^2 overflows fp16
    runner.backward((model(x) * 1e3).float().square().mean())
    assert float(runner.scale) == 2.0**14
    skipped = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert skipped                                        # overflowing leaves untouched
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for batch in _batches(2, dtype=torch.float16):
        runner.backward(_loss(model, batch))
    assert float(runner.scale) == 2.0**15                 # doubled after 2 clean steps
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bfloat16_parameters_update_in_float32() -> None:
    batches = _batches(5, dtype=torch.bfloat16)
    model = _mlp(dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    runner = opttx.FusedBackward(model, opttx.adalomo(1e-2))
    tx = opttx.adalomo(1e-2)
    params = dict(reference.named_parameters())
    state = tx.init({n: p.detach().float() for n, p in params.items()})
    for batch in batches:
        runner.backward(_loss(model, batch))
        reference.zero_grad(set_to_none=True)
        _loss(reference, batch).backward()
        with torch.no_grad():
            x = {n: p.detach().float() for n, p in params.items()}
            u, state = tx.update({n: p.grad.float() for n, p in params.items()}, state, x)
            for n, p in params.items():
                p.copy_(x[n] + u[n])
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, params[n])


def test_state_dict_round_trip_continues_identically() -> None:
    batches = _batches(8)
    a = _mlp()
    ra = opttx.FusedBackward(a, opttx.adalomo(1e-2), clip_grad_norm=0.1)
    for batch in batches[:4]:
        ra.backward(_loss(a, batch))
    b = copy.deepcopy(a)
    rb = opttx.FusedBackward(b, opttx.adalomo(1e-2), clip_grad_norm=0.1)
    rb.load_state_dict(copy.deepcopy(ra.state_dict()))
    for batch in batches[4:]:
        ra.backward(_loss(a, batch))
        rb.backward(_loss(b, batch))
    assert_trees_close(dict(b.named_parameters()), dict(a.named_parameters()), rtol=0)


def test_runner_rejects_bad_arguments() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="clip_grad_norm"):
        opttx.FusedBackward(model, opttx.adalomo(), clip_grad_norm=0.0)
    with pytest.raises(ValueError, match="clip_mode"):
        opttx.FusedBackward(model, opttx.adalomo(), clip_mode="later")
    with pytest.raises(ValueError, match="loss_scale"):
        opttx.FusedBackward(model, opttx.adalomo(), loss_scale=-1.0)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter"):
        opttx.FusedBackward(frozen, opttx.adalomo())


def test_per_leaf_states_share_the_8bit_maps() -> None:
    from opttx.bench.memory import tensor_bytes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 128))
    runner = opttx.FusedBackward(model, opttx.adamw_8bit(1e-3))
    whole = opttx.adamw_8bit(1e-3).init({n: p.detach() for n, p in model.named_parameters()})
    # the quantization maps (about 266 KB) are stored once, not once per parameter
    assert tensor_bytes(runner.states) <= tensor_bytes(whole) + 64
    runner.backward(model(torch.randn(4, 128)).square().mean())
    assert tensor_bytes(runner.states) <= tensor_bytes(whole) + 64
