"""Compile time and step time of a compiled train step as the parameter count is split into
more tensors (issue: performance at scale).

The same total number of parameters is split into 30, 100 and 300 matrices. The train step is
forward + backward + optimizer update + in-place write of parameters and state, under
``torch.compile(fullgraph=True)`` with Inductor, written like `opttx.bench.train`:

    grads, loss = grad_and_value(loss_fn)(params, batch)
    updates, new_state = tx.update(grads, state, params)
    opttx.apply_updates_(params, updates); opttx.tree_copy_(state, new_state)

The model's forward concatenates all parameters into one vector and computes one loss over it
(``tanh(w * x + b).square().mean()`` against a fixed target), so the forward and backward
graphs hold the same operations whatever the number of tensors: what grows with the count is
what the optimizer and the parameter plumbing add. Every configuration runs in a fresh
subprocess with an empty Inductor cache (a cold compile), and the "optimizer only" column
compiles ``tx.update`` + ``apply_updates_`` alone the same way.

Targets (issue): compile at 300 tensors <= 1.5x compile at 30; step at 300 <= 1.2x at 30.

Examples:
  python benchmarks/compile_scaling.py                       # adamw and adafactor, 30/100/300
  python benchmarks/compile_scaling.py --quick               # tiny, for a smoke test
  python benchmarks/compile_scaling.py --optimizers adamw --tensors 30,300
  python benchmarks/compile_scaling.py --optimizers adamw,adamw_flat,adamw_flatparams

Layouts: ``NAME`` is the per-leaf path; ``NAME_flat`` wraps the transform in `opttx.flatten`
(gradients and parameters packed into flat buffers every step); ``NAME_flatparams`` keeps the
parameters in `opttx.FlatParams` buffers, differentiates with respect to them and runs the
transform on the buffers (element-wise transforms only, as ``_flat``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_COMPILE_RATIO = 1.5
TARGET_STEP_RATIO = 1.2


def make_tx(name: str):
    import opttx
    if name == "adamw":
        return opttx.adamw(1e-3, weight_decay=1e-2)
    if name == "adafactor":
        return opttx.adafactor(1e-2, min_dim_size_to_factor=32)
    if name == "lion":
        return opttx.lion(1e-4)
    if name == "sgd":
        return opttx.sgd(1e-3)
    if name.endswith("_flat"):
        return opttx.flatten(make_tx(name[:-len("_flat")]))
    if name.endswith("_flatparams"):
        return make_tx(name[:-len("_flatparams")])
    raise SystemExit(f"unknown optimizer {name!r}")


def shapes_for(total: int, count: int) -> list[tuple[int, int]]:
    """``count`` matrices of about ``total / count`` elements, rows a power of two."""
    per = total // count
    rows = 2 ** max(5, round(math.log2(math.sqrt(per))))
    cols = max(1, per // rows)
    return [(rows, cols)] * count


def child(args: argparse.Namespace) -> None:
    """One configuration, in its own process: prints one JSON line."""
    import torch
    from torch.func import grad_and_value

    sys.path.insert(0, os.path.join(HERE, ".."))
    import opttx

    torch.manual_seed(0)
    shapes = shapes_for(args.total, args.count)
    params = {f"w{i:03d}": torch.randn(s) * 0.1 for i, s in enumerate(shapes)}
    n = sum(p.numel() for p in params.values())
    x = torch.randn(n)
    target = torch.randn(n) * 0.1
    tx = make_tx(args.opt)
    state = tx.init(params)

    def loss_fn(params, x, target):
        flat = torch.cat([p.reshape(-1) for p in params.values()])
        return (torch.tanh(flat * x) - target).square().mean()

    grad_loss = grad_and_value(loss_fn)

    def train_step(params, state, x, target):
        grads, loss = grad_loss(params, x, target)
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        opttx.tree_copy_(state, new_state)
        return loss

    def optimizer_step(params, state, grads):
        updates, new_state = tx.update(grads, state, params)
        opttx.apply_updates_(params, updates)
        opttx.tree_copy_(state, new_state)

    grads = {k: torch.randn_like(v) for k, v in params.items()}
    if args.flat_params:
        # the parameters live in one flat buffer: the step differentiates with respect to it
        flat = opttx.FlatParams(params)
        params, grads = flat.buffers, flat.flatten(grads)
        state = tx.init(params)

        def train_step(buffers, state, x, target):
            grads, loss = grad_and_value(lambda b: loss_fn(flat.unflatten(b), x, target))(
                buffers)
            updates, new_state = tx.update(grads, state, buffers)
            opttx.apply_updates_(buffers, updates)
            opttx.tree_copy_(state, new_state)
            return loss

    fn = optimizer_step if args.only_optimizer else train_step
    compiled = torch.compile(fn, fullgraph=True)
    call = (lambda: compiled(params, state, grads)) if args.only_optimizer else \
        (lambda: compiled(params, state, x, target))
    with torch._dynamo.config.patch(error_on_recompile=True):
        t0 = time.perf_counter()
        call()
        first = time.perf_counter() - t0
        for _ in range(3):
            call()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    entries = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))
    median = statistics.median(times)
    print(json.dumps({"opt": args.opt, "count": args.count, "params": n,
                      "shape": list(shapes[0]), "compile_s": first - median,
                      "step_ms": median * 1e3, "min_ms": min(times) * 1e3,
                      "cache_entries": entries}))


def run_child(opt: str, count: int, total: int, steps: int, only_optimizer: bool) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="opttx_compile_scaling_")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--opt", opt,
           "--count", str(count), "--total", str(total), "--steps", str(steps)]
    if opt.endswith("_flatparams"):
        cmd.append("--flat-params")
    if only_optimizer:
        cmd.append("--only-optimizer")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"child failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="adamw,adafactor")
    ap.add_argument("--tensors", default="30,100,300")
    ap.add_argument("--total", type=int, default=3_000_000, help="parameters in all")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--no-optimizer-only", action="store_true",
                    help="skip the optimizer-only compile column")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--opt", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--only-optimizer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flat-params", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.total, args.steps, args.tensors = 60_000, 3, "3,9"
    import torch
    counts = [int(c) for c in args.tensors.split(",")]
    opts = args.optimizers.split(",")
    print(f"opttx compile_scaling: {args.total:,} parameters split into {counts} matrices; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    rows = []
    for opt in opts:
        for count in counts:
            r = run_child(opt, count, args.total, args.steps, False)
            if not args.no_optimizer_only:
                r["opt_only_compile_s"] = run_child(opt, count, args.total, args.steps,
                                                    True)["compile_s"]
            rows.append(r)
            print(f"  {opt:10s} {count:4d} tensors {tuple(r['shape'])}: compile "
                  f"{r['compile_s']:.1f} s, step {r['step_ms']:.2f} ms", flush=True)
    print()
    print(f"{'optimizer':10s} {'tensors':>7s} {'shape':>11s} {'compile s':>9s} "
          f"{'opt-only s':>10s} {'step ms':>8s} {'min ms':>7s} {'compile x':>9s} "
          f"{'step x':>7s} {'cache':>5s}")
    verdicts = []
    for opt in opts:
        mine = [r for r in rows if r["opt"] == opt]
        base = mine[0]
        for r in mine:
            cr = r["compile_s"] / base["compile_s"]
            sr = r["step_ms"] / base["step_ms"]
            only = f"{r['opt_only_compile_s']:10.1f}" if "opt_only_compile_s" in r else \
                f"{'-':>10s}"
            print(f"{opt:10s} {r['count']:7d} {'x'.join(map(str, r['shape'])):>11s} "
                  f"{r['compile_s']:9.1f} {only} {r['step_ms']:8.2f} {r['min_ms']:7.2f} "
                  f"{cr:8.2f}x {sr:6.2f}x {r['cache_entries']:5d}")
        last = mine[-1]
        verdicts.append(
            f"{opt}: compile at {last['count']} tensors = "
            f"{last['compile_s'] / base['compile_s']:.2f}x at {base['count']} "
            f"(target <= {TARGET_COMPILE_RATIO}x), step = "
            f"{last['step_ms'] / base['step_ms']:.2f}x (target <= {TARGET_STEP_RATIO}x)")
    print()
    for v in verdicts:
        print(v)


if __name__ == "__main__":
    main()
