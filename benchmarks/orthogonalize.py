"""Orthogonalization: accuracy of each method against SVD's polar factor, one
batched product per shape group against one matrix at a time, and the bench GPT's final
loss for muon, normuon, dion (rank fraction 0.25) and adamw side by side.

1. Error against the exact polar factor :math:`UV^\\top` (``polar_factor``, float64 SVD) of
   Gaussian matrices, for ``orthogonalize``'s methods (Newton–Schulz with Keller Jordan's
   coefficients, Polar Express, Gram Newton–Schulz with either coefficient set) in float32
   and bfloat16: the spectral-norm distance ``||O - UV^T||_2`` (set by the smallest singular
   values, which no 5-step polynomial lifts to 1), the relative Frobenius distance, and the
   range of the singular values of ``O`` over the top 90% of the spectrum.
2. Time per step for ``--count`` (default 24) same-shaped ``--size`` x ``--size`` (1024)
   float32 matrices as leaves of one tree: ``orthogonalize()`` (one batched product per
   step for all of them) against ``orthogonalize(batched=False)`` (one matrix at a time),
   timed round-robin in one process (the ratio is what to read; the machine is shared).
3. ``python -m opttx.bench --optimizers adamw,muon,normuon,dion`` (dion at rank fraction
   0.25, its bench setting), its final train and held-out losses (``--bench-steps``).

Examples:
  python benchmarks/orthogonalize.py                 # everything (CPU: a few minutes)
  python benchmarks/orthogonalize.py --quick         # 256 x 256, fewer repeats, 60 steps
  python benchmarks/orthogonalize.py --skip-bench --device cuda   # GPU: sections 1 and 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import opttx
from opttx.transforms.orthogonalize import (NS_COEFFS, POLAR_EXPRESS_COEFFS,
                                            gram_newton_schulz, newton_schulz, polar_factor)

from _common import cpu_model, git_state  # noqa: E402  (benchmarks/ is on sys.path)

NS5 = [NS_COEFFS] * 5
METHODS = {
    "newton_schulz": lambda x, dt: newton_schulz(x, NS5, 1e-7, dt),
    "polar_express": lambda x, dt: newton_schulz(x, POLAR_EXPRESS_COEFFS, 1e-7, dt,
                                                 norm_scale=1.02),
    "gram_ns": lambda x, dt: gram_newton_schulz(x, NS5, 1e-7, dt),
    "gram_polar_express": lambda x, dt: gram_newton_schulz(x, POLAR_EXPRESS_COEFFS, 1e-7, dt,
                                                           norm_scale=1.02),
}


def accuracy(shapes: list[tuple[int, int]], device: str) -> None:
    print("\n## 1. error against SVD's polar factor (Gaussian matrices)\n")
    print("| shape | method | dtype | ‖O − UVᵀ‖₂ | ‖O − UVᵀ‖_F / ‖UVᵀ‖_F | "
          "sv(O), top 90% |")
    print("| --- | --- | --- | --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        g = torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
        exact = polar_factor(g)
        for name, fn in METHODS.items():
            for dt in (torch.float32, torch.bfloat16):
                o = fn(g.float(), dt).double()
                spec = float(torch.linalg.matrix_norm(o - exact, ord=2))
                fro = float((o - exact).norm() / exact.norm())
                sv = torch.linalg.svdvals(o)
                top = sv[: max(1, int(0.9 * sv.numel()))]
                print(f"| {shape[0]}x{shape[1]} | {name} | {str(dt)[6:]} | {spec:.3f} | "
                      f"{fro:.3f} | {float(top.min()):.3f}-{float(top.max()):.3f} |")


def timing(count: int, size: int, repeats: int, device: str) -> None:
    print(f"\n## 2. {count} same-shaped {size}x{size} float32 matrices: batched vs one at a "
          "time\n")
    gen = torch.Generator().manual_seed(1)
    tree = {f"w{i}": torch.randn(size, size, generator=gen).to(device) for i in range(count)}
    rows = []
    for method in ("newton_schulz", "polar_express"):
        variants = {"batched": opttx.orthogonalize(method=method),
                    "per matrix": opttx.orthogonalize(method=method, batched=False)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for tx in variants.values():          # warm-up
            tx.update(tree, opttx.EmptyState())
        for r in range(repeats):              # round-robin, alternating the first
            order = list(variants.items())
            for name, tx in (order if r % 2 == 0 else order[::-1]):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                tx.update(tree, opttx.EmptyState())
                if device == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
        b, p = statistics.median(times["batched"]), statistics.median(times["per matrix"])
        rows.append((method, b, p))
    print("| method | batched s/step | per matrix s/step | per matrix / batched |")
    print("| --- | --- | --- | --- |")
    for method, b, p in rows:
        print(f"| {method} | {b:.3f} | {p:.3f} | {p / b:.2f}x |")


def bench_losses(steps: int) -> None:
    from opttx.bench.cli import main
    print(f"\n## 3. bench GPT ({steps} steps): final losses\n")
    results = main(["--optimizers", "adamw,muon,normuon,dion", "--steps", str(steps),
                    "--out", "/tmp/opttx-bench-orthogonalize"])
    print("| optimizer | final train loss | held-out loss | step time ms (median) |")
    print("| --- | --- | --- | --- |")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | |")
            continue
        print(f"| {name} | {r['final_train_loss']:.4f} | {r['final_eval_loss']:.4f} | "
              f"{r['step_time_ms']:.1f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bench-steps", type=int, default=150)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.repeats, args.bench_steps = 256, 2, 60
    print(f"# benchmarks/orthogonalize.py: {cpu_model()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, opttx {git_state()}")
    accuracy([(256, 256), (256, 1024), (1024, 256)], args.device)
    timing(args.count, args.size, args.repeats, args.device)
    if not args.skip_bench:
        bench_losses(args.bench_steps)


if __name__ == "__main__":
    sys.exit(main())
