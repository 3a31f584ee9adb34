"""The engine of `opttx.distributed.offload` (and of `opttx.distributed.zero`'s offload): one
offloaded transform's chunks, placed on the host or the device, and its step (`Offloader`),
put together from its parts: the chunks' states (`opttx.distributed.chunk_state`), the copies
between device and host (`opttx.distributed.staging`), the master copies
(`opttx.distributed.masters`), the host step (`opttx.distributed.host_step`) and the steps run
in the background (`opttx.distributed.scheduling`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .._tracing import is_tracing
from ..base import (EmptyState, GradientTransformation, Params, REDUCER_KEY, State, TOTALS_KEY,
                    Updates, traits_of)
from ..combine import chain_links
from ..kernels import foreach, is_donating
from ..tree import PyTree, tree_flatten, tree_paths, tree_unflatten
from .chunk_plan import zero_plan
from .chunk_state import HOST, ChunkStates, flat_view
from .chunkable import check_offloadable, why_not_chunkable
from .host_step import HostSteps
from .masters import Masters, OffloadMasterState
from .placement import (LEAF_ALIGNMENT_BYTES, OffloadPlan, chunks_of, host_groups,
                        place_chunks, place_plan)
from .scheduling import BackgroundSteps
from .staging import Transfers

__all__ = ["AUTO_MARGIN", "OffloadStats", "Offloader"]

AUTO_MARGIN = 0.1       # "auto": the share of the device's memory left free for fragmentation


@dataclass
class OffloadStats:
    """What an offloaded transform did, counted eagerly (pass one to `offload` or
    `opttx.distributed.zero`'s ``offload_stats``; `reset` between steps to count one).

    Attributes:
      plan: the current placement (set by ``init``, changed by the ``"auto"`` warm-up).
      steps: updates run.
      host_chunk_steps, device_chunk_steps: chunk updates run on the host and the device.
      bytes_to_host: bytes of gradients and parameters copied into host staging buffers.
      bytes_to_device: bytes of host chunks' updates sent back to the device.

    Both count the leaves' bytes: the gaps that align each leaf in a chunk's buffers (under
    64 bytes a leaf, `LEAF_ALIGNMENT_BYTES`) ride along with a buffer's copy uncounted.
      host_seconds: wall time of the host chunks' updates (the CPU's part of a step, without
        the copies).
      started_in_backward: host chunk steps started from backward (``overlap=True``).
    """

    plan: OffloadPlan | None = None
    steps: int = 0
    host_chunk_steps: int = 0
    device_chunk_steps: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    host_seconds: float = 0.0
    started_in_backward: int = 0

    def reset(self) -> None:
        """Zero the counters (the plan stays)."""
        self.steps = self.host_chunk_steps = self.device_chunk_steps = 0
        self.bytes_to_host = self.bytes_to_device = 0
        self.host_seconds = 0.0
        self.started_in_backward = 0


class Offloader:
    """One offloaded transform: its chunks, their placement, maps and buffers. Built by
    ``init`` (or `adopt` for a restored state) of `offload` or of `zero` with ``offload``.
    Its parts: ``states`` (the chunks' states and their maps), ``transfers`` (staging
    buffers and copy streams), ``masters`` (``master_params``' copies), ``steps`` (the host
    step, eager or compiled) and ``background`` (the worker thread: ``overlap``,
    ``delayed``)."""

    def __init__(self, tx: GradientTransformation, fraction: float | str, *, layout: str,
                 compile: bool, budget_mb: float | None,
                 memory_probe: Callable[[], tuple[int, int]] | None, where: str,
                 stats: OffloadStats | None = None, overlap: bool = False,
                 delayed: bool = False, master_params: bool = False,
                 host_group_mb: float | None = None) -> None:
        self.tx = tx
        self.head = check_offloadable(tx, layout)
        self.is_chain = bool(chain_links(tx))
        self.links = chain_links(tx) or (tx,)
        self.fraction = fraction
        self.layout = layout
        self.budget_mb = budget_mb
        self.memory_probe = memory_probe
        self.where = where
        self.warmed_up = fraction != "auto" or budget_mb is not None
        self.overlap, self.delayed = overlap, delayed
        self.master_params = master_params
        self.host_group_mb = host_group_mb    # compiled host steps sharing one call (MiB)
        self.stats = stats if stats is not None else OffloadStats()
        self.states = ChunkStates(tx, layout, where)
        self.transfers = Transfers(self.states, self.stats)
        self.masters = Masters(self.states, master_params)
        self.steps = HostSteps(tx, self.head, compile, self.states, self.transfers,
                               self.masters, self.stats)
        self.background = BackgroundSteps(self.steps, overlap, delayed)

    @property
    def plan(self) -> OffloadPlan | None:
        """The chunks and their placement (None before `resolve`)."""
        return self.states.plan

    @plan.setter
    def plan(self, plan: OffloadPlan) -> None:
        self.states.plan = plan

    @property
    def spec(self) -> Any:
        """The treespec of the tree given to `resolve`."""
        return self.states.spec

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes of its leaves."""
        return self.states.shapes

    @property
    def device(self) -> torch.device:
        """Where the parameters and gradients live."""
        return self.states.device

    def resolve(self, tree: PyTree, members: Sequence[Sequence[int]] | None = None,
                costs: Sequence[float] | None = None, **plan_kwargs: Any) -> None:
        """Plan the chunks of ``tree`` (``members``: the leaf indices of each chunk, decided
        elsewhere, as `zero` does per rank); the maps between the whole state and each
        chunk's are built from the first state (`ChunkStates.build_maps`, on meta tensors:
        nothing allocated)."""
        self.states.resolve(tree)
        self.plan = self._plan_for(tree, members, costs, plan_kwargs)
        self.stats.plan = self.plan

    def hook(self, params: PyTree) -> None:
        """overlap: hooks on ``params`` (the model's own) that start each host chunk's copy
        and step from backward (`BackgroundSteps.hook`)."""
        self.background.hook(params)

    def _plan_for(self, tree: PyTree, members: Sequence[Sequence[int]] | None,
                  costs: Sequence[float] | None, kwargs: dict[str, Any]) -> OffloadPlan:
        leaves = tree_flatten(tree)[0]
        if members is None:
            members = [c.leaves for c in zero_plan(tree, 1, **kwargs).chunks]
        chunks = chunks_of(leaves, members, costs,
                           LEAF_ALIGNMENT_BYTES if self.layout == "leaves" else 0)
        plan = OffloadPlan(tuple(chunks), tuple(tree_paths(tree)), None)
        return place_plan(plan, self.fraction, self.budget_mb)

    def init(self, tree: PyTree) -> State:
        """The transform's state over ``tree`` with each chunk's tensors where the plan puts
        them (host chunks in host memory)."""
        leaves = tree_flatten(tree)[0]
        if not self.plan.chunks:              # no leaf here (a rank of zero that owns none)
            state = self.tx.init(tree)
            self._check_head(state)
            self.states.state_spec = tree_flatten(state)[1]
            return self.masters.outer(state, self.masters.flags(False))
        if self.layout == "flat":
            state = self.states.init_flat(leaves)
        else:
            placed = list(leaves)
            for c in self.plan.chunks:
                if c.on_host:
                    for i in c.leaves:
                        placed[i] = leaves[i].detach().to(HOST)
            state = self.tx.init(self.spec.unflatten(placed))
            self.states.build_maps(state)
        self._check_head(state)
        s_leaves = tree_flatten(state)[0]
        if self.layout != "flat":             # (the flat layout's buffers are pinned whole)
            for k, c in enumerate(self.plan.chunks):
                if c.on_host:
                    for _, j in self.states.maps[k].take:
                        s_leaves[j] = self.states.host_memory(s_leaves[j])
        self._place_shared(s_leaves)
        self.background.live = tree_unflatten(s_leaves, self.states.state_spec)
        if self.master_params:                # allocated now, started at the first update
            for k, c in enumerate(self.plan.chunks):
                if c.on_host:
                    self.masters.buffers[k] = self.masters.new(k)
                    self.masters.stale.update(c.leaves)
        return self.masters.outer(self.background.live, self.masters.flags(False))

    def _check_head(self, state: Any) -> None:
        """The links run on the device before the chunks must keep no state."""
        for j in range(self.head):
            if not isinstance(state[j] if self.is_chain else state, EmptyState):
                what = f"link {j} of the chain" if self.is_chain else "the transform"
                raise ValueError(
                    f"{self.where}: {what} cannot run chunk by chunk: "
                    f"{why_not_chunkable(traits_of(self.links[j]), self.layout)}; and it "
                    f"keeps state ({type(state[j] if self.is_chain else state).__name__}), so "
                    "it cannot run before the chunks either.")

    def _place_shared(self, s_leaves: list[Any]) -> None:
        """Shared tensors (step counts, injected hyperparameters) on the parameters' device."""
        for m in self.states.maps[:1]:
            for _, j in m.shared:
                s_leaves[j] = s_leaves[j].to(self.device)

    def adopt(self, state: State) -> State:
        """Take a state made elsewhere (a restored checkpoint, a state of the transform
        without offload): build the maps from it and move each chunk's tensors where the
        plan puts them. With ``master_params`` the master copy comes along (to host memory)
        when the state has one (an `OffloadMasterState`), else starts from the parameters at
        the next update; without, a master the state has is dropped."""
        outer = state if isinstance(state, OffloadMasterState) else None
        if outer is not None:
            state = outer.inner
        if not self.plan.chunks:
            self._check_head(state)
            self.states.state_spec = tree_flatten(state)[1]
            return self.masters.outer(state, self.masters.flags(False))
        self.states.build_maps(state)
        self._check_head(state)
        s_leaves = tree_flatten(state)[0]
        for k, c in enumerate(self.plan.chunks):
            self._move_chunk(k, s_leaves, HOST if c.on_host else self.device)
        self._place_shared(s_leaves)
        self.background.live = tree_unflatten(s_leaves, self.states.state_spec)
        if not self.master_params:
            return self.background.live
        self.masters.take(outer)              # started: the leaves with a master given
        return self.masters.outer(self.background.live,
                                  self.masters.flags(True, keep=self.masters.stale))

    def _move_chunk(self, k: int, s_leaves: list[Any], device: torch.device) -> None:
        """Chunk ``k``'s state tensors in ``s_leaves`` moved to ``device`` (host memory: pinned
        on CUDA)."""
        m, c = self.states.maps[k], self.plan.chunks[k]
        place = self.states.host_memory if device == HOST else lambda x: x.to(device)
        for _, j in m.take:
            s_leaves[j] = place(s_leaves[j])
        if m.flat:
            moved = list(m.template)
            for pos, parts in m.flat:
                moved[pos] = place(flat_view([s_leaves[j] for j in parts], c.numel))
            self.states.scatter_flat(k, moved, s_leaves)
        if device != HOST:
            # a chunk on the device steps its parameters there
            self.masters.buffers.pop(k, None)

    def _probe(self) -> tuple[int, int] | None:
        """``(peak bytes in use, capacity)`` of the device: ``memory_probe``'s, or CUDA's
        counters (None on another device)."""
        if self.memory_probe is not None:
            return self.memory_probe()
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            return torch.cuda.max_memory_allocated(self.device), props.total_memory
        return None

    def _warm_up(self, s_leaves: list[Any]) -> None:
        """After the first step's forward and backward (all state on the host): the device
        memory left beside the measured peak (less a margin) is the budget for state kept on
        the device; the chunks that fit move there."""
        self.warmed_up = True
        probe = self._probe()
        if probe is None:
            return
        peak, capacity = probe
        budget = max(0, int(capacity * (1 - AUTO_MARGIN)) - int(peak))
        on_host = place_chunks([c.state_bytes for c in self.plan.chunks], budget_bytes=budget)
        for k, (c, h) in enumerate(zip(self.plan.chunks, on_host)):
            if c.on_host and not h:
                self._move_chunk(k, s_leaves, self.device)
        self.plan = self.plan.placed(on_host, budget_bytes=budget)
        self.stats.plan = self.plan

    # --- the step ------------------------------------------------------------------------

    def update(self, updates: Updates, state: State, params: Params | None,
               extra_args: dict[str, Any]) -> tuple[Updates, State]:
        """One step: the head links on every leaf, then every chunk where it lives."""
        if is_tracing():
            raise ValueError(f"{self.where}: offload runs eagerly (its copies, streams and "
                             "host steps are not traced); compile the model's forward and "
                             "backward, and offload(..., compile=True) for the host steps.")
        if extra_args.get(REDUCER_KEY) is not None:
            raise ValueError(f"{self.where}: offload inside opttx.distributed.sharded is not "
                             "supported (the chunks' statistics would need the sharded "
                             "groups on the host).")
        # master_params: the state with its master copy, or the transform's alone (a state
        # of a run without offload: the master starts from the parameters); without, a
        # master copy given along is dropped
        outer = state if isinstance(state, OffloadMasterState) else None
        if outer is not None:
            state = outer.inner
        if not self.plan.chunks:              # no leaf here: only the counters move
            u, new = self.tx.update(updates, state, params, **extra_args)
            return u, self.masters.outer(new, self.masters.flags(False))
        s_leaves, spec = tree_flatten(state)
        if spec != self.states.state_spec:
            raise ValueError(f"{self.where}: the state given to update is not laid out as the "
                             "one init made (was it built by this transform's init?).")
        for j in range(self.head):            # stateless statistics across leaves: first
            link_state = state[j] if self.is_chain else state
            updates, _ = self.links[j].update(updates, link_state, params, **extra_args)
        grads = tree_flatten(updates)[0]
        p_leaves = tree_flatten(params)[0] if params is not None else None
        if self.master_params:
            if p_leaves is None:
                raise ValueError(f"{self.where}(master_params=True): update needs the "
                                 "parameters (params=...), to start the master copy from "
                                 "them and to return the updates that reach its values.")
            self.masters.take(outer)          # its master, or a restart from the params
        if not self.warmed_up:
            self._warm_up(s_leaves)
        extra = {k: v for k, v in extra_args.items() if k not in (TOTALS_KEY, REDUCER_KEY)}
        out, new_states, values = self._step_chunks(grads, state, s_leaves, p_leaves, extra)
        return self._finish(out, new_states, values, s_leaves, p_leaves, extra, outer)

    def _step_chunks(self, grads: list[torch.Tensor], state: Any, s_leaves: list[Any],
                     p_leaves: list[torch.Tensor] | None, extra: dict[str, Any]
                     ) -> tuple[list[Any], dict[int, Any], dict[int, torch.Tensor]]:
        """Every chunk's step: ``(out, new_states, values)``, the updates of every leaf (those
        of the host chunks with ``master_params`` still None), each chunk's new state, and
        with ``master_params`` each host chunk's new values on the device."""
        chunks = self.plan.chunks
        host = [k for k, c in enumerate(chunks) if c.on_host]
        background = self.background
        launched = background.take_launched(host, grads, state, s_leaves)
        if self.delayed and (state is not background.live
                             or background.written_since(s_leaves)):
            background.drop_pending()         # another state than ours: start afresh from it
        # delayed: the steps started last time are done before their buffers are refilled
        joined = background.joined(host)
        # the host chunks' copies start first; the whole state is only read until the end
        staged = {k: self.transfers.stage(k, grads, None if self.master_params else p_leaves,
                                          s_leaves) for k in host if k not in launched}
        values: dict[int, torch.Tensor] = {}      # master_params: new values on the device
        out: list[Any] = [None] * len(grads)
        new_states: dict[int, Any] = {}
        for k, c in enumerate(chunks):                # the device's chunks are queued
            if not c.on_host:
                new_states[k] = self._device_step(k, grads, s_leaves, p_leaves, extra, out)
        groups = {} if self.host_group_mb is None else host_groups(
            chunks, [k for k in host if k not in launched], self.host_group_mb)
        for k in host:                                # each host chunk as its copy lands
            group = groups.get(k)
            if group is not None and len(group) > 1:
                if k == group[0]:                     # host_group_mb: with its group
                    self.steps.group_step(group, staged, s_leaves, p_leaves, extra,
                                          new_states, values, out)
                continue
            if k in launched and self.master_params:
                values[k], new_states[k] = self._take_master_step(k, launched[k])
                continue
            if k in launched:
                u, new_states[k] = launched[k]
            elif self.delayed:
                u, new_states[k] = background.delayed_step(k, staged[k], s_leaves, extra, grads,
                                                           joined.get(k))
            elif self.master_params:
                values[k], new_states[k] = self._host_master_step(k, staged[k], s_leaves,
                                                                  p_leaves, extra)
                continue
            else:
                u, new_states[k] = self._host_step(k, staged[k], s_leaves, extra)
            self.states.scatter_updates(k, u, out)
        self.stats.steps += 1
        return out, new_states, values

    def _device_step(self, k: int, grads: list[torch.Tensor], s_leaves: list[Any],
                     p_leaves: list[torch.Tensor] | None, extra: dict[str, Any],
                     out: list[Any]) -> Any:
        """Device chunk ``k``'s step, queued on the device: its updates into ``out``; returns
        its new state."""
        c = self.plan.chunks[k]
        g = self.states.chunk_tree(k, [grads[i] for i in c.leaves])
        p = None if p_leaves is None else self.states.chunk_tree(
            k, [p_leaves[i] for i in c.leaves])
        u, new = self.steps.run(g, self.states.chunk_state(k, s_leaves, None), p, extra)
        self.stats.device_chunk_steps += 1
        self.states.scatter_updates(k, u, out)
        return new

    def _take_master_step(self, k: int, result: tuple[torch.Tensor, Any, torch.Tensor]
                          ) -> tuple[torch.Tensor, Any]:
        """master_params with overlap: host chunk ``k``'s step started in backward taken:
        its new values and state, its new master swapped in."""
        values, new_state, nxt = result
        # the chunk's two master buffers trade places: the new one is the master now (the
        # old one is the next step's second buffer, unless the caller keeps the state it
        # gave: then the next step writes a new one)
        old, self.masters.buffers[k] = self.masters.buffers[k], nxt
        self.transfers.keep(k, "master", old if is_donating() else None)
        self.masters.stale.difference_update(self.plan.chunks[k].leaves)
        return values, new_state

    def _host_master_step(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
                          p_leaves: list[torch.Tensor], extra: dict[str, Any]
                          ) -> tuple[torch.Tensor, Any]:
        """master_params: host chunk ``k``'s step once its copies landed; its new values (on
        the device) and state."""
        g, _, shared = self.transfers.wait_staged(k, staged)
        start = time.perf_counter()
        new_values, new_state = self.steps.master_step(
            k, g, self.states.chunk_state(k, s_leaves, shared), p_leaves, extra)
        self.stats.host_seconds += time.perf_counter() - start
        return self.transfers.send_values(k, new_values), new_state

    def _host_step(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
                   extra: dict[str, Any]) -> tuple[PyTree, Any]:
        """Host chunk ``k``'s step once its copies landed; its updates (on the device) and
        new state."""
        g, p, shared = self.transfers.wait_staged(k, staged)
        start = time.perf_counter()
        u, new_state = self.steps.host_run(k, g, self.states.chunk_state(k, s_leaves, shared),
                                           p, extra)
        self.stats.host_seconds += time.perf_counter() - start
        return self.transfers.send(k, u), new_state

    def _finish(self, out: list[Any], new_states: dict[int, Any],
                values: dict[int, torch.Tensor], s_leaves: list[Any],
                p_leaves: list[torch.Tensor] | None, extra: dict[str, Any],
                outer: OffloadMasterState | None) -> tuple[Updates, State]:
        """The chunks' new states written back into the whole state, the updates that reach
        the host chunks' new values (``master_params``), and the state returned."""
        chunks = self.plan.chunks
        written: set[int] = set()                # shared tensors: device chunks' first
        for k in sorted(range(len(chunks)), key=lambda k: chunks[k].on_host):
            self.states.write_back(k, new_states[k], s_leaves, written,
                                   self.transfers.shared_back)
        if any(c.on_host for c in chunks):        # the device waits, not the host
            self.transfers.device_waits()
        if values:                               # master_params: the updates reaching them
            where = [(i, flat[off:off + n].view(self.shapes[i])) for k, flat in values.items()
                     for i, off, n in zip(chunks[k].leaves, chunks[k].offsets, chunks[k].sizes)]
            diffs = foreach("sub", [v for _, v in where], [p_leaves[i] for i, _ in where])
            for (i, _), u in zip(where, diffs):
                out[i] = u
        new_state = tree_unflatten(s_leaves, self.states.state_spec)
        self.background.record(new_state, s_leaves, extra)
        if self.master_params:                # every host leaf's master holds its value
            flags = self.masters.flags_buffer_of(outer) if is_donating() else None
            if flags is not None:
                flags.fill_(True)             # donated: the buffer the flags given view
            else:
                flags = self.masters.flags(True)
            new_state = self.masters.outer(new_state, flags)
        return tree_unflatten(out, self.spec), new_state
