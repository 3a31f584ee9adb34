"""The Python around offload's grouped host step: where the time outside the compiled loop goes.

`benchmarks/offload.py` times the host step whole (`OffloadStats.host_seconds`); this script
times the engine's own pieces inside one grouped step (AdamW, ``layout="flat",
compile=True, master_params=True, host_group_mb=1024``, the same ~96 M float32 parameters in
32 MiB chunks), by wrapping its private methods with a timer: building each chunk's state
(``_chunk_state``), preparing the master step (``_master_args``), the compiled call, writing
the new state back (``_write_back``), and, where the engine has them, taking the given
state's master copy (``_take_master``) and building the returned one (``_outer``). Medians
over ``--steps`` steps after 3 untimed ones, summed over the chunks of a step. The methods
are private: a piece the engine does not have is reported as absent, so the script runs on
older commits too (run it in a checkout of each, to compare).

Example:
  PYTHONPATH=$PWD python benchmarks/offload_prep.py --steps 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import git_state  # noqa: E402

import torch  # noqa: E402

import opttx  # noqa: E402
from opttx.distributed import OffloadStats, offload  # noqa: E402
from opttx.distributed.chunk_state import ChunkStates  # noqa: E402
from opttx.distributed.host_step import HostSteps  # noqa: E402
from opttx.distributed.masters import Masters  # noqa: E402

# the engine's pieces timed: (its class, the method)
PIECES = {"chunk_state": ChunkStates, "master_args": HostSteps, "write_back": ChunkStates,
          "take": Masters, "outer": Masters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return wrapper
    present = [n for n, cls in PIECES.items() if hasattr(cls, n)]
    for name in present:
        setattr(PIECES[name], name, timed(name, getattr(PIECES[name], name)))
    compiled = HostSteps.compiled_step

    def compiled_step(self, k, method):
        return timed("compiled call", compiled(self, k, method))
    HostSteps.compiled_step = compiled_step

    from offload import shapes
    gen = torch.Generator().manual_seed(0)
    params = {str(i): torch.randn(s, generator=gen) * 0.02
              for i, s in enumerate(shapes(args.layers))}
    grads = {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in params.items()}
    stats = OffloadStats()
    tx = offload(opttx.adamw(1e-3, weight_decay=0.01), 1.0, layout="flat", compile=True,
                 master_params=True, host_group_mb=1024.0, stats=stats)
    state = tx.init(params)
    rows: list[dict[str, float]] = []
    for step in range(3 + args.steps):
        spent.clear()
        stats.reset()
        with opttx.donating():
            updates, state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        if step >= 3:
            rows.append(dict(spent, **{"host step (host_seconds)": stats.host_seconds}))
    n = sum(p.numel() for p in params.values())
    print(f"torch {torch.__version__}, opttx {git_state()}; {n / 1e6:.1f} M parameters, "
          f"{len(stats.plan.chunks)} chunks; medians of {args.steps} steps")
    for name in (*PIECES, "compiled call", "host step (host_seconds)"):
        if name in PIECES and name not in present:
            print(f"{name:<28}   absent")
            continue
        print(f"{name:<28}{1e3 * statistics.median(r.get(name, 0.0) for r in rows):>9.3f} ms")


if __name__ == "__main__":
    main()
