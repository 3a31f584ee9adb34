"""Where `opttx.distributed.offload` keeps each chunk's optimizer state: the chunks (the
parameters packed as `opttx.distributed.zero_plan` packs them for one rank), their placement
on the host or the device (`place_chunks`, `offload_plan`), the groups of host chunks that
share one compiled call (`host_groups`), and the checks of the arguments that choose them,
which `opttx.distributed.zero`'s offload shares.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .._checks import check_nonnegative, check_positive
from ..base import GradientTransformation, Params
from ..tree import tree_flatten, tree_paths
from .chunk_plan import state_costs, zero_plan

__all__ = ["DEFAULT_CHUNK_MB", "LEAF_ALIGNMENT_BYTES", "MIB", "OffloadChunk", "OffloadPlan",
           "check_chunk_size_mb", "check_host_group_mb", "chunks_of", "host_groups",
           "offload_plan", "place_chunks", "place_plan", "validated_fraction"]

MIB = 1 << 20            # bytes in a MiB
DEFAULT_CHUNK_MB = 32.0  # parameters per chunk: fine placement, host steps starting early
# Where each leaf starts in a host chunk's buffers (staging, master copy) when the transform
# sees the chunk leaf by leaf: at a multiple of 64 bytes, as a tensor of its own starts (the
# CPU allocator's alignment). CPU BLAS and LAPACK (MKL on AVX2, measured) round a matmul or an
# eigendecomposition of the same values differently at another alignment, so a leaf packed
# back to back after a 6-element one got other bits than the transform without offload.
LEAF_ALIGNMENT_BYTES = 64


@dataclass(frozen=True)
class OffloadChunk:
    """One chunk of an `OffloadPlan`: whole parameters of one dtype, back to back.

    ``leaves`` index the leaves of the tree the plan was made for (flattening order), in their
    order in the chunk; ``sizes`` are their elements; ``state_bytes`` the optimizer state they
    hold (measured on meta tensors with `opttx.distributed.state_costs`; the parameters' bytes
    when the transform cannot be initialised there or none was given). ``alignment``: each
    leaf starts at a multiple of this many elements of its chunk's buffers (1: back to back;
    `offload`'s per-leaf layout aligns them to 64 bytes, see `LEAF_ALIGNMENT_BYTES`)."""

    leaves: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    state_bytes: int
    on_host: bool
    alignment: int = 1

    # both read on every step (staging copies, views of the buffers): computed once
    @functools.cached_property
    def numel(self) -> int:
        """Elements of the chunk's buffers: its leaves and the gaps that align them."""
        offsets = self.offsets
        return offsets[-1] + self.sizes[-1] if self.sizes else 0

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Element offset of each leaf in the chunk."""
        out, pos, a = [], 0, self.alignment
        for n in self.sizes:
            pos = -(-pos // a) * a
            out.append(pos)
            pos += n
        return tuple(out)


@dataclass(frozen=True)
class OffloadPlan:
    """Which chunks of optimizer state live in host memory (`offload_plan`).

    Attributes:
      chunks: the chunks, in tree order (backward produces the last ones' gradients first).
      paths: the path of every leaf of the tree, for messages and `summary`.
      fraction: the fraction asked for (None with a budget).
      budget_bytes: the device budget for optimizer state the placement honours (None with a
        fraction).
    """

    chunks: tuple[OffloadChunk, ...]
    paths: tuple[str, ...]
    fraction: float | None
    budget_bytes: int | None = None

    @property
    def host_bytes(self) -> int:
        """Optimizer-state bytes in host memory."""
        return sum(c.state_bytes for c in self.chunks if c.on_host)

    @property
    def device_bytes(self) -> int:
        """Optimizer-state bytes in device memory."""
        return sum(c.state_bytes for c in self.chunks if not c.on_host)

    @property
    def host_fraction(self) -> float:
        """The share of the optimizer-state bytes in host memory (1.0 when there are none)."""
        total = self.host_bytes + self.device_bytes
        return self.host_bytes / total if total else float(all(c.on_host for c in self.chunks))

    def host_leaves(self) -> tuple[int, ...]:
        """The leaves (flattening indices) whose state lives in host memory."""
        return tuple(sorted(i for c in self.chunks if c.on_host for i in c.leaves))

    def placed(self, on_host: Sequence[bool], *, fraction: float | None = None,
               budget_bytes: int | None = None) -> "OffloadPlan":
        """This plan's chunks with another placement."""
        chunks = tuple(dataclasses.replace(c, on_host=bool(h))
                       for c, h in zip(self.chunks, on_host, strict=True))
        return OffloadPlan(chunks, self.paths, fraction, budget_bytes)

    def summary(self) -> str:
        """A table: each chunk's dtype, elements, state bytes, placement and parameters."""
        lines = [f"OffloadPlan: {len(self.chunks)} chunks; optimizer state {self.host_bytes} "
                 f"bytes on the host, {self.device_bytes} on the device "
                 f"({100 * self.host_fraction:.0f} % offloaded)"]
        for k, c in enumerate(self.chunks):
            names = ", ".join(self.paths[i] for i in c.leaves)
            lines.append(f"  chunk {k}: {'host  ' if c.on_host else 'device'} {c.dtype}, "
                         f"{c.numel} elements, state {c.state_bytes} bytes: {names}")
        return "\n".join(lines)


def place_chunks(state_bytes: Sequence[int], fraction: float | None = None,
                 budget_bytes: int | None = None) -> list[bool]:
    """Which chunks go to the host (True), given each chunk's optimizer-state bytes in tree
    order.

    With ``fraction`` :math:`f`: the fewest *last* chunks whose state holds at least
    :math:`f` of the total (all of them for :math:`f = 1`, none for :math:`f = 0`). The last
    chunks are the first whose gradients backward produces, so their copies and host steps
    have the rest of backward to overlap with; the first chunks, which the next forward needs
    first, stay on the device. With ``budget_bytes``: the longest run of *first* chunks whose
    state fits in the budget stays on the device, the rest goes to the host.

    Example:
      >>> place_chunks([4, 4, 4, 4], fraction=0.5)
      [False, False, True, True]
      >>> place_chunks([4, 4, 4, 4], budget_bytes=9)
      [False, False, True, True]
    """
    n = len(state_bytes)
    if (fraction is None) == (budget_bytes is None):
        raise ValueError("place_chunks: give exactly one of fraction and budget_bytes.")
    if budget_bytes is not None:
        check_nonnegative("budget_bytes", budget_bytes)
        used, keep = 0, 0
        for b in state_bytes:
            if used + b > budget_bytes:
                break
            used += b
            keep += 1
        return [k >= keep for k in range(n)]
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1] or 'auto', got {fraction!r}.")
    if fraction == 1.0:
        return [True] * n
    target, offloaded, first = fraction * sum(state_bytes), 0, n
    while first > 0 and offloaded < target:
        first -= 1
        offloaded += state_bytes[first]
    return [k >= first for k in range(n)]


def chunks_of(leaves: list[torch.Tensor], members: Sequence[Sequence[int]],
              costs: Sequence[float] | None, alignment_bytes: int = 0) -> list[OffloadChunk]:
    """Chunks (all on the device) of the given member lists, each leaf starting at a multiple
    of ``alignment_bytes`` in the chunk's buffers (0: back to back)."""
    out = []
    for m in members:
        m = tuple(m)
        if not m:
            continue
        sizes = tuple(leaves[i].numel() for i in m)
        if costs is None:
            state = sum(leaves[i].numel() * leaves[i].element_size() for i in m)
        else:
            state = int(sum(costs[i] for i in m))
        dtype = leaves[m[0]].dtype
        alignment = max(1, alignment_bytes // dtype.itemsize)
        out.append(OffloadChunk(m, sizes, dtype, state, False, alignment))
    return out


def check_host_group_mb(host_group_mb: float | None, compile: bool, delayed: bool,
                        where: str, name: str = "host_group_mb") -> None:
    """``host_group_mb`` groups compiled host steps: positive, with ``compile``, not with
    ``delayed`` (each delayed step is a job of its own)."""
    if host_group_mb is None:
        return
    check_positive(name, host_group_mb)
    if not compile:
        raise ValueError(f"{where}: {name} groups compiled host steps into one call; it needs "
                         "compile=True (eager, every op is its own kernel).")
    if delayed:
        raise ValueError(f"{where}: {name} is not implemented with delayed (each host "
                         "chunk's delayed step is a job of its own).")


def check_chunk_size_mb(chunk_size_mb: Any) -> None:
    """A finite number of MiB > 0 (inf and NaN name the argument instead of failing inside
    the chunk plan)."""
    check_positive("chunk_size_mb", chunk_size_mb)
    if not math.isfinite(float(chunk_size_mb)):
        raise ValueError(f"chunk_size_mb must be a finite number of MiB > 0, got "
                         f"{chunk_size_mb!r}: a chunk holds at most that many MiB of "
                         "parameters (a size above the model's puts it all in one chunk).")


def validated_fraction(fraction: Any, where: str) -> float | str:
    """An offload fraction checked: a number in [0, 1] (as a float) or ``"auto"``; ``where``
    names the caller in the error."""
    if isinstance(fraction, str):
        if fraction != "auto":
            raise ValueError(f"{where}: offload fraction must be a number in [0, 1] or 'auto', "
                             f"got {fraction!r}.")
        return fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"{where}: offload fraction must be a number in [0, 1] or 'auto', "
                         f"got {fraction!r}.")
    return float(fraction)


def offload_plan(params: Params, tx: GradientTransformation | None = None,
                 fraction: float | str = 1.0, *, chunk_size_mb: float = DEFAULT_CHUNK_MB,
                 device_budget_mb: float | None = None) -> OffloadPlan:
    """The chunks `offload` makes of ``params`` and where their optimizer state lives (no
    device needed: only shapes and dtypes are read, so meta tensors do).

    The chunks are `opttx.distributed.zero_plan`'s for one rank at the given capacity (whole
    parameters in tree order, a chunk closed when the next parameter does not fit, a
    parameter larger than the capacity alone in its chunk); each chunk's state bytes are
    what ``tx.init`` allocates for its parameters (`opttx.distributed.state_costs`;
    parameter bytes without ``tx``). Placement: see `place_chunks`.

    Args:
      params: the parameter tree.
      tx: the transform whose state is placed (None: parameter bytes stand for it).
      fraction: the share of the state to put on the host, in [0, 1], or ``"auto"``: keep on
        the device what fits in ``device_budget_mb`` (without a budget, everything goes to
        the host, as `offload` does before its warm-up step measures one).
      chunk_size_mb: the chunk capacity in MiB (of parameters). Smaller chunks place the
        state more finely and start their host steps sooner; each costs a little Python per
        step.
      device_budget_mb: with ``"auto"``, the device memory (MiB) the optimizer state may use.

    Returns:
      An `OffloadPlan`.

    Example:
      >>> plan = offload_plan({"w": torch.empty(1024, 1024), "b": torch.empty(1024)},
      ...                     opttx.adamw(1e-3), fraction=0.5, chunk_size_mb=2)
      >>> print(plan.summary())
    """
    fraction = validated_fraction(fraction, "offload_plan")
    if device_budget_mb is not None:
        check_nonnegative("device_budget_mb", device_budget_mb)
        if fraction != "auto":
            raise ValueError("offload_plan: device_budget_mb goes with fraction='auto'.")
    leaves = tree_flatten(params)[0]
    check_chunk_size_mb(chunk_size_mb)
    plan = zero_plan(params, 1, chunk_size_mb)
    costs = state_costs(tx, params) if tx is not None else None
    chunks = chunks_of(leaves, [c.leaves for c in plan.chunks], costs)
    return place_plan(OffloadPlan(tuple(chunks), tuple(tree_paths(params)), None), fraction,
                      device_budget_mb)


def place_plan(plan: OffloadPlan, fraction: float | str, budget_mb: float | None
               ) -> OffloadPlan:
    """``plan`` placed by ``fraction`` (`place_chunks`), or with ``"auto"`` by the budget
    ``budget_mb`` (MiB; None: every chunk on the host, until the warm-up measures one)."""
    sizes = [c.state_bytes for c in plan.chunks]
    if fraction == "auto":
        if budget_mb is None:
            return plan.placed([True] * len(sizes))
        budget = int(budget_mb * MIB)
        return plan.placed(place_chunks(sizes, budget_bytes=budget), budget_bytes=budget)
    return plan.placed(place_chunks(sizes, fraction=fraction), fraction=fraction)


def host_groups(chunks: Sequence[OffloadChunk], ks: list[int], host_group_mb: float
                ) -> dict[int, list[int]]:
    """Host chunks ``ks`` (in order) in groups of consecutive ones whose parameters take
    at most ``host_group_mb`` MiB (a larger chunk alone), each chunk mapped to its group."""
    groups: list[list[int]] = []
    size, cap = 0, host_group_mb * MIB
    for k in ks:
        c = chunks[k]
        nbytes = c.numel * c.dtype.itemsize
        if not groups or size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return {k: g for g in groups for k in g}
