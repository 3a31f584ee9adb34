r"""`diloco`: DiLoCo and streaming DiLoCo, an outer optimizer over replicas that train alone.

Each replica (a rank of ``group``, or a data-parallel group of its own inside it) runs the
inner transform on its own data for :math:`H` steps; then the *pseudo-gradient*, the global
parameters of the last synchronization minus the replica's parameters, is averaged over the
group (one all-reduce) and an outer transform steps the global parameters, which every replica
then continues from. Replicas communicate once every :math:`H` steps instead of every step
(data parallelism): :math:`H` times fewer bytes (Douillard et al., arXiv 2311.08105). Streaming
DiLoCo (Douillard et al., arXiv 2501.18512) splits the parameters into fragments synchronized
in turn, staggered by :math:`H/F` steps, so that the peak bandwidth is :math:`1/F` of it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .._tracing import is_tracing
from ..base import (GradientTransformation, Params, Role, State, Updates, check_init_params,
                    check_state_type, combine_traits, configuration_items, declare,
                    declare_roles, describe_value, replace_state, require_params,
                    safe_increment, traits_of, zero_count)
from ..kernels import cast_like, foreach
from ..tree import (MaskedNode, PyTree, Static, flatten_matching, tree_cond, tree_flatten,
                    tree_map, tree_unflatten)
from .consistency import check_replicated_leaves
from .reducer import CollectiveStats, collective_device, pack_all_reduce
from .shapes import agree_on_configuration, require_member

__all__ = ["DiLoCoState", "diloco", "diloco_fragments", "diloco_schedule"]


class DiLoCoState(NamedTuple):
    """State of `diloco`."""
    count: torch.Tensor        # shape (), int32: inner steps taken
    global_params: Updates     # like params (fp32 for 16-bit leaves): the global parameters,
    #                            each fragment's as of its last synchronization
    inner_state: State         # the inner transform's state (this replica's own)
    outer_states: tuple        # one outer state per fragment, over the params with the other
    #                            fragments' leaves masked (`opttx.MaskedNode`)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, global_params=Role.PARAMS_LIKE)


def diloco_fragments(params: Params, fragments: int | PyTree | Callable | None
                     ) -> tuple[list[int], int]:
    """The fragment of every leaf of ``params`` (in flattening order) and the number of
    fragments, as `diloco` reads its ``fragments`` argument:

    * None: one fragment (plain DiLoCo);
    * an int :math:`F`: the leaves in flattening order cut into :math:`F` contiguous runs of
      about equal numbers of elements (a leaf goes where its middle element falls), as
      streaming DiLoCo cuts a model into runs of consecutive layers;
    * a tree like ``params`` of ints ``0..F-1``, or a function of ``params`` returning one.
    """
    leaves, spec = tree_flatten(params)
    if fragments is None:
        return [0] * len(leaves), 1
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if fragments < 1:
            raise ValueError(f"diloco: fragments must be >= 1, got {fragments}.")
        sizes = [x.numel() for x in leaves]
        total = max(sum(sizes), 1)
        labels, before = [], 0
        for n in sizes:
            labels.append(min(fragments - 1, int(fragments * (before + n / 2) / total)))
            before += n
        return labels, fragments
    tree = fragments(params) if callable(fragments) else fragments
    labels, label_spec = tree_flatten(tree)
    if label_spec != spec:
        raise ValueError("diloco: the fragments tree must have the structure of the params "
                         "(one int per leaf).")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in labels):
        raise ValueError("diloco: every fragment label must be an int >= 0, got "
                         f"{sorted(set(map(repr, labels)))}.")
    return list(labels), (max(labels) + 1 if labels else 1)


def diloco_schedule(count: torch.Tensor, sync_every: int, num_fragments: int
                    ) -> list[torch.Tensor]:
    """For the 1-based step ``count``, whether each fragment synchronizes at it (0-dim bool
    tensors): fragment :math:`f` at the steps :math:`t` with :math:`t \\bmod (H/F) = 0` and
    :math:`(t/(H/F) - 1) \\bmod F = f`, i.e. at :math:`(f+1)H/F, (f+1)H/F + H, \\dots`: each
    every :math:`H` steps, one fragment every :math:`H/F` steps (torchft's order)."""
    period = sync_every // num_fragments
    on = torch.remainder(count, period) == 0
    turn = torch.remainder(torch.div(count, period, rounding_mode="floor") - 1, num_fragments)
    return [on & (turn == f) for f in range(num_fragments)]


def _masked(leaves: Sequence[Any], keep: Sequence[bool], spec: Any) -> PyTree:
    return tree_unflatten([x if k else MaskedNode() for x, k in zip(leaves, keep)], spec)


def _state_dtype(p: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


@declare()
def diloco(inner: GradientTransformation, outer: GradientTransformation | None = None,
           sync_every: int = 100, group: Any = None,
           fragments: int | PyTree | Callable | None = None, *, local_weight: float = 0.0,
           stats: CollectiveStats | None = None, communication_dtype: torch.dtype | None = None,
           state_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""DiLoCo: ``inner`` steps on each replica, an ``outer`` step on the averaged
    pseudo-gradient every ``sync_every`` steps (per fragment, staggered when streaming).

    With :math:`\theta^{(r)}` replica :math:`r`'s parameters (the ones it trains), :math:`\phi`
    the global parameters (in the state, the same on every replica), :math:`u^{(r)}_t` the
    inner update, :math:`W` the size of ``group`` and :math:`H` = ``sync_every``: every step
    :math:`\theta^{(r)} \leftarrow \theta^{(r)} + u^{(r)}_t`, and at a synchronization of
    fragment :math:`P` (its leaves)

    .. math::
        \Delta_P = \frac{1}{W}\sum_r \big(\phi_P - \theta^{(r)}_P\big), \qquad
        \phi_P \leftarrow \phi_P + \mathrm{outer}(\Delta_P), \qquad
        \theta^{(r)}_P \leftarrow (1-\lambda)\,\phi_P + \lambda\,\theta^{(r)}_P

    (:math:`\lambda` = ``local_weight``, 0 in DiLoCo). The returned update of a synchronized
    leaf is :math:`\theta^{\text{new}} - \theta` (so ``apply_updates`` lands on
    :math:`\phi_P` up to one rounding of the addition); the others get the inner update.
    Fragment :math:`f` of :math:`F` synchronizes at the steps :math:`(f+1)H/F + kH`
    (`diloco_schedule`): one fragment every :math:`H/F` steps, each every :math:`H` steps, in
    torchft's order. :math:`H` must be a multiple of :math:`F`.

    **Communication.** A synchronization of a fragment is one all-reduce (sum, then divided by
    :math:`W`) of one flat buffer of its pseudo-gradients (`opttx.distributed.pack_all_reduce`;
    ``stats`` counts it); other steps communicate nothing. Plain data parallelism
    (`all_reduce_gradients`) moves every gradient every step: :math:`H` times the bytes.
    Inside a replica, combine with the usual tools (``inner`` may itself be ``zero(...)`` or
    a chain starting with ``all_reduce_gradients(replica_group)``; ``group`` then holds one
    rank per replica, the same local rank in each).

    **One graph, one branch.** Which fragment synchronizes is computed from the step count in
    the graph; the synchronization is a ``torch.cond`` branch (`opttx.tree.tree_cond`), so in
    eager mode the collective runs on synchronization steps only (reading the 0-dim step
    count once per step and fragment: a device-to-host read where the parameters are on a GPU).

    **Differences from torchft's ``DiLoCo``** (``tests/test_diloco.py`` compares the two on 2
    gloo ranks, float64): no fault tolerance (quorum, retries, recovery: a failed collective
    raises); no ``fragment_sync_delay`` (the pseudo-gradient is taken at the synchronization
    step, :math:`\tau = 0` in arXiv 2501.18512); the pseudo-gradients are sent in one buffer per
    fragment (torchft's ``use_bucketization`` without a bucket cap); no quantization on the wire
    (``communication_dtype`` may halve it). Replicas land on :math:`\phi` by an update, so
    after a synchronization they agree to one rounding of :math:`\theta + (\phi - \theta)`
    (bit for bit where that is exact), where torchft copies :math:`\phi` in.

    Args:
      inner: the replica's transform (its learning rate included).
      outer: the transform of the global parameters, given the averaged pseudo-gradient as
        its gradient (any opttx chain; its state kept per fragment). Default: Nesterov SGD
        with learning rate 0.7 and momentum 0.9 (the DiLoCo paper's),
        ``opttx.sgd(0.7, momentum=0.9, nesterov=True)``.
      sync_every: :math:`H` >= 1, inner steps between two synchronizations of a fragment.
      group: the process group of the replicas (None: the default group; without
        ``torch.distributed`` initialized, or with one rank, nothing is communicated and the
        outer step takes the replica's own pseudo-gradient).
      fragments: None (one fragment), an int :math:`F` (contiguous runs of leaves of about
        equal size), or a tree like the params of fragment indices (or a function of the
        params returning one): see `diloco_fragments`.
      local_weight: :math:`\lambda` in [0, 1): how much of its own parameters a replica keeps
        at a synchronization (torchft's ``fragment_update_alpha``).
      stats: a `CollectiveStats` to count the all-reduces and their bytes into (eager).
      communication_dtype: the dtype of the pseudo-gradients on the wire (None: the global
        parameters').
      state_dtype: dtype of the global parameters (default: the parameters', float32 for
        16-bit ones).

    Returns:
      A `GradientTransformation` that needs ``params`` in ``update``; its state is a
      `DiLoCoState` (``init`` checks, on every rank, that the ranks built the same
      configuration and start from the same parameters: one all-reduce of a hash and one
      all-gather of checksums), checkpointed like any other (`opttx.distributed.state_dict`): the global
      parameters, the step count, the inner and outer states. A replica's parameters and
      inner state are its own (they differ across replicas), so each replica saves and loads
      its own checkpoint over a process group of its own ranks (``dcp.save(...,
      process_group=replica_group)``, `opttx.distributed.load_checkpoint` with
      ``group=replica_group``); a checkpoint saved over ``group`` would keep one replica's.

    Example:
      >>> tx = opttx.distributed.diloco(opttx.adamw(4e-4, weight_decay=0.1), sync_every=500)
      >>> streaming = opttx.distributed.diloco(opttx.adamw(4e-4), sync_every=100,
      ...                                      fragments=4)
      >>> state = tx.init(params)                      # same params on every replica
      >>> updates, state = tx.update(grads, state, params)   # this replica's gradients
      >>> params = opttx.apply_updates(params, updates)

    References:
      Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam and Shen, DiLoCo:
      Distributed Low-Communication Training of Language Models (arXiv 2311.08105).
      Douillard et al., Streaming DiLoCo with overlapping communication (arXiv 2501.18512).
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"diloco: inner must be a GradientTransformation, got "
                        f"{type(inner).__name__}.")
    if outer is None:
        from ..aliases import sgd
        outer = sgd(0.7, momentum=0.9, nesterov=True)
    if not isinstance(outer, GradientTransformation):
        raise TypeError(f"diloco: outer must be a GradientTransformation or None, got "
                        f"{type(outer).__name__}.")
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(f"diloco: sync_every must be an integer >= 1, got {sync_every!r}.")
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if fragments < 1 or sync_every % fragments:
            raise ValueError(f"diloco: sync_every ({sync_every}) must be a multiple of the "
                             f"number of fragments ({fragments}): one fragment synchronizes "
                             "every sync_every / fragments steps.")
    if not isinstance(local_weight, (int, float)) or not 0 <= local_weight < 1:
        raise ValueError(f"diloco: local_weight must be a number in [0, 1), got "
                         f"{local_weight!r}.")
    if communication_dtype is not None and (not isinstance(communication_dtype, torch.dtype)
                                            or not communication_dtype.is_floating_point):
        raise ValueError("diloco: communication_dtype must be a floating torch.dtype or None, "
                         f"got {communication_dtype!r}.")
    settings = configuration_items(inner, "inner") + configuration_items(outer, "outer") + [
        (f"diloco.{k}", describe_value(v, True)) for k, v in (
            ("sync_every", sync_every), ("local_weight", local_weight),
            ("communication_dtype", communication_dtype), ("state_dtype", state_dtype),
            ("fragments", fragments if isinstance(fragments, (int, type(None))) else "tree"))]

    def world() -> int:
        if not dist.is_initialized():
            return 1
        return dist.get_world_size(group if group is not None else dist.group.WORLD)

    def labels_of(params: Params) -> tuple[list[int], int]:
        labels, count = diloco_fragments(params, fragments)
        if sync_every % count:
            raise ValueError(f"diloco: sync_every ({sync_every}) must be a multiple of the "
                             f"number of fragments ({count}).")
        return labels, count

    def init(params: Params) -> DiLoCoState:
        check_init_params(params)
        labels, count = labels_of(params)
        if world() > 1 and not is_tracing():
            g = group if group is not None else dist.group.WORLD
            require_member(group, "opttx.distributed.diloco")
            agree_on_configuration(settings, g, collective_device(g), "opttx.distributed.diloco")
            # the replicas start from the same point, or their global parameters differ
            check_replicated_leaves("opttx.distributed.diloco", params,
                                    [True] * len(labels), group)
        leaves, spec = tree_flatten(params)
        global_params = tree_map(
            lambda p: p.detach().to(dtype=_state_dtype(p, state_dtype), copy=True), params)
        outer_states = tuple(outer.init(_masked(leaves, [lb == f for lb in labels], spec))
                             for f in range(count))
        return DiLoCoState(count=zero_count(params), global_params=global_params,
                           inner_state=inner.init(params), outer_states=outer_states)

    def update(updates: Updates, state: DiLoCoState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, DiLoCoState]:
        params = require_params(params, "diloco")
        check_state_type(state, DiLoCoState, "diloco")
        labels, num = labels_of(params)
        if len(state.outer_states) != num:
            raise ValueError(f"diloco: the state holds {len(state.outer_states)} outer states "
                             f"for {num} fragments: pass the state made by init on these "
                             "params.")
        count = safe_increment(state.count)
        syncs = diloco_schedule(count, sync_every, num)
        inner_updates, inner_state = inner.update(updates, state.inner_state, params,
                                                  **extra_args)
        spec, u, phi, y = flatten_matching(inner_updates, state.global_params, params,
                                           what="updates, global params and params")
        out, new_phi, outer_states = list(u), list(phi), list(state.outer_states)
        w = world()
        for f in range(num):
            idx = [i for i, lb in enumerate(labels) if lb == f]
            keep = [lb == f for lb in labels]

            def sync(uf: list, phif: list, yf: list, sf: Any, idx: list = idx,
                     keep: list = keep) -> tuple:
                # this replica's parameters after the inner step, in the global dtype
                local = foreach("add", cast_like(yf, phif), cast_like(uf, phif))
                delta = foreach("sub", phif, local)              # pseudo-gradient
                if w > 1:
                    g = group if group is not None else dist.group.WORLD
                    delta = pack_all_reduce(delta, "sum", g, stats, communication_dtype)
                    delta = [d.to(p.dtype) / w for d, p in zip(delta, phif)]
                full = [MaskedNode()] * len(labels)
                for i, d in zip(idx, delta):
                    full[i] = d
                ou, sf = outer.update(tree_unflatten(full, spec), sf,
                                      _masked(phi, keep, spec), **extra_args)
                ou = tree_flatten(ou)[0]                       # the fragment's leaves
                phif = cast_like(foreach("add", phif, cast_like(ou, phif)), phif)
                target = phif if local_weight == 0 else \
                    foreach("lerp", phif, local, local_weight)
                uf = cast_like(foreach("sub", target, cast_like(yf, phif)), uf)
                return uf, phif, yf, sf

            def skip(uf: list, phif: list, yf: list, sf: Any) -> tuple:
                return uf, phif, yf, sf

            if not idx:
                continue
            uf, phif, _, sf = tree_cond(syncs[f], sync, skip,
                                        ([out[i] for i in idx], [new_phi[i] for i in idx],
                                         [y[i] for i in idx], outer_states[f]))
            for i, a, b in zip(idx, uf, phif):
                out[i], new_phi[i] = a, b
            outer_states[f] = sf
        new_state = replace_state(state, count=count,
                                  global_params=tree_unflatten(new_phi, spec),
                                  inner_state=inner_state, outer_states=tuple(outer_states))
        return tree_unflatten(out, spec), new_state

    # its collective takes each replica's own parameters: a wrapper deciding from them (a
    # skip) agrees on the decision over the group first
    groups = tuple(dict.fromkeys(traits_of(inner).collective_groups + (group,)))
    return GradientTransformation(init, update,
                                  combine_traits((inner, outer), collective_groups=groups))
