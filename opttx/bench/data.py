"""Byte-level language-modelling data built from the Python standard library's source.

The corpus needs no download: it is the concatenation of the standard library's
``.py`` files, read in a sorted, deterministic order up to a byte budget, and
tokenised at the byte level (vocabulary of 256).  The tail of the corpus is held
out for evaluation, so held-out text comes from files never seen in training.  The
learning-rate sweep holds out a validation split of the same length from the training
stream's tail (`Corpus.validation_split`): its runs train on what precedes it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

VOCAB_SIZE = 256
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

Batch = tuple[torch.Tensor, torch.Tensor]


def stdlib_source(max_bytes: int) -> bytes:
    """Return up to ``max_bytes`` of standard-library Python source.

    Files are visited with a sorted ``os.walk`` from the directory holding
    ``os.py``, skipping third-party package directories, so the result depends
    only on the Python installation.
    """
    root = os.path.dirname(os.__file__)
    chunks: list[bytes] = []
    remaining = max_bytes
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                chunk = f.read(remaining)
            chunks.append(chunk)
            remaining -= len(chunk)
            if remaining == 0:
                return b"".join(chunks)
    return b"".join(chunks)


@dataclass(frozen=True)
class Corpus:
    """Train and held-out byte streams (``uint8`` tensors on the CPU)."""

    train: torch.Tensor
    heldout: torch.Tensor

    @classmethod
    def from_stdlib(cls, max_bytes: int, heldout_fraction: float) -> Corpus:
        """Load the stdlib corpus and hold out its last ``heldout_fraction``."""
        data = torch.frombuffer(bytearray(stdlib_source(max_bytes)), dtype=torch.uint8)
        split = int(len(data) * (1.0 - heldout_fraction))
        return cls(train=data[:split], heldout=data[split:])

    def validation_split(self) -> Corpus:
        """The learning-rate sweep's corpus: the training stream less its tail, and that tail
        (as long as the held-out split) held out as the validation split.

        The sweep scores its runs on this tail, so the held-out split that the final table
        reports is never used to choose a learning rate.
        """
        split = len(self.train) - len(self.heldout)
        if split <= 0:
            raise ValueError(f"the training stream ({len(self.train)} bytes) is not longer "
                             f"than the held-out split ({len(self.heldout)} bytes): no room "
                             "for a validation split of the same length")
        return Corpus(train=self.train[:split], heldout=self.train[split:])


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int, device: torch.device) -> Batch:
    """Cut ``seq_len + 1`` byte windows at ``starts`` into (input, next-byte target) pairs."""
    tokens = data[starts[:, None] + torch.arange(seq_len + 1)].to(device=device, dtype=torch.long)
    return tokens[:, :-1], tokens[:, 1:]


def train_batches(
    data: torch.Tensor, batch_size: int, seq_len: int, seed: int, device: torch.device
) -> Iterator[Batch]:
    """Yield an endless stream of random windows, fully determined by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        yield _windows(data, starts, seq_len, device)


def heldout_batches(
    data: torch.Tensor, batch_size: int, seq_len: int, num_batches: int, device: torch.device
) -> list[Batch]:
    """Return a fixed list of non-overlapping windows spread evenly over ``data``."""
    num_windows = min(num_batches * batch_size, (len(data) - 1) // seq_len)
    if num_windows == 0:
        raise ValueError(f"held-out split ({len(data)} bytes) is shorter than one window "
                         f"of {seq_len + 1}")
    stride = (len(data) - 1 - seq_len) // max(num_windows - 1, 1)
    starts = torch.arange(num_windows) * stride
    return [_windows(data, chunk, seq_len, device) for chunk in starts.split(batch_size)]
