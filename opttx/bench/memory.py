"""Measuring optimizer-state size and peak memory."""

from __future__ import annotations

import dataclasses
import resource
import sys
from typing import Any

import torch


def tensor_bytes(tree: Any) -> int:
    """Sum ``numel * element_size`` over the distinct tensors reachable in ``tree``.

    Walks dicts, lists, tuples (NamedTuples included) and dataclass instances;
    other leaves are ignored.  A tensor reached twice is counted once.
    """
    seen: set[tuple[int, int, torch.dtype]] = set()
    total = 0
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            key = (node.data_ptr(), node.numel(), node.dtype)
            if key not in seen:
                seen.add(key)
                total += node.numel() * node.element_size()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(getattr(node, f.name) for f in dataclasses.fields(node))
    return total


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
