"""The optimizer state of `opttx.distributed.offload` chunk by chunk: the transform's own
state over the whole parameter tree (laid out as without offload, so checkpoints do not
change), and each chunk's state gathered from it and written back, matched by the keys
checkpoints give every tensor (`ChunkStates`). With ``layout="flat"`` a chunk's state is one
flat vector per field, and the whole state's tensors are views of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..base import GradientTransformation, Role, fields_with_role
from ..tree import MaskedNode, PyTree, tree_flatten, tree_map, tree_unflatten
from .checkpoint_keys import keyed_state, param_paths
from .placement import OffloadPlan

__all__ = ["ChunkMap", "ChunkStates", "HOST", "count_positions", "flat_view", "init_on_meta",
           "keyed_paths", "keyed_positions", "meta_like", "OnChunkStates"]

HOST = torch.device("cpu")


def keyed_paths(tree: PyTree) -> list[str]:
    """The checkpoint name of every leaf of ``tree`` (`opttx.distributed.param_paths`)."""
    return param_paths(tree)


def keyed_positions(state: Any, tree: PyTree, mask: Sequence[bool] | None
                    ) -> tuple[dict[tuple, list[int]], list[Any], Any]:
    """``{key: positions}`` of the tensors of ``state`` among its flattened leaves, keyed as
    checkpoints key them (``("param", param path, field path)`` or ``("shared", field
    path)``); also the leaves and the treespec. Every tensor must get a key."""
    leaves, spec = tree_flatten(state)
    where: dict[int, list[int]] = {}
    for j, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            where.setdefault(id(x), []).append(j)
    per_param, shared = keyed_state(state, tree, mask)
    out: dict[tuple, list[int]] = {}
    for path, fields in per_param.items():
        for f, x in fields.items():
            out[("param", path, f)] = where[id(x)]
    for f, x in shared.items():
        out[("shared", f)] = where[id(x)]
    named = {j for js in out.values() for j in js}
    unnamed = [j for js in where.values() for j in js if j not in named]
    if unnamed:
        raise ValueError("offload: the state holds tensors that the checkpoint keys do not "
                         "name; it cannot be split by parameter.")
    return out, leaves, spec


def count_positions(state: Any, leaves: list[Any]) -> set[int]:
    """The positions among ``leaves`` (the state's) of the step counters: fields declared
    `opttx.extend.Role.COUNT`."""
    where = {id(x): j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
    out: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            for name in fields_with_role(node, Role.COUNT):
                x = getattr(node, name)
                if isinstance(x, torch.Tensor) and id(x) in where:
                    out.add(where[id(x)])
            for x in node:
                walk(x)
        elif isinstance(node, (list, tuple)):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for x in node.values():
                walk(x)
    walk(state)
    return out


def meta_like(tree: PyTree) -> PyTree:
    """``tree`` with every tensor replaced by an empty meta tensor of its shape and dtype."""
    return tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                    if isinstance(x, torch.Tensor) else x, tree)


def init_on_meta(tx: GradientTransformation, tree: PyTree, fallback: Callable[[], PyTree]
                 ) -> Any:
    """``tx.init`` on meta tensors shaped like ``tree`` (nothing allocated); ``tx.init`` of
    ``fallback()`` when the transform cannot be initialised on meta tensors."""
    try:
        return tx.init(meta_like(tree))
    except Exception:  # noqa: BLE001 - a transform that needs real data at init
        return tx.init(fallback())


def flat_view(parts: list[torch.Tensor], numel: int,
              offsets: Sequence[int] | None = None) -> torch.Tensor:
    """One flat tensor of ``numel`` elements holding ``parts`` at ``offsets`` (default: back
    to back): a view of their storage when they already lie so there (the state of the flat
    layout, a master copy), else a new buffer (a concatenation, or zeros with the parts
    copied in where there are gaps)."""
    packed = list(itertools.accumulate([x.numel() for x in parts][:-1], initial=0))
    if offsets is None:
        offsets = packed
    nonempty = [(x, o) for x, o in zip(parts, offsets) if x.numel() > 0]
    if nonempty:
        first, first_offset = nonempty[0]
        esize, ok = first.element_size(), True
        base = first.data_ptr() - first_offset * esize
        for x, o in nonempty:
            if (not x.is_contiguous() or x.dtype != first.dtype or x.device != first.device
                    or x.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                    or x.data_ptr() != base + o * esize):
                ok = False
                break
        start = first.storage_offset() - first_offset
        if ok and start >= 0 and (start + numel) * esize <= first.untyped_storage().nbytes():
            return first.as_strided((numel,), (1,), start)
    if not parts:
        return torch.empty(0)
    if list(offsets) == packed and sum(x.numel() for x in parts) == numel:
        return torch.cat([x.reshape(-1) for x in parts])
    out = parts[0].new_zeros(numel)
    for x, o in zip(parts, offsets):
        out[o:o + x.numel()].copy_(x.reshape(-1))
    return out


@dataclass
class ChunkMap:
    """How one chunk's state is gathered from the whole state and written back."""
    template: list[Any]           # the chunk state's leaves (placeholders where tensors go)
    spec: Any                     # its treespec
    take: list[tuple[int, int]]   # (chunk position, whole-state position) of its own tensors
    flat: list[tuple[int, list[int]]]   # flat layout: (chunk position, member positions)
    shared: list[tuple[int, int]]       # (chunk position, whole-state position)


class ChunkStates:
    """The chunks' states of one offloaded transform: the plan's chunks (``plan``, with the
    tree's treespec, shapes and dtypes), the map between the whole state and each chunk's
    (``maps``, built from a state on meta tensors), and the gathering and writing back of a
    chunk's state and updates."""

    def __init__(self, tx: GradientTransformation, layout: str, where: str) -> None:
        self.tx = tx
        self.layout = layout
        self.where = where
        self.plan: OffloadPlan | None = None
        self.maps: list[ChunkMap] = []
        self.spec: Any = None                 # the treespec of the tree given to init
        self.state_spec: Any = None
        self.device = HOST                    # where the parameters and gradients live
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[torch.dtype] = []
        self.counts: set[int] = set()         # positions of the step counters in the state
        self.meta_tree: PyTree = None
        # flat layout: (chunk, state position) -> (its flat buffer, the whole state's views of
        # it, the buffer's address), as `scatter_flat` last made them
        self._views: dict[tuple[int, int], tuple[torch.Tensor, tuple, int]] = {}

    def resolve(self, tree: PyTree) -> None:
        """Read the tree's structure, shapes, dtypes and device (the plan is set apart)."""
        leaves, self.spec = tree_flatten(tree)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [x.dtype for x in leaves]
        self.device = leaves[0].device if leaves else HOST
        self.meta_tree = meta_like(tree)

    def host_memory(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in host memory: page-locked (pinned) when the parameters live on a CUDA
        device, so a host chunk's tensors can be copied to the device asynchronously (a
        chunk moved there by the "auto" warm-up, a master copy sent each step)."""
        x = x.to(HOST)
        if self.device.type == "cuda" and not x.is_pinned():
            x = x.pin_memory()
        return x

    def chunk_tree(self, k: int, leaves: list[Any]) -> PyTree:
        """The tree of chunk ``k``: its leaves as given (others masked), or one flat vector."""
        c = self.plan.chunks[k]
        if self.layout == "flat":
            return (leaves[0],) if len(leaves) == 1 and leaves[0].dim() == 1 \
                and leaves[0].numel() == c.numel else (flat_view(list(leaves), c.numel),)
        full: list[Any] = [MaskedNode()] * len(self.shapes)
        for i, x in zip(c.leaves, leaves):
            full[i] = x
        return self.spec.unflatten(full)

    def as_chunk(self, k: int, buf: torch.Tensor) -> PyTree:
        """A staging buffer of chunk ``k`` as the chunk's tree (views shaped like its leaves,
        or the flat vector)."""
        c = self.plan.chunks[k]
        if self.layout == "flat":
            return (buf,)
        return self.chunk_tree(k, [buf[o:o + n].view(self.shapes[i])
                                   for i, o, n in zip(c.leaves, c.offsets, c.sizes)])

    def build_maps(self, state: Any) -> None:
        """The position of every tensor of ``state`` by key, and each chunk's map."""
        n = len(self.shapes)
        keys, s_leaves, self.state_spec = keyed_positions(state, self.meta_tree, [True] * n)
        self.counts = count_positions(state, s_leaves)
        paths = keyed_paths(self.meta_tree)
        self.maps = []
        covered: set[tuple] = set()
        for k, c in enumerate(self.plan.chunks):
            mine = set(c.leaves)
            if self.layout == "flat":
                flat = torch.empty(c.numel, dtype=c.dtype, device="meta")
                try:
                    template = init_on_meta(self.tx, (flat,), lambda: (torch.empty(
                        c.numel, dtype=c.dtype),))
                except Exception as e:  # noqa: BLE001 - named in the refusal
                    raise self.mismatch(f"its init fails on one flat vector: "
                                        f"{type(e).__name__}: {e}") from e
                tkeys, tleaves, tspec = keyed_positions(template, (flat,), [True])
            else:
                chunk_tree = self.chunk_tree(k, [self.meta_leaf(i) for i in c.leaves])
                template = init_on_meta(self.tx, chunk_tree, lambda: self.chunk_tree(
                    k, [torch.empty(self.shapes[i], dtype=self.dtypes[i]) for i in c.leaves]))
                tkeys, tleaves, tspec = keyed_positions(template, self.meta_tree,
                                                        [i in mine for i in range(n)])
            take, flat_take, shared = [], [], []
            for key, (pos, *_) in tkeys.items():
                if key[0] == "shared":
                    if key not in keys:
                        raise self.mismatch(f"shared entry {key[1]!r} of a chunk's state")
                    if tuple(tleaves[pos].shape) != tuple(s_leaves[keys[key][0]].shape):
                        raise self.mismatch(
                            f"the entry {key[1]!r}, which belongs to no single parameter, has "
                            f"shape {tuple(tleaves[pos].shape)} over one chunk and "
                            f"{tuple(s_leaves[keys[key][0]].shape)} over all parameters "
                            "(a state packed across parameters, as opttx.flatten's)")
                    shared.append((pos, keys[key][0]))
                    covered.add(key)
                elif self.layout == "flat":
                    parts = []
                    for i in c.leaves:
                        whole = ("param", paths[i], key[2])
                        if whole not in keys:
                            raise self.mismatch(f"{paths[i]} has no {key[2]!r} entry")
                        j = keys[whole][0]
                        if tuple(s_leaves[j].shape) != self.shapes[i] \
                                or tuple(tleaves[pos].shape) != (c.numel,):
                            raise self.mismatch(f"{paths[i]}'s {key[2]!r} is not shaped like "
                                                "the parameter")
                        parts.append(j)
                        covered.add(whole)
                    flat_take.append((pos, parts))
                else:
                    if key not in keys:
                        raise self.mismatch(f"entry {key[2]!r} of {key[1]}")
                    take.append((pos, keys[key][0]))
                    covered.add(key)
            self.maps.append(ChunkMap(tleaves, tspec, take, flat_take, shared))
        missing = [k for k in keys if k not in covered]
        if missing:
            raise self.mismatch(f"entry {missing[0][-1]!r} of {missing[0][1]} is in no "
                                "chunk's state")

    def meta_leaf(self, i: int) -> torch.Tensor:
        """Leaf ``i`` as an empty meta tensor (its shape and dtype, nothing allocated)."""
        return torch.empty(self.shapes[i], dtype=self.dtypes[i], device="meta")

    def mismatch(self, what: str) -> ValueError:
        """The error refusing a transform whose state over one chunk does not match its
        state over all parameters (``what``: where they differ)."""
        hint = (" With layout='flat' the chain must keep a state laid out like the "
                "parameters (element-wise), whatever their shapes; use layout='leaves'."
                if self.layout == "flat" else "")
        return ValueError(f"{self.where}: the transform's state over one chunk does not match "
                          f"its state over all parameters ({what}), so it cannot be run chunk "
                          f"by chunk.{hint}")

    def init_flat(self, leaves: list[torch.Tensor]) -> Any:
        """Flat layout: each chunk's state built over its flat vector, the whole state's
        tensors views of it (so a step finds each chunk's state contiguous, without a copy)."""
        state = init_on_meta(self.tx, self.spec.unflatten(leaves), lambda: self.spec.unflatten(
            [x.detach() for x in leaves]))
        self.build_maps(state)
        s_leaves, spec = tree_flatten(state)
        for k, c in enumerate(self.plan.chunks):
            dev = HOST if c.on_host else self.device
            flat = torch.cat([leaves[i].detach().reshape(-1) for i in c.leaves]).to(dev) \
                if c.leaves else torch.empty(0, dtype=c.dtype, device=dev)
            chunk_state = tree_flatten(self.tx.init((flat,)))[0]
            if c.on_host:
                for pos, _ in self.maps[k].flat:
                    chunk_state[pos] = self.host_memory(chunk_state[pos])
            self.scatter_flat(k, chunk_state, s_leaves)
            if k == 0:
                for pos, j in self.maps[k].shared:
                    s_leaves[j] = chunk_state[pos]
        return tree_unflatten(s_leaves, spec)

    def scatter_flat(self, k: int, chunk_leaves: list[Any], s_leaves: list[Any]) -> None:
        """Write views of chunk ``k``'s flat state tensors into the whole state's leaves. A
        buffer that is the one recorded for its place (a step that wrote it in place) gets
        the same view objects back, so the next `chunk_state` finds it without looking
        at the views' storage."""
        c = self.plan.chunks[k]
        for pos, parts in self.maps[k].flat:
            buf = chunk_leaves[pos]
            known = self._views.get((k, pos))
            if known is not None and known[0] is buf:
                views = known[1]
            else:
                views = tuple(buf[off:off + n].view(self.shapes[i])
                              for off, n, i in zip(c.offsets, c.sizes, c.leaves))
                self._views[(k, pos)] = (buf, views, buf.data_ptr())
            for j, view in zip(parts, views):
                s_leaves[j] = view

    def flat_state(self, k: int, pos: int, parts: list[int], s_leaves: list[Any]
                   ) -> torch.Tensor:
        """The flat state tensor at ``pos`` of chunk ``k`` from the whole state's leaves
        ``parts``: the buffer `scatter_flat` made them views of when they are those very
        view objects and the buffer is where it was (a few identity tests), else
        `flat_view` (which checks the storage of every part, or concatenates)."""
        known = self._views.get((k, pos))
        if known is not None:
            buf, views, ptr = known
            if all(s_leaves[j] is v for j, v in zip(parts, views)) and buf.data_ptr() == ptr:
                return buf
        return flat_view([s_leaves[j] for j in parts], self.plan.chunks[k].numel)

    def chunk_state(self, k: int, s_leaves: list[Any], shared: list[torch.Tensor] | None
                    ) -> Any:
        """Chunk ``k``'s state: its tensors of the whole state (the flat layout's as one flat
        view each), and the shared ones (``shared``: copies already on its side)."""
        m = self.maps[k]
        leaves = list(m.template)
        for pos, j in m.take:
            leaves[pos] = s_leaves[j]
        for pos, parts in m.flat:
            leaves[pos] = self.flat_state(k, pos, parts, s_leaves)
        for n, (pos, j) in enumerate(m.shared):
            # each chunk its own copy: a step that writes one in place (donated, or compiled)
            # must not advance the count that the next chunk reads
            leaves[pos] = s_leaves[j].clone() if shared is None else shared[n]
        return tree_unflatten(leaves, m.spec)

    def write_back(self, k: int, new_state: Any, s_leaves: list[Any], written: set[int],
                   back: Callable[[torch.Tensor, torch.device], torch.Tensor]) -> None:
        """Chunk ``k``'s new state into the whole state's leaves; each shared tensor (a step
        count) from the first chunk written that holds it (``written``: those already taken;
        a chunk without a partition's leaves holds none of that partition's counts), brought
        back to its device by ``back`` (`opttx.distributed.staging.Transfers.shared_back`)."""
        m = self.maps[k]
        leaves, spec = tree_flatten(new_state)
        if spec != m.spec:
            raise ValueError(f"{self.where}: the transform returned a state of another "
                             "structure than its init's; a state must keep its structure.")
        for pos, j in m.take:
            s_leaves[j] = leaves[pos]
        if m.flat:
            self.scatter_flat(k, leaves, s_leaves)
        for pos, j in m.shared:
            if j not in written:
                written.add(j)
                s_leaves[j] = back(leaves[pos], s_leaves[j].device)

    def scatter_updates(self, k: int, u: PyTree, out: list[Any]) -> None:
        """Chunk ``k``'s updates ``u`` (its tree, or its flat vector) into ``out``, the list of
        every leaf's update (the flat layout's as views shaped like the leaves)."""
        c = self.plan.chunks[k]
        if self.layout == "flat":
            (flat,) = u
            for i, off, n in zip(c.leaves, c.offsets, c.sizes):
                out[i] = flat[off:off + n].view(self.shapes[i])
        else:
            leaves = tree_flatten(u)[0]
            for i, x in zip(c.leaves, leaves):
                out[i] = x


def _read_through(name: str) -> property:
    return property(lambda self: getattr(self.states, name),
                    doc=f"The chunks' `ChunkStates.{name}` (read through ``states``).")


class OnChunkStates:
    """The reads of the shared `ChunkStates` (``self.states``) that the offload engine's parts
    (`Masters`, `Transfers`, `HostSteps`) make: its plan, layout, maps, placement and tree,
    written once here instead of a forwarding property per part."""

    states: ChunkStates
    plan = _read_through("plan")
    layout = _read_through("layout")
    maps = _read_through("maps")
    where = _read_through("where")
    device = _read_through("device")
    spec = _read_through("spec")
    shapes = _read_through("shapes")
