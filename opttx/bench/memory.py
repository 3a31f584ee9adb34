"""Measuring optimizer-state size and peak memory (`LiveTensorTracker`: exact live-tensor
bytes and their peak, on CPU as on CUDA)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import resource
import sys
import weakref
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def tensor_bytes(tree: Any) -> int:
    """Sum ``numel * element_size`` over the distinct tensors reachable in ``tree``.

    Walks dicts, lists, tuples (NamedTuples included) and dataclass instances;
    other leaves are ignored.  A tensor reached twice is counted once.
    """
    seen: set[tuple[int, int, torch.dtype]] = set()
    total = 0
    for node in iter_tensors(tree):
        key = (node.data_ptr(), node.numel(), node.dtype)
        if key not in seen:
            seen.add(key)
            total += node.numel() * node.element_size()
    return total


def storage_bytes(tree: Any, exclude: Any = ()) -> int:
    """Sum of ``nbytes`` over the distinct untyped storages of the tensors in ``tree``: the
    memory they hold (a view counts its whole storage, once), leaving out the storages of
    the tensors in ``exclude`` (for example the parameters, when a state aliases them)."""
    skip = {st._cdata for t in iter_tensors(exclude) if (st := _storage(t)) is not None}
    seen: dict[int, int] = {}
    for t in iter_tensors(tree):
        st = _storage(t)
        if st is not None and st._cdata not in skip:
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def peak_memory_kind(device: torch.device) -> str:
    """Describe what :func:`peak_memory_bytes` measures on ``device``."""
    return "CUDA max allocated" if device.type == "cuda" else "process peak RSS"


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (best effort for the CPU's process RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets the process's peak-RSS high-water mark
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the peak covers the whole process lifetime


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated since the last reset.  CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss if sys.platform == "darwin" else max_rss * 1024  # bytes on macOS, KiB elsewhere


# ---------------------------------------------------------------------------------------------
# live-tensor bytes: an exact peak at the granularity of ATen ops (CPU or CUDA)
# ---------------------------------------------------------------------------------------------


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors reachable in ``tree``, walked as `tensor_bytes` walks it (dicts, lists,
    tuples, NamedTuples, dataclass instances; a dict's keys are not visited)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            yield node
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(getattr(node, f.name) for f in dataclasses.fields(node))


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ...: no plain storage
        return None


# ops whose output shares the storage of an input that was created for them alone
# (``torch.tensor(data)`` builds its tensor with dispatch disabled, then calls lift_fresh)
_FRESH_OPS = ("lift_fresh", "lift_fresh_copy")


class LiveTensorTracker(TorchDispatchMode):
    """Bytes of live tensor storage and their peak, while the mode is active.

    Method: every ATen op run under the mode (forward, backward — the autograd engine carries
    the mode into its hooks and, on CUDA, into its device threads — optimizer steps, factory
    functions) is intercepted after it ran. Each output whose untyped storage is new — not
    already tracked and not the storage of one of the op's inputs (views, in-place and
    ``out=`` ops allocate nothing) — is registered: its ``nbytes`` are added to `live`, `peak`
    is raised to `live`, and a weak reference on the storage object subtracts the bytes
    again when the storage is freed (torch keeps a storage's Python object alive exactly as
    long as the storage itself, so the callback fires at the real free). A storage seen again
    with a larger size (``resize_``) adds the difference.

    ``baseline`` (any tree of tensors: parameters, optimizer state, the batch) is registered
    at construction the same way, so `live` starts at its deduplicated size and drops if a
    baseline tensor is freed inside (an optimizer that replaces its state).

    What it does not see: temporaries that a kernel allocates and frees inside one op (its
    workspace), allocator rounding and caching, and tensors allocated before the mode that
    are not in ``baseline``. The peak is therefore that of live tensors between ops — on CUDA
    compare with ``torch.cuda.max_memory_allocated``, which also counts workspaces and
    rounds every block up to 512 bytes.

    Args:
      baseline: tensors already allocated that count as live from the start.
      device: count only storages on this device (``"cpu"``, ``"cuda"``, ``"cuda:1"``);
        None counts every device together.

    Example:
      >>> tracker = LiveTensorTracker(baseline=[dict(model.named_parameters())])
      >>> with tracker:
      ...     model(x).sum().backward()
      >>> tracker.peak - tracker.start    # bytes above the parameters at the peak
    """

    def __init__(self, baseline: Any = (), device: torch.device | str | None = None) -> None:
        super().__init__()
        self.device = torch.device(device) if device is not None else None
        self._sizes: dict[int, int] = {}               # storage key -> bytes counted
        self._refs: dict[int, weakref.ref] = {}        # storage key -> weak ref with callback
        self.live = 0            # bytes of tracked storages alive now
        self.peak = 0            # the largest `live` seen
        self.allocated = 0       # bytes of all storages registered (baseline included)
        self.n_allocations = 0   # storages registered inside the mode
        self.sections: dict[str, int] = {}             # name -> peak inside `section(name)`
        self.track(baseline)
        self.start = self.live   # the baseline's bytes

    # -- registration -------------------------------------------------------------------------

    def _wanted(self, t: torch.Tensor) -> bool:
        if t.device.type == "meta":
            return False
        if self.device is None:
            return True
        if t.device.type != self.device.type:
            return False
        return self.device.index is None or t.device.index == self.device.index

    def _register(self, st: torch.UntypedStorage) -> bool:
        """Count ``st`` as live; True if it was not tracked yet."""
        key = st._cdata
        nbytes = st.nbytes()
        old = self._sizes.get(key)
        if old is not None:
            if nbytes > old:                            # grown by resize_
                self._sizes[key] = nbytes
                self.live += nbytes - old
                self.allocated += nbytes - old
                self.peak = max(self.peak, self.live)
            return False
        self._sizes[key] = nbytes
        self._refs[key] = weakref.ref(st, functools.partial(self._freed, key))
        self.live += nbytes
        self.allocated += nbytes
        self.peak = max(self.peak, self.live)
        return True

    def _freed(self, key: int, _ref: Any = None) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def track(self, tree: Any) -> int:
        """Register the storages of the tensors in ``tree`` as live; returns the bytes
        added (storages already tracked add nothing)."""
        before = self.live
        for t in iter_tensors(tree):
            if self._wanted(t):
                st = _storage(t)
                if st is not None:
                    self._register(st)
        return self.live - before

    def is_tracked(self, t: torch.Tensor) -> bool:
        st = _storage(t)
        return st is not None and st._cdata in self._sizes

    # -- measurement --------------------------------------------------------------------------

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak = self.live

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Record in ``sections[name]`` the peak reached inside the block (the overall
        `peak` keeps its maximum)."""
        outer = self.peak
        self.peak = self.live
        try:
            yield
        finally:
            self.sections[name] = self.peak
            self.peak = max(outer, self.peak)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        fresh = func.__name__.split(".")[0] in _FRESH_OPS
        inputs: set[int] | None = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or not self._wanted(t):
                continue
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            if key not in self._sizes and not fresh:
                if inputs is None:
                    inputs = {s._cdata for a in tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor) and (s := _storage(a)) is not None}
                if key in inputs:      # a view of an input, an in-place or out= result
                    continue
            if self._register(st):
                self.n_allocations += 1
        return out
