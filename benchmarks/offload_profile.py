"""What runs inside offload's grouped host step, from the profiler.

The grouped variant of `benchmarks/offload.py` (AdamW, ``layout="flat", compile=True,
master_params=True, host_group_mb=1024``, ~96 M float32 parameters in 12 chunks of 32 MiB)
runs 3 untimed steps, then ``--steps`` steps under ``torch.profiler`` (CPU activities) with
Inductor's ``cpp.enable_kernel_profile`` on, so each generated C++ kernel is an event.
Printed per step: the compiled region, the element-loop kernel(s), what the region spends
beside them, Dynamo's cache lookup (guard evaluation), and the calls of the opaque
coefficient op (`opttx.kernels.coefficient`) and of the small scalar kernels (step counts,
bias corrections) with their mean time.

Example:
  PYTHONPATH=$PWD python benchmarks/offload_profile.py --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import git_state  # noqa: E402

import torch  # noqa: E402
import torch._inductor.config  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import offload as bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=5)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, opttx {git_state()}", flush=True)
    torch._inductor.config.cpp.enable_kernel_profile = True
    gen = torch.Generator().manual_seed(0)
    sizes = bench.shapes(args.layers)
    params = [torch.randn(s, generator=gen) * 0.02 for s in sizes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in sizes]
    variant = bench.OpttxVariant(params, grads, True, 32.0, True, 1024.0)
    for _ in range(3):
        variant.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            variant.step()
    events = prof.key_averages()
    per_step = {}
    for e in events:
        per_step[e.key] = (e.count / args.steps, e.cpu_time_total / args.steps / 1e3)

    def total(pick) -> tuple[float, float]:
        hits = [v for k, v in per_step.items() if pick(k)]
        return sum(c for c, _ in hits), sum(ms for _, ms in hits)

    region = total(lambda k: k.startswith("Torch-Compiled Region"))
    loops = total(lambda k: k.startswith("graph_") and "_foreach" in k)
    scalar = total(lambda k: k.startswith("graph_") and "_foreach" not in k)
    lookup = total(lambda k: k == "TorchDynamo Cache Lookup")
    once = total(lambda k: k == "opttx::computed_once")
    print(f"per step, {args.steps} steps profiled:")
    print(f"  compiled region                 {region[1]:8.2f} ms")
    print(f"  element-loop kernel(s)          {loops[1]:8.2f} ms   ({loops[0]:.0f} calls)")
    print(f"  region minus loop kernels       {region[1] - loops[1]:8.2f} ms")
    print(f"  Dynamo cache lookup (guards)    {lookup[1]:8.2f} ms")
    print(f"  opttx::computed_once            {once[0]:8.0f} calls, "
          f"{1e3 * once[1] / max(once[0], 1):.1f} us each")
    print(f"  scalar kernels                  {scalar[0]:8.0f} calls")


if __name__ == "__main__":
    main()
