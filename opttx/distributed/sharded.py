"""`sharded(tx, specs)`: run any chain on local shards, with exact layer-wise statistics."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .._tracing import is_tracing
from ..base import (GradientTransformation, Params, REDUCER_KEY, State, Traits, Updates,
                    describe_value, configuration_items, declare, reducer_during_init)
from ..tree import PyTree, tree_flatten, tree_paths
from .owners import on_owners as _on_owners
from .consistency import (ConsistencyCheck, StepCounters, check_replicated_leaves,
                          common_counter_paths)
from .reducer import CollectiveStats, ShardedReducer, collective_device
from .shapes import (agree_on_configuration, agree_on_state_structure, global_shapes, is_dtensor,
                     raise_on_every_rank)
from .specs import flatten_specs, shard_groups, specs_from_dtensors

__all__ = ["sharded"]


def _to_local(tree: PyTree) -> tuple[PyTree, list[Any] | None]:
    """The tree with DTensor leaves replaced by their local tensors, and the DTensors (to
    rebuild the updates like them), or None when there are none."""
    leaves, treespec = tree_flatten(tree)
    if not any(is_dtensor(x) for x in leaves):
        return tree, None
    return treespec.unflatten([x.to_local() if is_dtensor(x) else x for x in leaves]), leaves


def _like_dtensors(tree: PyTree, templates: list[Any]) -> PyTree:
    from torch.distributed.tensor import DTensor
    leaves, treespec = tree_flatten(tree)
    out = [DTensor.from_local(x, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride()) if is_dtensor(t) else x
           for x, t in zip(leaves, templates)]
    return treespec.unflatten(out)


def _fingerprint(reducer: ShardedReducer) -> tuple:
    """What every rank must agree on: the tree structure and, per leaf, its number of dims and
    the (dim, group size) of each `Shard` (group members legitimately differ: each rank's own
    tensor-parallel group)."""
    import torch.distributed as dist
    return (repr(reducer.treespec), tuple(
        (n, tuple((s.dim, dist.get_world_size(s.group)) for s in shards))
        for n, shards in zip(reducer._ndims or (), reducer.flat_specs)))


def _agree_on_specs(reducer: ShardedReducer) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks' trees or specs differ (an
    empty tree on one rank would hang the others in the size all-reduce; Shard dims that
    differ would give wrong statistics silently). One ``all_gather_object``, at init."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, _fingerprint(reducer))
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            ours = every[0]
            if ours[0] != theirs[0]:
                what = f"the parameter trees differ ({ours[0]} on rank 0, {theirs[0]} on rank {r})"
            else:
                paths = tree_paths(reducer.treespec.unflatten(list(range(len(ours[1])))))
                i = next(i for i, (a, b) in enumerate(zip(ours[1], theirs[1])) if a != b)
                what = (f"{paths[i]}: (ndim, ((shard dim, group size), ...)) is {ours[1][i]} "
                        f"on rank 0, {theirs[1][i]} on rank {r}")
            raise ValueError("opttx.distributed.sharded: the ranks passed different parameter "
                             f"trees or specs to init: {what}. Every rank must pass the same "
                             "tree and the same specs (its own shards of every leaf).")


@declare(same_state_as="tx")
def sharded(tx: GradientTransformation, specs: PyTree | None = None, *,
            stats: CollectiveStats | None = None, check_sizes: bool = True,
            check_collectives: bool = False, on_owners: bool = False,
            owner_group: Any = None, split_above_mb: float | None = None
            ) -> GradientTransformation:
    r"""Run ``tx`` on the local shards of sharded parameters, with exact statistics.

    Elementwise transforms need nothing: they run on the local shard as they would on the
    whole tensor. Every layer-wise statistic (global norm, RMS, trust ratio, factored row and
    column means) goes through `opttx.base.reduce_statistics`; here it becomes collectives:

    .. math::
        s_\ell = \bigoplus_{r \in G} s_\ell^{(r)} \quad\text{for every group } G
        \text{ that shards a dim the statistic of leaf } \ell \text{ was reduced over,}

    with :math:`\oplus` the hook's op (sum or max), so every rank gets the single-device
    statistic. All leaves bound for one group in one hook call share one flat buffer and one
    ``all_reduce`` (`torch.distributed._functional_collectives`, traceable by
    ``torch.compile`` without a graph break): the number of collectives per step depends on
    the chain and on the groups, never on the number of parameters.

    Args:
      tx: any `GradientTransformation` (a chain, an alias).
      specs: a tree like the params whose leaves are `Replicated`, `Shard` or a tuple of
        `Shard` (None leaves: replicated). None: read from `DTensor` leaves (plain tensors are
        replicated). DTensor params and updates are handled as their local tensors; the
        updates come back as DTensors with the same placements, the state holds local tensors.
      stats: a `CollectiveStats` that counts hook calls, collectives and bytes (eager).
      check_sizes: at ``init``, all-reduce the local sizes once to check them against the
        ``size`` of each `Shard` that gives one.
      check_collectives: debugging aid: before every batched reduction, agree on its size
        across the group (one small extra collective) and raise a clear ``ValueError`` on every
        rank when the ranks disagree, rather than hang or abort in a mismatched collective.
      on_owners: run the whole of ``tx`` on whole leaves at owner ranks
        (`opttx.distributed.on_owners`): needed, and exact, for transforms that need whole
        matrices (`opttx.shampoo`, `opttx.galore_adamw`, 8-bit states), which raise a
        ``ValueError`` on local shards. Two ``all_to_all`` per step.
      owner_group: with ``on_owners``, the ranks among which leaves are spread (default: the
        one group that shards the leaves, else the default group).
      split_above_mb: with ``on_owners``, cut leaves larger than this (MiB) into one row
        segment per owner rank (see `opttx.distributed.on_owners`).

    ``init`` checks the specs on every rank (tree structure, dims, group membership) and agrees
    on the outcome with one all-reduce over the default group, so a bad spec on one rank raises
    a ``ValueError`` on all of them instead of hanging the others in a collective; then one
    ``all_gather_object`` checks that all ranks passed the same tree structure and the same
    shard dims and group sizes (an empty tree on one rank, or Shard(0) here and Shard(1)
    there, raises on every rank); last, one all-gather of an exact checksum of every
    replicated leaf (`Replicated`, or a plain tensor among DTensors) raises on every rank,
    naming the leaf, when one differs across the ranks. Every eager ``update`` sends the
    state's step counters along with the step's first statistic all-reduce (none for a chain
    without statistics): a rank whose state skipped an update (or took one more) makes every
    rank raise the same ``ValueError`` naming the counter. A wrapper around ``sharded`` that
    decides from the local shards (`opttx.apply_if_finite`) agrees on its decision over the
    default group first (`opttx.extend.Traits.collective_groups`).

    Returns:
      A `GradientTransformation` whose state is ``tx``'s state on the local shards. The specs
      are resolved by ``init`` (or by the first ``update`` after a restore) and kept: use one
      ``sharded`` transform per parameter tree.

    Example:
      >>> tp = dist.new_group([0, 1])
      >>> specs = {"w_in": Shard(0, tp), "w_out": Shard(1, tp), "b": Replicated()}
      >>> tx = opttx.distributed.sharded(opttx.adafactor(1e-2, factor_axes="last"), specs)
      >>> state = tx.init(local_params)
      >>> updates, state = tx.update(local_grads, state, local_params)

      FSDP2 (``fully_shard``): the parameters are DTensors sharded on dim 0 (unevenly where
      the size does not divide), the specs are read from them, and ``backward`` leaves each
      rank its shard of the already averaged gradient, so no other link is needed. Adafactor
      and CAME decide their factoring on the global shapes (``init`` all-reduces the local
      sizes once and the reducer hands them to the factoring rules); matrix transforms run on
      owner ranks:

      >>> fully_shard(model, mesh=mesh)          # after fully_shard on each block
      >>> opt = opttx.Optimizer(model.named_parameters(), sharded(opttx.adafactor(1e-2)))
      >>> opt = opttx.Optimizer(model.parameters(), sharded(opttx.shampoo(1e-3), on_owners=True))
      >>> params = {k: p.detach() for k, p in model.named_parameters()}   # or functionally
      >>> tx = sharded(opttx.lamb(1e-3))
      >>> state = tx.init(params)
      >>> updates, state = tx.update({k: p.grad for k, p in model.named_parameters()}, state,
      ...                            params)
      >>> opttx.apply_updates_(params, updates)  # writes the model's DTensor parameters

    References:
      Shoeybi et al., Megatron-LM (arXiv 1909.08053) for tensor-parallel sharding; Xu et al.,
      GSPMD (arXiv 2105.04663) for reductions over sharded dims.
    """
    if split_above_mb is not None and not on_owners:
        raise ValueError("sharded: split_above_mb cuts leaves into row segments for on_owners; "
                         "pass on_owners=True (element-wise and factored chains already run "
                         "on the local shards).")
    if on_owners:
        tx = _on_owners(tx, owner_group=owner_group, split_above_mb=split_above_mb)
    # Resolved once (at init, or at the first update after a restore): static config, so a
    # compiled step reads it as a constant.
    resolved: list[ShardedReducer] = []
    counter_paths: list[tuple[str, ...]] = [()]   # the step counters every rank's state holds
    check = ConsistencyCheck("opttx.distributed.sharded")   # off unless the mode is on

    def build(tree: PyTree) -> ShardedReducer:
        leaves, treespec = tree_flatten(tree)
        spec_tree = specs if specs is not None else specs_from_dtensors(tree)
        flat = flatten_specs(tree, spec_tree)
        return ShardedReducer(treespec, flat, shard_groups(flat), stats,
                              ndims=[x.ndim for x in leaves], check=check_collectives)

    def resolve_shapes(reducer: ShardedReducer, tree: PyTree) -> ShardedReducer:
        # one all-reduce of the local sizes per group; every rank gets here (specs agreed)
        spec_tree = specs if specs is not None else specs_from_dtensors(tree)
        reducer.global_shapes = global_shapes(tree, spec_tree, check=check_sizes)
        return reducer

    settings = configuration_items(tx) + [
        (f"sharded.{k}", describe_value(v, True)) for k, v in (
            ("check_sizes", check_sizes), ("check_collectives", check_collectives),
            ("on_owners", on_owners), ("split_above_mb", split_above_mb))]

    def agree() -> None:
        # first of all: a transform or setting that differs across ranks would pair
        # mismatched collectives (an abort, a hang, or a wrong sum)
        if dist.is_initialized() and dist.get_world_size() > 1:
            agree_on_configuration(settings, None, collective_device(None),
                                   "opttx.distributed.sharded")

    def init(params: Params) -> State:
        agree()
        error, reducer = None, None
        try:
            reducer = build(params)
        except (ValueError, TypeError) as e:
            error = e
        raise_on_every_rank(error)        # one rank's bad spec must not leave the others hanging
        _agree_on_specs(reducer)
        resolved[:] = [resolve_shapes(reducer, params)]
        local, _ = _to_local(params)
        with reducer_during_init(reducer):    # init has no extra_args (on_owners, factoring)
            state = tx.init(local)
        if dist.is_initialized() and dist.get_world_size() > 1:
            agree_on_state_structure(state, None, collective_device(None),
                                     "opttx.distributed.sharded")
        counter_paths[0] = common_counter_paths(state)
        check(params, lambda: [not shards for shards in reducer.flat_specs], state, at_init=True)
        # always: a replicated leaf that differs per rank would get other updates on every
        # rank (one all-gather of a checksum of each)
        check_replicated_leaves("opttx.distributed.sharded", params,
                                [not shards for shards in reducer.flat_specs])
        return state

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        if not resolved:                  # a restored state: resolved once, here (eagerly)
            agree()
            resolved[:] = [resolve_shapes(build(updates), updates)]
            counter_paths[0] = common_counter_paths(state)
        reducer = resolved[0]
        check(params, lambda: [not shards for shards in reducer.flat_specs], state)
        local_updates, templates = _to_local(updates)
        local_params = _to_local(params)[0] if params is not None else None
        # eager: the state's step counters travel with the step's first statistic's
        # all-reduce, so a rank whose state is at another step raises on every rank
        several = not is_tracing() and dist.is_initialized() and dist.get_world_size() > 1
        reducer.carry_counters(StepCounters("opttx.distributed.sharded", state,
                                            counter_paths[0]) if several else None)
        try:
            out, new_state = tx.update(local_updates, state, local_params,
                                       **{**extra_args, REDUCER_KEY: reducer})
        finally:
            reducer.carry_counters(None)
        if templates is not None:
            out = _like_dtensors(out, templates)
        return out, new_state

    # it runs on every rank of the default group, on each rank's own shards: a wrapper
    # deciding from them (apply_if_finite's skip) agrees on the decision over that group
    return GradientTransformation(init, update, Traits(collective_groups=(None,)))
