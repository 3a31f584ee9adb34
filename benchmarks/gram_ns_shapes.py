"""Newton–Schulz against Gram Newton–Schulz per matrix shape, on one device.

What one device can time of the sharded Muon step: the local work per shape. For each shape
(by default the hidden matrices of Llama-3 8B, whole and as the 8-way tensor-parallel slices a
rank holds), `opttx.newton_schulz` and `opttx.gram_newton_schulz` (the same iterate computed on
the Gram matrix of the smaller side, the form the sharded Gram mode runs) on a batch of
same-shaped matrices, interleaved round by round; prints the median time of each, their ratio,
and the largest difference of the results (bfloat16 iterations as Muon runs them on CUDA,
float32 on the CPU).

  python benchmarks/gram_ns_shapes.py --device cuda                 # the GPU session's section
  python benchmarks/gram_ns_shapes.py --shapes 256x64,64x256 --batch 4   # a quick CPU run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import opttx

# Llama-3 8B's hidden matrices (out x in): q/o 4096 x 4096, k/v 1024 x 4096, gate/up
# 14336 x 4096, down 4096 x 14336; and an 8-way tensor-parallel rank's slices of them
LLAMA3_8B = ["4096x4096", "1024x4096", "14336x4096", "4096x14336",
             "512x4096", "128x4096", "1792x4096", "4096x1792"]


def _time(fn, x: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default=",".join(LLAMA3_8B))
    parser.add_argument("--batch", type=int, default=4, help="matrices of each shape")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    coeffs = opttx.NS_COEFFS
    steps = [coeffs] * 5 if isinstance(coeffs[0], (int, float)) else list(coeffs)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return opttx.newton_schulz(x, steps, dtype=dtype)

    def gram(x: torch.Tensor) -> torch.Tensor:
        return opttx.gram_newton_schulz(x, steps, dtype=dtype)

    print(f"# {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, iterations in {dtype}, batch {args.batch}, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'shape':>12} {'NS ms':>9} {'Gram NS ms':>11} {'NS / Gram':>10} {'max |diff|':>11}")
    gen = torch.Generator(device=device).manual_seed(0)
    for text in args.shapes.split(","):
        m, n = (int(v) for v in text.split("x"))
        x = torch.randn(args.batch, m, n, device=device, generator=gen)
        a, b = plain(x), gram(x)                       # warm-up, and the difference
        diff = (a.float() - b.float()).abs().max().item()
        times: dict[str, list[float]] = {"ns": [], "gram": []}
        for _ in range(args.rounds):
            times["ns"].append(_time(plain, x))
            times["gram"].append(_time(gram, x))
        t_ns, t_gram = (statistics.median(times[k]) * 1e3 for k in ("ns", "gram"))
        print(f"{text:>12} {t_ns:9.2f} {t_gram:11.2f} {t_ns / t_gram:10.2f} {diff:11.2e}")


if __name__ == "__main__":
    main()
