"""Gradient collectives started during backward: the engine behind ``overlap=True`` of `zero`
and `all_reduce_gradients`.

A `BackwardLaunches` registers a ``register_post_accumulate_grad_hook`` on every parameter of
a set of groups (ZeRO chunks, data-parallel buckets). When backward has accumulated the
gradient of the last parameter of a group, the hook packs the group's gradients and starts its
collective asynchronously (``async_op=True``), so it runs while autograd computes the
gradients of earlier layers. Every rank starts the groups in the same fixed order (the last
group first; a group that is ready early waits for those before it), and at the end of each
backward starts the groups that are still missing, so every rank has issued the same
collectives in the same order whatever its backward did.

The transform's ``update`` first agrees with the other ranks (`BackwardLaunches.settle`, one
all-reduce of one integer per group and per parameter) on which results stand: a group's
result is taken (`BackwardLaunches.take`) only where every rank launched it on exactly the
tensors ``update`` got, unmodified since (same tensor objects, same version counters); every
other group is reduced again synchronously on every rank, so gradients modified in place
between ``backward`` and ``update`` (``clip_grad_norm_``) or other tensors passed to
``update`` give the same numbers as without overlap, at the cost of a second reduction. A
parameter that got no gradient on some ranks but one on others raises a ``ValueError``
naming it on every rank (its reduction would pair unrelated gradients).

Gradient accumulation over several backwards runs inside `no_sync` (nothing launched) except
for the last one. Eager only: a compiled ``update`` issues its own collectives. What is not
covered: a rank whose backward reached no hooked parameter at all (it launches nothing while
the others launch every group) still mismatches the collectives.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

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

    Every rank launches the groups in one fixed order (the last group first, as backward
    reaches the last layers first): a group whose gradients are ready waits for those before
    it in that order (DDP's rule), so the ranks issue their collectives in the same order
    even where their backwards run in different orders. At the end of each backward the
    groups not launched yet are launched too, with zeros for the gradients that are missing
    (a parameter unused in this backward), so that every rank has issued every group.

    `settle` (called by ``update`` before it takes any result) agrees across the ranks, with
    one small all-reduce, on which launched results stand: those of a group launched on
    every rank on exactly the tensors ``update`` got, not modified in place since (their
    version counters unchanged: ``clip_grad_norm_`` between backward and ``update`` modifies
    them). Every other group is reduced again, synchronously, on every rank. A parameter that
    got no gradient on some ranks but one on others raises a ``ValueError`` naming it, on
    every rank.

    Args:
      params: the parameters, in the order the groups index them (tensors that require grad
        and are leaves of autograd; others are never launched from backward).
      groups: lists of indices into ``params``; each group is launched once per backward (an
        empty group never).
      launch: ``launch(group_index, grads) -> wait``: starts the group's collective on its
        gradients and returns a function that waits for it and returns the result.
      group: the process group the collectives run on (None: the default group); `settle`'s
        all-reduce runs on it too.
      names: a name for each parameter, for error messages (default ``leaf i``).
      stats: a `CollectiveStats` that counts `settle`'s all-reduce.
    """

    def __init__(self, params: Sequence[torch.Tensor], groups: Sequence[Sequence[int]],
                 launch: Callable[[int, list[torch.Tensor]], Wait], *, group: Any = None,
                 names: Sequence[str] | None = None, stats: Any = None) -> None:
        self.params = list(params)
        self.groups = [list(g) for g in groups]
        self.launch = launch
        self.group = group
        self.names = list(names) if names is not None else [f"leaf {i}"
                                                            for i in range(len(self.params))]
        self.stats = stats
        self.enabled = True
        self._group_of = {i: k for k, g in enumerate(self.groups) for i in g}
        self._order = [k for k in reversed(range(len(self.groups))) if self.groups[k]]
        self._next = 0                 # position in _order of the next group to launch
        self._ready: set[int] = set()  # complete groups waiting for their turn
        self._arrived: list[set[int]] = [set() for _ in self.groups]
        # group -> (the gradients launched, their versions, missing param indices, wait)
        self._pending: dict[int, tuple[list[torch.Tensor], list[int], list[int], Wait]] = {}
        self._settled: dict[int, bool] = {}
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
                self._ready.add(k)
                self._launch_in_order()
        return hook

    def _launch_in_order(self) -> None:
        """Launch the ready groups whose turn has come (all those before them launched)."""
        while self._next < len(self._order) and self._order[self._next] in self._ready:
            k = self._order[self._next]
            self._ready.discard(k)
            self._start(k)
            self._next += 1

    def _start(self, k: int) -> None:
        """Launch group ``k`` on the parameters' current gradients (zeros for a missing one,
        recorded as missing)."""
        missing = [i for i in self.groups[k] if self.params[i].grad is None]
        grads = [self.params[i].grad if self.params[i].grad is not None
                 else torch.zeros_like(self.params[i]) for i in self.groups[k]]
        self._drop(k)                   # a launch of an earlier backward, never taken
        self._pending[k] = (grads, [g._version for g in grads], missing,
                            self.launch(k, grads))
        self.launched += 1

    def _end_of_backward_callback(self) -> None:
        """At the end of each backward: launch, in order, every group not launched yet (a
        parameter without a gradient this time leaves its group incomplete), then forget
        partly arrived groups."""
        if not self._queued:
            self._queued = True

            def finish() -> None:
                self._queued = False
                try:
                    if self.enabled and not _PAUSED[0]:
                        for k in self._order[self._next:]:
                            self._start(k)
                finally:
                    self._next = 0
                    self._ready = set()
                    self._arrived = [set() for _ in self.groups]
            torch.autograd.Variable._execution_engine.queue_callback(finish)

    def _drop(self, k: int) -> None:
        entry = self._pending.pop(k, None)
        if entry is not None:
            entry[3]()                      # let it finish: collectives stay paired

    def settle(self, grads: Sequence[Any], device: torch.device | None = None) -> None:
        """Agree with the other ranks on which launched results `take` may return, for the
        gradients ``grads`` that ``update`` got (one per parameter, in order; a list of
        another length makes every group be reduced again). One all-reduce of
        ``len(groups) + len(params)`` integers; raises on every rank, after every pending
        collective finished, when a parameter got no gradient on some ranks only."""
        n_groups, n_params = len(self.groups), len(self.params)
        same_length = len(grads) == n_params
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        flags = [0] * (n_groups + n_params)
        for k, (launched_on, versions, missing, _) in self._pending.items():
            given = [grads[i] for i in self.groups[k]] if same_length else []
            valid = (len(given) == len(launched_on) and not missing and all(
                a is b and a._version == v for a, b, v in zip(launched_on, given, versions)))
            flags[k] = int(valid)
            for i in missing:
                flags[n_groups + i] = (1 << rank) if world <= 62 else 1
        if device is None:
            device = self.params[0].device if self.params else torch.device("cpu")
        agreed = torch.tensor(flags, dtype=torch.int64, device=device)
        if self.stats is not None:
            self.stats.record(self.group, agreed)
        dist.all_reduce(agreed, group=self.group)
        agreed = agreed.tolist()
        self._settled = {k: agreed[k] == world for k in range(n_groups)}
        unused = [(i, agreed[n_groups + i]) for i in range(n_params)
                  if agreed[n_groups + i] and (agreed[n_groups + i] != (1 << world) - 1
                                               if world <= 62 else agreed[n_groups + i] != world)]
        if unused:
            self.drain()
            raise ValueError(self._unused_message(unused, world))

    def _unused_message(self, unused: list[tuple[int, int]], world: int) -> str:
        i, value = unused[0]
        if world <= 62:
            ranks = [r for r in range(world) if value >> r & 1]
            where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        else:
            where = f"{value} of {world} ranks"
        more = f" (and {len(unused) - 1} more parameters)" if len(unused) > 1 else ""
        return (f"overlap=True: the parameter {self.names[i]}{more} got no gradient in the last "
                f"backward on {where}, but one on the other ranks: their reductions, started "
                "during backward, would pair different gradients. Every rank must use every "
                "parameter in each backward (DDP's rule without find_unused_parameters; a "
                "term 0 * p.sum() in the loss keeps a parameter used), or use overlap=False, "
                "whose reductions start in update and take a missing gradient as zeros "
                "(opttx.Optimizer passes zeros).")

    def take(self, k: int, grads: Sequence[torch.Tensor]) -> Any | None:
        """The result of group ``k`` launched from backward on exactly ``grads`` (the same
        tensor objects, unmodified), as `settle` agreed on every rank, else None (the caller
        reduces ``grads`` itself, as every other rank does). Without `settle` (a caller of
        the older protocol) a result is taken when its tensors are those given, unmodified."""
        entry = self._pending.pop(k, None)
        if entry is None:
            return None
        launched_on, versions, missing, wait = entry
        result = wait()
        if k in self._settled:
            return result if self._settled.pop(k) else None
        if missing or len(launched_on) != len(grads) or any(
                a is not b or a._version != v for a, b, v in zip(launched_on, grads, versions)):
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
