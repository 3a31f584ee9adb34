"""The master copies of `opttx.distributed.offload` with ``master_params``: each host chunk's
parameters kept (float32 for 16-bit parameters) and stepped on the host, as ZeRO-Offload
does; the state that carries them (`OffloadMasterState`) and their buffers, flags and views
(`Masters`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from ..base import Params, Role, State, declare_optional, declare_roles
from ..tree import MaskedNode
from .chunk_state import HOST, ChunkStates, OnChunkStates, flat_view

__all__ = ["Masters", "OffloadMasterState"]


class OffloadMasterState(NamedTuple):
    """The state of `offload` with ``master_params`` (and of `zero` with
    ``offload_master_params``): the transform's state and the master copy of the host chunks'
    parameters. In a checkpoint the transform's entries are named as without offload
    (`Role.SAME_STATE`) and the master's are optional (`opttx.extend.declare_optional`): keyed
    ``"~master"`` and ``"~started"`` on each parameter, skipped by a run without them, and
    set to zeros (not started) in a run that loads a checkpoint without them (or with them for
    fewer parameters: one saved at another fraction)."""
    inner: State            # the transform's state, laid out as without offload
    master: Params          # like params: each host chunk's leaf's master copy (float32 for
    #                         16-bit parameters; views of the chunk's flat buffer), MaskedNode
    #                         for the leaves of device chunks
    started: Params         # like master: a 0-dim bool per leaf, whether its master holds the
    #                         parameter's value (False after init, or after loading a
    #                         checkpoint without it: the next update starts it from the
    #                         parameter)
    __roles__ = declare_roles(inner=Role.SAME_STATE, master=Role.PARAMS_LIKE,
                              started=Role.PER_LEAF_SCALAR)
    __optional__ = declare_optional("master", "started")


# Pickled (a state saved with torch.save) under the module it was first defined in, which
# re-exports it: states saved before it moved here still load with ``weights_only=True``
# (`opttx.register_safe_globals` registers it by that name), and new ones load in either.
OffloadMasterState.__module__ = "opttx.distributed.offload"


class Masters(OnChunkStates):
    """The host chunks' master copies of one offloaded transform (``enabled``: with
    ``master_params``; else its state is the transform's alone): one flat buffer per host
    chunk, the leaves whose master restarts from the parameters (``stale``), and the views
    and flags that the state returned holds (`outer`)."""

    def __init__(self, states: ChunkStates, enabled: bool) -> None:
        self.states = states
        self.enabled = enabled
        self.buffers: dict[int, torch.Tensor] = {}   # host chunk -> its flat master copy
        self.stale: set[int] = set()         # leaves whose master restarts from the params
        self._views: dict[int, tuple[torch.Tensor, tuple, int]] = {}  # buffer, views, address
        self._flag_views: tuple[torch.Tensor, tuple] | None = None  # started: buffer, views
        self.live_outer: Any = None           # the last state, with its master
        self.live_started: Any = None         # and its tree of flags (as `outer` made them)

    def new(self, k: int, zeros: bool = True) -> torch.Tensor:
        """A master buffer for host chunk ``k``: its parameters back to back, float32 for
        16-bit parameters, in (pinned) host memory; zeros (what a checkpoint holds before the
        first step) or uninitialized."""
        c = self.plan.chunks[k]
        dtype = torch.float32 if c.dtype in (torch.float16, torch.bfloat16) else c.dtype
        make = torch.zeros if zeros else torch.empty
        return make(c.numel, dtype=dtype, device=HOST, pin_memory=self.device.type == "cuda")

    def master(self, k: int, p_leaves: list[torch.Tensor]) -> torch.Tensor:
        """Host chunk ``k``'s master copy, started from ``p_leaves`` when the state had none
        (after init, or from a checkpoint without it: `stale`)."""
        c = self.plan.chunks[k]
        master = self.buffers.get(k)
        if master is None:
            master = self.buffers[k] = self.new(k, zeros=False)
            self.stale.update(c.leaves)
        if self.stale:
            for i, off, n in zip(c.leaves, c.offsets, c.sizes):
                if i in self.stale:
                    master[off:off + n].copy_(p_leaves[i].detach().reshape(-1))
                    self.stale.discard(i)
        return master

    def leaf_views(self, k: int, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of host chunk ``k``'s master buffer shaped like its leaves: the same view
        objects as last time for the same buffer (so `take` finds it by identity)."""
        known = self._views.get(k)
        if known is not None and known[0] is buf:
            return known[1]
        c = self.plan.chunks[k]
        views = tuple(buf[off:off + n].view(self.shapes[i])
                      for i, off, n in zip(c.leaves, c.offsets, c.sizes))
        self._views[k] = (buf, views, buf.data_ptr())
        return views

    def flags(self, value: bool, keep: set[int] | None = None) -> torch.Tensor:
        """A new buffer of the per-leaf ``started`` flags (one bool per leaf, in host
        memory), all ``value``; the leaves in ``keep`` the opposite."""
        flags = torch.full((len(self.shapes),), value, dtype=torch.bool)
        if keep:
            flags[sorted(keep)] = not value
        return flags

    def outer(self, inner: Any, flags: torch.Tensor) -> Any:
        """The state ``update`` and ``init`` return: ``inner`` (tx's state) alone, or with
        ``master_params`` an `OffloadMasterState` with the host chunks' master buffers as
        views shaped like their leaves, and their ``started`` flags as views of ``flags``
        (the same view objects as last time for the same buffers)."""
        if not self.enabled:
            return inner
        known = self._flag_views
        if known is None or known[0] is not flags:
            known = self._flag_views = (flags, tuple(flags[i] for i in range(len(self.shapes))))
        master: list[Any] = [MaskedNode()] * len(self.shapes)
        started: list[Any] = [MaskedNode()] * len(self.shapes)
        for k, c in enumerate(self.plan.chunks if self.plan is not None else ()):
            buf = self.buffers.get(k)
            if c.on_host and buf is not None:
                for i, v in zip(c.leaves, self.leaf_views(k, buf)):
                    master[i], started[i] = v, known[1][i]
        outer = OffloadMasterState(inner, self.spec.unflatten(master),
                                   self.spec.unflatten(started))
        self.live_outer, self.live_started = outer, outer.started
        return outer

    def flags_buffer_of(self, outer: "OffloadMasterState | None") -> torch.Tensor | None:
        """The flags buffer whose views are ``outer``'s ``started`` flags (as `outer` made
        them), else None."""
        known = self._flag_views
        if outer is None or known is None:
            return None
        if outer.started is self.live_started:   # the tree `outer` made last: its views
            return known[0]
        given = self.spec.flatten_up_to(outer.started)
        if all(x is v for x, v in zip(given, known[1]) if isinstance(x, torch.Tensor)):
            return known[0]
        return None

    def unstarted(self, outer: "OffloadMasterState", leaves: Sequence[int]) -> list[int]:
        """The ``leaves`` whose master in ``outer`` is absent or not started: one test of the
        flags buffer when ``outer``'s flags are the views `outer` made of it (a load writes
        into them in place), else one per leaf."""
        known = self._flag_views
        if known is not None and outer.started is self.live_started and \
                bool(known[0].all()):
            return []                         # the flags tree `outer` made last, all set
        given = self.spec.flatten_up_to(outer.started)
        if known is not None and all(given[i] is known[1][i] for i in leaves):
            if bool(known[0][list(leaves)].all()):
                return []
        return [i for i in leaves if not isinstance(given[i], torch.Tensor)
                or not bool(given[i])]

    def take(self, outer: "OffloadMasterState | None") -> None:
        """The master copy of ``outer`` (None: a state without one) as the host chunks'
        master buffers: the views' own buffer when they are the views `leaf_views` made
        (identity tests), else gathered into one (in host memory). The leaves whose master
        is missing or not started (``outer.started``) start from the parameters at their
        chunk's next step (`stale`). The state the last ``update`` returned, every flag
        still set (no checkpoint loaded into it since), takes two identity tests and one
        test of the flags buffer."""
        known = self._flag_views
        if outer is not None and outer is self.live_outer and known is not None and \
                outer.started is self.live_started and bool(known[0].all()):
            self.stale = set()                # the state the last update (or init) returned,
            return                            # its masters those buffers, every leaf started
        masters: dict[int, torch.Tensor] = {}
        given = self.spec.flatten_up_to(outer.master) if outer is not None else None
        host = [i for c in self.plan.chunks if c.on_host for i in c.leaves]
        stale = set(host if outer is None else self.unstarted(outer, host))
        for k, c in enumerate(self.plan.chunks):
            if not c.on_host:
                continue
            parts = None if given is None else [given[i] for i in c.leaves]
            buf = None
            if parts is not None and all(isinstance(x, torch.Tensor) for x in parts):
                known = self._views.get(k)
                if known is not None and known[2] == known[0].data_ptr() and \
                        all(x is v for x, v in zip(parts, known[1])):
                    buf = known[0]
                else:
                    dtype = torch.float32 if c.dtype in (torch.float16, torch.bfloat16) \
                        else c.dtype
                    if any(x.dtype != dtype or tuple(x.shape) != self.shapes[i]
                           for x, i in zip(parts, c.leaves)):
                        raise ValueError(
                            f"{self.where}(master_params=True): the state's master copy "
                            f"of chunk {k} is not {dtype} shaped like its parameters.")
                    buf = flat_view(parts, c.numel, c.offsets)
                    if buf.device != HOST or (self.device.type == "cuda"
                                              and not buf.is_pinned()):
                        buf = self.states.host_memory(buf)
            elif parts is not None:               # some of its leaves have no master given
                zeros = self.new(k)
                for x, i, off, n in zip(parts, c.leaves, c.offsets, c.sizes):
                    if isinstance(x, torch.Tensor):
                        zeros[off:off + n].copy_(x.reshape(-1))
                    else:
                        stale.add(i)
                buf = zeros
            if buf is None:
                buf = self.new(k)
                stale.update(c.leaves)
            masters[k] = buf
        # whole, at once: a step started in backward (overlap) runs on the worker thread
        self.buffers, self.stale = masters, stale
