"""How a compiled optimizer step should hand back its new state: AdamW, side by side.

A compiled opttx step computes the new state functionally; it then either copies it into the
old buffers (in place, as ``opttx.tree_copy_`` does) or returns it. How the copy is written
decides what Inductor can fuse: on CUDA it folds a per-tensor ``copy_`` into the graph input
into the kernel that computes the value, but not ``torch._foreach_copy_``, and then
materialises the update and recomputes the state in a second pass. Variants, all AdamW
(lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1) on the same parameters and
gradients:

  fused         torch.optim.AdamW(fused=True) (CUDA; on CPU torch's fused CPU kernel)
  torch_compile torch.compile(torch.optim.AdamW(foreach=True).step)
  tree_copy_    opttx: update, apply_updates_, opttx.tree_copy_(state, new) (one copy_ per
                tensor when compiled)
  foreach_copy  the same with torch._foreach_copy_(state leaves, new leaves)
  carry         the same returning the new state instead of copying it

The shape set is a ``--layers``-layer slice of TinyLlama-1.1B (hidden 2048, MLP 5632, vocab
32000; 4 layers: 307 M parameters in 39 tensors on a GPU; ``--small`` divides every dim by 8
for a CPU run). Timing: CUDA events (perf_counter on CPU) around each step, median of
``--steps`` after 5 untimed ones; a correctness check compares each variant's parameters with
``fused`` after the timed steps (all variants take the same number of steps). The roofline
is 28 bytes per parameter (read p, g, m, v; write p, m, v) over the measured copy bandwidth.

Examples:
  python benchmarks/state_copy.py                       # GPU, 4 layers
  python benchmarks/state_copy.py --device cpu --small  # a CPU run, minutes of compiling
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import early_cache_dir, git_state  # noqa: E402

early_cache_dir("opttx_state_copy_")

import torch  # noqa: E402

import opttx  # noqa: E402
from opttx.tree import tree_leaves  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def shapes(layers: int, div: int) -> list[tuple[int, ...]]:
    hidden, mlp, vocab, kv = 2048 // div, 5632 // div, 32000 // div, 256 // div
    out: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                (hidden,), (mlp, hidden), (mlp, hidden), (hidden, mlp)]
    return out + [(hidden,), (vocab, hidden)]


def torch_adamw(init, grads, **kw):
    ps = [p.clone().requires_grad_() for p in init]
    for p, g in zip(ps, grads):
        p.grad = g
    return torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw), ps


def opttx_variant(init, grads, how: str):
    tx = opttx.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    params = [p.clone() for p in init]
    box = {"state": tx.init(params)}

    def step(params, grads, state):
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        if how == "carry":
            return new_state
        if how == "tree_copy_":
            opttx.tree_copy_(state, new_state)
        else:
            pairs = [(d, s) for d, s in zip(tree_leaves(state), tree_leaves(new_state))
                     if d is not s]
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        return state

    compiled = torch.compile(step, fullgraph=True)

    def run() -> None:
        box["state"] = compiled(params, grads, box["state"])
    return run, params


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--small", action="store_true", help="every dim / 8 (a CPU-sized run)")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    sizes = shapes(a.layers, 8 if a.small else 1)
    init = [torch.randn(s, device=device) * 0.02 for s in sizes]
    grads = [torch.randn(s, device=device) * 1e-3 for s in sizes]
    n = sum(x.numel() for x in init)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn) -> list[float]:
        for _ in range(5):
            fn()
        sync()
        out = []
        for _ in range(a.steps):
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                out.append(1e3 * (time.perf_counter() - t0))
        return out

    big = torch.empty(64 * 2**20, device=device)
    copy_ms = statistics.median(timed(lambda: big.clone()))
    bandwidth = 2 * big.numel() * 4 / (copy_ms / 1e3)            # read + write, bytes/s
    del big
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"opttx state_copy: {n / 1e6:.1f} M parameters in {len(init)} tensors on {name}; "
          f"torch {torch.__version__}; opttx {git_state()}; copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s; median of {a.steps} steps")
    rows: dict[str, tuple[float, list[torch.Tensor]]] = {}
    opt, ps = torch_adamw(init, grads, fused=True)
    rows["fused"] = (statistics.median(timed(opt.step)), ps)
    del opt
    opt, ps = torch_adamw(init, grads, foreach=True)
    rows["torch_compile"] = (statistics.median(timed(torch.compile(opt.step))), ps)
    del opt
    for how in ("tree_copy_", "foreach_copy", "carry"):
        run, params = opttx_variant(init, grads, how)
        rows[how] = (statistics.median(timed(run)), params)
        del run
    base, ref = rows["fused"]
    roof = 28 * n / bandwidth * 1e3
    print(f"{'variant':14s} {'median ms':>9s} {'x fused':>8s} {'% roof':>7s} {'max |dp|':>9s}")
    for key, (ms, params) in rows.items():
        err = max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(params, ref))
        print(f"{key:14s} {ms:9.3f} {ms / base:8.2f} {100 * roof / ms:7.1f} {err:9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
