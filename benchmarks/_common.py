"""Helpers shared by the benchmark scripts (they run as ``python benchmarks/X.py``, so this
directory is on ``sys.path``: ``from _common import ...``).

Nothing here imports torch or opttx at module level: `early_cache_dir` must run before torch
is imported.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable


def early_cache_dir(prefix: str) -> None:
    """A fresh TORCHINDUCTOR_CACHE_DIR unless --warm-cache or the variable is set.

    Call before torch._inductor reads it: a cold cache makes the compile times honest."""
    if "--warm-cache" not in sys.argv and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=prefix)


def own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own: Dynamo caches compiled graphs per code object, so
    each compiled variant gets its own cache (a second optimizer's step, same source, is not
    counted as a recompile of the first and does not share its cache-size limit)."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------


def cpu_times() -> tuple[float, float, float]:
    """(wall s, CPU s busy on the whole machine, CPU s used by this process)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        fields = [0.0] * 5
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.ru_utime + own.ru_stime


def other_load(since: tuple[float, float, float]) -> float:
    """Cores kept busy by *other* processes since ``since`` (a `cpu_times()`)."""
    wall, busy, own = cpu_times()
    return max(0.0, ((busy - since[1]) - (own - since[2])) / max(wall - since[0], 1e-9))


def wait_idle(max_wait: float, threshold: float = 0.15,
              label: str = "other processes' load before timing:") -> None:
    """Wait (at most ``max_wait`` s) until other processes use < ``threshold`` cores, then
    print ``label`` and the load."""
    deadline = time.perf_counter() + max_wait
    while True:
        t0 = cpu_times()
        time.sleep(1.0)
        load = other_load(t0)
        if load < threshold or time.perf_counter() >= deadline:
            print(f"{label} {load:.2f} cores"
                  + ("" if load < threshold else f" (still busy after --wait-idle {max_wait:g}s)"),
                  flush=True)
            return


def meta_optimizers_dir() -> "os.PathLike[str]":
    """Where Meta's ``distributed_shampoo`` package is read from: ``$OPTTX_META_OPTIMIZERS``
    if set (a copy carried to another machine), else ``shared/refs/meta-optimizers`` beside the
    repository."""
    from pathlib import Path
    env = os.environ.get("OPTTX_META_OPTIMIZERS")
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parents[2] / "shared" / "refs" / "meta-optimizers"


def inductor_workarounds(device_type: str) -> None:
    """Switch off what crashes Inductor in the torch in use (printed when it applies).

    torch < 2.13 on CUDA: the loop reordering after fusion asserts that every node of a fused
    node is a ``SchedulerNode`` (``reorder_loops_by_dep_pair``, scheduler.py) and fails to
    compile Shampoo's step (seen with torch 2.11 on an H100); torch 2.13 returns False there
    instead. ``TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION=0`` is the same switch."""
    import torch
    if device_type == "cuda" and torch.__version__ < "2.13" \
            and torch._inductor.config.loop_ordering_after_fusion:
        torch._inductor.config.loop_ordering_after_fusion = False
        print(f"torch {torch.__version__}: Inductor's loop_ordering_after_fusion switched off "
              "(its assertion fails on Shampoo's graph before torch 2.13)", flush=True)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_state() -> str:
    """The commit of the opttx checkout and whether opttx/ has uncommitted changes."""
    import opttx
    root = os.path.dirname(os.path.dirname(os.path.abspath(opttx.__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "opttx"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit or "unknown") + (" + uncommitted changes in opttx/" if dirty else "")


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)
