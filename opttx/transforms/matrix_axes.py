"""Leaves read as matrices: the static layout shared by the matrix transforms
(`opttx.orthogonalize`, `opttx.scale_by_shape`, `opttx.scale_by_neuron_rms`,
`opttx.scale_to_orthogonal_norm`).

Each leaf is a matrix over two axes (``matrix_axes``, default the last two; more dims are a
batch of matrices), optionally cut into row blocks (``split``). These helpers check those
arguments at construction, resolve them per leaf from shapes alone (`leaf_matrix_axes`,
`leaf_row_blocks`), refuse leaves sharded over a matrix axis (`require_whole_matrices`), and
build a stateless transform on them (`stateless_matrix_transform`), and move a leaf's
matrix axes last and back (`to_last_two`, `from_last_two`, `in_layout_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .._checks import matrix_axes_of
from ..base import (REDUCER_KEY, EmptyState, GradientTransformation, Params, Traits, Updates,
                    check_init_params)
from ..tree import PyTree, leaf_labels, tree_flatten, tree_paths, tree_unflatten

__all__ = ["MatrixAxes", "Split", "check_axes_argument", "check_split_argument",
           "from_last_two", "global_matrix_shapes", "in_layout_of", "leaf_matrix_axes",
           "leaf_row_blocks", "require_whole_matrices", "sharded_matrix_dims",
           "stateless_matrix_transform", "to_last_two"]

MatrixAxes = tuple[int, int] | PyTree | Callable[[Params], PyTree]
Split = int | tuple[int, ...] | PyTree | Callable[[Params], PyTree] | None

_WHOLE_MATRICES = Traits(per_leaf=True, whole_leaves=True)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(a, int) for a in x)


def _is_split(x: Any) -> bool:
    """A split of one leaf: None, a number of equal row blocks, or the row sizes."""
    return x is None or (isinstance(x, int) and not isinstance(x, bool)) or (
        isinstance(x, tuple) and len(x) > 0 and all(isinstance(a, int) and not
                                                    isinstance(a, bool) for a in x))


def check_axes_argument(matrix_axes: MatrixAxes, name: str) -> None:
    """Refuse, at construction, a tuple of ints that is not a pair of axes (a tree of pairs, a
    callable or a pair pass; each leaf's pair is checked by `leaf_matrix_axes`)."""
    if isinstance(matrix_axes, tuple) and not _is_axes(matrix_axes) and \
            all(isinstance(a, int) for a in matrix_axes):
        raise ValueError(f"{name}: matrix_axes must be a pair of axes such as (-2, -1), got "
                         f"{matrix_axes!r}.")


def check_split_argument(split: Split, name: str) -> None:
    """Refuse, at construction, a ``split`` that is a bool, fewer than one row block, or row
    sizes that are not positive (a tree or a callable passes; `leaf_row_blocks` checks each
    leaf's)."""
    if isinstance(split, bool):
        raise ValueError(f"{name}: split must be a number of row blocks, a tuple of row sizes, "
                         f"a tree of those or None, got {split!r}.")
    if isinstance(split, int) and split < 1:
        raise ValueError(f"{name}: split must be >= 1 row blocks, got {split}.")
    if isinstance(split, tuple) and all(isinstance(a, int) for a in split) and (
            not split or any(a < 1 for a in split)):
        raise ValueError(f"{name}: split sizes must be positive row counts, got {split!r}.")


def leaf_matrix_axes(tree: PyTree, matrix_axes: MatrixAxes, name: str
                     ) -> list[tuple[int, int] | None]:
    """The (row, column) axes of every leaf of ``tree``, non-negative (None: leave the leaf
    unchanged, only where ``matrix_axes`` is given per leaf). Static: from shapes only."""
    leaves = tree_flatten(tree)[0]
    per_leaf = not _is_axes(matrix_axes)
    axes_of = (leaf_labels(matrix_axes, tree, "matrix_axes", is_leaf=_is_axes) if per_leaf
               else [matrix_axes] * len(leaves))
    out: list[tuple[int, int] | None] = []
    for i, (x, axes) in enumerate(zip(leaves, axes_of)):
        if axes is None and per_leaf:
            out.append(None)
            continue
        if x.dim() < 2:
            raise ValueError(
                f"{name}: updates{tree_paths(tree)[i]} has {x.dim()} dim(s), but it works on "
                "matrices (2 or more dims; more are a batch of matrices over matrix_axes). "
                "Route vectors and scalars to another transform: opttx.muon sends them to "
                "AdamW; otherwise use opttx.masked(..., lambda p: opttx.tree.tree_map("
                "lambda x: x.ndim >= 2, p)) or opttx.partition.")
        if not _is_axes(axes):
            raise ValueError(f"{name}: matrix_axes for updates{tree_paths(tree)[i]} is "
                             f"{axes!r}; give a pair of axes such as (-2, -1), or None to leave "
                             "the leaf unchanged.")
        out.append(matrix_axes_of(axes, x.shape, f"{name}, updates{tree_paths(tree)[i]}"))
    return out


def _row_blocks(split: Any, rows: int, where: str) -> tuple[int, ...] | None:
    """The row sizes of the blocks of a matrix of ``rows`` rows (None: the whole matrix)."""
    if split is None or split == 1:
        return None
    if isinstance(split, int):
        if rows % split:
            raise ValueError(f"{where}: split={split} row blocks do not divide the "
                             f"{rows} rows of its matrices.")
        return (rows // split,) * split
    if sum(split) != rows:
        raise ValueError(f"{where}: split sizes {split} add up to {sum(split)}, but its "
                         f"matrices have {rows} rows.")
    return tuple(split)


def leaf_row_blocks(tree: PyTree, split: Split, axes: list, name: str) -> list:
    """The row blocks of every leaf (None: whole matrices). Static."""
    leaves = tree_flatten(tree)[0]
    per_leaf = not _is_split(split)
    values = (leaf_labels(split, tree, "split", is_leaf=_is_split) if per_leaf
              else [split] * len(leaves))
    out = []
    for i, (x, ax, s) in enumerate(zip(leaves, axes, values)):
        if ax is None or s is None:
            out.append(None)
            continue
        if not _is_split(s):
            raise ValueError(f"{name}: split for updates{tree_paths(tree)[i]} is {s!r}; give "
                             "a number of row blocks, a tuple of row sizes, or None.")
        check_split_argument(s, name)
        out.append(_row_blocks(s, x.shape[ax[0]], f"{name}, updates{tree_paths(tree)[i]}"))
    return out


def require_whole_matrices(updates: PyTree, extra_args: dict[str, Any], axes: list,
                           name: str) -> None:
    """Raise when a leaf is sharded over one of its matrix axes (`sharded` without
    ``on_owners``). A leaf sharded over other axes only (the expert axis of an expert stack)
    holds whole matrices, each orthogonalized where it is."""
    reducer = extra_args.get(REDUCER_KEY)
    check = getattr(reducer, "require_whole", None)
    if check is None:
        return
    specs = getattr(reducer, "flat_specs", None)
    treespec = getattr(reducer, "treespec", None)
    if specs is None or treespec is None:
        check(updates, name)
        return
    try:
        flat = treespec.flatten_up_to(updates)
    except (ValueError, TypeError):
        return
    present = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    for i, ax in zip(present, axes):
        x = flat[i]
        if ax is None:
            continue
        if any(s.dim % x.dim() in ax for s in specs[i]):
            raise ValueError(
                f"{name} needs whole matrices, but leaf {i} is sharded over one of its matrix "
                f"axes {ax} here ({specs[i]}); orthogonalizing the local block would be "
                "another optimizer. Run it on owner ranks: opttx.distributed.sharded(tx, "
                "specs, on_owners=True), or shard such leaves over a batch axis (experts).")


def sharded_matrix_dims(leaves: list[torch.Tensor], spec: Any, axes: list,
                         extra_args: dict[str, Any]) -> list[tuple[int, ...]]:
    """Per leaf of ``leaves`` (of a tree of spec ``spec``), the matrix axes (of ``axes``) it is
    sharded over here, sorted (empty: whole matrices, or a leaf ``axes`` leaves alone); from
    the reducer of `opttx.distributed` in ``extra_args`` (none on one device). Static."""
    reducer = extra_args.get(REDUCER_KEY)
    none: list[tuple[int, ...]] = [()] * len(leaves)
    if reducer is None or getattr(reducer, "flat_specs", None) is None:
        return none
    try:
        flat = reducer.treespec.flatten_up_to(tree_unflatten(list(leaves), spec))
    except (ValueError, TypeError, AttributeError):
        return none
    present = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    out = []
    for i, x, ax in zip(present, leaves, axes):
        dims = sorted({s.dim % x.dim() for s in reducer.flat_specs[i]} & set(ax or ()))
        out.append(tuple(dims))
    return out


def _global_shapes(updates: PyTree, extra_args: dict[str, Any]) -> list[tuple[int, ...]]:
    """The whole shapes of the leaves present in ``updates`` (local shapes on one device)."""
    reducer = extra_args.get(REDUCER_KEY)
    known = getattr(reducer, "global_shapes_of", lambda tree: None)(updates)
    if known is not None:
        return [tuple(s) for s in known]
    return [tuple(x.shape) for x in tree_flatten(updates)[0]]


def global_matrix_shapes(leaves: list[torch.Tensor], spec: Any, extra_args: dict[str, Any]
                         ) -> list[tuple[int, ...]]:
    """The whole shapes of ``leaves`` (of a tree of spec ``spec``): under `opttx.distributed`
    those of the sharded tensors, on one device their own."""
    return _global_shapes(tree_unflatten(list(leaves), spec), extra_args)


def stateless_matrix_transform(name: str, fn: Callable[..., list[torch.Tensor]],
                               matrix_axes: MatrixAxes, split: Split, whole: bool = True,
                               batched: bool = False, on_shards: bool = False
                               ) -> GradientTransformation:
    """A stateless matrix transform from ``fn(leaves, axes, splits, shapes) -> leaves``
    (``shapes``: the whole shapes of the leaves); the leaves are checked (dims, axes, splits)
    at init and at every update (while tracing, in a compiled step). ``whole``: it needs
    whole matrices (refused on leaves sharded over a matrix axis); else it runs on local
    shards, reading the whole shapes (row blocks of a ``split`` still need whole rows).
    ``on_shards``: ``fn`` checks the shards itself and runs on them (`opttx.orthogonalize`'s
    Gram mode): it is called as ``fn(leaves, axes, splits, shapes, extra_args=...,
    spec=...)`` with the ``extra_args`` of the update and the spec of the updates' tree."""

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        axes = leaf_matrix_axes(params, matrix_axes, name)
        leaf_row_blocks(params, split, axes, name)
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EmptyState]:
        leaves, spec = tree_flatten(updates)
        if not leaves:
            return updates, state
        axes = leaf_matrix_axes(updates, matrix_axes, name)
        splits = leaf_row_blocks(updates, split, axes, name)
        if on_shards:
            shapes = _global_shapes(updates, extra_args)
            out = fn(leaves, axes, splits, shapes, extra_args=extra_args, spec=spec)
            return tree_unflatten(out, spec), state
        if whole:
            require_whole_matrices(updates, extra_args, axes, name)
        elif any(b is not None for b in splits):
            require_whole_matrices(updates, extra_args,
                                   [ax if b is not None else None
                                    for ax, b in zip(axes, splits)], name)
        shapes = _global_shapes(updates, extra_args)
        return tree_unflatten(fn(leaves, axes, splits, shapes), spec), state

    traits = _WHOLE_MATRICES if whole and not on_shards else Traits(per_leaf=True)
    return GradientTransformation(init, update,
                                  dataclasses.replace(traits, batched_across_leaves=batched))


def to_last_two(x: torch.Tensor, axes: tuple[int, int]) -> torch.Tensor:
    """``x`` with its matrix axes ``axes`` moved last (a view; ``x`` itself when they are)."""
    if axes == (x.dim() - 2, x.dim() - 1):
        return x
    return torch.movedim(x, axes, (-2, -1))


def from_last_two(y: torch.Tensor, axes: tuple[int, int]) -> torch.Tensor:
    """The inverse of `to_last_two`: the last two axes of ``y`` moved back to ``axes``."""
    if axes == (y.dim() - 2, y.dim() - 1):
        return y
    return torch.movedim(y, (-2, -1), axes)


def in_layout_of(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` (shaped like ``x``) with ``x``'s strides: a contiguous input gives a contiguous
    output (a transposed view would differ from the other branch of a `torch.cond` in
    `opttx.MultiSteps` and `opttx.apply_if_finite`)."""
    if y.stride() == x.stride():
        return y
    if x.is_contiguous():
        return y.contiguous()
    return torch.empty_like(x, dtype=y.dtype).copy_(y)
