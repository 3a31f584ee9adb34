"""Training one optimizer on the benchmark model, eagerly or as a compiled step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call, grad_and_value

import opttx

from .data import Batch, Corpus, heldout_batches, train_batches
from .memory import peak_memory_bytes, peak_memory_kind, reset_peak_memory, tensor_bytes
from .model import GPT, GPTConfig, lm_loss
from .parallel import Parallel
from .progress import ProgressBar

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
StateFn = Callable[[], Any]

# Steps excluded from timing (allocator warm-up, torch.compile compilation).
WARMUP_STEPS = 3
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


def eager_step(model: GPT, tx: opttx.GradientTransformation) -> tuple[StepFn, StateFn]:
    """Train step using ``opttx.Optimizer`` as a regular ``torch.optim.Optimizer``.

    Returns the step and a function giving the optimizer state to measure.
    """
    opt = opttx.Optimizer(model.parameters(), tx)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, lambda: opt.tx_states


def compiled_step(model: GPT, tx: opttx.GradientTransformation) -> tuple[StepFn, StateFn]:
    """Functional train step ``grad -> tx.update -> apply_updates_`` under ``torch.compile``.

    The parameter dict holds detached aliases of the model's parameters, so the
    in-place updates also train ``model`` itself (used for evaluation).
    Returns the step and a function giving the optimizer state to measure.
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

    torch.compiler.reset()  # each optimizer compiles afresh, never against the recompile limit
    compiled = torch.compile(step, fullgraph=True)
    return (lambda x, y: compiled(params, state, x, y)), (lambda: state)


@torch.no_grad()
def evaluate(model: GPT, batches: list[Batch]) -> float:
    """Mean held-out loss over ``batches``."""
    return sum(lm_loss(model(x), y).item() for x, y in batches) / len(batches)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(name: str, tx: opttx.GradientTransformation, corpus: Corpus,
          cfg: RunConfig, par: Parallel = Parallel("none")) -> dict[str, Any]:
    """Train a freshly initialised model with ``tx`` and return its metrics.

    Every call uses the same seed, so all optimizers start from the same weights
    and see the same batches. Under ``torchrun`` (``par``), every rank trains on its rows
    of each global batch with ``tx`` made data parallel (`Parallel.wrap`); losses are
    the global batch's, state bytes this rank's (``state_bytes_per_rank`` lists all).
    """
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model).to(cfg.device)
    make_step = compiled_step if cfg.compile else eager_step
    step, optimizer_state = make_step(model, par.wrap(tx))
    batches = train_batches(corpus.train, cfg.batch_size, cfg.model.seq_len, cfg.seed, cfg.device)
    heldout = heldout_batches(corpus.heldout, cfg.batch_size, cfg.model.seq_len,
                              cfg.eval_batches, cfg.device)

    warmup = min(WARMUP_STEPS, cfg.steps - 1)
    loss_curve: list[list[float]] = []
    eval_curve: list[list[float]] = [[0, evaluate(model, heldout)]]
    timed_s = 0.0
    reset_peak_memory(cfg.device)
    bar = ProgressBar(cfg.steps, name, enabled=par.is_main)
    try:
        for i in range(1, cfg.steps + 1):
            x, y = par.local(*next(batches))
            _sync(cfg.device)
            start = time.perf_counter()
            loss = par.mean(step(x, y)).item()
            if i > warmup:
                timed_s += time.perf_counter() - start
            loss_curve.append([i, loss])
            bar.advance(loss)
            if i % cfg.eval_every == 0 or i == cfg.steps:
                eval_curve.append([i, evaluate(model, heldout)])
    finally:
        bar.close()

    step_s = timed_s / (cfg.steps - warmup)
    last_losses = [loss for _, loss in loss_curve[-FINAL_LOSS_WINDOW:]]
    state_bytes = tensor_bytes(optimizer_state())
    return {
        "final_train_loss": sum(last_losses) / len(last_losses),
        "final_eval_loss": eval_curve[-1][1],
        "tokens_per_s": cfg.batch_size * cfg.model.seq_len / step_s,
        "step_time_ms": 1000.0 * step_s,
        "state_bytes": state_bytes,
        "state_bytes_per_rank": par.gather(state_bytes),
        "peak_memory_bytes": peak_memory_bytes(cfg.device),
        "peak_memory_kind": peak_memory_kind(cfg.device),
        "loss_curve": loss_curve,
        "eval_curve": eval_curve,
    }
