"""Pytree helpers shared by every transform.

opttx uses torch's own pytree library (``torch.utils._pytree``) everywhere: it needs no extra
dependency and Dynamo traces it under ``torch.compile(fullgraph=True)``. Lists, tuples, dicts,
``OrderedDict`` and NamedTuples are containers; tensors are leaves.

Two conventions differ from JAX and are worth knowing:

* ``None`` is a *leaf* in torch's pytree. opttx never uses ``None`` to mark an absent leaf;
  it uses `MaskedNode`, an empty container, so masked trees keep their structure.
* Every other module reaches torch's pytree only through this one (and ``torch._foreach_*``
  only through `opttx.kernels`): the two modules are where opttx touches private torch APIs,
  so a change in torch is fixed in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.utils._pytree as _pytree

from ._tracing import is_tracing
from .kernels import foreach_copy_

PyTree = Any

__all__ = [
    "MaskedNode",
    "PyTree",
    "Static",
    "assert_same_structure",
    "find_instances",
    "first_difference",
    "is_pytree_leaf",
    "mark_static_",
    "stats_like",
    "register_static_node",
    "tree_cast",
    "tree_cond",
    "tree_while",
    "tree_copy_",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_full_like",
    "tree_leaves",
    "tree_map",
    "tree_paths",
    "tree_structure",
    "tree_unflatten",
    "tree_zeros_like",
]

tree_map = _pytree.tree_map
tree_leaves = _pytree.tree_leaves
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_structure = _pytree.tree_structure
tree_flatten_with_path = _pytree.tree_flatten_with_path
keystr = _pytree.keystr
# whether a node is a leaf of torch's pytrees (none of its registered containers), without
# flattening it: torch's public name where it has one, its private one in older versions
is_pytree_leaf = getattr(_pytree, "tree_is_leaf", None) or _pytree._is_leaf


class MaskedNode(NamedTuple):
    """An empty container standing where a leaf is masked out (see `opttx.masked`).

    It has no children, so flattening a masked tree skips it and a transform never sees it,
    while the tree keeps the structure of the full parameter tree.
    """


@dataclasses.dataclass(frozen=True)
class Static:
    """A value kept in a tree's *structure*, not in its leaves: a node without children whose
    ``value`` (hashable: strings, numbers, tuples) is part of the tree spec.

    States use it for what describes them without being data: which transform and
    configuration made them (``made_by``), the roles of injected hyperparameters. Flattening,
    ``torch.cond``, ``vmap``, grouped kernels and checkpoints see no tensor in it; comparing
    two tree specs compares the values; ``torch.compile`` treats it as a constant (no
    recompile while it is unchanged), and ``torch.load(weights_only=True)`` accepts it.
    """

    value: Any = None

    def __reduce__(self) -> tuple:
        return (Static, (self.value,))


_pytree.register_pytree_node(
    Static, lambda node: ([], node.value), lambda _, value: Static(value),
    flatten_with_keys_fn=lambda node: ([], node.value), serialized_type_name="opttx.Static")


# ---------------------------------------------------------------------------------------------
# structure
# ---------------------------------------------------------------------------------------------


def register_static_node(cls: type, name: str) -> type:
    """Make ``cls`` a pytree node without children whose instance is its own context.

    Static, declared metadata inside a state (the layout of a quantized statistic, the place of
    a parameter's state): flattening yields no leaf, the instance sits in the treespec (so
    tree structures with other metadata compare unequal), ``tree_map``, ``torch.compile``,
    ``torch.func.vmap`` and checkpoints pass it through unchanged. Instances must be
    immutable, hashable and comparable (a frozen dataclass). ``name`` is the stable name used
    when a treespec is serialized. Returns ``cls``.
    """
    _pytree.register_pytree_node(cls, lambda node: ([], node), lambda _, node: node,
                                 serialized_type_name=name,
                                 flatten_with_keys_fn=lambda node: ([], node))
    return cls




def tree_paths(tree: PyTree) -> list[str]:
    """The path of every leaf of ``tree`` as a string such as ``['layers'][0].weight``."""
    return [keystr(path) or "<root>" for path, _ in tree_flatten_with_path(tree)[0]]


def first_difference(a: PyTree, b: PyTree, path: str = "") -> str:
    """Path and description of the first place where ``a`` and ``b`` differ in structure
    (empty when they have the same structure), for error messages."""
    a_leaf, b_leaf = is_pytree_leaf(a), is_pytree_leaf(b)
    if a_leaf and b_leaf:
        return ""
    if a_leaf != b_leaf:
        kinds = ("a leaf", "a container")
        return f"{path or '<root>'}: {kinds[not a_leaf]} vs {kinds[not b_leaf]}"
    a_children, a_ctx = _node_children(a)
    b_children, b_ctx = _node_children(b)
    if (isinstance(a, dict) and type(a) is type(b) and a_ctx != b_ctx
            and sorted(map(repr, a_ctx)) == sorted(map(repr, b_ctx))):
        return (f"{path or '<root>'}: the same keys in another order, {list(a_ctx)!r} vs "
                f"{list(b_ctx)!r} (the order of a dict's keys is part of a pytree's "
                "structure)")
    if type(a) is not type(b) or a_ctx != b_ctx or len(a_children) != len(b_children):
        return (f"{path or '<root>'}: {type(a).__name__} with keys {a_ctx!r} vs "
                f"{type(b).__name__} with keys {b_ctx!r}")
    for key, ca, cb in zip(_node_keys(a), a_children, b_children):
        found = first_difference(ca, cb, path + key)
        if found:
            return found
    return ""


def _one_level(node: Any) -> Any:
    """``node`` flattened one level: its children are the leaves (public pytree API only)."""
    return lambda x: x is not node


def _node_children(node: Any) -> tuple[list, Any]:
    children, spec = tree_flatten(node, is_leaf=_one_level(node))
    return list(children), spec.context


def _node_keys(node: Any) -> list[str]:
    entries, _ = tree_flatten_with_path(node, is_leaf=_one_level(node))
    return [keystr(path) for path, _ in entries]


def find_instances(tree: Any, cls: type) -> list[Any]:
    """Every instance of ``cls`` in a nested state (dicts, tuples, lists, NamedTuples), outermost
    first; an instance's own fields are searched too (a wrapper state around another)."""
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, cls):
            found.append(node)
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (tuple, list)):
            for v in node:
                walk(v)

    walk(tree)
    return found


def assert_same_structure(a: PyTree, b: PyTree, what: str = "trees") -> None:
    """Raise ``ValueError`` naming the first differing path if ``a`` and ``b`` differ (and,
    for dicts whose keys differ in order only, saying so)."""
    if tree_structure(a) == tree_structure(b):
        return
    where = first_difference(a, b) or "<root>"
    if "the same keys in another order" in where:
        advice = ("Build both with the same key order (e.g. {k: grads[k] for k in params}), "
                  "or pass the tree you built the state from.")
    else:
        advice = "Pass updates, state and params built from the same parameter tree."
        if _looks_swapped(a, b) or _looks_swapped(b, a):
            which = "first" if _looks_swapped(a, b) else "second"
            advice = (f"The {which} looks like an optimizer state (NamedTuples, step counts), "
                      "not a tree like the parameters: were the two results of update "
                      "unpacked the wrong way round? It returns (updates, state): "
                      "updates, state = tx.update(grads, state, params).")
    raise ValueError(f"The {what} have different structures; first difference at {where}. "
                     f"{advice}")


def _looks_swapped(a: PyTree, b: PyTree) -> bool:
    """Whether ``a`` looks like an optimizer state (holds a NamedTuple or a 0-dim integer
    tensor) where ``b`` does not: the sign of ``(state, updates)`` unpacked the wrong way."""
    def state_like(tree: PyTree) -> bool:
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return not isinstance(tree, MaskedNode)
        if isinstance(tree, (tuple, list)):
            return any(state_like(x) for x in tree)
        if isinstance(tree, dict):
            return any(state_like(x) for x in tree.values())
        return isinstance(tree, torch.Tensor) and tree.ndim == 0 and \
            not tree.is_floating_point()
    return state_like(a) and not state_like(b)


def reorder_like(tree: PyTree, like: PyTree) -> PyTree | None:
    """``tree`` with the keys of each dict in the order of the same dict in ``like`` when the
    two differ only in the order of dict keys (the same values, re-keyed), else None."""
    if isinstance(tree, dict) and isinstance(like, dict):
        if type(tree) is not type(like) or set(tree) != set(like):
            return None
        out = {}
        for k in like:
            sub = reorder_like(tree[k], like[k])
            if sub is None:
                return None
            out[k] = sub
        return type(tree)(out) if type(tree) is not dict else out
    if isinstance(tree, (list, tuple)) and type(tree) is type(like) and len(tree) == len(like):
        parts = [reorder_like(a, b) for a, b in zip(tree, like)]
        if any(p is None for p in parts):
            return None
        if hasattr(tree, "_fields"):
            return type(tree)(*parts)
        return type(tree)(parts)
    if tree_structure(tree) == tree_structure(like):
        return tree
    return None


# ---------------------------------------------------------------------------------------------
# building trees
# ---------------------------------------------------------------------------------------------


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of zeros like ``tree`` (in ``dtype`` when given)."""
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def tree_full_like(tree: PyTree, value: float, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of constants like ``tree`` (in ``dtype`` when given)."""
    return tree_map(lambda x: torch.full_like(x, value, dtype=dtype), tree)


def tree_cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Cast every floating leaf of ``tree`` to ``dtype`` (no-op when ``dtype`` is None)."""
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2",
                                                   "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, name))


def state_dtype(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype of optimizer statistics for a leaf: ``dtype`` if given, else fp32 for
    16-bit floats (docs/design.md, rule 3), else the leaf's own dtype.

    Raises:
      TypeError: a float8 ``dtype`` (``mu_dtype=torch.float8_e4m3fn``): torch's grouped
        kernels have no float8 arithmetic, and an unscaled float8 moment loses every value
        below its smallest subnormal; `opttx.quantize_state` with ``format="e4m3"`` keeps
        moments in float8 with a scale per block.
    """
    if dtype is not None:
        if dtype in _FLOAT8:
            raise TypeError(
                f"a {dtype} optimizer statistic (mu_dtype/nu_dtype) is not supported: torch's "
                "grouped kernels (lerp, addcmul) have no float8 arithmetic, and an unscaled "
                "float8 moment flushes small values to zero. Keep the moments in float8 with "
                "opttx.quantize_state(inner, format='e4m3') (or 'e5m2'): float8 values with "
                "one fp32 scale per block of 256, decoded to fp32 for each step.")
        return dtype
    if x.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return x.dtype


def stats_like(tree: PyTree, dtype: torch.dtype | None = None, value: float = 0.0) -> PyTree:
    """Statistics buffers like ``tree``: fp32 for 16-bit leaves unless ``dtype`` says otherwise."""
    return tree_map(lambda x: torch.full_like(x, value, dtype=state_dtype(x, dtype)), tree)


def mark_static_(*trees: PyTree) -> None:
    """Mark every tensor leaf of ``trees`` (parameters, gradients, optimizer state) as a
    static address for ``torch.compile``.

    CUDA graphs (``torch.compile(mode="reduce-overhead")``) replay fixed memory addresses; a
    step that writes its parameters and state in place (`opttx.apply_updates_`,
    `tree_copy_`) is captured only when those inputs are marked static, as torch's own
    compiled optimizers do. Call it once, before the first compiled call.

    Example:
      >>> opttx.tree.mark_static_(params, state)
      >>> step = torch.compile(train_step, mode="reduce-overhead", fullgraph=True)
    """
    for tree in trees:
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                torch._dynamo.mark_static_address(leaf)


def tree_copy_(dst: PyTree, src: PyTree) -> PyTree:
    """Copy every leaf of ``src`` into the matching leaf of ``dst`` in place; return ``dst``.

    In a compiled step this is how new optimizer state lands in the old buffers: ``copy_`` into
    graph inputs lowers to in-place writes, so the step does not hold two states. Compiled, it
    is one ``copy_`` per leaf, which Inductor folds into the kernel computing the value (a
    grouped ``_foreach_copy_`` it does not fold on CUDA: see `opttx.kernels.foreach_copy_`).
    """
    dst_leaves, spec = tree_flatten(dst)
    src_leaves = tree_leaves(src)
    if len(dst_leaves) != len(src_leaves):
        assert_same_structure(dst, src, "destination and source trees")
    pairs = [(d, s) for d, s in zip(dst_leaves, src_leaves)
             if isinstance(d, torch.Tensor) and d is not s]
    if pairs:
        foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    return dst


# ---------------------------------------------------------------------------------------------
# control flow that compiles
# ---------------------------------------------------------------------------------------------


def tree_cond(pred: torch.Tensor, true_fn: Callable, false_fn: Callable,
              operands: tuple) -> Any:
    """``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``, graph-safe.

    Both branches must return a tree with the structure of ``operands`` (same shapes and
    dtypes in both branches). Under ``torch.compile`` this is ``torch.cond`` over the flat
    leaves (one graph holds both branches and nothing recompiles when ``pred`` flips);
    outputs that are operands are cloned, as ``torch.cond`` forbids aliasing. In eager mode it
    is a Python branch on the value of ``pred``, so only one branch runs; under ``vmap``
    (`opttx.stacked`), where ``pred`` holds one value per slice, both run and each element is
    selected with ``torch.where``.
    """
    if not is_tracing():
        if _is_batched(pred):
            chosen = tree_flatten(true_fn(*operands))[0]
            other, spec = tree_flatten(false_fn(*operands))
            return tree_unflatten([torch.where(pred, a, b) for a, b in zip(chosen, other)],
                                  spec)
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    leaves, spec = tree_flatten(operands)
    out = torch.cond(pred, _on_leaves(true_fn, spec), _on_leaves(false_fn, spec), tuple(leaves))
    return tree_unflatten(list(out), spec)


def _is_batched(x: torch.Tensor) -> bool:
    """Whether ``x`` is a tensor of ``torch.vmap`` (its value differs per slice)."""
    check = getattr(torch._C._functorch, "is_batchedtensor", None)
    return bool(check is not None and isinstance(x, torch.Tensor) and check(x))


def _on_leaves(fn: Callable, spec: Any) -> Callable:
    """``fn`` of the operands' tree as a function of their flat leaves returning flat leaves,
    an output that is an input cloned (the control-flow operators forbid aliasing)."""
    def flat(*leaves: torch.Tensor) -> tuple:
        out = tree_flatten(fn(*tree_unflatten(list(leaves), spec)))[0]
        return tuple(t.clone() if any(t is i for i in leaves) else t for t in out)
    return flat


def tree_while(cond_fn: Callable, body_fn: Callable, operands: tuple) -> Any:
    """``while cond_fn(*operands): operands = body_fn(*operands)``, graph-safe.

    ``body_fn`` must return a tree with the structure, shapes and dtypes of ``operands``;
    ``cond_fn`` a boolean 0-dim tensor. In eager mode this is that Python loop (one device
    sync per test of the condition). Under ``torch.compile`` it is ``torch.while_loop`` over
    the flat leaves: a data-dependent number of iterations inside one graph, with the same
    iterates as the eager loop.
    """
    if not is_tracing():
        while bool(cond_fn(*operands)):
            operands = body_fn(*operands)
        return operands
    leaves, spec = tree_flatten(operands)

    def flat_cond(*flat: torch.Tensor) -> torch.Tensor:
        return cond_fn(*tree_unflatten(list(flat), spec))

    while_loop = getattr(torch, "while_loop", None)
    if while_loop is None:                   # torch < 2.12 has it under its private name
        from torch._higher_order_ops.while_loop import while_loop
    out = while_loop(flat_cond, _on_leaves(body_fn, spec), tuple(leaves))
    return tree_unflatten(list(out), spec)


def flatten_matching(updates: PyTree, *trees: PyTree, what: str = "updates and state"
                     ) -> tuple[Any, list[torch.Tensor], ...]:
    """Flatten ``updates`` and ``trees`` that must share its structure.

    Returns ``(treespec, update_leaves, *leaves_of_each_tree)``; raises ``ValueError`` naming
    the first differing path when a tree's structure differs.
    """
    leaves, spec = tree_flatten(updates)
    out: list[Any] = [spec, leaves]
    for tree in trees:
        other, other_spec = tree_flatten(tree)
        if other_spec != spec:
            assert_same_structure(updates, tree, what)
        out.append(other)
    return tuple(out)


_MASKED = object()   # stands for a MaskedNode position while labels are resolved
_FLAT_LAYOUT = [0]   # depth of `flat_layout` blocks (opttx.flatten's inner transform)


@contextlib.contextmanager
def flat_layout() -> Iterator[None]:
    """Inside this block the trees transforms see are flat buffers (`opttx.flatten`), not the
    parameters: per-leaf values given as functions of the tree (masks, labels, axes), which
    would read the buffers' shapes instead of the parameters', are refused by `leaf_labels`."""
    _FLAT_LAYOUT[0] += 1
    try:
        yield
    finally:
        _FLAT_LAYOUT[0] -= 1


def leaf_labels(labels: PyTree | Callable[[PyTree], PyTree], tree: PyTree,
                what: str = "labels", is_leaf: Callable[[Any], bool] | None = None
                ) -> list[Any]:
    """Resolve per-leaf values given as a tree like ``tree`` (or a prefix of it, or a function
    of ``tree`` returning one) to one value per leaf of ``tree``; ``is_leaf`` marks values
    that are containers in pytree terms (a tuple of axes) as single values."""
    is_masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731
    if callable(labels) and _FLAT_LAYOUT[0]:
        raise ValueError(
            f"opttx.flatten: the {what} are given as a function of the tree, but inside "
            "flatten the tree is one flat buffer per (device, dtype), so the function would "
            "see the buffers instead of the parameters (a mask of ndim >= 2 would drop every "
            "matrix). Put flatten inside the masking instead: "
            "opttx.partition({'decay': opttx.flatten(opttx.adamw(lr, weight_decay=wd)), "
            "'no_decay': opttx.flatten(opttx.adamw(lr, weight_decay=0.0))}, labels), or "
            "opttx.masked(opttx.flatten(inner), mask).")
    if callable(labels):
        fn = labels
        try:
            labels = fn(tree)       # a tree_map keeps the masked positions (MaskedNode)
        except (AttributeError, TypeError):
            # a function that reads the leaves directly (``{k: v.ndim > 1 for k, v in
            # p.items()}``) fails on a MaskedNode (a rank's part under zero or on_owners):
            # masked positions get a 0-dim meta tensor instead; their values are dropped below
            if not any(is_masked(x) for x in _pytree.tree_leaves(tree, is_leaf=is_masked)):
                raise
            labels = fn(_pytree.tree_map(
                lambda x: torch.empty((), device="meta") if is_masked(x) else x, tree,
                is_leaf=is_masked))
    # labels made from a tree with masked positions (by a function of it, as any tree_map
    # keeps them; by `partition` for its groups) hold MaskedNode there: no value
    labels = _pytree.tree_map(lambda x: _MASKED if is_masked(x) else x, labels,
                              is_leaf=is_masked)
    # a masked-out position (MaskedNode) still has its value in ``labels``: resolve the values
    # for every position, then drop those of the masked ones
    positions = _pytree.tree_map(lambda x: _MASKED if is_masked(x) else x, tree,
                                 is_leaf=is_masked)
    # each value of ``labels`` (a prefix of the tree) covers the leaves of its subtree
    values, value_spec = tree_flatten(labels, is_leaf=is_leaf)
    try:
        subtrees = value_spec.flatten_up_to(positions)
    except (ValueError, TypeError, RuntimeError):
        flat = None
    else:
        flat = []                # (a leaf position is one value: no pytree call for it)
        for v, sub in zip(values, subtrees):
            if is_pytree_leaf(sub):
                flat.append(v)
            else:
                flat.extend(v for _ in tree_leaves(sub))
    if flat is None:
        where = first_difference(labels, tree) or "the structures differ"
        inside = (" Inside opttx.flatten the tree is one flat buffer per (device, dtype), not "
                  "the parameters: put flatten inside the masking (opttx.masked(opttx.flatten"
                  "(inner), mask) or opttx.partition of flattened transforms)."
                  if _FLAT_LAYOUT[0] else "")
        raise ValueError(f"The {what} do not match the parameter tree: {where}. Give one "
                         f"value per parameter leaf, in a tree of the same structure.{inside}")
    return [v for v, x in zip(flat, tree_leaves(positions)) if x is not _MASKED]


def mask_leaves(mask: PyTree | Callable[[PyTree], PyTree], params: PyTree) -> list[bool]:
    """Resolve a mask (a tree of Python booleans like ``params``, a prefix of it, or a function
    of ``params`` returning one) to one boolean per leaf of ``params``.

    Masks are static: they decide which leaves a transform touches, so they must be Python
    booleans (from names and shapes), never tensors.
    """
    flat = leaf_labels(mask, params, "mask values")
    if not all(isinstance(value, bool) for value in flat):    # (the paths only for the error)
        for path, value in zip(tree_paths(params), flat):
            if not isinstance(value, bool):
                raise TypeError(f"mask{path} is {type(value).__name__}; masks hold Python "
                                "booleans (decided from names and shapes), not tensors.")
    return flat
