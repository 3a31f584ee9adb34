"""`flatten`: element-wise chains on flat buffers give the per-leaf numbers, compile to one
graph at 300 tensors, and refuse mismatched trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform

ELEMENTWISE = {
    "sgd": lambda: opttx.sgd(1e-2),
    "sgd_nesterov": lambda: opttx.sgd(1e-2, momentum=0.9, nesterov=True),
    "adam": lambda: opttx.adam(1e-3),
    "adamw": lambda: opttx.adamw(1e-3, weight_decay=0.1),
    "nadam": lambda: opttx.nadam(1e-3),
    "adagrad": lambda: opttx.adagrad(1e-2),
    "rmsprop": lambda: opttx.rmsprop(1e-3, momentum=0.9, centered=True),
    "lion": lambda: opttx.lion(1e-4, weight_decay=0.1),
    "clipped_adamw": lambda: opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adamw(1e-3)),
    "scheduled_adam": lambda: opttx.adam(opttx.warmup_cosine_decay_schedule(0, 1e-3, 3, 10)),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@given(tree=param_trees(max_leaves=5, dtypes=(torch.float32, torch.float64)),
       mixed=st.booleans())
def test_flatten_equals_the_per_leaf_path(name, tree, mixed) -> None:
    params = dict(tree.tree)
    if mixed:   # a second dtype group in the same tree
        params["extra64"] = torch.randn(3, 2, dtype=torch.float64)
        params["extra32"] = torch.randn(4, dtype=torch.float32)
    grads = gradient_stream(params, 6, seed=tree.seed)
    per_leaf, per_leaf_state = run_transform(ELEMENTWISE[name](), params, grads)
    flat, flat_state = run_transform(opttx.flatten(ELEMENTWISE[name]()), params, grads)
    # float32 rounding is relative to the terms summed, not to the result: an update that is
    # a near-cancellation of its moments (a scalar leaf of 9e-5 under updates of 1e-3) differs
    # between the grouped and the flat kernels by a rounding of the tree's largest update, so
    # the bound has a term of 1e-6 of the largest displacement (not of the parameters)
    largest = max((a - b).abs().max().item() for a, b in zip(
        opttx.tree.tree_leaves(per_leaf), opttx.tree.tree_leaves(params)))
    assert_trees_close(flat, per_leaf, rtol=1e-6, atol=1e-6 * largest)
    for x, y in zip(opttx.tree.tree_leaves(flat), opttx.tree.tree_leaves(per_leaf)):
        assert x.dtype == y.dtype and x.shape == y.shape


def test_flatten_state_is_one_buffer_per_dtype_group() -> None:
    params = {"a": torch.zeros(3, 4), "b": torch.zeros(5), "c": torch.zeros(2, dtype=torch.float64)}
    state = opttx.flatten(opttx.adam(1e-3)).init(params)
    mu = state.inner_state[0].mu
    assert isinstance(mu, tuple) and [m.shape for m in mu] == [(17,), (2,)]
    assert [m.dtype for m in mu] == [torch.float32, torch.float64]


def test_flatten_updates_have_the_leaves_shapes_and_apply_in_place() -> None:
    params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    tx = opttx.flatten(opttx.sgd(0.5))
    state = tx.init(params)
    grads = {"w": torch.full((2, 3), 2.0), "b": torch.full((3,), 4.0)}
    updates, state = tx.update(grads, state, params)
    assert updates["w"].shape == (2, 3) and updates["b"].shape == (3,)
    opttx.apply_updates_(params, updates)
    assert torch.equal(params["w"], torch.zeros(2, 3))
    assert torch.equal(params["b"], torch.full((3,), -1.0))


def test_flatten_rejects_params_of_another_structure() -> None:
    tx = opttx.flatten(opttx.adamw(1e-3))
    state = tx.init({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="b"):
        tx.update({"a": torch.zeros(2), "b": torch.zeros(3)}, state, {"a": torch.zeros(2)})


@pytest.mark.parametrize("layout", ["per_leaf", "flat"])
def test_one_graph_and_no_recompiles_at_300_tensors(layout) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = {f"w{i:03d}": torch.randn(4, 3, generator=gen) for i in range(300)}
    tx = opttx.adamw(opttx.linear_schedule(1e-3, 1e-4, 5), weight_decay=0.1)
    tx = opttx.flatten(tx) if layout == "flat" else tx
    state = tx.init(params)
    eager_params, eager_state = {k: v.clone() for k, v in params.items()}, tx.init(params)

    def step(params, state, grads):
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        opttx.tree_copy_(state, new_state)

    # Dynamo alone ("eager" backend): the graph count is what is asserted, and AOT tracing of
    # 300 per-leaf chains would cost a minute of CI time
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for grads in gradient_stream(params, 4, seed=1):
            compiled(params, state, grads)
            step(eager_params, eager_state, grads)
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(step.__code__)) == 1
    assert counter.frame_count == 1
    assert_trees_close(params, eager_params, rtol=1e-6)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# FlatParams: parameters that live in flat buffers
# ---------------------------------------------------------------------------------------------


def test_flat_params_round_trip_and_groups() -> None:
    params = {"a": torch.randn(3, 4), "b": torch.randn(5, dtype=torch.float64),
              "c": torch.randn(2, 2)}
    flat = opttx.FlatParams(params)
    assert [b.shape for b in flat.buffers] == [(16,), (5,)]
    assert [b.dtype for b in flat.buffers] == [torch.float32, torch.float64]
    assert_trees_close(flat.unflatten(), params, rtol=0)
    views = flat.unflatten()
    assert views["a"].data_ptr() == flat.buffers[0].data_ptr()       # views, not copies
    again = flat.flatten(views)
    assert all(torch.equal(x, y) for x, y in zip(again, flat.buffers))


def test_of_module_keeps_parameters_and_shares_storage() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = [id(p) for p in model.parameters()]
    flat = opttx.FlatParams.of_module(model)
    assert [id(p) for p in model.parameters()] == ids
    assert_trees_close({k: v.detach() for k, v in model.named_parameters()}, before, rtol=0)
    flat.buffers[0].add_(1.0)                         # the module sees the buffer
    assert torch.equal(model[0].bias.detach(), before["0.bias"] + 1.0)
    # eager training through opttx.Optimizer still works on the views
    opt = opttx.Optimizer(model.parameters(), opttx.adam(1e-2))
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    assert not torch.equal(model[0].weight.detach(), before["0.weight"] + 1.0)


def test_compiled_step_on_flat_params_equals_the_per_leaf_step() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.func import functional_call, grad_and_value
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = {k: v.detach().clone() for k, v in model.named_parameters()}
    flat = opttx.FlatParams.of_module(model)
    tx = opttx.adamw(opttx.linear_schedule(1e-2, 1e-3, 4), weight_decay=0.1)
    state, ref_state = tx.init(flat.buffers), tx.init(reference)

    def loss_fn(params, x, y):
        return (functional_call(model, params, (x,)) - y).square().mean()

    def flat_step(buffers, state, x, y):
        grads, loss = grad_and_value(lambda b: loss_fn(flat.unflatten(b), x, y))(buffers)
        updates, new_state = tx.update(grads, state, buffers)
        opttx.apply_updates_(buffers, updates)
        opttx.tree_copy_(state, new_state)
        return loss

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(flat_step, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(5):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            compiled(flat.buffers, state, x, y)
            grads = torch.func.grad(loss_fn)(reference, x, y)
            updates, ref_state = tx.update(grads, ref_state, reference)
            reference = opttx.apply_updates(reference, updates)
    assert counter.frame_count == 1
    assert_trees_close({k: v.detach() for k, v in model.named_parameters()}, reference,
                       rtol=1e-6)
    torch._dynamo.reset()
