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
`opttx.extend.Role.COUNT`), compares them, and raises the same ``ValueError`` on every rank naming
the first leaf or counter that differs and the ranks' values. A rank that skips an update is
caught at the next check where its replicated leaves or counters differ; one that skips
*every* collective of a step cannot be told apart from a slow one and still hangs the others
until the process group's timeout.

Two checks run always, without the mode (they cost no collective of their own per step):
`sharded` and `zero` compare a checksum of every replicated leaf at ``init`` (one all-gather,
`check_replicated_leaves`), and the state's step counters travel with a collective of every
eager update (`StepCounters`: `zero`'s all-gather of updates, the first all-reduce of
`sharded`'s statistics), so a rank whose state skipped an update, or took one more, is named
on every rank at its next update. What only the mode sees is a rank that leaves out a whole
call of ``update`` (its next call pairs with the others' current one, its counts equal
theirs) and a replicated leaf that drifts after ``init``.

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
import math
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .._tracing import is_tracing
from ..base import Role, fields_with_role
from ..tree import PyTree, tree_flatten, tree_paths

__all__ = ["ConsistencyCheck", "StepCounters", "check_replicated_leaves",
           "common_counter_paths", "consistency_checks", "count_tensors",
           "set_consistency_checks"]


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
    return {k: int(x) for k, x in count_tensors(state, path).items()}


def count_tensors(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    """The step counters of ``state`` (0-dim tensors in fields declared `Role.COUNT`, at any
    depth), keyed by their paths in the state, in a fixed order (the state's)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        counters = set(fields_with_role(state, Role.COUNT)) \
            if getattr(type(state), "__roles__", None) is not None else set()
        for name in state._fields:
            x = getattr(state, name)
            if name in counters and isinstance(x, torch.Tensor) and x.ndim == 0:
                out[f"{path}.{name}"] = x
            else:
                out.update(count_tensors(x, f"{path}.{name}"))
    elif isinstance(state, (tuple, list)):
        for i, x in enumerate(state):
            out.update(count_tensors(x, f"{path}[{i}]"))
    elif isinstance(state, dict):
        for k, x in state.items():
            out.update(count_tensors(x, f"{path}[{k!r}]"))
    return out


# ---------------------------------------------------------------------------------------------
# always on: the ranks' step counters compared at every eager update
# ---------------------------------------------------------------------------------------------


def _exact_bits(dtype: torch.dtype) -> int:
    """``b``: every integer of magnitude up to ``2 ** b`` is exact in ``dtype`` (the
    significand's bits, with the implicit one; 62 for integer dtypes)."""
    if not dtype.is_floating_point:
        return 62
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


class StepCounters:
    """The step counters of a state as they travel with a collective of `sharded` or `zero`,
    so that a rank whose state skipped an update (it called ``update`` but kept its old
    state, or one wrapper skipped on one rank only) or took one more, or that loaded another
    checkpoint, is found at the next update and every rank raises the same ``ValueError``
    naming the counter and each rank's value. Always on in eager code; a compiled update is
    not checked (raising would need a host sync). A rank that leaves out a whole call of
    ``update`` is not seen here: its next call pairs with the others' current one with the
    same counts (see the module docstring).

    ``paths``: the counters to send, those every rank's state holds (`common_counter_paths`,
    agreed at ``init``: under `zero` or `on_owners` a rank's state holds the counters of its
    own leaves' partitions only); a state without one of them sends nothing.

    ``modulus``: the values travel modulo this (a power of two that the collective's dtype
    holds exactly: ``2 ** 8`` in bfloat16), which tells apart ranks that differ by fewer
    steps."""

    def __init__(self, who: str, state: Any, paths: Sequence[str] = ()) -> None:
        self.who = who
        found = count_tensors(state) if state is not None and paths else {}
        self.paths = [p for p in paths if p in found]
        self.values = [found[p] for p in self.paths]
        if len(self.paths) != len(paths):        # not the state the paths were agreed on
            self.paths, self.values = [], []

    def __bool__(self) -> bool:
        return bool(self.values)

    @staticmethod
    def modulus(dtype: torch.dtype) -> int:
        return 2 ** min(_exact_bits(dtype), 31)

    def tail(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The counters modulo `modulus` as a vector in ``dtype`` on ``device``."""
        m = self.modulus(dtype)
        counts = torch.stack([x.detach().to(device=device, dtype=torch.int64)
                              for x in self.values])
        return torch.remainder(counts, m).to(dtype)

    def reduction_tail(self, op: str, dtype: torch.dtype, world: int, device: torch.device
                       ) -> torch.Tensor:
        """The counters as they travel with an all-reduce (``op`` "max" or "sum") in
        ``dtype`` over ``world`` ranks: ``[c, -c]`` for max (the result holds the largest
        and the smallest), ``[c, c * c]`` for sum (equal on every rank exactly when
        ``world * sum(c * c) == sum(c) ** 2``), ``c`` modulo a power of two the sums hold
        exactly in ``dtype``."""
        c = torch.remainder(torch.stack([x.detach().to(device=device, dtype=torch.int64)
                                         for x in self.values]),
                            self._reduction_modulus(op, dtype, world))
        pair = torch.cat([c, -c] if op == "max" else [c, c * c])
        return pair.to(dtype)

    @staticmethod
    def _reduction_modulus(op: str, dtype: torch.dtype, world: int) -> int:
        bits = _exact_bits(dtype)
        if op == "max":
            return 2 ** min(bits, 31)
        return 2 ** max(1, min(15, (bits - max(world - 1, 1).bit_length()) // 2))

    def check_reduced(self, op: str, reduced: torch.Tensor, dtype: torch.dtype,
                      world: int) -> None:
        """``reduced``: the all-reduced `reduction_tail`. Raise when the ranks' counters
        differ (every rank of the group sees the same sums, so every one raises)."""
        values = [int(v) for v in reduced.detach().cpu().tolist()]
        n = len(self.paths)
        for j, path in enumerate(self.paths):
            a, b = values[j], values[n + j]
            same = (a == -b) if op == "max" else (world * b == a * a)
            if not same:
                m = self._reduction_modulus(op, dtype, world)
                mine = int(self.values[j]) % m
                what = (f"from {-b} to {a}" if op == "max" else "not the same on every rank")
                self._raise(path, f"{what} (modulo {m}; this rank: {mine})")

    def _raise(self, path: str, shown: str) -> None:
        raise ValueError(
            f"{self.who}: the ranks' states are at different steps: the step counter "
            f"{path or '<root>'} is {shown}. A rank skipped an update (called update but "
            "kept its old state, or skipped on its own) or took one more, or loaded another "
            "checkpoint; the ranks would go on pairing different steps. Every rank must take "
            "every update: skip bad steps on all ranks together with opttx.apply_if_finite "
            "(it agrees on the skip across the ranks).")

    def compare(self, every_rank: torch.Tensor, dtype: torch.dtype) -> None:
        """``every_rank``: one row per rank, the `tail` each rank sent. Raise on a mismatch
        (every rank reads the same rows, so every rank raises the same error)."""
        rows = [[int(v) for v in row] for row in every_rank.detach().cpu().tolist()]
        for j, path in enumerate(self.paths):
            values = [row[j] for row in rows]
            if any(v != values[0] for v in values[1:]):
                m = self.modulus(dtype)
                shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                self._raise(path, shown + (f" (modulo {m})" if m <= 2 ** 16 else ""))


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


def common_counter_paths(state: Any, group: Any = None) -> tuple[str, ...]:
    """The paths of the step counters (`count_tensors`) that every rank's ``state`` holds, in
    this rank's order (the same on every rank): one ``all_gather_object`` over ``group``
    (None: the default group); every counter on one process."""
    mine = list(count_tensors(state))
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tuple(mine)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    shared = set(every[0]).intersection(*every[1:])
    return tuple(p for p in every[0] if p in shared)


def _checksum_tensor(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`checksum` as a 2-vector (int64) on ``device``, without leaving the device."""
    x = x.detach()
    if hasattr(x, "to_local"):
        x = x.to_local()
    if x.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    bits = x.contiguous().view(view).reshape(-1).to(torch.int64)
    return torch.stack([bits.sum(), (bits * bits).sum()]).to(device)


def check_replicated_leaves(who: str, params: PyTree, replicated: Sequence[bool],
                            group: Any = None) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` (None: the default group) when
    a leaf of ``params`` marked ``replicated`` holds different values on different ranks,
    naming the first such leaf and the ranks that differ: one all-gather of an exact
    checksum of each (`checksum`'s, computed where the leaves live). For ``init``: a
    replicated leaf that differs per rank would get different updates on every rank."""
    if is_tracing() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    leaves, _ = tree_flatten(params)
    paths = tree_paths(params)
    chosen = [i for i, (x, r) in enumerate(zip(leaves, replicated))
              if r and isinstance(x, torch.Tensor)]
    if not chosen:
        return
    import torch.distributed._functional_collectives as funcol
    from .reducer import collective_device
    g = dist.group.WORLD if group is None else group
    device = collective_device(g)
    mine = torch.cat([_checksum_tensor(leaves[i], device) for i in chosen])
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    every = funcol.wait_tensor(gather(mine, 0, g))
    rows = every.view(dist.get_world_size(g), len(chosen), 2).cpu()
    differ = (rows != rows[:1]).any(dim=2).any(dim=0)
    if bool(differ.any()):
        k = int(differ.nonzero()[0])
        first = rows[:, k]
        ranks = [r for r in range(1, rows.shape[0]) if not torch.equal(first[r], first[0])]
        raise ValueError(
            f"{who}: the replicated leaf {paths[chosen[k]]} holds different values on "
            f"different ranks (rank 0 differs from rank(s) {ranks}; {int(differ.sum())} "
            "replicated leaves differ in all): a replicated leaf (Replicated, or a plain "
            "tensor among DTensors) must be the same on every rank, else each rank updates "
            "its own copy and they drift apart. Initialise it from the same seed or "
            "checkpoint on every rank, or broadcast it from one rank "
            "(torch.distributed.broadcast) before init.")
