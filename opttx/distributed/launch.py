"""Joining the process group again after ``torchrun`` restarted the workers."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

__all__ = ["init_process_group_for_restarts"]


def init_process_group_for_restarts(backend: str = "gloo",
                                    timeout: datetime.timedelta | None = None,
                                    **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` that works again after ``torchrun`` restarts
    the workers (``--max-restarts``), for instance once a rank was killed.

    Under ``torchrun`` the workers rendezvous through the elastic agent's store, which
    outlives the workers: a restarted group that reuses it reads the dead workers' addresses
    left there by the previous attempt (seen with torch 2.13 and gloo: "Gloo connectFullMesh
    failed ... Connection refused", or a hang). Here every attempt gets a namespace of its own
    in that store (its keys under ``attempt_<TORCHELASTIC_RESTART_COUNT>/``). Outside
    ``torchrun`` (or when the agent's store is not offered to the workers) it is
    ``dist.init_process_group(backend, timeout=timeout, **kwargs)``.

    Args:
      backend: ``"gloo"``, ``"nccl"``, ...
      timeout: the collectives' timeout (None: torch's default).
      kwargs: further arguments of ``init_process_group`` (``device_id``, ...).

    Example:
      >>> # torchrun --nproc_per_node 2 --max-restarts 1 train.py
      >>> opttx.distributed.init_process_group_for_restarts("gloo")   # in train.py
    """
    options = dict(kwargs)
    if timeout is not None:
        options["timeout"] = timeout
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **options)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False,
                          timeout=timeout or datetime.timedelta(seconds=300))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **options)
