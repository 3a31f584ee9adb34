r"""Stacked layout: same-shaped parameters kept in one ``(L, *shape)`` buffer, and any per-leaf
transform run on every slice of it in one batched pass.

The layers of a transformer share their shapes: a 32-layer model has 32 query matrices of the
same shape, 32 of each MLP matrix, and so on. Per leaf, a compiled optimizer step lowers the
chain once per tensor, so its graph, its compile time and its kernel count grow with the
number of layers. `flatten` / `FlatParams` remove that growth for *element-wise* chains only:
a flat vector has no rows, no columns and no per-leaf norm. The stacked layout keeps the
structure:

* `StackedParams` stores the leaves that share (shape, dtype, device) in one buffer of shape
  ``(L, *shape)``; each parameter is the view ``buffer[i]``. A step differentiates with respect
  to the buffers, so the gradients arrive stacked too, with nothing to pack.
* `stacked(tx)` applies ``tx`` to each slice ``buffer[i]`` as if it were its own leaf, with
  ``torch.func.vmap`` over dim 0 of every leaf: Adafactor factors each ``(m, n)`` slice over its
  own rows and columns, LAMB takes one trust ratio per slice, block-RMS clipping clips per
  slice. The graph holds one copy of the chain per distinct stack length ``L`` (leaves of
  other lengths masked), whatever the number of parameters.

Same numbers: ``stacked(tx)`` on the stacked buffers equals ``tx`` on the separate leaves for
every per-leaf transform (checked for every alias that is per-leaf in
``tests/test_stacked.py``). What vmap cannot take is refused, not approximated:

* statistics across leaves (`clip_by_global_norm`, `apply_if_finite`) would be taken per
  slice: they raise inside `stacked`; put them outside, where the stacked buffers hold exactly
  the elements of the leaves (``chain(clip_by_global_norm(1.0), stacked(adamw(1e-3)))``);
* data-dependent control flow on per-slice values (Shampoo's root bookkeeping) raises
  vmap's own error; a branch on the shared step count (GaLore's projector refresh) works;
* distributed wrappers (`opttx.distributed`) around or inside `stacked` raise.

Step counts and injected hyperparameters (0-dim state that does not depend on the slice) stay
one shared tensor, not a stack: coefficients made from them are then plain 0-dim tensors.

Random numbers (stochastic rounding) are drawn independently per slice
(``randomness="different"``).

torch has no vmap rule for its grouped ``_foreach_*`` kernels, which opttx's transforms use;
importing this module registers one for each that lacks it (once, never during ``init`` or
``update``), which runs the per-tensor op on each tensor of the group (inside `stacked` a
group holds one tensor per shape group, so this costs nothing measurable). The registration only adds rules where torch raises "Batching rule
not implemented"; it changes no existing behaviour.

References:
  The layer-stacking ("scan over layers") layout of JAX/Flax and Praxis models; optax's
  transforms are vmapped over such stacks the same way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.func import vmap

from .base import (GradientTransformation, REDUCER_KEY, Role, TOTALS_KEY, Traits,
                   check_init_params, current_reducer, declare, declare_roles, leaf_roles,
                   traits_of)
from .tree import (MaskedNode, PyTree, Static, keystr, tree_flatten, tree_flatten_with_path,
                   tree_map, tree_unflatten)

__all__ = ["StackedParams", "StackedState", "stacked"]


# ---------------------------------------------------------------------------------------------
# vmap rules for torch's grouped kernels
# ---------------------------------------------------------------------------------------------

# foreach op -> the per-tensor aten op it groups (None: same name)
_PER_TENSOR = {
    "add": None, "sub": None, "mul": None, "div": None, "lerp": None, "addcmul": None,
    "addcdiv": None, "clamp_min": None, "clamp_max": None, "maximum": None, "minimum": None,
    "pow": None, "sqrt": None, "rsqrt": None, "reciprocal": None, "sign": None, "neg": None,
    "abs": None, "exp": None, "log": None, "sigmoid": None, "tanh": None, "copy": None,
    "zero": None, "norm": "linalg_vector_norm",
}
_LIBRARY: list[Any] = []      # the torch.library.Library holding the rules, once registered


def _per_tensor_kernel(name: str, inplace: bool, scalar_other: bool):
    """A FuncTorchBatched kernel for ``_foreach_<name>[_]``: the aten op on each tensor."""
    base = _PER_TENSOR[name] or name
    if name in ("maximum", "minimum") and scalar_other:
        base = "clamp_min" if name == "maximum" else "clamp_max"
    # in place: the functional op, then copy_ (vmap has no rule for several in-place ops, such
    # as addcmul_, and would loop over the slices)
    own_inplace = inplace and name in ("copy", "zero")
    op = getattr(torch.ops.aten, base + ("_" if own_inplace else ""), None)
    if op is None:
        return None
    write = inplace and not own_inplace

    # the foreach schemas pass these positionally where the per-tensor op takes a keyword
    keyword = {"addcmul": "value", "addcdiv": "value", "norm": None}.get(name, "")
    positional = 3 if name in ("addcmul", "addcdiv") else 1 if name == "norm" else None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        out = []
        for i in range(n):
            each = [a[i] if isinstance(a, (list, tuple)) else a for a in args]
            kw = dict(kwargs)
            if positional is not None and len(each) > positional:
                rest = each[positional:]
                each = each[:positional]
                if keyword:                       # addcmul(self, t1, t2, value)
                    kw[keyword] = rest[0]
                else:                             # norm(self, ord, dtype)
                    kw["ord"] = rest[0]
                    if len(rest) > 1:
                        kw["dtype"] = rest[1]
            if name == "lerp" and not isinstance(each[2], torch.Tensor):
                # a traced weight is a symbolic float, on which lerp's decomposition would
                # guard (weight < 0.5); as a 0-dim tensor it is the same formula, unguarded
                each[2] = torch.full((), each[2], dtype=each[0].dtype, device=each[0].device)
            result = op(*each, **kw)
            if write:
                each[0].copy_(result)
            out.append(result)
        return None if inplace else out

    return kernel


def install_foreach_vmap_rules() -> None:
    """Give every ``torch._foreach_<op>`` in ``_PER_TENSOR`` that has no vmap rule one that runs
    the per-tensor op on each tensor. Idempotent; run once when this module is imported."""
    if _LIBRARY:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name in _PER_TENSOR:
        for inplace in (False, True):
            packet = getattr(torch.ops.aten, f"_foreach_{name}" + ("_" if inplace else ""), None)
            if packet is None:
                continue
            for overload in packet.overloads():
                qualname = f"aten::{packet._qualified_op_name.split('::')[1]}" + (
                    f".{overload}" if overload != "default" else "")
                if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "FuncTorchBatched"):
                    continue
                if overload.endswith("_out") or (overload == "Tensor" and
                                                 name in ("addcmul", "addcdiv")):
                    continue     # out= variants, and scalars packed in one CPU tensor: unruled
                kernel = _per_tensor_kernel(name, inplace, overload in ("Scalar", "ScalarList"))
                if kernel is not None:
                    lib.impl(qualname.split("::")[1], kernel, "FuncTorchBatched")
    _LIBRARY.append(lib)


# Registered once, here, rather than inside `stacked`'s init/update: dispatcher registration is
# global state and must not happen while a step is traced or while another thread dispatches.
# It only fills rules torch lacks (the per-tensor fallback above), so importing opttx changes
# nothing for code that never vmaps a grouped kernel.
install_foreach_vmap_rules()


# ---------------------------------------------------------------------------------------------
# StackedParams
# ---------------------------------------------------------------------------------------------


def _group_name(x: torch.Tensor, taken: set[str]) -> str:
    name = ("x".join(map(str, x.shape)) or "scalar") + "_" + str(x.dtype).removeprefix("torch.")
    if x.device.type != "cpu":
        name += f"_{x.device.type}{x.device.index if x.device.index is not None else ''}"
    out, k = name, 1
    while out in taken:
        out, k = f"{name}_{k}", k + 1
    return out


class StackedParams:
    r"""Parameters stored stacked: the leaves sharing (shape, dtype, device) live in one buffer
    of shape ``(L, *shape)``, each leaf the view ``buffer[i]``.

    ``buffers`` is a dict from a group name (``"768x3072_float32"``) to its buffer, in order of
    first appearance; it is the tree a step differentiates with respect to and hands to
    `stacked` transforms. ``unstack(buffers)`` gives the parameter tree back as views.

    Example (the compiled step is that of `opttx.FlatParams`, with ``stack.unstack`` in
    place of ``flat.unflatten``):
      >>> stack = opttx.StackedParams.of_module(model)   # parameters now view the buffers
      >>> tx = opttx.chain(opttx.clip_by_global_norm(1.0), opttx.stacked(opttx.adafactor(1e-2)))
      >>> state = tx.init(stack.buffers)
      >>> params = stack.unstack(stack.buffers)          # the parameter tree, as views
    """

    def __init__(self, params: PyTree) -> None:
        leaves, self.spec = tree_flatten(params)
        if not leaves:
            raise ValueError("StackedParams needs at least one parameter tensor.")
        check_init_params(params)
        keys: dict[tuple, list[int]] = {}
        for i, x in enumerate(leaves):
            keys.setdefault((tuple(x.shape), x.dtype, x.device), []).append(i)
        self.groups: list[list[int]] = list(keys.values())
        self.names: list[str] = []
        for g in self.groups:
            self.names.append(_group_name(leaves[g[0]], set(self.names)))
        self.slot: list[tuple[int, int]] = [(0, 0)] * len(leaves)   # leaf -> (group, index)
        for gi, g in enumerate(self.groups):
            for k, i in enumerate(g):
                self.slot[i] = (gi, k)
        with torch.no_grad():
            self.buffers: dict[str, torch.Tensor] = {
                name: torch.stack([leaves[i].detach() for i in g])
                for name, g in zip(self.names, self.groups)}

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> StackedParams:
        """Move ``module``'s parameters into stacked buffers: every ``nn.Parameter`` keeps its
        identity and now views its slice, so eager training, ``state_dict`` and the compiled
        functional step all see the same storage."""
        named = dict(module.named_parameters())
        stack = cls(named)
        with torch.no_grad():
            for p, view in zip(named.values(), tree_flatten(stack.unstack())[0]):
                p.data = view
        return stack

    def unstack(self, buffers: dict[str, torch.Tensor] | None = None) -> PyTree:
        """The parameter tree as views of ``buffers`` (default: the stored buffers); one
        ``unbind`` per group, so a traced step holds one op per group, not one per leaf."""
        buffers = self.buffers if buffers is None else buffers
        slices = [buffers[name].unbind(0) for name in self.names]
        return tree_unflatten([slices[g][k] for g, k in self.slot], self.spec)

    def stack(self, tree: PyTree) -> dict[str, torch.Tensor]:
        """Stack a tree shaped like the parameters (gradients, say) into new buffers."""
        leaves, spec = tree_flatten(tree)
        if spec != self.spec:
            from .tree import assert_same_structure
            assert_same_structure(self.unstack(), tree, "parameters and tree")
        return {name: torch.stack([leaves[i] for i in g])
                for name, g in zip(self.names, self.groups)}

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}: {len(g)}" for n, g in zip(self.names, self.groups))
        return f"StackedParams({sum(map(len, self.groups))} leaves in {len(self.groups)} " \
               f"stacks: {sizes})"


# ---------------------------------------------------------------------------------------------
# stacked(tx)
# ---------------------------------------------------------------------------------------------


class StackedState(NamedTuple):
    """State of `stacked`."""
    inner_states: tuple   # per stack length L (in order of first appearance): the inner state
                          # over the leaves of that length (the others `MaskedNode`), every
                          # leaf of it stacked along dim 0
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles()


_NOT_DISTRIBUTED = ("opttx.stacked does not run under opttx.distributed wrappers: shard or "
                    "own the unstacked parameters instead.")


def _across_slices(total: torch.Tensor, op: str = "sum") -> torch.Tensor:
    raise NotImplementedError(
        "a statistic across leaves (clip_by_global_norm, apply_if_finite, ...) cannot run "
        "inside opttx.stacked: it would be taken per slice. Put it outside, on the stacked "
        "buffers (chain(clip_by_global_norm(...), stacked(...))), where it sees every element.")


_SHARED = (Role.COUNT, Role.SCALAR)


def _per_slice(state: PyTree) -> PyTree:
    """For every tensor of ``state``: whether it holds one value per slice (stacked) or one
    shared by all slices, read from the declared roles (`opttx.base.leaf_roles`): counters and
    shared scalars are shared, a per-leaf scalar and every tensor of a dim or more are per
    slice. A 0-dim tensor in a field that declares no role is refused: shared or per slice
    would be a guess."""
    def decide(x: Any, role: Any, path: Any) -> bool:
        if role in _SHARED:
            return False
        if role is Role.PER_LEAF_SCALAR or x.dim() > 0:
            return True
        raise ValueError(
            f"opttx.stacked: state{keystr(path)} is a 0-dim tensor in a field that declares no "
            "role, so it cannot tell whether it is shared by all slices (Role.COUNT, "
            "Role.SCALAR) or one per slice (Role.PER_LEAF_SCALAR); declare it in the state's "
            "__roles__.")
    roles = leaf_roles(state)
    flat, spec = tree_flatten_with_path(state)
    role_leaves = tree_flatten(roles, is_leaf=lambda r: r is None or isinstance(r, Role))[0]
    return tree_unflatten([decide(x, r, path) if isinstance(x, torch.Tensor) else False
                           for (path, x), r in zip(flat, role_leaves)], spec)


def _unbatch_shared(tree: PyTree) -> PyTree:
    """vmap expands an output that does not depend on the slice to the stack length with
    stride 0. A shared one (a step count, an injected hyperparameter: `_per_slice`) is one
    0-dim tensor again: coefficients made from it (bias corrections) are then plain 0-dim
    tensors, which torch's grouped kernels take as scalars. A per-slice one (zeros made from
    a shape, per-leaf flags) gets its own memory, since state is written in place."""
    def one(x: Any, per_slice: bool) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.stride(0) != 0:
            return x
        if not per_slice:
            return x[0].clone()
        return x.contiguous()
    return tree_map(one, tree, _per_slice_after_init(tree))


def _per_slice_after_init(tree: PyTree) -> PyTree:
    """`_per_slice` of a state vmap returned from ``init`` (every leaf has the stack dim):
    by role, a leaf of a declared shared field is shared; the rest per slice."""
    roles = leaf_roles(tree)
    flat, spec = tree_flatten(tree)
    role_leaves = tree_flatten(roles, is_leaf=lambda r: r is None or isinstance(r, Role))[0]
    assert len(role_leaves) == len(flat)
    return tree_unflatten([r not in _SHARED for r in role_leaves], spec)


def _state_dims(state: PyTree) -> PyTree:
    """vmap's in/out dims for a state: shared leaves None, the others stacked (dim 0)."""
    return tree_map(lambda x, per_slice: 0 if per_slice else None, state, _per_slice(state))


def _lengths(tree: PyTree) -> list[list[int]]:
    """Leaf indices per stack length (dim 0), in order of first appearance: vmap maps one
    length at a time."""
    lengths: dict[int, list[int]] = {}
    for i, x in enumerate(tree_flatten(tree)[0]):
        if x.dim() == 0:
            raise ValueError("opttx.stacked needs a leading stack dim on every leaf; a 0-dim "
                             "leaf has none (StackedParams stacks scalars into shape (L,)).")
        lengths.setdefault(x.shape[0], []).append(i)
    return list(lengths.values())


def _part(tree: PyTree | None, idx: list[int]) -> PyTree | None:
    """``tree`` with only the leaves ``idx`` (the others `MaskedNode`), each slice at least
    1-dim: a stack of scalars ``(L,)`` is mapped as ``(L, 1)``, so that the only 0-dim state a
    slice can have is state shared by all slices (see `_unbatch_shared`)."""
    if tree is None:
        return None
    leaves, spec = tree_flatten(tree)
    keep = set(idx)
    return tree_unflatten([(x.unsqueeze(-1) if x.dim() == 1 else x) if i in keep
                           else MaskedNode() for i, x in enumerate(leaves)], spec)


@declare()
def stacked(inner: GradientTransformation) -> GradientTransformation:
    r"""Apply the per-leaf transform ``inner`` to every slice along dim 0 of every leaf.

    .. math::
        u[i] = \mathrm{inner}(g[i], s[i], x[i]) \quad \text{for each } i,
        \qquad s = (s[0], \dots, s[L-1]) \text{ stacked}

    in one batched pass (``torch.func.vmap`` over dim 0 of the updates, the state and the
    parameters; one pass per distinct stack length ``L``, the other leaves masked). Use it on
    the buffers of `StackedParams`, where each slice is one parameter: the numbers are those
    of ``inner`` on the separate parameters, and a compiled step holds one copy of ``inner``'s
    graph per stack length instead of one per parameter.

    Args:
      inner: a transform or chain whose leaves are independent (every alias but the ones with
        a statistic across leaves, data-dependent control flow or a distributed wrapper: see
        the module docstring, which says what is refused and why).

    Returns:
      A `GradientTransformation` over trees whose leaves have a leading stack dim.

    Example:
      >>> stack = opttx.StackedParams({f"layer{i}": torch.randn(64, 32) for i in range(12)})
      >>> tx = opttx.stacked(opttx.adafactor(1e-2))        # factored per (64, 32) slice
      >>> state = tx.init(stack.buffers)                   # row stats (12, 64), col (12, 32)

    References:
      ``jax.vmap`` over stacked layer parameters, as optax transforms are used on scanned
      models.
    """

    if traits_of(inner).across_leaves:
        _across_slices(torch.zeros(()))        # refused when built: see _across_slices
    if not traits_of(inner).per_leaf:
        raise NotImplementedError(
            "opttx.stacked runs its inner transform on each slice, so the transform must "
            "declare Traits(per_leaf=True): each leaf's update depends on that leaf only (no "
            "statistic across leaves). This one declares no such trait; declare it on a "
            "transform of your own that is per-leaf, or run it on the separate leaves.")

    def init(params: PyTree) -> StackedState:
        check_init_params(params)
        if current_reducer() is not None:
            raise NotImplementedError(_NOT_DISTRIBUTED)
        init_one = vmap(inner.init, randomness="different")
        return StackedState(tuple(_unbatch_shared(init_one(_part(params, idx)))
                                  for idx in _lengths(params)))

    def update(updates: PyTree, state: StackedState, params: PyTree | None = None,
               **extra_args: Any) -> tuple[PyTree, StackedState]:
        if extra_args.get(REDUCER_KEY) is not None or extra_args.get(TOTALS_KEY) is not None:
            raise NotImplementedError(_NOT_DISTRIBUTED)
        inner_args = {**extra_args, TOTALS_KEY: _across_slices}
        leaves, spec = tree_flatten(updates)
        parts = _lengths(updates)
        if len(parts) != len(state.inner_states):
            raise ValueError(f"opttx.stacked: the updates have {len(parts)} stack lengths, the "
                             f"state was made for {len(state.inner_states)}.")
        out: list[Any] = [None] * len(leaves)
        new_states = []
        for idx, inner_state in zip(parts, state.inner_states):
            sub = _part(updates, idx)
            dims = _state_dims(inner_state)
            if params is None:
                def one(u: PyTree, s: Any) -> tuple[PyTree, Any]:
                    return inner.update(u, s, None, **inner_args)
                u, s = vmap(one, in_dims=(0, dims), out_dims=(0, dims),
                            randomness="different")(sub, inner_state)
            else:
                def one(u: PyTree, s: Any, p: PyTree) -> tuple[PyTree, Any]:
                    return inner.update(u, s, p, **inner_args)
                u, s = vmap(one, in_dims=(0, dims, 0), out_dims=(0, dims),
                            randomness="different")(
                    sub, inner_state, _part(params, idx))
            for i, x in zip(idx, tree_flatten(u)[0]):
                out[i] = x.view(leaves[i].shape)
            new_states.append(s)
        return tree_unflatten(out, spec), StackedState(tuple(new_states), made_by=state.made_by)

    inner_traits = traits_of(inner)
    return GradientTransformation(init, update, Traits(
        elementwise=inner_traits.elementwise, per_leaf=True,
        batched_across_leaves=inner_traits.batched_across_leaves))


