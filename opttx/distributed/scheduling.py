"""The host steps of `opttx.distributed.offload` that run in the background, on one worker
thread: with ``overlap`` each host chunk's step started from backward as soon as its
gradients are in, with ``delayed`` each host chunk's step running behind the next forward and
backward (ZeRO-Offload's one-step delayed update); and the record of the state the last
update returned, which those steps start from (`BackgroundSteps`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..kernels import donating
from ..tree import PyTree, tree_flatten, tree_unflatten
from .host_step import HostSteps
from .overlap import BackwardLaunches

__all__ = ["BackgroundSteps", "tensor_versions"]


def tensor_versions(leaves: list[Any]) -> list[int]:
    """The version counters of the tensors among ``leaves`` (-1 for an inference tensor,
    which has none and cannot be written in place outside inference mode)."""
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(-1 if x.is_inference() else x._version)
    return out


class BackgroundSteps:
    """The worker thread of one offloaded transform and the host chunks' steps it runs (by
    ``steps``): started from backward (``overlap``), or one step behind (``delayed``); and
    ``live``, the state the last update returned, with its tensors' versions."""

    def __init__(self, steps: HostSteps, overlap: bool, delayed: bool) -> None:
        self.steps = steps
        self.states, self.transfers, self.masters = steps.states, steps.transfers, steps.masters
        self.stats = steps.stats
        self.overlap, self.delayed = overlap, delayed
        self._worker: Any = None              # the thread running host steps in background
        self._launches: Any = None            # overlap: the host chunks started in backward
        self._pending: dict[int, Any] = {}    # delayed: each host chunk's step in flight
        self._versions: list[int] | None = None   # delayed, overlap: the last state's versions
        self.live: Any = None                 # the state the last update returned
        self.extra: dict[str, Any] = {}       # the extra args of the last update
        self._stepped: set[int] = set()       # host chunks whose step has compiled (compile)
        self._params: list[torch.Tensor] = []  # overlap: the model's parameters, detached

    def record(self, state: Any, s_leaves: list[Any], extra: dict[str, Any]) -> None:
        """``state`` (its leaves ``s_leaves``) is the one the last update returned, with
        ``extra`` its extra args: the steps started next start from it."""
        self.live, self.extra = state, extra
        if self.delayed or self.overlap:
            self._versions = tensor_versions(s_leaves)

    def joined(self, host: list[int]) -> dict[int, Any]:
        """delayed: the results of the steps started last time, once done (before their
        buffers are refilled)."""
        return {k: self._pending.pop(k).result() for k in host if k in self._pending}

    @property
    def plan(self) -> Any:
        """The chunks' `ChunkStates.plan`."""
        return self.states.plan

    @property
    def where(self) -> Any:
        """The chunks' `ChunkStates.where`."""
        return self.states.where

    @property
    def maps(self) -> Any:
        """The chunks' `ChunkStates.maps`."""
        return self.states.maps

    @property
    def shapes(self) -> Any:
        """The chunks' `ChunkStates.shapes`."""
        return self.states.shapes

    def _background(self) -> Any:
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opttx-offload")
        return self._worker

    def _submit(self, k: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the worker thread (a future). With ``compile``, host chunk ``k``'s
        first step runs here instead, and compiles here: Dynamo's "compiling" flag
        (``torch.compiler.is_compiling``) is one per process, so a compile on the worker
        raises it for the caller's thread too. The library's own branches ask
        `opttx.is_tracing`, which also checks that the thread is traced; the user's
        code (a model's forward that reads the flag) does not."""
        if self.steps.compile and k not in self._stepped:
            from concurrent.futures import Future
            self._stepped.add(k)
            done: Future = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - raised where the result is taken
                done.set_exception(e)
            return done
        return self._background().submit(fn, *args)

    def hook(self, params: PyTree) -> None:
        """overlap: hooks on ``params`` (the model's own) that start each host chunk's copy
        and step from backward."""
        leaves = tree_flatten(params)[0]
        if not BackwardLaunches.hookable(leaves):
            raise ValueError(f"{self.where}(overlap=True): init needs the model's parameters "
                             "themselves (leaf tensors that require grad, e.g. "
                             "dict(model.named_parameters())) to hook their gradients.")
        if self._launches is not None:
            self._launches.remove()
        groups = [list(c.leaves) if c.on_host else [] for c in self.plan.chunks]
        self._params = [x.detach() for x in leaves]
        self._launches = BackwardLaunches(leaves, groups, self._launch)

    def _launch(self, k: int, grads: list[torch.Tensor]) -> Callable[[], Any]:
        """From backward: copy host chunk ``k``'s gradients and parameters to the host and
        start its step on the worker thread, on the state the last update returned."""
        if self.live is None:
            return lambda: None
        s_leaves = tree_flatten(self.live)[0]
        full: list[Any] = [None] * len(self.shapes)
        for i, g in zip(self.plan.chunks[k].leaves, grads):
            full[i] = g
        self.stats.started_in_backward += 1
        # functional: if update does not take this result (other gradients, another state),
        # the state it started from must be intact
        if self.masters.enabled:
            # a checkpoint without a master was loaded?
            if self.masters.live_outer is not None:
                self.masters.stale.update(self.masters.unstarted(
                    self.masters.live_outer, self.plan.chunks[k].leaves))
            master = self.masters.master(k, self._params)
            staged = self.transfers.stage(k, full, None, s_leaves)
            future = self._submit(k, self._job_master, k, staged, s_leaves,
                                  dict(self.extra), master)
        else:
            staged = self.transfers.stage(k, full, self._params, s_leaves)
            future = self._submit(k, self._job, k, staged, s_leaves, dict(self.extra),
                                  False)
        return future.result

    def _job_master(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
                    extra: dict[str, Any], master: torch.Tensor
                    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """master_params with overlap: host chunk ``k``'s step from backward, functionally:
        the new master into the chunk's second master buffer (swapped in when ``update``
        takes the result), its values sent to the device. Returns (the values on the device,
        the new state, the new master)."""
        g, _, shared = self.transfers.wait_staged(k, staged)
        nxt = self.transfers.buffer(k, "master", master.dtype)
        start = time.perf_counter()
        with donating(False):
            values, new = self.steps.master_step(
                k, g, self.states.chunk_state(k, s_leaves, shared), self._params, extra,
                into=nxt, master=master)
        self.stats.host_seconds += time.perf_counter() - start
        return self.transfers.send_values(k, values), new, nxt

    def _job(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
             extra: dict[str, Any], donate: bool, base: Any = None) -> tuple[PyTree, Any]:
        """A host chunk's step off the main thread: wait for its copies, update, send. From
        ``base`` (delayed: the chunk's state from its last step, with its own step counts and
        the other shared tensors, injected hyperparameters, of the state given to update)
        or from the chunk's part of ``s_leaves``."""
        g, p, shared = self.transfers.wait_staged(k, staged)
        if base is None:
            state = self.states.chunk_state(k, s_leaves, shared)
        else:
            leaves, spec = tree_flatten(base)
            for n, (pos, j) in enumerate(self.maps[k].shared):
                if j not in self.states.counts:
                    leaves[pos] = shared[n]
            state = tree_unflatten(leaves, spec)
        start = time.perf_counter()
        with donating(donate):
            u, new = self.steps.host_run(k, g, state, p, extra)
            u = self.transfers.send(k, u)
        self.stats.host_seconds += time.perf_counter() - start
        return u, new

    def take_launched(self, host: list[int], grads: list[torch.Tensor], state: Any,
                      s_leaves: list[Any]) -> dict[int, tuple[PyTree, Any]]:
        """overlap: the results of the host chunks started in backward on this state. None
        when the state is another, or was written in place since the last ``update`` (a
        checkpoint loaded into it: the steps may have started from the replaced values;
        ``update`` then runs those chunks itself)."""
        if self._launches is None:
            return {}
        if state is not self.live or self.written_since(s_leaves):   # dropped
            self._launches.drain()
            return {}
        out = {}
        for k in host:
            got = self._launches.take(k, [grads[i] for i in self.plan.chunks[k].leaves])
            if got is not None:
                out[k] = got
        return out

    def delayed_step(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
                     extra: dict[str, Any], grads: list[torch.Tensor],
                     previous: tuple[PyTree, Any] | None) -> tuple[PyTree, Any]:
        """delayed: the step started last time (``previous``: its updates and state), and
        this step's started in the background from that state, functionally (the state
        returned now is not written by it)."""
        if previous is None:                  # the first step: nothing to apply yet
            c = self.plan.chunks[k]
            u = self.states.chunk_tree(k, [torch.zeros_like(grads[i]) for i in c.leaves])
            state, base = self.states.chunk_state(k, s_leaves, None), None
        else:
            u, state = previous
            base = state
        self._pending[k] = self._submit(k, self._job, k, staged, s_leaves, dict(extra), False,
                                        base)
        return u, state

    def written_since(self, s_leaves: list[Any]) -> bool:
        """Whether a tensor of the state the last ``update`` returned was written in place
        since (`opttx.Optimizer.load_state_dict` copies a checkpoint into the live state):
        its version counter moved. The steps then in flight were started from another
        state, and are dropped as for a state that is not ours. (Before the first update
        nothing is recorded: the steps started then read the state as it is.)"""
        return self._versions is not None and tensor_versions(s_leaves) != self._versions

    def drop_pending(self) -> None:
        """delayed: forget the steps in flight (started from another state), once done."""
        for future in self._pending.values():
            future.result()                   # let it finish: its buffers are in use
        self._pending.clear()
