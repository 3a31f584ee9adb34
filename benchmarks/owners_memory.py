"""Shampoo's state per rank under tensor parallelism with `on_owners`: whole leaves vs leaves
cut into row segments (``split_above_mb``), on a model whose token embedding holds 40 % of
the parameters.

The parameter tree is `zero_memory.gpt_shapes` (pre-norm GPT, 12 blocks, d_model 128 by
default) with the token embedding sized to ``--embedding-share`` of the parameters. Every
rank of a world of N (gloo, ``opttx.testing.spawn_ranks``) is one tensor-parallel rank
holding Megatron-style shards: the embeddings, the head, q/k/v and the MLP's up projection
split by rows (``Shard(0)``), the attention output and the MLP's down projection by columns
(``Shard(1)``), norms and biases replicated. The optimizer is
``sharded(opttx.shampoo(1e-3, grafting="adam", precondition_frequency=100), specs,
on_owners=True)`` (``max_preconditioner_dim`` 1024), once with whole leaves (each leaf at one
owner, balanced by its :math:`m^3+n^3` cost) and once with ``split_above_mb`` just below the
embedding's size (the embedding cut into one row segment per rank at multiples of 1024 rows,
the other leaves whole). ``--steps`` eager steps (no root step: frequency 100); no timing.

Figures: the distinct storage bytes of each rank's state; "heaviest / (single / N)" is the
largest over the ranks divided by one N-th of the single-device state (1.00: a perfect split;
the target for the split plan at world 4: <= 1 + 0.10 N, i.e. the heaviest rank at
most 1/N + 10 % of the whole); collectives per step (`CollectiveStats`).

Examples:
  python benchmarks/owners_memory.py                  # worlds 2 and 4
  python benchmarks/owners_memory.py --worlds 4 --blocks 4
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import opttx  # noqa: E402
from opttx.distributed import (CollectiveStats, Replicated, Shard, local_shard,  # noqa: E402
                               on_owners, sharded)
from opttx.distributed.owners import default_cost  # noqa: E402
from opttx.testing import spawn_ranks  # noqa: E402
from zero_memory import gpt_shapes, problem, state_bytes  # noqa: E402


def spec_of(name: str, shape: tuple[int, ...]):
    if len(shape) < 2:
        return Replicated()
    return Shard(1) if name.endswith(("attn.out.weight", "mlp.down.weight")) else Shard(0)


def make_tx() -> opttx.GradientTransformation:
    return opttx.shampoo(1e-3, grafting="adam", precondition_frequency=100)


def worker(rank: int, world: int, shapes: dict, steps: int, split_mb: float,
           cost: str = "work") -> dict:
    full, grads = problem(shapes, 0, steps)
    specs = {k: spec_of(k, s) for k, s in shapes.items()}
    local = {k: local_shard(v, specs[k]) for k, v in full.items()}
    cost = default_cost if cost == "work" else cost
    out = {}
    for label, split in (("whole leaves", None), ("split", split_mb)):
        stats = CollectiveStats()
        tx = sharded(on_owners(make_tx(), cost=cost, split_above_mb=split), specs,
                     stats=stats)
        params, state, counts = local, tx.init(local), []
        for g in grads:
            stats.reset()
            _, state = tx.update({k: local_shard(v, specs[k]) for k, v in g.items()}, state,
                                 params)
            counts.append(stats.collectives)
        out[label] = {"state": state_bytes(state), "collectives": counts}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--embedding-share", type=float, default=0.4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cost", choices=("work", "state"), default="work",
                   help="owners balanced by the roots' work (default_cost, per block) or by "
                        "state bytes (on_owners(cost='state'))")
    a = p.parse_args()
    shapes = gpt_shapes(a.blocks, a.d_model, embedding_share=a.embedding_share)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    tok_mb = torch.Size(shapes["tok"]).numel() * 4 / 2**20
    full, grads = problem(shapes, 0, a.steps)
    tx = make_tx()
    state = tx.init(full)
    for g in grads:
        _, state = tx.update(g, state, full)
    single = state_bytes(state)
    print(f"torch {torch.__version__}, {platform.machine()}, gloo; {len(shapes)} tensors, "
          f"{n / 1e6:.2f} M parameters, token embedding {shapes['tok']} "
          f"({100 * torch.Size(shapes['tok']).numel() / n:.0f} %); shampoo state on one "
          f"device {single / 2**20:.1f} MiB; split above {0.99 * tok_mb:.2f} MiB")
    print(f"{'world':>5s} {'plan':>13s} {'heaviest MiB':>13s} {'lightest MiB':>13s} "
          f"{'heaviest / (single / N)':>24s} {'coll/step':>10s}")
    ok = True
    for world in (int(w) for w in a.worlds.split(",")):
        runs = spawn_ranks(worker, world_size=world,
                           args=(shapes, a.steps, 0.99 * tok_mb, a.cost),
                           timeout=1200)
        for label in ("whole leaves", "split"):
            states = [r[label]["state"] for r in runs]
            ratio = max(states) / (single / world)
            counts = sorted({c for r in runs for c in r[label]["collectives"]})
            target = ""
            if label == "split":
                met = ratio <= 1 + 0.10 * world
                ok &= met or world != 4
                target = f"  (target <= {1 + 0.10 * world:.2f}: {'met' if met else 'NO'})"
            print(f"{world:5d} {label:>13s} {max(states) / 2**20:13.2f} "
                  f"{min(states) / 2**20:13.2f} {ratio:24.3f} "
                  f"{'/'.join(map(str, counts)):>10s}{target}")
    print("target met at world 4" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
