"""Which transforms of the conformance registry offload's compiled host step can trace.

For every entry of `tests/registry.py` that offloads (not refused at init), this runs
``offload(tx, 1.0, compile=True)`` (default ``layout="leaves"``, chunks of ~50 floats on 0-D
to 4-D leaves, as `tests/test_offload.py`) for ``--steps`` steps and compares its parameters
and state with the eager host step's (rtol 1e-5, atol 1e-6: compiled rounding). The host
step is traced with Dynamo's eager backend (what fails to trace is Dynamo's to refuse;
Inductor's builds would take minutes per entry here). ``--dynamic`` overrides the shapes the
host step is compiled with: ``auto`` (offload's own choice: static for ``layout="leaves"``),
``true`` (symbolic sizes, what offload used before 28 Nov) or ``false``. Prints one line per
entry and the failures at the end.

Examples:
  PYTHONPATH=$PWD python benchmarks/offload_compile_check.py                 # about 10 min
  PYTHONPATH=$PWD python benchmarks/offload_compile_check.py --dynamic true --only adafactor kron
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from _common import git_state  # noqa: E402

import torch  # noqa: E402

import opttx  # noqa: E402,F401
from opttx.distributed import offload  # noqa: E402
from opttx.testing import assert_trees_close, gradient_stream, run_transform  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dynamic", choices=["auto", "true", "false"], default="auto")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="registry names to run (default: all)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, opttx {git_state()}, dynamic={args.dynamic}", flush=True)

    compile_ = torch.compile
    dynamic = {"true": True, "false": False}.get(args.dynamic)

    def eager_backend(fn, **kwargs):
        kwargs.pop("options", None)
        if dynamic is not None:
            kwargs["dynamic"] = dynamic
        return compile_(fn, **kwargs, backend="eager")
    torch.compile = eager_backend

    import test_offload as cases                     # the registry and offload's test trees
    torch._dynamo.config.recompile_limit = 64
    failed = []
    for case in cases.RUN:
        if case.name in cases.REFUSED_AT_INIT or (args.only and case.name not in args.only):
            continue
        start = time.perf_counter()
        try:
            params = cases.leaves_0d_to_4d(case)
            grads = gradient_stream(params, args.steps, seed=3)
            expected = run_transform(offload(case.make(), 1.0, chunk_size_mb=cases.CHUNK_MB),
                                     params, grads)
            got = run_transform(offload(case.make(), 1.0, chunk_size_mb=cases.CHUNK_MB,
                                        compile=True), params, grads)
            assert_trees_close(got, expected, rtol=1e-5, atol=1e-6, what=case.name)
            print(f"ok   {case.name:<48}{time.perf_counter() - start:6.1f} s", flush=True)
        except Exception as e:                        # noqa: BLE001 - reported, then summed
            first = (str(e).splitlines() or [""])[0][:160]
            print(f"FAIL {case.name:<48}{type(e).__name__}: {first}", flush=True)
            failed.append(case.name)
    print(f"\n{len(failed)} failed: {failed}")


if __name__ == "__main__":
    main()
