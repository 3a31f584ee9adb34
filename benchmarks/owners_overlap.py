"""`on_owners` plain against in buckets (``on_owners(tx, buckets=...)``), side by side.

Configurations: the plain path, ``buckets=2, 4, 8`` and ``bucket_mb=0.1``. A GPT's block
matrices (per layer: q, k, v, out d x d; MLP up 4d x d, down d x 4d),
tensor-parallel over all ranks (q, k, v, up Shard(0); out, down Shard(1)), run as
``sharded(on_owners(tx, ...), specs)`` with gloo on CPU, world 2 and 4 (one process per rank,
one intra-op thread each, `opttx.testing.spawn_ranks`). Per row: the median wall time of an
eager step over ``--steps`` steps (after one warm-up step) on rank 0, and the fastest
(the configurations take turns step by step, so load changes reach all alike), the number of buckets and
collectives per step, and the ratio to the plain path (below 1: the buckets are faster). The
updates of every row are checked bitwise equal to the plain path's.

Examples:
  python benchmarks/owners_overlap.py                      # muon and shampoo, world 2 and 4
  python benchmarks/owners_overlap.py --worlds 2 --tx muon --layers 2 --dim 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import opttx
from opttx.distributed import CollectiveStats, Shard, local_shard, on_owners, sharded
from opttx.testing import spawn_ranks

TXS = {
    "muon": lambda: opttx.muon(1e-2),
    "shampoo": lambda: opttx.shampoo(1e-2, max_preconditioner_dim=256, precondition_frequency=1,
                                     epsilon=1e-6, grafting="adam"),
}


def model(layers: int, dim: int) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(0)
    full, specs = {}, {}
    for i in range(layers):
        for name, shape, dim_ in (("q", (dim, dim), 0), ("k", (dim, dim), 0),
                                  ("v", (dim, dim), 0), ("o", (dim, dim), 1),
                                  ("up", (4 * dim, dim), 0), ("down", (dim, 4 * dim), 1)):
            full[f"{i}.{name}"] = torch.randn(shape, generator=gen) / dim ** 0.5
            specs[f"{i}.{name}"] = Shard(dim_)
    return full, specs


def worker(rank: int, world: int, name: str, layers: int, dim: int, steps: int,
           configs: list[tuple[int | None, float | None]]) -> list[dict]:
    full, specs = model(layers, dim)
    local = {k: local_shard(v, specs[k]) for k, v in full.items()}
    gen = torch.Generator().manual_seed(1 + rank)
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in local.items()}
             for _ in range(steps + 1)]
    txs, states, times, first = [], [], [], []
    for buckets, mb in configs:
        stats = CollectiveStats()
        tx = sharded(on_owners(TXS[name](), buckets=buckets, bucket_mb=mb), specs, stats=stats)
        txs.append((tx, stats))
        states.append(tx.init(local))
        times.append([])
        first.append(None)
    # the configurations take turns step by step, so that a change in the machine's load
    # reaches all of them alike
    for j, g in enumerate(grads):
        for c, (tx, stats) in enumerate(txs):
            stats.reset()
            start = time.perf_counter()
            u, states[c] = tx.update(g, states[c], local)
            times[c].append(time.perf_counter() - start)
            if j == 0:
                first[c] = u
    rows = []
    for c, (buckets, mb) in enumerate(configs):
        same = all(torch.equal(first[c][k], first[0][k]) for k in full)
        rows.append({"buckets": buckets, "mb": mb, "ms": 1e3 * statistics.median(times[c][1:]),
                     "min": 1e3 * min(times[c][1:]), "collectives": txs[c][1].collectives,
                     "same": same})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--tx", default="muon,shampoo")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--buckets", default="2,4,8", help="numbers of buckets")
    ap.add_argument("--sizes", default="0.1", help="bucket_mb values (MiB)")
    args = ap.parse_args()
    configs: list[tuple[int | None, float | None]] = [(None, None)]
    configs += [(int(b), None) for b in args.buckets.split(",") if b]
    configs += [(None, float(s)) for s in args.sizes.split(",") if s]
    full, _ = model(args.layers, args.dim)
    total = sum(v.numel() * 4 for v in full.values()) / 2**20
    print(f"# {args.layers} layers, d={args.dim}: {len(full)} matrices, {total:.1f} MiB "
          f"float32; median of {args.steps} eager steps, rank 0, gloo on CPU, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads here, 1 per rank")
    print(f"{'world':>5} {'tx':>8} {'buckets':>9} {'colls':>5} {'median ms':>9} "
          f"{'vs plain':>8} {'min ms':>9} {'vs plain':>8} {'bitwise':>7}")
    for world in (int(w) for w in args.worlds.split(",")):
        for name in args.tx.split(","):
            rows = spawn_ranks(worker, world, args=(name, args.layers, args.dim, args.steps,
                                                    configs), timeout=1800)[0]
            plain, low = rows[0]["ms"], rows[0]["min"]
            for r in rows:
                mb = ("plain" if r["mb"] is None and r["buckets"] is None
                      else f"{r['buckets']}" if r["buckets"] is not None else f"{r['mb']:g} MiB")
                print(f"{world:>5} {name:>8} {mb:>9} {r['collectives']:>5} {r['ms']:>9.1f} "
                      f"{r['ms'] / plain:>8.2f} {r['min']:>9.1f} {r['min'] / low:>8.2f} "
                      f"{str(r['same']):>7}", flush=True)


if __name__ == "__main__":
    main()
