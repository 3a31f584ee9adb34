"""Gradient collectives started during backward: the engine behind ``overlap=True`` of `zero`
and `all_reduce_gradients`.

A `BackwardLaunches` registers a ``register_post_accumulate_grad_hook`` on every parameter of
a set of groups (ZeRO chunks, data-parallel buckets). When backward has accumulated the
gradient of the last parameter of a group, the hook packs the group's gradients and starts its
collective asynchronously (``async_op=True``), so it runs while autograd computes the
gradients of earlier layers. The transform's ``update`` then takes the result of each group
(`BackwardLaunches.take`): it waits on the collective instead of issuing it, and falls back to
the ordinary synchronous path for a group that was not launched (a parameter without a
gradient in that backward) or whose gradients are not the tensors backward left (the caller
passed other tensors: they are reduced as given).

The contract is DDP's: the collectives see the gradients as backward leaves them; change them
inside the chain (clipping, scaling), not between ``backward`` and ``update``. Gradient
accumulation over several backwards runs inside `no_sync` (nothing launched) except for the
last one. Eager only: a compiled ``update`` issues its own collectives.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["BackwardLaunches", "no_sync"]

Wait = Callable[[], Any]
_PAUSED = [0]          # nesting depth of `no_sync` (process-wide: hooks may run on other threads)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Backwards inside this block launch no collective from any `BackwardLaunches` (the
    micro-steps of gradient accumulation before the last, as DDP's ``no_sync``).

    Example:
      >>> model = torch.nn.Linear(4, 2)
      >>> with opttx.distributed.no_sync():           # first micro-batch: launches nothing
      ...     model(torch.randn(3, 4)).square().mean().backward()
      >>> model(torch.randn(3, 4)).square().mean().backward()   # launches the reductions
    """
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


class BackwardLaunches:
    """Start ``launch(group, grads)`` from backward as soon as a group's gradients are ready.

    Args:
      params: the parameters, in the order the groups index them (tensors that require grad
        and are leaves of autograd; others are never launched from backward).
      groups: lists of indices into ``params``; each group is launched once per backward.
      launch: ``launch(group_index, grads) -> wait``: starts the group's collective on its
        gradients and returns a function that waits for it and returns the result.
    """

    def __init__(self, params: Sequence[torch.Tensor], groups: Sequence[Sequence[int]],
                 launch: Callable[[int, list[torch.Tensor]], Wait]) -> None:
        self.params = list(params)
        self.groups = [list(g) for g in groups]
        self.launch = launch
        self.enabled = True
        self._group_of = {i: k for k, g in enumerate(self.groups) for i in g}
        self._arrived: list[set[int]] = [set() for _ in self.groups]
        self._pending: dict[int, tuple[list[torch.Tensor], Wait]] = {}
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self.params)
                         if i in self._group_of and p.requires_grad and p.is_leaf]
        self.launched = 0              # groups launched from backward (for tests and stats)

    @staticmethod
    def hookable(params: Sequence[Any]) -> bool:
        """Whether every tensor of ``params`` can carry a gradient hook (the model's own
        parameters, not detached copies or local shards)."""
        return all(isinstance(p, torch.Tensor) and p.requires_grad and p.is_leaf
                   for p in params)

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self.enabled or _PAUSED[0] or p.grad is None:
                return
            self._end_of_backward_callback()
            k = self._group_of[i]
            self._arrived[k].add(i)
            if len(self._arrived[k]) == len(self.groups[k]):
                self._arrived[k] = set()
                grads = [self.params[j].grad for j in self.groups[k]]
                self._drop(k)               # a launch of an earlier backward, never taken
                self._pending[k] = (grads, self.launch(k, grads))
                self.launched += 1
        return hook

    def _end_of_backward_callback(self) -> None:
        """Forget partly arrived groups at the end of each backward (a parameter without a
        gradient this time leaves its group to the synchronous path)."""
        if not self._queued:
            self._queued = True

            def reset() -> None:
                self._queued = False
                self._arrived = [set() for _ in self.groups]
            torch.autograd.Variable._execution_engine.queue_callback(reset)

    def _drop(self, k: int) -> None:
        entry = self._pending.pop(k, None)
        if entry is not None:
            entry[1]()                      # let it finish: collectives stay paired

    def take(self, k: int, grads: Sequence[torch.Tensor]) -> Any | None:
        """The result of group ``k`` launched from backward on exactly ``grads`` (the same
        tensor objects), else None (the caller reduces ``grads`` itself)."""
        entry = self._pending.pop(k, None)
        if entry is None:
            return None
        launched_on, wait = entry
        result = wait()
        if len(launched_on) != len(grads) or any(a is not b for a, b in
                                                 zip(launched_on, grads)):
            return None
        return result

    def drain(self) -> None:
        """Wait for every launch not taken (before a synchronous path issues its own
        collectives, so that all ranks keep the same order of collectives)."""
        for k in list(self._pending):
            self._drop(k)

    def remove(self) -> None:
        """Remove the hooks (waiting for launches not taken)."""
        self.drain()
        for h in self._handles:
            h.remove()
        self._handles = []
