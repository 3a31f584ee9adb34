"""How long `opttx.testing.spawn_ranks` takes to run a trivial function on two ranks, started
from its fork server (the default where the platform has one) and as fresh interpreters
(``"spawn"``, what it did before), interleaved call by call.

A fresh interpreter imports torch and opttx before it can run anything; a rank forked from
the server has them already (the server imports them once, at the first call: that call is
not timed). The difference, times the number of spawned worlds, is what the test suite saves.

Example:
  python benchmarks/spawn_ranks.py --calls 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, git_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()

    import torch

    import opttx.testing as testing
    print(f"torch {torch.__version__}, {cpu_model()}, opttx {git_state()}", flush=True)
    default = testing._start_method
    methods = {"fork server (default)": default, "spawn": lambda: "spawn"}
    testing.spawn_ranks(max, args.world)                   # starts the fork server: untimed
    times: dict[str, list[float]] = {name: [] for name in methods}
    try:
        for _ in range(args.calls):
            for name, method in methods.items():
                testing._start_method = method
                t = time.perf_counter()
                ranks = testing.spawn_ranks(max, args.world)  # fn(rank, world) = world
                times[name].append(time.perf_counter() - t)
                assert ranks == [args.world] * args.world
    finally:
        testing._start_method = default
    print(f"\n{args.world} ranks, {args.calls} calls each (default start method here: "
          f"{default()!r}): median s per call (min)")
    for name, ts in times.items():
        print(f"  {name:<24}{statistics.median(ts):8.2f}  ({min(ts):.2f})")


if __name__ == "__main__":
    main()
