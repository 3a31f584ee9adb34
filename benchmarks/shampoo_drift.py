"""Why compiled and eager opttx.shampoo end at different losses: rounding, amplified.

`shampoo_step.py` shows the compiled Shampoo row ending a little away from its eager twin.
This script separates the two candidate causes on a small tree (a 256 x 64 embedding whose
rows 64 and up never get a gradient, a 64 x 64 matrix and a 64-vector, all float32) with
fixed seeded gradients, ``--steps`` free-running steps, roots recomputed every 5 steps:

  compiled   the same updates under ``torch.compile(fullgraph=True)`` (Inductor), against
             eager: the gap a compiler's different rounding leaves
  one ulp    eager again with every leaf's first gradient moved up by one ulp
             (``torch.nextafter``),
             against eager: the gap Shampoo itself gives to a rounding difference

for epsilon 1e-12 (Meta's default: the factors of the vector and of the unseen rows are
rank-deficient, so a root's norm is about epsilon^(-1/4) and amplifies rounding) and 1e-6.
The figure per leaf is ||a - b|| / ||b - start||, the displacement gap. Equal magnitudes
of the two columns mean the compiled step is as right as eager is stable.

Example:
  python benchmarks/shampoo_drift.py            # about a minute, mostly compiling
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, git_state  # noqa: E402

import torch  # noqa: E402

import opttx  # noqa: E402

SHAPES = {"emb": (256, 64), "w": (64, 64), "b": (64,)}


def gradients(steps: int) -> list[dict]:
    out = []
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 + t)
        g = {k: 0.01 * torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        g["emb"][64:] = 0                      # rows never seen: a rank-deficient factor
        out.append(g)
    return out


def run(tx: opttx.GradientTransformation, params: dict, grads: list[dict],
        compiled: bool) -> dict:
    update = torch.compile(tx.update, fullgraph=True) if compiled else tx.update
    state = tx.init(params)
    for g in grads:
        u, state = update(g, state, params)
        params = opttx.apply_updates(params, u)
    return params


def gaps(a: dict, b: dict, start: dict) -> dict:
    return {k: float((a[k] - b[k]).norm() / (b[k] - start[k]).norm()) for k in a}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    start = {k: 0.02 * torch.randn(s) for k, s in SHAPES.items()}
    grads = gradients(a.steps)
    # every leaf's first gradient one ulp up (the leaves are preconditioned independently)
    nudged = [{k: torch.nextafter(v, torch.full_like(v, 1.0)) if i == 0 else v
               for k, v in g.items()} for i, g in enumerate(grads)]
    print(f"opttx shampoo_drift: {a.steps} steps, roots every 5; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {cpu_model()}; opttx {git_state()}")
    print(f"{'epsilon':>8s} {'leaf':>5s} {'compiled vs eager':>18s} {'one ulp vs eager':>17s}")
    for epsilon in (1e-12, 1e-6):
        def make() -> opttx.GradientTransformation:
            return opttx.shampoo(1e-3, betas=(0.9, 0.999), grafting="adam",
                                 precondition_frequency=5, epsilon=epsilon)
        eager = run(make(), start, grads, compiled=False)
        compiled = gaps(run(make(), start, grads, compiled=True), eager, start)
        ulp = gaps(run(make(), start, nudged, compiled=False), eager, start)
        torch.compiler.reset()
        for k in SHAPES:
            print(f"{epsilon:8.0e} {k:>5s} {compiled[k]:18.2e} {ulp[k]:17.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
