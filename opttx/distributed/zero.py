"""`zero(tx, group)`: ZeRO stage 1 and 2 with chunk-based memory management.

Parameters are packed, in tree-flattening order, into flat chunks of a fixed capacity; every
whole parameter is owned by one rank (owners balanced by bytes), and a chunk is laid out as one
equal-size segment per rank holding exactly that rank's owned parameters. Gradients are reduced
per chunk (stage 2: ``reduce_scatter``, each rank receiving its own segment; stage 1:
``all_reduce``), owners run any transform on their whole owned leaves, and the updates are
all-gathered per chunk. `zero_plan` shows the layout without a process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .._checks import check_nonnegative, check_positive
from .._tracing import is_tracing
from ..base import (GradientTransformation, Params, REDUCER_KEY, State, TOTALS_KEY, Traits,
                    Updates, configuration_items, current_reducer, declare, describe_value,
                    reducer_during_init, traits_of)
from ..tree import (MaskedNode, PyTree, assert_same_structure, tree_flatten, tree_leaves,
                    tree_paths, tree_unflatten)
from .chunk_plan import ZeroChunk, ZeroPlan, state_costs, zero_plan
from .chunkable import inside_wrappers, peel_wrappers
from .consistency import (ConsistencyCheck, StepCounters, check_replicated_leaves,
                          common_counter_paths)
from .offload_engine import Offloader
from .overlap import BackwardLaunches
from .placement import check_host_group_mb, validated_fraction
from .reducer import CollectiveStats, ShardedReducer, collective_device
from .specs import Shard
from .shapes import (agree_on_configuration, agree_on_state_structure, agree_on_tree,
                     raise_on_every_rank, require_member)

__all__ = ["ZeroChunk", "ZeroPlan", "state_costs", "zero", "zero_plan"]

# the non-deprecated names where this torch has them
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_async = (getattr(dist, "reduce_scatter_single", None)
                         or dist.reduce_scatter_tensor)


def _flat_with_gaps(placed: list[tuple[torch.Tensor, int]], length: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A flat buffer of ``length`` elements holding each tensor of ``placed`` (tensor, offset;
    in increasing offsets) at its offset, zeros in the gaps and the tail: one ``cat``."""
    pieces, pos = [], 0
    for x, off in placed:
        if off > pos:
            pieces.append(torch.zeros(off - pos, dtype=dtype, device=device))
        pieces.append(x.reshape(-1).to(dtype))
        pos = off + x.numel()
    if pos < length:
        pieces.append(torch.zeros(length - pos, dtype=dtype, device=device))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


# ---------------------------------------------------------------------------------------------
# the transform
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Resolved:
    """The static configuration of one `zero` transform, resolved once per parameter tree."""
    plan: ZeroPlan
    treespec: Any
    group: Any
    rank: int
    world: int
    control_device: torch.device
    launches: BackwardLaunches | None = None   # overlap: the chunks started from backward
    leaf_shapes: tuple[tuple[int, ...], ...] = ()   # of the parameters (plan.shapes: units)
    leaf_paths: tuple[str, ...] = ()
    split_reducer: Any = None     # split_above_mb: the reducer over the split leaves' rows
    offloader: Any = None         # offload: this rank's chunks of state on the host
    offload_tx: Any = None        # offload: tx run by the offloader (inside tx's wrappers)
    counter_paths: tuple[str, ...] = ()   # the state's step counters every rank holds

    def unit_of_leaf(self) -> list[int]:
        """For every leaf, the unit this rank holds of it: its own row segment of a split
        leaf, the leaf itself otherwise (the index of the unit in the plan)."""
        if not self.plan.units:
            return list(range(len(self.plan.owners)))
        out = [-1] * len(self.leaf_shapes)
        for k, (i, a, _) in enumerate(self.plan.units):
            if a < 0 or self.plan.owners[k] == self.rank:
                out[i] = k
        return out

    def to_units(self, leaves: list[Any]) -> list[Any]:
        """Per unit of the plan: the leaf, or its rows of a segment."""
        if not self.plan.units:
            return leaves
        return [leaves[i] if a < 0 else leaves[i][a:b] for i, a, b in self.plan.units]


@declare(same_state_as="tx")
def zero(tx: GradientTransformation, group: Any = None, stage: int = 2,
         chunk_size_mb: float | None = None, offload: bool | float | str = False, *,
         min_chunk_size_mb: float = 32.0, search_range_mb: float = 32.0,
         balance: str = "params", stats: CollectiveStats | None = None,
         communication_dtype: torch.dtype | None = None, overlap: bool = False,
         split_above_mb: float | None = None, offload_layout: str = "leaves",
         offload_compile: bool = False, device_budget_mb: float | None = None,
         offload_stats: Any = None,
         offload_master_params: bool = False,
         offload_host_group_mb: float | None = None) -> GradientTransformation:
    r"""ZeRO data parallelism: each rank keeps the optimizer state of the parameters it owns.

    With :math:`W` ranks in ``group``, rank :math:`r` holding its local gradients
    :math:`g^{(r)}`, and :math:`O_r` the parameters rank :math:`r` owns (`zero_plan`: whole
    parameters, balanced by bytes, packed in chunks):

    .. math::
        \bar g_\ell = \frac{1}{W} \sum_{r=1}^{W} g^{(r)}_\ell, \qquad
        (u_\ell)_{\ell \in O_r},\ s_r' = \mathrm{tx.update}\big((\bar g_\ell)_{\ell \in O_r},
        s_r, (x_\ell)_{\ell \in O_r}\big), \qquad u = \bigcup_r (u_\ell)_{\ell \in O_r}

    so every rank returns the same full updates :math:`u`, equal to ``tx`` applied to the mean
    gradient on one device, while the state :math:`s_r` covers :math:`O_r` only (about
    :math:`1/W` of it). ``tx`` may be any chain (adamw, adafactor, came, lamb, galore_adamw,
    shampoo, adamw_8bit, ...): every leaf it sees is a whole tensor, so layer-wise statistics
    and matrix transforms are exact; the leaves other ranks own are `MaskedNode` placeholders
    (as in `opttx.masked`), so ``init`` allocates only the owned state. Statistics taken
    across leaves (`opttx.clip_by_global_norm`) are combined over the group through
    ``extra_args[opttx.base.TOTALS_KEY]``: one all-reduce of one number, on every rank.

    **Tensor parallel x ZeRO.** ``sharded(zero(tx, dp_group), specs)`` on a 2-D mesh: every
    rank holds its tensor-parallel shards; ``zero`` chooses the owners in the data-parallel
    group on the global shapes (so both shards of a parameter have the same owner index),
    reduces and gathers the local shards' chunks over ``dp_group``, and passes the sharded
    reducer on to ``tx``, whose row, column and layer statistics are reduced over the
    tensor-parallel group as under `sharded` alone. Transforms that need whole matrices go
    through `opttx.distributed.on_owners` over the tensor-parallel group inside:
    ``sharded(zero(on_owners(shampoo(...), owner_group=tp_group), dp_group), specs)``.
    Collectives per step: those of ``sharded(tx)`` on the owned leaves, plus 2 per chunk.

    Per step and per chunk: stage 2 reduce-scatters the gradient chunk (sum, then divided by
    :math:`W`; rank :math:`r` receives exactly its segment, its owned gradients); stage 1
    all-reduces it and each rank keeps its segment. Then each rank's segment of updates is
    all-gathered. Collectives per step: :math:`2 \times` chunks, plus one per statistic across
    leaves; they do not depend on the number of parameters. All are functional collectives
    (`torch.distributed._functional_collectives`), so a compiled step
    (``torch.compile(..., fullgraph=True)``) has no graph break.

    Args:
      tx: the transform the owners run, on whole leaves.
      group: the data-parallel process group (None: the default group).
      stage: 2 (reduce-scatter the gradients, default) or 1 (all-reduce them). The state is
        partitioned either way; stage 2 also receives only the owned gradients.
      chunk_size_mb: the chunk capacity in MiB (None: searched, see `zero_plan`).
      offload: keep a share of the owned optimizer state in host memory and run its update
        on the host (`opttx.distributed.offload`, applied to this rank's owned leaves in
        this plan's chunks: each chunk's segment of this rank is one offload chunk). True or
        1.0: all of it; a number in [0, 1]: that share of the state bytes (the last chunks);
        ``"auto"``: what does not fit beside the first step's peak device memory (or
        ``device_budget_mb``). The same numbers as without offload (bitwise for per-leaf
        chains with ``offload_compile=False``); the chain must run chunk by chunk
        (`opttx.distributed.check_offloadable`: per-leaf links, after stateless statistics
        across leaves such as `opttx.clip_by_global_norm`; `opttx.apply_if_finite` around
        them runs around this rank's chunks, its skip agreed over the group). Eager only; not with
        ``split_above_mb`` nor inside `sharded`.
      min_chunk_size_mb, search_range_mb: the capacities searched when ``chunk_size_mb`` is
        None.
      balance: what the owners are balanced by: ``"params"`` (default) the parameter bytes
        (the least padding, so the least traffic; the state follows when it is proportional
        to the parameters, as Adam's); ``"state"`` the optimizer-state bytes ``tx.init``
        allocates for each parameter (`state_costs`, measured on meta tensors; parameter
        bytes when ``tx`` cannot be initialised there), for transforms whose state is not
        proportional (Adafactor's whole vectors beside factored matrices): a more even state
        at the price of padding, since segments still hold the parameters (measured in
        benchmarks/RESULTS.md, zero_memory).
      stats: a `CollectiveStats` counting the collectives (eager; traced ones under compile).
      communication_dtype: the dtype of the gradient chunks and of the gathered updates on
        the wire (None: the parameters' dtype). ``torch.bfloat16`` halves the bytes of both
        collectives; the owners still compute in the parameters' dtype. Each rank's gradient
        is rounded to bf16 before the sum and the sum once more, so an element of the mean
        gradient is off by at most about :math:`(W + 1)\,2^{-8}\,\overline{|g|}` (the mean of
        the ranks' absolute values; bf16 keeps 8 significant bits), and each update element by
        at most :math:`2^{-8}` of itself. Float32 communication is exact.
      overlap: start each chunk's gradient reduction during backward, from the parameters'
        post-accumulate-grad hooks, as soon as backward has produced all gradients of the
        chunk (`opttx.distributed.overlap.BackwardLaunches`); ``update`` then waits for it
        instead of issuing it. ``init`` must get the model's parameters themselves (plain
        tensors that require grad, e.g. ``dict(model.named_parameters())``), and every rank
        must give every parameter a gradient in each backward (else a ``ValueError`` on every
        rank naming the parameter). ``update`` first agrees across the ranks (one small
        all-reduce) on which launched chunks stand: a chunk whose ``.grad`` tensors were
        replaced or modified in place since backward (``clip_grad_norm_``; clip inside the
        chain instead) is reduced again, so the numbers are those without overlap. Eager
        only (a compiled step issues its collectives itself). Accumulating micro-batches:
        run the backwards before the last inside
        ``opttx.distributed.no_sync()`` (else each backward launches again, correct but
        wasted).
      split_above_mb: split every parameter larger than this (MiB) into row segments (dim 0),
        one per rank (`zero_plan`), instead of giving it one owner: an embedding that holds
        40 % of the model then spreads its state evenly. Each rank runs ``tx`` on its rows of
        such a leaf; the statistics ``tx`` reduces over dim 0 (Adafactor's and CAME's column
        means, norms, trust ratios) go through the reduction hook as under `sharded`
        (``Shard(0, group)``), so the result stays the single-device one. For element-wise,
        factored and layer-wise chains, and for blocked ones (`opttx.shampoo`: the rows are
        split at multiples of its ``max_preconditioner_dim``, `Traits.block_rows`, so every
        rank holds whole blocks); other transforms that need whole matrices refuse it, and so
        does `zero` for chains with statistics across leaves (`opttx.clip_by_global_norm`:
        a split leaf's share of the total would be counted on every rank). Not with
        ``overlap`` nor inside `sharded`; a checkpoint of a split plan is refused.
      offload_layout, offload_compile: the ``layout`` and ``compile`` of
        `opttx.distributed.offload` for the host chunks.
      device_budget_mb: with ``offload="auto"``, the device memory (MiB) for the state.
      offload_stats: an `opttx.distributed.OffloadStats` for this rank's offload.
      offload_master_params: the ``master_params`` of `opttx.distributed.offload`: each rank
        keeps its host chunks' parameters on the host (float32 for 16-bit parameters) and
        steps them there; the updates it gathers to the other ranks reach the master's values.
        The rank's state is then an `opttx.distributed.OffloadMasterState`; its master copy
        is in checkpoints (optional entries, keyed by parameter: it reshards to another world
        size, and loads into a single-device ``offload(..., master_params=True)``).
      offload_host_group_mb: the ``host_group_mb`` of `opttx.distributed.offload` (with
        ``offload_compile``): consecutive host chunks of a rank in one compiled call.

    ``update(local_grads, state, params)`` takes this rank's unreduced gradients (the full
    tree, plain tensors) and the full replicated ``params``; gradients are cast to the
    parameters' dtype for the reduction and the updates come back in the gradients' dtypes.
    ``extra_args`` reach ``tx``.
    ``init`` checks that every rank passes the same parameter tree (structure, shapes, dtypes,
    and values: one all-gather of an exact checksum of each parameter) and raises the same
    ``ValueError`` on every rank otherwise (a rank may own no parameter: it runs ``tx`` on a
    tree without leaves, which only advances its counters); ``update`` checks the gradients
    against that tree (a trace-time check, free at run time). Every eager ``update`` sends the
    state's step counters along with its first all-gather of updates: a rank whose state
    skipped an update (or took one more) makes every rank raise the same ``ValueError``
    naming the counter. A wrapper around ``zero`` that decides from the local gradients
    (`opttx.apply_if_finite`, `opttx.MultiSteps`) agrees on its decision over ``group``
    first (``zero`` declares it: `opttx.extend.Traits.collective_groups`).

    Returns:
      A `GradientTransformation` whose state is ``tx``'s state over the owned leaves (others
      `MaskedNode`). The plan is resolved by ``init`` (or by the first ``update`` after a
      restore, from the gradients) and kept: use one ``zero`` transform per parameter tree.

    Example:
      >>> tx = opttx.distributed.zero(opttx.chain(opttx.clip_by_global_norm(1.0),
      ...                                         opttx.adamw(1e-3)), dp_group, stage=2)
      >>> state = tx.init(params)                   # the same full params on every rank
      >>> updates, state = tx.update(local_grads, state, params)
      >>> params = opttx.apply_updates(params, updates)

    References:
      Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion Parameter Models
      (arXiv 1910.02054); Fang et al., PatrickStar: Parallel Training of Pre-trained Models via
      Chunk-based Memory Management (arXiv 2108.05818), the chunks of ColossalAI's Gemini.
    """
    cfg = _zero_config(tx, group, stage, chunk_size_mb, offload,
                       min_chunk_size_mb=min_chunk_size_mb, search_range_mb=search_range_mb,
                       balance=balance, stats=stats, communication_dtype=communication_dtype,
                       overlap=overlap, split_above_mb=split_above_mb,
                       offload_layout=offload_layout, offload_compile=offload_compile,
                       device_budget_mb=device_budget_mb, offload_stats=offload_stats,
                       offload_master_params=offload_master_params,
                       offload_host_group_mb=offload_host_group_mb)
    resolved: list[_Resolved] = []
    settings = configuration_items(tx) + [
        (f"zero.{k}", describe_value(v, True)) for k, v in (
            ("stage", stage), ("chunk_size_mb", chunk_size_mb), ("offload", offload),
            ("min_chunk_size_mb", min_chunk_size_mb), ("search_range_mb", search_range_mb),
            ("balance", balance), ("communication_dtype", communication_dtype),
            ("overlap", overlap), ("split_above_mb", split_above_mb),
            ("offload_layout", offload_layout), ("offload_compile", offload_compile),
            ("device_budget_mb", device_budget_mb),
            ("offload_master_params", offload_master_params),
            ("offload_host_group_mb", offload_host_group_mb))]

    def agree() -> None:
        # first of all: a setting that differs across ranks would pair mismatched collectives
        if dist.is_initialized() and dist.get_world_size(cfg.group) > 1:
            require_member(cfg.group, "opttx.distributed.zero")
            agree_on_configuration(settings, cfg.group, collective_device(cfg.group),
                                   "opttx.distributed.zero")
    check = ConsistencyCheck("opttx.distributed.zero")      # off unless the mode is on

    def init(params: Params) -> State:
        agree()
        res = _resolve_at_init(params, cfg)
        if cfg.overlap:
            res = _with_launches(res, params, cfg)
        for old in resolved:                 # a second init: the old hooks go
            if old.launches is not None:
                old.launches.remove()
        if cfg.offload is not None:
            res = _with_offloader(res, params, cfg)
        resolved[:] = [res]
        if res.offloader is not None:
            error, state = None, None
            try:
                state = res.offload_tx.init(_mask(params, res))
            except (ValueError, TypeError) as e:   # a chain refused: on every rank
                error = e
            raise_on_every_rank(error, res.group, "opttx.distributed.zero: rank {rank} "
                                "refused to offload the chain (see its error).")
        elif res.split_reducer is None:
            state = cfg.tx.init(_mask(params, res))
        else:
            with reducer_during_init(res.split_reducer):
                state = cfg.tx.init(_mask(params, res))
        agree_on_state_structure(state, res.group, res.control_device,
                                 "opttx.distributed.zero")
        resolved[:] = [dataclasses.replace(res, counter_paths=common_counter_paths(
            state, res.group))]
        check(params, None, state, res.group, at_init=True)
        # always: every parameter is replicated over the group; one that differs per rank
        # would take the same updates from other values (one all-gather of checksums)
        check_replicated_leaves("opttx.distributed.zero", params,
                                [True] * len(tree_leaves(params)), res.group)
        return state

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        if not resolved:
            require_member(cfg.group, "opttx.distributed.zero")
            agree()
            res = _resolve(updates, cfg, current_reducer(extra_args))
            if cfg.offload is not None:   # a restored state: its owned chunks placed
                res = _with_offloader(res, updates, cfg, adopt=True)
            resolved[:] = [dataclasses.replace(res, counter_paths=common_counter_paths(
                state, res.group))]
        check(params, None, state, resolved[0].group)
        return _zero_update(updates, state, params, extra_args, resolved[0], cfg)

    # its collectives take each rank's own gradients: a wrapper deciding from them
    # (apply_if_finite's skip, MultiSteps' boundary) agrees on the decision over the group
    return GradientTransformation(init, update, Traits(collective_groups=(group,)))


@dataclass(frozen=True, eq=False)
class _ZeroConfig:
    """The static settings of one `zero` transform, validated (plain data)."""
    tx: GradientTransformation
    group: Any                          # as given (None: the default group)
    stage: int
    chunk_size_mb: float | None
    offload: float | str | None         # the offloaded share (None: no offload)
    min_chunk_size_mb: float
    search_range_mb: float
    balance: str
    stats: CollectiveStats | None
    communication_dtype: torch.dtype | None   # on the wire (None: the parameters' dtype)
    overlap: bool                             # gradient reductions started during backward
    split_above_mb: float | None              # leaves split into row segments above this
    offload_layout: str = "leaves"            # offload: the host chunks' layout
    offload_compile: bool = False             # offload: compile the host chunks' update
    device_budget_mb: float | None = None     # offload="auto": the state's device budget
    offload_stats: Any = None                 # offload: an OffloadStats to fill
    offload_master_params: bool = False       # offload: the host chunks' parameters there too
    offload_host_group_mb: float | None = None   # offload: compiled host steps per call


def _zero_config(tx: GradientTransformation, group: Any, stage: int,
                 chunk_size_mb: float | None, offload: bool | float | str, *,
                 min_chunk_size_mb: float,
                 search_range_mb: float, balance: str, stats: CollectiveStats | None,
                 communication_dtype: torch.dtype | None = None, overlap: bool = False,
                 split_above_mb: float | None = None, offload_layout: str = "leaves",
                 offload_compile: bool = False, device_budget_mb: float | None = None,
                 offload_stats: Any = None, offload_master_params: bool = False,
                 offload_host_group_mb: float | None = None) -> _ZeroConfig:
    """Validate `zero`'s arguments into a `_ZeroConfig`."""
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"zero needs a GradientTransformation, got a {type(tx).__name__} (did "
                        "you forget to call the factory?).")
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"zero: stage must be 1 or 2, got {stage!r}.")
    if balance not in ("state", "params"):
        raise ValueError(f"zero: balance must be 'state' or 'params', got {balance!r}.")
    if chunk_size_mb is not None:
        check_positive("chunk_size_mb", chunk_size_mb)
    check_positive("min_chunk_size_mb", min_chunk_size_mb)
    check_nonnegative("search_range_mb", search_range_mb)
    if communication_dtype is not None and (not isinstance(communication_dtype, torch.dtype)
                                            or not communication_dtype.is_floating_point):
        raise ValueError("zero: communication_dtype must be a floating torch.dtype or None, "
                         f"got {communication_dtype!r}.")
    if split_above_mb is not None:
        check_nonnegative("split_above_mb", split_above_mb)
        if overlap:
            raise ValueError("zero: split_above_mb and overlap=True do not go together yet "
                             "(a split parameter's gradient feeds several chunks).")
        if traits_of(tx).across_leaves:
            raise ValueError(
                "zero: split_above_mb with a transform that takes statistics across leaves "
                "(a global norm, Traits.across_leaves) is not supported: every rank holds rows "
                "of a split leaf, so its share of a global total would be counted once per "
                "rank. Split only element-wise, factored and layer-wise chains.")
    share = _offload_share(tx, offload, split_above_mb, offload_layout, device_budget_mb)
    if offload_master_params and share is None:
        raise ValueError("zero: offload_master_params goes with offload (a share of the state "
                         "on the host).")
    if offload_host_group_mb is not None and share is None:
        raise ValueError("zero: offload_host_group_mb goes with offload (a share of the state "
                         "on the host).")
    check_host_group_mb(offload_host_group_mb, offload_compile, False, "zero",
                        "offload_host_group_mb")
    return _ZeroConfig(tx=tx, group=group, stage=stage, chunk_size_mb=chunk_size_mb,
                       offload=share, min_chunk_size_mb=min_chunk_size_mb,
                       search_range_mb=search_range_mb, balance=balance, stats=stats,
                       communication_dtype=communication_dtype, overlap=bool(overlap),
                       split_above_mb=split_above_mb, offload_layout=offload_layout,
                       offload_compile=bool(offload_compile),
                       device_budget_mb=device_budget_mb, offload_stats=offload_stats,
                       offload_master_params=bool(offload_master_params),
                       offload_host_group_mb=offload_host_group_mb)


# ---------------------------------------------------------------------------------------------
# offload: the owned state's chunks on the host (opttx.distributed.offload)
# ---------------------------------------------------------------------------------------------


def _offload_share(tx: GradientTransformation, offload: Any, split_above_mb: float | None,
                   layout: str, device_budget_mb: float | None) -> float | str | None:
    """``offload`` validated: None (off), a share in [0, 1] or ``"auto"``; the chain checked
    for running chunk by chunk."""
    if offload is False or offload is None:
        if device_budget_mb is not None:
            raise ValueError("zero: device_budget_mb goes with offload='auto'.")
        return None
    share = 1.0 if offload is True else validated_fraction(offload, "zero")
    if device_budget_mb is not None:
        check_nonnegative("device_budget_mb", device_budget_mb)
        if share != "auto":
            raise ValueError("zero: device_budget_mb goes with offload='auto'.")
    if split_above_mb is not None:
        raise ValueError("zero: offload and split_above_mb do not go together (a split "
                         "leaf's statistics are reduced over the ranks inside the update).")
    peel_wrappers(tx, layout)      # apply_if_finite, multi_steps: around the chunks
    return share


def _with_offloader(res: _Resolved, tree: PyTree, cfg: _ZeroConfig, adopt: bool = False
                    ) -> _Resolved:
    """``res`` with the offload engine of this rank: one offload chunk per chunk of the plan
    in which this rank owns parameters (its segment), placed by ``cfg.offload``, and the
    transform that runs it (``offload_tx``); ``adopt``: its first run adopts a restored
    state."""
    if res.split_reducer is not None:
        raise ValueError("zero: offload and split_above_mb do not go together.")
    masked = _mask(tree, res)
    owned = [i for i, r in enumerate(res.plan.owners) if r == res.rank]
    index = {leaf: k for k, leaf in enumerate(owned)}     # leaf -> place among owned leaves
    members = [[index[i] for i, _, _ in c.members(res.rank)] for c in res.plan.chunks]
    wrappers, core = peel_wrappers(cfg.tx, cfg.offload_layout)
    engine = Offloader(core, cfg.offload, layout=cfg.offload_layout,
                       compile=cfg.offload_compile, budget_mb=cfg.device_budget_mb,
                       memory_probe=None, where="opttx.distributed.zero",
                       stats=cfg.offload_stats, master_params=cfg.offload_master_params,
                       host_group_mb=cfg.offload_host_group_mb)
    engine.resolve(masked, members=[m for m in members if m],
                   costs=state_costs(core, masked))
    # the chunks' run inside the wrappers peeled off tx: apply_if_finite's skip is decided
    # once over every chunk, and over the group through the statistics hook
    running = inside_wrappers(wrappers, core, lambda: engine, [adopt])
    return dataclasses.replace(res, offloader=engine, offload_tx=running)


def _resolve(tree: PyTree, cfg: _ZeroConfig, reducer: Any = None) -> _Resolved:
    """The plan and the group's coordinates for this parameter (or gradient) tree; inside
    `opttx.distributed.sharded` (``reducer``), owners decided on the global shapes."""
    g = cfg.group if cfg.group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    sizes = dict(min_chunk_size_mb=cfg.min_chunk_size_mb, search_range_mb=cfg.search_range_mb)
    owners = None
    shapes = None if reducer is None else reducer.global_shapes_of(tree)
    if shapes is not None:
        # the ranks of a tensor-parallel group hold shards of the same parameters, perhaps of
        # different sizes: they must own the same ones, so owners come from the global shapes
        leaves, treespec = tree_flatten(tree)
        whole = tree_unflatten([torch.empty(s, dtype=x.dtype, device="meta")
                                for s, x in zip(shapes, leaves)], treespec)
        costs = state_costs(cfg.tx, whole) if cfg.balance == "state" else None
        owners = zero_plan(whole, world, cfg.chunk_size_mb, costs=costs, **sizes).owners
    costs = state_costs(cfg.tx, tree) if cfg.balance == "state" and owners is None else None
    plan = zero_plan(tree, world, cfg.chunk_size_mb, costs=costs, owners=owners,
                     split_above_mb=cfg.split_above_mb,
                     split_block_rows=traits_of(cfg.tx).block_rows, **sizes)
    leaves, treespec = tree_flatten(tree)
    split_reducer = None
    if plan.units:
        if reducer is not None:
            raise ValueError("zero: split_above_mb inside opttx.distributed.sharded is not "
                             "supported (the split leaves' statistics would need both groups).")
        split = set(plan.split_leaves)
        split_reducer = ShardedReducer(
            treespec, [(Shard(0, g),) if i in split else () for i in range(len(leaves))], [g],
            cfg.stats, ndims=[x.ndim for x in leaves])
        split_reducer.global_shapes = [tuple(x.shape) for x in leaves]
        starts: list[int | None] = [None] * len(leaves)
        for k, (i, a, _) in enumerate(plan.units):
            if a >= 0 and plan.owners[k] == rank:
                starts[i] = a
        split_reducer.row_starts = starts
    return _Resolved(plan, treespec, g, rank, world, collective_device(g),
                     leaf_shapes=tuple(tuple(x.shape) for x in leaves),
                     leaf_paths=tuple(tree_paths(tree)), split_reducer=split_reducer)


def _resolve_at_init(params: Params, cfg: _ZeroConfig) -> _Resolved:
    """`_resolve` at init, with the ranks agreeing on the tree: an error on one rank is
    raised on every rank, and different trees on different ranks are refused."""
    # before any collective on the group: the ranks of the group go on without this one
    require_member(cfg.group, "opttx.distributed.zero")
    error, res = None, None
    try:
        res = _resolve(params, cfg, current_reducer())
    except (ValueError, TypeError) as e:
        error = e
    g = cfg.group if cfg.group is not None else dist.group.WORLD
    # one rank's bad tree must not leave the others hanging
    raise_on_every_rank(error, g, "opttx.distributed.zero: rank {rank} rejected its parameter "
                                  "tree at init (see its error); no rank went on.")
    agree_on_tree(params, g, res.control_device,
                  "opttx.distributed.zero: the ranks passed different parameter trees to "
                  "init (structure, shapes or dtypes); every rank must pass the same full "
                  "(replicated) parameter tree.")
    return res


def _mask(tree: PyTree, res: _Resolved) -> PyTree:
    """``tree`` with the leaves other ranks own replaced by `MaskedNode` (of a split leaf,
    this rank's rows)."""
    units = res.to_units(res.treespec.flatten_up_to(tree))
    return tree_unflatten([units[k] if res.plan.owners[k] == res.rank else MaskedNode()
                           for k in res.unit_of_leaf()], res.treespec)


def _check_tree(tree: PyTree, res: _Resolved, what: str) -> list[torch.Tensor]:
    """The leaves of ``tree``, checked against the structure and shapes given to init."""
    leaves, treespec = tree_flatten(tree)
    if treespec != res.treespec:
        template = tree_unflatten([0] * len(res.leaf_shapes), res.treespec)
        assert_same_structure(tree, template, f"{what} and the params given to zero's init")
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != res.leaf_shapes[i]:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"opttx.distributed.zero: {what}{res.leaf_paths[i]} has shape "
                             f"{got}, but the parameter given to init has shape "
                             f"{res.leaf_shapes[i]}.")
    return leaves


def _zero_update(updates: Updates, state: State, params: Params | None,
                 extra_args: dict[str, Any], res: _Resolved, cfg: _ZeroConfig
                 ) -> tuple[Updates, State]:
    """One step of `zero`: reduce the gradients, the owners' update, gather the updates."""
    if res.launches is not None and not is_tracing():
        # overlap: which chunks launched in backward stand, agreed on every rank (a missing
        # gradient on one rank raises on every rank here, before the tree checks)
        res.launches.settle(tree_leaves(updates))
    grads = _check_tree(updates, res, "updates")
    if params is not None:
        _check_tree(params, res, "params")
    device = grads[0].device if grads else res.control_device
    counters = _step_counters(state, res, cfg, device)     # read before the state changes
    owned = _reduce_gradients(res.to_units(grads), res, cfg, device)
    new_of, new_state = _owners_update(owned, state, params, extra_args, res, cfg, device)
    out = _gather_updates(new_of, grads, res, cfg, device, counters)
    return tree_unflatten(out, res.treespec), new_state


def _step_counters(state: State, res: _Resolved, cfg: _ZeroConfig, device: torch.device
                   ) -> tuple[StepCounters, torch.Tensor] | None:
    """The state's step counters and their values as they travel with the first all-gather
    of updates (in its dtype), so that every rank compares every rank's (`StepCounters`);
    None in a compiled step, on one rank, or without counters or chunks to carry them."""
    if is_tracing() or res.world == 1:
        return None
    first = next((c for c in res.plan.chunks if c.segment), None)
    counters = StepCounters("opttx.distributed.zero", state, res.counter_paths)
    if first is None or not counters:
        return None
    return counters, counters.tail(cfg.communication_dtype or first.dtype, device)


def _reduce_gradients(grads: list[torch.Tensor], res: _Resolved, cfg: _ZeroConfig,
                      device: torch.device) -> list[Any]:
    """The mean gradients this rank owns (views of its segment of each reduced chunk),
    `MaskedNode` for the others: a reduce-scatter per chunk (stage 2) or an all-reduce; taken
    from backward where ``overlap`` started it there."""
    plan, rank = res.plan, res.rank
    launches = None if is_tracing() else res.launches
    owned: list[Any] = [MaskedNode()] * len(grads)
    for k, c in enumerate(plan.chunks):
        mine = c.members(rank)
        if c.segment == 0:         # only empty parameters: nothing to communicate
            for i, _, _ in mine:
                owned[i] = grads[i].to(c.dtype)
            continue
        seg = None if launches is None else launches.take(k, [grads[i] for i in c.leaves])
        if seg is None:            # issued after those launched in backward, on every rank
            flat = _flat_with_gaps([(grads[i], off) for i, off in zip(c.leaves, c.offsets)],
                                   c.numel, cfg.communication_dtype or c.dtype, device)
            if cfg.stats is not None:
                cfg.stats.record(res.group, flat)
            if cfg.stage == 2:
                seg = funcol.wait_tensor(_reduce_scatter(flat, "sum", 0, res.group))
            else:
                full = funcol.wait_tensor(funcol.all_reduce(flat, "sum", res.group))
                seg = full[rank * c.segment:(rank + 1) * c.segment]
            seg = seg.to(c.dtype) / res.world
        for i, off, n in mine:
            owned[i] = seg[off:off + n].view(plan.shapes[i])
            if is_tracing():       # views of one buffer: torch.cond (apply_if_finite,
                owned[i] = owned[i].clone()   # MultiSteps inside) refuses aliased operands
    return owned


def _with_launches(res: _Resolved, params: Params, cfg: _ZeroConfig) -> _Resolved:
    """``res`` with hooks on the parameters that start each chunk's reduction in backward."""
    leaves = tree_leaves(params)
    if not BackwardLaunches.hookable(leaves):
        raise ValueError("zero(overlap=True): init needs the model's parameters themselves "
                         "(leaf tensors that require grad, e.g. dict(model.named_parameters())) "
                         "to hook their gradients; it got detached copies, local shards or "
                         "tensors without grad.")
    chunks = [c for c in res.plan.chunks]

    def launch(k: int, grads: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
        c = chunks[k]
        flat = _flat_with_gaps([(g, off) for g, off in zip(grads, c.offsets)], c.numel,
                               cfg.communication_dtype or c.dtype, grads[0].device)
        if cfg.stats is not None:
            cfg.stats.record(res.group, flat)
        if cfg.stage == 2:
            out = flat.new_empty(c.segment)
            work = _reduce_scatter_async(out, flat, group=res.group, async_op=True)
        else:
            out, work = flat, dist.all_reduce(flat, group=res.group, async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            seg = out if cfg.stage == 2 else out[res.rank * c.segment:(res.rank + 1) * c.segment]
            return seg.to(c.dtype) / res.world
        return wait

    groups = [list(c.leaves) if c.segment else [] for c in chunks]
    return dataclasses.replace(res, launches=BackwardLaunches(
        leaves, groups, launch, group=res.group, names=res.leaf_paths, stats=cfg.stats))


def _combiner(res: _Resolved, stats: CollectiveStats | None,
              outer: Callable[..., torch.Tensor] | None = None) -> Callable[..., torch.Tensor]:
    """The ``TOTALS_KEY`` hook: a statistic across leaves all-reduced over the group, then
    passed to the ``outer`` hook of an enclosing wrapper (if any)."""
    def combine(total: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in ("sum", "max"):
            raise ValueError(f"reduce_across_leaves: op must be 'sum' or 'max', got {op!r}.")
        buf = total.reshape(-1).to(res.control_device)   # one total, or several stacked
        if stats is not None:
            stats.record(res.group, buf)
        out = funcol.wait_tensor(funcol.all_reduce(buf, op, res.group))
        out = out.reshape(total.shape).to(total.device)
        return out if outer is None else outer(out, op=op)
    return combine


def _owners_update(owned: list[Any], state: State, params: Params | None,
                   extra_args: dict[str, Any], res: _Resolved, cfg: _ZeroConfig,
                   device: torch.device) -> tuple[dict[int, torch.Tensor], State]:
    """``tx`` on the owned whole leaves (others masked), chunk by chunk where they live when
    offloaded; returns the update of every owned leaf (by index) and the state."""
    # a sharded reducer (zero inside `sharded`: tensor parallel x ZeRO) goes on to tx, which
    # sees the local shards of the leaves it owns; statistics across leaves are combined over
    # the data-parallel group, then by an enclosing combiner's group
    inner_args = dict(extra_args)
    inner_args[TOTALS_KEY] = _combiner(res, cfg.stats, extra_args.get(TOTALS_KEY))
    if res.split_reducer is not None:     # the rows of split leaves: reduced over the group
        inner_args[REDUCER_KEY] = res.split_reducer
    masked_updates = tree_unflatten([owned[k] for k in res.unit_of_leaf()], res.treespec)
    masked_params = None if params is None else _mask(params, res)
    if res.offloader is not None:
        new, new_state = res.offload_tx.update(masked_updates, state, masked_params,
                                               **inner_args)
    else:
        new, new_state = cfg.tx.update(masked_updates, state, masked_params, **inner_args)
    new_leaves = tree_leaves(new)
    mine_all = res.plan.owned(res.rank)
    if len(new_leaves) != len(mine_all):
        raise ValueError(f"opttx.distributed.zero: the inner transform returned "
                         f"{len(new_leaves)} updates for the {len(mine_all)} leaves this "
                         "rank owns; it must keep the structure of its input.")
    return dict(zip(mine_all, new_leaves)), new_state


def _gather_updates(new_of: dict[int, torch.Tensor], grads: list[torch.Tensor],
                    res: _Resolved, cfg: _ZeroConfig, device: torch.device,
                    counters: tuple[StepCounters, torch.Tensor] | None = None
                    ) -> list[torch.Tensor]:
    """Every leaf's update, in its gradient's dtype: an all-gather of the owners' segments
    per chunk (in ``communication_dtype`` when set); a split leaf's rows concatenated. With
    ``counters`` (`_step_counters`), the first chunk's segments carry each rank's step
    counters after its updates, compared once gathered."""
    plan = res.plan
    leaf_of = [u[0] for u in plan.units] or list(range(len(grads)))
    out: list[Any] = [None] * len(plan.owners)
    for c in plan.chunks:
        if c.segment == 0:
            for i in c.leaves:
                g = grads[leaf_of[i]]
                out[i] = torch.zeros(plan.shapes[i], dtype=g.dtype, device=g.device)
            continue
        seg = _flat_with_gaps([(new_of[i], off) for i, off, _ in c.members(res.rank)],
                              c.segment, cfg.communication_dtype or c.dtype, device)
        extra = 0
        if counters is not None:          # this chunk carries the counters (after each
            extra = counters[1].numel()   # rank's segment), then no other
            seg = torch.cat([seg, counters[1]])
        if cfg.stats is not None:
            cfg.stats.record(res.group, seg)
        full = funcol.wait_tensor(_all_gather(seg, 0, res.group))
        for i, r, off, n in zip(c.leaves, c.owners, c.offsets, c.sizes):
            off += r * extra
            out[i] = full[off:off + n].view(plan.shapes[i]).to(grads[leaf_of[i]].dtype)
            if is_tracing():       # views of one buffer: a torch.cond around zero
                out[i] = out[i].clone()       # (apply_if_finite) refuses aliased outputs
        if counters is not None:
            rows = full.view(res.world, c.segment + extra)[:, c.segment:]
            counters[0].compare(rows, seg.dtype)
            counters = None
    missing = [plan.paths[i] for i, x in enumerate(out) if x is None]
    if missing:                    # static: a plan that skipped a leaf is a bug, not a no-op
        raise ValueError(f"opttx.distributed.zero: {missing[0]} is not covered by any "
                         "chunk of the plan.")
    if not plan.units:
        return out
    rows: list[list[torch.Tensor]] = [[] for _ in grads]
    for (i, _, _), x in zip(plan.units, out):
        rows[i].append(x)
    return [r[0] if len(r) == 1 else torch.cat(r) for r in rows]
