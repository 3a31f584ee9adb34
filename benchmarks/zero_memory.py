"""Optimizer-state bytes per rank and collectives per step under `opttx.distributed.zero`.

Every optimizer runs as ``opttx.distributed.zero(tx, stage=2)`` on the parameter tree of a
pre-norm GPT (16 tensors per block, 6 outside: 198 tensors and 2.4 M parameters with the
defaults, float32) over world sizes 1, 2 and 4 (``torch.multiprocessing.spawn``, gloo, one
spawn per world size, one thread per rank), once with the chunk capacity searched (the
default, 32 to 64 MiB: one chunk for this model) and with 4 MiB and 1 MiB chunks (several
chunks, so that the count of collectives is tested against more than one; 1 MiB at world 4 is
a capacity of exactly world x the largest parameter, where the packing pads badly).

Figures (eager, seeded random gradients, ``--steps`` steps; ``init`` not counted):

  state/rank   the distinct storage bytes of the tensors in each rank's zero state after the
               steps (``tx``'s state over the leaves the rank owns, counters included); the
               largest over the ranks is shown, with the smallest beside it
  single       the same bytes for ``tx.init`` + the same steps on one device, no zero
  ratio        largest state/rank / (single / N): 1.00 is a perfect 1/N split; the target
               is <= 1.05, plus the padding fraction (padding / parameter bytes), which only
               the gradient and update chunks carry ("yes, by padding": within the target
               only thanks to that allowance)
  by-state     the ratio a split of whole leaves balanced by their own state bytes would
               give (greedy, largest first, over the per-leaf ``tx.init`` bytes): what
               balancing owners by state rather than by parameter bytes could reach
  padding      the bytes of the chunks that hold no parameter (`ZeroPlan.padding_bytes`),
               and their share of the parameter bytes
  coll/step    the collectives `CollectiveStats` counts in one ``update`` (a count that
               varies between steps prints as ``min-max``), against 2 x chunks (one
               reduce-scatter and one all-gather per chunk); with ``--split``, plus the
               all-reduces of the split leaves' statistics across their segments (Adafactor
               2, CAME 3, LAMB 1, AdamW 0: one per reduction-hook call, not per leaf)

Owners hold whole parameters, balanced by parameter bytes (`zero_plan`; zero's default): the
state split is as even as the parameter split for AdamW (8 bytes per parameter), but not for
optimizers whose state is not proportional to the parameter bytes (Adafactor's row and column
factors, Shampoo's m x m and n x n factors per block); ``--balance state`` runs
``zero(..., balance="state")``, which balances each parameter's state bytes instead. No
timing is taken.

A model whose token embedding holds a large share of the parameters (``--embedding-share
0.4``: the vocabulary sized so, the head kept at 256 rows) puts that share of the state on the
embedding's owner whatever the world size; ``--split`` runs ``zero(..., split_above_mb=...)``
just below the embedding's size, which splits it into one row segment per rank (`zero_plan`).

Examples:
  python benchmarks/zero_memory.py                    # world 1, 2, 4; adamw, adafactor, shampoo
  python benchmarks/zero_memory.py --worlds 2 --only adamw --blocks 4
  python benchmarks/zero_memory.py --worlds 2,4 --only adamw,adafactor,came,lamb \
      --embedding-share 0.4 --split --balance state
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opttx
from opttx.base import traits_of
from opttx.distributed import CollectiveStats, state_costs, zero, zero_plan
from opttx.testing import exit_rank
from opttx.tree import tree_leaves

OPTIMIZERS = ("adamw", "adafactor", "shampoo", "came", "lamb")
DEFAULT = ("adamw", "adafactor", "shampoo")
CHUNKS = {"searched": None, "4 MiB": 4.0, "1 MiB": 1.0}     # label -> chunk_size_mb


def gpt_shapes(blocks: int, d: int, vocab: int = 256, seq: int = 64,
               embedding_share: float | None = None) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of a pre-norm GPT with separate q, k, v projections and a 4x MLP;
    with ``embedding_share``, the token embedding's rows are chosen so that it holds that
    share of the parameters (the head keeps ``vocab`` rows)."""
    shapes: dict[str, tuple[int, ...]] = {"tok": (vocab, d), "pos": (seq, d)}
    for i in range(blocks):
        b = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            shapes[b + ln + ".weight"] = (d,)
            shapes[b + ln + ".bias"] = (d,)
        for name, shape in (("attn.q", (d, d)), ("attn.k", (d, d)), ("attn.v", (d, d)),
                            ("attn.out", (d, d)), ("mlp.up", (4 * d, d)),
                            ("mlp.down", (d, 4 * d))):
            shapes[b + name + ".weight"] = shape
            shapes[b + name + ".bias"] = (shape[0],)
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    shapes["head"] = (vocab, d)
    if embedding_share is not None:
        rest = sum(torch.Size(s).numel() for k, s in shapes.items() if k != "tok")
        shapes["tok"] = (round(embedding_share / (1 - embedding_share) * rest / d), d)
    return shapes


def make_tx(name: str) -> opttx.GradientTransformation:
    if name == "adamw":
        return opttx.adamw(1e-3, weight_decay=0.01)
    if name == "adafactor":
        return opttx.adafactor(1e-2)                  # optax's defaults: factored >= 128
    if name == "shampoo":
        return opttx.shampoo(1e-3, grafting="adam", precondition_frequency=10)
    if name == "came":
        return opttx.came(2e-4, weight_decay=0.01)
    if name == "lamb":
        return opttx.lamb(1e-3, weight_decay=0.01)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def state_bytes(state: Any) -> int:
    """Distinct storage bytes of the tensors in ``state`` (a shared buffer counted once)."""
    seen: dict[tuple[int, int], int] = {}
    for x in tree_leaves(state):
        if isinstance(x, torch.Tensor) and x.numel():
            s = x.untyped_storage()
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def problem(shapes: dict[str, tuple[int, ...]], seed: int, steps: int
            ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    gen = torch.Generator().manual_seed(1000 + seed)
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()}
             for _ in range(steps)]
    return params, grads


def single_device(shapes: dict[str, tuple[int, ...]], only: list[str], steps: int
                  ) -> dict[str, int]:
    """State bytes of every optimizer on one device, after the same number of steps."""
    params, grads = problem(shapes, 0, steps)
    out = {}
    for name in only:
        tx = make_tx(name)
        state = tx.init(params)
        for g in grads:
            _, state = tx.update(g, state, params)
        out[name] = state_bytes(state)
    return out


def per_leaf_state(shapes: dict[str, tuple[int, ...]], name: str) -> list[int]:
    """The state bytes of each leaf alone (``tx.init`` of a one-leaf tree, its counters
    subtracted)."""
    tx = make_tx(name)
    base = state_bytes(tx.init({}))
    return [state_bytes(tx.init({k: torch.zeros(s)})) - base for k, s in shapes.items()]


def balanced_by_state(costs: list[int], world: int) -> float:
    """Largest load / (total / world) of a greedy largest-first split of whole leaves."""
    loads = [0] * world
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads) / (sum(costs) / world)


def worker(rank: int, world: int, store: str, out: str, shapes: dict, only: list[str],
           steps: int, balance: str = "params", split_above_mb: float | None = None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    results: dict[str, Any] = {}
    shapes = {k: tuple(v) for k, v in shapes.items()}
    params, grads = problem(shapes, rank, steps)      # each rank its own (unreduced) grads
    for name in only:
        for label, mb in CHUNKS.items():
            key = f"{name}|{label}"
            try:
                stats = CollectiveStats()
                tx = zero(make_tx(name), stage=2, chunk_size_mb=mb, stats=stats,
                          balance=balance, split_above_mb=split_above_mb)
                state = tx.init(params)
                counts = []
                for g in grads:
                    stats.reset()
                    _, state = tx.update(g, state, params)
                    counts.append(stats.collectives)
                results[key] = {"state": state_bytes(state), "counts": counts}
            except Exception:  # noqa: BLE001 - reported in the table
                results[key] = {"error": traceback.format_exc(limit=4)}
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    exit_rank()


def run_world(world: int, shapes: dict, only: list[str], steps: int,
              balance: str = "params", split_above_mb: float | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        store, out = Path(tmp) / "store", Path(tmp) / "out"
        mp.spawn(worker, args=(world, str(store), str(out), shapes, only, steps, balance,
                               split_above_mb), nprocs=world, join=True)
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def table(shapes: dict, single: dict[str, int], by_world: dict[int, list[dict]],
          only: list[str], leaf_costs: dict[str, list[int]],
          balance: str = "params", split_above_mb: float | None = None) -> tuple[str, bool]:
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    param_bytes = sum(x.numel() * 4 for x in meta.values())
    head = (f"{'optimizer':10} {'chunks':9} {'N':>2} | {'n':>3} {'padding KiB':>12} "
            f"{'single MiB':>10} {'max/rank':>9} {'min/rank':>9} {'ratio':>6} {'target':>6} "
            f"{'by-state':>8} | "
            f"{'coll/step':>9} {'2xchunks':>8} | ok")
    lines = [head, "-" * len(head)]
    all_ok = True
    for name in only:
        for label, mb in CHUNKS.items():
            for world, results in by_world.items():
                costs = state_costs(make_tx(name), meta) if balance == "state" else None
                plan = zero_plan(meta, world, mb, costs=costs,      # the plan zero makes
                                 split_above_mb=split_above_mb,
                                 split_block_rows=traits_of(make_tx(name)).block_rows)
                n = len(plan.chunks)
                pad = plan.padding_bytes / param_bytes
                key = f"{name}|{label}"
                errors = [r[key]["error"] for r in results if "error" in r[key]]
                if errors:
                    lines.append(f"{name:10} {label:9} {world:>2} | error: "
                                 f"{errors[0].strip().splitlines()[-1]}")
                    all_ok = False
                    continue
                per_rank = [r[key]["state"] for r in results]
                counts = [c for r in results for c in r[key]["counts"]]
                ratio = max(per_rank) / (single[name] / world)
                target = 1.05 + pad
                # split leaves add the reductions of their statistics across the segments
                # (as tensor parallelism's): the same count every step, not per leaf
                ok = ratio <= target and (max(counts) <= 2 * n if split_above_mb is None
                                          else min(counts) == max(counts) >= 2 * n)
                all_ok &= ok
                lines.append(
                    f"{name:10} {label:9} {world:>2} | {n:>3} "
                    f"{plan.padding_bytes / 1024:>7.1f} ({100 * pad:3.1f}%) "
                    f"{single[name] / 2**20:>10.2f} {max(per_rank) / 2**20:>9.2f} "
                    f"{min(per_rank) / 2**20:>9.2f} {ratio:>6.3f} {target:>6.3f} "
                    f"{balanced_by_state(leaf_costs[name], world):>8.3f} | "
                    f"{span(counts):>9} {2 * n:>8} | "
                    f"{'NO' if not ok else 'yes' if ratio <= 1.05 else 'yes, by padding'}")
    return "\n".join(lines), all_ok


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes")
    parser.add_argument("--only", default=",".join(DEFAULT),
                        help=f"comma-separated subset of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--blocks", type=int, default=12, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--balance", choices=("params", "state"), default="params",
                        help="what zero balances the owners by (its balance= argument)")
    parser.add_argument("--embedding-share", type=float, default=None,
                        help="size the token embedding to this share of the parameters")
    parser.add_argument("--split", action="store_true",
                        help="zero(..., split_above_mb=) just below the token embedding's size")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    only = [x for x in args.only.split(",") if x]
    for name in only:
        make_tx(name)                                  # unknown names fail before spawning
    shapes = gpt_shapes(args.blocks, args.d_model, embedding_share=args.embedding_share)
    n_params = sum(torch.Size(s).numel() for s in shapes.values())
    tok_mb = torch.Size(shapes["tok"]).numel() * 4 / 2**20
    split = 0.99 * tok_mb if args.split else None
    single = single_device(shapes, only, args.steps)
    by_world = {w: run_world(w, shapes, only, args.steps, args.balance, split)
                for w in (int(x) for x in args.worlds.split(","))}
    leaf_costs = {name: per_leaf_state(shapes, name) for name in only}
    text, ok = table(shapes, single, by_world, only, leaf_costs, args.balance, split)
    share = torch.Size(shapes["tok"]).numel() / n_params
    print(f"torch {torch.__version__}, {platform.machine()}, gloo; {len(shapes)} tensors, "
          f"{n_params / 1e6:.2f} M parameters (float32; token embedding {shapes['tok']}, "
          f"{100 * share:.0f} %), zero stage 2, {args.steps} steps, owners balanced by "
          f"{args.balance}" + (f", leaves above {split:.2f} MiB split into row segments"
                               if split else ""))
    print(text)
    print("all targets met" if ok else "SOME TARGETS MISSED (rows marked NO)")


if __name__ == "__main__":
    main()
