"""Command-line entry point: ``python -m opttx.bench``."""

from __future__ import annotations

import argparse
import dataclasses
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
from .references import Reference, select_references
from .report import sweep_text_table, text_table, write_report
from .sweep import DEFAULT_POINTS, Sweep, multiplier_label, powers, scaled, sweep
from .train import WARMUP_STEPS, Builder, RunConfig, train_all


def parser() -> argparse.ArgumentParser:
    """The command line's flags."""
    p = argparse.ArgumentParser(
        prog="python -m opttx.bench",
        description=(
            "Train a tiny byte-level GPT on the Python standard library's source with several "
            "opttx optimizers (same initialisation, same batches) and compare loss, speed and "
            "memory. Each optimizer first runs a learning-rate sweep: --sweep rates (its "
            "default times 3**k around 1: x1/3, x1, x3), each trained for --sweep-steps on the "
            "training stream less a validation split (its tail, as long as the held-out "
            "split); the final, timed run uses the rate with the lowest validation loss and "
            "is evaluated on the held-out split."
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
    p.add_argument("--sweep", type=int, default=DEFAULT_POINTS, metavar="N",
                   help="learning rates tried per optimizer before its final run (odd: the "
                   "default rate times 3**k, k = -(N-1)/2 .. (N-1)/2); 1 runs no sweep")
    p.add_argument("--no-sweep", dest="sweep", action="store_const", const=1,
                   help="train at the default learning rates, with no sweep (--sweep 1)")
    p.add_argument("--sweep-steps", type=int, default=None,
                   help="training steps of each sweep run; None: a third of --steps, at "
                   "least 1 (shorter than the final run, so that the demo with the sweep "
                   "takes about twice as long as without)")
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
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse command-line flags (see `parser`) and check them."""
    p = parser()
    args = p.parse_args(argv)
    if args.sweep_steps is None:
        args.sweep_steps = max(args.steps // 3, 1)
    for flag in ("steps", "block", "sweep", "sweep_steps", "batch_size", "seq_len",
                 "eval_every", "eval_batches", "corpus_bytes"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps must exceed the {WARMUP_STEPS} untimed warm-up steps")
    if not 0.0 < args.heldout_fraction < 1.0:
        p.error("--heldout-fraction must be between 0 and 1")
    if args.sweep % 2 == 0:
        p.error("--sweep must be odd (the default rate and as many rates above it as below)")
    if args.sweep > 1 and args.heldout_fraction >= 0.5:
        p.error("--heldout-fraction must be below 0.5 with the sweep: its validation split, "
                "as long as the held-out one, is cut from the training stream")
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
    cfg = _run_config(args)
    par = setup(args.parallel, cfg.device, cfg.batch_size)
    if par.is_main:
        print(
            f"corpus: {len(corpus.train):,} train / {len(corpus.heldout):,} held-out bytes; "
            f"{'compiled' if args.compile else 'eager'} on {cfg.device}; "
            + (f"{par.mode} over {par.world} ranks" if par.world > 1 else "single process"),
            file=sys.stderr,
        )
    refs = _references(requested, args.references, par)

    def on_error(name: str, exc: Exception) -> None:
        traceback.print_exc()
        if par.world > 1:     # the other ranks may be waiting in a collective: stop
            raise exc

    start = time.perf_counter()
    sweeps: dict[str, Sweep] = {}
    if args.sweep > 1:
        if par.is_main:
            print(f"learning-rate sweep: {args.sweep} rates per optimizer "
                  f"({', '.join(map(multiplier_label, powers(args.sweep)))}), "
                  f"{args.sweep_steps} steps each", file=sys.stderr)
        sweeps = sweep(names, corpus, cfg, args.sweep, args.sweep_steps, par, on_error)
    sweep_time = time.perf_counter() - start
    builders, hyper = _builders(names, requested, refs, sweeps)
    if par.is_main:
        print(f"optimizers: {', '.join(builders)}", file=sys.stderr)
    results = train_all(builders, corpus, cfg, par, on_error)
    elapsed = time.perf_counter() - start
    par.close()
    for name, r in results.items():
        r["hyperparams"] = hyper[name]
        r["learning_rate"] = hyper[name].get("learning_rate", hyper[name].get("lr"))
        if name in sweeps:
            r["sweep"] = sweeps[name].as_dict()
    if not par.is_main:
        return results

    settings = {k: str(v) for k, v in vars(args).items()}
    settings.update(train_bytes=len(corpus.train), heldout_bytes=len(corpus.heldout),
                    wall_time_s=f"{elapsed:.1f}", sweep_time_s=f"{sweep_time:.1f}",
                    world_size=str(par.world), parallel=par.mode)
    notes = write_report(results, args.out, settings)
    if sweeps:
        print(sweep_text_table(results) + "\n")
    print(text_table(results))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"report written to {args.out}/ in {elapsed:.1f}s (the sweep {sweep_time:.1f}s)",
          file=sys.stderr)
    return results


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The final runs' settings, from the flags."""
    return RunConfig(
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


def _references(requested: list[str], references: bool, par: Parallel) -> list[Reference]:
    """The references to run (none without ``--references`` or under torchrun), each reason
    for leaving one out printed."""
    if not references:
        return []
    if par.world > 1:
        if par.is_main:
            print("skipping --references: they run in a single process only", file=sys.stderr)
        return []
    refs, skipped = select_references(requested)
    for reason in skipped:
        print(f"skipping reference {reason}", file=sys.stderr)
    return refs


def _builders(names: list[str], requested: list[str], refs: list[Reference],
              sweeps: dict[str, Sweep]
              ) -> tuple[dict[str, Builder], dict[str, dict[str, Any]]]:
    """What each run trains with (name -> opttx transformation or reference builder), each
    reference right after its opttx counterpart, and each run's hyper-parameters: a swept
    optimizer at its chosen rate, a reference at its own rate scaled as its counterpart's."""
    builders: dict[str, Builder] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for name in names + [n for n in requested if n not in names]:
        chosen = sweeps.get(name)
        if name in names:
            rate = {"learning_rate": chosen.learning_rate} if chosen else {}
            builders[name], hyper[name] = build(name, **rate), hyperparams(name, **rate)
        for ref in refs:
            if ref.counterpart == name:
                if chosen:
                    ref = dataclasses.replace(ref, hyperparams={
                        **ref.hyperparams, "lr": scaled(ref.hyperparams["lr"], chosen.power)})
                builders[ref.name] = ref.build
                hyper[ref.name] = {**ref.hyperparams, "reference_for": name,
                                   **({"note": ref.note} if ref.note else {})}
    return builders, hyper
