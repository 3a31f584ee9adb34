"""A checking mode for distributed runs: do the ranks still hold what they must share?

Two faults give no error by themselves, only wrong numbers:

* a leaf that is replicated (`Replicated` under `sharded`, every parameter under `zero`) but
  holds different values on different ranks (initialised from another seed, loaded from
  another checkpoint, or drifted since): each rank goes on with its own values;
* a rank that skips one update (``optimizer.step()`` skipped after a local NaN loss, say) and
  so pairs its next step with the other ranks' current one: under `sharded` its replicated
  leaves and its step counts fall behind the others'.

With the checking mode on, every ``every``-th eager ``update`` of `sharded` and of `zero` (and
their ``init``) gathers from every rank, with one ``all_gather_object``, an exact checksum of
each replicated parameter it is given (the bits of the values, summed as 64-bit integers,
with the sum of their squares) and every step counter of the state (fields declared
`opttx.Role.COUNT`), compares them, and raises the same ``ValueError`` on every rank naming
the first leaf or counter that differs and the ranks' values. A rank that skips an update is
caught at the next check where its replicated leaves or counters differ; one that skips
*every* collective of a step cannot be told apart from a slow one and still hangs the others
until the process group's timeout.

The mode is off by default (the check reads every replicated parameter and talks to every
rank). Turn it on with `consistency_checks` (a context manager), `set_consistency_checks`, or
the environment variable ``OPTTX_CONSISTENCY_CHECKS=k`` (read at import, so it reaches ranks
started by ``torch.multiprocessing``); opttx's own test suite runs with ``k = 1``, and
`opttx.testing.spawn_ranks` turns it on in the ranks it starts. Eager only: a compiled
``update`` is not checked.

Example:
  >>> with opttx.distributed.consistency_checks(every=100):   # checks updates 1, 101, ...
  ...     for step in range(2):
  ...         updates, state = tx.update(grads, state, params)
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .._tracing import is_tracing
from ..base import Role, fields_with_role
from ..tree import PyTree, tree_flatten, tree_paths

__all__ = ["ConsistencyCheck", "consistency_checks", "set_consistency_checks"]


def _from_environment() -> int | None:
    value = os.environ.get("OPTTX_CONSISTENCY_CHECKS", "").strip()
    if not value or value == "0":
        return None
    try:
        every = int(value)
    except ValueError:
        raise ValueError(f"OPTTX_CONSISTENCY_CHECKS={value!r}: expected a positive integer "
                         "(check every that many updates) or 0.") from None
    return every if every > 0 else None


_EVERY: list[int | None] = [_from_environment()]


def set_consistency_checks(every: int | None) -> None:
    """Check the ranks' replicated leaves and step counters every ``every`` updates of
    `sharded` and `zero` (None or 0: never), process-wide."""
    if every is not None and (not isinstance(every, int) or isinstance(every, bool)
                              or every < 0):
        raise ValueError(f"every must be a positive integer, 0 or None, got {every!r}.")
    _EVERY[0] = every or None


@contextlib.contextmanager
def consistency_checks(every: int | None = 1) -> Iterator[None]:
    """Within this block, check every ``every`` updates (see the module docstring)."""
    before = _EVERY[0]
    set_consistency_checks(every)
    try:
        yield
    finally:
        _EVERY[0] = before


def checksum(x: torch.Tensor) -> tuple[int, int]:
    """An exact checksum of the bits of ``x``: the sum of its elements' bit patterns as 64-bit
    integers and the (wrapping) sum of their squares. Any change of one element changes the
    first; the second makes compensating changes of two elements unlikely to cancel."""
    x = x.detach()
    if hasattr(x, "to_local"):                 # a DTensor: this rank's part
        x = x.to_local()
    if x.numel() == 0:
        return 0, 0
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    bits = x.contiguous().view(view).reshape(-1).to(torch.int64)
    return int(bits.sum()), int((bits * bits).sum())


def _counts(state: Any, path: str = "") -> dict[str, int]:
    """Every step counter of ``state`` (a 0-dim tensor in a field declared `Role.COUNT`, at
    any depth), keyed by its path in the state."""
    out: dict[str, int] = {}
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        counters = set(fields_with_role(state, Role.COUNT)) \
            if getattr(type(state), "__roles__", None) is not None else set()
        for name in state._fields:
            x = getattr(state, name)
            if name in counters and isinstance(x, torch.Tensor) and x.ndim == 0:
                out[f"{path}.{name}"] = int(x)
            else:
                out.update(_counts(x, f"{path}.{name}"))
    elif isinstance(state, (tuple, list)):
        for i, x in enumerate(state):
            out.update(_counts(x, f"{path}[{i}]"))
    elif isinstance(state, dict):
        for k, x in state.items():
            out.update(_counts(x, f"{path}[{k!r}]"))
    return out


class ConsistencyCheck:
    """The checking mode's hook of one `sharded` or `zero` transform: call it at the start of
    every eager ``init`` and ``update`` with the parameters, which of them are replicated,
    and the state."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.calls = 0

    def __call__(self, params: PyTree | None,
                 replicated: Callable[[], Sequence[bool]] | None, state: Any,
                 group: Any = None, *, at_init: bool = False) -> None:
        """``replicated()``: which leaves of ``params`` are replicated (None: all); a
        function, evaluated only when a check runs."""
        every = _EVERY[0]
        if (every is None or is_tracing() or not dist.is_initialized()
                or dist.get_world_size(group) == 1):
            return
        if at_init:
            self.calls = 0
        else:
            self.calls += 1
            if (self.calls - 1) % every:
                return
        mine: dict[str, Any] = {"counts": _counts(state) if state is not None else {},
                                "sums": {}}
        if params is not None:
            leaves, _ = tree_flatten(params)
            paths = tree_paths(params)
            flags = replicated() if replicated is not None else [True] * len(leaves)
            mine["sums"] = {p: checksum(x) for p, x, r in zip(paths, leaves, flags)
                            if r and isinstance(x, torch.Tensor)}
        every_rank: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every_rank, mine, group=group)
        when = "init" if at_init else f"update {self.calls}"
        self._compare(every_rank, "sums", when,
                      "the replicated parameter {key} holds different values on different "
                      "ranks (checksums {values}): a replicated leaf must be the same on every "
                      "rank (initialised from the same seed or checkpoint, and updated at "
                      "every step on every rank)")
        self._compare(every_rank, "counts", when,
                      "the step counter {key} of the state differs across the ranks "
                      "({values}): a rank skipped or repeated an update, or loaded another "
                      "checkpoint")

    def _compare(self, every_rank: list[dict], part: str, when: str, text: str) -> None:
        tables = [r[part] for r in every_rank]
        shared = [k for k in tables[0] if all(k in t for t in tables[1:])]
        for key in shared:
            values = [t[key] for t in tables]
            if any(v != values[0] for v in values[1:]):
                shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                raise ValueError(f"{self.who}: consistency check at {when}: "
                                 + text.format(key=key or "<root>", values=shown) + ".")
