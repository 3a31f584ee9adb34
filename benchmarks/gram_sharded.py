"""Orthogonalization of sharded matrices: on the shards with the Gram matrix all-reduced
(`opttx.orthogonalize(sharded_mode="gram")`) against the gathered path, side by side.

For each matrix shape, sharded over rows or columns (``Shard(0)``/``Shard(1)``) across all
ranks of the default group, one step of `orthogonalize` (Newton–Schulz, 5 steps; Gram
Newton–Schulz, restart at step 2) by three paths:

  gram      ``sharded(orthogonalize(method, sharded_mode="gram"), specs)``: the local shard
            iterates, the Gram matrix of the unsharded side all-reduced (6 all-reduces per
            step for Newton–Schulz, 3 for Gram Newton–Schulz, whatever the leaves);
  gathered  every rank all-gathers the matrix (``all_gather_into_tensor``), orthogonalizes it
            whole and keeps its own rows or columns;
  owners    ``sharded(orthogonalize(method), specs, on_owners=True)``: the matrix sent to one
            owner rank (all-to-all), orthogonalized there, the shards sent back.

Times are the median over ``--steps`` steps after one warm-up, of the slowest rank (each step
ends with a barrier), eager, 1 thread per rank (the ranks share the machine's cores). Bytes
are what each rank puts into its collectives per step (the payload; a ring all-reduce moves
about twice its payload, an all-gather or all-to-all about its payload): for gram, the
reducer's count; for gathered, the whole matrix less the own shard; for owners, the shards
sent to the owner and back (its all-to-all buffers, the own part included). Each gram
result is checked against the gathered one (max abs).

Example:
  PYTHONPATH=$PWD python benchmarks/gram_sharded.py                 # world 2 and 4
  PYTHONPATH=$PWD python benchmarks/gram_sharded.py --worlds 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, git_state  # noqa: E402

SHAPES = (((2048, 512), 0), ((512, 2048), 1), ((1024, 1024), 0), ((4096, 256), 0))
METHODS = ("newton_schulz", "gram_newton_schulz")


def _worker(rank: int, world: int, store: str, out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import opttx
    from opttx.distributed import CollectiveStats, Shard, local_shard, sharded
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape, dim in SHAPES:
        full = torch.randn(shape, generator=gen)
        spec = {"w": Shard(dim)}
        local = {"w": local_shard(full, spec["w"])}
        sizes = [torch.tensor_split(torch.empty(shape[dim]), world)[r].numel()
                 for r in range(world)]
        start = sum(sizes[:rank])
        for method in METHODS:
            stats = CollectiveStats()
            gram = sharded(opttx.orthogonalize(method=method, sharded_mode="gram"), spec,
                           stats=stats)
            ostats = CollectiveStats()
            owners = sharded(opttx.orthogonalize(method=method), spec, on_owners=True,
                             stats=ostats)
            whole = opttx.orthogonalize(method=method)
            gram_state, owners_state = gram.init(local), owners.init(local)

            def run_gram():
                return gram.update(local, gram_state)[0]["w"]

            def run_owners():
                return owners.update(local, owners_state)[0]["w"]

            def run_gathered():
                x = local["w"].movedim(dim, 0).contiguous()
                pieces = [torch.empty((n, *x.shape[1:])) for n in sizes]
                if len(set(sizes)) == 1:
                    buf = torch.empty((sum(sizes), *x.shape[1:]))
                    dist.all_gather_into_tensor(buf, x)
                else:
                    dist.all_gather(pieces, x)
                    buf = torch.cat(pieces)
                y = whole.update({"w": buf.movedim(0, dim)}, opttx.EmptyState())[0]["w"]
                return y.narrow(dim, start, sizes[rank])

            times = {}
            for name, fn in (("gram", run_gram), ("gathered", run_gathered),
                             ("owners", run_owners)):
                fn()
                ts = []
                for _ in range(steps):
                    dist.barrier()
                    t = time.perf_counter()
                    fn()
                    dist.barrier()
                    ts.append(time.perf_counter() - t)
                times[name] = statistics.median(ts)
            stats.reset()
            ostats.reset()
            got = run_gram()
            run_owners()
            gram_bytes = stats.bytes
            error = float((got - run_gathered()).abs().max())
            own = local["w"].numel() * 4
            rows.append({"shape": list(shape), "dim": dim, "method": method,
                         "times": times, "gram_bytes": gram_bytes,
                         "collectives": stats.collectives,
                         "gathered_bytes": full.numel() * 4 - own,
                         "owners_bytes": ostats.bytes,
                         "error": error})
    Path(f"{out}.{rank}").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    import torch
    import torch.multiprocessing as mp
    print(f"torch {torch.__version__}, {cpu_model()}, {os.cpu_count()} cores, "
          f"opttx {git_state()}", flush=True)
    for world in (int(w) for w in args.worlds.split(",")):
        tmp = Path(tempfile.mkdtemp(prefix="gram_sharded"))
        mp.start_processes(_worker, args=(world, str(tmp / "store"), str(tmp / "out"),
                                          args.steps), nprocs=world, join=True,
                           start_method="spawn")
        ranks = [json.loads(Path(f"{tmp / 'out'}.{r}").read_text()) for r in range(world)]
        print(f"\nworld {world} (gloo): ms per step (slowest rank), KiB into collectives per "
              "step (rank 1), time ratios against gram")
        print(f"{'shape':>11} {'shard':>5} {'method':<19} {'gram':>8} {'gathered':>9} "
              f"{'owners':>8} {'gath/gram':>9} {'own/gram':>8} {'KiB gram':>9} "
              f"{'KiB gath':>9} {'KiB own':>8} {'calls':>5} {'max|diff|':>9}")
        for i, row in enumerate(ranks[0]):
            t = {k: max(r[i]["times"][k] for r in ranks) * 1e3 for k in row["times"]}
            one = ranks[1][i]
            side = "rows" if row["dim"] == 0 else "cols"
            print(f"{'x'.join(map(str, row['shape'])):>11} {side:>5} "
                  f"{row['method']:<19} {t['gram']:8.1f} {t['gathered']:9.1f} "
                  f"{t['owners']:8.1f} {t['gathered'] / t['gram']:9.2f} "
                  f"{t['owners'] / t['gram']:8.2f} {one['gram_bytes'] / 1024:9.1f} "
                  f"{one['gathered_bytes'] / 1024:9.1f} {one['owners_bytes'] / 1024:8.1f} "
                  f"{row['collectives']:5d} {max(r[i]['error'] for r in ranks):9.1e}")


if __name__ == "__main__":
    main()
