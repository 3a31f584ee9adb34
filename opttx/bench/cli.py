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
from .parallel import MODES, Parallel, setup
from .references import select_references
from .report import text_table, write_report
from .train import WARMUP_STEPS, Builder, RunConfig, train_all


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
        help="comma-separated opttx alias names (and adamw_fp8, adamw_fp8_e5m2, "
        "adamw_bf16_ecc, adamw_bf16_sr: AdamW with quantize_state's other formats); names "
        "opttx does not provide are skipped",
    )
    p.add_argument("--steps", type=int, default=150,
                   help=f"training steps per optimizer (the first {WARMUP_STEPS} untimed)")
    p.add_argument("--block", type=int, default=10,
                   help="timed steps each optimizer runs per round of the round-robin")
    p.add_argument(
        "--references",
        action="store_true",
        help="also run the other libraries' counterparts of the chosen optimizers "
        "(torch.optim AdamW and Muon, transformers Adafactor, heavyball Muon and SOAP, "
        "torchao AdamW8bit, AdamW4bit and AdamWFp8; "
        "eagerly; a library not installed is skipped with the reason printed)",
    )
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
    p.add_argument("--seed", type=int, default=0,
                   help="seed for initialisation and batch sampling")
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
    for flag in ("steps", "block", "batch_size", "seq_len", "eval_every", "eval_batches",
                 "corpus_bytes"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must exceed the {WARMUP_STEPS} untimed warm-up steps")
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
        block=args.block,
    )
    par = setup(args.parallel, cfg.device, cfg.batch_size)
    if par.is_main:
        print(
            f"corpus: {len(corpus.train):,} train / {len(corpus.heldout):,} held-out bytes; "
            f"{'compiled' if args.compile else 'eager'} on {cfg.device}; "
            + (f"{par.mode} over {par.world} ranks" if par.world > 1 else "single process"),
            file=sys.stderr,
        )

    builders, hyper = _builders(names, requested, args.references, par)
    if par.is_main:
        print(f"optimizers: {', '.join(builders)}", file=sys.stderr)

    def on_error(name: str, exc: Exception) -> None:
        traceback.print_exc()
        if par.world > 1:     # the other ranks may be waiting in a collective: stop
            raise exc

    start = time.perf_counter()
    results = train_all(builders, corpus, cfg, par, on_error)
    for name, r in results.items():
        r["hyperparams"] = hyper[name]
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


def _builders(names: list[str], requested: list[str], references: bool, par: Parallel
              ) -> tuple[dict[str, Builder], dict[str, dict[str, Any]]]:
    """What each run trains with (name -> opttx transformation or reference builder), each
    reference right after its opttx counterpart, and each run's hyper-parameters."""
    builders: dict[str, Builder] = {}
    hyper: dict[str, dict[str, Any]] = {}
    refs = []
    if references and par.world > 1:
        if par.is_main:
            print("skipping --references: they run in a single process only", file=sys.stderr)
    elif references:
        refs, skipped = select_references(requested)
        for reason in skipped:
            print(f"skipping reference {reason}", file=sys.stderr)
    for name in names + [n for n in requested if n not in names]:
        if name in names:
            builders[name], hyper[name] = build(name), hyperparams(name)
        for ref in refs:
            if ref.counterpart == name:
                builders[ref.name] = ref.build
                hyper[ref.name] = {**ref.hyperparams, "reference_for": name,
                                   **({"note": ref.note} if ref.note else {})}
    return builders, hyper
