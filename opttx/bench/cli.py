"""Command-line entry point: ``python -m opttx.bench``."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .data import VOCAB_SIZE, Corpus
from .model import GPTConfig
from .optimizers import DEFAULT_OPTIMIZERS, build, hyperparams, split_available
from .parallel import MODES, setup
from .report import text_table, write_report
from .train import RunConfig, train


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse command-line flags."""
    p = argparse.ArgumentParser(
        prog="python -m opttx.bench",
        description=(
            "Train a tiny byte-level GPT on the Python standard library's source with several "
            "opttx optimizers (same initialisation, same batches) and compare loss, speed and "
            "memory."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--optimizers",
        default=",".join(DEFAULT_OPTIMIZERS),
        help="comma-separated opttx alias names; names opttx does not provide are skipped",
    )
    p.add_argument("--steps", type=int, default=150, help="training steps per optimizer")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    p.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--n-layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads")
    p.add_argument("--eval-every", type=int, default=50,
                   help="held-out evaluation interval in steps")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--corpus-bytes", type=int, default=3_000_000,
                   help="bytes of stdlib source to read")
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="tail of the corpus held out for evaluation")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--compile",
        action="store_true",
        help="train with a torch.compile'd functional step (tx.update + apply_updates_) "
        "instead of the eager opttx.Optimizer loop",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for initialisation and batch sampling")
    p.add_argument(
        "--parallel",
        choices=MODES,
        default="auto",
        help="under torchrun: 'zero' (opttx.distributed.zero, optimizer state divided among "
        "the ranks) or 'dp' (all_reduce_gradients, state replicated); 'auto' is zero under "
        "torchrun and a single process otherwise",
    )
    p.add_argument("--out", type=Path, default=Path("report"), help="report folder")
    args = p.parse_args(argv)
    for flag in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "corpus_bytes"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if not 0.0 < args.heldout_fraction < 1.0:
        p.error("--heldout-fraction must be between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Run the benchmark and write the report; return the per-optimizer results."""
    args = parse_args(argv)
    requested = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    names, missing = split_available(requested)
    if missing:
        print(f"skipping optimizers not provided by opttx: {', '.join(missing)}", file=sys.stderr)
    if not names:
        raise SystemExit("none of the requested optimizers exists in opttx")

    corpus = Corpus.from_stdlib(args.corpus_bytes, args.heldout_fraction)
    cfg = RunConfig(
        model=GPTConfig(
            vocab_size=VOCAB_SIZE,
            seq_len=args.seq_len,
            d_model=args.d_model,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
        ),
        steps=args.steps,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        seed=args.seed,
        device=torch.device(args.device),
        compile=args.compile,
    )
    par = setup(args.parallel, cfg.device, cfg.batch_size)
    if par.is_main:
        print(
            f"corpus: {len(corpus.train):,} train / {len(corpus.heldout):,} held-out bytes; "
            f"{'compiled' if args.compile else 'eager'} on {cfg.device}; "
            + (f"{par.mode} over {par.world} ranks; " if par.world > 1 else "")
            + f"optimizers: {', '.join(names)}",
            file=sys.stderr,
        )

    results: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    for name in names:
        results[name] = {"hyperparams": hyperparams(name)}
        try:
            results[name].update(train(name, build(name), corpus, cfg, par))
        except Exception as exc:  # report the failure and carry on with the other optimizers
            traceback.print_exc()
            results[name]["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if par.world > 1:     # the other ranks may be waiting in a collective: stop
                raise
    elapsed = time.perf_counter() - start
    par.close()
    if not par.is_main:
        return results

    settings = {k: str(v) for k, v in vars(args).items()}
    settings.update(train_bytes=len(corpus.train), heldout_bytes=len(corpus.heldout),
                    wall_time_s=f"{elapsed:.1f}", world_size=str(par.world),
                    parallel=par.mode)
    notes = write_report(results, args.out, settings)
    print(text_table(results))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"report written to {args.out}/ in {elapsed:.1f}s", file=sys.stderr)
    return results
