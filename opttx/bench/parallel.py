"""Data parallelism for the benchmark when it runs under ``torchrun``.

Every rank draws the same global batches (same seed) and trains on its slice of rows; the
optimizer is wrapped so the ranks stay identical:

* ``zero`` (the default under torchrun): `opttx.distributed.zero` (stage 2) — gradients
  reduce-scattered per chunk, each whole parameter updated by its owner (optimizer state
  divided among the ranks), updates all-gathered;
* ``dp``: `opttx.distributed.all_reduce_gradients` as the first link — every rank holds the
  whole optimizer state.

Both give the single-process run's numbers up to float32 rounding (the global batch's mean
gradient is the mean of the ranks' slice means).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import opttx

MODES = ("auto", "none", "dp", "zero")


@dataclass(frozen=True)
class Parallel:
    """How this process takes part: ``mode`` is ``none`` for a single process."""

    mode: str
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        """Whether this rank prints and writes the report."""
        return self.rank == 0

    def wrap(self, tx: opttx.GradientTransformation) -> opttx.GradientTransformation:
        """``tx`` made data parallel (the identity for a single process)."""
        from opttx.distributed import all_reduce_gradients, zero
        if self.mode == "zero":
            return zero(tx, stage=2)
        if self.mode == "dp":
            return opttx.chain(all_reduce_gradients(), tx)
        return tx

    def local(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of a global batch."""
        if self.world == 1:
            return x, y
        rows = x.shape[0] // self.world
        part = slice(self.rank * rows, (self.rank + 1) * rows)
        return x[part], y[part]

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over the ranks (the global batch's loss)."""
        if self.world == 1:
            return value
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.world

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (a picklable object), in rank order."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def setup(mode: str, device: torch.device, batch_size: int) -> Parallel:
    """Join the ``torchrun`` job when there is one (``WORLD_SIZE`` > 1) and choose the mode:
    ``auto`` is ``zero`` under torchrun and ``none`` otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if mode not in MODES:
        raise ValueError(f"--parallel must be one of {MODES}, got {mode!r}.")
    if world == 1:
        if mode in ("dp", "zero"):
            raise SystemExit(f"--parallel {mode} needs several processes: launch with "
                             "torchrun --nproc_per_node N -m opttx.bench ...")
        return Parallel("none")
    if mode == "none":
        raise SystemExit("--parallel none under torchrun: every rank would train alone.")
    if batch_size % world:
        raise SystemExit(f"--batch-size {batch_size} must be divisible by the {world} ranks.")
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=5))
    return Parallel("zero" if mode == "auto" else mode, rank, world)
