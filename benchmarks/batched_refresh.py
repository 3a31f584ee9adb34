"""A Shampoo / SOAP refresh step (every factor decomposed) with the batched refresh
(`batched_refresh=True`: one ``eigh`` per size group) against the per-factor one
(`batched_refresh=False`: one ``eigh`` per factor), side by side, eager, on the shapes of a
small transformer's layers (``--layers`` blocks of q/k/v/o ``d x d`` and MLP ``d x 4d``,
``4d x d`` matrices, ``--dim d``; the MLP matrices are blocked at ``--block``). Prints the
median step time of each over interleaved rounds, their ratio, the ``eigh`` calls of one
step, and whether the two give the same updates bit for bit.

Run: ``.venv/bin/python benchmarks/batched_refresh.py [--device cpu] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import cpu_model, git_state

import torch

import opttx


def model_shapes(layers: int, d: int) -> dict[str, tuple[int, int]]:
    shapes = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            shapes[f"l{i}.{name}"] = (d, d)
        shapes[f"l{i}.up"] = (4 * d, d)
        shapes[f"l{i}.down"] = (d, 4 * d)
    return shapes


def optimizers(block: int) -> dict:
    return {
        "shampoo": lambda b: opttx.block_by_dims(opttx.precondition_shampoo(
            0.999, 1e-8, 1, 1, batched_refresh=b), block),
        "shampoo eigendecomposed": lambda b: opttx.block_by_dims(opttx.precondition_shampoo(
            0.999, 1e-8, 1, 1, eigendecomposed=True, batched_refresh=b), block),
        "soap (meta, eigh)": lambda b: opttx.block_by_dims(
            opttx.precondition_eigenvalue_corrected(0.999, 1e-8, 1, batched_refresh=b), block),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    print(f"machine: {name}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"commit {git_state()}")
    gen = torch.Generator().manual_seed(0)
    shapes = model_shapes(args.layers, args.dim)
    params = {k: torch.randn(s, generator=gen).to(dev) for k, s in shapes.items()}
    grads = {k: torch.randn(s, generator=gen).to(dev) for k, s in shapes.items()}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"{args.layers} layers, d = {args.dim}, blocks of {args.block}: "
          f"{len(shapes)} matrices")
    for label, make in optimizers(args.block).items():
        txs = {b: make(b) for b in (True, False)}
        states = {b: txs[b].update(grads, txs[b].init(params), params)[1] for b in txs}
        times = {True: [], False: []}
        outs = {}
        for _ in range(args.rounds + 1):                 # the first round warms up
            for b in (True, False):
                sync()
                t0 = time.perf_counter()
                outs[b] = txs[b].update(grads, states[b], params)
                sync()
                times[b].append(time.perf_counter() - t0)
        calls = {}
        for b in (True, False):
            with torch.profiler.profile() as prof:
                txs[b].update(grads, states[b], params)
            calls[b] = sum(e.count for e in prof.key_averages() if e.key == "aten::linalg_eigh")
        tb, tl = statistics.median(times[True][1:]), statistics.median(times[False][1:])
        same = all(torch.equal(x, y) for x, y in zip(
            opttx.tree.tree_leaves(outs[True]), opttx.tree.tree_leaves(outs[False]))
            if isinstance(x, torch.Tensor))
        print(f"{label:24s} batched {tb * 1e3:8.1f} ms ({calls[True]:3d} eigh), per factor "
              f"{tl * 1e3:8.1f} ms ({calls[False]:3d} eigh), per-factor / batched "
              f"{tl / tb:.2f}, bitwise {same}")


if __name__ == "__main__":
    main()
