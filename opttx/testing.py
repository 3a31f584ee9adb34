"""Tools for property-based tests of optimizers: hypothesis strategies for pytrees of tensors
and hyperparameters, closeness assertions on trees, and equivalence runners.

opttx's own test suite uses these; they are public so that users can prove their own
compositions equal a reference.

Example:
  >>> from hypothesis import given
  >>> from opttx.testing import param_trees, assert_equivalent
  >>> @given(tree=param_trees())
  ... def test_my_adam_is_adam(tree):
  ...     mine = opttx.chain(opttx.scale_by_adam(), opttx.scale(-1e-3))
  ...     assert_equivalent(mine, opttx.adam(1e-3), tree, steps=10)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .base import GradientTransformation, apply_updates
from .tree import PyTree, keystr, tree_flatten_with_path, tree_leaves, tree_map, tree_structure

__all__ = [
    "ParamTree",
    "assert_equivalent",
    "assert_trees_close",
    "gradient_stream",
    "max_relative_error",
    "param_trees",
    "run_transform",
    "shapes",
]


# ---------------------------------------------------------------------------------------------
# closeness
# ---------------------------------------------------------------------------------------------


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual − expected| / max|expected|`` (absolute error when ``expected`` is 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return err / scale if scale > 0 else err


def assert_trees_close(actual: PyTree, expected: PyTree, rtol: float = 1e-5,
                       atol: float = 0.0, what: str = "trees") -> None:
    """Assert two trees have the same structure and every leaf is close.

    A leaf passes when ``max|a − e| <= atol + rtol · max|e|`` (its max relative error, see
    `max_relative_error`, is at most ``rtol`` when ``atol`` is 0). Shapes and dtypes must
    match. The error names the path of the worst leaf and its error.
    """
    if tree_structure(actual) != tree_structure(expected):
        from .tree import assert_same_structure
        assert_same_structure(actual, expected, what)
    worst: tuple[float, str] = (0.0, "")
    for (path, a), e in zip(tree_flatten_with_path(actual)[0], tree_leaves(expected)):
        where = keystr(path) or "<root>"
        if not isinstance(a, torch.Tensor):
            assert a == e, f"{what}{where}: {a!r} != {e!r}"
            continue
        assert a.shape == e.shape, f"{what}{where}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{what}{where}: dtype {a.dtype} != {e.dtype}"
        if a.dtype == torch.bool or not a.is_floating_point():
            assert torch.equal(a, e), f"{what}{where}: values differ"
            continue
        assert torch.isfinite(a).all() == torch.isfinite(e).all(), \
            f"{what}{where}: non-finite values differ"
        a_f, e_f = torch.nan_to_num(a.double()), torch.nan_to_num(e.double())
        err = (a_f - e_f).abs().max().item() if a.numel() else 0.0
        scale = e_f.abs().max().item() if a.numel() else 0.0
        excess = err - (atol + rtol * scale)
        if excess > worst[0]:
            rel = err / scale if scale else float("inf")
            worst = (excess, f"{what}{where}: max abs error {err:.3e}, max relative error "
                             f"{rel:.3e} (rtol {rtol:g}, atol {atol:g})")
    assert worst[0] <= 0, worst[1]


# ---------------------------------------------------------------------------------------------
# running transforms
# ---------------------------------------------------------------------------------------------


def gradient_stream(params: PyTree, steps: int, seed: int = 0,
                    scale: float = 1.0) -> list[PyTree]:
    """``steps`` trees of Gaussian gradients like ``params`` (reproducible from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    return [tree_map(lambda p: (scale * torch.randn(p.shape, generator=gen,
                                                    dtype=torch.float64)).to(p.dtype), params)
            for _ in range(steps)]


def run_transform(tx: GradientTransformation, params: PyTree, grads: Sequence[PyTree],
                  **extra_args: Any) -> tuple[PyTree, Any]:
    """Apply ``tx`` for each gradient tree in ``grads``; return final params and state."""
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params, **extra_args)
        params = apply_updates(params, updates)
    return params, state


def assert_equivalent(tx_a: GradientTransformation, tx_b: GradientTransformation,
                      params: PyTree, steps: int = 10, grads: Sequence[PyTree] | None = None,
                      rtol: float = 1e-5, atol: float = 0.0, seed: int = 0) -> None:
    """Assert two transforms give the same parameters after ``steps`` updates.

    Gradients are Gaussian (`gradient_stream`) unless given.
    """
    grads = list(grads) if grads is not None else gradient_stream(params, steps, seed)
    pa, _ = run_transform(tx_a, params, grads)
    pb, _ = run_transform(tx_b, params, grads)
    assert_trees_close(pa, pb, rtol=rtol, atol=atol, what="params")


# ---------------------------------------------------------------------------------------------
# hypothesis strategies
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamTree:
    """A drawn parameter tree: ``tree`` (a dict of tensors) and the ``seed`` that made it."""
    tree: dict[str, torch.Tensor]
    seed: int

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tree.items()}
        dtypes = {str(v.dtype) for v in self.tree.values()}
        return f"ParamTree(shapes={shapes}, dtypes={dtypes}, seed={self.seed})"


def shapes(min_dims: int = 0, max_dims: int = 3, min_side: int = 1, max_side: int = 7):
    """Strategy for tensor shapes (tuples of ints)."""
    from hypothesis import strategies as st
    return st.lists(st.integers(min_side, max_side), min_size=min_dims,
                    max_size=max_dims).map(tuple)


def param_trees(min_leaves: int = 1, max_leaves: int = 4,
                dtypes: Sequence[torch.dtype] = (torch.float32,),
                shape_strategy: Any = None, scale: float = 1.0):
    """Strategy for `ParamTree`: a dict of 1–4 named tensors of drawn shapes and dtype.

    Values are Gaussian from a drawn seed (fast to generate and to shrink on failure).
    """
    from hypothesis import strategies as st

    shape_strategy = shape_strategy if shape_strategy is not None else shapes()

    @st.composite
    def build(draw: Callable) -> ParamTree:
        n = draw(st.integers(min_leaves, max_leaves))
        leaf_shapes = [draw(shape_strategy) for _ in range(n)]
        dtype = draw(st.sampled_from(list(dtypes)))
        seed = draw(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        tree = {f"p{i}": (scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype)
                for i, s in enumerate(leaf_shapes)}
        return ParamTree(tree=tree, seed=seed)

    return build()
