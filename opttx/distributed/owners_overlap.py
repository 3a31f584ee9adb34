r"""`on_owners` in buckets: the ``all_to_all`` of one bucket of leaves runs while the owners
compute another (``on_owners(tx, buckets=...)`` or ``bucket_mb=...``).

The plain path sends every leaf's pieces to the owners in one ``all_to_all``, runs ``tx`` on
all owned leaves, and sends the updates back in one more: the wires idle while the owners
compute and the owners idle while the wires carry. In buckets :math:`B_1, \dots, B_n` (sets of
leaves, the same on every rank), step :math:`k` of the pipeline issues the gather of
:math:`B_{k+1}`, waits for that of :math:`B_k`, runs ``tx`` on the leaves of :math:`B_k` this
rank owns, and issues the return of :math:`B_k`'s updates; the returns are waited for at the
end. Every collective is a functional one (``torch.distributed._functional_collectives``): in
eager mode it runs in the background until its wait, and ``torch.compile`` traces the issues
and the waits in that order, in one graph as the plain path.

Running ``tx`` on a part of the leaves is the plain result only for a transform whose every
leaf's output depends on that leaf alone (declared `opttx.extend.Traits`: ``per_leaf`` and not
``across_leaves``); others are refused. The state stays the plain path's (``tx``'s state over
the owned leaves): each bucket's state is taken from it by the keys checkpoints give every
tensor, the entries that belong to no leaf (step counts) copied into every bucket and taken
back from the first. A transform that batches leaves of one shape (``batched_across_leaves``:
Muon's Newton-Schulz) keeps all leaves of a shape in one bucket, so its batches, and its
rounding, are the plain path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..base import GradientTransformation, reducer_during_init, traits_of
from ..tree import MaskedNode, tree_flatten, tree_unflatten
from .chunk_state import init_on_meta, keyed_positions
from .owners import (OwnerPlan, LeafRoute, finish_gather, finish_scatter, start_gather,
                     start_scatter, wire_dtype)
from .reducer import CollectiveStats

__all__ = ["DEFAULT_BUCKETS", "BucketPlan", "check_bucketable", "make_buckets",
           "overlapped_update"]

DEFAULT_BUCKETS = 4
"""The number of buckets of ``on_owners(tx, overlap=True)``. A count rather than a size: every
bucket adds two ``all_to_all``, whose latency grows with the ranks, and leaves of 16 MiB and
more (a Llama-3 8B's) would each make a bucket of their own. Measured by
benchmarks/owners_overlap.py (gloo on CPU, world 2 and 4: 2 to 8 buckets against the plain
path) and modeled by benchmarks/scale_model.py (Llama-3 8B, 64 ranks: 4 buckets hide the most
of the owners' computation behind the all_to_alls); see benchmarks/RESULTS.md."""


def check_bucketable(tx: GradientTransformation) -> None:
    """Refuse, with the reason, a transform that cannot run bucket by bucket."""
    t = traits_of(tx)
    if t.across_leaves:
        raise ValueError(
            "on_owners: buckets run the transform on a part of the leaves at a time, and its "
            "traits say it takes a statistic across leaves (Traits.across_leaves: a global "
            "norm, a finiteness test), which needs every leaf before any update. Clip outside "
            "on_owners (sharded(chain(clip_by_global_norm(...), on_owners(tx, buckets=...)), "
            "specs): the norm is then reduced over the local shards), or use one bucket.")
    if not t.per_leaf:
        raise ValueError(
            "on_owners: buckets run the transform on a part of the leaves at a time, and its "
            "traits do not say that each leaf's output depends on that leaf alone "
            "(Traits.per_leaf), so a bucket's numbers could differ from the whole tree's; "
            "declare the traits of a transform of your own (opttx.extend.LEAFWISE) if they "
            "hold, or use one bucket.")


def make_buckets(plan: OwnerPlan, nbytes: list[int], buckets: int | None,
                 bucket_mb: float | None, by_shape: bool) -> list[list[int]]:
    """The buckets (lists of param leaf indices, in leaf order) of ``plan``'s leaves: leaves
    in order, a bucket closed when it reaches ``bucket_mb`` MiB (whole leaves' bytes,
    ``nbytes``) or, with ``buckets``, an ``n``-th of the total. With ``by_shape`` the units
    are the groups of leaves of one shape (all in one bucket)."""
    units: dict[Any, list[int]] = {}
    for i, leaf in enumerate(plan.leaves):
        if leaf is None:
            continue
        key = (tuple(leaf.shape), nbytes[i] // max(leaf.numel(), 1)) if by_shape else i
        units.setdefault(key, []).append(i)
    sizes = [sum(nbytes[i] for i in members) for members in units.values()]
    if buckets is not None:
        target = sum(sizes) / max(buckets, 1)
    else:
        target = bucket_mb * 2**20
    out: list[list[int]] = [[]]
    filled = 0.0
    for members, size in zip(units.values(), sizes):
        if out[-1] and filled + size > target and (buckets is None or len(out) < buckets):
            out.append([])
            filled = 0.0
        out[-1].extend(members)
        filled += size
    return [sorted(b) for b in out if b]


@dataclass
class _BucketMap:
    """How one bucket's state is taken from the whole state and written back."""
    template: list[Any]           # the bucket state's leaves (tensor positions filled per step)
    spec: Any                     # its treespec
    take: list[tuple[int, int]]   # (bucket position, whole-state position): its leaves' tensors
    shared: list[tuple[int, int]]  # (bucket position, whole-state position): no leaf's (counts)


@dataclass
class BucketPlan:
    """The buckets of one owner plan and, for this rank, each bucket's state map."""
    buckets: list[list[int]]            # param leaf indices per bucket, the same on every rank
    routes: list[list[LeafRoute]]           # per bucket, its routes in the plan's order
    mine: list[list[int]]               # per bucket, the leaves this rank owns
    maps: list[_BucketMap | None]       # per bucket, None where this rank owns none of it
    state_spec: Any                     # the treespec of the whole state
    treespec: Any                       # of the param tree


def bucket_plan(tx: GradientTransformation, plan: OwnerPlan, treespec: Any,
                local: list[torch.Tensor | None], state: Any, buckets: int | None,
                bucket_mb: float | None) -> BucketPlan:
    """The `BucketPlan` of ``plan`` for ``tx`` and its whole state ``state`` (made by
    ``tx.init`` over the owned leaves); ``local``: this rank's param pieces (their dtypes)."""
    nbytes = [0 if leaf is None else leaf.numel() * local[i].element_size()
              for i, leaf in enumerate(plan.leaves)]
    groups = make_buckets(plan, nbytes, buckets, bucket_mb,
                          traits_of(tx).batched_across_leaves)
    every = plan.routes()
    owned = plan.owned()
    routes = [[r for r in every if r.index in set(b)] for b in groups]
    mine = [[i for i in b if owned[i]] for b in groups]
    n = len(plan.leaves)

    def meta(i: int) -> torch.Tensor:
        leaf = plan.leaves[i]
        shape = leaf.shape if leaf is not None else (0,)
        dtype = local[i].dtype if local[i] is not None else torch.float32
        return torch.empty(shape, dtype=dtype, device="meta")
    meta_tree = treespec.unflatten([meta(i) for i in range(n)])
    keys, _, state_spec = keyed_positions(state, meta_tree, owned)
    maps: list[_BucketMap | None] = []
    covered: set[tuple] = set()
    for members in mine:
        if not members:
            maps.append(None)
            continue
        keep = set(members)
        tree = treespec.unflatten([meta(i) if i in keep else MaskedNode() for i in range(n)])
        with reducer_during_init(None):          # whole leaves, as the owners see them
            template = init_on_meta(tx, tree, lambda keep=keep: treespec.unflatten(
                [torch.zeros(meta(i).shape, dtype=meta(i).dtype) if i in keep else MaskedNode()
                 for i in range(n)]))
        tkeys, tleaves, tspec = keyed_positions(template, meta_tree,
                                                [i in keep for i in range(n)])
        take, shared = [], []
        for key, (pos, *_) in tkeys.items():
            if key not in keys:
                raise ValueError(f"on_owners: the transform's state over one bucket has an "
                                 f"entry {key[-1]!r} that its state over the owned leaves "
                                 "lacks, so it cannot run bucket by bucket; use one bucket.")
            (shared if key[0] == "shared" else take).append((pos, keys[key][0]))
            covered.add(key)
        maps.append(_BucketMap(tleaves, tspec, take, shared))
    missing = [k for k in keys if k not in covered]
    if any(mine) and missing:
        raise ValueError(f"on_owners: entry {missing[0][-1]!r} of the transform's state is in "
                         "no bucket's state, so it cannot run bucket by bucket; use one "
                         "bucket.")
    return BucketPlan(groups, routes, mine, maps, state_spec, treespec)


def overlapped_update(tx: GradientTransformation, bplan: BucketPlan, plan: OwnerPlan,
                      trees: list[list[torch.Tensor | None]], state: Any,
                      inner_extra: dict[str, Any], stats: CollectiveStats | None,
                      communication_dtype: torch.dtype | None
                      ) -> tuple[list[torch.Tensor | None], Any]:
    """One step of ``tx`` on the owners, bucket by bucket (see the module docstring): per param
    leaf, this rank's piece of the update (None where absent), and the new whole state."""
    s_leaves, spec = tree_flatten(state)
    if spec != bplan.state_spec:
        raise ValueError("on_owners: the state given to update is not laid out as the one "
                         "init made (was it built by this transform's init?).")
    grads = trees[0]
    n = len(plan.leaves)
    # the plain path's wire dtypes: the same roundings, whatever a bucket holds
    gather_dtype = _promoted([tree[leaf.index] for tree in trees
                              for leaf in plan.routes()])
    back_dtype = wire_dtype(plan, grads, plan.routes(), communication_dtype)
    out: list[torch.Tensor | None] = [None] * n
    new_leaves = list(s_leaves)
    written: set[int] = set()
    returns = []
    count = len(bplan.buckets)
    gathers = {0: start_gather(plan, trees, stats, bplan.routes[0], gather_dtype)}
    ran = False
    for k in range(count):
        if k + 1 < count:                 # the next bucket travels while this one computes
            gathers[k + 1] = start_gather(plan, trees, stats, bplan.routes[k + 1],
                                          gather_dtype)
        whole = finish_gather(gathers.pop(k))
        computed: list[torch.Tensor | None] = [None] * n
        m = bplan.maps[k]
        if m is not None:
            keep = set(bplan.mine[k])
            masked = [bplan.treespec.unflatten([t[i] if i in keep else MaskedNode()
                                                for i in range(n)]) for t in whole]
            u, new = tx.update(masked[0], _bucket_state(m, s_leaves), masked[1]
                               if len(masked) > 1 else None, **inner_extra)
            flat_u = bplan.treespec.flatten_up_to(u)
            for i in keep:
                computed[i] = flat_u[i]
            _write_back(m, new, new_leaves, written)
            ran = True
        returns.append(start_scatter(plan, computed, grads, stats, back_dtype,
                                     bplan.routes[k]))
    if not ran:                           # this rank owns no leaf: tx still counts the step
        nothing = bplan.treespec.unflatten([MaskedNode()] * n)
        _, new = tx.update(nothing, state, nothing if len(trees) > 1 else None, **inner_extra)
        new_leaves = tree_flatten(new)[0]
    for started in returns:
        finish_scatter(started, out)
    return out, tree_unflatten(new_leaves, bplan.state_spec)


def _promoted(tensors: list[torch.Tensor]) -> torch.dtype | None:
    if not tensors:
        return None
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _bucket_state(m: _BucketMap, s_leaves: list[Any]) -> Any:
    """A bucket's state: its leaves' tensors of the whole state, and a copy of each shared one
    (a step that writes one in place must not advance the count the next bucket reads)."""
    leaves = list(m.template)
    for pos, j in m.take:
        leaves[pos] = s_leaves[j]
    for pos, j in m.shared:
        leaves[pos] = s_leaves[j].clone()
    return tree_unflatten(leaves, m.spec)


def _write_back(m: _BucketMap, new_state: Any, s_leaves: list[Any], written: set[int]) -> None:
    """A bucket's new state into the whole state's leaves; each shared tensor from the first
    bucket that holds it."""
    leaves, spec = tree_flatten(new_state)
    if spec != m.spec:
        raise ValueError("on_owners: the transform returned a state of another structure than "
                         "its init's; a state must keep its structure.")
    for pos, j in m.take:
        s_leaves[j] = leaves[pos]
    for pos, j in m.shared:
        if j not in written:
            written.add(j)
            s_leaves[j] = leaves[pos]
