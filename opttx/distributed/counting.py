r"""`count_collectives()`: count the collectives a block of eager code issues, with the bytes
each rank sends and receives, as the process groups run them.

A ``TorchDispatchMode`` sees every functional collective (``torch.distributed.
_functional_collectives``, which opttx's distributed wrappers and ``torch.compile``'s eager
fallbacks issue) and the c10d ops behind ``torch.distributed.all_reduce`` and friends,
however a module bound them. Per call it records the kind, the group size :math:`W` and the
bytes this rank sends and receives, by the algorithm the cost model assumes
(`opttx.distributed.cost_model`):

=================  ==================================  =====================================
collective         sent by this rank                   received by this rank
=================  ==================================  =====================================
all_to_all         its input less its own split        the output less its own split
all_reduce (ring)  :math:`2 (W-1)/W \cdot n`           :math:`2 (W-1)/W \cdot n`
reduce_scatter     :math:`(W-1)/W \cdot n` (input)     the same
all_gather         :math:`(W-1) \cdot n` (its input)   the same
=================  ==================================  =====================================

(:math:`n` the bytes of the input). The counts of opttx's own `CollectiveStats` are the
payloads the wrappers pack; these are the wire bytes, for the α–β estimate of
benchmarks/scale_model.py and its test. Eager only (under ``torch.compile`` the collectives run
inside the compiled graph, out of the mode's sight).

Example:
  >>> with count_collectives() as counts:
  ...     updates, state = tx.update(grads, state, params)
  >>> counts.calls, counts.sent, counts.received, counts.by_kind
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounts", "count_collectives"]


@dataclass
class CollectiveCounts:
    """What `count_collectives` saw: per call ``(kind, group size, sent, received)``."""
    records: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def calls(self) -> int:
        """The number of collectives."""
        return len(self.records)

    @property
    def sent(self) -> int:
        """The bytes this rank sent, over all calls."""
        return sum(r[2] for r in self.records)

    @property
    def received(self) -> int:
        """The bytes this rank received, over all calls."""
        return sum(r[3] for r in self.records)

    @property
    def by_kind(self) -> dict[str, int]:
        """The number of calls of each kind."""
        out: dict[str, int] = {}
        for kind, *_ in self.records:
            out[kind] = out.get(kind, 0) + 1
        return out

    def reset(self) -> None:
        self.records.clear()


def _group(name: Any) -> tuple[int, int]:
    """``(size, rank)`` of the process group named ``name`` (an op's group argument)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    pg = _resolve_process_group(name) if isinstance(name, str) else name
    if not hasattr(pg, "size"):                 # a c10d op's ScriptObject
        pg = torch.distributed.ProcessGroup.unbox(pg)
    return pg.size(), pg.rank()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _all_reduce(w: int, n: int) -> tuple:
    b = 2 * (w - 1) * n // w                    # ring: reduce-scatter, then all-gather
    return ("all_reduce", w, b, b)


def _all_to_all(x: torch.Tensor, out_rows: int, w: int, rank: int, in_splits: Any,
                out_splits: Any) -> tuple:
    """``x`` split along dim 0 by ``in_splits`` (even: None or empty) to the ``w`` ranks, and
    ``out_rows`` rows received split by ``out_splits``; the rank's own split stays."""
    rows = math.prod(x.shape[1:])                # elements per split unit (1: flat)
    ins = list(in_splits) if in_splits else [x.shape[0] // w] * w
    outs = list(out_splits) if out_splits else [out_rows // w] * w
    item = x.element_size()
    return ("all_to_all", w, (sum(ins) - ins[rank]) * rows * item,
            (sum(outs) - outs[rank]) * rows * item)


def _broadcast(w: int, rank: int, root: int, n: int) -> tuple:
    return ("broadcast", w, n if rank == root else 0, 0 if rank == root else n)


def _record(op: Any, args: tuple, counts: CollectiveCounts) -> None:
    """Append the record of one collective op call (others ignored)."""
    record = (_c10d_record if op.namespace == "c10d" else
              _functional_record if op.namespace == "_c10d_functional" else None)
    out = record(op._opname, args) if record is not None else None
    if out is not None:
        counts.records.append(out)


def _functional_record(name: str, args: tuple) -> tuple | None:
    """The functional collectives (``torch.distributed._functional_collectives``): the ops
    traced code issues, their group a name or a group."""
    if name in ("all_reduce", "all_reduce_"):
        return _all_reduce(_group(args[2])[0], _nbytes(args[0]))
    if name == "all_reduce_coalesced":
        return _all_reduce(_group(args[2])[0], sum(_nbytes(x) for x in args[0]))
    if name == "all_to_all_single":
        x, out_splits, in_splits, group = args[:4]
        w, rank = _group(group)
        return _all_to_all(x, x.shape[0], w, rank, in_splits, out_splits)
    if name == "reduce_scatter_tensor":
        w = args[2]
        b = (w - 1) * _nbytes(args[0]) // w
        return ("reduce_scatter", w, b, b)
    if name == "all_gather_into_tensor":
        w = args[1]
        b = (w - 1) * _nbytes(args[0])
        return ("all_gather", w, b, b)
    if name == "broadcast":
        w, rank = _group(args[2])
        return _broadcast(w, rank, args[1], _nbytes(args[0]))
    return None


def _c10d_record(name: str, args: tuple) -> tuple | None:
    """The ops behind ``torch.distributed.all_reduce`` and friends (their process group is an
    argument)."""
    if name == "allreduce_":
        return _all_reduce(_group(args[1])[0], sum(_nbytes(x) for x in args[0]))
    if name == "_allgather_base_":
        w, _ = _group(args[2])
        b = (w - 1) * _nbytes(args[1])
        return ("all_gather", w, b, b)
    if name == "_reduce_scatter_base_":
        w, _ = _group(args[2])
        b = (w - 1) * _nbytes(args[1]) // w
        return ("reduce_scatter", w, b, b)
    if name == "alltoall_base_":
        out, x, group, out_splits, in_splits = args[:5]
        w, rank = _group(group)
        return _all_to_all(x, out.shape[0], w, rank, in_splits, out_splits)
    if name == "broadcast_":
        w, rank = _group(args[1])
        return _broadcast(w, rank, args[2], sum(_nbytes(x) for x in args[0]))
    return None


class _Counting(TorchDispatchMode):
    def __init__(self, counts: CollectiveCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        _record(func, args, self.counts)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_collectives(counts: CollectiveCounts | None = None) -> Iterator[CollectiveCounts]:
    """Within this block, count every functional collective this rank issues (see the module
    docstring) into ``counts`` (a new `CollectiveCounts` when None), which the block gets."""
    counts = CollectiveCounts() if counts is None else counts
    with _Counting(counts):
        yield counts
