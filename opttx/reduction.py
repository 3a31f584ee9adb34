"""The reduction hook (docs/design.md, rule 6): how a transform takes a statistic of its
leaves so that it stays right when the leaves are sharded. On one device every function here
is the identity; under `opttx.distributed` the reducer and the combiner passed in
``extra_args`` (`REDUCER_KEY`, `TOTALS_KEY`) make the statistics whole. Also the input of a
preconditioner inside `opttx.graft` (`PRECONDITION_INPUT`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence
from typing import Any, Iterator, Literal

import torch

from .core import Updates
from .tree import PyTree, flatten_matching, tree_leaves, tree_unflatten

__all__ = [
    "LEAF_SPEC_KEY",
    "PRECONDITION_INPUT",
    "REDUCER_KEY",
    "TOTALS_KEY",
    "ReduceOp",
    "current_reducer",
    "precondition_leaves",
    "precondition_target",
    "reduce_across_leaves",
    "reduce_leaf_statistics",
    "reduce_statistics",
    "reducer_during_init",
    "require_whole_leaves",
]


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


LEAF_SPEC_KEY = "opttx_leaf_spec"
"""The key of ``extra_args`` under which `leafwise` hands its ``step`` the spec of the tree
its lists of leaves come from (read by `reduce_leaf_statistics`)."""


def reduce_leaf_statistics(partials: Sequence[torch.Tensor], extra_args: dict[str, Any],
                           op: ReduceOp = "sum", spec: Any = None) -> list[torch.Tensor]:
    """Step (b) of rule 6 for a *list* of per-leaf partial statistics, one per leaf in the
    order of the leaves: `reduce_statistics` of the tree they stand for, as a list again.

    Inside a `leafwise` step the tree's spec comes with ``extra_args``; elsewhere pass the
    ``spec`` of the updates (``spec, g = flatten_matching(updates)``). Unsharded it returns
    ``partials`` unchanged, with no work.

    Example (in a leafwise step, each leaf's sum of squares, whole when sharded; unsharded,
    as here, the partials come back as they are):
      >>> g = [torch.ones(3), torch.ones(2, 2)]
      >>> sq = reduce_leaf_statistics([x.square().sum() for x in g], extra_args={})
    """
    if extra_args.get(REDUCER_KEY) is None:
        return list(partials)
    spec = extra_args.get(LEAF_SPEC_KEY) if spec is None else spec
    if spec is None:
        raise ValueError("reduce_leaf_statistics needs the spec of the tree the partials "
                         "belong to: call it in a leafwise step, or pass spec=.")
    return flatten_matching(reduce_statistics(tree_unflatten(list(partials), spec),
                                              extra_args, op))[1]


def require_whole_leaves(updates: PyTree, extra_args: dict[str, Any], name: str,
                         block_rows: int | None = None) -> None:
    """Raise when a transform that needs whole matrices (an SVD, an eigendecomposition of a
    factor, a blocking by shape) is handed local shards: under `opttx.distributed.sharded`
    that would silently be an approximation on the local block. The reducer in
    ``extra_args[REDUCER_KEY]`` knows which leaves are sharded; a trace-time check, free at
    run time. ``block_rows``: the transform needs only whole blocks of that many rows, so
    rows split at multiples of it pass (`Traits.block_rows`)."""
    check = getattr(extra_args.get(REDUCER_KEY), "require_whole", None)
    if check is not None:
        if block_rows is None:
            check(updates, name)
        else:
            check(updates, name, block_rows=block_rows)


def reduce_across_leaves(total: torch.Tensor, extra_args: dict[str, Any],
                         op: ReduceOp = "sum") -> torch.Tensor:
    """Step (c') of a statistic taken across leaves (a global norm): combine this rank's
    ``total`` over the leaves it holds with the totals of the ranks holding the others.
    ``total`` is a tensor of any shape (one total, or several stacked: one collective).

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


def precondition_leaves(grads: list[torch.Tensor], extra_args: dict[str, Any]
                        ) -> list[torch.Tensor]:
    """The leaves a preconditioner applies itself to inside a `leafwise` step: those of
    ``extra_args[PRECONDITION_INPUT]`` when `opttx.graft` provides one, else ``grads``."""
    if PRECONDITION_INPUT in extra_args:
        return tree_leaves(extra_args[PRECONDITION_INPUT])
    return grads
