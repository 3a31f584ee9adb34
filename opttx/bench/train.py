"""Training the optimizers on the benchmark model, timed alike, eagerly or as compiled steps.

How every optimizer is timed alike (`train_all`):

1. a process warm-up: a few untimed steps of a throw-away model with ``torch.optim.SGD``, so
   the first optimizer does not pay for the process's first kernels, thread-pool start and
   allocator growth;
2. per optimizer, ``WARMUP_STEPS`` untimed training steps: the first ``TRACKED_STEPS`` run
   eagerly under `LiveTensorTracker` (its peak of live tensor bytes), the last one untracked
   (under ``--compile`` it compiles the step);
3. the timed steps, round-robin: in each round every optimizer runs its next ``block`` steps,
   starting from a different optimizer each round, so that a change in the machine's load
   falls on all of them alike. Every optimizer gets the same number of timed steps; each
   step (forward, backward, optimizer step and the loss's ``.item()``) is timed on its own and
   the report gives the median.
"""

from __future__ import annotations

import statistics
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call, grad_and_value

import opttx

from .data import Batch, Corpus, heldout_batches, train_batches
from .memory import LiveTensorTracker, tensor_bytes
from .model import GPT, GPTConfig, lm_loss
from .parallel import Parallel
from .progress import ProgressBar

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
StateFn = Callable[[], Any]
# An opttx transformation, or a function of the model's named parameters building a
# torch.optim.Optimizer-like object (a reference: step, zero_grad, state).
Builder = opttx.GradientTransformation | Callable[[list], Any]

# Untimed steps per optimizer (state creation, allocator warm-up, torch.compile compilation).
WARMUP_STEPS = 3
# The first of them run under the live-tensor tracker: the optimizer's peak bytes.
TRACKED_STEPS = 2
# Untimed steps of a throw-away model before the first optimizer (the process's warm-up).
PROCESS_WARMUP_STEPS = 3
# A single process (no torchrun).
SINGLE = Parallel("none")
# The reported final training loss averages this many last steps to damp batch noise.
FINAL_LOSS_WINDOW = 10


@dataclass(frozen=True)
class RunConfig:
    """Settings shared by every optimizer run."""

    model: GPTConfig
    steps: int
    batch_size: int
    eval_every: int
    eval_batches: int
    seed: int
    device: torch.device
    compile: bool
    block: int = 10          # timed steps per optimizer per round of the round-robin


@dataclass
class Run:
    """One optimizer's training: its model, step functions and what was measured."""

    name: str
    model: GPT
    step: StepFn             # the step that is timed (compiled under --compile)
    eager: StepFn            # the same step uncompiled: what the tracker measures
    state: StateFn           # the optimizer state, for its size
    batches: Iterator[Batch]
    heldout: list[Batch]
    done: int = 0
    loss_curve: list[list[float]] = field(default_factory=list)
    eval_curve: list[list[float]] = field(default_factory=list)
    step_times_ms: list[float] = field(default_factory=list)
    peak_live_bytes: int = 0


def eager_step(model: GPT, opt: Any) -> tuple[StepFn, StateFn]:
    """Train step ``loss.backward(); opt.step(); opt.zero_grad()`` with ``opt`` an
    ``opttx.Optimizer`` or any ``torch.optim.Optimizer``-like reference.

    Returns the step and a function giving the optimizer state to measure.
    """
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    state = (lambda: opt.tx_states) if isinstance(opt, opttx.Optimizer) else (lambda: opt.state)
    return step, state


def functional_step(model: GPT, tx: opttx.GradientTransformation
                    ) -> tuple[StepFn, StepFn, StateFn]:
    """Functional train step ``grad -> tx.update -> apply_updates_``, and the same step under
    ``torch.compile(fullgraph=True)``.

    The parameter dict holds detached aliases of the model's parameters, so the
    in-place updates also train ``model`` itself (used for evaluation).
    Returns the compiled step, the eager one and a function giving the optimizer state.
    """
    params = {name: p.detach() for name, p in model.named_parameters()}
    state = tx.init(params)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(functional_call(model, params, (x,)), y)

    grad_and_loss = grad_and_value(loss_fn)

    def step(params: dict[str, torch.Tensor], state: Any, x: torch.Tensor,
             y: torch.Tensor) -> torch.Tensor:
        grads, loss = grad_and_loss(params, x, y)
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        opttx.tree_copy_(state, new_state)
        return loss

    # a code object of its own per optimizer: Dynamo caches compiled graphs per code object,
    # so each optimizer's step compiles once and keeps its graph while the others run
    own = types.FunctionType(step.__code__.replace(co_name=f"step_{id(tx):x}"),
                             step.__globals__, step.__name__, None, step.__closure__)
    compiled = torch.compile(own, fullgraph=True)
    return ((lambda x, y: compiled(params, state, x, y)),
            (lambda x, y: step(params, state, x, y)), (lambda: state))


@torch.no_grad()
def evaluate(model: GPT, batches: list[Batch]) -> float:
    """Mean held-out loss over ``batches``."""
    return sum(lm_loss(model(x), y).item() for x, y in batches) / len(batches)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start(name: str, build: Builder, corpus: Corpus, cfg: RunConfig,
          par: Parallel = SINGLE, first_eval: bool = True) -> Run:
    """A freshly initialised model with its optimizer (``build``: an opttx transformation,
    made data parallel by ``par``, or a reference's builder), evaluated at step 0 if
    ``first_eval`` (the sweep's runs, scored at their end only, skip it).

    Every run uses the same seed, so all optimizers start from the same weights and see the
    same batches.
    """
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(cfg.device)
    if not isinstance(build, opttx.GradientTransformation):
        step, state = eager_step(model, build(list(model.named_parameters())))
        eager = step
    elif cfg.compile:
        step, eager, state = functional_step(model, par.wrap(build))
    else:
        opt = opttx.Optimizer(model.named_parameters(), par.wrap(build))
        step, state = eager_step(model, opt)
        eager = step
    batches = train_batches(corpus.train, cfg.batch_size, cfg.model.seq_len, cfg.seed, cfg.device)
    heldout = heldout_batches(corpus.heldout, cfg.batch_size, cfg.model.seq_len,
                              cfg.eval_batches, cfg.device)
    run = Run(name, model, step, eager, state, batches, heldout)
    if first_eval:
        run.eval_curve.append([0, evaluate(model, heldout)])
    return run


def advance(run: Run, n: int, cfg: RunConfig, par: Parallel, bar: ProgressBar,
            timed: bool = True, tracker: LiveTensorTracker | None = None) -> None:
    """Run ``n`` more training steps of ``run``; time each one if ``timed``; with a
    ``tracker``, run the eager step under it (untimed)."""
    for _ in range(n):
        x, y = par.local(*next(run.batches))
        if tracker is not None:
            tracker.track((x, y))
            with tracker:
                loss = par.mean(run.eager(x, y)).item()
        else:
            _sync(cfg.device)
            t0 = time.perf_counter()
            loss = par.mean(run.step(x, y)).item()
            if timed:
                run.step_times_ms.append(1e3 * (time.perf_counter() - t0))
        run.done += 1
        run.loss_curve.append([run.done, loss])
        bar.advance(loss, run.name)
        if run.done % cfg.eval_every == 0 or run.done == cfg.steps:
            run.eval_curve.append([run.done, evaluate(run.model, run.heldout)])


def warm_up(run: Run, cfg: RunConfig, par: Parallel, bar: ProgressBar) -> None:
    """The untimed first steps: the tracked ones (the run's peak live bytes), then the rest."""
    params = list(run.model.parameters())
    tracker = LiveTensorTracker(baseline=[params, run.state()], device=cfg.device)
    advance(run, TRACKED_STEPS, cfg, par, bar, timed=False, tracker=tracker)
    run.peak_live_bytes = tracker.peak
    advance(run, WARMUP_STEPS - TRACKED_STEPS, cfg, par, bar, timed=False)


def process_warm_up(cfg: RunConfig) -> None:
    """A few untimed steps of a throw-away model, so the first optimizer timed does not pay
    for the process's first kernels."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(cfg.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.model.seq_len),
                      device=cfg.device)
    for _ in range(PROCESS_WARMUP_STEPS):
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    _sync(cfg.device)


def summary(run: Run, cfg: RunConfig, par: Parallel) -> dict[str, Any]:
    """The figures of a finished run."""
    times = run.step_times_ms
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    last_losses = [loss for _, loss in run.loss_curve[-FINAL_LOSS_WINDOW:]]
    state_bytes = tensor_bytes(run.state())
    return {
        "final_train_loss": sum(last_losses) / len(last_losses),
        "final_eval_loss": run.eval_curve[-1][1],
        "tokens_per_s": cfg.batch_size * cfg.model.seq_len / (statistics.median(times) / 1e3),
        "step_time_ms": statistics.median(times),
        "step_time_quartiles_ms": [quartiles[0], quartiles[2]],
        "timed_steps": len(times),
        "warmup_steps": WARMUP_STEPS,
        "param_bytes": tensor_bytes(list(run.model.parameters())),
        "state_bytes": state_bytes,
        "state_bytes_per_rank": par.gather(state_bytes),
        "peak_live_bytes": run.peak_live_bytes,
        "step_times_ms": times,
        "loss_curve": run.loss_curve,
        "eval_curve": run.eval_curve,
    }


def train_all(builders: dict[str, Builder], corpus: Corpus, cfg: RunConfig,
              par: Parallel = SINGLE,
              on_error: Callable[[str, Exception], None] | None = None
              ) -> dict[str, dict[str, Any]]:
    """Train every optimizer of ``builders`` (name -> builder), timed alike (see the module's
    docstring); returns the figures per name, ``{"error": ...}`` for a run that failed
    (``on_error`` is told; without it the exception propagates)."""
    if cfg.steps <= WARMUP_STEPS:
        raise ValueError(f"steps ({cfg.steps}) must exceed the {WARMUP_STEPS} warm-up steps")
    out: dict[str, dict[str, Any]] = {}
    runs: dict[str, Run] = {}
    bar = ProgressBar(cfg.steps * len(builders), "training", enabled=par.is_main)

    def guarded(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # report the failure and carry on with the others
            if on_error is None:
                raise
            on_error(name, exc)
            out[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            runs.pop(name, None)
            return None

    try:
        process_warm_up(cfg)
        for name, build in builders.items():
            run = guarded(name, start, name, build, corpus, cfg, par)
            if run is not None:
                runs[name] = run
                guarded(name, warm_up, run, cfg, par, bar)
        for i in range(-(-(cfg.steps - WARMUP_STEPS) // cfg.block)):
            order = list(runs)
            k = i % max(len(order), 1)     # each round starts from the next optimizer
            for name in order[k:] + order[:k]:
                run = runs[name]
                guarded(name, advance, run, min(cfg.block, cfg.steps - run.done), cfg, par, bar)
    finally:
        bar.close()
    for name in builders:
        if name in runs:
            out[name] = summary(runs[name], cfg, par)
    return {name: out[name] for name in builders}
