"""Gradient communication overlapped with backward, and bf16 on the wire (gloo, CPU).

Each rank trains the same MLP (``--layers`` square layers of width ``--width``, batch
``--batch`` of its own data) and times whole steps — forward, backward, the optimizer's
update, the in-place apply — for four ways of averaging the gradients:

  zero2           ``zero(adamw, stage=2)``: reduce-scatter per chunk after backward
  zero2+overlap   the same chunks, their reduce-scatters started from backward's hooks
  ddp             ``chain(all_reduce_gradients(), adamw)``: all-reduce per bucket after it
  ddp+overlap     the buckets' all-reduces started from backward's hooks

Chunks and buckets are ``--chunk-mb`` MiB, so there are several and the first ones can travel
while autograd computes the gradients of earlier layers. The modes are interleaved: rounds of
``--steps`` timed steps each (after one untimed step), repeated ``--rounds`` times in turn, a
barrier before every step; the table gives each mode's median step time and its ratio to the
mode without overlap. The bytes each rank hands to its collectives per step are counted with
float32 and with bf16 communication (``communication_dtype=torch.bfloat16``).

Examples:
  python benchmarks/overlap.py                      # world 2 and 4
  python benchmarks/overlap.py --worlds 2 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opttx
from opttx.testing import exit_rank
from opttx.distributed import CollectiveStats, all_reduce_gradients, zero

MIB = 1 << 20


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks)


def modes(chunk_mb: float) -> dict[str, Callable[..., opttx.GradientTransformation]]:
    return {
        "zero2": lambda stats, **kw: zero(opttx.adamw(1e-4), stage=2, chunk_size_mb=chunk_mb,
                                         stats=stats, **kw),
        "ddp": lambda stats, **kw: opttx.chain(
            all_reduce_gradients(bucket_size_mb=chunk_mb, stats=stats, **kw),
            opttx.adamw(1e-4)),
    }


class Run:
    """One mode on its own copy of the model."""

    def __init__(self, make: Callable[..., opttx.GradientTransformation], cfg: dict,
                 **kwargs: Any) -> None:
        self.model = make_model(cfg["layers"], cfg["width"])
        self.params = dict(self.model.named_parameters())
        self.stats = CollectiveStats()
        self.tx = make(self.stats, **kwargs)
        self.state = self.tx.init(self.params)
        self.gen = torch.Generator().manual_seed(dist.get_rank())
        self.cfg = cfg

    def step(self) -> float:
        x = torch.randn(self.cfg["batch"], self.cfg["width"], generator=self.gen)
        dist.barrier()
        start = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        self.model(x).square().mean().backward()
        with torch.no_grad():
            updates, self.state = self.tx.update({k: p.grad for k, p in self.params.items()},
                                                 self.state, self.params)
            opttx.apply_updates_(self.params, updates)
        return time.perf_counter() - start


def _worker(rank: int, world: int, store: str, out: str, cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    runs: dict[str, Run] = {}
    for name, make in modes(cfg["chunk_mb"]).items():
        runs[name] = Run(make, cfg)
        runs[f"{name}+overlap"] = Run(make, cfg, overlap=True)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run.step()                                   # untimed
    for _ in range(cfg["rounds"]):
        for name, run in runs.items():
            times[name] += [run.step() for _ in range(cfg["steps"])]
    chunks = {}
    for name, make in modes(cfg["chunk_mb"]).items():
        per_dtype = {}
        for dtype in (None, torch.bfloat16):
            run = Run(make, cfg, communication_dtype=dtype)
            run.stats.reset()
            run.step()
            per_dtype["bf16" if dtype else "fp32"] = run.stats.bytes
            chunks[name] = run.stats.collectives
        per_dtype["collectives"] = chunks[name]
        times[f"{name} bytes"] = per_dtype
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    exit_rank()


def measure(world: int, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="opttx_overlap_") as tmp:
        store, out = Path(tmp) / "store", Path(tmp) / "times.json"
        mp.spawn(_worker, args=(world, str(store), str(out), cfg), nprocs=world, join=True)
        return json.loads(out.read_text())


def table(world: int, res: dict) -> str:
    lines = [f"world {world}: {'mode':<14} {'median ms/step':>15} {'vs no overlap':>14} "
             f"{'collectives':>11} {'KiB/step fp32':>14} {'KiB/step bf16':>14}"]
    for base in ("zero2", "ddp"):
        ref = statistics.median(res[base])
        nbytes = res[f"{base} bytes"]
        for name in (base, f"{base}+overlap"):
            med = statistics.median(res[name])
            lines.append(f"{'':9}{name:<14} {1e3 * med:>15.2f} {med / ref:>13.2f}x "
                         f"{nbytes['collectives']:>11} {nbytes['fp32'] / 1024:>14.1f} "
                         f"{nbytes['bf16'] / 1024:>14.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--chunk-mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    cfg = {k: getattr(args, k) for k in ("layers", "width", "batch", "chunk_mb", "steps",
                                         "rounds")}
    n = args.layers * (args.width + 1) * args.width
    print(f"torch {torch.__version__}, {platform.machine()}, gloo, one thread per rank; MLP "
          f"{args.layers} x {args.width} ({n / 1e6:.1f} M parameters, batch {args.batch}), "
          f"chunks/buckets of {args.chunk_mb} MiB; {args.rounds} rounds x {args.steps} steps "
          "per mode, interleaved")
    for world in (int(w) for w in args.worlds.split(",")):
        print(table(world, measure(world, cfg)))


if __name__ == "__main__":
    main()
