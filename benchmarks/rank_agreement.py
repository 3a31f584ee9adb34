"""What the ranks' agreement on rank-local decisions costs an eager step, on two gloo ranks.

Side by side, round by round (each round times every variant once, in turn):

* ``zero(adamw)`` against ``apply_if_finite(zero(adamw), 3)`` (the finiteness test, the skip
  agreed over the group with one all-reduce of one number, the eager branch), and against the
  same without the agreement (zero behind an undeclared pair; right only while no rank sees a
  NaN), which isolates the all-reduce;
* ``MultiSteps(zero(adamw), 4)`` with ``agree_across_ranks=True`` (the default: one all-reduce
  of two numbers per call, and a host read of it) against ``False``, per call (four calls:
  three accumulating, one stepping);
* ``sharded(lamb)`` with the step counters carried by its first all-reduce (as always now)
  against the same reducer with nothing carried (the counters taken off by hand).

Ratios above 1 are the cost. CPU tensors; on a GPU the host read of the agreement is a sync.

Example:
  python benchmarks/rank_agreement.py --rounds 20 --size 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _undeclared(tx):
    """``tx`` as a bare ``(init, update)`` pair: no traits, so no collective groups."""
    import opttx
    return opttx.GradientTransformation(tx.init, tx.update)


def _rank(rank: int, world: int, rounds: int, size: int) -> dict:
    import torch

    import opttx
    from opttx.distributed import Shard, consistency_checks, sharded, zero
    from opttx.distributed import reducer as reducer_module

    gen = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(size, size, generator=gen) for i in range(4)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    local = {k: v[rank * size // world:(rank + 1) * size // world].clone()
             for k, v in params.items()}
    local_grads = {k: v[rank * size // world:(rank + 1) * size // world].clone()
                   for k, v in grads.items()}
    specs = {k: Shard(0) for k in params}

    def stepper(tx, p, g, calls=1):
        state = [tx.init(p)]

        def step():
            for _ in range(calls):
                _, state[0] = tx.update(g, state[0], p)
        return step

    carry = reducer_module.ShardedReducer.carry_counters

    def no_carry(self, counters):
        carry(self, None)

    variants = {
        "zero(adamw)": (stepper(zero(opttx.adamw(1e-3)), params, grads), None),
        "apply_if_finite(zero(adamw))": (stepper(opttx.apply_if_finite(
            zero(opttx.adamw(1e-3)), 3), params, grads), None),
        # the same without the agreement: zero behind a pair that declares no groups (right
        # here only because no rank sees a NaN): what the all-reduce itself costs
        "apply_if_finite(zero), no agreement": (stepper(opttx.apply_if_finite(
            _undeclared(zero(opttx.adamw(1e-3))), 3), params, grads), None),
        "MultiSteps(zero, 4), agree=False": (stepper(opttx.MultiSteps(
            zero(opttx.adamw(1e-3)), 4, agree_across_ranks=False).gradient_transformation(), params, grads, 4), None),
        "MultiSteps(zero, 4), agree=True": (stepper(opttx.MultiSteps(
            zero(opttx.adamw(1e-3)), 4).gradient_transformation(), params, grads, 4), None),
        "sharded(lamb), nothing carried": (stepper(sharded(opttx.lamb(1e-3), specs), local,
                                                   local_grads), no_carry),
        "sharded(lamb), counters carried": (stepper(sharded(opttx.lamb(1e-3), specs), local,
                                                    local_grads), None),
    }
    times = {name: [] for name in variants}
    with consistency_checks(None):
        for step, _ in variants.values():          # warm-up, untimed
            step()
        for _ in range(rounds):
            for name, (step, patch) in variants.items():
                if patch is not None:
                    reducer_module.ShardedReducer.carry_counters = patch
                torch.distributed.barrier()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
                reducer_module.ShardedReducer.carry_counters = carry
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--size", type=int, default=256)
    args = ap.parse_args()

    import torch

    from _common import cpu_model, git_state
    from opttx.testing import spawn_ranks
    import rank_agreement
    print(f"torch {torch.__version__}, {cpu_model()}, opttx {git_state()}, 2 gloo ranks, "
          f"4 x ({args.size}, {args.size}) float32, median of {args.rounds} rounds", flush=True)
    got = spawn_ranks(rank_agreement._rank, 2, args=(args.rounds, args.size), timeout=1200,
                      consistency_checks=None)[0]
    for name, t in got.items():
        print(f"  {name:36s} {t * 1e3:8.2f} ms")
    for base, other in (("zero(adamw)", "apply_if_finite(zero(adamw))"),
                        ("apply_if_finite(zero), no agreement", "apply_if_finite(zero(adamw))"),
                        ("MultiSteps(zero, 4), agree=False", "MultiSteps(zero, 4), agree=True"),
                        ("sharded(lamb), nothing carried", "sharded(lamb), counters carried")):
        print(f"  {other} / {base}: {got[other] / got[base]:.3f}")


if __name__ == "__main__":
    main()
