"""Meta's blocking for Shampoo and SOAP (`block_by_dims`): every leaf cut into blocks.

The blocks are Meta's (Distributed Shampoo, arXiv 2309.06497): drop size-1 dims, merge
neighbouring dims from the last one while the product stays <= ``max_preconditioner_dim``
(`merge_small_dims`), then cut every dim into chunks of at most that size (`block_shapes`,
`split_blocks`). `block_by_dims` runs an inner transform on the blocks and puts the result
back together (`merge_blocks`).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Sequence

import torch

from .._checks import check_gradient_leaves, check_positive_int
from .._tracing import is_tracing
from ..base import (GradientTransformation, PRECONDITION_INPUT, Params, REDUCER_KEY, Updates,
                    check_init_params, combine_traits, current_reducer, declare,
                    reducer_during_init, require_whole_leaves, traits_of)
from ..tree import (PyTree, flatten_matching, tree_flatten, tree_map, tree_paths, tree_structure,
                    tree_unflatten)

__all__ = [
    "block_by_dims",
    "block_shapes",
    "chunks",
    "merge_blocks",
    "merge_small_dims",
    "split_blocks",
]


def merge_small_dims(shape: Sequence[int], max_dim: int,
                     target_dimensionality: int | float = 1) -> tuple[int, ...]:
    """Meta's dimension merging: drop size-1 dims, then walking from the last dim merge each
    dim into its right neighbour while the product stays <= ``max_dim`` and more than
    ``target_dimensionality`` dims would remain (Meta's ``target_parameter_dimensionality``:
    1 merges as far as the size allows, 2 keeps matrices, ``math.inf`` merges nothing and
    keeps the shape as it is). A shape with an empty dim is ``(0,)``.

    >>> merge_small_dims((32, 3, 64, 64), 1024)
    (32, 192, 64)
    >>> merge_small_dims((32, 3, 64, 64), 8192)
    (96, 4096)
    >>> merge_small_dims((32, 3, 64, 64), 10**6, target_dimensionality=2)
    (32, 12288)
    """
    max_dim = _limit(max_dim)
    if 0 in shape:
        return (0,)
    if target_dimensionality == math.inf:
        return tuple(shape) or (1,)
    dims = [d for d in reversed(shape) if d != 1] or [1]
    merged = [dims[0]]
    for i, d in enumerate(dims[1:], start=1):
        if len(merged) + len(dims) - i > target_dimensionality and merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(reversed(merged))


def block_shapes(shape: Sequence[int], max_dim: int,
                 target_dimensionality: int | float = 1) -> list[tuple[int, ...]]:
    """The shapes of the blocks of a tensor of ``shape``, in row-major block order."""
    max_dim = _limit(max_dim)
    merged = merge_small_dims(shape, max_dim, target_dimensionality)
    # an empty dim is one empty block (as torch.split gives)
    pieces: list[list[int]] = [[max_dim] * (m // max_dim) + ([m % max_dim] if m % max_dim else [])
                               if m else [0] for m in merged]
    shapes: list[tuple[int, ...]] = [()]
    for sizes in pieces:
        shapes = [s + (size,) for s in shapes for size in sizes]
    return shapes


def _limit(max_dim: float) -> int:
    """``max_preconditioner_dim`` as an int: ``math.inf`` (Meta's "never split") becomes a
    size no tensor reaches."""
    return sys.maxsize if max_dim == math.inf else int(max_dim)


def split_blocks(x: torch.Tensor, max_dim: int, target: int | float = 1
                 ) -> tuple[torch.Tensor, ...]:
    """The blocks of ``x`` (views, shapes `block_shapes`, row-major block order): ``x`` with
    its dims merged (`merge_small_dims`), cut along every dim into chunks of ``max_dim``."""
    max_dim = _limit(max_dim)
    blocks = [x.reshape(merge_small_dims(x.shape, max_dim, target))]
    for dim in range(blocks[0].dim()):
        blocks = [piece for b in blocks for piece in torch.split(b, max_dim, dim=dim)]
    return tuple(blocks)


def merge_blocks(blocks: Sequence[torch.Tensor], shape: Sequence[int], max_dim: int,
                 target: int | float = 1) -> torch.Tensor:
    """The tensor of ``shape`` that `split_blocks` cut into ``blocks`` (the inverse: the round
    trip is the identity)."""
    max_dim = _limit(max_dim)
    merged = merge_small_dims(shape, max_dim, target)
    counts = [max(1, math.ceil(m / max_dim)) for m in merged]
    parts = list(blocks)
    for dim in reversed(range(len(merged))):
        n = counts[dim]
        parts = [torch.cat(parts[i:i + n], dim=dim) if n > 1 else parts[i]
                 for i in range(0, len(parts), n)]
    return parts[0].reshape(shape)


@declare()
def block_by_dims(inner: GradientTransformation, max_preconditioner_dim: int | float = 1024,
                  target_parameter_dimensionality: int | float = 1) -> GradientTransformation:
    """Run ``inner`` on Meta's blocks of every leaf and reassemble its updates.

    Each leaf becomes a tuple of blocks (`block_shapes`); ``inner`` sees that tree, and its
    state is laid out by block. The blocks tile the leaf exactly and the round trip is the
    identity. ``max_preconditioner_dim=math.inf`` (as Meta's) merges every dim of size > 1
    into one and never splits: each leaf is one 1-D block (full-matrix Adagrad on it).
    ``target_parameter_dimensionality`` (Meta's, of its distributed config) stops the merging
    at that many dims (see `merge_small_dims`): with ``math.inf`` and
    ``target_parameter_dimensionality=2`` every leaf of 2 or more dims is one matrix.

    Example:
      >>> tx = opttx.block_by_dims(opttx.precondition_shampoo(), max_preconditioner_dim=1024)
    """
    if max_preconditioner_dim != math.inf:
        check_positive_int("max_preconditioner_dim", max_preconditioner_dim)
    target = target_parameter_dimensionality
    if target != math.inf:
        check_positive_int("target_parameter_dimensionality", target)
    # whole row blocks of a leaf split by rows are its blocks only when dims merge as usual
    rows = None if max_preconditioner_dim == math.inf or target != 1 \
        else int(max_preconditioner_dim)
    config = (f"block_by_dims(max_preconditioner_dim={max_preconditioner_dim}, "
              f"target_parameter_dimensionality={target})")
    max_preconditioner_dim = _limit(max_preconditioner_dim)

    def blocked(tree: PyTree) -> PyTree:
        return tree_map(lambda x: split_blocks(x, max_preconditioner_dim, target), tree)

    def init(params: Params) -> Any:
        check_init_params(params)
        _check_row_blocks(params, current_reducer(), max_preconditioner_dim)
        with reducer_during_init(None):       # every block is whole
            return inner.init(blocked(params))

    def update(updates: Updates, state: Any, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, Any]:
        require_whole_leaves(updates, extra_args, "block_by_dims", block_rows=rows)
        _check_row_blocks(updates, current_reducer(extra_args), max_preconditioner_dim)
        spec, leaves = flatten_matching(updates)
        # None, sparse, integer or complex leaves, and (with params) shapes other than the
        # params': refused here, naming the leaf, before the blocks are cut (a transposed
        # gradient merged into one dim would otherwise pass as the same blocks)
        check_gradient_leaves(leaves, None if params is None
                              else flatten_matching(updates, params)[2], updates,
                              "block_by_dims")
        # leaves split by rows at block boundaries (zero's split_above_mb) give whole
        # blocks: inner sees no sharded reducer
        extra = {k: v for k, v in extra_args.items() if k != REDUCER_KEY}
        if PRECONDITION_INPUT in extra:
            extra[PRECONDITION_INPUT] = blocked(extra[PRECONDITION_INPUT])
        try:
            out, state = inner.update(blocked(updates), state,
                                      None if params is None else blocked(params), **extra)
        except (ValueError, TypeError) as err:
            _refuse_other_blocks(err, inner, state, leaves, spec, updates, config, blocked,
                                 lambda shape: block_shapes(shape, max_preconditioner_dim,
                                                            target))
            raise
        counts = [len(block_shapes(x.shape, max_preconditioner_dim, target)) for x in leaves]
        merged = [merge_blocks(bs, x.shape, max_preconditioner_dim, target).to(x.dtype)
                  for bs, x in zip(chunks(tree_flatten(out)[0], counts, "block_by_dims"),
                                   leaves)]
        return tree_unflatten(merged, spec), state

    return GradientTransformation(init, update, combine_traits(
        (inner,), elementwise=False, per_leaf=traits_of(inner).per_leaf, whole_leaves=True,
        takes_precondition_input=traits_of(inner).takes_precondition_input, block_rows=rows))


def _refuse_other_blocks(err: Exception, inner: GradientTransformation, state: Any,
                         leaves: list[torch.Tensor], spec: Any, updates: Updates,
                         config: str, blocked: Any, cut: Any) -> None:
    """After ``inner.update`` failed inside `block_by_dims`: when ``state`` does not have the
    structure ``inner.init`` gives on this configuration's blocks (computed on "meta" tensors:
    no memory, no numbers), raise a ``ValueError`` saying so, naming this configuration and
    the blocks it cuts, instead of the inner's structure error ("tuple vs tuple"). The state
    of `block_by_dims` is its inner's, with no stamp of its own (a root of its own would
    rename every checkpoint key of Shampoo), so the configuration that made it is
    not recorded; `opttx.Optimizer.load_state_dict` and `opttx.distributed.load_checkpoint`
    compare the whole configuration by identity. Otherwise (the same structure: another
    problem, or while tracing) returns, and the caller re-raises ``err``."""
    if is_tracing():
        return
    try:
        template = tree_unflatten([torch.empty(x.shape, dtype=x.dtype, device="meta")
                                   for x in leaves], spec)
        with reducer_during_init(None):
            expected = inner.init(blocked(template))
    except Exception:   # noqa: BLE001 - no diagnosis possible: the inner's own error stands
        return
    if tree_structure(expected) == tree_structure(state):
        return
    paths = tree_paths(updates)
    shown = []
    for path, x in zip(paths, leaves):
        blocks = cut(x.shape)
        if len(blocks) > 1 or tuple(blocks[0]) != tuple(x.shape):
            shown.append(f"{path or 'the leaf'} {tuple(x.shape)} into {len(blocks)} blocks "
                         f"{[tuple(b) for b in blocks[:3]]}{' ...' if len(blocks) > 3 else ''}")
    cuts = "; ".join(shown[:3]) if shown else "every leaf into one block (itself)"
    raise ValueError(
        f"{config}.update got a state that does not hold this configuration's blocks (it cuts "
        f"{cuts}): the state was made by another block configuration (another "
        "max_preconditioner_dim or target_parameter_dimensionality, which opttx.shampoo "
        "passes to block_by_dims) or for other parameters. A state of "
        "another configuration cannot be used: build it with this transform's init (or load "
        "a checkpoint made by the same configuration: opttx.Optimizer.load_state_dict and "
        f"opttx.distributed.load_checkpoint name both configurations). Inner error: {err}"
    ) from err


def _check_row_blocks(tree: PyTree, reducer: Any, max_dim: int) -> None:
    """Where a leaf is only this rank's rows of a larger one (zero's ``split_above_mb``), its
    blocks are those of the whole leaf only if dim 0 is merged with no other dim, here and in
    the whole leaf, and the other dims merge alike: else raise (the blocks would differ)."""
    starts = getattr(reducer, "row_starts", None)
    if starts is None or reducer.global_shapes is None:
        return                    # no rows split here (other shards: require_whole_leaves)
    try:
        flat = reducer.treespec.flatten_up_to(tree)
    except (ValueError, TypeError):
        return
    for x, start, whole in zip(flat, starts, reducer.global_shapes):
        if start is None or not isinstance(x, torch.Tensor):
            continue
        mine, theirs = merge_small_dims(x.shape, max_dim), merge_small_dims(whole, max_dim)
        if mine[0] != x.shape[0] or theirs[0] != whole[0] or mine[1:] != theirs[1:]:
            raise ValueError(
                f"block_by_dims: rows {tuple(x.shape)} of a {tuple(whole)} leaf block "
                f"differently from the whole leaf (merged dims {mine} vs {theirs} at "
                f"max_preconditioner_dim={max_dim}); give every rank at least one whole block "
                "of rows, or do not split this leaf.")


def chunks(flat: list, counts: list[int], who: str) -> list[list]:
    """Split ``flat`` into consecutive runs of the given lengths (the blocks, or factors, of
    each leaf); a ``ValueError`` naming ``who`` when the lengths do not add up."""
    if len(flat) != sum(counts):
        raise ValueError(f"{who}: expected {sum(counts)} tensors for {len(counts)} leaves, "
                         f"got {len(flat)}; were the state and updates built from the same "
                         "parameter tree?")
    out, i = [], 0
    for c in counts:
        out.append(flat[i:i + c])
        i += c
    return out
