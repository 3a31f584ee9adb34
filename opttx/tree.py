"""Pytree helpers shared by every transform.

opttx uses torch's own pytree library (``torch.utils._pytree``) everywhere: it needs no extra
dependency and Dynamo traces it under ``torch.compile(fullgraph=True)``. Lists, tuples, dicts,
``OrderedDict`` and NamedTuples are containers; tensors are leaves.

Two conventions differ from JAX and are worth knowing:

* ``None`` is a *leaf* in torch's pytree. opttx never uses ``None`` to mark an absent leaf;
  it uses `MaskedNode`, an empty container, so masked trees keep their structure.
* The elementwise hot paths work on *lists of leaves* with ``torch._foreach_*`` kernels (one
  call for a whole group of tensors), not on ``tree_map`` of per-leaf ops (DESIGN.md rule 4).

The ``foreach_*`` helpers below take scalars that may be Python numbers or 0-dim tensors (a
hyperparameter injected with `opttx.inject_hyperparams`, a bias correction computed from the
step count), and honour *donation*: inside `donating` the helpers that update optimizer state
write into the old state buffers instead of allocating new ones. Purity is the semantics;
donation is how `opttx.Optimizer` and `apply_updates_` avoid doubling memory in eager mode.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.utils._pytree as _pytree

PyTree = Any
Scalar = float | int | torch.Tensor

__all__ = [
    "MaskedNode",
    "PyTree",
    "assert_same_structure",
    "donating",
    "is_donating",
    "mark_static_",
    "tree_cast",
    "tree_cond",
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
_is_leaf = getattr(_pytree, "tree_is_leaf", None) or _pytree._is_leaf


class MaskedNode(NamedTuple):
    """An empty container standing where a leaf is masked out (see `opttx.masked`).

    It has no children, so flattening a masked tree skips it and a transform never sees it,
    while the tree keeps the structure of the full parameter tree.
    """


# ---------------------------------------------------------------------------------------------
# structure
# ---------------------------------------------------------------------------------------------


def tree_paths(tree: PyTree) -> list[str]:
    """The path of every leaf of ``tree`` as a string such as ``['layers'][0].weight``."""
    return [keystr(path) or "<root>" for path, _ in tree_flatten_with_path(tree)[0]]


def _first_difference(a: PyTree, b: PyTree, path: str = "") -> str:
    """Path and description of the first place where ``a`` and ``b`` differ in structure."""
    a_leaf, b_leaf = _is_leaf(a), _is_leaf(b)
    if a_leaf and b_leaf:
        return ""
    if a_leaf != b_leaf:
        kinds = ("a leaf", "a container")
        return f"{path or '<root>'}: {kinds[not a_leaf]} vs {kinds[not b_leaf]}"
    a_children, a_ctx = _node_children(a)
    b_children, b_ctx = _node_children(b)
    if type(a) is not type(b) or a_ctx != b_ctx or len(a_children) != len(b_children):
        return (f"{path or '<root>'}: {type(a).__name__} with keys {a_ctx!r} vs "
                f"{type(b).__name__} with keys {b_ctx!r}")
    for key, ca, cb in zip(_node_keys(a), a_children, b_children):
        found = _first_difference(ca, cb, path + key)
        if found:
            return found
    return ""


def _node_children(node: Any) -> tuple[list, Any]:
    handler = _pytree.SUPPORTED_NODES[_pytree._get_node_type(node)]
    children, context = handler.flatten_fn(node)
    return list(children), context


def _node_keys(node: Any) -> list[str]:
    handler = _pytree.SUPPORTED_NODES[_pytree._get_node_type(node)]
    if handler.flatten_with_keys_fn is None:
        return [f"[{i}]" for i in range(len(_node_children(node)[0]))]
    entries, _ = handler.flatten_with_keys_fn(node)
    return [keystr((k,)) for k, _ in entries]


def assert_same_structure(a: PyTree, b: PyTree, what: str = "trees") -> None:
    """Raise ``ValueError`` naming the first differing path if ``a`` and ``b`` differ."""
    if tree_structure(a) == tree_structure(b):
        return
    where = _first_difference(a, b) or "<root>"
    raise ValueError(f"The {what} have different structures; first difference at {where}. "
                     "Pass updates, state and params built from the same parameter tree.")


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


def state_dtype(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype of optimizer statistics for a leaf: ``dtype`` if given, else fp32 for
    16-bit floats (DESIGN.md rule 3), else the leaf's own dtype."""
    if dtype is not None:
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
    graph inputs lowers to in-place writes, so the step does not hold two states.
    """
    dst_leaves, spec = tree_flatten(dst)
    src_leaves = tree_leaves(src)
    if len(dst_leaves) != len(src_leaves):
        assert_same_structure(dst, src, "destination and source trees")
    pairs = [(d, s) for d, s in zip(dst_leaves, src_leaves)
             if isinstance(d, torch.Tensor) and d is not s]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
    return dst


# ---------------------------------------------------------------------------------------------
# donation: in-place state updates when the caller gives up the old state
# ---------------------------------------------------------------------------------------------

_DONATE = [False]


def is_donating() -> bool:
    """Whether the caller has donated the old state buffers (see `donating`).

    Always False while ``torch.compile`` traces: a compiled step is functional and its final
    ``copy_`` into the inputs (`tree_copy_`) is what lowers to in-place writes.
    """
    return _DONATE[0] and not torch.compiler.is_compiling()


@contextlib.contextmanager
def donating(enabled: bool = True) -> Iterator[None]:
    """Let transforms write their new state into the old state buffers.

    Inside this context the caller promises not to use the state it passes to ``update``
    again (it is replaced by the returned state, which then aliases the same storage). The
    numbers are unchanged; only allocations are saved. ``donating(False)`` switches it off for
    a block, as wrappers do that must keep the old state (`apply_if_finite`, `MultiSteps`).
    """
    previous = _DONATE[0]
    _DONATE[0] = enabled
    try:
        yield
    finally:
        _DONATE[0] = previous
        if not previous:
            _OWNED.clear()


# Temporaries created by opttx inside `donating` (fresh update tensors no one else holds):
# id -> tensor, weakly. A later link of the chain may overwrite them in place. Tensors are
# registered explicitly where they are created, so buffers that alias state or ``p.grad``
# are never in it.
_OWNED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def mark_owned(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Record fresh temporaries (inside `donating`) so later links may reuse them; returns
    ``tensors``."""
    if is_donating():
        for t in tensors:
            _OWNED[id(t)] = t
    return tensors


def is_owned(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is a temporary registered with `mark_owned` (so it may be
    overwritten in place)."""
    return bool(tensors) and is_donating() and all(_OWNED.get(id(t)) is t for t in tensors)


def scalar_operand(value: Scalar, like: Sequence[torch.Tensor]) -> Scalar:
    """Prepare a 0-dim coefficient for a foreach op over ``like``.

    Under ``torch.compile`` on CPU, Inductor inlines the arithmetic that produced a 0-dim
    tensor (a bias correction's ``pow``, a schedule's ``cos``) into every element loop of the
    kernel that consumes it. Passing it through a foreach add makes Inductor read it once as a
    scalar argument instead (measured: compiled AdamW 4.97x -> 1.02x torch's fused kernel).
    That scalar is a C ``float``, so float64 leaves keep the inlined (exact) form.
    """
    if (isinstance(value, torch.Tensor) and torch.compiler.is_compiling()
            and value.device.type == "cpu" and like
            and all(t.dtype != torch.float64 for t in like)):
        # ``value * 1``: an intermediate, not the graph input itself, or Dynamo specializes
        # on the input's value (a recompile whenever an injected weight decay changes)
        return torch._foreach_add([value.new_zeros(())], value * 1)[0]
    return value


# Devices whose 0-dim tensors a compiled step may read back to the host as a scalar kernel
# argument (free on the CPU; see `scalar_operand`). On any other device that read is a
# device-to-host sync in every step, and Inductor will not put such a graph in a CUDA graph.
HOST_READABLE_DEVICES: tuple[str, ...] = ("cpu",)

# grouped ops with a List overload, where a 0-dim tensor repeated per tensor broadcasts
_LIST_OVERLOADS = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "clamp_min",
                             "clamp_max", "pow", "lerp"})


def device_scalar(op: str, value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """``value`` for ``torch._foreach_<op>(tensors, ..., value)`` in a compiled step.

    Given a 0-dim tensor where a grouped kernel takes a Scalar, torch picks the Scalar
    overload and reads the tensor back to the host (``.item()``) first; in a compiled graph
    on a GPU that is a sync per step, and it keeps the graph out of CUDA graphs. Repeated
    once per tensor it selects the List overload instead, which broadcasts it on the device.
    Eager steps and host-readable devices keep ``value`` as it is."""
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and tensors
            and op in _LIST_OVERLOADS and torch.compiler.is_compiling()
            and value.device.type not in HOST_READABLE_DEVICES):
        return [value] * len(tensors)
    return value


# ---------------------------------------------------------------------------------------------
# grouped elementwise kernels
# ---------------------------------------------------------------------------------------------

Tensors = Sequence[torch.Tensor]


def foreach_op_(op: str, tensors: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
    """``torch._foreach_<op>(tensors, *args)`` on *temporaries* the caller owns.

    In eager mode it runs in place (no new allocation); under ``torch.compile`` out of place
    (Inductor fuses it anyway, and in-place foreach ops are refused inside ``torch.cond``
    branches), with a 0-dim tensor argument kept on its device (`device_scalar`). Returns the
    result list.
    """
    if torch.compiler.is_compiling():
        args = tuple(device_scalar(op, a, tensors) for a in args)
        return list(getattr(torch, f"_foreach_{op}")(tensors, *args))
    getattr(torch, f"_foreach_{op}_")(tensors, *args)
    return tensors


def foreach_sum_of_squares(tensors: Tensors, dtype: torch.dtype | None = None
                           ) -> list[torch.Tensor]:
    r""":math:`\sum x^2` of every tensor, as 0-dim tensors in ``dtype`` (default: float64 if
    any tensor is float64, else float32).

    Eager: one grouped ``_foreach_norm`` pass, squared. Compiled: one ``sum(x * x)`` reduction
    per tensor, which Inductor fuses with the producer of ``x`` (it lowers ``_foreach_norm``
    to separate, slower reductions: about 1.8x slower for clip-by-RMS + apply on CPU).
    """
    if not tensors:
        return []
    if dtype is None:
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in tensors) \
            else torch.float32
    if torch.compiler.is_compiling():
        return [torch.sum(torch.square(x.to(dtype))) for x in tensors]
    norms = torch._foreach_norm(list(tensors), 2, dtype=dtype)
    return list(torch._foreach_mul(norms, norms))


def foreach_ema(old: Tensors, new: Tensors, decay: Scalar) -> list[torch.Tensor]:
    """``decay * old + (1 - decay) * new`` for every pair; in place on ``old`` when donating.

    Written as a ``lerp`` (one pass) when ``old`` and ``new`` share a dtype.
    """
    if not old:
        return []
    new = _match_dtypes(new, old)
    weight = device_scalar("lerp", scalar_operand(1 - decay, old), old)
    if is_donating():
        torch._foreach_lerp_(old, new, weight)
        return list(old)
    return list(torch._foreach_lerp(old, new, weight))


def foreach_ema_sq(old: Tensors, new: Tensors, decay: Scalar) -> list[torch.Tensor]:
    """``decay * old + (1 - decay) * new²`` for every pair; in place on ``old`` when donating."""
    if not old:
        return []
    new = _match_dtypes(new, old)
    out = _maybe_inplace(torch._foreach_mul, old, scalar_operand(decay, old))
    if isinstance(decay, torch.Tensor):
        weight = scalar_operand(1 - decay, old)
        return foreach_op_("add", out, torch._foreach_mul(torch._foreach_mul(new, new), weight))
    return foreach_op_("addcmul", out, new, new, 1 - decay)


def foreach_accumulate_sq(old: Tensors, new: Tensors) -> list[torch.Tensor]:
    """``old + new²`` for every pair; in place on ``old`` when donating."""
    if not old:
        return []
    new = _match_dtypes(new, old)
    if is_donating():
        torch._foreach_addcmul_(old, new, new)
        return list(old)
    return list(torch._foreach_addcmul(old, new, new))


def foreach_axpy(a: Scalar, x: Tensors, y: Tensors) -> list[torch.Tensor]:
    """``a * x + y`` for every pair. ``x`` is left untouched; ``y`` is overwritten in place
    only when it is a temporary of the running chain (`is_owned`), else a new list is made."""
    if not x:
        return []
    y = list(y)
    a = scalar_operand(a, y)
    if is_owned(y):
        if isinstance(a, torch.Tensor):
            torch._foreach_add_(y, torch._foreach_mul(x, a))
        else:
            torch._foreach_add_(y, x, alpha=a)
        return y
    if isinstance(a, torch.Tensor):
        return mark_owned(list(torch._foreach_add(y, torch._foreach_mul(x, a))))
    return mark_owned(list(torch._foreach_add(y, x, alpha=a)))


def foreach_scale(x: Tensors, factor: Scalar) -> list[torch.Tensor]:
    """``factor * x`` for every leaf; in place when ``x`` is a temporary of the running chain
    (`is_owned`), else as new tensors."""
    if not x:
        return []
    x = list(x)
    factor = scalar_operand(factor, x)
    if is_owned(x):
        torch._foreach_mul_(x, factor)
        return x
    return mark_owned(list(torch._foreach_mul(x, factor)))


def _maybe_inplace(op: Callable, tensors: Tensors, *args: Any) -> list[torch.Tensor]:
    if is_donating():
        getattr(torch, op.__name__ + "_")(tensors, *args)
        return list(tensors)
    return list(op(tensors, *args))


def _match_dtypes(tensors: Tensors, like: Tensors) -> list[torch.Tensor]:
    return [t if t.dtype == l.dtype else t.to(l.dtype) for t, l in zip(tensors, like)]


def cast_like(tensors: Tensors, like: Tensors) -> list[torch.Tensor]:
    """``tensors`` each cast to the dtype of the matching tensor of ``like``."""
    return _match_dtypes(tensors, like)


def new_buffers(tensors: Tensors, fresh: Tensors) -> list[torch.Tensor]:
    """Return ``fresh``, written into the buffers ``tensors`` when donating (state replaced by
    values computed out of place, for example a running maximum or a where-select)."""
    if is_donating() and tensors:
        torch._foreach_copy_(list(tensors), list(fresh))
        return list(tensors)
    return list(fresh)


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
    is a Python branch on the value of ``pred``, so only one branch runs.
    """
    if not torch.compiler.is_compiling():
        return true_fn(*operands) if bool(pred) else false_fn(*operands)
    leaves, spec = tree_flatten(operands)

    def flat_branch(fn: Callable) -> Callable:
        def branch(*flat: torch.Tensor) -> tuple:
            out = tree_flatten(fn(*tree_unflatten(list(flat), spec)))[0]
            return tuple(t.clone() if any(t is i for i in flat) else t for t in out)
        return branch

    out = torch.cond(pred, flat_branch(true_fn), flat_branch(false_fn), tuple(leaves))
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


def foreach_scale_add(old: Tensors, decay: Scalar, new: Tensors) -> list[torch.Tensor]:
    """``decay * old + new`` for every pair; in place on ``old`` when donating."""
    if not old:
        return []
    new = _match_dtypes(new, old)
    out = _maybe_inplace(torch._foreach_mul, old, scalar_operand(decay, old))
    return foreach_op_("add", out, new)


_MASKED = object()   # stands for a MaskedNode position while labels are resolved


def leaf_labels(labels: PyTree | Callable[[PyTree], PyTree], tree: PyTree,
                what: str = "labels", is_leaf: Callable[[Any], bool] | None = None
                ) -> list[Any]:
    """Resolve per-leaf values given as a tree like ``tree`` (or a prefix of it, or a function
    of ``tree`` returning one) to one value per leaf of ``tree``; ``is_leaf`` marks values
    that are containers in pytree terms (a tuple of axes) as single values."""
    is_masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731
    if callable(labels):
        labels = labels(tree)
    # labels made from a tree with masked positions (by a function of it, as any tree_map
    # keeps them; by `partition` for its groups) hold MaskedNode there: no value
    labels = _pytree.tree_map(lambda x: _MASKED if is_masked(x) else x, labels,
                              is_leaf=is_masked)
    # a masked-out position (MaskedNode) still has its value in ``labels``: resolve the values
    # for every position, then drop those of the masked ones
    positions = _pytree.tree_map(lambda x: _MASKED if is_masked(x) else x, tree,
                                 is_leaf=is_masked)
    spec = tree_structure(positions)
    try:
        flat = _pytree._broadcast_to_and_flatten(labels, spec, is_leaf=is_leaf)
    except Exception:
        flat = None
    if flat is None:
        where = _first_difference(labels, tree) or "the structures differ"
        raise ValueError(f"The {what} do not match the parameter tree: {where}. Give one "
                         f"value per parameter leaf, in a tree of the same structure.")
    return [v for v, x in zip(flat, tree_leaves(positions)) if x is not _MASKED]


def mask_leaves(mask: PyTree | Callable[[PyTree], PyTree], params: PyTree) -> list[bool]:
    """Resolve a mask (a tree of Python booleans like ``params``, a prefix of it, or a function
    of ``params`` returning one) to one boolean per leaf of ``params``.

    Masks are static: they decide which leaves a transform touches, so they must be Python
    booleans (from names and shapes), never tensors.
    """
    flat = leaf_labels(mask, params, "mask values")
    for path, value in zip(tree_paths(params), flat):
        if not isinstance(value, bool):
            raise TypeError(f"mask{path} is {type(value).__name__}; masks hold Python booleans "
                            "(decided from names and shapes), not tensors.")
    return flat
