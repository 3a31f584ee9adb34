"""The copies of `opttx.distributed.offload` between the device and the host: each host
chunk's pinned staging buffers (its gradients and parameters copied in, its updates or new
values sent out), and on CUDA the two side streams that carry them, so the device's own
work goes on while they run (`Transfers`). On a CPU-only machine they are plain copies.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels import is_donating
from ..tree import PyTree, tree_flatten, tree_unflatten
from .chunk_state import HOST, ChunkStates, OnChunkStates

__all__ = ["Transfers"]


class Transfers(OnChunkStates):
    """The staging buffers and copy streams of one offloaded transform's host chunks
    (``states``: their chunks and layout; ``stats``: an `OffloadStats` counting the bytes)."""

    def __init__(self, states: ChunkStates, stats: Any) -> None:
        self.states = states
        self.stats = stats
        self._staging: dict[tuple[int, str], torch.Tensor] = {}
        self._streams: tuple[Any, Any] | None = None
        self._sent: dict[int, Any] = {}       # CUDA: each host chunk's last update copy

    def keep(self, k: int, what: str, buf: torch.Tensor | None) -> None:
        """Make ``buf`` host chunk ``k``'s staging buffer ``what`` (None: forget it, the
        next `buffer` allocates a new one)."""
        if buf is None:
            self._staging.pop((k, what), None)
        else:
            self._staging[(k, what)] = buf

    def device_waits(self) -> None:
        """The caller's stream waits for the updates sent to the device (the host does
        not); nothing when no copy ran on a side stream."""
        if self._streams is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._streams[1])

    def updates_buffer(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Host chunk ``k``'s staging buffer for its updates, once the last step's copy to
        the device has read it."""
        self.await_sent(k)
        return self.buffer(k, "updates", dtype)

    def await_sent(self, k: int) -> None:
        """Wait until the last copy of host chunk ``k``'s updates (or values) to the device
        has read its host buffer."""
        previous = self._sent.pop(k, None)
        if previous is not None:
            previous.synchronize()

    def buffer(self, k: int, what: str, dtype: torch.dtype) -> torch.Tensor:
        """The staging buffer ``what`` of host chunk ``k`` (pinned when the device is CUDA)."""
        buf = self._staging.get((k, what))
        if buf is None or buf.dtype != dtype:
            n = self.plan.chunks[k].numel
            buf = torch.empty(n, dtype=dtype, device=HOST,
                              pin_memory=self.device.type == "cuda")
            self._staging[(k, what)] = buf
        return buf

    def cuda_streams(self) -> tuple[Any, Any]:
        """The two side streams: copies to the host, copies back to the device."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        return self._streams

    def stage(self, k: int, grads: list[torch.Tensor], params: list[torch.Tensor] | None,
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
            return (None, [x.to(HOST, copy=True) for x in shared], *bufs)
        down, _ = self.cuda_streams()
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
        buf = self.buffer(k, what, xs[0].dtype if xs else c.dtype)
        self.stats.bytes_to_host += sum(c.sizes) * buf.element_size()
        for x, off, n in zip(xs, c.offsets, c.sizes):
            buf[off:off + n].copy_(x.detach().reshape(-1), non_blocking=non_blocking)
        return buf

    def wait_staged(self, k: int, staged: tuple[Any, ...]
                    ) -> tuple[PyTree, PyTree | None, list[torch.Tensor]]:
        """Host chunk ``k``'s staged gradients, parameters and shared tensors, once copied."""
        event, shared, grads, *rest = staged
        if event is not None:
            event.synchronize()
        params = self.states.as_chunk(k, rest[0]) if rest else None
        return self.states.as_chunk(k, grads), params, shared

    def send(self, k: int, u: PyTree) -> PyTree:
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
            staging = self.updates_buffer(k, dtype)
            if self.layout == "flat":
                staging.copy_(leaves[0])
            else:
                for x, off, n in zip(leaves, c.offsets, c.sizes):
                    staging[off:off + n].copy_(x.reshape(-1))
        flat = self.send_values(k, staging)
        return tree_unflatten(list(self.states.as_chunk(k, flat)) if self.layout == "flat" else
                              tree_flatten(self.states.as_chunk(k, flat))[0], spec)

    def send_values(self, k: int, flat: torch.Tensor) -> torch.Tensor:
        """Host chunk ``k``'s flat buffer (new parameter values, or updates) on the device: on
        CUDA from pinned memory on the update stream (the caller's stream waits for it), else
        as it is."""
        self.stats.bytes_to_device += sum(self.plan.chunks[k].sizes) * flat.element_size()
        if self.device.type != "cuda":
            return flat
        _, up = self.cuda_streams()
        with torch.cuda.stream(up):
            on_device = flat.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(up)
        on_device.record_stream(torch.cuda.current_stream(self.device))
        self._sent[k] = done
        return on_device

    def shared_back(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A shared tensor computed by a host chunk, back on ``device``: on CUDA through
        pinned memory on the update stream (all chunks on the host: the step count)."""
        if x.device == device:
            return x
        if device.type != "cuda" or x.device.type != "cpu":
            return x.to(device)
        pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)
        _, up = self.cuda_streams()
        with torch.cuda.stream(up):
            out = pinned.to(device, non_blocking=True)
        out.record_stream(torch.cuda.current_stream(device))
        return out
