"""Record every alias's parameters and states after 10 eager steps (fixed seed, CPU).

The refactors of the transform contract must not change a single bit of any alias: this file
writes the reference (``aliases.pt``) once, at the commit before such a change, and
``tests/test_golden.py`` compares the current code with it. A deliberate numeric change (a
fidelity fix) regenerates only the affected entries, with the reason in its commit message:

    python tests/golden/record.py [name ...]      # no names: every entry

Bits are compared on the machine that recorded them only (`machine`: vectorized kernels round
differently on other CPUs); elsewhere the test skips with the reason. On a new machine, record
every entry from a checkout of the reference commits: 57d2eb9 (before the contract refactor),
then ``shampoo`` from 112f14c (its fidelity fix).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

import opttx

PATH = Path(__file__).with_name("aliases.pt")
STEPS = 10

# name -> factory of the transform; each runs on the same tree (see `tree`)
CASES = {
    "sgd": lambda: opttx.sgd(0.1),
    "sgd_nesterov": lambda: opttx.sgd(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: opttx.adam(1e-2),
    "adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
    "adamw_nesterov": lambda: opttx.adamw(1e-2, b1=0.8, weight_decay=0.05, nesterov=True),
    "nadam": lambda: opttx.nadam(1e-2, momentum_decay=4e-3),
    "adagrad": lambda: opttx.adagrad(1e-2),
    "rmsprop": lambda: opttx.rmsprop(1e-2),
    "rmsprop_centered": lambda: opttx.rmsprop(1e-2, centered=True, momentum=0.5),
    "lion": lambda: opttx.lion(1e-3, weight_decay=0.1),
    "adafactor": lambda: opttx.adafactor(1e-2),
    "adafactor_last": lambda: opttx.adafactor(None, factor_axes="last", momentum=0.9),
    "came": lambda: opttx.came(1e-3, weight_decay=0.01),
    "lamb": lambda: opttx.lamb(1e-2, weight_decay=0.01),
    "lars": lambda: opttx.lars(0.1),
    "galore_adamw": lambda: opttx.galore_adamw(1e-2, rank=4, update_proj_gap=4),
    "adamw_8bit": lambda: opttx.adamw_8bit(1e-2, weight_decay=0.01),
    "galore_adamw_8bit": lambda: opttx.galore_adamw_8bit(1e-2, rank=4, update_proj_gap=4),
    "adalomo": lambda: opttx.adalomo(1e-2),
    "shampoo": lambda: opttx.shampoo(1e-2, epsilon=1e-6, precondition_frequency=2,
                                     start_preconditioning_step=2, max_preconditioner_dim=32),
}


def tree() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (16, 12), "b": (12,), "conv": (2, 3, 8), "big": (64, 80)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def run(name: str) -> dict[str, list[torch.Tensor]]:
    """Parameters and every tensor of the state after `STEPS` eager steps."""
    tx = CASES[name]()
    params = tree()
    state = tx.init(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        params = opttx.apply_updates(params, updates)
    leaves = [x for x in opttx.tree.tree_leaves(state) if isinstance(x, torch.Tensor)]
    return {"params": [params[k] for k in sorted(params)], "state": leaves}


def machine() -> str:
    """The CPU and the kernels torch picks on it: vectorized kernels (AVX2, AVX-512, with or
    without fused multiply-adds) round differently, so bits compare on one machine only."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}; {torch.backends.cpu.get_cpu_capability()}"


def main(names: list[str]) -> None:
    table = torch.load(PATH) if PATH.exists() and names else {"torch": str(torch.__version__),
                                                             "machine": machine(),
                                                             "cases": {}}
    if table.get("machine") != machine():
        raise SystemExit(f"the fixture was recorded on {table.get('machine')}; this is "
                         f"{machine()}: record every entry (no names) at the reference commit")
    for name in names or list(CASES):
        table["cases"][name] = run(name)
    torch.save(table, PATH)
    print(f"wrote {PATH} ({len(table['cases'])} cases, torch {table['torch']}, "
          f"{table['machine']})")


if __name__ == "__main__":
    main(sys.argv[1:])
