"""Which optimizers the benchmark runs, and with which hyper-parameters."""

from __future__ import annotations

from typing import Any

import opttx

# adamw, lion and sgd are the first-order baselines; the rest run as their aliases land.
DEFAULT_OPTIMIZERS = ("adamw", "lion", "sgd", "muon", "adafactor", "came", "lamb",
                      "galore_adamw", "adamw_8bit", "adamw_4bit", "galore_adamw_8bit", "shampoo",
                      "adalomo", "soap", "normuon", "adamuon", "dion", "dion2", "kron")

# AdamW with its moments stored in each of quantize_state's formats, beside fp32 "adamw" (the
# rows of `--optimizers` given by `LOW_BIT_OPTIMIZERS`): each is chain(quantize_state(
# scale_by_adam(), format=...), add_decayed_weights(wd), scale_by_learning_rate(lr)) with
# adamw's rate and weight decay, so that the state format is all that differs. adamw_8bit and
# adamw_4bit are opttx aliases; these are built here.
STATE_FORMAT_ROWS: dict[str, str] = {"adamw_fp8": "e4m3", "adamw_fp8_e5m2": "e5m2",
                                     "adamw_bf16_ecc": "bf16_ecc", "adamw_bf16_sr": "bf16_sr"}
LOW_BIT_OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", *STATE_FORMAT_ROWS)

# Keyword arguments per optimizer alias for the tiny byte-level GPT at its default
# size.  The sgd, adamw and lion rates are the best of a coarse 150-step sweep
# (factors of ~3); the others are educated guesses.  Each ``learning_rate`` is the
# centre of the demo's learning-rate sweep (sweep.py), which tries it and its
# neighbours and keeps the best on a validation split.  Only ``learning_rate`` is
# passed where the alias's other defaults are sensible.  Relative-step methods
# (Adafactor, AdaLomo, LAMB) scale updates by parameter norms and so take larger rates.
HYPERPARAMS: dict[str, dict[str, Any]] = {
    "sgd": {"learning_rate": 0.03, "momentum": 0.9},
    "adam": {"learning_rate": 1e-3},
    "adamw": {"learning_rate": 1e-3},
    "nadam": {"learning_rate": 1e-3},
    "adagrad": {"learning_rate": 1e-2},
    "rmsprop": {"learning_rate": 3e-4},
    "lion": {"learning_rate": 3e-4},
    "adafactor": {"learning_rate": 1e-2},
    "came": {"learning_rate": 1e-3},
    "lamb": {"learning_rate": 1e-2},
    # d_model is 128: rank 32 projects every matrix to a quarter of its small side
    "galore_adamw": {"learning_rate": 3e-3, "rank": 32, "update_proj_gap": 50, "scale": 0.25},
    "galore_adamw_8bit": {"learning_rate": 3e-3, "rank": 32, "update_proj_gap": 50,
                          "scale": 0.25},
    # adamw's weight decay (1e-4), not the aliases' default 1e-2: only the state format differs
    "adamw_8bit": {"learning_rate": 1e-3, "weight_decay": 1e-4},
    "adamw_4bit": {"learning_rate": 1e-3, "weight_decay": 1e-4},
    **{name: {"learning_rate": 1e-3, "weight_decay": 1e-4} for name in STATE_FORMAT_ROWS},
    "shampoo": {"learning_rate": 1e-3, "betas": (0.9, 0.999), "grafting": "adam",
                "precondition_frequency": 10, "epsilon": 1e-10},
    "adalomo": {"learning_rate": 1e-2},
    # Muon on the hidden matrices (Newton-Schulz-orthogonalized momentum: unit-scale updates,
    # hence the larger rate), AdamW at adamw's rate on the embeddings and vectors
    "muon": {"learning_rate": 0.02, "adam_learning_rate": 1e-3},
    "soap": {"learning_rate": 3e-3},
    # the Muon family: matrices as muon's (the dion package's spectral-norm
    # scaling sqrt(fan_out/fan_in) where it is theirs), AdamW at adamw's rate elsewhere
    "normuon": {"learning_rate": 0.02, "weight_decay": 0.0, "adam_learning_rate": 1e-3},
    "adamuon": {"learning_rate": 1e-3, "adam_learning_rate": 1e-3},
    "dion": {"learning_rate": 0.02, "rank_fraction": 0.25, "weight_decay": 0.0,
             "adam_learning_rate": 1e-3},
    "dion2": {"learning_rate": 0.02, "fraction": 0.25, "weight_decay": 0.0,
              "adam_learning_rate": 1e-3},
    "kron": {"learning_rate": 3e-4},
}
FALLBACK_HYPERPARAMS: dict[str, Any] = {"learning_rate": 1e-3}

# DiLoCo rows: `opttx.distributed.diloco` around the named alias (built with this row's
# hyperparameters; its learning rate is the one the sweep moves), with DiLoCo's default outer
# step (Nesterov SGD, 0.7, 0.9) every `DILOCO_SYNC_EVERY` steps. The bench trains one model in
# one process, so the row is DiLoCo with a single replica: the inner steps and the outer step on
# the replica's own pseudo-gradient (no all-reduce; not tried under torchrun, where the bench
# wraps every row in its own data parallelism). What it shows is the outer optimizer's effect
# on the loss; the communication saving is measured in benchmarks/diloco.py.
DILOCO_ROWS: dict[str, str] = {"diloco_adamw": "adamw"}
DILOCO_SYNC_EVERY = 10
HYPERPARAMS["diloco_adamw"] = {"learning_rate": 1e-3}
DEFAULT_OPTIMIZERS = DEFAULT_OPTIMIZERS + tuple(DILOCO_ROWS)
# Hyperball-Muon (MuonH): Muon's direction on the hidden matrices with their weight and update
# norms fixed (no weight decay); its rate is the angular step per update (||dW|| = lr·||W0||),
# AdamW at adamw's rate elsewhere. Centred at 0.06: with 0.02 at the centre the sweep chose
# its top edge (0.06); the sweep now tries 0.02, 0.06 and 0.18
DEFAULT_OPTIMIZERS += ("hyperball_muon",)
HYPERPARAMS["hyperball_muon"] = {"learning_rate": 0.06, "adam_learning_rate": 1e-3}


def split_available(names: list[str]) -> tuple[list[str], list[str]]:
    """Partition ``names`` into those that ``opttx`` provides and those it lacks."""
    present = [n for n in names if hasattr(opttx, n) or n in STATE_FORMAT_ROWS
               or n in DILOCO_ROWS]
    return present, [n for n in names if n not in present]


def hyperparams(name: str, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments used to build optimizer ``name``: its `HYPERPARAMS` entry (or
    `FALLBACK_HYPERPARAMS`) with ``overrides`` (e.g. the sweep's ``learning_rate``)."""
    return {**HYPERPARAMS.get(name, FALLBACK_HYPERPARAMS), **overrides}


def build(name: str, **overrides: Any) -> opttx.GradientTransformation:
    """Build the ``opttx`` gradient transformation named ``name`` with `hyperparams`
    ``(name, **overrides)``."""
    hp = hyperparams(name, **overrides)
    if name in DILOCO_ROWS:
        return opttx.distributed.diloco(build(DILOCO_ROWS[name], **hp),
                                        sync_every=DILOCO_SYNC_EVERY)
    if name in STATE_FORMAT_ROWS:
        return opttx.chain(
            opttx.quantize_state(opttx.scale_by_adam(), format=STATE_FORMAT_ROWS[name]),
            opttx.add_decayed_weights(hp["weight_decay"]),
            opttx.scale_by_learning_rate(hp["learning_rate"]))
    return getattr(opttx, name)(**hp)
