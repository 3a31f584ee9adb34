"""How far offload's compiled flat host step (``layout="flat", compile=True``: Inductor's
CPU loop, FMAs contracted) is from eager AdamW: the error bound quoted in the offload
docstring and guide.

Runs AdamW (lr 1e-2, weight decay 0.1) eagerly and through
``offload(..., layout="flat", compile=True)`` on tests/test_offload.py's leaves (1-D to 4-D,
randn) and on a larger randn vector, for ``--steps`` steps of the same gradients, and prints,
over every parameter element: the largest relative error |got - eager| / |eager|, the
|eager| where it occurs, the largest absolute error, and the largest error in units of
float32's spacing at the leaf's largest magnitude (ulp of max |p|). Accuracy, not speed: no
timing.

    python benchmarks/offload_compiled_error.py [--steps 6] [--n 100000]
"""

from __future__ import annotations

import argparse

import torch

import opttx
from opttx.distributed import offload
from opttx.testing import gradient_stream, run_transform


def measure(params: dict[str, torch.Tensor], steps: int, chunk_mb: float) -> dict[str, float]:
    grads = gradient_stream(params, steps, seed=12)
    eager = run_transform(opttx.adamw(1e-2, weight_decay=0.1), params, grads)[0]
    tx = offload(opttx.adamw(1e-2, weight_decay=0.1), 1.0, chunk_size_mb=chunk_mb,
                 layout="flat", compile=True)
    got = run_transform(tx, params, grads)[0]
    worst = {"rel": 0.0, "at": 0.0, "abs": 0.0, "ulps": 0.0}
    for k in params:
        e, g = eager[k].double().reshape(-1), got[k].double().reshape(-1)
        d = (g - e).abs()
        rel = d / e.abs().clamp_min(1e-30)
        i = int(rel.argmax())
        if float(rel[i]) > worst["rel"]:
            worst["rel"], worst["at"] = float(rel[i]), float(e[i].abs())
        worst["abs"] = max(worst["abs"], float(d.max()))
        spacing = float(torch.finfo(torch.float32).eps) * float(e.abs().max())
        worst["ulps"] = max(worst["ulps"], float(d.max()) / spacing)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--n", type=int, default=100_000)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    shapes = {"b": (5,), "w": (6, 5), "v": (6, 5), "tall": (7, 3), "t": (2, 3, 4),
              "q": (2, 3, 2, 2)}
    small = {k: torch.randn(s, generator=gen, dtype=torch.float64).float()
             for k, s in shapes.items()}
    large = {"x": torch.randn(args.n, generator=gen)}
    for name, params, chunk_mb in (("tests/test_offload.py leaves", small, 200 / 2 ** 20),
                                   (f"randn({args.n})", large, 0.1)):
        w = measure(params, args.steps, chunk_mb)
        print(f"{name}, {args.steps} steps: max relative {w['rel']:.2e} (at |p| = "
              f"{w['at']:.2e}), max absolute {w['abs']:.2e}, max {w['ulps']:.2f} ulp of the "
              "leaf's largest |p|")


if __name__ == "__main__":
    main()
