"""The harness of the distributed fault tests (tests/test_faults_distributed.py and
tests/test_faults_overlap_and_consistency_distributed.py): each rank runs named cases in one gloo
process group with a short collective timeout (a regression that hangs fails fast), records
what it saw per case as JSON, and the tests read every rank's records."""

from __future__ import annotations

import datetime
import json
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from opttx.testing import exit_rank

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)


def outcome(fn: Callable[[], Any]) -> dict:
    """``{"error": message or None, "type": exception type, "value": fn() when it returned}``
    (DCP's ``CheckpointException`` derives from ``BaseException`` and is recorded too)."""
    try:
        return {"error": None, "value": fn()}
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - recorded for tests
        return {"error": f"{type(e).__name__}: {e}"[:2000], "type": type(e).__name__}


def run_cases(rank: int, world: int, store: str, out: str,
              cases: dict[str, Callable[[], Any]]) -> None:
    """In a fresh gloo group (one thread per rank, the store a file): each case's record, or
    the traceback of a case that crashed itself, written as ``{out}.{rank}``; then leave."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:  # noqa: BLE001 - a crash of the case itself, reported by its test
            results[name] = {"crash": traceback.format_exc(limit=8)}
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    exit_rank()
