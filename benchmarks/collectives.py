"""Collectives and bytes per optimizer step under tensor parallelism, for every alias.

Every alias runs as ``opttx.distributed.sharded(alias, specs, stats=stats)`` on the local
shards of a GPT's parameters, split Megatron-style over all ranks of the default group:

  column-parallel  q, k, v, MLP up: weight and bias Shard(0)
  row-parallel     attention out, MLP down: weight Shard(1), bias Replicated
  everything else  layer norms, embeddings, head: Replicated

The element-wise aliases need no collective; the layer-wise ones turn each reduction-hook call
into one batched all-reduce per group (`CollectiveStats` counts them and their payload); the
matrix ones (Shampoo, GaLore) run whole leaves on owner ranks (``sharded(tx, specs,
on_owners=True)``: one all-to-all to the owners, one back). The same aliases run on a model
with a few blocks: the counts do not depend on the number of leaves, only the bytes do.

Processes: ``torch.multiprocessing.spawn`` with gloo and a file store, world 2 and 4 (one
spawn each). Counts are eager (``stats.reset()`` before each ``update``, ``init`` not counted),
taken over ``--steps`` steps on seeded random gradients; a count that varies between steps is
shown as ``min-max``. KiB are what rank 0 sends into its collectives per step. No timing.

With ``--tp-zero STAGE`` (world 4 only) the ranks form a 2 x 2 mesh, tensor parallel over
pairs {0, 1}, {2, 3} and data parallel over {0, 2}, {1, 3}, and every alias runs as
``sharded(zero(alias, dp_group, stage), specs)`` (the matrix aliases as
``on_owners(alias, owner_group=tp_group)`` inside): the table then shows the tensor-parallel
collectives (statistics, all-to-alls of on_owners) and ZeRO's (2 per chunk, plus one per
statistic across leaves) separately, and the heaviest rank's optimizer state beside the
state ``sharded(alias)`` alone keeps on each rank.

Examples:
  python benchmarks/collectives.py                       # 16 and 2 blocks, world 2 and 4
  python benchmarks/collectives.py --worlds 2 --only adam,lamb --steps 2
  python benchmarks/collectives.py --worlds 4 --tp-zero 2
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import platform
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opttx
from opttx.testing import exit_rank
from opttx.distributed import (CollectiveStats, Replicated, Shard, global_factor_axes,
                               local_shard, on_owners, sharded, zero)

ALIASES = ("adam", "adamw", "lion", "adafactor", "came", "lamb", "lars", "clip+adamw",
           "shampoo", "galore_adamw")
ON_OWNERS = ("shampoo", "galore_adamw")     # need whole matrices: sharded(..., on_owners=True)

# ---------------------------------------------------------------------------------------------
# the model's parameter shapes and their Megatron-style specs
# ---------------------------------------------------------------------------------------------

COLUMN, ROW, WHOLE = "column", "row", "whole"


def gpt_layout(blocks: int, d: int, vocab: int = 256, seq: int = 64
               ) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (global shape, kind)`` of a pre-norm GPT with separate q, k, v projections
    and a 4x MLP: 16 tensors per block, 5 outside them."""
    layout: dict[str, tuple[tuple[int, ...], str]] = {
        "tok": ((vocab, d), WHOLE), "pos": ((seq, d), WHOLE)}
    for i in range(blocks):
        b = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            layout[b + ln + ".weight"] = ((d,), WHOLE)
            layout[b + ln + ".bias"] = ((d,), WHOLE)
        for name, (out, inp) in (("attn.q", (d, d)), ("attn.k", (d, d)), ("attn.v", (d, d)),
                                 ("mlp.up", (4 * d, d))):
            layout[b + name + ".weight"] = ((out, inp), COLUMN)
            layout[b + name + ".bias"] = ((out,), COLUMN)
        for name, (out, inp) in (("attn.out", (d, d)), ("mlp.down", (d, 4 * d))):
            layout[b + name + ".weight"] = ((out, inp), ROW)
            layout[b + name + ".bias"] = ((out,), WHOLE)       # added after the all-reduce
    layout["ln_f.weight"] = ((d,), WHOLE)
    layout["ln_f.bias"] = ((d,), WHOLE)
    layout["head"] = ((vocab, d), WHOLE)
    return layout


def megatron_specs(layout: dict[str, tuple[tuple[int, ...], str]], group: Any = None
                   ) -> dict[str, Any]:
    """Column-parallel tensors split on dim 0, row-parallel weights on dim 1, over ``group``
    (None: the default group); the rest replicated."""
    return {k: Shard(0, group) if kind == COLUMN else Shard(1, group) if kind == ROW
            else Replicated() for k, (_, kind) in layout.items()}


# ---------------------------------------------------------------------------------------------
# the aliases
# ---------------------------------------------------------------------------------------------


def make_alias(name: str, params: dict[str, torch.Tensor], specs: dict[str, Any]
               ) -> opttx.GradientTransformation:
    """The alias ``name`` with small-model hyperparameters. Adafactor and CAME factor on the
    global shapes (`global_factor_axes`), not on the local shards."""
    if name == "adam":
        return opttx.adam(1e-3)
    if name == "adamw":
        return opttx.adamw(1e-3, weight_decay=0.01)
    if name == "lion":
        return opttx.lion(1e-4, weight_decay=0.01)
    if name == "adafactor":
        return opttx.adafactor(1e-2, min_dim_size_to_factor=32,
                               factor_axes=global_factor_axes(params, specs, "largest", 32))
    if name == "came":
        return opttx.came(2e-4, weight_decay=0.01,
                          factor_axes=global_factor_axes(params, specs, "last", 1))
    if name == "lamb":
        return opttx.lamb(1e-3, weight_decay=0.01)
    if name == "lars":
        return opttx.lars(1.0, weight_decay=1e-4)
    if name == "clip+adamw":
        return opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adamw(1e-3, weight_decay=0.01))
    if name == "shampoo":
        return opttx.shampoo(1e-2, precondition_frequency=2)
    if name == "galore_adamw":
        return opttx.galore_adamw(1e-2, rank=8, update_proj_gap=2)
    raise ValueError(f"unknown alias {name!r}; choose from {', '.join(ALIASES)}")


def has_on_owners() -> bool:
    """Whether this opttx's `sharded` takes ``on_owners`` (whole leaves on owner ranks)."""
    return "on_owners" in inspect.signature(sharded).parameters


# ---------------------------------------------------------------------------------------------
# one measurement: collectives per step of one alias on one model
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One alias on one model at one world size."""
    alias: str
    world: int
    leaves: int
    collectives: list[int]
    kib: list[float]
    note: str = ""
    zero_collectives: list[int] | None = None   # --tp-zero: ZeRO's (collectives: TP's)
    state_kib: tuple[float, float] | None = None  # --tp-zero: heaviest rank, sharded alone


def count_steps(name: str, layout: dict[str, tuple[tuple[int, ...], str]], steps: int
                ) -> tuple[list[int], list[float]]:
    """Run ``steps`` sharded updates of alias ``name``; collectives and KiB of each step."""
    specs = megatron_specs(layout)
    gen = torch.Generator().manual_seed(0)      # the same full tensors on every rank
    full = {k: torch.randn(s, generator=gen) for k, (s, _) in layout.items()}
    params = {k: local_shard(v, specs[k]) for k, v in full.items()}
    stats = CollectiveStats()
    kwargs = {"on_owners": True} if name in ON_OWNERS else {}
    tx = sharded(make_alias(name, params, specs), specs, stats=stats, **kwargs)
    state = tx.init(params)
    collectives, kib = [], []
    for _ in range(steps):
        grads = {k: local_shard(torch.randn(s, generator=gen), specs[k])
                 for k, (s, _) in layout.items()}
        stats.reset()
        updates, state = tx.update(grads, state, params)
        collectives.append(stats.collectives)
        kib.append(stats.bytes / 1024)
        params = opttx.apply_updates(params, updates)
    return collectives, kib


def _state_kib(state: Any) -> float:
    return sum(x.numel() * x.element_size() for x in opttx.tree.tree_leaves(state)
               if isinstance(x, torch.Tensor)) / 1024


def count_tp_zero(name: str, layout: dict[str, tuple[tuple[int, ...], str]], steps: int,
                  stage: int, groups: tuple[Any, Any]) -> tuple[list[int], list[int],
                                                                list[float], tuple]:
    """``sharded(zero(alias, dp, stage), specs)`` on the 2 x 2 mesh: TP collectives, ZeRO
    collectives and KiB of each step; the heaviest rank's state and sharded(alias)'s."""
    tp, dp = groups
    specs = megatron_specs(layout, tp)
    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=gen) for k, (s, _) in layout.items()}
    params = {k: local_shard(v, specs[k]) for k, v in full.items()}
    ts, zs = CollectiveStats(), CollectiveStats()
    alias = make_alias(name, params, specs)
    inner = on_owners(alias, owner_group=tp) if name in ON_OWNERS else alias
    tx = sharded(zero(inner, dp, stage=stage, stats=zs), specs, stats=ts)
    state = tx.init(params)
    alone = sharded(make_alias(name, params, specs), specs,
                    on_owners=name in ON_OWNERS).init(params)
    tp_counts, zero_counts, kib = [], [], []
    for _ in range(steps):
        grads = {k: local_shard(torch.randn(s, generator=gen), specs[k])
                 for k, (s, _) in layout.items()}
        ts.reset(), zs.reset()
        updates, state = tx.update(grads, state, params)
        tp_counts.append(ts.collectives)
        zero_counts.append(zs.collectives)
        kib.append((ts.bytes + zs.bytes) / 1024)
        params = opttx.apply_updates(params, updates)
    mine = torch.tensor([_state_kib(state), _state_kib(alone)])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return tp_counts, zero_counts, kib, (float(mine[0]), float(mine[1]))


def _run_row(name: str, layout: dict, world: int, config: dict, groups: Any) -> Row:
    row = Row(name, world, len(layout), [], [])
    if config.get("tp_zero"):
        row.collectives, row.zero_collectives, row.kib, row.state_kib = count_tp_zero(
            name, layout, config["steps"], config["tp_zero"], groups)
    else:
        row.collectives, row.kib = count_steps(name, layout, config["steps"])
    return row


def _worker(rank: int, world: int, store: str, out: str, config: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    rows = []
    groups = None
    if config.get("tp_zero"):               # every rank creates every group, in one order
        tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = (tps[rank // 2], dps[rank % 2])
    for blocks in config["blocks"]:
        layout = gpt_layout(blocks, config["d_model"])
        for name in config["aliases"]:
            row = Row(name, world, len(layout), [], [])
            if name in ON_OWNERS and not has_on_owners():
                row.note = "skipped: sharded() has no on_owners keyword in this opttx"
            else:
                try:
                    row = _run_row(name, layout, world, config, groups)
                except Exception as e:  # noqa: BLE001 - reported in the table, same on all ranks
                    row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    if rank == 0:
                        traceback.print_exc(limit=4)
            rows.append(row.__dict__)
            dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    exit_rank()


def measure(world: int, config: dict) -> list[Row]:
    """Spawn ``world`` gloo processes and return rank 0's rows."""
    with tempfile.TemporaryDirectory(prefix="opttx_collectives_") as tmp:
        store, out = Path(tmp) / "store", Path(tmp) / "rows.json"
        mp.spawn(_worker, args=(world, str(store), str(out), config), nprocs=world, join=True)
        return [Row(**r) for r in json.loads(out.read_text())]


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------


def _span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return format(low, fmt) if low == high else f"{format(low, fmt)}-{format(high, fmt)}"


def table(rows: list[Row]) -> str:
    """One line per (alias, world): the large model's counts beside the small model's."""
    by_key: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        by_key.setdefault((r.alias, r.world), []).append(r)
    sizes = sorted({r.leaves for r in rows}, reverse=True)
    tp_zero = any(r.zero_collectives is not None for r in rows)
    head = f"{'alias':<14} {'world':>5}"
    for n in sizes:
        head += (f" | {'leaves':>6} {'TP coll':>7} {'ZeRO coll':>9} {'KiB/step':>9} "
                 f"{'state KiB max/alone':>19}" if tp_zero else
                 f" | {'leaves':>6} {'coll/step':>9} {'KiB/step':>10}")
    lines = [head, "-" * len(head)]
    for (alias, world), group in by_key.items():
        line = f"{alias:<14} {world:>5}"
        notes = []
        for n in sizes:
            r = next((r for r in group if r.leaves == n), None)
            if r is None or r.note:
                line += f" | {n:>6} {'-':>9} {'-':>10}"
                notes += [r.note] if r is not None else []
            elif tp_zero:
                line += (f" | {n:>6} {_span(r.collectives, 'd'):>7} "
                         f"{_span(r.zero_collectives, 'd'):>9} {_span(r.kib, '.1f'):>9} "
                         f"{f'{r.state_kib[0]:.0f} / {r.state_kib[1]:.0f}':>19}")
            else:
                line += (f" | {n:>6} {_span(r.collectives, 'd'):>9} "
                         f"{_span(r.kib, '.1f'):>10}")
        lines.append(line + (f"   ({notes[0]})" if notes else ""))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--blocks", default="16,2",
                        help="comma-separated block counts (16 tensors per block, 5 more)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated aliases (default: all)")
    parser.add_argument("--tp-zero", type=int, choices=(1, 2), default=None,
                        help="ZeRO stage of sharded(zero(alias, dp), specs) on a 2 x 2 mesh "
                             "(world 4 only)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    aliases = args.only.split(",") if args.only else list(ALIASES)
    unknown = sorted(set(aliases) - set(ALIASES))
    if unknown:
        raise SystemExit(f"unknown aliases {unknown}; choose from {', '.join(ALIASES)}")
    config = {"blocks": [int(b) for b in args.blocks.split(",")], "d_model": args.d_model,
              "steps": args.steps, "aliases": aliases, "tp_zero": args.tp_zero}
    if args.tp_zero and args.worlds != "4":
        raise SystemExit("--tp-zero runs on a 2 x 2 mesh: give --worlds 4")
    rows: list[Row] = []
    for world in (int(w) for w in args.worlds.split(",")):
        rows += measure(world, config)
    rows.sort(key=lambda r: (aliases.index(r.alias), r.world))
    mode = (f"; tp 2 x dp 2, sharded(zero(alias, dp, stage={args.tp_zero}), specs)"
            if args.tp_zero else "")
    print(f"torch {torch.__version__}, {platform.machine()}, gloo; d_model {args.d_model}, "
          f"{args.steps} steps; on_owners available: {has_on_owners()}{mode}")
    print(table(rows))


if __name__ == "__main__":
    main()
