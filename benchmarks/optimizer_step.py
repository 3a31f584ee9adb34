"""The eager `opttx.Optimizer` AdamW step against torch's foreach AdamW, and the functional
donating step, side by side.

22 M float32 parameters in 16 tensors (1024 x 1344 each), AdamW with lr 3e-4, betas (0.9,
0.95), eps 1e-8, weight decay 0.1 (non-dyadic numbers: the Optimizer holds them as float64
and its eager step calls the factories with them as Python floats, the functional path's
kernels). Variants, timed in interleaved rounds (each round runs every variant ``--steps``
steps, in an order rotated per round, so a slow phase of the machine touches them all):

* ``torch foreach``: ``torch.optim.AdamW(foreach=True)``, the reference;
* ``opttx.Optimizer``: ``opttx.Optimizer(params, opttx.adamw(...))``, its eager step;
* ``functional donating``: ``tx.update`` of ``opttx.adamw(...)`` inside `opttx.donating`,
  then `opttx.apply_updates_` (what the Optimizer's step is meant to cost);
* ``Optimizer, fold_learning_rate``: the same with the learning rate written into the
  parameter update (``p.add_(u, alpha=-lr)``, `opttx.update_deferring_scale`): one pass fewer;
* ``opttx.optim.AdamW``: the torch-named class, which folds the learning rate as torch does;
* ``Optimizer, float32 hyperparameters`` (``--with-float32``): the same transform injected
  as float32 0-dim tensors (the Optimizer's earlier storage): read as Python floats too, so
  it differs in its numbers (rounded), not in its kernels.

Prints per-variant median ms per step and the median over rounds of the paired ratio to
torch foreach (each round's ratio uses that round's torch time). The parameters of every
variant are checked against torch's after the first round (max |difference|).

Run: ``.venv/bin/python benchmarks/optimizer_step.py [--rounds 7] [--steps 5]
[--wait-idle 120] [--with-float32]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _common import cpu_model, cpu_times, git_state, other_load, wait_idle

import torch

import opttx

SHAPE = (1024, 1344)
TENSORS = 16
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) * 0.02 for _ in range(TENSORS)]


def adamw() -> opttx.GradientTransformation:
    return opttx.adamw(HYPER["lr"], b1=HYPER["betas"][0], b2=HYPER["betas"][1],
                       eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])


class TorchForeach:
    name = "torch foreach"

    def __init__(self, params, grads):
        self.params = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = torch.optim.AdamW(self.params, foreach=True, **HYPER)

    def step(self):
        self.opt.step()

    def values(self):
        return [p.detach() for p in self.params]


class OpttxOptimizer:
    name = "opttx.Optimizer"

    def __init__(self, params, grads, tx=None):
        self.params = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = opttx.Optimizer(self.params, tx if tx is not None else adamw())

    def step(self):
        self.opt.step()

    def values(self):
        return [p.detach() for p in self.params]


class FoldedOptimizer(OpttxOptimizer):
    name = "Optimizer, fold_learning_rate"

    def __init__(self, params, grads):
        super().__init__(params, grads)
        self.opt = opttx.Optimizer(self.params, adamw(), fold_learning_rate=True)


class TorchNamesAdamW(OpttxOptimizer):
    name = "opttx.optim.AdamW"

    def __init__(self, params, grads):
        super().__init__(params, grads)
        self.opt = opttx.optim.AdamW(self.params, foreach=True, **HYPER)


class Float32Hyperparameters(OpttxOptimizer):
    name = "Optimizer, float32 hyperparameters"

    def __init__(self, params, grads):
        super().__init__(params, grads, opttx.inject_all_hyperparams(adamw(), torch.float32))


class FunctionalDonating:
    name = "functional donating"

    def __init__(self, params, grads):
        self.params = [p.clone() for p in params]
        self.grads = grads
        self.tx = adamw()
        self.state = self.tx.init(self.params)

    @torch.no_grad()
    def step(self):
        with opttx.donating():
            updates, self.state = self.tx.update(self.grads, self.state, self.params)
        opttx.apply_updates_(self.params, updates)

    def values(self):
        return self.params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--wait-idle", type=float, default=0.0)
    parser.add_argument("--with-float32", action="store_true")
    args = parser.parse_args()

    print(f"machine: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; commit {git_state()}")
    print(f"AdamW {HYPER}; {TENSORS} tensors of {SHAPE} = "
          f"{TENSORS * SHAPE[0] * SHAPE[1] / 1e6:.1f} M float32 parameters")
    params = make_params()
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(SHAPE, generator=gen) * 1e-2 for _ in range(TENSORS)]
    kinds = [TorchForeach, OpttxOptimizer, FunctionalDonating, FoldedOptimizer, TorchNamesAdamW]
    if args.with_float32:
        kinds.append(Float32Hyperparameters)
    variants = [k(params, [g.clone() for g in grads]) for k in kinds]
    for v in variants:              # warm-up: first-step allocations, lazy inits
        v.step()
    reference = variants[0].values()
    for v in variants[1:]:
        diff = max((a - b).abs().max().item() for a, b in zip(v.values(), reference))
        print(f"  after one step, {v.name:<36} max |p - p_torch| = {diff:.1e}")
    if args.wait_idle:
        wait_idle(args.wait_idle)

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    load_start = cpu_times()
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                v.step()
            times[v.name].append((time.perf_counter() - t0) / args.steps * 1e3)
    load = other_load(load_start)

    ref = times[variants[0].name]
    print(f"(other processes kept {load:.2f} cores busy while timing; {args.rounds} rounds "
          f"of {args.steps} steps)")
    print(f"{'variant':<38}{'median ms':>10}{'min ms':>9}{'x torch foreach (paired)':>26}")
    for v in variants:
        t = times[v.name]
        ratios = [a / b for a, b in zip(t, ref)]
        print(f"{v.name:<38}{statistics.median(t):>10.1f}{min(t):>9.1f}"
              f"{statistics.median(ratios):>20.3f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
