r"""The learning-rate sweep: each optimizer tried at a few learning rates before the timed runs,
the best kept on a validation split, so that no optimizer is ranked by a guessed rate.

For an optimizer whose `HYPERPARAMS` rate is :math:`\eta` the grid of ``n`` rates (``n`` odd,
``--sweep``, default 3) is

.. math::

    \eta \cdot 3^{k}, \qquad k = -\tfrac{n-1}{2}, \dots, \tfrac{n-1}{2}

(``n`` = 3: :math:`\eta/3, \eta, 3\eta`). Only ``learning_rate`` is scaled; an optimizer's
other rates (the AdamW part of the Muon family, ``adam_learning_rate``) keep adamw's.

Each rate trains a fresh model (the same initialisation and batch seed as the final run) for
``--sweep-steps`` steps (default a third of ``--steps``: shorter than the final run, which
keeps the whole demo within about twice the time of the final runs alone, at the price of
favouring rates that learn fast early) on the training stream less its tail, and is scored
by its mean loss on that tail (`Corpus.validation_split`, as long as the held-out split). The
rate with the lowest validation loss is chosen; the final, timed run trains at it on the whole
training stream and is evaluated on the held-out split, which the choice never saw. A rate
whose run fails or diverges (a non-finite loss) is never chosen; if none is finite the
optimizer keeps its `HYPERPARAMS` rate. The sweep's runs are untimed and eager (also under
``--compile``: compiling every candidate's step would cost more than the runs). A reference
(``--references``) is not swept: it runs at its counterpart's chosen multiple of its own rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .data import Corpus
from .optimizers import build, hyperparams
from .parallel import Parallel
from .progress import ProgressBar
from .train import SINGLE, RunConfig, advance, start

# The ratio of neighbouring rates in the grid.
FACTOR = 3.0
# The grid's size without --sweep: the default rate and its two neighbours.
DEFAULT_POINTS = 3


def powers(n: int) -> list[int]:
    """The ``n`` powers of `FACTOR` (``n`` odd) that the default learning rate is scaled by:
    ``-(n - 1) / 2`` to ``(n - 1) / 2``; ``[0]`` for 1."""
    if n < 1 or n % 2 == 0:
        raise ValueError(f"the sweep needs an odd, positive number of learning rates, got {n}")
    return list(range(-(n // 2), n // 2 + 1))


def scaled(rate: float, power: int) -> float:
    """``rate`` times ``FACTOR ** power``, divided for a negative power (``1e-3 / 3``, not
    ``1e-3 * (1 / 3)``: the rate a reader would write)."""
    return rate * FACTOR ** power if power >= 0 else rate / FACTOR ** -power


def multipliers(n: int) -> list[float]:
    """The ``n`` factors of the grid (``n`` odd): ``FACTOR ** k`` for each of `powers`."""
    return [scaled(1.0, k) for k in powers(n)]


def multiplier_label(power: int) -> str:
    """How the report names the grid's point ``FACTOR ** power``: ``"x1/3"``, ``"x1"``,
    ``"x3"``."""
    factor = f"{FACTOR ** abs(power):g}"
    return f"x1/{factor}" if power < 0 else f"x{factor}"


@dataclass(frozen=True)
class Sweep:
    """One optimizer's sweep: the rates tried, their validation losses and the choice."""

    steps: int                       # training steps of each sweep run
    powers: list[int]                # of FACTOR, the default rate's multipliers, ascending
    learning_rates: list[float]      # the rates tried, ascending
    losses: list[float]              # validation loss after each run (inf: it failed)
    chosen: int                      # index of the rate kept

    @property
    def learning_rate(self) -> float:
        """The rate the final run trains at."""
        return self.learning_rates[self.chosen]

    @property
    def power(self) -> int:
        """The chosen rate is the default one times ``FACTOR ** power``."""
        return self.powers[self.chosen]

    @property
    def at_edge(self) -> bool:
        """Whether the chosen rate is the grid's smallest or largest (the best may lie beyond
        it); never for a one-point grid."""
        return len(self.losses) > 1 and self.chosen in (0, len(self.losses) - 1)

    def as_dict(self) -> dict[str, Any]:
        """The sweep for ``results.json``."""
        return {"steps": self.steps, "powers": self.powers,
                "multipliers": [scaled(1.0, k) for k in self.powers],
                "learning_rates": self.learning_rates, "validation_losses": self.losses,
                "chosen_learning_rate": self.learning_rate, "at_edge": self.at_edge}


def best_index(losses: list[float], default: int) -> int:
    """The index of the lowest finite loss (the first of equal ones); ``default`` when none
    is finite."""
    finite = [(loss, i) for i, loss in enumerate(losses) if math.isfinite(loss)]
    return min(finite)[1] if finite else default


def sweep(names: list[str], corpus: Corpus, cfg: RunConfig, points: int, steps: int,
          par: Parallel = SINGLE,
          on_error: Callable[[str, Exception], None] | None = None) -> dict[str, Sweep]:
    """Run the sweep (see the module's docstring) of every optimizer of ``names``.

    ``cfg`` is the final runs' configuration; the sweep's runs take ``steps`` steps, eagerly,
    and are evaluated once, at their end, on the validation split of ``corpus``. A run that
    raises scores ``inf`` after ``on_error`` is told (without it the exception propagates).
    Under torchrun every rank keeps rank 0's losses, so that all choose alike.
    """
    grid = powers(points)
    data = corpus.validation_split()
    run_cfg = dataclasses.replace(cfg, steps=steps, eval_every=steps, compile=False)
    bar = ProgressBar(steps * len(grid) * len(names), "lr sweep", enabled=par.is_main)
    out: dict[str, Sweep] = {}
    try:
        for name in names:
            base = hyperparams(name)["learning_rate"]
            rates = [scaled(base, k) for k in grid]
            losses = []
            for rate in rates:
                try:
                    run = start(name, build(name, learning_rate=rate), data, run_cfg, par,
                                first_eval=False)
                    advance(run, steps, run_cfg, par, bar, timed=False)
                    losses.append(run.eval_curve[-1][1])
                except Exception as exc:  # a rate that fails is not chosen; the others run
                    if on_error is None:
                        raise
                    on_error(name, exc)
                    losses.append(math.inf)
            losses = par.gather(losses)[0]
            out[name] = Sweep(steps, grid, rates, losses, best_index(losses, len(rates) // 2))
    finally:
        bar.close()
    return out
