"""Compressed optimizer states (`quantize_state` formats) on the bench GPT: bytes per parameter
read from the states, and the optimizer step's time against plain AdamW, side by side.

For each state format of AdamW (fp32 ``adamw``, ``8bit``, ``4bit``, ``e4m3``, ``e5m2``,
``bf16_ecc``, ``bf16_sr``) and torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` where
torchao is installed:

* **bytes per parameter** of Adam's two moments, summed from the state's own tensors after one
  step: over the compressed leaves alone (what a format costs), and over the whole state
  (fp32 moments of the small leaves, step counts and the rounding tables of the maps, all
  included) per parameter of the model;
* **optimizer step time**: ``tx.update`` + ``apply_updates_`` (opttx) or ``opt.step()``
  (torchao) on fixed gradients, eager, in round-robin blocks so that a change of the machine's
  load falls on every variant alike; the median and its ratio to fp32 AdamW's. With
  ``--compiled`` also the opttx steps under ``torch.compile(fullgraph=True)`` (Inductor).

Training quality (final train and held-out loss with the same seeds) comes from the bench
itself::

    python -m opttx.bench --optimizers adamw,adamw_8bit,adamw_4bit,adamw_fp8,adamw_fp8_e5m2,\\
        adamw_bf16_ecc,adamw_bf16_sr --references

Usage::

    python benchmarks/lowbit.py [--steps 30] [--block 5] [--compiled] [--d-model 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

import opttx
from opttx.bench.model import GPT, GPTConfig
from opttx.transforms.state_formats import CorrectedTensor, QuantizedTensor

FORMATS = ("8bit", "4bit", "e4m3", "e5m2", "bf16_ecc", "bf16_sr")
TORCHAO = {"AdamW8bit": "8bit", "AdamW4bit": "4bit", "AdamWFp8": "e4m3"}
LR, WD = 1e-3, 1e-4


def adamw(fmt: str | None) -> opttx.GradientTransformation:
    inner = opttx.scale_by_adam()
    if fmt is not None:
        inner = opttx.quantize_state(inner, format=fmt)
    return opttx.chain(inner, opttx.add_decayed_weights(WD), opttx.scale_by_learning_rate(LR))


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in opttx.tree.tree_leaves(tensors)
               if isinstance(t, torch.Tensor))


def opttx_bytes(state: Any, params: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(bytes per element of the compressed leaves, bytes per parameter of the whole state)."""
    total = sum(p.numel() for p in params.values())
    q = state[0]
    if not isinstance(q, opttx.QuantizedState):          # fp32 adamw
        return float("nan"), nbytes(state) / total
    compressed = [n for leaf in q.quantized for n in opttx.tree.tree_leaves(
        leaf, is_leaf=lambda x: isinstance(x, (QuantizedTensor, CorrectedTensor)))
        if isinstance(n, (QuantizedTensor, CorrectedTensor))]
    elements = sum(p.numel() for p, s in zip(params.values(), _slots(q)) if s)
    return nbytes([c[:2] for c in compressed]) / elements, nbytes(state) / total


def _slots(q: opttx.QuantizedState) -> list[bool]:
    return [s.quantized for s in opttx.tree.tree_leaves(
        q.plan, is_leaf=lambda x: isinstance(x, opttx.LeafSlot))]


def torchao_bytes(opt: Any, params: dict[str, torch.Tensor]) -> tuple[float, float]:
    total = sum(p.numel() for p in params.values())
    whole, compressed, elements = 0, 0, 0
    for p in params.values():
        for name in ("exp_avg", "exp_avg_sq"):
            x = opt.state[p][name]
            inner = [getattr(x, a) for a in getattr(x, "tensor_attrs", [])]
            size = nbytes(inner) if inner else x.numel() * x.element_size()
            whole += size
            if inner:
                compressed += nbytes([t for t, a in zip(inner, x.tensor_attrs) if a != "qmap"])
                elements += p.numel() if name == "exp_avg" else 0
        whole += nbytes(opt.state[p]["step"])
    return compressed / max(elements, 1), whole / total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    ap.add_argument("--block", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--compiled", action="store_true", help="also time compiled opttx steps")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=2)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=args.d_model, n_layers=args.n_layers))
    base = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    grads = {k: torch.randn(v.shape, generator=gen) * 1e-2 for k, v in base.items()}
    print(f"bench GPT d_model {args.d_model}, {args.n_layers} layers: "
          f"{sum(v.numel() for v in base.values()):,} parameters in {len(base)} tensors; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)

    steps: dict[str, Callable[[], None]] = {}
    sizes: dict[str, tuple[float, float]] = {}
    for fmt in (None, *FORMATS):
        name = "adamw" if fmt is None else f"opttx {fmt}"
        tx = adamw(fmt)
        params = {k: v.clone() for k, v in base.items()}
        state = tx.init(params)
        box = {"state": state}

        def step(tx=tx, params=params, box=box) -> None:
            with opttx.donating():
                updates, box["state"] = tx.update(grads, box["state"], params)
            opttx.apply_updates_(params, updates)

        step()
        sizes[name] = opttx_bytes(box["state"], params)
        steps[name] = step
        if args.compiled:
            def functional(params, state, grads, tx=tx):
                updates, new = tx.update(grads, state, params)
                opttx.apply_updates_(params, updates)
                opttx.tree_copy_(state, new)
            code = functional.__code__.replace(co_name=f"step_{fmt}")
            import types
            own = types.FunctionType(code, functional.__globals__, code.co_name,
                                     functional.__defaults__)
            compiled = torch.compile(own, fullgraph=True)
            cparams = {k: v.clone() for k, v in base.items()}
            cstate = tx.init(cparams)
            t0 = time.perf_counter()
            compiled(cparams, cstate, grads)
            print(f"compiled {name}: {time.perf_counter() - t0:.1f} s to compile",
                  file=sys.stderr)
            steps[f"{name} (compiled)"] = (lambda c=compiled, p=cparams, s=cstate:
                                          c(p, s, grads))
    try:
        from torchao import optim as ao
    except ImportError as err:
        print(f"torchao not installed ({err}): its rows are left out", file=sys.stderr)
        ao = None
    if ao is not None:
        for cls in TORCHAO:
            leaves = {k: torch.nn.Parameter(v.clone()) for k, v in base.items()}
            opt = getattr(ao, cls)(list(leaves.values()), lr=LR, weight_decay=WD)

            def step(opt=opt, leaves=leaves) -> None:
                for k, p in leaves.items():
                    p.grad = grads[k]
                opt.step()

            t0 = time.perf_counter()
            step()                       # compiles its per-parameter step
            print(f"torchao {cls}: first step {time.perf_counter() - t0:.1f} s (compiles)",
                  file=sys.stderr)
            sizes[f"torchao {cls}"] = torchao_bytes(opt, leaves)
            steps[f"torchao {cls}"] = step

    for fn in steps.values():              # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(-(-args.steps // args.block)):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            for _ in range(args.block):
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(1e3 * (time.perf_counter() - t0))
    ref = statistics.median(times["adamw"])
    header = ("variant", "B/elem compressed", "B/param whole state", "step ms (median)",
              "x adamw")
    rows = []
    for name in names:
        base_name = name.removesuffix(" (compiled)")
        per, whole = sizes.get(base_name, (float("nan"), float("nan")))
        med = statistics.median(times[name])
        rows.append((name, "-" if per != per else f"{per:.3f}", f"{whole:.3f}", f"{med:.2f}",
                     f"{med / ref:.2f}"))
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
