"""The cost of a weight EMA per training step, side by side: `opttx.ema_params` (the average
updated inside the optimizer step) against torch's way (``AveragedModel`` with
``get_ema_multi_avg_fn`` updated after the step), both around AdamW, and AdamW alone. Eager
`opttx.Optimizer` steps (and ``torch.optim.AdamW(foreach=True)`` + ``AveragedModel``) on an
MLP; prints the median time of each over interleaved rounds, the ratios, and whether the two
averages agree bit for bit at the end.

Run: ``.venv/bin/python benchmarks/weight_ema.py [--width 1024] [--steps 20] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from _common import cpu_model, git_state

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import opttx

DECAY = 0.999


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; commit {git_state()}")
    base = _model(args.width)
    n = sum(p.numel() for p in base.parameters())
    print(f"MLP of 4 Linear({args.width}, {args.width}): {n / 1e6:.1f} M parameters, "
          f"{args.steps} steps per round, decay {DECAY}")
    grads = [[torch.randn_like(p) for p in base.parameters()] for _ in range(args.steps)]

    def runner(kind: str):
        model = copy.deepcopy(base)
        params = list(model.parameters())
        averaged = None
        if kind == "opttx ema_params(adamw)":
            opt = opttx.Optimizer(params, opttx.ema_params(opttx.adamw(1e-3), DECAY))
        elif kind == "torch AdamW + AveragedModel":
            opt = torch.optim.AdamW(params, 1e-3, weight_decay=1e-4, foreach=True)
        else:
            opt = opttx.Optimizer(params, opttx.adamw(1e-3))
        if kind.endswith("AveragedModel"):
            averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))

        def run() -> float:
            t0 = time.perf_counter()
            for g in grads:
                for p, x in zip(params, g):
                    p.grad = x
                opt.step()
                if averaged is not None:
                    averaged.update_parameters(model)
            return time.perf_counter() - t0
        return run, opt, averaged

    kinds = ["opttx adamw", "opttx adamw + AveragedModel", "opttx ema_params(adamw)",
             "torch AdamW + AveragedModel"]
    runs = {k: runner(k) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds + 1):                # the first round warms up
        for k in kinds:
            t = runs[k][0]()
            if r:
                times[k].append(t / args.steps)
    plain = statistics.median(times["opttx adamw"])
    for k in kinds:
        t = statistics.median(times[k])
        print(f"{k:30s} {t * 1e3:8.2f} ms/step  {t / plain:5.2f}x opttx adamw alone")
    ours = opttx.transforms.weight_ema.find_ema_params_states(
        runs["opttx ema_params(adamw)"][1].tx_states[0])[0]
    theirs = runs["opttx adamw + AveragedModel"][2].module.parameters()
    same = all(torch.equal(a, b.detach()) for a, b in zip(opttx.tree.tree_leaves(ours.ema),
                                                          theirs))
    print(f"ema_params's average equals AveragedModel's (same AdamW steps) bit for bit: {same}")


if __name__ == "__main__":
    main()
