"""One batched ``torch.linalg.eigh`` against a loop of per-matrix calls, side by side: the
question behind a batched Shampoo/SOAP refresh (same-size factors in one call). Prints, per
(batch, size), the median time of each over interleaved rounds, their ratio, and whether the
eigenpairs agree bit for bit.

Run: ``.venv/bin/python benchmarks/batched_eigh.py [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import cpu_model, git_state

import torch

CASES = [(64, 64), (32, 128), (16, 256), (8, 512)]   # (matrices, size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; commit {git_state()}")
    gen = torch.Generator().manual_seed(0)
    for batch, n in CASES:
        a = torch.randn(batch, n, n, generator=gen)
        a = a @ a.transpose(-1, -2) + 1e-3 * torch.eye(n)     # symmetric positive definite
        batched, loop = [], []
        for _ in range(args.rounds + 1):                       # the first round warms up
            t0 = time.perf_counter()
            w, v = torch.linalg.eigh(a)
            t1 = time.perf_counter()
            each = [torch.linalg.eigh(x) for x in a]
            t2 = time.perf_counter()
            batched.append(t1 - t0)
            loop.append(t2 - t1)
        tb, tl = statistics.median(batched[1:]), statistics.median(loop[1:])
        same = all(torch.equal(w[i], e[0]) and torch.equal(v[i], e[1])
                   for i, e in enumerate(each))
        print(f"{batch:3d} x {n}x{n}: batched {tb * 1e3:7.1f} ms, loop {tl * 1e3:7.1f} ms, "
              f"loop/batched {tl / tb:.2f}, bitwise {same}")


if __name__ == "__main__":
    main()
