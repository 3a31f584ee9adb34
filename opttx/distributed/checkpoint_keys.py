"""Checkpoint keys of opttx states: every state tensor named by parameter path and field path.

The layout-independent naming used by `opttx.Optimizer.state_dict` and
`opttx.distributed.state_dict` (see `opttx.distributed.checkpoint` for the design).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from ..base import (OPTIONAL_MARK, EmptyState, Role, fields_with_role, optional_fields,
                    state_roles)
from ..tree import (MaskedNode, PyTree, is_pytree_leaf, tree_flatten, tree_flatten_with_path,
                    tree_structure)

__all__ = ["dtensor_placement", "keyed_state", "local_entries_as_dtensors", "param_paths"]


# ---------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------


def _entry(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _join(entries: Iterable[Any]) -> str:
    return ".".join(_entry(k) for k in entries)


def param_paths(params: PyTree) -> list[str]:
    """The checkpoint name of every leaf of ``params``: dict keys, list indices and attribute
    names joined by dots (``{"layers": [{"w": ...}]}`` -> ``"layers.0.w"``), as
    ``nn.Module.named_parameters`` names them; a bare tensor is ``"param"``.

    Raises:
      ValueError: two leaves get the same name (a dict key containing a dot that clashes with
        a nested path).
    """
    paths = [_join(path) or "param" for path, _ in tree_flatten_with_path(params)[0]]
    if len(set(paths)) != len(paths):
        seen, twice = set(), None
        for p in paths:
            if p in seen:
                twice = p
                break
            seen.add(p)
        raise ValueError(f"Two parameter leaves are both named {twice!r} in a checkpoint; "
                         "rename the dict keys so that no key with a dot equals a nested path.")
    return paths


# ---------------------------------------------------------------------------------------------
# the walk: which tensor belongs to which parameter
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _View:
    """The parameter tree a part of the state was built over: its structure, the param path
    of each of its leaves and whether the leaf was present (not masked) there."""
    spec: Any
    paths: tuple[str, ...]
    present: tuple[bool, ...]


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """(key, child) of a pytree container, or None for a leaf: one level of
    ``tree_flatten_with_path``, with every node below ``node`` taken as a leaf."""
    if is_pytree_leaf(node):             # (not tree_structure: it flattens the whole subtree)
        return None
    entries, _ = tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(path[0], child) for path, child in entries]


def _tensors(tree: Any) -> list[tuple[str, torch.Tensor]]:
    return [(_join(p), x) for p, x in tree_flatten_with_path(tree)[0] if _is_tensor(x)]


def _field(node_path: str, inner: str) -> str:
    return ".".join(s for s in (node_path, inner) if s) or "state"


def _walk(node: Any, path: tuple, view: _View, out_state: dict, out_shared: dict,
          owner: tuple[Any, str] | None = None, layouts: dict | None = None) -> None:
    """Sort the tensors of ``node`` (at ``path`` in the state) into per-parameter entries
    (``out_state[param path][field path]``) and shared ones (``out_shared[field path]``).
    ``owner``: the state NamedTuple and the field ``node`` is (its declared layout of the
    field's tensors goes into ``layouts[param path][field path]``, see `_declared_dims`)."""
    from ..transforms.quantized import QuantizedState
    if isinstance(node, (MaskedNode, EmptyState)):
        return
    if isinstance(node, QuantizedState):
        _walk_quantized(node, path, view, out_state, out_shared)
        return
    if not view.spec.is_leaf():
        try:
            subs = view.spec.flatten_up_to(node)
        except (ValueError, TypeError, RuntimeError):
            subs = None
        if subs is not None:
            where = _join(path)
            k = 0                        # the leaves present in the state, in order
            for i, sub in enumerate(subs):
                if isinstance(sub, MaskedNode):
                    continue
                for inner, x in _tensors(sub):
                    _put(out_state.setdefault(view.paths[i], {}), _field(where, inner), x)
                    if layouts is not None and isinstance(sub, torch.Tensor):
                        dims = _declared_dims(owner, k)
                        if dims is not None:
                            layouts.setdefault(view.paths[i], {})[_field(where, inner)] = dims
                k += 1
            return
    else:
        # the state of one bare leaf: everything below belongs to it
        where = _join(path)
        for inner, x in _tensors(node):
            _put(out_state.setdefault(view.paths[0], {}), _field(where, inner), x)
        return
    children = _children(node)
    if children is None:
        if _is_tensor(node):
            _put(out_shared, _join(path) or "state", node)
        return
    named = isinstance(node, tuple) and hasattr(node, "_fields")
    roles = state_roles(node) if named else {}
    optional = optional_fields(node) if named else frozenset()
    for key, child in children:
        name = _entry(key)
        if roles.get(name) is Role.SAME_STATE:      # keyed as the wrapped transform's own
            below = path
        elif name in optional:                      # a loader may skip it (declare_optional)
            below = path + (OPTIONAL_MARK + name,)
        else:
            below = path + (key,)
        _walk(child, below, view, out_state, out_shared, (node, name) if named else None,
              layouts)


def _declared_dims(owner: tuple[Any, str] | None, k: int) -> tuple[int, ...] | None:
    """How the ``k``-th present leaf's tensor of a field relates to its parameter, as the
    state declares it: the dims of the parameter it is reduced over (``()``: shaped like the
    parameter); None when nothing is declared. Read from the state's ``reduced_dims(field,
    k)`` when it has one (factored statistics), else from the field's role (a moment or a
    parameter copy is shaped like the parameter)."""
    if owner is None:
        return None
    state, field = owner
    method = getattr(state, "reduced_dims", None)
    if callable(method):
        return method(field, k)
    role = state_roles(state).get(field)
    return () if role is not None and role.like_updates else None


def _put(table: dict, key: str, x: torch.Tensor) -> None:
    if key in table and table[key] is not x:
        raise ValueError(f"Two tensors of the state map to the checkpoint key {key!r}; the "
                         "state's structure is ambiguous for checkpoints (a parameter tree "
                         "whose root container looks like a state node?).")
    table[key] = x


# The tensors that `keyed_state` found in `quantize_state`'s per-leaf states: statistics of
# the whole leaf by its declared plan (computed on whole leaves), which
# `local_entries_as_dtensors` keeps whole (written by the leaf's owner) instead of telling them
# from local-shard statistics by their shapes (packed codes, block scales and row statistics
# have neither the shard's nor the leaf's shape). By id, weakly: a mark lives as long as its
# buffer (a WeakSet would compare tensors with ==).
_WHOLE_LEAF: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _walk_quantized(node: Any, path: tuple, view: _View, out_state: dict,
                    out_shared: dict) -> None:
    """A `QuantizedState`: its declared plan (`leaf_slots`) says where each parameter's state
    is: entry ``i`` of its `Role.QUANTIZED` field (the state of that leaf alone) or entry ``i``
    of the lists of ``dense`` (one inner state over the list of the small leaves); key both by
    the param paths of those leaves."""
    from ..transforms.quantized import leaf_slots
    try:
        slots = leaf_slots(node, view.spec)
    except ValueError as err:
        raise ValueError(f"state{_join(path)}: {err}") from None
    (field,) = fields_with_role(node, Role.QUANTIZED)
    per_leaf = getattr(node, field)
    large = {s.index: i for i, s in enumerate(slots) if s is not None and s.quantized}
    small = [i for _, i in sorted((s.index, i) for i, s in enumerate(slots)
                                  if s is not None and not s.quantized)]
    where = _join(path + (field,))
    for j, leaf_state in enumerate(per_leaf):
        for inner, x in _tensors(leaf_state):
            _put(out_state.setdefault(view.paths[large[j]], {}), _field(where, inner), x)
            _WHOLE_LEAF[id(x)] = x
    if small:
        small_view = _View(tree_structure([0] * len(small)),
                           tuple(view.paths[i] for i in small), (True,) * len(small))
        dense: dict = {}
        _walk(node.dense, path + ("dense",), small_view, dense, out_shared)
        for param, fields in dense.items():
            for key, x in fields.items():
                _put(out_state.setdefault(param, {}), key, x)
                _WHOLE_LEAF[id(x)] = x
    for name in node._fields:
        if name not in (field, "dense"):
            for inner, x in _tensors(getattr(node, name)):
                _put(out_shared, _field(_join(path + (name,)), inner), x)


def _present_from_state(state: Any, spec: Any) -> list[bool] | None:
    """Which parameter leaves a state built over a masked tree (zero, on_owners) covers: the
    positions not masked in some node of the state shaped like the parameter tree (a link
    under `opttx.masked` covers fewer, hence the union)."""
    from ..transforms.quantized import QuantizedState, leaf_slots
    found: list[list[bool]] = []

    def visit(node: Any) -> None:
        if isinstance(node, QuantizedState):     # its plan declares the leaves it covers
            try:
                found.append([s is not None for s in leaf_slots(node, spec)])
            except ValueError:
                pass
            return
        if isinstance(node, (MaskedNode, EmptyState)) or _is_tensor(node):
            return
        if not spec.is_leaf():
            try:
                subs = spec.flatten_up_to(node)
            except (ValueError, TypeError, RuntimeError):
                subs = None
            if subs is not None:
                found.append([not isinstance(s, MaskedNode) for s in subs])
                return
        for _, child in _children(node) or []:
            visit(child)

    visit(state)
    return [any(column) for column in zip(*found)] if found else None


def keyed_state(state: Any, params: PyTree, mask: Sequence[bool] | None = None,
                layouts: dict | None = None
                ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The tensors of ``state`` as ``({param path: {field path: tensor}}, {field path:
    tensor})``: per parameter, and shared (see `opttx.distributed.checkpoint`). ``mask``:
    which leaves of ``params`` the state covers (None: read from the state). ``layouts``, a
    dict, is filled with the declared layout of each per-parameter entry (``{param path:
    {field path: reduced dims}}``, `_declared_dims`)."""
    leaves, spec = tree_flatten(params)
    paths = tuple(param_paths(params))
    if mask is None:
        mask = _present_from_state(state, spec) or [True] * len(leaves)
    view = _View(spec, paths, tuple(mask))
    out_state: dict[str, dict[str, torch.Tensor]] = {}
    out_shared: dict[str, torch.Tensor] = {}
    _walk(state, (), view, out_state, out_shared, None, layouts)
    return {k: v for k, v in out_state.items() if v}, out_shared


# ---------------------------------------------------------------------------------------------
# local shards -> DTensors
# ---------------------------------------------------------------------------------------------


def dtensor_placement(param: Any) -> tuple[Any, tuple, tuple[int, ...]] | None:
    """``(mesh, placements, global shape)`` of a sharded DTensor parameter, else None."""
    placements = getattr(param, "placements", None)
    if placements is None or all(not p.is_shard() for p in placements):
        return None
    return param.device_mesh, tuple(placements), tuple(param.shape)


def _without(shape: Sequence[int], dims: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with the ``dims`` left out (a statistic reduced over them)."""
    n = len(shape)
    drop = {d % n for d in dims} if n else set()
    return tuple(s for i, s in enumerate(shape) if i not in drop)


def _kind(x: torch.Tensor, local_shape: tuple[int, ...], shape: tuple[int, ...],
          dims: tuple[int, ...] | None = None) -> str:
    """How a state tensor of a sharded parameter relates to it, seen from this rank: from the
    state's declared layout (``dims``: the parameter dims it is reduced over, ``()`` for one
    shaped like it) when there is one, else from its shape (an undeclared state)."""
    if hasattr(x, "to_local"):
        return "dtensor"
    if x.dim() == 0:
        return "scalar"
    if dims is not None:
        if tuple(x.shape) == _without(local_shape, dims):
            return f"reduced{tuple(d % len(shape) for d in dims)}" if dims else "local"
        if tuple(x.shape) == _without(shape, dims):
            return "whole"
        return "other"
    if x.numel() == 0:
        return f"empty{tuple(x.shape)}"       # a placeholder, or the piece of an empty shard
    if tuple(x.shape) == local_shape:
        return "local"
    if tuple(x.shape) == shape:
        return "whole"
    return "other"


def _agree(kinds: list[str]) -> str:
    """One kind from every rank's (for the ranks holding the entry)."""
    if len(set(kinds)) == 1:
        return kinds[0]
    if "local" in kinds and all(k == "local" or k.startswith("empty") for k in kinds):
        return "local"                        # element-wise, empty where the shard is empty
    return "other"


def _reduced_placements(placements: tuple, dims: tuple[int, ...], ndim: int) -> tuple:
    """The placements of a statistic reduced over ``dims`` of a parameter placed so: a shard
    of a kept dim is a shard of that dim of the statistic (renumbered); a shard of a reduced
    dim is replicated (the reduction hook made the statistic whole on every rank)."""
    from torch.distributed.tensor import Replicate, Shard
    out = []
    for p in placements:
        if p.is_shard():
            d = p.dim % ndim
            out.append(Replicate() if d in dims else Shard(d - sum(1 for r in dims if r < d)))
        else:
            out.append(p)
    return tuple(out)


def local_entries_as_dtensors(table: dict[str, dict[str, torch.Tensor]], paths: Sequence[str],
                              leaves: Sequence[Any], placed: Sequence[Any],
                              strict: bool = True, rank: int | None = None,
                              layouts: dict | None = None) -> dict:
    """Entries of sharded parameters shaped like the local shard (element-wise statistics of
    a transform run on local shards) as DTensors with the parameter's placements, so a
    checkpoint holds the whole tensor once and reshards. Entries of the whole leaf's shape
    (a whole-leaf layout: `on_owners`), scalars and placeholders empty on every rank stay
    plain tensors. The decision is agreed over all ranks (one ``all_gather_object`` when a
    process group is initialized), so every rank lays out an entry alike. Any other entry is
    a statistic of the local shard that cannot be resharded: with ``rank`` given it is kept
    under ``field + "@rank<rank>"`` (a per-rank entry), else it raises when ``strict`` and
    stays a plain tensor otherwise."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    mine: dict[tuple[str, str], str] = {}
    for path, leaf, where in zip(paths, leaves, placed):
        if where is None:
            continue
        local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
        for field, x in table.get(path, {}).items():
            dims = (layouts or {}).get(path, {}).get(field)
            mine[(path, field)] = ("whole" if _WHOLE_LEAF.get(id(x)) is x   # quantize_state's
                                   else _kind(x, tuple(local.shape), tuple(where[2]), dims))
    everyone = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    agreed = {key: _agree([r[key] for r in everyone if key in r]) for key in mine}
    out = dict(table)
    for path, leaf, where in zip(paths, leaves, placed):
        entries = table.get(path)
        if not entries or where is None:
            continue
        mesh, placements, shape = where
        local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
        converted = {}
        for field, x in entries.items():
            kind = agreed[(path, field)]
            if kind == "local":
                stride = torch.empty(shape, device="meta").stride()
                converted[field] = DTensor.from_local(x, mesh, placements, run_check=False,
                                                      shape=torch.Size(shape), stride=stride)
            elif kind.startswith("reduced"):    # a row or column statistic (declared)
                dims = tuple(int(d) for d in kind[len("reduced("):-1].split(",") if d.strip())
                whole = _without(shape, dims)
                stride = torch.empty(whole, device="meta").stride()
                converted[field] = DTensor.from_local(
                    x, mesh, _reduced_placements(placements, dims, len(shape)),
                    run_check=False, shape=torch.Size(whole), stride=stride)
            elif kind != "other":
                converted[field] = x
            elif rank is not None:
                converted[f"{field}@rank{rank}"] = x
            elif not strict:
                converted[field] = x
            else:
                raise NotImplementedError(
                    f"state {path} {field} has shape {tuple(x.shape)}: a statistic of the "
                    f"local shard {tuple(local.shape)} whose state declares no layout (not a "
                    "moment shaped like the parameter, nor a row or column statistic with "
                    "reduced_dims) cannot be resharded; declare it, run this transform under "
                    "on_owners (whole leaves), or save it per rank (per_rank=True: reloads "
                    "at the same world size and sharding only).")
        out[path] = converted
    return out
