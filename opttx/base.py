"""The transform contract: `GradientTransformation`, the trivial transforms, applying updates,
and the reduction hook through which layer-wise statistics become sharding-aware."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Literal, NamedTuple, Protocol

import torch

from ._checks import check_floating
from .tree import (MaskedNode, PyTree, assert_same_structure, tree_flatten, tree_leaves,
                   tree_map, tree_unflatten)

Params = PyTree
Updates = PyTree
State = PyTree

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "Params",
    "REDUCER_KEY",
    "TOTALS_KEY",
    "advance_counts",
    "current_reducer",
    "State",
    "Updates",
    "apply_updates",
    "apply_updates_",
    "identity",
    "reduce_across_leaves",
    "reduce_statistics",
    "reducer_during_init",
    "require_whole_leaves",
    "round_stochastic_",
    "require_params",
    "safe_increment",
    "set_to_zero",
    "stateless",
    "stateless_with_extra_args",
    "stateless_with_tree_map",
    "zero_count",
]


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> State: ...


class TransformUpdateFn(Protocol):
    def __call__(self, updates: Updates, state: State, params: Params | None = None,
                 **extra_args: Any) -> tuple[Updates, State]: ...


class GradientTransformation(NamedTuple):
    """A pair of pure functions: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra_args) -> (updates, new_state)``.

    ``update`` never mutates its inputs (see `opttx.tree.donating` for the one, opt-in,
    exception that saves memory). ``extra_args`` are passed down a chain to every link, so a
    transform must accept and ignore the ones it does not know.
    """

    init: TransformInitFn
    update: TransformUpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def stateless_with_extra_args(fn: Callable[[Updates, Params | None, dict[str, Any]], Updates]
                              ) -> GradientTransformation:
    """A transform from ``fn(updates, params, extra_args) -> updates``, for stateless
    transforms that need the ``extra_args`` of a chain (the reduction hook of sharded runs)."""

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EmptyState]:
        return fn(updates, params, extra_args), state

    return GradientTransformation(init, update)


def stateless(fn: Callable[[Updates, Params | None], Updates]) -> GradientTransformation:
    """A transform from a function ``fn(updates, params) -> updates`` of the whole tree.

    Example:
      >>> halve = opttx.stateless(lambda u, p: opttx.tree_map(lambda g: g / 2, u))
    """
    return stateless_with_extra_args(lambda updates, params, extra_args: fn(updates, params))


def stateless_with_tree_map(fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                            ) -> GradientTransformation:
    """A transform applying ``fn(update_leaf, param_leaf)`` to every leaf (``param_leaf`` is
    None when no params are given)."""

    def tree_fn(updates: Updates, params: Params | None) -> Updates:
        if params is None:
            return tree_map(lambda u: fn(u, None), updates)
        return tree_map(fn, updates, params)

    return stateless(tree_fn)


def identity() -> GradientTransformation:
    """Leave updates unchanged.

    Example:
      >>> tx = opttx.chain(opttx.identity(), opttx.sgd(0.1))   # same as opttx.sgd(0.1)
    """
    return stateless(lambda updates, params: updates)


def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros (the parameters do not move); used by `opttx.freeze`."""
    return stateless(lambda updates, params: tree_map(torch.zeros_like, updates))


# ---------------------------------------------------------------------------------------------
# applying updates
# ---------------------------------------------------------------------------------------------


def _paired_leaves(params: Params, updates: Updates) -> tuple[list, list, Any]:
    p_leaves, spec = tree_flatten(params)
    u_leaves = tree_leaves(updates)
    if len(p_leaves) != len(u_leaves):
        assert_same_structure(params, updates, "params and updates")
    return p_leaves, u_leaves, spec


def round_stochastic_(out: torch.Tensor, x: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Write float32 ``x`` into the bfloat16 tensor ``out``, rounded stochastically.

    A value between two neighbouring bfloat16 numbers :math:`a < x < b` becomes :math:`b`
    with probability :math:`(x - a)/(b - a)`, so :math:`\mathbb{E}[\mathrm{round}(x)] = x`:
    updates much smaller than the spacing of bfloat16 near the parameter still move it on
    average, where round-to-nearest would drop them every step. Done on the bits: a uniform
    16-bit integer is added to the float32 pattern and the low 16 bits are cut (inf and NaN
    pass through unchanged).

    References:
      Gupta et al., Deep Learning with Limited Numerical Precision (arXiv 1502.02551);
      Zamirai et al., Revisiting BFloat16 Training (arXiv 2010.06192).
    """
    x = x.to(torch.float32)
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    rounded = ((bits + noise) & -65536).view(torch.float32)
    out.copy_(torch.where(torch.isfinite(x), rounded, x))
    return out


def _stochastic_pairs(p_leaves: list, u_leaves: list, scale: float = 1.0
                      ) -> tuple[list, list, list, list]:
    """Split leaves into bfloat16 parameters (written with stochastic rounding) and others."""
    sr_p, sr_u, rest_p, rest_u = [], [], [], []
    for p, u in zip(p_leaves, u_leaves):
        if p.dtype == torch.bfloat16:
            sr_p.append(p)
            sr_u.append(u if scale == 1.0 else u * scale)
        else:
            rest_p.append(p)
            rest_u.append(u.to(p.dtype))
    return sr_p, sr_u, rest_p, rest_u


def _kind(x: torch.Tensor) -> Any:
    """What a grouped (``_foreach``) kernel cannot mix: plain tensors, and DTensors per mesh
    and placements (a tree under ``parallelize_module`` holds both)."""
    mesh = getattr(x, "device_mesh", None)
    if mesh is None:
        return None
    return (id(mesh), tuple(x.placements))


def _foreach_add(p_leaves: list[torch.Tensor], u_leaves: list[torch.Tensor],
                 inplace: bool, alpha: float = 1.0) -> list[torch.Tensor]:
    """``p + alpha · u`` (or ``p += alpha · u``) with one grouped kernel per kind of leaf
    (see `_kind`)."""
    groups: dict[Any, list[int]] = {}
    for i, p in enumerate(p_leaves):
        groups.setdefault(_kind(p), []).append(i)
    out: list[Any] = list(p_leaves)
    for idx in groups.values():
        ps, us = [p_leaves[i] for i in idx], [u_leaves[i] for i in idx]
        if inplace:
            torch._foreach_add_(ps, us, alpha=alpha)
        else:
            for i, r in zip(idx, torch._foreach_add(ps, us, alpha=alpha)):
                out[i] = r
    return out


def apply_updates(params: Params, updates: Updates, *, stochastic_rounding: bool = False,
                  generator: torch.Generator | None = None) -> Params:
    """``params + updates``, leaf by leaf, as a new tree (pure).

    Updates are cast to each parameter's dtype. One grouped kernel for all leaves. With
    ``stochastic_rounding=True`` bfloat16 parameters are added in float32 and rounded
    stochastically (`round_stochastic_`); other dtypes are unaffected.

    Example:
      >>> updates, state = tx.update(grads, state, params)
      >>> params = opttx.apply_updates(params, updates)
    """
    p_leaves, u_leaves, spec = _paired_leaves(params, updates)
    if stochastic_rounding:
        out = []
        for p, u in zip(p_leaves, u_leaves):
            if p.dtype == torch.bfloat16:
                out.append(round_stochastic_(torch.empty_like(p), p.float() + u.float(),
                                             generator))
            else:
                out.append(p + u.to(p.dtype))
        return tree_unflatten(out, spec)
    u_leaves = [u.to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    return tree_unflatten(_foreach_add(p_leaves, u_leaves, inplace=False), spec)


@torch.no_grad()
def apply_updates_(params: Params, updates: Updates, *, stochastic_rounding: bool = False,
                   generator: torch.Generator | None = None) -> Params:
    """``params += updates`` in place (also on ``nn.Parameter`` leaves); returns ``params``.

    In a compiled step the write lowers to an in-place update of the graph's inputs. With
    ``stochastic_rounding=True`` bfloat16 parameters are updated in float32 and written back
    rounded stochastically (`round_stochastic_`): the usual companion of bf16 parameters
    with fp32 optimizer state, instead of an fp32 master copy of the weights (4 bytes per
    parameter saved).
    """
    p_leaves, u_leaves, _ = _paired_leaves(params, updates)
    if not p_leaves:
        return params
    if stochastic_rounding:
        sr_p, sr_u, p_leaves, u_leaves = _stochastic_pairs(p_leaves, u_leaves)
        for p, u in zip(sr_p, sr_u):
            round_stochastic_(p, p.float() + u.float(), generator)
        _foreach_add(p_leaves, u_leaves, inplace=True)
        return params
    u_leaves = [u.to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    _foreach_add(p_leaves, u_leaves, inplace=True)
    return params


# ---------------------------------------------------------------------------------------------
# helpers shared by transforms
# ---------------------------------------------------------------------------------------------


def advance_counts(state: State) -> State:
    """``state`` with every step counter (a ``count`` field of a NamedTuple state, at any
    depth) advanced by one and nothing else changed: what an update on a tree without leaves
    leaves behind (a rank that owns no leaf under `opttx.distributed.zero` or ``on_owners``,
    a label of `opttx.partition` that matches nothing), so counters stay in step with the
    ranks that do have leaves."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        fields = {name: advance_counts(getattr(state, name)) for name in state._fields}
        count = fields.get("count")
        if isinstance(count, torch.Tensor) and count.ndim == 0 and \
                not count.dtype.is_floating_point:
            fields["count"] = safe_increment(getattr(state, "count"))
        return type(state)(**fields)
    if isinstance(state, (tuple, list)):
        return type(state)(advance_counts(x) for x in state)
    if isinstance(state, dict):
        return {k: advance_counts(v) for k, v in state.items()}
    return state


def zero_count(params: Params) -> torch.Tensor:
    """A 0-dim int32 step counter on the device of the first parameter."""
    leaves = [x for x in tree_leaves(params) if isinstance(x, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    return torch.zeros((), dtype=torch.int32, device=device)


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, saturating at the largest value of its dtype instead of wrapping."""
    limit = torch.iinfo(count.dtype).max
    return torch.where(count < limit, count + 1, count)


def require_params(params: Params | None, name: str) -> Params:
    """Raise a clear error when a transform that reads the parameters got none."""
    if params is None:
        raise ValueError(f"{name} needs the current parameters: call "
                         f"tx.update(updates, state, params) with params.")
    return params


def check_init_params(params: Params) -> None:
    """Common checks of the tree given to ``init``: floating-point tensor leaves only."""
    check_floating(params)


# ---------------------------------------------------------------------------------------------
# the reduction hook (DESIGN.md rule 6)
# ---------------------------------------------------------------------------------------------

REDUCER_KEY = "opttx_reducer"
"""The key of ``extra_args`` under which `opttx.distributed` passes its reducer."""

TOTALS_KEY = "opttx_totals"
"""The key of ``extra_args`` under which a distributed wrapper that hands whole leaves to owner
ranks (`opttx.distributed.sharded` with ``on_owners=True``, `opttx.distributed.zero`) passes
the function that combines statistics taken across leaves (see `reduce_across_leaves`)."""

ReduceOp = Literal["sum", "max"]


_INIT_REDUCER: contextvars.ContextVar[Any] = contextvars.ContextVar("opttx_init_reducer",
                                                                  default=None)


def current_reducer(extra_args: dict[str, Any] | None = None) -> Any:
    """The reducer of the enclosing `opttx.distributed.sharded`, or None on one device.

    In ``update`` it is ``extra_args[REDUCER_KEY]``; ``init`` has no extra_args, so
    ``sharded`` sets it for the duration of ``tx.init`` (`reducer_during_init`) and
    ``current_reducer()`` (no argument) reads it there. Transforms use it for decisions that
    must be taken on the global shapes (Adafactor's factoring) and for whole-leaf checks."""
    if extra_args is not None:
        return extra_args.get(REDUCER_KEY)
    return _INIT_REDUCER.get()


@contextlib.contextmanager
def reducer_during_init(reducer: Any) -> Iterator[None]:
    """Make ``reducer`` the `current_reducer` of the ``init`` calls inside the block (None:
    none, as for whole leaves at owner ranks)."""
    token = _INIT_REDUCER.set(reducer)
    try:
        yield
    finally:
        _INIT_REDUCER.reset(token)


def reduce_statistics(partials: PyTree, extra_args: dict[str, Any], op: ReduceOp = "sum",
                      dims: PyTree | None = None) -> PyTree:
    """Step (b) of every layer-wise reduction: combine local partial statistics over shards.

    ``partials`` is a tree with the structure of the updates (`MaskedNode` where a leaf is
    absent) whose leaves are the *local* partial statistics of each leaf (a sum of squares, a
    row sum, ...). ``dims`` gives, per leaf, the tuple of the leaf's dims that the statistic
    was reduced over (None: all of them). On unsharded leaves this is the identity; under
    `opttx.distributed.sharded` the reducer passed in ``extra_args[REDUCER_KEY]`` turns it into
    collectives over the process groups that shard those dims, batched over all leaves.
    """
    reducer = extra_args.get(REDUCER_KEY)
    if reducer is None:
        return partials
    return reducer(partials, op=op, dims=dims)


def require_whole_leaves(updates: PyTree, extra_args: dict[str, Any], name: str) -> None:
    """Raise when a transform that needs whole matrices (an SVD, an eigendecomposition of a
    factor, a blocking by shape) is handed local shards: under `opttx.distributed.sharded`
    that would silently be an approximation on the local block. The reducer in
    ``extra_args[REDUCER_KEY]`` knows which leaves are sharded; a trace-time check, free at
    run time."""
    check = getattr(extra_args.get(REDUCER_KEY), "require_whole", None)
    if check is not None:
        check(updates, name)


def reduce_across_leaves(total: torch.Tensor, extra_args: dict[str, Any],
                         op: ReduceOp = "sum") -> torch.Tensor:
    """Step (c') of a statistic taken across leaves (a global norm): combine this rank's
    ``total`` over the leaves it holds with the totals of the ranks holding the others.

    Call it after `reduce_statistics` and the local sum over leaves, on every rank, even one
    that holds no leaf (its total is zero): when whole leaves are spread over owner ranks
    (``extra_args[TOTALS_KEY]``, one collective), each leaf is on exactly one rank; otherwise
    (one device, or local shards whose per-leaf statistics `reduce_statistics` already made
    whole) it is the identity.
    """
    combine = extra_args.get(TOTALS_KEY)
    if combine is None:
        return total
    return combine(total, op=op)


PRECONDITION_INPUT = "precondition_input"
"""The ``extra_args`` key under which `opttx.graft` passes the (filtered) gradient that a
preconditioning transform should apply itself to, while its statistics come from ``updates``
(the raw gradient). `scale_by_rms`, `scale_by_rss` and `precondition_shampoo` honour it."""


def precondition_target(updates: Updates, extra_args: dict[str, Any]) -> Updates:
    """What a preconditioning transform applies itself to: ``extra_args[PRECONDITION_INPUT]``
    when `opttx.graft` provides one, else the updates themselves."""
    return extra_args.get(PRECONDITION_INPUT, updates)


def is_masked(x: Any) -> bool:
    """Whether ``x`` is a `MaskedNode` placeholder."""
    return isinstance(x, MaskedNode)
