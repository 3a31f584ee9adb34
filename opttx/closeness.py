"""Closeness of trees of tensors, and the gradients to compare transforms on: what both
`opttx.testing` (which re-exports them) and `opttx.conformance` use."""

from __future__ import annotations

import torch

from .tree import (PyTree, first_difference, keystr, reorder_like, tree_flatten_with_path,
                   tree_leaves, tree_map, tree_structure)

__all__ = ["assert_trees_close", "gradient_stream", "max_relative_error"]


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual − expected| / max|expected|`` (absolute error when ``expected`` is 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return err / scale if scale > 0 else err


def assert_trees_close(actual: PyTree, expected: PyTree, rtol: float = 1e-5,
                       atol: float = 0.0, what: str = "trees") -> None:
    """Assert two trees have the same structure and every leaf is close.

    Dicts that hold the same keys in another order are compared key by key; any other
    difference of structure fails, naming the first place where the trees differ. A leaf
    passes when ``max|a − e| <= atol + rtol · max|e|`` (its max relative error, see
    `max_relative_error`, is at most ``rtol`` when ``atol`` is 0). Shapes and dtypes must
    match. The error names the path of the worst leaf and its error.
    """
    if tree_structure(actual) != tree_structure(expected):
        reordered = reorder_like(actual, expected)
        if reordered is None:       # not only dict keys in another order: say what differs
            where = first_difference(actual, expected) or "<root>"
            raise AssertionError(f"{what}: the actual and expected trees have different "
                                 f"structures; first difference at {where}.")
        actual = reordered          # the same keys in another order: compared key by key
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


def gradient_stream(params: PyTree, steps: int, seed: int = 0,
                    scale: float = 1.0) -> list[PyTree]:
    """``steps`` trees of Gaussian gradients like ``params`` (reproducible from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    return [tree_map(lambda p: (scale * torch.randn(p.shape, generator=gen,
                                                    dtype=torch.float64)).to(p.dtype), params)
            for _ in range(steps)]
