"""Compile time and step time of a compiled train step as the parameter count is split into
more tensors.

The same total number of parameters is split into 30, 100 and 300 matrices. The train step is
forward + backward + optimizer update + in-place write of parameters and state, under
``torch.compile(fullgraph=True)`` with Inductor, written like `opttx.bench.train`:

    grads, loss = grad_and_value(loss_fn)(params, batch)
    updates, new_state = tx.update(grads, state, params)
    opttx.apply_updates_(params, updates); opttx.tree_copy_(state, new_state)

Two models (``--model``):

* ``cat`` (default): the forward concatenates all parameters into one vector and computes one
  loss over it (``(tanh(w * x) - target).square().mean()``), so the arithmetic is the same
  whatever the number of tensors: what grows with the count is what the optimizer and the
  parameter plumbing add.
* ``layers``: ``count`` residual layers ``h = h + tanh(h @ W_i)`` of square ``(d, d)``
  matrices on a (64, d) batch, unrolled in Python (a deep network: the model's own graph grows
  with the layer count). In the ``_stacked`` layout the layers run as one ``scan`` over the
  stacked matrices (torch's prototype ``torch._higher_order_ops.scan``; the step then takes
  its gradient with ``torch.autograd.grad``, which needs Dynamo's ``trace_autograd_ops``):
  the model's graph holds one layer whatever the count.

Every configuration runs in a fresh subprocess with an empty Inductor cache (a cold compile),
and the "optimizer only" column compiles ``tx.update`` + ``apply_updates_`` alone the same
way. The ``loss`` column is the first step's loss: equal across layouts of one model and
count, it shows the layouts train the same model.

Targets: compile at 300 tensors <= 1.5x compile at 30; step at 300 <= 1.2x at 30.

Examples:
  python benchmarks/compile_scaling.py                       # adamw and adafactor, 30/100/300
  python benchmarks/compile_scaling.py --quick               # tiny, for a smoke test
  python benchmarks/compile_scaling.py --optimizers adamw --tensors 30,300
  python benchmarks/compile_scaling.py --optimizers adamw,adamw_flat,adamw_flatparams
  python benchmarks/compile_scaling.py --optimizers adamw_stacked,adafactor_stacked
  python benchmarks/compile_scaling.py --model layers --optimizers adafactor,adafactor_stacked

Layouts: ``NAME`` is the per-leaf path; ``NAME_flat`` wraps the transform in `opttx.flatten`
(gradients and parameters packed into flat buffers every step); ``NAME_flatparams`` keeps the
parameters in `opttx.FlatParams` buffers, differentiates with respect to them and runs the
transform on the buffers (element-wise transforms only, as ``_flat``); ``NAME_stacked`` keeps
the parameters in `opttx.StackedParams` (one ``(count, *shape)`` buffer, here a single stack)
and runs ``opttx.stacked(NAME)`` on it: any per-leaf transform, Adafactor included.
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
    if name.endswith("_stacked"):
        return opttx.stacked(make_tx(name[:-len("_stacked")]))
    raise SystemExit(f"unknown optimizer {name!r}")


def shapes_for(total: int, count: int, model: str = "cat") -> list[tuple[int, int]]:
    """``count`` matrices of about ``total / count`` elements: rows a power of two (``cat``),
    square (``layers``)."""
    per = total // count
    if model == "layers":
        d = math.isqrt(per)
        return [(d, d)] * count
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
    shapes = shapes_for(args.total, args.count, args.model)
    params = {f"w{i:03d}": torch.randn(s) * (s[0] ** -0.5 if args.model == "layers" else 0.1)
              for i, s in enumerate(shapes)}
    n = sum(p.numel() for p in params.values())
    if args.model == "layers":
        x = torch.randn(64, shapes[0][0])
        target = torch.randn(64, shapes[0][0])
    else:
        x = torch.randn(n)
        target = torch.randn(n) * 0.1
    tx = make_tx(args.opt)
    state = tx.init(params)

    def loss_fn(params, x, target):
        if args.model == "layers":
            h = x
            for w in params.values():
                h = h + torch.tanh(h @ w)
            return (h - target).square().mean()
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
    elif args.opt.endswith("_stacked"):
        # the parameters live in one (count, *shape) stack; the model is written over it
        stack = opttx.StackedParams(params)
        params, grads = stack.buffers, stack.stack(grads)
        state = tx.init(params)
        (weights,) = params.values()

        if args.model == "cat":
            def train_step(buffers, state, x, target):
                def stacked_loss(buffers):   # the same vector as the per-leaf cat
                    flat = torch.cat([b.reshape(-1) for b in buffers.values()])
                    return (torch.tanh(flat * x) - target).square().mean()
                grads, loss = grad_and_value(stacked_loss)(buffers)
                updates, new_state = tx.update(grads, state, buffers)
                opttx.apply_updates_(buffers, updates)
                opttx.tree_copy_(state, new_state)
                return loss
        else:
            from torch._higher_order_ops import scan
            torch._dynamo.config.trace_autograd_ops = True
            weights.requires_grad_(True)

            def layer(h, w):
                h = h + torch.tanh(h @ w)
                return h, h.new_zeros(())

            def train_step(buffers, state, x, target):
                (w,) = buffers.values()
                h, _ = scan(layer, x, w)
                loss = (h - target).square().mean()
                (g,) = torch.autograd.grad(loss, [w])
                with torch.no_grad():
                    updates, new_state = tx.update({k: g for k in buffers}, state, buffers)
                    opttx.apply_updates_(buffers, updates)
                    opttx.tree_copy_(state, new_state)
                return loss.detach()

    fn = optimizer_step if args.only_optimizer else train_step
    compiled = torch.compile(fn, fullgraph=True)
    call = (lambda: compiled(params, state, grads)) if args.only_optimizer else \
        (lambda: compiled(params, state, x, target))
    with torch._dynamo.config.patch(error_on_recompile=True):
        t0 = time.perf_counter()
        loss = call()
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
                      "cache_entries": entries,
                      "loss": None if loss is None else float(loss)}))


def run_child(opt: str, count: int, total: int, steps: int, only_optimizer: bool,
              model: str) -> dict:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="opttx_compile_scaling_")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--opt", opt,
           "--count", str(count), "--total", str(total), "--steps", str(steps),
           "--model", model]
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
    ap.add_argument("--model", choices=("cat", "layers"), default="cat",
                    help="cat: one loss over all parameters; layers: a deep residual network "
                         "(see the module docstring)")
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
    print(f"opttx compile_scaling ({args.model} model): {args.total:,} parameters split into "
          f"{counts} matrices; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    rows = []
    for opt in opts:
        for count in counts:
            r = run_child(opt, count, args.total, args.steps, False, args.model)
            if not args.no_optimizer_only:
                r["opt_only_compile_s"] = run_child(opt, count, args.total, args.steps,
                                                    True, args.model)["compile_s"]
            rows.append(r)
            print(f"  {opt:18s} {count:4d} tensors {tuple(r['shape'])}: compile "
                  f"{r['compile_s']:.1f} s, step {r['step_ms']:.2f} ms", flush=True)
    print()
    print(f"{'optimizer':18s} {'tensors':>7s} {'shape':>11s} {'compile s':>9s} "
          f"{'opt-only s':>10s} {'step ms':>8s} {'min ms':>7s} {'compile x':>9s} "
          f"{'step x':>7s} {'cache':>5s} {'loss':>10s}")
    verdicts = []
    for opt in opts:
        mine = [r for r in rows if r["opt"] == opt]
        base = mine[0]
        for r in mine:
            cr = r["compile_s"] / base["compile_s"]
            sr = r["step_ms"] / base["step_ms"]
            only = f"{r['opt_only_compile_s']:10.1f}" if "opt_only_compile_s" in r else \
                f"{'-':>10s}"
            print(f"{opt:18s} {r['count']:7d} {'x'.join(map(str, r['shape'])):>11s} "
                  f"{r['compile_s']:9.1f} {only} {r['step_ms']:8.2f} {r['min_ms']:7.2f} "
                  f"{cr:8.2f}x {sr:6.2f}x {r['cache_entries']:5d} {r['loss']:10.6g}")
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
