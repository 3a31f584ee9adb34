"""The host chunks' step of `opttx.distributed.offload`: the transform's update of one chunk
on the CPU, eagerly or compiled by Inductor (the state written in place, the updates into the
chunk's staging buffer, with ``master_params`` the master copy stepped in the same loop), and
with ``host_group_mb`` several chunks' compiled steps in one call (`HostSteps`).
"""

from __future__ import annotations

import time
import types
from typing import Any, Callable, Sequence

import torch

from ..base import GradientTransformation, apply_updates, apply_updates_
from ..combine import chain_links
from ..kernels import CoefficientsFirst, donating, is_donating
from ..tree import PyTree, tree_copy_, tree_flatten, tree_map
from .chunk_state import ChunkStates, OnChunkStates
from .masters import Masters
from .staging import Transfers

__all__ = ["HostSteps", "copy_leaves", "copy_state", "host_compile_options",
           "write_shared_once"]


def host_compile_options() -> dict[str, Any]:
    """Inductor's options for the compiled host step.

    * The C++ compiler may contract a multiply and an add into one fused multiply-add
      (``-ffp-contract=fast``), as DeepSpeed's CPU Adam does with its SIMD FMAs. On a CPU that
      runs out of arithmetic before memory bandwidth (2 cores of a Xeon VM: the loop takes
      twice as long on one thread) AdamW's loop on 96 M parameters goes from 57.6 to
      54.9 ms, DeepSpeed's 55.0 (benchmarks/offload_host_loop.py). The flag was a bool in
      older torch, a string now.
    * `opttx.kernels.CoefficientsFirst` moves every chunk's scalar work (step counts, bias
      corrections) ahead of the element loops, so that with ``host_group_mb`` no Python call
      runs between two chunks' loops with cold caches (benchmarks/offload.py: the grouped
      step 1.063x -> 1.015x DeepSpeed's time, paired round by round), and computes the work
      that a group's chunks repeat on their shared step count once (1.011x -> 0.98x). It
      changes no value."""
    from torch._inductor import config
    options: dict[str, Any] = {"post_grad_custom_pre_pass": CoefficientsFirst()}
    current = getattr(config.cpp, "enable_floating_point_contract_flag", None)
    if current is not None:
        options["cpp.enable_floating_point_contract_flag"] = ("fast" if isinstance(current, str)
                                                              else True)
    return options


# Which leaves to write travel into compiled steps as tuples of bools, one per flat leaf:
# Dynamo takes bools as constants, where a tuple of positions (ints) would become symbolic
# sizes under dynamic=True, and a test like ``i in positions`` on them is not what it reads.


def copy_leaves(dst: PyTree, src: PyTree, which: Sequence[bool]) -> None:
    """The leaves of ``src`` copied into those of ``dst`` where ``which`` (a bool per flat
    leaf) is True."""
    if any(which):
        d, s = tree_flatten(dst)[0], tree_flatten(src)[0]
        tree_copy_([x for x, w in zip(d, which) if w], [x for x, w in zip(s, which) if w])


def copy_state(dst: PyTree, src: PyTree, keep: Sequence[bool]) -> None:
    """``tree_copy_(dst, src)`` but for the leaves where ``keep`` (a bool per flat leaf, or
    empty: none) is True."""
    if any(keep):
        copy_leaves(dst, src, [not k for k in keep])
    else:
        tree_copy_(dst, src)


def write_shared_once(items: list[tuple[Any, ...]], news: list[Any]) -> None:
    """After a group's steps (`HostSteps.group_step`): each item's state (its second
    element) takes the new values of the shared tensors it writes (its last element: a bool
    per leaf) from that chunk's new state."""
    for item, new in zip(items, news):
        copy_leaves(item[1], new, item[-1])


class HostSteps(OnChunkStates):
    """The steps of one offloaded transform's chunks: ``tx`` after its ``head`` links (which
    run on the device over every leaf first), eager or, with ``compile``, compiled for the CPU
    per host chunk (or group of them); the chunks' states, staging buffers and master copies
    come from ``states``, ``transfers`` and ``masters``."""

    def __init__(self, tx: GradientTransformation, head: int, compile: bool,
                 states: ChunkStates, transfers: Transfers, masters: Masters,
                 stats: Any) -> None:
        self.tx = tx
        self.head = head
        self.is_chain = bool(chain_links(tx))
        self.links = chain_links(tx) or (tx,)
        self.compile = compile
        self.states = states
        self.transfers = transfers
        self.masters = masters
        self.stats = stats
        self._compiled: dict[tuple[Any, str], Callable] = {}   # (chunk(s), step) -> compiled

    def run(self, grads: PyTree, state: Any, params: PyTree | None,
            extra: dict[str, Any]) -> tuple[PyTree, Any]:
        """The chunked part of the transform on one chunk: the whole transform, or the links
        after the head."""
        if not self.head:
            return self.tx.update(grads, state, params, **extra)
        if not self.is_chain:                 # a stateless transform: all of it ran before
            return grads, state
        new = list(state)
        for j in range(self.head, len(self.links)):
            grads, new[j] = self.links[j].update(grads, state[j], params, **extra)
        return grads, tuple(new)

    def _in_place(self, grads: PyTree, state: Any, params: PyTree | None,
                  extra: dict[str, Any], out: PyTree, keep: tuple[bool, ...] = ()) -> Any:
        """The compiled host step: the new state into the old buffers and the updates into
        ``out`` (the chunk's staging buffer), so nothing is allocated per step. The state's
        leaves where ``keep`` (a bool per leaf) is True are not written; the new state is
        then returned (for the caller to write them)."""
        u, new = self.run(grads, state, params, extra)
        copy_state(state, new, keep)
        tree_copy_(out, u)
        return new if any(keep) else None

    def host_run(self, k: int, grads: PyTree, state: Any, params: PyTree | None,
                 extra: dict[str, Any]) -> tuple[PyTree, Any]:
        """Host chunk ``k``'s update: eager, or compiled for the CPU (the state written in
        place, a copy of it unless the caller donates it; the updates into the chunk's
        staging buffer)."""
        if not self.compile:
            self.stats.host_chunk_steps += 1
            return self.run(grads, state, params, extra)
        args, out = self.in_place_args(k, grads, state, params)
        self.compiled_step(k, self._in_place)(*args[:3], extra, args[3])
        return out, args[1]

    def in_place_args(self, k: int, grads: PyTree, state: Any, params: PyTree | None,
                      clones: dict[int, torch.Tensor] | None = None
                      ) -> tuple[tuple[Any, ...], PyTree]:
        """Host chunk ``k``'s compiled step, prepared: the arguments of `_in_place` but
        ``extra`` (gradients, a state it may write, parameters, out), and ``out``: the
        chunk's staging buffer its updates land in. ``clones``: as `_writable`'s."""
        self.stats.host_chunk_steps += 1
        state = self._writable(state, clones)
        dtype = tree_flatten(grads)[0][0].dtype
        out = self.states.as_chunk(k, self.transfers.updates_buffer(k, dtype))
        return (grads, state, params, out), out

    def group_step(self, group: list[int], staged: dict[int, tuple[Any, ...]],
                   s_leaves: list[Any], p_leaves: list[torch.Tensor] | None,
                   extra: dict[str, Any], new_states: dict[int, Any],
                   values: dict[int, torch.Tensor], out: list[Any]) -> None:
        """The host chunks ``group`` stepped by one compiled call, once all their copies have
        landed: their loops run back to back, with no Python between them. (After a loop
        over tens of MB, the caches hold the loop's data and not the interpreter's: the next
        compiled call's Python then takes about 0.3 ms, against 0.04 ms warm;
        benchmarks/offload_host_loop.py.) Each chunk's step is the one it takes alone. The
        chunks' scalar work (their bias corrections, through `opttx.kernels.coefficient`'s
        opaque op) would follow the previous chunk's loop, as traced: the compile options'
        `opttx.kernels.CoefficientsFirst` moves all of it ahead of the first loop.

        The group's chunks share one copy of each shared tensor (a step count), which every
        chunk's step reads as it was and which the first chunk holding it writes after all
        of them (`_master_updates`): what each chunk's step alone reads and the write-back
        keeps. The steps run functionally inside the call (their new state then copied into
        the buffers, which Inductor folds into the loops), so no step writes that copy.
        Their scalar work then reads one input, and the same compile pass computes it once
        for the group (`opttx.kernels.merge_coefficients`: AdamW's 2 opaque calls per group
        instead of 2 per chunk; the grouped step of benchmarks/offload.py went from 1.011x
        to 0.98x DeepSpeed's time, paired)."""
        waited = {k: self.transfers.wait_staged(k, staged[k]) for k in group}
        start = time.perf_counter()
        items, results = [], []
        copies: dict[int, torch.Tensor] = {}       # whole-state position -> the group's copy
        clones: dict[int, torch.Tensor] = {}       # _writable's, by the tensor's id
        for k in group:
            g, p, shared = waited[k]
            m = self.maps[k]
            keep, first = [False] * len(m.template), [False] * len(m.template)
            for n, (pos, j) in enumerate(m.shared):
                if j not in copies:
                    copies[j] = s_leaves[j].clone() if shared is None else shared[n]
                    first[pos] = True
                keep[pos] = True
            state = self.states.chunk_state(k, s_leaves, [copies[j] for _, j in m.shared])
            if self.masters.enabled:
                args, result = self.master_args(k, g, state, p_leaves, None, clones=clones)
            else:
                args, result = self.in_place_args(k, g, state, p, clones=clones)
            items.append((*args, tuple(keep), tuple(first)))
            results.append(result)
        method = self._master_updates if self.masters.enabled else self._in_places
        with donating(False):       # no chunk's step writes the copies the next one reads
            self.compiled_step(tuple(group), method)(items, extra)
        self.stats.host_seconds += time.perf_counter() - start
        for k, args, result in zip(group, items, results):
            new_states[k] = args[1]
            if self.masters.enabled:
                values[k] = self.transfers.send_values(k, result)
            else:
                self.states.scatter_updates(k, self.transfers.send(k, result), out)

    def _master_updates(self, items: list[tuple[Any, ...]], extra: dict[str, Any]) -> None:
        """`_master_update` of several host chunks, in place (one compiled call). Each item
        ends with two bools per leaf of the chunk's state: whether it is a shared tensor
        (one per group, not written by the chunk's step), and whether the chunk writes it
        once all the steps have read it (`group_step`)."""
        write_shared_once(items, [
            self._master_update(grads, state, params, extra, into, out, True, shared)
            for grads, state, params, into, out, shared, _ in items])

    def _in_places(self, items: list[tuple[Any, ...]], extra: dict[str, Any]) -> None:
        """`_in_place` of several host chunks (one compiled call); the shared tensors as in
        `_master_updates`."""
        write_shared_once(items, [self._in_place(grads, state, params, extra, out, shared)
                                  for grads, state, params, out, shared, _ in items])

    def master_step(self, k: int, grads: PyTree, state: Any, p_leaves: list[torch.Tensor],
                    extra: dict[str, Any], into: torch.Tensor | None = None,
                    master: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Host chunk ``k``'s update added to its master copy (``master``, else `Masters.master`),
        in place, or into ``into`` (the chunk's second master buffer: the master itself is
        only read), in the same compiled loop with ``compile``; returns the chunk's new
        parameter values (the new master, or its cast to the parameters' dtype in a staging
        buffer) and new state."""
        args, values = self.master_args(k, grads, state, p_leaves, into, master)
        if self.compile:
            self.compiled_step(k, self._master_update)(*args[:3], extra, *args[3:], True)
            return values, args[1]
        return values, self._master_update(*args[:3], extra, *args[3:], False)

    def master_args(self, k: int, grads: PyTree, state: Any, p_leaves: list[torch.Tensor],
                    into: torch.Tensor | None, master: torch.Tensor | None = None,
                    clones: dict[int, torch.Tensor] | None = None
                    ) -> tuple[tuple[Any, ...], torch.Tensor]:
        """Host chunk ``k``'s master step, prepared: the arguments of `_master_update` but
        ``extra`` and ``state_in_place`` (gradients, state, master, into, out; with
        ``compile`` a state it may write), and the buffer its new values land in. From
        ``master`` when given (a step on the worker thread, which must not read the
        engine's dicts that ``update`` rebuilds meanwhile), else from `Masters.master`.
        ``clones``: as `_writable`'s."""
        self.stats.host_chunk_steps += 1
        c = self.plan.chunks[k]
        if master is None:
            master = self.masters.master(k, p_leaves)
        if into is None and not is_donating():
            # functional: the state given keeps its master; the new one is a new buffer
            into = self.masters.buffers[k] = self.masters.new(k, zeros=False)
        self.transfers.await_sent(k)          # the last step's values have left the buffers
        params = self.states.as_chunk(k, master)
        target = None if into is None else self.states.as_chunk(k, into)
        cast = self.transfers.buffer(k, "values", c.dtype) if master.dtype != c.dtype else None
        out = None if cast is None else self.states.as_chunk(k, cast)
        if self.compile:
            state = self._writable(state, clones)
        values = cast if cast is not None else (master if into is None else into)
        return (grads, state, params, target, out), values

    def _master_update(self, grads: PyTree, state: Any, params: PyTree,
                       extra: dict[str, Any], into: PyTree | None, out: PyTree | None,
                       state_in_place: bool, keep: tuple[bool, ...] = ()) -> Any:
        """The master step: the updates added to the master copy (``params``) in place, or
        into ``into``; the new master cast into ``out`` (16-bit parameters). The new state
        is written into the old buffers with ``state_in_place`` (compiled: one loop that
        reads and writes each byte once, as DeepSpeed's CPU Adam), else returned. 16-bit
        gradients of a float32 master are widened first (in the compiled loop, as they are
        read), so the update the master takes is computed and added in float32, as in
        mixed-precision training, not rounded to the gradients' dtype on the way. With
        ``state_in_place``, the state's leaves where ``keep`` (a bool per leaf) is True are
        not written, and the new state is returned (for the caller to write them)."""
        wide = tree_flatten(params)[0][0].dtype
        grads = tree_map(lambda g: g.to(wide) if isinstance(g, torch.Tensor)
                         and g.dtype != wide and g.is_floating_point() else g, grads)
        u, new = self.run(grads, state, params, extra)
        if state_in_place:
            copy_state(state, new, keep)
        if into is None:
            apply_updates_(params, u)
            into = params
        else:
            tree_copy_(into, apply_updates(params, u))
        if out is not None:
            tree_copy_(out, into)
        # compiled, nothing is returned: a graph output would be one more buffer written
        # per state tensor (the state is already in place)
        return None if state_in_place and not any(keep) else new

    def compiled_step(self, k: int | tuple[int, ...], method: Callable) -> Callable:
        """``method`` compiled for host chunk ``k`` alone, or for a group of them (a tuple;
        ``host_group_mb``), with Inductor on the CPU, under a copy
        of its code object. Dynamo keeps the graphs of one code object together, at most
        ``recompile_limit`` (8) of them; with ``layout="leaves"`` each chunk's tree (its
        masked positions) is a graph of its own, and every offload transform in a process
        adds its own: one code object shared by them failed at the ninth (``fullgraph``).

        Shapes are static with ``layout="leaves"``: its per-leaf transforms read their
        leaves' sizes in Python (Adafactor's factored axes sorted by size, blocks of 8-bit
        states, Shampoo's and GaLore's matrices), which Dynamo does not trace with symbolic
        sizes (31 of the conformance registry's transforms failed to compile so, all traced
        with static shapes). The flat layout's element-wise chains keep dynamic shapes:
        their fused loop ran 4 % faster so (benchmarks/offload.py's grouped step, 40 rounds
        interleaved with DeepSpeedCPUAdam: 0.984 against 1.025 paired), and the chunk's
        step is traced once either way."""
        key = (k, method.__name__)
        if key not in self._compiled:
            fn = method.__func__
            own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                     fn.__defaults__, fn.__closure__)
            self._compiled[key] = torch.compile(types.MethodType(own, self), fullgraph=True,
                                                dynamic=self.layout == "flat",
                                                options=host_compile_options())
        return self._compiled[key]

    def _writable(self, state: Any, clones: dict[int, torch.Tensor] | None = None) -> Any:
        """``state`` for a compiled step that writes it in place: itself when the caller
        donates it, else a copy. ``clones`` (by the tensor's id): a tensor that several
        states share is copied once, and the copies share that copy."""
        if is_donating():
            return state
        clones = {} if clones is None else clones

        def copy(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) not in clones:
                clones[id(x)] = x.clone()
            return clones[id(x)]
        return tree_map(copy, state)
