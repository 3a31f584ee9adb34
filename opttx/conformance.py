"""The transform contract as checks you can run on your own transform (docs/design.md,
section 5).

opttx's conformance registry (``tests/registry.py``) runs these same checks over every
public transform; `check_transform` runs them over yours:

    >>> from opttx.testing import check_transform
    >>> check_transform(lambda: opttx.lion(1e-3), factory=opttx.lion,
    ...                 kwargs={"learning_rate": 1e-3})

Each check takes a function that builds a fresh transform (``make``) and raises
``AssertionError`` (or the transform's own error) naming what broke. The distributed
properties (``sharded`` and ``zero`` equal to one device) need processes:
`opttx.testing.assert_shard_invariant` runs them.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import torch

from .base import GradientTransformation, traits_of
from .closeness import assert_trees_close, gradient_stream
from .kernels import donating
from .tree import MaskedNode, PyTree, find_instances, tree_flatten, tree_leaves, tree_map

__all__ = ["CHECKS", "check_transform", "check_purity", "check_tree_without_leaves",
           "check_state_structure_and_dtypes", "check_float64_determinism",
           "check_one_compiled_graph", "check_injected_hyperparameters",
           "check_stacked", "check_checkpoint_round_trip", "check_errors",
           "check_donation", "check_compile_on_another_thread", "check_degenerate_shapes",
           "check_nonfinite_gradients", "check_no_aliasing", "NONFINITE_BEHAVIOURS",
           "check_optimizer_resume",
           "standard_params", "leaves_0d_to_4d", "degenerate_params"]

Make = Callable[[], GradientTransformation]
STEPS = 3


def standard_params(dtype: torch.dtype = torch.float32, seed: int = 0,
                    matrices_only: bool = False) -> dict[str, torch.Tensor]:
    """A matrix, a vector (left out with ``matrices_only``), a 3-D leaf and a second matrix
    of the first one's shape (so that `opttx.stacked` has a stack of two)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w": (6, 5), "b": (5,), "t": (2, 3, 4), "v": (6, 5)}
    if matrices_only:
        del shapes["b"]
    return {k: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)
            for k, s in shapes.items()}


def leaves_0d_to_4d(seed: int = 0, matrices_only: bool = False) -> dict[str, torch.Tensor]:
    """A 0-D to a 4-D leaf (2-D to 4-D with ``matrices_only``), two matrices of one shape, and
    a tall one: the shapes whose special cases a transform may take."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"s": (), "b": (5,), "w": (6, 5), "v": (6, 5), "tall": (7, 3), "t": (2, 3, 4),
              "q": (2, 3, 2, 2)}
    if matrices_only:
        del shapes["s"], shapes["b"]
    return {k: torch.randn(s, generator=gen, dtype=torch.float64).float()
            for k, s in shapes.items()}


def _gradients(params: PyTree, steps: int, seed: int) -> list[PyTree]:
    return gradient_stream(params, steps, seed=seed)


def _close(actual: Any, expected: Any, rtol: float, what: str, atol: float = 0.0) -> None:
    assert_trees_close(actual, expected, rtol=rtol, atol=atol, what=what)


def _run(tx: GradientTransformation, params: PyTree, grads: list, state: Any = None
         ) -> tuple[PyTree, Any]:
    from .base import apply_updates
    state = tx.init(params) if state is None else state
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = apply_updates(params, updates)
    return params, state


def _run_donating(tx: GradientTransformation, params: PyTree, grads: list) -> tuple[Any, Any]:
    """``_run``'s steps inside `donating`, the updates applied in place (`apply_updates_`)
    to a copy of ``params``: (final params, final state)."""
    from .base import apply_updates_
    params, state = _clone(params), tx.init(params)
    for g in grads:
        with donating():
            updates, state = tx.update(g, state, params)
        apply_updates_(params, updates)
    return params, state


def _run_folded(tx: GradientTransformation, params: PyTree, grads: list) -> tuple[Any, Any]:
    """``_run`` with the final scale in the parameter write (`update_deferring_scale`, then
    `apply_updates` with ``scale``): what ``Optimizer(..., fold_learning_rate=True)`` runs."""
    from .base import apply_updates, update_deferring_scale
    state = tx.init(params)
    for g in grads:
        updates, state, scale = update_deferring_scale(tx, g, state, params)
        params = apply_updates(params, updates, scale=scale)
    return params, state


def _clone(tree: Any) -> Any:
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _signature(tree: Any) -> tuple:
    leaves, spec = tree_flatten(tree)
    return spec, [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
                  for x in leaves]


# ---------------------------------------------------------------------------------------------
# the properties
# ---------------------------------------------------------------------------------------------


def check_purity(make: Make, params: PyTree | None = None, name: str = "transform") -> None:
    """``update`` writes into none of the updates, state or params it is given."""
    params = standard_params() if params is None else params
    tx = make()
    state = tx.init(params)
    from .base import apply_updates
    for g in _gradients(params, STEPS, 1):
        before = _clone((g, state, params))
        updates, new_state = tx.update(g, state, params)
        _close((g, state, params), before, 0.0, f"{name} inputs")
        state, params = new_state, apply_updates(params, updates)


def check_tree_without_leaves(make: Make, name: str = "transform") -> None:
    """A rank with no leaf of its own (``zero``, ``on_owners``): init and update run, nothing
    to compute, the result keeps the tree."""
    empty = {"w": MaskedNode()}
    tx = make()
    state = tx.init(empty)
    for _ in range(2):
        updates, state = tx.update(empty, state, empty)
        assert list(updates) == ["w"] and not tree_leaves(updates), name


def check_state_structure_and_dtypes(make: Make, params_of: Callable[[torch.dtype], PyTree]
                                     | None = None, name: str = "transform") -> None:
    """The state after steps has the structure, shapes and dtypes of the state at init (a
    compiled step, donation and checkpoints rely on it); with bfloat16 params the floating
    statistics are float32 (rule 3) and the updates come back in the params' dtype."""
    params_of = params_of or (lambda dtype: standard_params(dtype))
    for dtype in (torch.float32, torch.bfloat16):
        tx = make()
        params = params_of(dtype)
        state0 = tx.init(params)
        updates, state = None, state0
        for g in _gradients(params, STEPS, 2):
            updates, state = tx.update(g, state, params)
        assert _signature(state) == _signature(state0), \
            f"{name}: the state changed its structure, shapes or dtypes in a step"
        for p, u in zip(tree_leaves(params), tree_leaves(updates)):
            assert u.dtype == p.dtype and u.shape == p.shape, (name, u.dtype, u.shape)
        if dtype == torch.bfloat16:
            # quantize_state's compressed statistics (bfloat16 values, bfloat16 scales at 4
            # bits) are stored so on request, declared as such by their layouts
            from .transforms.state_formats import CorrectedTensor, QuantizedTensor
            chosen = lambda node: isinstance(node, (QuantizedTensor, CorrectedTensor))  # noqa
            low = [x for x in tree_leaves(state, is_leaf=chosen) if isinstance(x, torch.Tensor)
                   and x.dtype in (torch.bfloat16, torch.float16)]
            assert not low, f"{name}: 16-bit state tensors {[x.shape for x in low]}"


def check_float64_determinism(make: Make, params: PyTree | None = None,
                              name: str = "transform") -> None:
    """Two float64 runs of the same steps are bitwise equal."""
    params = standard_params(torch.float64) if params is None else params
    grads = _gradients(params, STEPS, 3)
    _close(_run(make(), params, grads), _run(make(), params, grads), 0.0, name)


def _compiled_run(tx: GradientTransformation, params: PyTree, grads: list,
                  hyper: Callable | None = None) -> tuple:
    from torch._dynamo.testing import CompileCounter

    from .base import apply_updates
    counter = CompileCounter()

    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return apply_updates(params, updates), state

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    state = tx.init(params)
    eager_params, eager_state = params, tx.init(params)
    for i, g in enumerate(grads):
        if hyper is not None:
            hyper(state, i)
            hyper(eager_state, i)
        params, state = compiled(params, state, g)
        eager_params, eager_state = step(eager_params, eager_state, g)
    return counter, (params, state), (eager_params, eager_state)


def check_one_compiled_graph(make: Make, params: PyTree | None = None,
                             name: str = "transform") -> None:
    """Steps in one ``torch.compile(fullgraph=True)`` function (Dynamo only): one graph, no
    recompile across steps, and the eager numbers (rtol 1e-6)."""
    params = standard_params() if params is None else params
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            counter, compiled, eager = _compiled_run(make(), params,
                                                     _gradients(params, STEPS, 4))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1, f"{name}: {counter.frame_count} graphs"
    _close(compiled, eager, 1e-6, name)


def check_injected_hyperparameters(factory: Callable[..., GradientTransformation],
                                   kwargs: dict, params: PyTree | None = None,
                                   name: str = "transform") -> bool:
    """``inject_hyperparams(factory)(**kwargs)`` compiled: changing every injected value
    between steps recompiles nothing, and the numbers are eager's. Returns False when the
    factory injects nothing (no numeric hyperparameter)."""
    from .wrappers import inject_hyperparams
    params = standard_params() if params is None else params
    tx = inject_hyperparams(factory)(**kwargs)
    injected = list(tx.init(params).hyperparams)
    if not injected:
        return False

    def hyper(state, i):
        for key in injected:
            value = state.hyperparams[key]
            state.hyperparams[key].copy_(value * (1 - 0.01 * (i + 1)))

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            counter, compiled, eager = _compiled_run(tx, params,
                                                     _gradients(params, STEPS, 5), hyper)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1, f"{name}: {counter.frame_count} graphs"
    _close(compiled, eager, 1e-6, name)
    return True


def check_stacked(make: Make, params: PyTree | None = None, refused: bool = False,
                  name: str = "transform") -> None:
    """Per-leaf transforms (declared ``Traits.per_leaf``, no statistic across leaves) give
    their per-leaf numbers on `opttx.stacked` slices; the others are refused when
    ``stacked`` is built. ``refused``: the transform is known not to run under vmap (it
    must raise)."""
    from .stacked import StackedParams, stacked
    params = standard_params() if params is None else params
    traits = traits_of(make())
    stack = StackedParams(params)
    grads = _gradients(params, STEPS, 6)
    if not traits.per_leaf or traits.across_leaves:
        try:
            stacked(make())
        except NotImplementedError as e:
            assert "per_leaf" in str(e) or "across leaves" in str(e), f"{name}: {e}"
            return
        raise AssertionError(f"{name}: stacked accepted a transform that is not per-leaf")
    if torch.__version__ < "2.13" and _holds_quantized(make().init(params)):
        return      # the vmap of older torch has no batching rule for the codes' view(dtype)
    if refused:
        try:
            _run(stacked(make()), stack.buffers, [stack.stack(g) for g in grads])
        except (NotImplementedError, ValueError, RuntimeError):
            return
        raise AssertionError(f"{name}: stacked ran a transform said to be refused")
    per_leaf, _ = _run(make(), params, grads)
    buffers, _ = _run(stacked(make()), stack.buffers, [stack.stack(g) for g in grads])
    # vmap runs one batched kernel over the stack (a batched eigh, a batched matmul) where
    # the per-leaf run calls it per matrix, and the slices of a stack are not aligned as a
    # matrix of its own is: CPU LAPACK rounds them differently, and an eigenbasis
    # preconditioner carries that to 1.5e-6 of the update after 6 steps (MKL on AVX2)
    _close(stack.unstack(buffers), per_leaf, 1e-5, name, atol=1e-7)


def _key_paths(tree: dict, prefix: tuple = ()) -> set[tuple]:
    out = set()
    for k, v in tree.items():
        out |= _key_paths(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,)}
    return out


def check_checkpoint_round_trip(make: Make, params: PyTree | None = None,
                                name: str = "transform") -> None:
    """Checkpoint keys are the same for a fresh state and a trained one; saved with
    ``torch.save`` and loaded with ``weights_only=True`` into a fresh state, training goes on
    bit-identically."""
    from .distributed.checkpoint import load_state_dict, state_dict
    params = standard_params() if params is None else params
    grads = _gradients(params, 2 * STEPS, 7)
    tx = make()
    mid_params, mid_state = _run(tx, params, grads[:STEPS])
    keys = _key_paths(state_dict(tx.init(params), params))
    saved = state_dict(mid_state, mid_params)
    assert _key_paths(saved) == keys, f"{name}: the checkpoint keys change after steps"
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed = load_state_dict(tx.init(params), loaded, mid_params)
    _close(_run(tx, mid_params, grads[STEPS:], resumed),
           _run(tx, mid_params, grads[STEPS:], mid_state), 0.0, name)


def check_errors(make: Make, params: PyTree | None = None, name: str = "transform") -> None:
    """Integer parameters are refused at init; updates whose tree differs from the params'
    raise before a parameter moves (in ``update`` when the state is laid out like the params,
    at the latest in ``apply_updates``)."""
    from .base import apply_updates
    tx = make()
    try:
        tx.init({"w": torch.ones(3, 2, dtype=torch.int64)})
    except (TypeError, ValueError) as e:
        assert any(w in str(e) for w in ("float", "integer", "dtype")), f"{name}: {e}"
    else:
        raise AssertionError(f"{name}: init accepted integer parameters")
    params = standard_params() if params is None else params
    state = tx.init(params)
    grads = _gradients(params, 1, 8)[0]
    missing = dict(list(grads.items())[:-1])
    try:
        updates, _ = tx.update(missing, state, params)
        apply_updates(params, updates)
    except (TypeError, ValueError):
        return
    raise AssertionError(f"{name}: updates without leaf {list(grads)[-1]!r} were applied")


def check_donation(make: Make, params: PyTree | None = None, steps: int = 30,
                   name: str = "transform") -> None:
    """The in-place paths give the functional numbers bit for bit over ``steps`` steps
    (first steps, warm-ups and periodic refreshes included): ``update`` inside
    `opttx.donating` with `opttx.apply_updates_`, and `opttx.Optimizer` (which donates its
    state and holds the declared hyperparameters in it) against ``update`` and
    `opttx.apply_updates` of the transform *as given* (``make()``): parameters, and every
    state buffer where the two states have one structure (the injected states' inner
    states; an optional term whose hyperparameter is 0 stays in the Optimizer's state, as a
    scheduler may move it). A transform that writes a state buffer in place and reads the old
    value afterwards fails here, and so does an Optimizer that computes with hyperparameters
    other than the numbers given (rounded to float32: ``1 - b2`` of float32(0.95)). A
    transform with a final scale (`opttx.base.Traits.final_scale`) also runs folded:
    ``Optimizer(..., fold_learning_rate=True)`` equals `opttx.update_deferring_scale` with
    `opttx.apply_updates` (``scale=``) bit for bit, and a folded step is the unfolded one to
    a rounding."""
    params = leaves_0d_to_4d() if params is None else params
    grads = _gradients(params, steps, 9)
    tx = make()
    expected = _run(tx, params, grads)
    _close(_run_donating(tx, params, grads), expected, 0.0,
           f"{name}: donating + apply_updates_")
    if not isinstance(params, dict):
        return
    _check_optimizer_run(make, params, grads, expected, False,
                         f"{name}: Optimizer against the functional path of the transform given")
    if traits_of(tx).final_scale:
        folded = _run_folded(tx, params, grads[:1])
        _close(folded[0], _run(tx, params, grads[:1])[0], 1e-6,
               f"{name}: the final scale folded into the write, one step", atol=1e-12)
        _check_optimizer_run(make, params, grads, _run_folded(tx, params, grads), True,
                             f"{name}: Optimizer(fold_learning_rate=True) against "
                             "update_deferring_scale + apply_updates(scale=)")


def _check_optimizer_run(make: Make, params: dict, grads: list, expected: tuple, fold: bool,
                         what: str) -> None:
    """`opttx.Optimizer` over ``make()`` (with ``fold_learning_rate=fold``) run on ``grads``
    equals ``expected`` (params, state) bit for bit."""
    from .optim import Optimizer
    model = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    optimizer = Optimizer(list(model.items()), make(), fold_learning_rate=fold)
    for g in grads:
        for k, p in model.items():
            p.grad = g[k].clone()
        optimizer.step()
    _close({k: p.detach() for k, p in model.items()}, expected[0], 0.0, what)
    live, functional = _without_injection(optimizer.tx_states[0]), \
        _without_injection(expected[1])
    if tree_flatten(live)[1] == tree_flatten(functional)[1]:
        # (an optional term whose hyperparameter is 0, a momentum, is left out of the
        # functional state and kept in the Optimizer's, where a scheduler may move it)
        _close(live, functional, 0.0, f"{what} (state)")


def _without_injection(state: Any) -> Any:
    """``state`` with every `opttx.InjectHyperparamsState` in it replaced by its inner state
    and every `Static` field emptied: the buffers of the transform as built, before
    `opttx.inject_all_hyperparams` (which also names the injected factories in the
    ``made_by`` fields of the states around them)."""
    from torch.utils._pytree import tree_map as map_nodes
    from .tree import Static
    from .wrappers import InjectHyperparamsState

    def strip(node: Any) -> Any:
        if isinstance(node, InjectHyperparamsState):
            return _without_injection(node.inner_state)
        return Static() if isinstance(node, Static) else node
    return map_nodes(strip, state,
                     is_leaf=lambda n: isinstance(n, (InjectHyperparamsState, Static)))


def check_compile_on_another_thread(make: Make, params: PyTree | None = None, steps: int = 12,
                                    name: str = "transform") -> None:
    """An eager step taken while ``torch.compile`` traces on another thread gives the same
    numbers, bit for bit, functional and donating. Dynamo's "compiling" flag
    (``torch.compiler.is_compiling``) is one per process; this check raises it by hand, as
    such a compile leaves it for the whole process, around an eager run. A transform that
    branches on the bare flag instead of `opttx.is_tracing` (which also asks whether
    this thread is traced) takes its traced branches in eager code here: another reduction,
    a skipped check, no donation."""
    params = leaves_0d_to_4d() if params is None else params
    grads = _gradients(params, steps, 10)
    tx = make()
    expected = _run(tx, params, grads)
    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        functional = _run(tx, params, grads)
        donated = _run_donating(tx, params, grads)
    finally:
        torch.compiler._is_compiling_flag = flag
    _close(functional, expected, 0.0, f"{name}: functional, while another thread compiles")
    _close(donated, expected, 0.0, f"{name}: donating, while another thread compiles")


# the properties of degenerate inputs: shapes with a zero, a one or no dimension, a NaN in a
# gradient, and a state that keeps an input


def degenerate_params(matrices_only: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """A matrix beside zero-size matrices ((0, 5), (6, 0)), a row (1×N) and a column (N×1);
    without ``matrices_only`` also a 0-D leaf, an empty vector and a vector."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w": (6, 4), "e": (0, 5), "z": (6, 0), "row": (1, 5), "col": (5, 1),
              "s": (), "n": (0,), "b": (4,)}
    if matrices_only:
        del shapes["s"], shapes["n"], shapes["b"]
    return {k: torch.randn(s, generator=gen, dtype=torch.float64).float()
            for k, s in shapes.items()}


def check_degenerate_shapes(make: Make, params: PyTree | None = None,
                            name: str = "transform") -> None:
    """On a tree with zero-size, 1×N and N×1 matrices and 0-D leaves (`degenerate_params`),
    every step gives finite updates of the params' shapes and dtypes (empty for empty
    leaves), and the state round-trips through a checkpoint (`check_checkpoint_round_trip`
    on the same tree)."""
    from .base import apply_updates
    from .tree import keystr, tree_flatten_with_path
    params = degenerate_params() if params is None else params
    tx = make()
    state = tx.init(params)
    for i, g in enumerate(_gradients(params, STEPS, 11)):
        updates, state = tx.update(g, state, params)
        paths = tree_flatten_with_path(params)[0]
        for (path, p), u in zip(paths, tree_leaves(updates)):
            where = f"{name}: step {i}, leaf {keystr(path)} {tuple(p.shape)}"
            assert u.shape == p.shape and u.dtype == p.dtype, \
                f"{where}: an update of shape {tuple(u.shape)}, {u.dtype}"
            assert bool(torch.isfinite(u).all()), f"{where}: a non-finite update"
        params = apply_updates(params, updates)
    check_checkpoint_round_trip(make, params, name)


NONFINITE_BEHAVIOURS = {
    "propagates": "the leaf's update of that step holds a NaN (a later step may raise)",
    "raises": "the step raises an error",
    "skips": "the whole step is skipped: every update is zero, and later steps are finite",
    "zeroes": "the NaN element's update is zero, every other one finite",
    "at_boundary": "the leaf's update holds a NaN at the next step that applies the "
                   "accumulated gradient",
    "ignores": "the leaf's gradient is not used: its updates stay finite",
}
"""How a transform answers one NaN element in one leaf's gradient (the classes of
docs/guide/faults.md); `check_nonfinite_gradients` checks the declared one."""


def check_nonfinite_gradients(make: Make, params: PyTree | None = None,
                              behaviour: str = "propagates", name: str = "transform") -> None:
    """A NaN in one element of one leaf's gradient (the first matrix, at the second step) is
    never hidden: with ``behaviour="propagates"`` (every transform that computes with its
    gradients) that leaf's update of the step holds a NaN; a wrapper that deals with it
    declares another behaviour of `NONFINITE_BEHAVIOURS` and is checked for that one."""
    from .base import apply_updates
    if behaviour not in NONFINITE_BEHAVIOURS:
        raise ValueError(f"behaviour must be one of {sorted(NONFINITE_BEHAVIOURS)}, got "
                         f"{behaviour!r}")
    params = standard_params() if params is None else params
    key = next(k for k, v in params.items() if v.ndim >= 2)
    bad = 1       # the steps after it only matter to the behaviours that act later
    steps = bad + 1 if behaviour in ("propagates", "raises") else STEPS + 2
    grads = _gradients(params, steps, 12)
    grads[bad] = {**grads[bad], key: grads[bad][key].clone()}
    grads[bad][key].view(-1)[1] = float("nan")
    tx = make()
    state = tx.init(params)
    seen = []               # per step from the NaN on: (leaf has a NaN, all finite, all zero)
    raised: Exception | None = None
    for i, g in enumerate(grads):
        try:
            updates, state = tx.update(g, state, params)
        except Exception as e:  # an error from the NaN step on is an answer
            if i < bad:
                raise
            raised = e
            break
        if i >= bad:
            u = updates[key]
            seen.append((bool(u.isnan().any()),
                         all(bool(torch.isfinite(x).all()) for x in tree_leaves(updates)),
                         all(not bool(x.any()) for x in tree_leaves(updates)), u))
        params = apply_updates(params, updates)
    what = f"{name}: one NaN in {key!r}'s gradient at step {bad}"
    if behaviour == "raises":
        assert raised is not None and not seen, f"{what}: no error at that step"
        return
    if raised is not None and (behaviour != "propagates" or not seen):
        raise AssertionError(f"{what}: raised {type(raised).__name__}: {raised} (its "
                             f"behaviour: {behaviour})") from raised
    if behaviour == "propagates":
        assert seen[0][0], f"{what}: no NaN in its update of that step (it hid the NaN)"
    elif behaviour == "skips":
        assert seen[0][2] and seen[0][1], f"{what}: the step was not skipped (updates not zero)"
        assert all(s[1] for s in seen[1:]), f"{what}: a later step is not finite"
    elif behaviour == "zeroes":
        u = seen[0][3]
        assert seen[0][1] and u.view(-1)[1] == 0, f"{what}: the element's update is not zero"
    elif behaviour == "at_boundary":
        assert any(s[0] for s in seen), f"{what}: no NaN in its updates of the next steps"
    else:
        assert all(s[1] for s in seen) and not any(s[0] for s in seen), \
            f"{what}: a non-finite update"


def _storages(tree: Any) -> dict[int, str]:
    """data_ptr of the storage of every non-empty tensor leaf -> a description."""
    from .tree import keystr, tree_flatten_with_path
    out = {}
    for path, x in tree_flatten_with_path(tree)[0]:
        if isinstance(x, torch.Tensor) and x.numel() and x.untyped_storage().nbytes():
            out.setdefault(x.untyped_storage().data_ptr(), keystr(path))
    return out


def _assert_no_shared(state: Any, given: dict[str, Any], what: str) -> None:
    held = _storages(state)
    for role, tree in given.items():
        shared = sorted((path, held[ptr]) for ptr, path in _storages(tree).items()
                        if ptr in held)
        assert not shared, (f"{what}: the state (at {shared[0][1]}) shares memory with the "
                            f"{role} it was given (at {shared[0][0]}): keep a copy "
                            "(opttx.copy_for_state)")


def check_no_aliasing(make: Make, params: PyTree | None = None,
                      name: str = "transform") -> None:
    """A state never shares memory with the params ``init`` was given, nor with the updates
    (gradients) or params ``update`` was given, functional and inside `opttx.donating`: the
    caller may overwrite those (``zero_grad(set_to_none=False)``, an in-place step) and the
    state must not change with them."""
    from .base import apply_updates, apply_updates_
    params = standard_params() if params is None else params
    for donate in (False, True):
        tx = make()
        p = _clone(params)
        state = tx.init(p)
        what = f"{name}{' (donating)' if donate else ''}"
        _assert_no_shared(state, {"params": p}, f"{what}: init")
        for i, g in enumerate(_gradients(p, 2, 13)):
            with donating(donate):
                updates, state = tx.update(g, state, p)
            _assert_no_shared(state, {"updates": g, "params": p}, f"{what}: step {i}")
            if donate:
                apply_updates_(p, updates)
            else:
                p = apply_updates(p, updates)



def _same_state_dict(actual: dict, expected: dict, what: str) -> None:
    """Two `opttx.Optimizer` state dicts are equal: the same entries, tensors bitwise (and of
    one dtype), the same param groups with the same values."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
                a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return type(a) is type(b) and a == b
    assert actual["state"].keys() == expected["state"].keys(), f"{what}: other entries"
    for key, entries in expected["state"].items():
        mine = actual["state"][key]
        assert mine.keys() == entries.keys(), \
            f"{what}: param {key}: entries {sorted(mine)} != {sorted(entries)}"
        for field, value in entries.items():
            assert same(mine[field], value), f"{what}: param {key}: {field} differs"
    assert len(actual["param_groups"]) == len(expected["param_groups"]), what
    for i, (mine, theirs) in enumerate(zip(actual["param_groups"], expected["param_groups"])):
        assert mine.keys() == theirs.keys(), \
            f"{what}: param group {i}: keys {sorted(mine)} != {sorted(theirs)}"
        for key in theirs:
            assert same(mine[key], theirs[key]), \
                f"{what}: param group {i}: {key!r} is {mine[key]!r}, saved {theirs[key]!r}"


def check_optimizer_resume(make: Make, params: PyTree | None = None, steps: int = 3,
                           after: int | None = None, name: str = "transform") -> None:
    """`opttx.Optimizer` resumes exactly: after ``steps`` steps with a scheduler history (a
    torch ``LambdaLR`` on ``lr`` when the group has a writable one, and every other
    hyperparameter key written by hand once), its state dict, saved with ``torch.save``
    and loaded with ``weights_only=True`` into a fresh Optimizer (and scheduler), gives
    ``state_dict()`` equal to the one saved, ``load_state_dict(state_dict())`` changes
    nothing, and ``after`` more steps (default ``steps``) with their scheduler steps equal
    the uninterrupted run bit for bit (parameters, state, param groups)."""
    from .optim import Optimizer
    params = standard_params() if params is None else params
    if not isinstance(params, dict):
        params = {str(i): p for i, p in enumerate(tree_leaves(params))}
    after = steps if after is None else after
    grads = _gradients(params, steps + after, 17)

    def build(values: dict[str, torch.Tensor]) -> tuple[Any, Any, dict]:
        model = {k: torch.nn.Parameter(v.clone()) for k, v in values.items()}
        opt = Optimizer(list(model.items()), make())
        group = opt.param_groups[0]
        sched = None
        if "lr" in group and "lr" not in group._scheduled:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s + 0.25)
        return opt, sched, model

    def train(opt: Any, sched: Any, model: dict, gs: list) -> None:
        for g in gs:
            for k, p in model.items():
                p.grad = g[k].clone()
            opt.step()
            if sched is not None:
                sched.step()

    opt, sched, model = build(params)
    train(opt, sched, model, grads[:1])
    group = opt.param_groups[0]
    for key in opt._keys[0].places:        # every other key written once, by hand
        value = group[key]
        if key == "lr" or key in group._scheduled:
            continue
        scaled = tuple(v * 0.96875 for v in value) if isinstance(value, tuple) \
            else value * 0.96875
        group[key] = scaled
    train(opt, sched, model, grads[1:steps])
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict() if sched else None,
                "params": {k: p.detach().clone() for k, p in model.items()}}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_sched, resumed_model = build(saved["params"])
    if resumed_sched is not None:
        resumed_sched.load_state_dict(saved["sched"])
    resumed.load_state_dict(saved["opt"])
    _same_state_dict(resumed.state_dict(), saved["opt"], f"{name}: state_dict after loading")
    resumed.load_state_dict(resumed.state_dict())
    _same_state_dict(resumed.state_dict(), saved["opt"],
                     f"{name}: load_state_dict(state_dict()) after loading")
    train(opt, sched, model, grads[steps:])
    train(resumed, resumed_sched, resumed_model, grads[steps:])
    _close({k: p.detach() for k, p in resumed_model.items()},
           {k: p.detach() for k, p in model.items()}, 0.0, f"{name}: resumed parameters")
    _same_state_dict(resumed.state_dict(), opt.state_dict(), f"{name}: resumed run")


CHECKS: dict[str, Callable[..., Any]] = {
    "purity": check_purity,
    "tree_without_leaves": check_tree_without_leaves,
    "state_structure_and_dtypes": check_state_structure_and_dtypes,
    "float64_determinism": check_float64_determinism,
    "one_compiled_graph": check_one_compiled_graph,
    "stacked": check_stacked,
    "checkpoint_round_trip": check_checkpoint_round_trip,
    "errors": check_errors,
    "donation": check_donation,
    "compile_on_another_thread": check_compile_on_another_thread,
    "degenerate_shapes": check_degenerate_shapes,
    "nonfinite_gradients": check_nonfinite_gradients,
    "no_aliasing": check_no_aliasing,
    "optimizer_resume": check_optimizer_resume,
}
"""The single-process checks of `check_transform`, by name (``injected_hyperparameters``
runs too when a factory is given)."""


def check_transform(make: Make, *, factory: Callable[..., GradientTransformation] | None = None,
                    kwargs: dict | None = None, matrices_only: bool = False,
                    stacked_refused: bool = False, skip: tuple[str, ...] = (),
                    nonfinite: str = "propagates") -> None:
    """Run every single-process check of the transform contract on a transform of yours.

    Args:
      make: builds a fresh transform (``lambda: my_transform(0.9)``).
      factory, kwargs: the factory and its arguments, to check that its injected
        hyperparameters (`opttx.inject_hyperparams`) change without recompiling.
      matrices_only: the transform takes matrices only (no 0-D or 1-D leaf in the trees).
      stacked_refused: the transform does not run under vmap (`opttx.stacked` must raise).
      skip: names of `CHECKS` not to run.
      nonfinite: how the transform answers a NaN in a gradient (`NONFINITE_BEHAVIOURS`):
        ``"propagates"`` for every transform that computes with its gradients; a wrapper
        that skips or zeroes non-finite steps says so.

    Raises:
      AssertionError: listing every check that failed and why.

    Example (a transform of your own passes its factory in the same way; docs/guide/writing.md
    checks its worked examples so):
      >>> check_transform(lambda: opttx.lion(1e-3), factory=opttx.lion,
      ...                 kwargs={"learning_rate": 1e-3})
    """
    def params(dtype: torch.dtype = torch.float32) -> PyTree:
        return standard_params(dtype, matrices_only=matrices_only)

    runs: dict[str, Callable[[], Any]] = {
        "purity": lambda: check_purity(make, params()),
        "tree_without_leaves": lambda: check_tree_without_leaves(make),
        "state_structure_and_dtypes": lambda: check_state_structure_and_dtypes(make, params),
        "float64_determinism": lambda: check_float64_determinism(make, params(torch.float64)),
        "one_compiled_graph": lambda: check_one_compiled_graph(make, params()),
        "stacked": lambda: check_stacked(make, params(), refused=stacked_refused),
        "checkpoint_round_trip": lambda: check_checkpoint_round_trip(make, params()),
        "errors": lambda: check_errors(make, params()),
        "donation": lambda: check_donation(make, leaves_0d_to_4d(matrices_only=matrices_only)),
        "compile_on_another_thread": lambda: check_compile_on_another_thread(
            make, leaves_0d_to_4d(matrices_only=matrices_only)),
        "degenerate_shapes": lambda: check_degenerate_shapes(
            make, degenerate_params(matrices_only)),
        "nonfinite_gradients": lambda: check_nonfinite_gradients(make, params(), nonfinite),
        "no_aliasing": lambda: check_no_aliasing(make, params()),
        "optimizer_resume": lambda: check_optimizer_resume(make, params()),
    }
    if factory is not None:
        runs["injected_hyperparameters"] = lambda: check_injected_hyperparameters(
            factory, dict(kwargs or {}), params())
    failures = []
    for check, run in runs.items():
        if check in skip:
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001 - every failure is reported together
            failures.append(f"{check}: {type(e).__name__}: {str(e)[:400]}")
    if failures:
        raise AssertionError("the transform breaks the contract:\n" + "\n".join(failures))


def _holds_quantized(state: Any) -> bool:
    """Whether ``state`` holds 8-bit codes."""
    from .transforms.quantized import QuantizedTensor
    return bool(find_instances(state, QuantizedTensor))
