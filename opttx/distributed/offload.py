r"""Heterogeneous memory: optimizer state by chunks on the host or on the device, and each
chunk's update where its state lives (ColossalAI's Gemini, DeepSpeed's ZeRO-Offload).

The parameters are packed into chunks as `zero_plan` packs them (whole parameters, in tree
order, one dtype per chunk). A *placement* puts a fraction of the chunks' optimizer state in
host memory, the rest on the device; `offload_plan` shows it. Each step then runs the same
transform once per chunk: a host chunk's gradients (and parameters) are copied to the host, its
update runs on the CPU (eagerly, or compiled by Inductor into one vectorized C++ loop over the
chunk with ``layout="flat", compile=True``) and the updates go back to the device; a device
chunk's update runs on the device. On CUDA the copies run on side streams into pinned staging
buffers, so the device chunks compute while the host ones are copied and computed.

Why chunks give the same numbers: a transform whose traits say ``per_leaf`` computes each
leaf's output from that leaf alone, so running it on the leaves of one chunk at a time is
running it on all leaves at once (its step counters advance once per call, in every chunk
alike). An ``elementwise`` chain may even see each chunk as one flat vector (``layout="flat"``,
as `opttx.flatten`). A chain that takes a statistic across leaves and keeps state (Prodigy)
cannot be cut into chunks and is refused; stateless statistics across leaves at the head of a
`opttx.chain` (`opttx.clip_by_global_norm`) run first, on the device, over every leaf; a
wrapper declared to run its inner transform on the whole updates (`opttx.apply_if_finite`)
runs around the chunks.

The state is the transform's own state over the parameter tree, laid out exactly as without
offload (a host chunk's tensors simply live in host memory), so checkpoints
(`opttx.distributed.state_dict`) have the same keys with and without offload, and
`set_hyperparams_`, `opttx.Optimizer` and the wrappers see what they expect.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

from .._checks import check_nonnegative, check_positive
from .._tracing import is_tracing
from ..base import (EmptyState, GradientTransformation, Params, REDUCER_KEY, Role, State,
                    TOTALS_KEY, Updates, apply_updates, apply_updates_, combine_traits,
                    declare, declare_optional, declare_roles, fields_with_role, traits_of)
from ..combine import chain_links
from ..kernels import CoefficientsFirst, donating, is_donating
from ..tree import (MaskedNode, PyTree, tree_copy_, tree_flatten, tree_map, tree_paths,
                    tree_unflatten)
from .checkpoint_keys import keyed_state

__all__ = ["OffloadChunk", "OffloadMasterState", "OffloadPlan", "OffloadStats",
           "check_offloadable", "offload", "offload_plan", "place_chunks"]

_MIB = 1 << 20
DEFAULT_CHUNK_MB = 32.0  # parameters per chunk: fine placement, host steps starting early
_HOST = torch.device("cpu")


def _host_compile_options() -> dict[str, Any]:
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


_AUTO_MARGIN = 0.1       # "auto": the share of the device's memory left free for fragmentation


# ---------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadChunk:
    """One chunk of an `OffloadPlan`: whole parameters of one dtype, back to back.

    ``leaves`` index the leaves of the tree the plan was made for (flattening order), in their
    order in the chunk; ``sizes`` are their elements; ``state_bytes`` the optimizer state they
    hold (measured on meta tensors with `opttx.distributed.state_costs`; the parameters' bytes
    when the transform cannot be initialised there or none was given)."""

    leaves: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    state_bytes: int
    on_host: bool

    @property
    def numel(self) -> int:
        """Elements of the chunk."""
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Element offset of each leaf in the chunk."""
        out, pos = [], 0
        for n in self.sizes:
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


def _chunks_of(leaves: list[torch.Tensor], members: Sequence[Sequence[int]],
               costs: Sequence[float] | None) -> list[OffloadChunk]:
    """Chunks (all on the device) of the given member lists."""
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
        out.append(OffloadChunk(m, sizes, leaves[m[0]].dtype, state, False))
    return out


def _check_host_group_mb(host_group_mb: float | None, compile: bool, delayed: bool,
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


def _check_chunk_size_mb(chunk_size_mb: Any) -> None:
    """A finite number of MiB > 0 (inf and NaN name the argument instead of failing inside
    the chunk plan)."""
    check_positive("chunk_size_mb", chunk_size_mb)
    if not math.isfinite(float(chunk_size_mb)):
        raise ValueError(f"chunk_size_mb must be a finite number of MiB > 0, got "
                         f"{chunk_size_mb!r}: a chunk holds at most that many MiB of "
                         "parameters (a size above the model's puts it all in one chunk).")


def _validated_fraction(fraction: Any, where: str) -> float | str:
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
    from .zero import state_costs, zero_plan
    fraction = _validated_fraction(fraction, "offload_plan")
    if device_budget_mb is not None:
        check_nonnegative("device_budget_mb", device_budget_mb)
        if fraction != "auto":
            raise ValueError("offload_plan: device_budget_mb goes with fraction='auto'.")
    leaves = tree_flatten(params)[0]
    _check_chunk_size_mb(chunk_size_mb)
    plan = zero_plan(params, 1, chunk_size_mb)
    costs = state_costs(tx, params) if tx is not None else None
    chunks = _chunks_of(leaves, [c.leaves for c in plan.chunks], costs)
    return _place(OffloadPlan(tuple(chunks), tuple(tree_paths(params)), None), fraction,
                  device_budget_mb)


def _place(plan: OffloadPlan, fraction: float | str, budget_mb: float | None) -> OffloadPlan:
    sizes = [c.state_bytes for c in plan.chunks]
    if fraction == "auto":
        if budget_mb is None:
            return plan.placed([True] * len(sizes))
        budget = int(budget_mb * _MIB)
        return plan.placed(place_chunks(sizes, budget_bytes=budget), budget_bytes=budget)
    return plan.placed(place_chunks(sizes, fraction=fraction), fraction=fraction)


# ---------------------------------------------------------------------------------------------
# which chains run chunk by chunk
# ---------------------------------------------------------------------------------------------


def _chunkable(traits: Any, layout: str) -> bool:
    if layout == "flat":
        return traits.elementwise and not traits.across_leaves
    return traits.per_leaf and not traits.across_leaves


def check_offloadable(tx: GradientTransformation, layout: str = "leaves") -> int:
    """Refuse, with the reason, a transform that cannot run chunk by chunk; return the number
    of leading links of a `opttx.chain` that run on the device over every leaf first.

    Read from the declared `opttx.Traits`: with ``layout="leaves"`` every link must be
    ``per_leaf`` (each leaf's output from that leaf alone: element-wise chains, Adafactor's
    and CAME's factored moments, LAMB's trust ratios, 8-bit states, Shampoo's blocks) and
    not ``across_leaves``; with ``layout="flat"`` ``elementwise``. Links at the head of a
    chain that do not qualify (a statistic across leaves, or undeclared) are allowed when
    they keep no state (checked at ``init``): they run before the chunks, on every leaf.

    Raises:
      ValueError: naming the link and the trait that keeps it from running by chunks.
    """
    if layout not in ("leaves", "flat"):
        raise ValueError(f"offload: layout must be 'leaves' or 'flat', got {layout!r}.")
    links = chain_links(tx) or (tx,)
    head = 0                  # links that do not work leaf by leaf, run first if stateless
    while head < len(links) and not _chunkable(traits_of(links[head]), "leaves"):
        head += 1
    for j in range(head, len(links)):
        t = traits_of(links[j])
        if not _chunkable(t, layout):
            what = f"link {j} of the chain" if chain_links(tx) else "the transform"
            raise ValueError(f"offload: {what} cannot run chunk by chunk: {_why(t, layout)}.")
    return head


def peel_wrappers(tx: GradientTransformation, layout: str = "leaves"
                  ) -> tuple[list[tuple[Any, str]], GradientTransformation]:
    """``(wrappers, core)``: ``tx`` as declared wrappers around a transform that runs chunk by
    chunk. A transform that cannot run by chunks but wraps another on the whole updates,
    keeping its state whole (`opttx.declare`'s ``wraps``: `opttx.apply_if_finite`,
    `opttx.multi_steps`), is peeled off, outermost first, as ``(recipe, argument)``; the
    offloaded run of ``core`` then goes inside it (`_around`), so ``offload(apply_if_finite(
    adamw(...), 5))`` is ``apply_if_finite(offload(adamw(...)), 5)`` with the same state.

    Raises:
      ValueError: `check_offloadable`'s, for ``core``.
    """
    wrappers: list[tuple[Any, str]] = []
    core = tx
    while not _chunkable(traits_of(core), layout):
        recipe = getattr(core, "recipe", None)
        name = recipe.declaration.wraps if recipe is not None else None
        if name is None or not isinstance(recipe.arguments.get(name), GradientTransformation):
            break
        wrappers.append((recipe, name))
        core = recipe.arguments[name]
    check_offloadable(core, layout)
    return wrappers, core


def _around(wrappers: list[tuple[Any, str]], core: GradientTransformation,
            engine_of: Callable[[], "_Offloader"], adopt: list[bool]
            ) -> GradientTransformation:
    """The offloaded run of ``core`` (by ``engine_of()``) as a transform with ``core``'s
    traits and recipe (so the wrappers' identities, and their states' ``made_by``, are those
    without offload), inside the ``wrappers`` of `peel_wrappers`, rebuilt around it. A
    restored state (``adopt[0]``) is adopted by the engine at its first run."""
    def init(params: Params) -> State:
        return engine_of().init(params)

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        engine = engine_of()
        if adopt[0]:
            state = engine.adopt(state)
            adopt[0] = False
        return engine.update(updates, state, params, extra_args)

    # the engine runs the links itself and applies every scale (no deferred final scale)
    traits = dataclasses.replace(traits_of(core), final_scale=False)
    tx = GradientTransformation(init, update, traits, core.recipe)
    for recipe, name in reversed(wrappers):
        tx = recipe.rebuild(**{name: tx})
    return tx


def _why(t: Any, layout: str) -> str:
    if t.across_leaves:
        return ("its traits say it takes a statistic across leaves (Traits.across_leaves: a "
                "global norm, a finiteness test, Prodigy's estimate), so no chunk could be "
                "updated before every gradient is in. A stateless one may lead the chain "
                "(chain(clip_by_global_norm(1.0), adamw(...)): it runs on the device first), "
                "and a wrapper declared to call its inner transform on the whole updates runs "
                "around the chunks (offload(apply_if_finite(adamw(...), 5)) runs as "
                "apply_if_finite(offload(adamw(...)), 5)); wrap other stateful ones around the "
                "offloaded transform")
    if layout == "flat" and t.per_leaf:
        return ("layout='flat' needs an element-wise chain (Traits.elementwise) and this one "
                "takes statistics of whole leaves (factored moments, norms, blocks); use "
                "layout='leaves'")
    if t.whole_leaves:
        return ("its traits say it needs whole tensors but not that it works leaf by leaf "
                "(Traits.whole_leaves without Traits.per_leaf)")
    return ("its traits do not say it works leaf by leaf (Traits.per_leaf), so running it on "
            "a part of the leaves could change its numbers; declare the traits of a "
            "transform of your own (opttx.LEAFWISE or opttx.ELEMENTWISE) if they hold")


# ---------------------------------------------------------------------------------------------
# the state: the transform's own, chunk states gathered from it by checkpoint keys
# ---------------------------------------------------------------------------------------------


def _keyed_positions(state: Any, tree: PyTree, mask: Sequence[bool] | None
                     ) -> tuple[dict[tuple, list[int]], list[Any], Any]:
    """``{key: positions}`` of the tensors of ``state`` among its flattened leaves, keyed as
    checkpoints key them (``("param", param path, field path)`` or ``("shared", field
    path)``); also the leaves and the treespec. Every tensor must get a key."""
    leaves, spec = tree_flatten(state)
    where: dict[int, list[int]] = {}
    for j, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            where.setdefault(id(x), []).append(j)
    per_param, shared = keyed_state(state, tree, mask)
    out: dict[tuple, list[int]] = {}
    for path, fields in per_param.items():
        for f, x in fields.items():
            out[("param", path, f)] = where[id(x)]
    for f, x in shared.items():
        out[("shared", f)] = where[id(x)]
    named = {j for js in out.values() for j in js}
    unnamed = [j for js in where.values() for j in js if j not in named]
    if unnamed:
        raise ValueError("offload: the state holds tensors that the checkpoint keys do not "
                         "name; it cannot be split by parameter.")
    return out, leaves, spec


def _count_positions(state: Any, leaves: list[Any]) -> set[int]:
    """The positions among ``leaves`` (the state's) of the step counters: fields declared
    `opttx.Role.COUNT`."""
    where = {id(x): j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
    out: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            for name in fields_with_role(node, Role.COUNT):
                x = getattr(node, name)
                if isinstance(x, torch.Tensor) and id(x) in where:
                    out.add(where[id(x)])
            for x in node:
                walk(x)
        elif isinstance(node, (list, tuple)):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for x in node.values():
                walk(x)
    walk(state)
    return out


def _meta(tree: PyTree) -> PyTree:
    return tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                    if isinstance(x, torch.Tensor) else x, tree)


def _init_on_meta(tx: GradientTransformation, tree: PyTree, fallback: Callable[[], PyTree]
                  ) -> Any:
    """``tx.init`` on meta tensors shaped like ``tree`` (nothing allocated); ``tx.init`` of
    ``fallback()`` when the transform cannot be initialised on meta tensors."""
    try:
        return tx.init(_meta(tree))
    except Exception:  # noqa: BLE001 - a transform that needs real data at init
        return tx.init(fallback())


def _versions(leaves: list[Any]) -> list[int]:
    """The version counters of the tensors among ``leaves`` (-1 for an inference tensor,
    which has none and cannot be written in place outside inference mode)."""
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(-1 if x.is_inference() else x._version)
    return out


def _flat_view(parts: list[torch.Tensor], numel: int) -> torch.Tensor:
    """One flat tensor of ``parts`` (tensors laid back to back): a view of their storage when
    they are already contiguous there (the state of the flat layout), else a concatenation."""
    nonempty = [x for x in parts if x.numel() > 0]
    if nonempty:
        first = nonempty[0]
        esize, pos, ok = first.element_size(), first.data_ptr(), True
        for x in parts:
            if x.numel() == 0:
                continue
            if (not x.is_contiguous() or x.dtype != first.dtype or x.device != first.device
                    or x.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                    or x.data_ptr() != pos):
                ok = False
                break
            pos += x.numel() * esize
        if ok and first.storage_offset() * esize + numel * esize \
                <= first.untyped_storage().nbytes():
            return first.as_strided((numel,), (1,), first.storage_offset())
    if not parts:
        return torch.empty(0)
    return torch.cat([x.reshape(-1) for x in parts])


# Which leaves to write travel into compiled steps as tuples of bools, one per flat leaf:
# Dynamo takes bools as constants, where a tuple of positions (ints) would become symbolic
# sizes under dynamic=True, and a test like ``i in positions`` on them is not what it reads.


def _copy_leaves(dst: PyTree, src: PyTree, which: Sequence[bool]) -> None:
    """The leaves of ``src`` copied into those of ``dst`` where ``which`` (a bool per flat
    leaf) is True."""
    if any(which):
        d, s = tree_flatten(dst)[0], tree_flatten(src)[0]
        tree_copy_([x for x, w in zip(d, which) if w], [x for x, w in zip(s, which) if w])


def _copy_state(dst: PyTree, src: PyTree, keep: Sequence[bool]) -> None:
    """``tree_copy_(dst, src)`` but for the leaves where ``keep`` (a bool per flat leaf, or
    empty: none) is True."""
    if any(keep):
        _copy_leaves(dst, src, [not k for k in keep])
    else:
        tree_copy_(dst, src)


def _write_shared_once(items: list[tuple[Any, ...]], news: list[Any]) -> None:
    """After a group's steps (`_Offloader._group_step`): each item's state (its second
    element) takes the new values of the shared tensors it writes (its last element: a bool
    per leaf) from that chunk's new state."""
    for item, new in zip(items, news):
        _copy_leaves(item[1], new, item[-1])


class OffloadMasterState(NamedTuple):
    """The state of `offload` with ``master_params`` (and of `zero` with
    ``offload_master_params``): the transform's state and the master copy of the host chunks'
    parameters. In a checkpoint the transform's entries are named as without offload
    (`Role.SAME_STATE`) and the master's are optional (`opttx.declare_optional`): keyed
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


@dataclass
class _ChunkMap:
    """How one chunk's state is gathered from the whole state and written back."""
    template: list[Any]           # the chunk state's leaves (placeholders where tensors go)
    spec: Any                     # its treespec
    take: list[tuple[int, int]]   # (chunk position, whole-state position) of its own tensors
    flat: list[tuple[int, list[int]]]   # flat layout: (chunk position, member positions)
    shared: list[tuple[int, int]]       # (chunk position, whole-state position)


class _Offloader:
    """One offloaded transform: its chunks, their placement, maps and buffers. Built by
    ``init`` (or `adopt` for a restored state) of `offload` or of `zero` with ``offload``."""

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
        self.compile = compile
        self.budget_mb = budget_mb
        self.memory_probe = memory_probe
        self.where = where
        self.plan: OffloadPlan | None = None
        self.maps: list[_ChunkMap] = []
        self.spec: Any = None                 # the treespec of the tree given to init
        self.state_spec: Any = None
        self.device = _HOST                   # where the parameters and gradients live
        self.warmed_up = fraction != "auto" or budget_mb is not None
        self._staging: dict[tuple[int, str], torch.Tensor] = {}
        self._streams: tuple[Any, Any] | None = None
        self._sent: dict[int, Any] = {}       # CUDA: each host chunk's last update copy
        self.overlap, self.delayed = overlap, delayed
        self._worker: Any = None              # the thread running host steps in background
        self._launches: Any = None            # overlap: the host chunks started in backward
        self._pending: dict[int, Any] = {}    # delayed: each host chunk's step in flight
        self._versions: list[int] | None = None   # delayed, overlap: the last state's versions
        self._live: Any = None                # the state the last update returned
        self._extra: dict[str, Any] = {}      # the extra args of the last update
        self._compiled: dict[tuple[Any, str], Callable] = {}   # (chunk(s), step) -> compiled
        self._stepped: set[int] = set()       # host chunks whose step has compiled (compile)
        self.master_params = master_params
        self._masters: dict[int, torch.Tensor] = {}   # host chunk -> its flat master copy
        self._stale: set[int] = set()         # leaves whose master restarts from the params
        self._master_views: dict[int, tuple[torch.Tensor, tuple, int]] = {}  # as _views
        self._flag_views: tuple[torch.Tensor, tuple] | None = None  # started: buffer, views
        self._live_outer: Any = None          # master_params: the last state, with its master
        self._live_started: Any = None        # and its tree of flags (as _outer made them)
        # flat layout: (chunk, state position) -> (its flat buffer, the whole state's views of
        # it, the buffer's address), as `_scatter_flat` last made them
        self._views: dict[tuple[int, int], tuple[torch.Tensor, tuple, int]] = {}
        self.host_group_mb = host_group_mb    # compiled host steps sharing one call (MiB)
        self.stats = stats if stats is not None else OffloadStats()

    # --- resolving -----------------------------------------------------------------------

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
        if self.compile and k not in self._stepped:
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
        from .overlap import BackwardLaunches
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
        if self._live is None:
            return lambda: None
        s_leaves = tree_flatten(self._live)[0]
        full: list[Any] = [None] * len(self.shapes)
        for i, g in zip(self.plan.chunks[k].leaves, grads):
            full[i] = g
        self.stats.started_in_backward += 1
        # functional: if update does not take this result (other gradients, another state),
        # the state it started from must be intact
        if self.master_params:
            if self._live_outer is not None:  # a checkpoint without a master was loaded?
                self._stale.update(self._unstarted(self._live_outer, self.plan.chunks[k].leaves))
            master = self._master(k, self._params)
            staged = self._stage(k, full, None, s_leaves)
            future = self._submit(k, self._job_master, k, staged, s_leaves,
                                  dict(self._extra), master)
        else:
            staged = self._stage(k, full, self._params, s_leaves)
            future = self._submit(k, self._job, k, staged, s_leaves, dict(self._extra),
                                  False)
        return future.result

    def _job_master(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
                    extra: dict[str, Any], master: torch.Tensor
                    ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """master_params with overlap: host chunk ``k``'s step from backward, functionally:
        the new master into the chunk's second master buffer (swapped in when ``update``
        takes the result), its values sent to the device. Returns (the values on the device,
        the new state, the new master)."""
        g, _, shared = self._wait_staged(k, staged)
        nxt = self._buffer(k, "master", master.dtype)
        start = time.perf_counter()
        with donating(False):
            values, new = self._master_step(k, g, self._chunk_state(k, s_leaves, shared),
                                            self._params, extra, into=nxt, master=master)
        self.stats.host_seconds += time.perf_counter() - start
        return self._send_values(k, values), new, nxt

    def _job(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
             extra: dict[str, Any], donate: bool, base: Any = None) -> tuple[PyTree, Any]:
        """A host chunk's step off the main thread: wait for its copies, update, send. From
        ``base`` (delayed: the chunk's state from its last step, with its own step counts and
        the other shared tensors, injected hyperparameters, of the state given to update)
        or from the chunk's part of ``s_leaves``."""
        g, p, shared = self._wait_staged(k, staged)
        if base is None:
            state = self._chunk_state(k, s_leaves, shared)
        else:
            leaves, spec = tree_flatten(base)
            for n, (pos, j) in enumerate(self.maps[k].shared):
                if j not in self.counts:
                    leaves[pos] = shared[n]
            state = tree_unflatten(leaves, spec)
        start = time.perf_counter()
        with donating(donate):
            u, new = self._host_run(k, g, state, p, extra)
            u = self._send(k, u)
        self.stats.host_seconds += time.perf_counter() - start
        return u, new

    def _plan_for(self, tree: PyTree, members: Sequence[Sequence[int]] | None,
                  costs: Sequence[float] | None, kwargs: dict[str, Any]) -> OffloadPlan:
        from .zero import zero_plan
        leaves = tree_flatten(tree)[0]
        if members is None:
            members = [c.leaves for c in zero_plan(tree, 1, **kwargs).chunks]
        chunks = _chunks_of(leaves, members, costs)
        plan = OffloadPlan(tuple(chunks), tuple(tree_paths(tree)), None)
        return _place(plan, self.fraction, self.budget_mb)

    def resolve(self, tree: PyTree, members: Sequence[Sequence[int]] | None = None,
                costs: Sequence[float] | None = None, **plan_kwargs: Any) -> None:
        """Plan the chunks of ``tree`` (``members``: the leaf indices of each chunk, decided
        elsewhere, as `zero` does per rank) and build the maps between the whole state and
        each chunk's (on meta tensors: nothing allocated)."""
        leaves, self.spec = tree_flatten(tree)
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [x.dtype for x in leaves]
        self.device = leaves[0].device if leaves else _HOST
        self.plan = self._plan_for(tree, members, costs, plan_kwargs)
        self.stats.plan = self.plan
        self._meta_tree = _meta(tree)

    def _chunk_tree(self, k: int, leaves: list[Any]) -> PyTree:
        """The tree of chunk ``k``: its leaves as given (others masked), or one flat vector."""
        c = self.plan.chunks[k]
        if self.layout == "flat":
            return (leaves[0],) if len(leaves) == 1 and leaves[0].dim() == 1 \
                and leaves[0].numel() == c.numel else (_flat_view(list(leaves), c.numel),)
        full: list[Any] = [MaskedNode()] * len(self.shapes)
        for i, x in zip(c.leaves, leaves):
            full[i] = x
        return self.spec.unflatten(full)

    def _build_maps(self, state: Any) -> None:
        """The position of every tensor of ``state`` by key, and each chunk's map."""
        n = len(self.shapes)
        keys, s_leaves, self.state_spec = _keyed_positions(state, self._meta_tree, [True] * n)
        self.counts = _count_positions(state, s_leaves)
        paths = keyed_paths(self._meta_tree)
        self.maps = []
        covered: set[tuple] = set()
        for k, c in enumerate(self.plan.chunks):
            mine = set(c.leaves)
            if self.layout == "flat":
                flat = torch.empty(c.numel, dtype=c.dtype, device="meta")
                try:
                    template = _init_on_meta(self.tx, (flat,), lambda: (torch.empty(
                        c.numel, dtype=c.dtype),))
                except Exception as e:  # noqa: BLE001 - named in the refusal
                    raise self._mismatch(f"its init fails on one flat vector: "
                                         f"{type(e).__name__}: {e}") from e
                tkeys, tleaves, tspec = _keyed_positions(template, (flat,), [True])
            else:
                chunk_tree = self._chunk_tree(k, [self._meta_leaf(i) for i in c.leaves])
                template = _init_on_meta(self.tx, chunk_tree, lambda: self._chunk_tree(
                    k, [torch.empty(self.shapes[i], dtype=self.dtypes[i]) for i in c.leaves]))
                tkeys, tleaves, tspec = _keyed_positions(template, self._meta_tree,
                                                         [i in mine for i in range(n)])
            take, flat_take, shared = [], [], []
            for key, (pos, *_) in tkeys.items():
                if key[0] == "shared":
                    if key not in keys:
                        raise self._mismatch(f"shared entry {key[1]!r} of a chunk's state")
                    if tuple(tleaves[pos].shape) != tuple(s_leaves[keys[key][0]].shape):
                        raise self._mismatch(
                            f"the entry {key[1]!r}, which belongs to no single parameter, has "
                            f"shape {tuple(tleaves[pos].shape)} over one chunk and "
                            f"{tuple(s_leaves[keys[key][0]].shape)} over all parameters "
                            "(a state packed across parameters, as opttx.flatten's)")
                    shared.append((pos, keys[key][0]))
                    covered.add(key)
                elif self.layout == "flat":
                    parts = []
                    for i in c.leaves:
                        whole = ("param", paths[i], key[2])
                        if whole not in keys:
                            raise self._mismatch(f"{paths[i]} has no {key[2]!r} entry")
                        j = keys[whole][0]
                        if tuple(s_leaves[j].shape) != self.shapes[i] \
                                or tuple(tleaves[pos].shape) != (c.numel,):
                            raise self._mismatch(f"{paths[i]}'s {key[2]!r} is not shaped like "
                                                 "the parameter")
                        parts.append(j)
                        covered.add(whole)
                    flat_take.append((pos, parts))
                else:
                    if key not in keys:
                        raise self._mismatch(f"entry {key[2]!r} of {key[1]}")
                    take.append((pos, keys[key][0]))
                    covered.add(key)
            self.maps.append(_ChunkMap(tleaves, tspec, take, flat_take, shared))
        missing = [k for k in keys if k not in covered]
        if missing:
            raise self._mismatch(f"entry {missing[0][-1]!r} of {missing[0][1]} is in no "
                                 "chunk's state")

    def _meta_leaf(self, i: int) -> torch.Tensor:
        return torch.empty(self.shapes[i], dtype=self.dtypes[i], device="meta")

    def _mismatch(self, what: str) -> ValueError:
        hint = (" With layout='flat' the chain must keep a state laid out like the "
                "parameters (element-wise), whatever their shapes; use layout='leaves'."
                if self.layout == "flat" else "")
        return ValueError(f"{self.where}: the transform's state over one chunk does not match "
                          f"its state over all parameters ({what}), so it cannot be run chunk "
                          f"by chunk.{hint}")

    # --- init and adopting a state -------------------------------------------------------

    def init(self, tree: PyTree) -> State:
        """The transform's state over ``tree`` with each chunk's tensors where the plan puts
        them (host chunks in host memory)."""
        leaves = tree_flatten(tree)[0]
        if not self.plan.chunks:              # no leaf here (a rank of zero that owns none)
            state = self.tx.init(tree)
            self._check_head(state)
            self.state_spec = tree_flatten(state)[1]
            return self._outer(state, self._flags(False))
        if self.layout == "flat":
            state = self._init_flat(leaves)
        else:
            placed = list(leaves)
            for c in self.plan.chunks:
                if c.on_host:
                    for i in c.leaves:
                        placed[i] = leaves[i].detach().to(_HOST)
            state = self.tx.init(self.spec.unflatten(placed))
            self._build_maps(state)
        self._check_head(state)
        s_leaves = tree_flatten(state)[0]
        if self.layout != "flat":             # (the flat layout's buffers are pinned whole)
            for k, c in enumerate(self.plan.chunks):
                if c.on_host:
                    for _, j in self.maps[k].take:
                        s_leaves[j] = self._host_memory(s_leaves[j])
        self._place_shared(s_leaves)
        self._live = tree_unflatten(s_leaves, self.state_spec)
        if self.master_params:                # allocated now, started at the first update
            for k, c in enumerate(self.plan.chunks):
                if c.on_host:
                    self._masters[k] = self._new_master(k)
                    self._stale.update(c.leaves)
        return self._outer(self._live, self._flags(False))

    def _init_flat(self, leaves: list[torch.Tensor]) -> State:
        """Flat layout: each chunk's state built over its flat vector, the whole state's
        tensors views of it (so a step finds each chunk's state contiguous, without a copy)."""
        state = _init_on_meta(self.tx, self.spec.unflatten(leaves), lambda: self.spec.unflatten(
            [x.detach() for x in leaves]))
        self._build_maps(state)
        s_leaves, spec = tree_flatten(state)
        for k, c in enumerate(self.plan.chunks):
            dev = _HOST if c.on_host else self.device
            flat = torch.cat([leaves[i].detach().reshape(-1) for i in c.leaves]).to(dev) \
                if c.leaves else torch.empty(0, dtype=c.dtype, device=dev)
            chunk_state = tree_flatten(self.tx.init((flat,)))[0]
            if c.on_host:
                for pos, _ in self.maps[k].flat:
                    chunk_state[pos] = self._host_memory(chunk_state[pos])
            self._scatter_flat(k, chunk_state, s_leaves)
            if k == 0:
                for pos, j in self.maps[k].shared:
                    s_leaves[j] = chunk_state[pos]
        return tree_unflatten(s_leaves, spec)

    def _scatter_flat(self, k: int, chunk_leaves: list[Any], s_leaves: list[Any]) -> None:
        """Write views of chunk ``k``'s flat state tensors into the whole state's leaves. A
        buffer that is the one `_views` recorded for its place (a step that wrote it in place)
        gets the same view objects back, so the next `_chunk_state` finds it without looking
        at the views' storage."""
        c = self.plan.chunks[k]
        for pos, parts in self.maps[k].flat:
            buf = chunk_leaves[pos]
            known = self._views.get((k, pos))
            if known is not None and known[0] is buf:
                views = known[1]
            else:
                views = tuple(buf[off:off + n].view(self.shapes[i])
                              for off, n, i in zip(c.offsets, c.sizes, c.leaves))
                self._views[(k, pos)] = (buf, views, buf.data_ptr())
            for j, view in zip(parts, views):
                s_leaves[j] = view

    def _flat_state(self, k: int, pos: int, parts: list[int], s_leaves: list[Any]
                    ) -> torch.Tensor:
        """The flat state tensor at ``pos`` of chunk ``k`` from the whole state's leaves
        ``parts``: the buffer `_scatter_flat` made them views of when they are those very
        view objects and the buffer is where it was (a few identity tests), else
        `_flat_view` (which checks the storage of every part, or concatenates)."""
        known = self._views.get((k, pos))
        if known is not None:
            buf, views, ptr = known
            if all(s_leaves[j] is v for j, v in zip(parts, views)) and buf.data_ptr() == ptr:
                return buf
        return _flat_view([s_leaves[j] for j in parts], self.plan.chunks[k].numel)

    def _check_head(self, state: Any) -> None:
        """The links run on the device before the chunks must keep no state."""
        for j in range(self.head):
            if not isinstance(state[j] if self.is_chain else state, EmptyState):
                what = f"link {j} of the chain" if self.is_chain else "the transform"
                raise ValueError(
                    f"{self.where}: {what} cannot run chunk by chunk: "
                    f"{_why(traits_of(self.links[j]), self.layout)}; and it keeps state "
                    f"({type(state[j] if self.is_chain else state).__name__}), so it cannot "
                    "run before the chunks either.")

    def _place_shared(self, s_leaves: list[Any]) -> None:
        """Shared tensors (step counts, injected hyperparameters) on the parameters' device."""
        for m in self.maps[:1]:
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
            self.state_spec = tree_flatten(state)[1]
            return self._outer(state, self._flags(False))
        self._build_maps(state)
        self._check_head(state)
        s_leaves = tree_flatten(state)[0]
        for k, c in enumerate(self.plan.chunks):
            self._move_chunk(k, s_leaves, _HOST if c.on_host else self.device)
        self._place_shared(s_leaves)
        self._live = tree_unflatten(s_leaves, self.state_spec)
        if not self.master_params:
            return self._live
        self._take_master(outer)              # started: the leaves with a master given
        return self._outer(self._live, self._flags(True, keep=self._stale))

    def _move_chunk(self, k: int, s_leaves: list[Any], device: torch.device) -> None:
        m, c = self.maps[k], self.plan.chunks[k]
        place = self._host_memory if device == _HOST else lambda x: x.to(device)
        for _, j in m.take:
            s_leaves[j] = place(s_leaves[j])
        if m.flat:
            moved = list(m.template)
            for pos, parts in m.flat:
                moved[pos] = place(_flat_view([s_leaves[j] for j in parts], c.numel))
            self._scatter_flat(k, moved, s_leaves)
        if device != _HOST:
            self._masters.pop(k, None)        # a chunk on the device steps its parameters there

    def _host_memory(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in host memory: page-locked (pinned) when the parameters live on a CUDA
        device, so a host chunk's tensors can be copied to the device asynchronously (a
        chunk moved there by the "auto" warm-up, a master copy sent each step)."""
        x = x.to(_HOST)
        if self.device.type == "cuda" and not x.is_pinned():
            x = x.pin_memory()
        return x

    # --- "auto": the warm-up measurement -------------------------------------------------

    def _probe(self) -> tuple[int, int] | None:
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
        budget = max(0, int(capacity * (1 - _AUTO_MARGIN)) - int(peak))
        on_host = place_chunks([c.state_bytes for c in self.plan.chunks], budget_bytes=budget)
        for k, (c, h) in enumerate(zip(self.plan.chunks, on_host)):
            if c.on_host and not h:
                self._move_chunk(k, s_leaves, self.device)
        self.plan = self.plan.placed(on_host, budget_bytes=budget)
        self.stats.plan = self.plan

    # --- the step ------------------------------------------------------------------------

    def _run(self, grads: PyTree, state: Any, params: PyTree | None,
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
        u, new = self._run(grads, state, params, extra)
        _copy_state(state, new, keep)
        tree_copy_(out, u)
        return new if any(keep) else None

    def _host_run(self, k: int, grads: PyTree, state: Any, params: PyTree | None,
                  extra: dict[str, Any]) -> tuple[PyTree, Any]:
        """Host chunk ``k``'s update: eager, or compiled for the CPU (the state written in
        place, a copy of it unless the caller donates it; the updates into the chunk's
        staging buffer)."""
        if not self.compile:
            self.stats.host_chunk_steps += 1
            return self._run(grads, state, params, extra)
        args, out = self._in_place_args(k, grads, state, params)
        self._compiled_step(k, self._in_place)(*args[:3], extra, args[3])
        return out, args[1]

    def _in_place_args(self, k: int, grads: PyTree, state: Any, params: PyTree | None,
                       clones: dict[int, torch.Tensor] | None = None
                       ) -> tuple[tuple[Any, ...], PyTree]:
        """Host chunk ``k``'s compiled step, prepared: the arguments of `_in_place` but
        ``extra`` (gradients, a state it may write, parameters, out), and ``out``: the
        chunk's staging buffer its updates land in. ``clones``: as `_writable`'s."""
        self.stats.host_chunk_steps += 1
        state = self._writable(state, clones)
        dtype = tree_flatten(grads)[0][0].dtype
        out = self._as_chunk(k, self._updates_buffer(k, dtype))
        return (grads, state, params, out), out

    # --- host_group_mb: several host chunks' compiled steps in one call ------------------

    def _host_groups(self, ks: list[int]) -> dict[int, list[int]]:
        """Host chunks ``ks`` (in order) in groups of consecutive ones whose parameters take
        at most ``host_group_mb`` MiB (a larger chunk alone), each chunk mapped to its group."""
        groups: list[list[int]] = []
        size, cap = 0, self.host_group_mb * _MIB
        for k in ks:
            c = self.plan.chunks[k]
            nbytes = c.numel * c.dtype.itemsize
            if not groups or size + nbytes > cap:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += nbytes
        return {k: g for g in groups for k in g}

    def _group_step(self, group: list[int], staged: dict[int, tuple[Any, ...]],
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
        waited = {k: self._wait_staged(k, staged[k]) for k in group}
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
            state = self._chunk_state(k, s_leaves, [copies[j] for _, j in m.shared])
            if self.master_params:
                args, result = self._master_args(k, g, state, p_leaves, None, clones=clones)
            else:
                args, result = self._in_place_args(k, g, state, p, clones=clones)
            items.append((*args, tuple(keep), tuple(first)))
            results.append(result)
        method = self._master_updates if self.master_params else self._in_places
        with donating(False):       # no chunk's step writes the copies the next one reads
            self._compiled_step(tuple(group), method)(items, extra)
        self.stats.host_seconds += time.perf_counter() - start
        for k, args, result in zip(group, items, results):
            new_states[k] = args[1]
            if self.master_params:
                values[k] = self._send_values(k, result)
            else:
                self._scatter_updates(k, self._send(k, result), out)

    def _master_updates(self, items: list[tuple[Any, ...]], extra: dict[str, Any]) -> None:
        """`_master_update` of several host chunks, in place (one compiled call). Each item
        ends with two bools per leaf of the chunk's state: whether it is a shared tensor
        (one per group, not written by the chunk's step), and whether the chunk writes it
        once all the steps have read it (`_group_step`)."""
        _write_shared_once(items, [
            self._master_update(grads, state, params, extra, into, out, True, shared)
            for grads, state, params, into, out, shared, _ in items])

    def _in_places(self, items: list[tuple[Any, ...]], extra: dict[str, Any]) -> None:
        """`_in_place` of several host chunks (one compiled call); the shared tensors as in
        `_master_updates`."""
        _write_shared_once(items, [self._in_place(grads, state, params, extra, out, shared)
                                   for grads, state, params, out, shared, _ in items])

    def _as_chunk(self, k: int, buf: torch.Tensor) -> PyTree:
        """A staging buffer of chunk ``k`` as the chunk's tree (views shaped like its leaves,
        or the flat vector)."""
        c = self.plan.chunks[k]
        if self.layout == "flat":
            return (buf,)
        return self._chunk_tree(k, [buf[o:o + n].view(self.shapes[i])
                                    for i, o, n in zip(c.leaves, c.offsets, c.sizes)])

    def _updates_buffer(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Host chunk ``k``'s staging buffer for its updates, once the last step's copy to
        the device has read it."""
        self._await_sent(k)
        return self._buffer(k, "updates", dtype)

    def _await_sent(self, k: int) -> None:
        """Wait until the last copy of host chunk ``k``'s updates (or values) to the device
        has read its host buffer."""
        previous = self._sent.pop(k, None)
        if previous is not None:
            previous.synchronize()

    # --- master_params: the host chunks' parameters kept and stepped on the host ---------

    def _new_master(self, k: int, zeros: bool = True) -> torch.Tensor:
        """A master buffer for host chunk ``k``: its parameters back to back, float32 for
        16-bit parameters, in (pinned) host memory; zeros (what a checkpoint holds before the
        first step) or uninitialized."""
        c = self.plan.chunks[k]
        dtype = torch.float32 if c.dtype in (torch.float16, torch.bfloat16) else c.dtype
        make = torch.zeros if zeros else torch.empty
        return make(c.numel, dtype=dtype, device=_HOST, pin_memory=self.device.type == "cuda")

    def _master(self, k: int, p_leaves: list[torch.Tensor]) -> torch.Tensor:
        """Host chunk ``k``'s master copy, started from ``p_leaves`` when the state had none
        (after init, or from a checkpoint without it: `_stale`)."""
        c = self.plan.chunks[k]
        master = self._masters.get(k)
        if master is None:
            master = self._masters[k] = self._new_master(k, zeros=False)
            self._stale.update(c.leaves)
        if self._stale:
            for i, off, n in zip(c.leaves, c.offsets, c.sizes):
                if i in self._stale:
                    master[off:off + n].copy_(p_leaves[i].detach().reshape(-1))
                    self._stale.discard(i)
        return master

    def _master_leaves(self, k: int, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of host chunk ``k``'s master buffer shaped like its leaves: the same view
        objects as last time for the same buffer (so `_take_master` finds it by identity)."""
        known = self._master_views.get(k)
        if known is not None and known[0] is buf:
            return known[1]
        c = self.plan.chunks[k]
        views = tuple(buf[off:off + n].view(self.shapes[i])
                      for i, off, n in zip(c.leaves, c.offsets, c.sizes))
        self._master_views[k] = (buf, views, buf.data_ptr())
        return views

    def _flags(self, value: bool, keep: set[int] | None = None) -> torch.Tensor:
        """A new buffer of the per-leaf ``started`` flags (one bool per leaf, in host
        memory), all ``value``; the leaves in ``keep`` the opposite."""
        flags = torch.full((len(self.shapes),), value, dtype=torch.bool)
        if keep:
            flags[sorted(keep)] = not value
        return flags

    def _outer(self, inner: Any, flags: torch.Tensor) -> Any:
        """The state ``update`` and ``init`` return: ``inner`` (tx's state) alone, or with
        ``master_params`` an `OffloadMasterState` with the host chunks' master buffers as
        views shaped like their leaves, and their ``started`` flags as views of ``flags``
        (the same view objects as last time for the same buffers)."""
        if not self.master_params:
            return inner
        known = self._flag_views
        if known is None or known[0] is not flags:
            known = self._flag_views = (flags, tuple(flags[i] for i in range(len(self.shapes))))
        master: list[Any] = [MaskedNode()] * len(self.shapes)
        started: list[Any] = [MaskedNode()] * len(self.shapes)
        for k, c in enumerate(self.plan.chunks if self.plan is not None else ()):
            buf = self._masters.get(k)
            if c.on_host and buf is not None:
                for i, v in zip(c.leaves, self._master_leaves(k, buf)):
                    master[i], started[i] = v, known[1][i]
        outer = OffloadMasterState(inner, self.spec.unflatten(master),
                                   self.spec.unflatten(started))
        self._live_outer, self._live_started = outer, outer.started
        return outer

    def _flags_buffer_of(self, outer: "OffloadMasterState | None") -> torch.Tensor | None:
        """The flags buffer whose views are ``outer``'s ``started`` flags (as `_outer` made
        them), else None."""
        known = self._flag_views
        if outer is None or known is None:
            return None
        if outer.started is self._live_started:   # the tree `_outer` made last: its views
            return known[0]
        given = self.spec.flatten_up_to(outer.started)
        if all(x is v for x, v in zip(given, known[1]) if isinstance(x, torch.Tensor)):
            return known[0]
        return None

    def _unstarted(self, outer: "OffloadMasterState", leaves: Sequence[int]) -> list[int]:
        """The ``leaves`` whose master in ``outer`` is absent or not started: one test of the
        flags buffer when ``outer``'s flags are the views `_outer` made of it (a load writes
        into them in place), else one per leaf."""
        known = self._flag_views
        if known is not None and outer.started is self._live_started and \
                bool(known[0].all()):
            return []                         # the flags tree `_outer` made last, all set
        given = self.spec.flatten_up_to(outer.started)
        if known is not None and all(given[i] is known[1][i] for i in leaves):
            if bool(known[0][list(leaves)].all()):
                return []
        return [i for i in leaves if not isinstance(given[i], torch.Tensor)
                or not bool(given[i])]

    def _take_master(self, outer: "OffloadMasterState | None") -> None:
        """The master copy of ``outer`` (None: a state without one) as the host chunks'
        master buffers: the views' own buffer when they are the views `_master_leaves` made
        (identity tests), else gathered into one (in host memory). The leaves whose master
        is missing or not started (``outer.started``) start from the parameters at their
        chunk's next step (`_stale`). The state the last ``update`` returned, every flag
        still set (no checkpoint loaded into it since), takes two identity tests and one
        test of the flags buffer."""
        known = self._flag_views
        if outer is not None and outer is self._live_outer and known is not None and \
                outer.started is self._live_started and bool(known[0].all()):
            self._stale = set()               # the state the last update (or init) returned,
            return                            # its masters those buffers, every leaf started
        masters: dict[int, torch.Tensor] = {}
        given = self.spec.flatten_up_to(outer.master) if outer is not None else None
        host = [i for c in self.plan.chunks if c.on_host for i in c.leaves]
        stale = set(host if outer is None else self._unstarted(outer, host))
        for k, c in enumerate(self.plan.chunks):
            if not c.on_host:
                continue
            parts = None if given is None else [given[i] for i in c.leaves]
            buf = None
            if parts is not None and all(isinstance(x, torch.Tensor) for x in parts):
                known = self._master_views.get(k)
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
                    buf = _flat_view(parts, c.numel)
                    if buf.device != _HOST or (self.device.type == "cuda"
                                               and not buf.is_pinned()):
                        buf = self._host_memory(buf)
            elif parts is not None:               # some of its leaves have no master given
                zeros = self._new_master(k)
                for x, i, off, n in zip(parts, c.leaves, c.offsets, c.sizes):
                    if isinstance(x, torch.Tensor):
                        zeros[off:off + n].copy_(x.reshape(-1))
                    else:
                        stale.add(i)
                buf = zeros
            if buf is None:
                buf = self._new_master(k)
                stale.update(c.leaves)
            masters[k] = buf
        # whole, at once: a step started in backward (overlap) runs on the worker thread
        self._masters, self._stale = masters, stale

    def _master_step(self, k: int, grads: PyTree, state: Any, p_leaves: list[torch.Tensor],
                     extra: dict[str, Any], into: torch.Tensor | None = None,
                     master: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """Host chunk ``k``'s update added to its master copy (``master``, else `_master`),
        in place, or into ``into`` (the chunk's second master buffer: the master itself is
        only read), in the same compiled loop with ``compile``; returns the chunk's new
        parameter values (the new master, or its cast to the parameters' dtype in a staging
        buffer) and new state."""
        args, values = self._master_args(k, grads, state, p_leaves, into, master)
        if self.compile:
            self._compiled_step(k, self._master_update)(*args[:3], extra, *args[3:], True)
            return values, args[1]
        return values, self._master_update(*args[:3], extra, *args[3:], False)

    def _master_args(self, k: int, grads: PyTree, state: Any, p_leaves: list[torch.Tensor],
                     into: torch.Tensor | None, master: torch.Tensor | None = None,
                     clones: dict[int, torch.Tensor] | None = None
                     ) -> tuple[tuple[Any, ...], torch.Tensor]:
        """Host chunk ``k``'s master step, prepared: the arguments of `_master_update` but
        ``extra`` and ``state_in_place`` (gradients, state, master, into, out; with
        ``compile`` a state it may write), and the buffer its new values land in. From
        ``master`` when given (a step on the worker thread, which must not read the
        engine's dicts that ``update`` rebuilds meanwhile), else from `_master`.
        ``clones``: as `_writable`'s."""
        self.stats.host_chunk_steps += 1
        c = self.plan.chunks[k]
        if master is None:
            master = self._master(k, p_leaves)
        if into is None and not is_donating():
            # functional: the state given keeps its master; the new one is a new buffer
            into = self._masters[k] = self._new_master(k, zeros=False)
        self._await_sent(k)                   # the last step's values have left the buffers
        params = self._as_chunk(k, master)
        target = None if into is None else self._as_chunk(k, into)
        cast = self._buffer(k, "values", c.dtype) if master.dtype != c.dtype else None
        out = None if cast is None else self._as_chunk(k, cast)
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
        u, new = self._run(grads, state, params, extra)
        if state_in_place:
            _copy_state(state, new, keep)
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

    def _compiled_step(self, k: int | tuple[int, ...], method: Callable) -> Callable:
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
                                                options=_host_compile_options())
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

    def _send_values(self, k: int, flat: torch.Tensor) -> torch.Tensor:
        """Host chunk ``k``'s flat buffer (new parameter values, or updates) on the device: on
        CUDA from pinned memory on the update stream (the caller's stream waits for it), else
        as it is."""
        self.stats.bytes_to_device += flat.numel() * flat.element_size()
        if self.device.type != "cuda":
            return flat
        _, up = self._cuda_streams()
        with torch.cuda.stream(up):
            on_device = flat.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(up)
        on_device.record_stream(torch.cuda.current_stream(self.device))
        self._sent[k] = done
        return on_device

    def _chunk_state(self, k: int, s_leaves: list[Any], shared: list[torch.Tensor] | None
                     ) -> Any:
        """Chunk ``k``'s state: its tensors of the whole state (the flat layout's as one flat
        view each), and the shared ones (``shared``: copies already on its side)."""
        m, c = self.maps[k], self.plan.chunks[k]
        leaves = list(m.template)
        for pos, j in m.take:
            leaves[pos] = s_leaves[j]
        for pos, parts in m.flat:
            leaves[pos] = self._flat_state(k, pos, parts, s_leaves)
        for n, (pos, j) in enumerate(m.shared):
            # each chunk its own copy: a step that writes one in place (donated, or compiled)
            # must not advance the count that the next chunk reads
            leaves[pos] = s_leaves[j].clone() if shared is None else shared[n]
        return tree_unflatten(leaves, m.spec)

    def _write_back(self, k: int, new_state: Any, s_leaves: list[Any], written: set[int]
                    ) -> None:
        """Chunk ``k``'s new state into the whole state's leaves; each shared tensor (a step
        count) from the first chunk written that holds it (``written``: those already taken;
        a chunk without a partition's leaves holds none of that partition's counts)."""
        m = self.maps[k]
        leaves, spec = tree_flatten(new_state)
        if spec != m.spec:
            raise ValueError(f"{self.where}: the transform returned a state of another "
                             "structure than its init's; a state must keep its structure.")
        for pos, j in m.take:
            s_leaves[j] = leaves[pos]
        if m.flat:
            self._scatter_flat(k, leaves, s_leaves)
        for pos, j in m.shared:
            if j not in written:
                written.add(j)
                s_leaves[j] = self._shared_back(leaves[pos], s_leaves[j].device)

    def _shared_back(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A shared tensor computed by a host chunk, back on ``device``: on CUDA through
        pinned memory on the update stream (all chunks on the host: the step count)."""
        if x.device == device:
            return x
        if device.type != "cuda" or x.device.type != "cpu":
            return x.to(device)
        pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)
        _, up = self._cuda_streams()
        with torch.cuda.stream(up):
            out = pinned.to(device, non_blocking=True)
        out.record_stream(torch.cuda.current_stream(device))
        return out

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
            return u, self._outer(new, self._flags(False))
        s_leaves, spec = tree_flatten(state)
        if spec != self.state_spec:
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
            self._take_master(outer)          # its master, or a restart from the params
        if not self.warmed_up:
            self._warm_up(s_leaves)
        extra = {k: v for k, v in extra_args.items() if k not in (TOTALS_KEY, REDUCER_KEY)}
        chunks = self.plan.chunks
        host = [k for k, c in enumerate(chunks) if c.on_host]
        launched = self._take_launched(host, grads, state, s_leaves)
        if self.delayed and (state is not self._live or self._written_since(s_leaves)):
            self._drop_pending()              # another state than ours: start afresh from it
        # delayed: the steps started last time are done before their buffers are refilled
        joined = {k: self._pending.pop(k).result() for k in host if k in self._pending}
        # the host chunks' copies start first; the whole state is only read until the end
        staged = {k: self._stage(k, grads, None if self.master_params else p_leaves,
                                 s_leaves) for k in host if k not in launched}
        values: dict[int, torch.Tensor] = {}      # master_params: new values on the device
        out: list[Any] = [None] * len(grads)
        new_states: dict[int, Any] = {}
        for k, c in enumerate(chunks):                # the device's chunks are queued
            if c.on_host:
                continue
            g = self._chunk_tree(k, [grads[i] for i in c.leaves])
            p = None if p_leaves is None else self._chunk_tree(k, [p_leaves[i] for i in c.leaves])
            u, new_states[k] = self._run(g, self._chunk_state(k, s_leaves, None), p, extra)
            self.stats.device_chunk_steps += 1
            self._scatter_updates(k, u, out)
        groups = {} if self.host_group_mb is None else self._host_groups(
            [k for k in host if k not in launched])
        for k in host:                                # each host chunk as its copy lands
            group = groups.get(k)
            if group is not None and len(group) > 1:
                if k == group[0]:                     # host_group_mb: with its group
                    self._group_step(group, staged, s_leaves, p_leaves, extra, new_states,
                                     values, out)
                continue
            if k in launched and self.master_params:
                values[k], new_states[k], nxt = launched[k]
                # the chunk's two master buffers trade places: the new one is the master now
                # (the old one is the next step's second buffer, unless the caller keeps the
                # state it gave: then the next step writes a new one)
                old, self._masters[k] = self._masters[k], nxt
                if is_donating():
                    self._staging[(k, "master")] = old
                else:
                    self._staging.pop((k, "master"), None)
                self._stale.difference_update(chunks[k].leaves)
                continue
            if k in launched:
                u, new_states[k] = launched[k]
            elif self.delayed:
                u, new_states[k] = self._delayed(k, staged[k], s_leaves, extra, grads,
                                                 joined.get(k))
            elif self.master_params:
                g, _, shared = self._wait_staged(k, staged[k])
                start = time.perf_counter()
                new_values, new_states[k] = self._master_step(
                    k, g, self._chunk_state(k, s_leaves, shared), p_leaves, extra)
                self.stats.host_seconds += time.perf_counter() - start
                values[k] = self._send_values(k, new_values)
                continue
            else:
                g, p, shared = self._wait_staged(k, staged[k])
                start = time.perf_counter()
                u, new_states[k] = self._host_run(k, g, self._chunk_state(k, s_leaves, shared),
                                                  p, extra)
                self.stats.host_seconds += time.perf_counter() - start
                u = self._send(k, u)
            self._scatter_updates(k, u, out)
        self.stats.steps += 1
        written: set[int] = set()                # shared tensors: device chunks' first
        for k in sorted(range(len(chunks)), key=lambda k: chunks[k].on_host):
            self._write_back(k, new_states[k], s_leaves, written)
        if self._streams is not None and host:    # the device waits, not the host
            torch.cuda.current_stream(self.device).wait_stream(self._streams[1])
        if values:                               # master_params: the updates reaching them
            where = [(i, flat[off:off + n].view(self.shapes[i])) for k, flat in values.items()
                     for i, off, n in zip(chunks[k].leaves, chunks[k].offsets, chunks[k].sizes)]
            diffs = torch._foreach_sub([v for _, v in where], [p_leaves[i] for i, _ in where])
            for (i, _), u in zip(where, diffs):
                out[i] = u
        new_state = tree_unflatten(s_leaves, self.state_spec)
        self._live, self._extra = new_state, extra
        if self.delayed or self.overlap:
            self._versions = _versions(s_leaves)
        if self.master_params:                # every host leaf's master holds its value
            flags = self._flags_buffer_of(outer) if is_donating() else None
            if flags is not None:
                flags.fill_(True)             # donated: the buffer the flags given view
            else:
                flags = self._flags(True)
            new_state = self._outer(new_state, flags)
        return tree_unflatten(out, self.spec), new_state

    def _take_launched(self, host: list[int], grads: list[torch.Tensor], state: Any,
                       s_leaves: list[Any]) -> dict[int, tuple[PyTree, Any]]:
        """overlap: the results of the host chunks started in backward on this state. None
        when the state is another, or was written in place since the last ``update`` (a
        checkpoint loaded into it: the steps may have started from the replaced values;
        ``update`` then runs those chunks itself)."""
        if self._launches is None:
            return {}
        if state is not self._live or self._written_since(s_leaves):   # dropped
            self._launches.drain()
            return {}
        out = {}
        for k in host:
            got = self._launches.take(k, [grads[i] for i in self.plan.chunks[k].leaves])
            if got is not None:
                out[k] = got
        return out

    def _delayed(self, k: int, staged: tuple[Any, ...], s_leaves: list[Any],
                 extra: dict[str, Any], grads: list[torch.Tensor],
                 previous: tuple[PyTree, Any] | None) -> tuple[PyTree, Any]:
        """delayed: the step started last time (``previous``: its updates and state), and
        this step's started in the background from that state, functionally (the state
        returned now is not written by it)."""
        if previous is None:                  # the first step: nothing to apply yet
            c = self.plan.chunks[k]
            u = self._chunk_tree(k, [torch.zeros_like(grads[i]) for i in c.leaves])
            state, base = self._chunk_state(k, s_leaves, None), None
        else:
            u, state = previous
            base = state
        self._pending[k] = self._submit(k, self._job, k, staged, s_leaves, dict(extra), False,
                                        base)
        return u, state

    def _written_since(self, s_leaves: list[Any]) -> bool:
        """Whether a tensor of the state the last ``update`` returned was written in place
        since (`opttx.Optimizer.load_state_dict` copies a checkpoint into the live state):
        its version counter moved. The steps then in flight were started from another
        state, and are dropped as for a state that is not ours. (Before the first update
        nothing is recorded: the steps started then read the state as it is.)"""
        return self._versions is not None and _versions(s_leaves) != self._versions

    def _drop_pending(self) -> None:
        for future in self._pending.values():
            future.result()                   # let it finish: its buffers are in use
        self._pending.clear()

    def _scatter_updates(self, k: int, u: PyTree, out: list[Any]) -> None:
        c = self.plan.chunks[k]
        if self.layout == "flat":
            (flat,) = u
            for i, off, n in zip(c.leaves, c.offsets, c.sizes):
                out[i] = flat[off:off + n].view(self.shapes[i])
        else:
            leaves = tree_flatten(u)[0]
            for i, x in zip(c.leaves, leaves):
                out[i] = x

    # --- transfers: pinned staging buffers and side streams on CUDA, plain copies else ---

    def _buffer(self, k: int, what: str, dtype: torch.dtype) -> torch.Tensor:
        """The staging buffer ``what`` of host chunk ``k`` (pinned when the device is CUDA)."""
        buf = self._staging.get((k, what))
        if buf is None or buf.dtype != dtype:
            n = self.plan.chunks[k].numel
            buf = torch.empty(n, dtype=dtype, device=_HOST,
                              pin_memory=self.device.type == "cuda")
            self._staging[(k, what)] = buf
        return buf

    def _cuda_streams(self) -> tuple[Any, Any]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def _stage(self, k: int, grads: list[torch.Tensor], params: list[torch.Tensor] | None,
               s_leaves: list[Any]) -> tuple[Any, ...]:
        """Start copying host chunk ``k``'s gradients (and parameters) into its staging
        buffers, and the shared state tensors (step counts) beside them: on CUDA
        asynchronously on the copy stream, after the work queued so far."""
        c = self.plan.chunks[k]
        sources = [("grads", [grads[i] for i in c.leaves])]
        if params is not None:
            sources.append(("params", [params[i] for i in c.leaves]))
        if any(x.dtype != xs[0].dtype for _, xs in sources for x in xs):
            raise ValueError(f"{self.where}: the gradients (or parameters) of one chunk must "
                             "share a dtype.")
        shared = [s_leaves[j] for _, j in self.maps[k].shared]
        if self.device.type != "cuda":
            bufs = [self._fill(k, what, xs, non_blocking=False) for what, xs in sources]
            return (None, [x.to(_HOST, copy=True) for x in shared], *bufs)
        down, _ = self._cuda_streams()
        down.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(down):
            bufs = [self._fill(k, what, xs, non_blocking=True) for what, xs in sources]
            on_host = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(
                x, non_blocking=True) for x in shared]
            event = torch.cuda.Event()
            event.record(down)
        for _, xs in sources:
            for x in xs:
                x.record_stream(down)
        for x in shared:
            x.record_stream(down)
        return (event, on_host, *bufs)

    def _fill(self, k: int, what: str, xs: list[torch.Tensor], non_blocking: bool
              ) -> torch.Tensor:
        c = self.plan.chunks[k]
        buf = self._buffer(k, what, xs[0].dtype if xs else c.dtype)
        self.stats.bytes_to_host += buf.numel() * buf.element_size()
        for x, off, n in zip(xs, c.offsets, c.sizes):
            buf[off:off + n].copy_(x.detach().reshape(-1), non_blocking=non_blocking)
        return buf

    def _wait_staged(self, k: int, staged: tuple[Any, ...]
                     ) -> tuple[PyTree, PyTree | None, list[torch.Tensor]]:
        """Host chunk ``k``'s staged gradients, parameters and shared tensors, once copied."""
        event, shared, grads, *rest = staged
        if event is not None:
            event.synchronize()
        return (self._as_chunk(k, grads), (self._as_chunk(k, rest[0]) if rest else None),
                shared)

    def _send(self, k: int, u: PyTree) -> PyTree:
        """Host chunk ``k``'s updates on the device: on CUDA through its pinned buffer (the
        compiled step wrote them there) on the other copy stream, which the caller's stream
        waits for, not the host. On a CPU-only machine they are returned as they are; those
        in a staging buffer (rewritten by the next step) are copied unless the caller
        donates (`opttx.Optimizer` applies them before its next step)."""
        c = self.plan.chunks[k]
        leaves, spec = tree_flatten(u)
        if self.device.type != "cuda":
            self.stats.bytes_to_device += sum(x.numel() * x.element_size() for x in leaves)
            if is_donating():
                return u
            staging = {b.untyped_storage().data_ptr() for (kk, _), b in self._staging.items()
                       if kk == k}
            return tree_unflatten([x.clone() if x.untyped_storage().data_ptr() in staging
                                   else x for x in leaves], spec)
        dtype = leaves[0].dtype
        staging = self._staging.get((k, "updates"))
        if staging is None or leaves[0].untyped_storage().data_ptr() != \
                staging.untyped_storage().data_ptr():
            staging = self._updates_buffer(k, dtype)
            if self.layout == "flat":
                staging.copy_(leaves[0])
            else:
                for x, off, n in zip(leaves, c.offsets, c.sizes):
                    staging[off:off + n].copy_(x.reshape(-1))
        flat = self._send_values(k, staging)
        return tree_unflatten(list(self._as_chunk(k, flat)) if self.layout == "flat" else
                              tree_flatten(self._as_chunk(k, flat))[0], spec)


def keyed_paths(tree: PyTree) -> list[str]:
    """The checkpoint name of every leaf of ``tree`` (`opttx.distributed.param_paths`)."""
    from .checkpoint_keys import param_paths
    return param_paths(tree)


# ---------------------------------------------------------------------------------------------
# the single-device transform
# ---------------------------------------------------------------------------------------------


@declare(same_state_as="tx")
def offload(tx: GradientTransformation, fraction: float | str = 1.0, *,
            chunk_size_mb: float = DEFAULT_CHUNK_MB, layout: str = "leaves",
            compile: bool = False, device_budget_mb: float | None = None,
            memory_probe: Callable[[], tuple[int, int]] | None = None,
            stats: OffloadStats | None = None, overlap: bool = False,
            delayed: bool = False, master_params: bool = False,
            host_group_mb: float | None = None) -> GradientTransformation:
    r"""Run ``tx`` with a fraction of its optimizer state, and that part's update, on the host.

    The parameters are packed into chunks (`offload_plan`); the state of the chunks the
    placement puts on the host lives in host memory, and every step, chunk by chunk:

    .. math::
        (u_C, s_C') = \mathrm{tx.update}(g_C, s_C, x_C) \quad \text{on the host for a host
        chunk } C \text{ (} g_C, x_C \text{ copied there, } u_C \text{ copied back), on the
        device otherwise,}

    so a step equals ``tx`` on all leaves (bitwise: the same kernels on the same numbers,
    chunk by chunk) for any chain `check_offloadable` accepts: its links work leaf by leaf
    (``Traits.per_leaf``: adamw, lion, adafactor, came, lamb, 8-bit states, ...), after
    stateless statistics across leaves at its head (`opttx.clip_by_global_norm`, run on the
    device over every leaf first). A wrapper declared to call its inner transform on the
    whole updates (`opttx.declare`'s ``wraps``: `opttx.apply_if_finite`, `opttx.multi_steps`)
    runs around the chunks: ``offload(apply_if_finite(adamw(...), 5))``
    is ``apply_if_finite(offload(adamw(...)), 5)``, one skip decision over every chunk, with
    the same state. Other chains that keep a statistic across leaves are refused with the
    reason; wrap them around the offloaded transform instead
    (``MultiSteps(offload(adamw(...)), 4)``).

    On CUDA each host chunk's gradients and parameters are copied on a side stream into
    pinned staging buffers, the device chunks' updates are queued meanwhile, each host chunk
    computes as soon as its copy has landed, and its updates return on a second side stream
    that the caller's stream waits for (no blocking copy on the device's critical path). On a
    CPU-only machine the copies are plain ordered copies.

    Args:
      tx: the transform (a chain, an alias).
      fraction: the share of the optimizer state to keep on the host, in [0, 1] (the last
        chunks in tree order, `place_chunks`), or ``"auto"``: everything on the host for the
        first step (the warm-up); after its forward and backward, the device memory left
        beside the peak measured so far (``torch.cuda.max_memory_allocated``; less 10 % of
        the device's memory) is the budget, and the first chunks whose state fits move to the
        device. ``device_budget_mb`` gives the budget instead of measuring it.
      chunk_size_mb: the chunk capacity in MiB of parameters (`offload_plan`).
      layout: ``"leaves"`` (default): ``tx`` sees each chunk's leaves in the parameter tree
        (others masked); right for every per-leaf chain. ``"flat"``: ``tx`` sees each chunk
        as one flat vector (`opttx.flatten`), for element-wise chains only: one kernel per
        op and chunk, and with ``compile`` one vectorized loop per chunk. Masks and
        partitions inside ``tx`` then see the flat vector, as with `opttx.flatten`.
      compile: compile the host chunks' update for the CPU with ``torch.compile`` (Inductor;
        the state written in place; the C++ compiler may contract a multiply and an add
        into one fused multiply-add, as DeepSpeed's CPU Adam does: on a 2-core Xeon the
        loop is then as fast as DeepSpeed's). Inductor's kernels round differently from
        eager ones in the last bits (measured, ``benchmarks/offload_compiled_error.py``:
        AdamW's parameters within 0.44 ulp of each leaf's largest magnitude over 6 steps,
        2.4e-7 absolute on a randn leaf; relative to an element near zero that is larger,
        1e-4 at 9e-6), so the bitwise equality with ``tx`` holds with ``compile=False``
        (default). Any chain that offloads compiles so: with ``layout="leaves"`` each
        chunk's step for its leaves' shapes (static), the flat layout's loop with dynamic
        shapes.
      device_budget_mb: with ``"auto"``, the device memory (MiB) for optimizer state.
      memory_probe: with ``"auto"``, ``() -> (peak bytes in use, device capacity bytes)``
        instead of the CUDA counters (tests pass a fake one).
      stats: an `OffloadStats` that records the plan, the chunk steps and the bytes copied.
      overlap: start each host chunk's step during backward, as soon as the gradients of
        all its parameters are there (`opttx.distributed.BackwardLaunches`: post-accumulate-
        grad hooks; the copy to the host and the step run while backward goes on, the step
        on a worker thread); ``update`` then collects them. ``init`` must get the model's
        parameters themselves (``dict(model.named_parameters())``; `opttx.Optimizer` hands
        ``init`` detached copies, so there ``init`` raises a ``ValueError``: run the
        functional loop, docs/guide/offload.md), ``update`` the ``.grad`` tensors backward
        left and the state the last update returned (otherwise the chunks run in
        ``update``). Eager; the statistics across
        leaves at a chain's head (global-norm clipping) need every gradient first, so they
        are refused with it; in gradient accumulation, run the micro-batches before the last
        inside `opttx.distributed.no_sync`. A step started in backward runs functionally
        (its starting state stays intact until ``update`` takes the result): with
        ``compile=True`` one more pass over the chunk's state, eagerly new buffers. A
        checkpoint loaded into the state in place since the last ``update``
        (`opttx.Optimizer.load_state_dict`) makes ``update`` drop the steps started and run
        those chunks itself (the state's version counters moved).
      delayed: the one-step delayed parameter update of ZeRO-Offload (DPU): ``update`` at step
        :math:`t` starts the host chunks' step on step :math:`t`'s gradients in the
        background and returns, for those chunks, the updates computed from step
        :math:`t-1`'s (zeros at the first step), so the host computes while the device runs
        the next forward and backward. A different optimizer: the offloaded parameters
        move by :math:`u(g_{t-1}, x_{t-1})` at step :math:`t`, one step late (check it for
        your model; the paper starts the delay after a few dozen warm-up steps, this option
        from the first). The state ``update`` returns has the host chunks as of step
        :math:`t-1` (a checkpoint drops the step in flight; a run resumed from it moves
        the host chunks by zero at its first step, and so does a run whose live state a
        checkpoint was loaded into, `opttx.Optimizer.load_state_dict`: the steps in flight
        then came from the replaced state and are dropped). Not with ``overlap``.
      master_params: keep the host chunks' parameters on the host too, as ZeRO-Offload does:
        a master copy (float32 for 16-bit parameters, their own dtype otherwise; pinned on
        CUDA), allocated by ``init``, started from the parameters at the first ``update``
        and stepped there, :math:`x_C \leftarrow x_C + u_C` in the same loop as the update (with
        ``compile``, one pass over gradient, state and master: what DeepSpeed's CPU Adam
        reads and writes). The parameters are then not copied to the host each step; the
        new values go to the device instead of the updates (in the parameters' dtype), and
        ``update`` returns for those leaves :math:`\mathrm{fl}(x_C' - x)`, computed on the
        device, so that applying it gives the master's values: exactly whenever a
        parameter's new value is within a factor 2 of its old one (Sterbenz's lemma; a step
        that crosses zero may land one rounding of the difference away, and the next step
        starts again from the master). For 16-bit parameters this is the float32 master
        copy of mixed-precision training: updates below half a bf16 ulp accumulate instead
        of vanishing (`opttx.Optimizer`'s ``stochastic_rounding`` is the alternative
        without a copy). The master is part of the state (`OffloadMasterState`): in place
        inside `opttx.donating` (`opttx.Optimizer`), else into a new buffer, so a state
        given again (a step `opttx.apply_if_finite` dropped) steps from its own master. In
        checkpoints its entries are optional (``"~master"``, ``"~started"``,
        `opttx.declare_optional`): a run resumed from one continues bit for bit, a run
        without the master skips them, and a checkpoint without them (or a state of ``tx``
        alone given to ``update``) starts the master from the parameters, which for 16-bit
        parameters drops its extra bits. Write parameters through the optimizer while it
        runs (the master overwrites other changes; a checkpoint loaded into both the model
        and the optimizer is such a write). With ``overlap`` a step started in backward
        writes the chunk's second master buffer (4 more bytes per parameter on the host),
        which ``update`` swaps in when it takes the step, so a step it drops leaves the
        master as it was. Not with ``delayed``.
      host_group_mb: with ``compile``, the host chunks whose step ``update`` runs itself
        (not those ``overlap`` started in backward) go in groups of consecutive chunks of at
        most this many MiB of parameters, each group one compiled call: the chunks' loops
        run back to back with no Python between them. After a loop over tens of MB the
        caches hold its data, not the interpreter's, and each compiled call's Python takes
        about 0.3 ms instead of 0.04 (2-core Xeon; benchmarks/offload_host_loop.py): with
        32 MiB chunks, about a tenth of the host step (benchmarks/offload.py, AdamW on
        96 M parameters: one call per chunk 1.11x DeepSpeedCPUAdam's time, grouped 0.98x,
        0.983x paired round by round over 100 rounds). The group's chunks share one copy of
        the step count (written once, after all their steps), so their scalar work (bias
        corrections) is computed once, ahead of all the loops
        (`opttx.kernels.CoefficientsFirst`).
        On CUDA a group starts when the copies of all its chunks have landed (a larger
        group overlaps less of the copies to the host with the steps). Each chunk's numbers
        are those of its step alone.
        Default None: one call per chunk. Not with ``delayed``.

    Returns:
      A `GradientTransformation` whose state is ``tx``'s state, laid out as without offload
      (checkpoints move between offloaded runs and runs without offload), its host chunks'
      tensors in host memory; with ``master_params`` an `OffloadMasterState` holding it and
      the master copy (keyed in checkpoints as ``tx``'s state alone, plus the master's
      optional entries). The plan is resolved by ``init`` (or by the first ``update``
      after a restore) and kept: one ``offload`` transform per parameter tree.

    Example:
      >>> tx = opttx.distributed.offload(opttx.adamw(1e-3), fraction=0.5)
      >>> opt = opttx.Optimizer(model.parameters(), tx)      # or functionally:
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)

    References:
      Ren et al., ZeRO-Offload: Democratizing Billion-Scale Model Training (arXiv
      2101.06840); Fang et al., PatrickStar (arXiv 2108.05818), the chunks and placement of
      ColossalAI's Gemini.
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"offload needs a GradientTransformation, got a {type(tx).__name__} "
                        "(did you forget to call the factory?).")
    fraction = _validated_fraction(fraction, "offload")
    _check_chunk_size_mb(chunk_size_mb)
    if overlap and delayed:
        raise ValueError("offload: overlap and delayed do not go together: delayed already "
                         "runs each host step behind the next forward and backward.")
    _check_host_group_mb(host_group_mb, compile, delayed, "offload")
    if master_params and delayed:
        raise ValueError("offload: master_params is not implemented with delayed (its host "
                         "steps run one step behind the parameters the master would follow).")
    if device_budget_mb is not None:
        check_nonnegative("device_budget_mb", device_budget_mb)
        if fraction != "auto":
            raise ValueError("offload: device_budget_mb goes with fraction='auto'.")
    if memory_probe is not None and fraction != "auto":
        raise ValueError("offload: memory_probe goes with fraction='auto'.")
    wrappers, core = peel_wrappers(tx, layout)
    if check_offloadable(core, layout) and overlap:
        raise ValueError("offload(overlap=True): the chain starts with a statistic across "
                         "leaves (global-norm clipping), which needs every gradient before "
                         "any chunk's step; clip inside backward's reach is impossible, so "
                         "use overlap=False (or clip per leaf: clip_by_block_rms).")

    def make() -> _Offloader:
        return _Offloader(core, fraction, layout=layout, compile=compile,
                          budget_mb=device_budget_mb, memory_probe=memory_probe,
                          where="offload", stats=stats, overlap=overlap, delayed=delayed,
                          master_params=master_params, host_group_mb=host_group_mb)

    resolved: list[_Offloader] = []

    def resolve(tree: PyTree) -> _Offloader:
        from .zero import state_costs
        engine = make()
        engine.resolve(tree, costs=state_costs(core, tree), chunk_size_mb=chunk_size_mb)
        resolved[:] = [engine]
        return engine

    adopt = [False]
    # the chunks' run, inside the wrappers peeled off tx (apply_if_finite: one decision over
    # every chunk)
    running = _around(wrappers, core, lambda: resolved[0], adopt)

    def init(params: Params) -> State:
        from ..base import check_init_params
        check_init_params(params)
        engine = resolve(params)
        adopt[0] = False
        state = running.init(params)
        if overlap:
            engine.hook(params)
        return state

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        if not resolved:              # a restored state: planned from the updates, adopted
            resolve(updates)          # by the engine at its first run
            adopt[0] = True
        engine = resolved[0]
        leaves, spec = tree_flatten(updates)
        if spec != engine.spec or any(tuple(x.shape) != s for x, s in zip(leaves, engine.shapes)):
            from ..tree import assert_same_structure
            template = tree_unflatten(list(engine.shapes), engine.spec)
            assert_same_structure(updates, template, "updates and the params given to init")
            raise ValueError("offload: the updates' shapes differ from the params given to "
                             f"init: {[tuple(x.shape) for x in leaves]} vs {engine.shapes}.")
        return running.update(updates, state, params, **extra_args)

    return GradientTransformation(init, update, combine_traits((tx,)))
