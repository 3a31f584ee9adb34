"""A whole train step — torch.func.grad_and_value over functional_call, tx.update,
apply_updates — compiles with fullgraph=True to one graph and does not recompile over 10
steps, for every alias with a warmup-cosine learning rate, and for the wrappers whose
control flow depends on tensor values (torch.cond inside the graph)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import functional_call, grad_and_value

import opttx
from opttx.testing import assert_trees_close

@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty compile caches (they are keyed by code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


SCHEDULE = opttx.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=10)

ALIASES = {
    "sgd": lambda lr: opttx.sgd(lr),
    "sgd_nesterov": lambda lr: opttx.sgd(lr, momentum=0.9, nesterov=True),
    "adam": lambda lr: opttx.adam(lr),
    "adamw": lambda lr: opttx.adamw(lr, weight_decay=0.1,
                                    mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    "nadam": lambda lr: opttx.nadam(lr),
    "nadam_torch": lambda lr: opttx.nadam(lr, momentum_decay=4e-3),
    "adagrad": lambda lr: opttx.adagrad(lr),
    "rmsprop": lambda lr: opttx.rmsprop(lr, centered=True, momentum=0.9),
    "lion": lambda lr: opttx.lion(lr),
    "adafactor": lambda lr: opttx.adafactor(lr, min_dim_size_to_factor=4, momentum=0.9,
                                            weight_decay_rate=0.01),
    "adafactor_transformers": lambda lr: opttx.adafactor(
        relative_step=True, warmup_init=True, factor_axes="last", min_dim_size_to_factor=1,
        momentum=0.9, weight_decay_rate=0.01, weight_decay_scaled_by_lr=True),
    "adafactor_torch": lambda lr: opttx.adafactor(
        opttx.relative_step_schedule(1e-2), min_dim_size_to_factor=1, eps=0.0,
        eps_clamp=1e-7, factor_axes="last", weight_decay_rate=1e-3),
    "came": lambda lr: opttx.came(lr, weight_decay=0.01),
    "lamb": lambda lr: opttx.lamb(lr, weight_decay=0.01,
                                  trust_ratio_mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    "lars": lambda lr: opttx.lars(lr, weight_decay=1e-4),
    "clip_chain": lambda lr: opttx.chain(opttx.clip_by_global_norm(1.0),
                                         opttx.clip_by_block_rms(1.0), opttx.adam(lr)),
    "apply_if_finite": lambda lr: opttx.apply_if_finite(opttx.adam(lr), 3),
    "multi_steps": lambda lr: opttx.MultiSteps(opttx.adam(lr), 2).gradient_transformation(),
    "inject": lambda lr: opttx.inject_hyperparams(opttx.adamw)(learning_rate=lr),
    "inject_adafactor": lambda lr: opttx.inject_hyperparams(opttx.adafactor)(
        learning_rate=lr, min_dim_size_to_factor=4, weight_decay_rate=1e-3),
    "adalomo": lambda lr: opttx.adalomo(lr, weight_decay=0.01),
    "galore_adamw": lambda lr: opttx.galore_adamw(lr, rank=2, update_proj_gap=3,
                                                  weight_decay=0.01),
    "adamw_8bit": lambda lr: opttx.adamw_8bit(lr, min_size=64),
    "flatten_adamw": lambda lr: opttx.flatten(opttx.adamw(lr, weight_decay=0.1)),
}


def graphs_of(fn) -> int:
    """Compiled graphs cached for ``fn``'s code: 1 means one graph and no recompile.

    (A compile counter backend can be called twice for one graph when Dynamo restarts its
    analysis to turn a Python scalar into a tensor; the cache holds what was kept.)
    """
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def make_step(model: torch.nn.Module, tx: opttx.GradientTransformation):
    def loss_fn(params, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    def step(params, state, x, y):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return opttx.apply_updates(params, updates), state, loss

    return step


def batches(n: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
            for _ in range(n)]


@pytest.mark.parametrize("name", list(ALIASES))
@torch._dynamo.config.patch(error_on_recompile=True)
def test_train_step_is_one_graph_without_recompiles(name: str) -> None:
    model = make_model()
    tx = ALIASES[name](SCHEDULE)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    counter = CompileCounterWithBackend("aot_eager")
    step = make_step(model, tx)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_params, eager_state = params, state
    for x, y in batches(10):
        params, state, _ = compiled(params, state, x, y)
        eager_params, eager_state, _ = step(eager_params, eager_state, x, y)
    assert counter.frame_count >= 1 and graphs_of(step) == 1, f"{name}: {graphs_of(step)} graphs"
    assert_trees_close(params, eager_params, rtol=1e-5, what=f"{name} params")


def test_changing_injected_hyperparameters_does_not_recompile() -> None:
    model = make_model()
    tx = opttx.inject_hyperparams(opttx.adamw)(learning_rate=1e-2, weight_decay=0.01)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    counter = CompileCounterWithBackend("aot_eager")
    step = make_step(model, tx)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i, (x, y) in enumerate(batches(6)):
        opttx.set_hyperparams_(state, learning_rate=1e-2 / (i + 1), b1=0.9 - 0.1 * i,
                               weight_decay=0.01 * (i + 1))
        params, state, _ = compiled(params, state, x, y)
    assert counter.frame_count >= 1 and graphs_of(step) == 1
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-2 / 6)


def test_in_place_compiled_step_matches_eager() -> None:
    """The in-place form (apply_updates_ and tree_copy_ on the inputs) used for real runs."""
    model = make_model()
    tx = opttx.adamw(SCHEDULE, weight_decay=0.1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    ref_params, ref_state = dict(params), tx.init(params)
    loss_fn = make_step(model, tx)

    def step_(params, state, x, y):
        new_params, new_state, loss = loss_fn(params, state, x, y)
        opttx.tree_copy_(params, new_params)
        opttx.tree_copy_(state, new_state)
        return loss

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step_, backend=counter, fullgraph=True)
    buffers = [t.data_ptr() for t in opttx.tree.tree_leaves((params, state))]
    for x, y in batches(5):
        compiled(params, state, x, y)
        ref_params, ref_state, _ = loss_fn(ref_params, ref_state, x, y)
    assert counter.frame_count >= 1 and graphs_of(step_) == 1
    assert buffers == [t.data_ptr() for t in opttx.tree.tree_leaves((params, state))]
    assert_trees_close(params, ref_params, rtol=1e-6)
    assert_trees_close(state, ref_state, rtol=1e-6)


def test_inductor_step_equals_eager() -> None:
    """One small real Inductor compile: its numbers equal eager's."""
    model = make_model()
    tx = opttx.adamw(SCHEDULE, weight_decay=0.1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    step = make_step(model, tx)
    compiled = torch.compile(step, fullgraph=True)
    p_c, s_c = params, tx.init(params)
    p_e, s_e = params, tx.init(params)
    for x, y in batches(3):
        p_c, s_c, loss_c = compiled(p_c, s_c, x, y)
        p_e, s_e, loss_e = step(p_e, s_e, x, y)
    assert_trees_close(p_c, p_e, rtol=1e-5)
    assert_trees_close(s_c, s_e, rtol=1e-5)


def test_marked_static_in_place_step_compiles_once_and_matches_eager() -> None:
    params = {"w": torch.randn(6, 4), "b": torch.zeros(4)}
    eager = {k: v.clone() for k, v in params.items()}
    tx = opttx.adamw(SCHEDULE, weight_decay=0.1)
    state, eager_state = tx.init(params), tx.init(eager)
    opttx.tree.mark_static_(params, state)

    def step(params, state, grads):
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        opttx.tree_copy_(state, new_state)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
            compiled(params, state, grads)
            step(eager, eager_state, grads)
    assert graphs_of(step) == 1 and counter.frame_count == 1
    assert_trees_close(params, eager, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# device scalars stay on the device (no sync per step, CUDA graphs possible)
# ---------------------------------------------------------------------------------------------

# their branch is a torch.cond on a tensor predicate, which the host must read to take it
HOST_BRANCHING = {"apply_if_finite", "multi_steps", "galore_adamw"}


def _in_place_step(tx):
    def step(params, state, grads):
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        opttx.tree_copy_(state, new_state)
    return step


@pytest.mark.parametrize("pattern, instead", [
    (r"[\w)\]]\._replace\(", "opttx.base.replace_state"),
    (r"\blocals\(\)", "the names spelled out"),
])
def test_no_construct_that_torch_211_cannot_trace(pattern: str, instead: str) -> None:
    """Constructs that torch 2.11's Dynamo mishandles, kept out of ``opttx/`` (pyproject
    allows torch >= 2.11; CI runs 2.13, which traces both, so only the source can show a
    regression). ``NamedTuple._replace``: the tuple leaves the graph *empty*, so a compiled
    step returning its state returned ``TraceState()``; ``locals()``: not traceable, and
    ``inject_hyperparams`` calls factories such as ``shampoo`` inside the compiled step."""
    import pathlib
    import re
    root = pathlib.Path(opttx.__file__).parent
    calls = [f"{path.relative_to(root)}:{i}" for path in sorted(root.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(pattern, line.split("#")[0].split("``")[0])]
    assert calls == [], f"{pattern} in {calls}: use {instead}"


def test_replace_state_keeps_every_field_and_rejects_unknown_ones() -> None:
    from opttx.base import replace_state
    from opttx.transforms.moments import ScaleByAdamState
    state = ScaleByAdamState(count=torch.tensor(3), mu={"w": 1}, nu={"w": 2})
    new = replace_state(state, nu={"w": 5})
    assert type(new) is ScaleByAdamState and new == state._replace(nu={"w": 5})
    with pytest.raises(TypeError, match="no field"):
        replace_state(state, velocity=1)


@pytest.mark.parametrize("name", [n for n in ALIASES if n not in HOST_BRANCHING])
def test_compiled_step_reads_no_device_scalar_back_to_the_host(name: str) -> None:
    """Off the CPU a 0-dim coefficient (a bias correction, an injected hyperparameter) given
    to a grouped kernel's Scalar overload is read back with ``.item()``: a sync per step and
    no CUDA graph. Traced on the meta device (tensors without data, where such a read raises),
    the compiled optimizer step holds no read."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    params = {"w": torch.randn(8, 4, device="meta"), "b": torch.randn(4, device="meta")}
    tx = ALIASES[name](SCHEDULE)
    state = tx.init(params)
    reads = []

    def forward_compiler(gm, inputs):
        reads.extend(str(n.meta.get("stack_trace", "")).strip().splitlines()[-1:]
                     for n in gm.graph.nodes
                     if n.target is torch.ops.aten._local_scalar_dense.default)
        return make_boxed_func(gm.forward)

    step = torch.compile(_in_place_step(tx), fullgraph=True,
                         backend=aot_autograd(fw_compiler=forward_compiler))
    step(params, state, {k: torch.randn_like(v) for k, v in params.items()})
    assert not reads, f"{name} reads device scalars back at: {reads}"


def test_device_scalar_path_equals_eager(monkeypatch) -> None:
    """The List-overload form `device_scalar` gives a 0-dim coefficient off the CPU, run
    here on the CPU by declaring no device host-readable: Inductor's lowering of it gives
    the same numbers as eager."""
    monkeypatch.setattr(opttx.kernels, "HOST_READABLE_DEVICES", ())
    tx = opttx.partition(
        {"adamw": opttx.adamw(SCHEDULE, weight_decay=0.1),
         "adafactor": opttx.inject_hyperparams(opttx.adafactor)(
             learning_rate=1e-2, min_dim_size_to_factor=2, momentum=0.9),
         "lion": opttx.inject_hyperparams(opttx.lion)(learning_rate=1e-3, b1=0.9)},
        {"a": "adamw", "f": "adafactor", "l": "lion"})
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(6, 4, generator=gen) for k in "afl"}
    eager_params = {k: v.clone() for k, v in params.items()}
    state, eager_state = tx.init(params), tx.init(eager_params)
    step = _in_place_step(tx)
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(3):
        grads = {k: torch.randn(6, 4, generator=gen) for k in "afl"}
        compiled(params, state, grads)
        step(eager_params, eager_state, grads)
    assert_trees_close(params, eager_params, rtol=1e-6)
