"""Bad input and faults on one process: each case gives the right numbers or a clear
error that names the leaf and what was expected, never silently wrong numbers, a hang or a
half-loaded state. The multi-process cases are in tests/test_faults_distributed.py; the table of
outcomes is docs/guide/faults.md.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import opttx
from opttx.tree import tree_flatten, tree_leaves

# ---------------------------------------------------------------------------------------------
# silent wrong numbers
# ---------------------------------------------------------------------------------------------


def test_apply_updates_pairs_leaves_by_path() -> None:
    """A dict of updates in another key order moves each leaf by its own update."""
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    out = opttx.apply_updates(params, {"b": torch.full((2,), 2.0), "a": torch.ones(2)})
    assert out["a"].tolist() == [1.0, 1.0] and out["b"].tolist() == [2.0, 2.0]
    inplace = {"a": torch.zeros(2), "b": torch.zeros(2)}
    opttx.apply_updates_(inplace, {"b": torch.full((2,), 2.0), "a": torch.ones(2)})
    assert inplace["a"].tolist() == [1.0, 1.0] and inplace["b"].tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="structure"):
        opttx.apply_updates(params, [torch.ones(2), torch.ones(2)])


def test_stateless_chain_refuses_a_broadcastable_update() -> None:
    """sgd has no state to compare with; apply_updates compares with the params."""
    params = {"w": torch.zeros(4, 3)}
    tx = opttx.sgd(0.1)
    updates, _ = tx.update({"w": torch.ones(1, 3)}, tx.init(params), params)
    with pytest.raises(ValueError, match=r"\['w'\].*\(1, 3\), expected \(4, 3\)"):
        opttx.apply_updates(params, updates)


def test_apply_updates_refuses_complex_updates_of_real_params() -> None:
    """Casting a complex update to a real parameter would drop its imaginary part."""
    params = {"w": torch.zeros(3)}
    with pytest.raises(TypeError, match=r"\['w'\].*complex"):
        opttx.apply_updates(params, {"w": torch.ones(3, dtype=torch.complex64)})


def test_shampoo_bf16_params_follow_fp32_within_bf16_rounding() -> None:
    """Shampoo on bf16 parameters (fp32 statistics, graft's filtered gradient in fp32)
    gives the fp32 run's updates on the same (bf16-representable) gradients, up to the
    rounding of the output to bf16 (the grafted result, computed in fp32, then its product
    with the learning rate)."""
    torch.manual_seed(0)
    p32 = {"w": torch.randn(8, 6), "b": torch.randn(6)}
    p16 = {k: v.bfloat16() for k, v in p32.items()}
    tx = opttx.shampoo(1e-2)                      # beta1 = 0.9: graft keeps a filtered gradient
    s32, s16 = tx.init(p32), tx.init(p16)
    filtered = [x for x in tree_leaves(s16) if x.is_floating_point()]
    assert all(x.dtype == torch.float32 for x in filtered)
    for _ in range(12):
        g16 = {k: torch.randn(v.shape).bfloat16() for k, v in p32.items()}
        u32, s32 = tx.update({k: v.float() for k, v in g16.items()}, s32, p32)
        u16, s16 = tx.update(g16, s16, p16)
        for k in p32:
            assert u16[k].dtype == torch.bfloat16
            err = (u16[k].float() - u32[k]).abs()
            assert (err <= 2.0**-7 * u32[k].abs() + 1e-30).all(), (k, err.max())


ALIASES_WITH_STATE = {
    "adam": lambda: opttx.adam(1e-2),
    "adamw": lambda: opttx.adamw(1e-2),
    "lion": lambda: opttx.lion(1e-2),
    "lamb": lambda: opttx.lamb(1e-2),
    "nadam": lambda: opttx.nadam(1e-2),
    "rmsprop": lambda: opttx.rmsprop(1e-2),
    "adagrad": lambda: opttx.adagrad(1e-2),
    "sgd_momentum": lambda: opttx.sgd(1e-2, momentum=0.9),
    # factored and layer-wise: checked against their state or the params
    "adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=2),
    "came": lambda: opttx.came(1e-3, min_dim_size_to_factor=2),
    "lars": lambda: opttx.lars(0.1),
    "adalomo": lambda: opttx.adalomo(1e-2),
}


@pytest.mark.parametrize("name", sorted(ALIASES_WITH_STATE))
def test_gradient_of_a_broadcastable_shape_is_refused(name: str) -> None:
    """A (1, 3) gradient for a (4, 3) parameter used to update every row alike."""
    params = {"b": torch.zeros(3), "w": torch.zeros(4, 3)}
    tx = ALIASES_WITH_STATE[name]()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"gradient\['w'\] has shape \(1, 3\), expected \(4, 3\)"):
        tx.update({"b": torch.ones(3), "w": torch.ones(1, 3)}, state, params)


@st.composite
def broadcastable_wrong_shapes(draw) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A parameter shape and a different shape that broadcasts to it (some dims of size
    > 1 set to 1, or leading dims dropped)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    assume(any(d > 1 for d in shape) or len(shape) > 1)
    ones = draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    wrong = tuple(1 if o else d for d, o in zip(shape, ones))
    wrong = wrong[draw(st.integers(0, len(wrong) - 1)):]
    assume(wrong != shape)
    return shape, wrong


@settings(max_examples=15, deadline=None)
@given(shapes=broadcastable_wrong_shapes(), name=st.sampled_from(sorted(ALIASES_WITH_STATE)))
def test_any_broadcastable_wrong_shape_is_refused(shapes, name: str) -> None:
    shape, wrong = shapes
    assert torch.broadcast_shapes(shape, wrong) == shape
    params = {"w": torch.zeros(shape)}
    tx = ALIASES_WITH_STATE[name]()
    with pytest.raises(ValueError, match=r"gradient\['w'\] has shape"):
        tx.update({"w": torch.ones(wrong)}, tx.init(params), params)


BAD_GRADIENTS = {
    "int": (lambda: torch.ones(4, 3, dtype=torch.int64), TypeError, "dtype torch.int64"),
    "complex": (lambda: torch.ones(4, 3, dtype=torch.complex64), TypeError, "complex"),
    "sparse": (lambda: torch.ones(4, 3).to_sparse(), TypeError, "sparse"),
    "none": (lambda: None, TypeError, "NoneType, expected a floating-point tensor of shape"),
}


@pytest.mark.parametrize("name", ["adam", "lion", "sgd_momentum"])
@pytest.mark.parametrize("kind", sorted(BAD_GRADIENTS))
def test_gradients_that_are_not_dense_real_floats_are_refused(name: str, kind: str) -> None:
    """Int gradients gave zero updates (adam) or a torch error (lion), complex ones complex
    updates, sparse and None ones torch errors: each is refused, naming the leaf."""
    make, error, text = BAD_GRADIENTS[kind]
    params = {"w": torch.zeros(4, 3)}
    tx = ALIASES_WITH_STATE[name]()
    with pytest.raises(error, match=r"\['w'\]") as info:
        tx.update({"w": make()}, tx.init(params), params)
    assert text in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_shampoo_refuses_int_and_complex_gradients(dtype: torch.dtype) -> None:
    """An int gradient gave a zero update of dtype int64, a complex one a complex update."""
    params = {"w": torch.zeros(4, 3)}
    tx = opttx.shampoo(1e-2)
    with pytest.raises(TypeError, match=r"block_by_dims: the gradient\['w'\] "):
        tx.update({"w": torch.ones(4, 3, dtype=dtype)}, tx.init(params), params)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_galore_refuses_int_and_complex_gradients(dtype: torch.dtype) -> None:
    """An int gradient of a projected matrix gave a float64 update (the projection promoted
    it), silently."""
    params = {"w": torch.zeros(6, 5), "b": torch.zeros(5)}
    tx = opttx.galore_adamw(1e-2, rank=2)
    with pytest.raises(TypeError, match=r"project_lowrank: the gradient\['w'\]"):
        tx.update({"w": torch.ones(6, 5, dtype=dtype), "b": torch.ones(5)}, tx.init(params),
                  params)


@pytest.mark.parametrize("make", [
    lambda: opttx.adam(math.inf), lambda: opttx.sgd(math.inf),
    lambda: opttx.adamw(1e-3, weight_decay=math.inf), lambda: opttx.lion(1e-3, weight_decay=math.inf),
])
def test_infinite_learning_rate_or_weight_decay_is_refused(make) -> None:
    with pytest.raises(ValueError, match="must be finite, got inf"):
        make()


def test_inf_still_means_no_limit_where_it_is_meaningful() -> None:
    opttx.clip_by_global_norm(math.inf)
    opttx.shampoo(1e-3, max_preconditioner_dim=math.inf)


# ---------------------------------------------------------------------------------------------
# clear errors instead of crashes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, error, text", [
    (lambda count: None, TypeError, "returned NoneType"),
    (lambda count: "0.1", TypeError, "returned str"),
    (lambda count: torch.ones(1) * 0.1, ValueError, r"shape \(1,\)"),
])
def test_a_schedule_returning_no_number_is_refused_at_construction(schedule, error, text) -> None:
    with pytest.raises(error, match=f"learning_rate schedule {text}" if "shape" not in text
                       else text):
        opttx.adam(schedule)


def test_a_schedule_of_a_tensor_still_works() -> None:
    tx = opttx.adam(opttx.linear_schedule(0.1, 0.0, 10))
    params = {"w": torch.zeros(2)}
    updates, _ = tx.update({"w": torch.ones(2)}, tx.init(params), params)
    assert torch.allclose(updates["w"], torch.full((2,), -0.1))


def test_state_of_another_optimizer_is_refused() -> None:
    params = {"w": torch.zeros(4, 3)}
    tx = opttx.sgd(0.1, momentum=0.9)
    with pytest.raises(TypeError, match="made by scale_by_adam.*but this transform is trace"):
        tx.update({"w": torch.ones(4, 3)}, opttx.adam(0.1).init(params), params)


def test_state_none_is_refused_by_a_chain() -> None:
    params = {"w": torch.zeros(4, 3)}
    with pytest.raises(TypeError, match="got a state of type NoneType, expected the tuple"):
        opttx.adamw(1e-2).update({"w": torch.ones(4, 3)}, None, params)


def test_state_none_is_refused_by_a_moment_transform() -> None:
    params = {"w": torch.zeros(4, 3)}
    with pytest.raises(TypeError, match="got a state of type NoneType, expected ScaleByAdamState"):
        opttx.scale_by_adam().update({"w": torch.ones(4, 3)}, None, params)


def test_state_for_other_shapes_is_refused() -> None:
    params = {"w": torch.zeros(4, 3)}
    tx = opttx.adam(0.1)
    state = tx.init({"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4, 3\), expected \(2, 3\)"):
        tx.update({"w": torch.ones(4, 3)}, state, params)


# ---------------------------------------------------------------------------------------------
# the functional API and autograd
# ---------------------------------------------------------------------------------------------


def test_apply_updates_refuses_params_that_require_grad_in_grad_mode() -> None:
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    updates = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(ValueError, match=r"\['weight'\] requires grad"):
        opttx.apply_updates(params, updates)
    with torch.no_grad():
        out = opttx.apply_updates(params, updates)
    assert out["weight"].grad_fn is None
    detached = opttx.apply_updates({k: v.detach() for k, v in params.items()}, updates)
    assert torch.equal(detached["bias"], out["bias"])


@pytest.mark.parametrize("name", ["lars", "prodigy", "schedule_free_adamw", "adamw"])
def test_apply_updates_in_place_refuses_updates_with_autograd_history(name: str) -> None:
    """A step in grad mode on parameters that require grad: lars's trace, Prodigy's sums and
    Schedule-Free's z kept one more step of graph per step (state depth 51 after 50 steps);
    now apply_updates_ refuses the updates, and under no_grad the state has no graph."""
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    tx = getattr(opttx, name)(1e-2)
    state = tx.init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    updates, _ = tx.update(grads, state, params)
    with pytest.raises(ValueError, match=r"\['weight'\] carries autograd history"):
        opttx.apply_updates_(params, updates)
    with torch.no_grad():
        updates, state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
    assert all(x.grad_fn is None for x in opttx.tree.tree_leaves(state)
               if isinstance(x, torch.Tensor))


def test_apply_updates_differentiable_on_purpose() -> None:
    """differentiable=True: d/dp of sum((p - lr * p)^2) = 2 (1 - lr)^2 p."""
    p = torch.tensor([1.0, -2.0], requires_grad=True)
    new = opttx.apply_updates({"p": p}, {"p": -0.1 * p}, differentiable=True)
    (new["p"] ** 2).sum().backward()
    assert torch.allclose(p.grad, 2 * 0.81 * p.detach())


# ---------------------------------------------------------------------------------------------
# apply_if_finite(check_state=True): overflow inside the inner statistics
# ---------------------------------------------------------------------------------------------


def test_apply_if_finite_check_state_sees_an_overflow_in_the_statistics() -> None:
    """A finite gradient of 1e30 makes Adam's second moment inf in float32: the default
    applies the step (the element is then frozen, its update 0 for good); check_state
    skips it and keeps the state."""
    params = {"w": torch.zeros(2)}
    huge, clean = {"w": torch.tensor([1e30, 1.0])}, {"w": torch.ones(2)}
    plain = opttx.apply_if_finite(opttx.adam(0.1), 3)
    _, s = plain.update(huge, plain.init(params), params)
    assert torch.isinf(s.inner_state[0].nu["w"][0])
    u, _ = plain.update(clean, s, params)
    assert u["w"][0] == 0                                     # frozen
    checked = opttx.apply_if_finite(opttx.adam(0.1), 3, check_state=True)
    s0 = checked.init(params)
    u, s = checked.update(huge, s0, params)
    assert torch.equal(u["w"], torch.zeros(2)) and int(s.total_notfinite) == 1
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(s.inner_state),
                                                 tree_leaves(s0.inner_state)))
    u, s = checked.update(clean, s, params)
    ref, _ = opttx.adam(0.1).update(clean, opttx.adam(0.1).init(params), params)
    assert torch.equal(u["w"], ref["w"])


def test_apply_if_finite_check_state_compiles_to_the_same_numbers() -> None:
    params = {"w": torch.zeros(2)}
    tx = opttx.apply_if_finite(opttx.adam(0.1), 3, check_state=True)
    step = torch.compile(tx.update, fullgraph=True, backend="aot_eager")
    se, sc = tx.init(params), tx.init(params)
    for g in ([1e30, 1.0], [1.0, 1.0], [float("nan"), 1.0], [0.5, -1.0]):
        grads = {"w": torch.tensor(g)}
        ue, se = tx.update(grads, se, params)
        uc, sc = step(grads, sc, params)
        torch.testing.assert_close(uc, ue)              # float32 rounding: other kernels
        torch.testing.assert_close(tree_leaves(sc), tree_leaves(se))
    assert int(sc.total_notfinite) == 2


# ---------------------------------------------------------------------------------------------
# FusedBackward
# ---------------------------------------------------------------------------------------------


def test_fused_backward_refuses_a_transform_across_leaves() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="across leaves"):
        opttx.FusedBackward(model, opttx.chain(opttx.clip_by_global_norm(1.0), opttx.sgd(0.1)))


def test_fused_backward_previous_clipping_survives_a_nan_step() -> None:
    """A NaN gradient norm must not carry into the next step's clip coefficient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    runner = opttx.FusedBackward(model, opttx.sgd(0.1), clip_grad_norm=1.0)
    x = torch.randn(4, 3)
    runner.backward(model(x).square().sum())
    coef = runner.clip_coef.clone()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    runner.backward(model(x).square().sum())
    assert torch.isnan(runner.grad_norm) and torch.equal(runner.clip_coef, coef)
    with torch.no_grad():
        model.weight.copy_(torch.randn(2, 3))
        model.bias.zero_()
    runner.backward(model(x).square().sum())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fused_backward_refuses_a_sparse_gradient() -> None:
    model = torch.nn.Embedding(5, 3, sparse=True)
    runner = opttx.FusedBackward(model, opttx.adalomo(1e-3))
    with pytest.raises(TypeError, match="gradient of 'weight' is a torch.sparse_coo tensor"):
        runner.backward(model(torch.tensor([0, 2])).sum())


def test_fused_backward_state_dict_is_a_snapshot() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    runner = opttx.FusedBackward(model, opttx.adamw(1e-2))
    x = torch.randn(4, 3)
    runner.backward(model(x).square().sum())
    saved = runner.state_dict()
    kept = copy.deepcopy(saved)
    runner.backward(model(x).square().sum())
    assert not _same(runner.state_dict(), kept)
    assert _same(saved, kept)


def test_fused_backward_load_state_dict_is_all_or_nothing() -> None:
    """A state for another shape of the second parameter is refused before the first
    parameter's state is written."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    runner = opttx.FusedBackward(model, opttx.adamw(1e-2))
    runner.backward(model(torch.randn(4, 3)).square().sum())
    before = runner.state_dict()
    bad = runner.state_dict()
    leaves, spec = tree_flatten(bad["states"]["weight"])
    bad["states"]["weight"] = spec.unflatten([x + 1 for x in leaves])
    bad["states"]["bias"] = opttx.adamw(1e-2).init({"bias": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"'bias'.*\(5,\).*\(2,\)"):
        runner.load_state_dict(bad)
    assert _same(runner.state_dict(), before)


# ---------------------------------------------------------------------------------------------
# Optimizer.load_state_dict
# ---------------------------------------------------------------------------------------------


def _stepped_optimizer() -> tuple[torch.nn.Module, opttx.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = opttx.Optimizer([{"params": model[0].parameters()},           # generators
                           {"params": model[1].parameters()}], opttx.adam, lr=1e-2)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def _entry(sd: dict, group: int, part: str) -> tuple:
    for key in sd["param_groups"][group]["params"]:
        for name in sd["state"][key]:
            if name.endswith(part):
                return key, name
    raise AssertionError(part)


@pytest.mark.parametrize("part, cast, text", [
    ("mu", torch.int64, "torch.int64, expected (2, 3) torch.float32"),
    ("count", torch.float32, "torch.float32, expected () torch.int32"),
])
def test_optimizer_load_state_dict_refuses_another_dtype(part: str, cast: torch.dtype,
                                                         text: str) -> None:
    _, opt = _stepped_optimizer()
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    key, name = _entry(bad, 0, part)
    bad["state"][key][name] = bad["state"][key][name].to(cast)
    with pytest.raises(ValueError, match=name) as info:
        opt.load_state_dict(bad)
    assert text in str(info.value)


def test_optimizer_load_state_dict_is_all_or_nothing() -> None:
    """A mismatch in the second group leaves the first group's state as it was."""
    _, opt = _stepped_optimizer()
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    for key in bad["param_groups"][0]["params"]:
        bad["state"][key] = {k: v + 1 if v.is_floating_point() else v
                             for k, v in bad["state"][key].items()}
    key, name = _entry(bad, 1, "nu")
    bad["state"][key][name] = torch.zeros(7)
    with pytest.raises(ValueError, match="param group 1"):
        opt.load_state_dict(bad)
    now = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(sd["state"]),
                                                 tree_leaves(now["state"])))


def test_optimizer_load_state_dict_without_param_groups() -> None:
    _, opt = _stepped_optimizer()
    with pytest.raises(ValueError, match="'state' and 'param_groups'.*got keys \\['state'\\]"):
        opt.load_state_dict({"state": opt.state_dict()["state"]})


def test_optimizer_empty_checkpoint_file_loads_nothing(tmp_path) -> None:
    _, opt = _stepped_optimizer()
    before = copy.deepcopy(opt.state_dict())
    (tmp_path / "opt.pt").write_bytes(b"")
    with pytest.raises(EOFError):
        opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    assert _same(opt.state_dict(), before)


def test_optimizer_group_lr_must_be_a_number() -> None:
    _, opt = _stepped_optimizer()
    with pytest.raises(TypeError, match="param group 'lr' must be a number"):
        opt.param_groups[0]["lr"] = "1e-3"


# ---------------------------------------------------------------------------------------------
# checkpoints load with torch.load(weights_only=True)
# ---------------------------------------------------------------------------------------------


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _same(a, b) -> bool:
    """Same structure (NamedTuple types included), same leaves (NaN equal to NaN)."""
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    return sa == sb and all(
        x.dtype == y.dtype and x.shape == y.shape and bool((x == y).logical_or(
            x.isnan() & y.isnan() if x.is_floating_point() else x != x).all())
        if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


@pytest.mark.parametrize("name", ["adamw", "adafactor", "shampoo", "adamw_8bit",
                                  "galore_adamw", "came", "lion"])
def test_functional_state_loads_with_weights_only(name: str) -> None:
    torch.manual_seed(0)
    params = {"w": torch.randn(16, 8), "b": torch.randn(8)}
    tx = opttx.inject_hyperparams(getattr(opttx, name))(learning_rate=1e-3)
    tx = opttx.apply_if_finite(tx, 3)
    state = tx.init(params)
    _, state = tx.update({k: torch.randn_like(v) for k, v in params.items()}, state, params)
    loaded = _roundtrip(state)
    assert _same(loaded, state)          # NamedTuple types and structure kept
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    assert _same(tx.update(grads, loaded, params)[0], tx.update(grads, state, params)[0])


def test_fused_backward_and_optimizer_state_dicts_load_with_weights_only() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    runner = opttx.FusedBackward(model, opttx.adalomo(1e-3))
    runner.backward(model(torch.randn(4, 3)).square().sum())
    assert _same(_roundtrip(runner.state_dict()), runner.state_dict())
    _, opt = _stepped_optimizer()
    assert _same(_roundtrip(opt.state_dict()), opt.state_dict())


# ---------------------------------------------------------------------------------------------
# examples/resume_after_kill.py validates its `latest` marker
# ---------------------------------------------------------------------------------------------


def _resume_example():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "resume_after_kill.py"
    spec = importlib.util.spec_from_file_location("resume_after_kill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("marker, text", [
    ("../elsewhere/step_4", "not a step_N name"),
    ("", "not a step_N name"),
    ("step_8", "no .metadata"),              # named, but never completed
])
def test_resume_example_refuses_a_bad_latest_marker(tmp_path, marker: str, text: str) -> None:
    example = _resume_example()
    (tmp_path / "step_8").mkdir()
    (tmp_path / "latest").write_text(marker)
    with pytest.raises(SystemExit, match=text):
        example.latest(tmp_path)


def test_resume_example_reads_a_good_latest_marker(tmp_path) -> None:
    example = _resume_example()
    assert example.latest(tmp_path) is None
    (tmp_path / "step_12").mkdir()
    (tmp_path / "step_12" / ".metadata").write_bytes(b"")
    (tmp_path / "latest").write_text("step_12\n")
    assert example.latest(tmp_path) == tmp_path / "step_12"
    assert example.checkpoint_step(tmp_path / "step_12") == 12


def test_optimizer_load_state_dict_refuses_a_str_lr_before_writing() -> None:
    _, opt = _stepped_optimizer()
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    for key in bad["param_groups"][0]["params"]:
        bad["state"][key] = {k: v + 1 if v.is_floating_point() else v
                             for k, v in bad["state"][key].items()}
    bad["param_groups"][1]["lr"] = "0.1"
    with pytest.raises(TypeError, match="param group 'lr' must be a number"):
        opt.load_state_dict(bad)
    assert _same(opt.state_dict(), sd)


# ---------------------------------------------------------------------------------------------
# named errors instead of torch's (shapes of another state, configurations, arguments)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, make", [
    ("ProdigyState", lambda: opttx.prodigy()),
    ("ScheduleFreeState.z", lambda: opttx.schedule_free_sgd(1.0)),
    ("ScheduleFreeState.z", lambda: opttx.schedule_free_adamw(1e-3)),
])
def test_a_state_of_other_shapes_is_refused_naming_the_leaf(name, make) -> None:
    """Prodigy and Schedule-Free given the state of parameters of other shapes: the named
    ValueError of the other moment transforms (before: torch's broadcasting RuntimeError in
    the kernels), also for a broadcastable (1, 3) state against (4, 3)."""
    tx = make()
    grads = {"w": torch.ones(4, 3)}
    for other in ({"w": torch.ones(5, 3)}, {"w": torch.ones(1, 3)}):
        state = tx.init(other)
        with pytest.raises(ValueError, match=rf"{name}.*gradient\['w'\] has shape \(4, 3\), "
                                             rf"expected \({other['w'].shape[0]}, 3\)"):
            tx.update(grads, state, {"w": torch.ones(4, 3)})


@pytest.mark.parametrize("make", [
    lambda dim: opttx.shampoo(1e-3, max_preconditioner_dim=dim),
    lambda dim: opttx.block_by_dims(opttx.precondition_eigenvalue_corrected(0.95, 1e-8, 10),
                                    max_preconditioner_dim=dim),
])
def test_a_state_of_another_block_configuration_is_refused_naming_it(make) -> None:
    """shampoo(max_preconditioner_dim=4).update with shampoo(max_preconditioner_dim=8)'s
    state (and the reverse; block_by_dims over SOAP's preconditioner alike; opttx.soap's own
    max_precond_dim is in its preconditioner's stamp, refused by identity): a ValueError
    naming this configuration and the blocks it cuts (before: "structures differ ... tuple
    vs tuple"); a state of the right configuration still steps."""
    p = {"w": torch.randn(8, 8)}
    g = {"w": torch.randn(8, 8)}
    with pytest.raises(ValueError, match=r"block_by_dims\(max_preconditioner_dim=4, .*does not "
                                         r"hold this configuration's blocks \(it cuts \['w'\] "
                                         r"\(8, 8\) into 4 blocks.*another block configuration"):
        make(4).update(g, make(8).init(p), p)
    with pytest.raises(ValueError, match=r"max_preconditioner_dim=8, .*it cuts every leaf "
                                         r"into one block"):
        make(8).update(g, make(4).init(p), p)
    u, _ = make(4).update(g, make(4).init(p), p)
    assert torch.isfinite(u["w"]).all()


@pytest.mark.parametrize("size", [float("inf"), float("nan"), -1.0, 0])
def test_offload_chunk_size_must_be_a_finite_positive_number(size) -> None:
    """offload(..., chunk_size_mb=inf) gave OverflowError from int(inf) in the chunk plan;
    now a ValueError naming the argument (NaN, 0 and negative sizes as before)."""
    from opttx.distributed import offload, offload_plan
    with pytest.raises(ValueError, match="chunk_size_mb must be"):
        offload(opttx.adamw(1e-3), chunk_size_mb=size)
    with pytest.raises(ValueError, match="chunk_size_mb must be"):
        offload_plan({"w": torch.ones(4)}, opttx.adamw(1e-3), chunk_size_mb=size)


def test_a_user_factory_configuration_is_checked_where_it_reaches_the_state() -> None:
    """A declared factory of a user over opttx's chain (as in `opttx.extend.declare`'s docstring,
    with ``decay`` left as configuration): functionally, ``update`` checks the stamps of the
    transforms that built the state, so ``nesterov`` (trace's configuration) is refused
    naming both values, while ``decay`` (trace's hyperparameter) is accepted: the state fits
    either. `Optimizer.load_state_dict` compares the factory's whole configuration and
    refuses both. A user transform whose state has ``made_by`` is checked on its own
    configuration functionally too. The documented behaviour (declare's docstring,
    docs/design.md section 3)."""
    from typing import NamedTuple

    @opttx.extend.declare(hyperparams={"learning_rate": opttx.extend.HyperRole.LEARNING_RATE})
    def my_momentum(learning_rate: float, decay: float = 0.9, nesterov: bool = False):
        return opttx.chain(opttx.trace(decay, nesterov),
                           opttx.scale_by_learning_rate(learning_rate))

    p = {"w": torch.ones(3)}
    with pytest.raises(TypeError, match=r"trace\(nesterov=False.*nesterov: False vs True"):
        my_momentum(0.1, nesterov=True).update(p, my_momentum(0.1).init(p), p)
    my_momentum(0.1, decay=0.5).update(p, my_momentum(0.1).init(p), p)       # accepted
    for other in ({"nesterov": True}, {"decay": 0.5}):
        w = torch.nn.Parameter(torch.ones(3))
        w.grad = torch.ones(3)
        saved = opttx.Optimizer([w], my_momentum(0.1))
        saved.step()
        with pytest.raises(ValueError, match="was made by .*my_momentum"):
            opttx.Optimizer([w], my_momentum(0.1, **other)).load_state_dict(saved.state_dict())

    class ScaledState(NamedTuple):
        count: torch.Tensor
        made_by: opttx.extend.Static = opttx.extend.Static()
        __roles__ = opttx.extend.declare_roles(count=opttx.extend.Role.COUNT)

    @opttx.extend.declare()
    def my_scale(factor: float = 2.0) -> opttx.GradientTransformation:
        def init(params):
            return ScaledState(count=torch.zeros((), dtype=torch.int32))

        def update(updates, state, params=None):
            return ({k: v * factor for k, v in updates.items()},
                    state._replace(count=state.count + 1))
        return opttx.GradientTransformation(init, update)

    with pytest.raises(TypeError, match=r"my_scale\(factor=3.0\).*factor: 3.0 vs 2.0"):
        my_scale(2.0).update(p, my_scale(3.0).init(p), p)
