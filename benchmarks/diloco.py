"""Bytes per step of DiLoCo (`opttx.distributed.diloco`) against plain data parallelism, and
its compiled step (one graph at world 2).

2 gloo ranks (one spawn), each training the same small MLP on its own batches for ``--steps``
steps. Every all-reduce is counted by a wrapper around
``torch.distributed._functional_collectives.all_reduce`` (what `pack_all_reduce` calls):

  dp         chain(all_reduce_gradients(), adamw): every gradient, every step
  diloco H   diloco(adamw, sync_every=H): every parameter, every H steps
  stream H/F diloco(adamw, sync_every=H, fragments=F): one fragment every H/F steps

Then the DiLoCo step (update + apply_updates) compiled with ``fullgraph=True`` over sync and
non-sync steps: the number of graphs (1: the sync is a torch.cond branch, nothing recompiles)
and the largest difference from eager. No timing.

Examples:
  python benchmarks/diloco.py                 # H = 4, 16; F = 2
  python benchmarks/diloco.py --steps 32 --h 8 --backend aot_eager
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.func import functional_call, grad

import opttx
from opttx.distributed import all_reduce_gradients, diloco
from opttx.testing import spawn_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _loss(model: torch.nn.Module, params: dict, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)


def _run(tx: opttx.GradientTransformation, rank: int, steps: int) -> dict:
    counter = {"calls": 0, "bytes": 0}
    real = funcol.all_reduce

    def counted(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        counter["calls"] += 1
        counter["bytes"] += tensor.numel() * tensor.element_size()
        return real(tensor, op, group)

    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    funcol.all_reduce = counted
    try:
        for step in range(steps):
            g = grad(lambda p: _loss(model, p, rank, step))(params)
            updates, state = tx.update(g, state, params)
            params = opttx.apply_updates(params, updates)
    finally:
        funcol.all_reduce = real
    loss = float(_loss(model, params, rank, steps))
    return {**counter, "loss": loss}


def _compiled(rank: int, h: int, backend: str) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = diloco(opttx.adamw(1e-3), sync_every=h, fragments=2)

    def step(g: dict, s: Any, p: dict) -> tuple:
        u, s = tx.update(g, s, p)
        return opttx.apply_updates(p, u), s

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    a, sa, b, sb = params, tx.init(params), params, tx.init(params)
    for t in range(2 * h):
        g = grad(lambda p: _loss(model, p, rank, t))(a)
        a, sa = compiled(g, sa, a)
        b, sb = step(g, sb, b)
    return {"graphs": counter.frame_count,
            "difference": max(float((a[k] - b[k]).abs().max()) for k in a)}


def _worker(rank: int, world: int, steps: int, hs: list[int], fragments: int,
            backend: str) -> dict:
    del world
    rows = {"dp": _run(opttx.chain(all_reduce_gradients(), opttx.adamw(1e-3)), rank, steps)}
    for h in hs:
        rows[f"diloco H={h}"] = _run(diloco(opttx.adamw(1e-3), sync_every=h), rank, steps)
        rows[f"stream H={h} F={fragments}"] = _run(
            diloco(opttx.adamw(1e-3), sync_every=h, fragments=fragments), rank, steps)
    rows["compiled"] = _compiled(rank, hs[0], backend)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--h", type=int, nargs="+", default=[4, 16])
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the compiled check (aot_eager: the graph "
                   "without Inductor's code generation, faster)")
    args = p.parse_args()
    # the ranks import the worker from this file as a module (not from __main__)
    import importlib
    worker = importlib.import_module("diloco")._worker
    rank0 = spawn_ranks(worker, 2, args=(args.steps, args.h, args.fragments, args.backend), timeout=900)[0]
    compiled = rank0.pop("compiled")
    dp = rank0["dp"]
    print(f"world 2 (gloo), {args.steps} steps, "
          f"{sum(p.numel() for p in _model().parameters())} float32 parameters")
    print(f"{'run':<18}{'all-reduces':>12}{'KiB total':>12}{'KiB / step':>12}"
          f"{'DP / this':>11}{'loss (rank 0)':>15}")
    for name, r in rank0.items():
        ratio = dp["bytes"] / r["bytes"] if r["bytes"] else float("inf")
        print(f"{name:<18}{r['calls']:>12}{r['bytes'] / 1024:>12.1f}"
              f"{r['bytes'] / 1024 / args.steps:>12.2f}{ratio:>11.2f}{r['loss']:>15.4f}")
    print(f"compiled DiLoCo step ({args.backend}, H={args.h[0]}, 2 fragments, "
          f"{2 * args.h[0]} steps): "
          f"{compiled['graphs']} graph(s), largest difference from eager "
          f"{compiled['difference']:.2e}")


if __name__ == "__main__":
    main()
