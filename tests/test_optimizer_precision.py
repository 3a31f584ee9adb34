"""`opttx.Optimizer` computes with its hyperparameters at the precision they were given.

The Optimizer holds every declared hyperparameter in the transform state as a float64 0-dim
CPU tensor holding exactly the number given; an eager step calls the factories with those
numbers as Python floats, so it *is* the functional step of the transform given (the same
kernels, bit for bit), and a compiled step reads the tensors as graph inputs (complements such
as ``1 - b2`` formed in float64), one graph that a scheduler changes without recompiling.
With float32 hyperparameters (what the Optimizer injected before), ``1 - 0.9999`` was
1.000166e-4 and the cases below drift from the functional path and from torch.optim.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import opttx


def _params(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def _grads(params: dict, steps: int, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
            for _ in range(steps)]


def _functional(tx: opttx.GradientTransformation, params: dict, grads: list[dict]) -> dict:
    params = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
    return params


def _through_optimizer(tx: opttx.GradientTransformation, params: dict, grads: list[dict]
                       ) -> dict:
    model = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = opttx.Optimizer(list(model.items()), tx)
    for g in grads:
        for k, p in model.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in model.items()}


def _max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _relative_displacement_error(ours: dict, theirs: dict, start: dict) -> float:
    """max |(ours - start) - (theirs - start)| / max |theirs - start| over every leaf."""
    d_ours = torch.cat([(ours[k] - start[k]).flatten() for k in start])
    d_theirs = torch.cat([(theirs[k] - start[k]).flatten() for k in start])
    return ((d_ours - d_theirs).abs().max() / d_theirs.abs().max()).item()


def _torch_run(make: callable, params: dict, grads: list[dict]) -> dict:
    model = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make(list(model.values()))
    for g in grads:
        for k, p in model.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in model.items()}


def test_hyperparameters_are_float64_cpu_tensors_holding_the_numbers_given() -> None:
    """Whatever the model's dtype: float64, on the CPU (read by an eager step for free), the
    exact Python numbers; the group shows them under torch's keys."""
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
        opt = opttx.Optimizer([p], opttx.adamw, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)
        hyperparams = opt.tx_states[0].hyperparams
        assert {t.dtype for t in hyperparams.values()} == {torch.float64}
        assert {t.device.type for t in hyperparams.values()} == {"cpu"}
        assert hyperparams["b2"].item() == 0.95 and hyperparams["learning_rate"].item() == 3e-4
        assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_soap_with_rank_deficient_factors_equals_the_functional_path_bitwise() -> None:
    """SOAP's eigenbasis of a rank-deficient early factor amplifies a 5e-8 change of b2 to
    2.1e-3 on the matrix leaf (each step moves it ~3e-3): through the Optimizer it is bit
    for bit the functional path; with b2 rounded to float32 it is not (the case can tell)."""
    params = _params({"v": (6,), "m": (8, 5)})
    grads = _grads(params, 12)
    expected = _functional(opttx.soap(3e-3, weight_decay=0.0), params, grads)
    actual = _through_optimizer(opttx.soap(3e-3, weight_decay=0.0), params, grads)
    for k in params:
        assert torch.equal(actual[k], expected[k]), k
    rounded = _functional(opttx.inject_all_hyperparams(opttx.soap(3e-3, weight_decay=0.0),
                                                       torch.float32), params, grads)
    assert _max_difference(rounded, expected) > 1e-4


FACTORIES = {
    "adam": lambda h: opttx.adam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"]),
    "adamw": lambda h: opttx.adamw(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                   weight_decay=h["wd"]),
    "rmsprop": lambda h: opttx.rmsprop(h["lr"], decay=h["b2"], eps=h["eps"],
                                       eps_in_sqrt=False, momentum=h["b1"]),
    "lion": lambda h: opttx.lion(h["lr"], b1=h["b1"], b2=h["b2"], weight_decay=h["wd"]),
    "nadam": lambda h: opttx.nadam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"]),
    "radam": lambda h: opttx.radam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                   weight_decay=h["wd"], decoupled_weight_decay=True),
    "sgd": lambda h: opttx.chain(opttx.add_decayed_weights(h["wd"]),
                                 opttx.sgd(h["lr"], momentum=h["b1"], nesterov=True)),
    "adafactor": lambda h: opttx.adafactor(h["lr"], min_dim_size_to_factor=2,
                                           momentum=h["b1"], weight_decay_rate=h["wd"]),
}


@pytest.mark.parametrize("name", list(FACTORIES))
@settings(max_examples=4, deadline=None)
@given(h=st.fixed_dictionaries({"lr": st.sampled_from([3e-4, 1e-3, 0.01]),
                                "b1": st.sampled_from([0.9, 0.95]),
                                "b2": st.sampled_from([0.95, 0.999, 0.9999]),
                                "eps": st.sampled_from([1e-8, 1e-6]),
                                "wd": st.sampled_from([0.0, 0.1, 1e-2])}))
def test_optimizer_equals_the_functional_path_bitwise(name: str, h: dict) -> None:
    """Non-dyadic hyperparameters (not exact in float32): the eager Optimizer step is the
    functional step of the transform given, bit for bit, over 10 steps."""
    params = _params({"w": (6, 4), "b": (4,), "s": ()})
    grads = _grads(params, 10)
    expected = _functional(FACTORIES[name](h), params, grads)
    actual = _through_optimizer(FACTORIES[name](h), params, grads)
    for k in params:
        assert torch.equal(actual[k], expected[k]), (name, k)


def test_rmsprop_alpha_0_9999_follows_torch_over_100_steps() -> None:
    """``1 - alpha`` of 0.9999 is 1e-4 in float64 and 1.000166e-4 from float32(0.9999):
    through the Optimizer the displacement is within 1e-6 of torch.optim.RMSprop's (relative
    to its largest element) after 100 steps; float32 hyperparameters were 8e-5 off."""
    params = _params({"w": (64, 32), "b": (32,)})
    grads = _grads(params, 100)
    theirs = _torch_run(lambda ps: torch.optim.RMSprop(ps, lr=1e-3, alpha=0.9999), params,
                        grads)
    make = lambda: opttx.rmsprop(1e-3, decay=0.9999, eps=1e-8, eps_in_sqrt=False)  # noqa: E731
    ours = _through_optimizer(make(), params, grads)
    assert _relative_displacement_error(ours, theirs, params) <= 1e-6
    rounded = _through_optimizer(opttx.inject_all_hyperparams(make(), torch.float32), params,
                                 grads)
    assert _relative_displacement_error(rounded, theirs, params) > 1e-5


def test_radam_through_the_optimizer_is_at_the_functional_paths_precision() -> None:
    """RAdam against torch.optim.RAdam over 30 steps: the Optimizer equals the functional path
    bit for bit, 4e-7 from torch in relative displacement (float32 hyperparameters: 2.5e-5)."""
    params = _params({"w": (64, 32), "b": (32,)})
    grads = _grads(params, 30)
    theirs = _torch_run(lambda ps: torch.optim.RAdam(ps, lr=1e-3), params, grads)
    ours = _through_optimizer(opttx.radam(1e-3, eps_before_debias=True), params, grads)
    functional = _functional(opttx.radam(1e-3, eps_before_debias=True), params, grads)
    assert all(torch.equal(ours[k], functional[k]) for k in params)
    assert _relative_displacement_error(ours, theirs, params) <= 1e-6


@pytest.mark.parametrize("steps", [1, 30])
def test_came_through_the_optimizer_is_at_the_functional_paths_precision(steps: int) -> None:
    """CAME against came_pytorch.CAME: the Optimizer equals the functional path bit for bit,
    within 1e-5 of came_pytorch in relative displacement from the first step on (float32
    hyperparameters: 8.3e-5 at step 0)."""
    CAME = pytest.importorskip("came_pytorch").CAME
    params = _params({"w": (64, 32), "b": (32,)})
    grads = _grads(params, steps)
    theirs = _torch_run(lambda ps: CAME(ps, lr=1e-3, weight_decay=1e-2), params, grads)
    ours = _through_optimizer(opttx.came(1e-3, weight_decay=1e-2), params, grads)
    functional = _functional(opttx.came(1e-3, weight_decay=1e-2), params, grads)
    assert all(torch.equal(ours[k], functional[k]) for k in params)
    assert _relative_displacement_error(ours, theirs, params) <= 1e-5


def test_a_shared_tensor_lr_set_in_place_is_the_lr_of_the_next_step() -> None:
    """A 0-dim tensor ``lr`` in a param group is the state's own value: ``fill_`` on it (a
    scheduler's in-place write) is what the next eager step computes with, the number it
    holds as a Python float."""
    params = _params({"w": (6, 4), "b": (4,)})
    grads = _grads(params, 4)
    lr = torch.tensor(1e-3)
    model = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = opttx.Optimizer([{"params": model, "lr": lr}], opttx.adam(1e-2))
    assert opt.param_groups[0]["lr"] is lr
    expected = [v.clone() for v in params.values()]
    tx_state = None
    for i, g in enumerate(grads):
        lr.fill_(1e-3 / (i + 1))
        for p, gi in zip(model, g.values()):
            p.grad = gi.clone()
        opt.step()
        tx = opttx.adam(lr.item())
        tx_state = tx.init(expected) if tx_state is None else tx_state
        updates, tx_state = tx.update(list(g.values()), tx_state, expected)
        expected = opttx.apply_updates(expected, updates)
    for p, e in zip(model, expected):
        assert torch.equal(p.detach(), e)


def test_a_schedule_as_hyperparameter_equals_the_functional_path_bitwise() -> None:
    params = _params({"w": (6, 4), "b": (4,)})
    grads = _grads(params, 6)
    make = lambda: opttx.adamw(opttx.warmup_cosine_decay_schedule(0.0, 3e-3, 2, 6),  # noqa
                               b2=0.95, weight_decay=0.1)
    expected = _functional(make(), params, grads)
    actual = _through_optimizer(make(), params, grads)
    for k in params:
        assert torch.equal(actual[k], expected[k]), k


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_is_one_graph_without_recompiles_over_a_scheduled_run(backend: str
                                                                            ) -> None:
    """``torch.compile(opt.step)`` with OneCycleLR cycling lr and b1 over 8 steps: one graph,
    no recompile (Dynamo's ``error_on_recompile``), the eager twin's numbers. Dynamo's
    eager backend is called once. Through AOT autograd, Dynamo restarts its analysis once on
    the first compile (a float64 0-dim CPU input gets a symbolic float that the scalar pass
    finds unused: torch 2.13), so the counter sees two calls and one graph is cached."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)]
    model = [torch.nn.Parameter(p.clone()) for p in params]
    twin = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opttx.Optimizer(model, opttx.adamw, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    eager = opttx.Optimizer(twin, opttx.adamw, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10)
              for o in (opt, eager)]
    counter = CompileCounterWithBackend(backend)
    step = torch.compile(opt.step, backend=counter)
    lrs = set()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(8):
            for p, q in zip(model, twin):
                p.grad = torch.randn(p.shape, generator=gen)
                q.grad = p.grad.clone()
            step()
            eager.step()
            for s in scheds:
                s.step()
            lrs.add(opt.param_groups[0]["lr"])
    cached = torch._dynamo.eval_frame._debug_get_cache_entry_list(opt.step.__func__.__code__)
    torch._dynamo.reset()
    assert len(lrs) == 8
    assert counter.frame_count == (1 if backend == "eager" else 2)
    assert len(cached) == 1
    for p, q in zip(model, twin):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
