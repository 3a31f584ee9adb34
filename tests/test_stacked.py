"""`stacked` on `StackedParams`: per-leaf transforms run on stacks of same-shaped parameters
give the per-leaf numbers, compile to one graph whatever the number of stacked tensors, and
refuse what vmap would silently change (statistics across leaves, distributed wrappers)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opttx
from opttx.testing import assert_trees_close, gradient_stream

from test_layout import ELEMENTWISE

PER_LEAF = {
    # the element-wise chains of the flatten tests, but the one with a global norm (refused
    # inside stacked: tested below, outside it)
    **{name: make for name, make in ELEMENTWISE.items() if name != "clipped_adamw"},
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=2),
    "adafactor_relative": lambda: opttx.adafactor(None, min_dim_size_to_factor=2,
                                                  momentum=0.9),
    "came": lambda: opttx.came(1e-3),
    "lamb": lambda: opttx.lamb(1e-3, weight_decay=0.01),
    "lars": lambda: opttx.lars(1e-2),
    "adamw_8bit": lambda: opttx.adamw_8bit(1e-3, block_size=8),
    "galore_adamw": lambda: opttx.galore_adamw(1e-3, rank=2, update_proj_gap=2),
    "adalomo": lambda: opttx.adalomo(1e-3),
    "injected_adamw": lambda: opttx.inject_hyperparams(opttx.adamw)(
        learning_rate=opttx.linear_schedule(1e-3, 1e-4, 4), weight_decay=0.1),
    # labels and masks as functions of the (slice) shapes: inside vmap a leaf is one slice
    "partition_by_ndim": lambda: opttx.partition(
        {"mat": opttx.adafactor(1e-2, min_dim_size_to_factor=2), "vec": opttx.adamw(1e-3)},
        lambda t: opttx.tree.tree_map(lambda x: "mat" if x.ndim > 1 else "vec", t)),
    "masked_lamb": lambda: opttx.masked(
        opttx.lamb(1e-3), lambda t: opttx.tree.tree_map(lambda x: x.ndim > 1, t)),
}

dims = st.integers(1, 5)
group = st.tuples(st.integers(1, 4),                                     # stack length
                  st.lists(dims, min_size=0, max_size=3).map(tuple),     # slice shape
                  st.sampled_from([torch.float32, torch.float64]))


def _params(groups, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for g, (length, shape, dtype) in enumerate(groups):
        for i in range(length):
            params[f"g{g}_{i}"] = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return params


def _per_leaf_and_stacked(make, params, steps: int = 4, seed: int = 0, make_stacked=None):
    """Train ``make()`` per leaf and ``make_stacked()`` (default: ``stacked(make())``) on the
    stacks of the same parameters; return both parameter trees."""
    grads = gradient_stream(params, steps, seed=seed)
    per_leaf = {k: v.clone() for k, v in params.items()}
    tx = make()
    state = tx.init(per_leaf)
    stack = opttx.StackedParams({k: v.clone() for k, v in params.items()})
    stx = opttx.stacked(make()) if make_stacked is None else make_stacked()
    sstate = stx.init(stack.buffers)
    for g in grads:
        updates, state = tx.update(g, state, per_leaf)
        opttx.apply_updates_(per_leaf, updates)
        supdates, new_sstate = stx.update(stack.stack(g), sstate, stack.buffers)
        opttx.apply_updates_(stack.buffers, supdates)
        opttx.tree_copy_(sstate, new_sstate)
    return per_leaf, stack.unstack()


@pytest.mark.parametrize("name", sorted(PER_LEAF))
@given(groups=st.lists(group, min_size=1, max_size=3), seed=st.integers(0, 2 ** 16))
def test_stacked_equals_the_per_leaf_path(name, groups, seed) -> None:
    if name == "galore_adamw":       # GaLore projects matrices; give it some
        groups = [(length, (4, 3), dtype) for length, _, dtype in groups]
    params = _params(groups, seed)
    per_leaf, from_stacks = _per_leaf_and_stacked(PER_LEAF[name], params, seed=seed)
    assert_trees_close(from_stacks, per_leaf, rtol=1e-6)
    for k in params:
        assert from_stacks[k].dtype == per_leaf[k].dtype
        assert from_stacks[k].shape == per_leaf[k].shape


def test_factored_statistics_are_per_slice() -> None:
    # 80 layers of (16, 8): per slice, row statistics (80, 16) and column statistics (80, 8).
    # Factoring the (80, 16, 8) stack as one tensor would pick its two largest dims (80, 16)
    # and keep (80, 8) and (16, 8) instead.
    stack = opttx.StackedParams({f"layer{i}": torch.randn(16, 8) for i in range(80)})
    state = opttx.stacked(opttx.scale_by_factored_rms(min_dim_size_to_factor=2)).init(
        stack.buffers)
    shapes = {tuple(x.shape) for x in opttx.tree.tree_leaves(state) if x.numel() > 1}
    assert shapes == {(80, 16), (80, 8)}


def test_step_counts_are_shared_not_stacked() -> None:
    stack = opttx.StackedParams({f"w{i}": torch.randn(3, 2) for i in range(5)})
    (state,) = opttx.stacked(opttx.adam(1e-3)).init(stack.buffers).inner_states
    assert state[0].count.shape == ()                     # one count for the 5 slices
    assert state[0].mu["3x2_float32"].shape == (5, 3, 2)


def test_global_norm_outside_stacked_equals_per_leaf_and_inside_is_refused() -> None:
    params = _params([(3, (4, 2), torch.float32), (2, (5,), torch.float32)], seed=3)
    # sgd, not adam: adam's step would hide a wrong clipping factor (it is scale-invariant)
    outside = lambda: opttx.chain(opttx.clip_by_global_norm(0.5), opttx.sgd(1e-1))
    per_leaf, from_stacks = _per_leaf_and_stacked(
        outside, params, steps=3, make_stacked=lambda: opttx.chain(
            opttx.clip_by_global_norm(0.5), opttx.stacked(opttx.sgd(1e-1))))
    assert_trees_close(from_stacks, per_leaf, rtol=1e-6)

    # refused when built, from the declared traits (Traits.across_leaves) ...
    with pytest.raises(NotImplementedError, match="across leaves"):
        opttx.stacked(outside())
    with pytest.raises(NotImplementedError, match="across leaves"):
        opttx.stacked(opttx.apply_if_finite(opttx.adam(1e-3), 3))
    # ... and a transform that declares nothing is not known to be per-leaf: refused too
    undeclared = opttx.adam(1e-3)
    with pytest.raises(NotImplementedError, match="per_leaf"):
        opttx.stacked(opttx.GradientTransformation(undeclared.init, undeclared.update))


def test_stacked_refuses_distributed_wrappers_and_scalars() -> None:
    tx = opttx.stacked(opttx.adam(1e-3))
    buffers = {"w": torch.zeros(3, 2)}
    state = tx.init(buffers)
    with pytest.raises(NotImplementedError, match="distributed"):
        tx.update(buffers, state, buffers, **{opttx.base.REDUCER_KEY: object()})
    with opttx.base.reducer_during_init(object()), \
            pytest.raises(NotImplementedError, match="distributed"):
        tx.init(buffers)
    with pytest.raises(ValueError, match="leading stack dim"):
        tx.init({"s": torch.zeros(())})


def test_stacked_params_round_trip_groups_and_scalars() -> None:
    params = {"a": torch.randn(3, 4), "b": torch.randn(5, dtype=torch.float64),
              "c": torch.randn(3, 4), "t": torch.randn(()), "u": torch.randn(())}
    stack = opttx.StackedParams(params)
    assert {k: tuple(v.shape) for k, v in stack.buffers.items()} == {
        "3x4_float32": (2, 3, 4), "5_float64": (1, 5), "scalar_float32": (2,)}
    back = stack.unstack()
    assert list(back) == list(params)
    for i, k in enumerate(params):
        group, index = stack.slot[i]
        assert torch.equal(back[k], params[k]) and back[k].shape == params[k].shape
        assert back[k].data_ptr() == stack.buffers[stack.names[group]][index].data_ptr()
    restacked = stack.stack(params)
    assert all(torch.equal(restacked[n], stack.buffers[n]) for n in stack.names)
    with pytest.raises(ValueError, match="c"):
        stack.stack({"a": params["a"], "b": params["b"]})
    assert "5 leaves in 3 stacks" in repr(stack)


def test_scalar_parameters_train_like_per_leaf() -> None:
    params = {"t": torch.tensor(0.5), "u": torch.tensor(-1.5), "w": torch.randn(4, 3)}
    for make in (lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=2),
                 lambda: opttx.lamb(1e-3)):
        per_leaf, from_stacks = _per_leaf_and_stacked(make, params)
        assert_trees_close(from_stacks, per_leaf, rtol=1e-6)


def test_of_module_keeps_parameters_and_shares_storage() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(4)])
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = [id(p) for p in model.parameters()]
    stack = opttx.StackedParams.of_module(model)
    assert [id(p) for p in model.parameters()] == ids
    assert {k: tuple(v.shape) for k, v in stack.buffers.items()} == {
        "6x6_float32": (4, 6, 6), "6_float32": (4, 6)}
    for k, p in model.named_parameters():
        assert torch.equal(p, before[k])
    with torch.no_grad():
        stack.buffers["6x6_float32"][2].fill_(1.0)
    assert torch.equal(model[2].weight, torch.ones(6, 6))


def _train(compiled_backend: str | None, layers: int, make, steps: int = 3):
    torch.manual_seed(0)
    params = {f"w{i:03d}": torch.randn(4, 3) for i in range(layers)}
    stack = opttx.StackedParams(params)
    tx = opttx.stacked(make())
    state = tx.init(stack.buffers)

    def step(buffers, state, grads):
        updates, new_state = tx.update(grads, state, buffers)
        opttx.apply_updates_(buffers, updates)
        opttx.tree_copy_(state, new_state)

    fn = step if compiled_backend is None else torch.compile(step, backend=compiled_backend,
                                                             fullgraph=True)
    for g in gradient_stream(params, steps, seed=1):
        fn(stack.buffers, state, stack.stack(g))
    return stack.unstack()


def test_one_graph_and_no_recompiles_at_300_tensors() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    make = lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=2)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = _train(counter, 300, make)
    assert counter.frame_count == 1
    assert_trees_close(compiled, _train(None, 300, make), rtol=1e-6)
    torch._dynamo.reset()


def test_inductor_step_equals_eager() -> None:
    # small and real: Inductor lowers the vmapped chain (the lerp of a traced 0-dim weight
    # once failed there only)
    torch._dynamo.reset()
    make = lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9)
    assert_trees_close(_train("inductor", 6, make), _train(None, 6, make), rtol=1e-6)
    torch._dynamo.reset()


def test_foreach_vmap_rules_match_the_grouped_kernels() -> None:
    from opttx.stacked import install_foreach_vmap_rules
    install_foreach_vmap_rules()
    a, b = torch.randn(3, 4), torch.randn(3, 4)

    def grouped(x, y):
        out = torch._foreach_lerp([x, y], [y, x], 0.25)
        torch._foreach_addcmul_(out, [x, y], [y, y], 0.5)
        out = torch._foreach_maximum(out, 0.1)
        return torch._foreach_norm(out, 2)

    got = torch.func.vmap(grouped)(a, b)
    for i in range(3):
        want = grouped(a[i], b[i])
        assert torch.equal(got[0][i], want[0]) and torch.equal(got[1][i], want[1])
