"""Optimizer-state bytes per parameter and peak memory of one training step, per optimizer.

Model: the benchmark GPT (``opttx.bench.model``), scaled to ~100M parameters (d_model 768,
14 layers, 12 heads, byte vocabulary 256 with a tied head: 99.4M parameters, 398 MB in
float32), one batch of 1 x 128 random tokens. Optimizers, each in a fresh subprocess:

  torch AdamW          torch.optim.AdamW(lr=1e-3, weight_decay=0.01), torch's default
                       implementation for the device (for-loop on CPU, foreach on CUDA)
  torch AdamW foreach  the same with foreach=True
  torch AdamW fused    the same with fused=True (the reference of docs/design.md, rule 5)
  opttx adamw          opttx.Optimizer(named params, opttx.adamw(1e-3, weight_decay=0.01))
  adafactor            opttx.adafactor(1e-2)           (optax's defaults: no momentum)
  came                 opttx.came(1e-3)
  galore_adamw         opttx.galore_adamw(1e-3, rank=128)      (every 2-D leaf projected)
  adamw_8bit           opttx.adamw_8bit(1e-3)
  galore_adamw_8bit    opttx.galore_adamw_8bit(1e-3, rank=128) (skipped if not in opttx)
  adalomo              opttx.FusedBackward(model, opttx.adalomo(1e-2)): updates applied
                       inside backward, each gradient freed after its update
  fwd+bwd only         reference: no optimizer; a post-accumulate-grad hook frees every
                       gradient as soon as autograd has finished it

The opttx aliases run eagerly through ``opttx.Optimizer`` (``loss.backward(); opt.step();
opt.zero_grad()``), the way a torch.optim user runs them.

Method. Memory is counted by `opttx.bench.memory.LiveTensorTracker`, a TorchDispatchMode
that registers the untyped storage of every new op output (views, in-place and ``out=``
results allocate nothing) and subtracts it when the storage is freed (a weak reference on
the storage), keeping the peak: the exact bytes of live tensors between ATen ops, forward,
backward (hooks included) and optimizer step alike. RSS is not used: glibc keeps freed
pages and it counts the interpreter. The tracker is checked by `self_check` at the start of
the run (known allocations, a view, an in-place op, a freed baseline tensor, a backward) and,
on CUDA, against ``torch.cuda.max_memory_allocated``.

Each subprocess builds the model (seed 0) and takes two steps on the same batch. Step 1
allocates the optimizer state (its peak is reported too: GaLore's SVDs run in it). Step 2 is
measured: the tracker's baseline is the parameters + the optimizer state + the batch, and
the figures are

  state B/param  distinct storage bytes of the optimizer state after step 2 / parameters
  proj. MB       state bytes of the projected matrices only (the 2-D leaves galore_adamw
                 projects; for opttx.Optimizer runs: the storage bytes of
                 ``tx.init(those leaves)``, which the run checks equals the state size)
  peak MB        the largest live bytes during step 2 (params + state + batch included)
  peak-P MB      peak minus the parameters
  in             the phase where the peak happened (forward / backward / step)
  step1 MB       the same peak for step 1
  resid MB       live bytes after step 2 (loss dropped, grads set to None, gc run) minus the
                 parameters, state and batch: what the step left allocated (should be ~0)

plus the activations: the bytes the forward leaves alive (saved tensors, logits, loss).

Targets:
  adamw_8bit state <= 2.1 bytes/param;
  galore_adamw (rank 128) state on the projected matrices <= 35% of adamw's on them;
  adalomo peak <= 1.05 x (parameters + state + activations + the largest single gradient),
  where "activations" is the forward+backward working set: the peak of the "fwd+bwd only"
  run minus the parameters (it covers the saved activations and the backward's activation
  gradients). adalomo's excess over that run is also printed in units of the largest
  gradient.

Examples:
  python benchmarks/memory.py --quick               # ~5M parameters, a smoke run (~2 min)
  python benchmarks/memory.py                       # ~100M parameters (8-11 min on 2 busy
                                                    # cores, most of it GaLore's SVDs)
  python benchmarks/memory.py --only adamw_8bit,adalomo,none
  python benchmarks/memory.py --device cuda         # on a GPU, with the CUDA cross-check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import opttx  # noqa: E402
from opttx.bench.memory import LiveTensorTracker, storage_bytes, tensor_bytes  # noqa: E402
from opttx.bench.model import GPT, GPTConfig, lm_loss  # noqa: E402

MB = 1e6
MiB = 1 << 20
TARGET_8BIT_BYTES = 2.1
TARGET_GALORE_RATIO = 0.35
TARGET_ADALOMO_SLACK = 1.05

# key -> (label, description). Order = table order.
OPTIMIZERS: dict[str, tuple[str, str]] = {
    "torch_adamw": ("torch AdamW", "torch.optim.AdamW(lr=1e-3, weight_decay=0.01)"),
    "torch_adamw_foreach": ("torch AdamW foreach", "torch.optim.AdamW(..., foreach=True)"),
    "torch_adamw_fused": ("torch AdamW fused", "torch.optim.AdamW(..., fused=True)"),
    "adamw": ("opttx adamw", "opttx.adamw(1e-3, weight_decay=0.01)"),
    "adafactor": ("adafactor", "opttx.adafactor(1e-2)"),
    "came": ("came", "opttx.came(1e-3)"),
    "galore_adamw": ("galore_adamw", "opttx.galore_adamw(1e-3, rank=R)"),
    "adamw_8bit": ("adamw_8bit", "opttx.adamw_8bit(1e-3)"),
    "galore_adamw_8bit": ("galore_adamw_8bit", "opttx.galore_adamw_8bit(1e-3, rank=R)"),
    "adalomo": ("adalomo (in backward)", "opttx.FusedBackward(model, opttx.adalomo(1e-2))"),
    "none": ("fwd+bwd only", "no optimizer, each grad freed in backward"),
}


def opttx_tx(key: str, rank: int) -> opttx.GradientTransformation:
    if key == "adamw":
        return opttx.adamw(1e-3, weight_decay=0.01)
    if key == "adafactor":
        return opttx.adafactor(1e-2)
    if key == "came":
        return opttx.came(1e-3)
    if key == "galore_adamw":
        return opttx.galore_adamw(1e-3, rank=rank)
    if key == "adamw_8bit":
        return opttx.adamw_8bit(1e-3)
    if key == "galore_adamw_8bit":
        return opttx.galore_adamw_8bit(1e-3, rank=rank)
    if key == "adalomo":
        return opttx.adalomo(1e-2)
    raise KeyError(key)


def available(key: str) -> bool:
    alias = {"torch_adamw": None, "torch_adamw_foreach": None, "torch_adamw_fused": None,
             "none": None}.get(key, key)
    return alias is None or hasattr(opttx, alias)


# ---------------------------------------------------------------------------------------------
# the tracker's self-check
# ---------------------------------------------------------------------------------------------


def self_check(device: torch.device) -> list[str]:
    """Known allocations under the tracker; returns lines describing each check (raises
    AssertionError on a wrong count)."""
    lines = []

    def expect(what: str, got: int, want: int) -> None:
        ok = got == want
        lines.append(f"  {what}: {got} bytes, expected {want}: {'ok' if ok else 'WRONG'}")
        assert ok, lines[-1]

    base = torch.zeros(MiB // 4, device=device)          # 1 MiB
    tr = LiveTensorTracker(baseline=[base], device=device)
    expect("baseline", tr.live, MiB)
    with tr:
        a = torch.empty(MiB // 4, device=device)
        b = torch.ones(2 * MiB // 4, device=device)
        expect("+1 MiB +2 MiB", tr.live, 4 * MiB)
        v = b.view(2, -1)[1]
        b.mul_(2)
        torch.add(a, 1, out=a)
        expect("view, in-place, out= (nothing new)", tr.live, 4 * MiB)
        del a, base
        expect("freed 1 MiB + the baseline", tr.live, 2 * MiB)
        del b
        expect("del b while a view of it lives (nothing freed)", tr.live, 2 * MiB)
        del v
        expect("last view freed", tr.live, 0)
        expect("peak", tr.peak, 4 * MiB)
        lin = torch.nn.Linear(512, 512, bias=False, device=device)     # 1 MiB weight
        x = torch.randn(256, 512, device=device)                        # 0.5 MiB
        start = tr.live
        (lin(x) ** 2).sum().backward()
        gc.collect()
        expect("after backward: the weight's grad (+ the 4-byte loss is freed)",
               tr.live - start, MiB)
        lin.weight.grad = None
        expect("grad set to None", tr.live, start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        tr = LiveTensorTracker(device=device)
        with tr:
            a = torch.empty(3 * MiB // 4, device=device)
            b = a * 2
            del a
            c = b + 1
            del b, c
        torch.cuda.synchronize(device)
        cuda_peak = torch.cuda.max_memory_allocated(device) - before
        ok = abs(tr.peak - cuda_peak) <= max(4096, cuda_peak // 100)
        lines.append(f"  CUDA: tracker peak {tr.peak} bytes vs torch.cuda.max_memory_allocated "
                     f"{cuda_peak} bytes: {'ok' if ok else 'WRONG'}")
        assert ok, lines[-1]
    return lines


# ---------------------------------------------------------------------------------------------
# one optimizer, in its own process
# ---------------------------------------------------------------------------------------------


class Setup:
    """A model and one way to train it: `step` runs forward, backward and the update."""

    def __init__(self, key: str, model: GPT, rank: int, device: torch.device) -> None:
        self.key = key
        self.model = model
        self.named = dict(model.named_parameters())      # the tied head appears once
        self.opt: Any = None
        self.runner: opttx.FusedBackward | None = None
        self.tx: opttx.GradientTransformation | None = None
        self.impl = ""
        if key in ("torch_adamw", "torch_adamw_foreach", "torch_adamw_fused"):
            kind = {"torch_adamw_fused": "fused", "torch_adamw_foreach": "foreach"}.get(key)
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                                         fused=True if kind == "fused" else None,
                                         foreach=True if kind == "foreach" else None)
            if kind is not None:
                self.impl = kind
            else:
                from torch.optim.optimizer import _default_to_fused_or_foreach
                _, foreach = _default_to_fused_or_foreach(list(model.parameters()), False, False)
                self.impl = "foreach" if foreach else "for-loop"
        elif key == "none":
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(self._drop_grad)
        elif key == "adalomo":
            self.tx = opttx_tx(key, rank)
            self.runner = opttx.FusedBackward(model, self.tx)
        else:
            self.tx = opttx_tx(key, rank)
            self.opt = opttx.Optimizer(model.named_parameters(), self.tx)

    @staticmethod
    def _drop_grad(p: torch.Tensor) -> None:
        p.grad = None

    def state(self) -> Any:
        if self.runner is not None:
            r = self.runner
            return [r.states, r.scale, r.good_steps, r.overflow, r.sum_sq, r.prev_norm,
                    r.clip_coef]
        if isinstance(self.opt, opttx.Optimizer):
            return self.opt._tx_states
        if self.opt is not None:
            return self.opt.state
        return []

    def projected_state_bytes(self, names: list[str]) -> int | None:
        """State bytes of the leaves in ``names``."""
        if self.key == "none":
            return 0
        if self.runner is not None:
            return storage_bytes([self.runner.states[n] for n in names])
        if self.tx is not None:
            with torch.no_grad():
                sub = {n: self.named[n].detach() for n in names}
                return storage_bytes(self.tx.init(sub))
        return storage_bytes([self.opt.state[self.named[n]] for n in names])

    def step(self, x: torch.Tensor, y: torch.Tensor, tr: LiveTensorTracker) -> int:
        """One training step under ``tr`` (sections forward / backward / step); returns
        the bytes that the forward left alive (the activations)."""
        before = tr.live
        with tr.section("forward"):
            loss = lm_loss(self.model(x), y)
        activations = tr.live - before
        with tr.section("backward"):
            if self.runner is not None:
                self.runner.backward(loss)
            else:
                loss.backward()
        if self.opt is not None:
            with tr.section("step"):
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
        del loss
        return activations


def vm_hwm() -> int:
    """The process's peak RSS since the last reset (Linux), bytes; 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                     n_layers=args.layers, n_heads=args.heads)


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    key = args.worker
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(model_config(args)).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    setup = Setup(key, model, args.rank, device)
    params = list(setup.named.values())
    n_params = sum(p.numel() for p in params)
    param_bytes = storage_bytes(params)
    projected = [n for n, p in setup.named.items() if p.dim() == 2]
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # step 1: the state is allocated
    gc.collect()
    tr1 = LiveTensorTracker(baseline=[params, setup.state(), x, y], device=device)
    t0 = time.perf_counter()
    with tr1:
        setup.step(x, y, tr1)
    sync()
    step1_s = time.perf_counter() - t0
    gc.collect()

    # step 2: measured
    state = setup.state()
    state_bytes_before = storage_bytes(state, exclude=params)
    del state
    reset_hwm()
    hwm0 = vm_hwm()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        cuda_start = torch.cuda.memory_allocated(device)
    tr = LiveTensorTracker(baseline=[params, setup.state(), x, y], device=device)
    t0 = time.perf_counter()
    with tr:
        activations = setup.step(x, y, tr)
    sync()
    step2_s = time.perf_counter() - t0
    cuda_peak_delta = (torch.cuda.max_memory_allocated(device) - cuda_start) if cuda else None
    hwm = vm_hwm()
    gc.collect()
    state = setup.state()
    state_bytes = storage_bytes(state, exclude=params)
    held = storage_bytes([params, state, x, y])
    residual = tr.live - held
    peak_phase = max(tr.sections, key=tr.sections.get)

    result: dict[str, Any] = {
        "key": key, "impl": setup.impl, "n_params": n_params, "param_bytes": param_bytes,
        "state_bytes": state_bytes, "state_bytes_after_step1": state_bytes_before,
        "state_tensor_bytes": tensor_bytes(state),
        "projected_state_bytes": setup.projected_state_bytes(projected),
        "projected_param_bytes": storage_bytes([setup.named[n] for n in projected]),
        "peak": tr.peak, "start": tr.start, "sections": tr.sections, "peak_phase": peak_phase,
        "peak_step1": tr1.peak, "activations": activations, "residual": residual,
        "largest_grad": max((p.numel() * p.element_size(), n) for n, p in setup.named.items()),
        "n_allocations": tr.n_allocations, "allocated": tr.allocated - tr.start,
        "rss_hwm_delta": (hwm - hwm0) if hwm and hwm0 else None,
        "cuda_peak_delta": cuda_peak_delta, "step1_s": step1_s, "step2_s": step2_s,
    }
    if setup.tx is not None:      # init on every leaf: does the state keep its init size?
        with torch.no_grad():
            if setup.runner is not None:      # FusedBackward: one state per leaf
                init = [setup.tx.init({n: p.detach()}) for n, p in setup.named.items()]
                result["init_state_bytes"] = storage_bytes(init)
                result["compared_state_bytes"] = storage_bytes(setup.runner.states)
            else:
                result["init_state_bytes"] = storage_bytes(
                    setup.tx.init({n: p.detach() for n, p in setup.named.items()}))
                result["compared_state_bytes"] = state_bytes
    return result


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            cpu = f"{len(names)} x {names[0]}"
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        mem = f", {kib / 2**20:.1f} GiB RAM"
    except (OSError, StopIteration):
        pass
    gpu = ""
    if device.type == "cuda":
        gpu = f", GPU {torch.cuda.get_device_name(device)}"
    return (f"{cpu}{mem}{gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"Python {platform.python_version()}")


def worker_argv(args: argparse.Namespace, key: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", key, "--device", args.device,
            "--d-model", str(args.d_model), "--layers", str(args.layers),
            "--heads", str(args.heads), "--vocab", str(args.vocab),
            "--seq-len", str(args.seq_len), "--batch", str(args.batch),
            "--rank", str(args.rank)]


def run_one(args: argparse.Namespace, key: str) -> dict[str, Any] | None:
    t0 = time.perf_counter()
    proc = subprocess.run(worker_argv(args, key), capture_output=True, text=True,
                          timeout=args.timeout)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"  {key}: FAILED (exit {proc.returncode})\n{proc.stdout[-3000:]}"
              f"{proc.stderr[-3000:]}", flush=True)
        return None
    res = json.loads(lines[-1][len("RESULT "):])
    res["wall_s"] = wall
    print(f"  {key}: {wall:.1f} s (step 1 {res['step1_s']:.1f} s, step 2 {res['step2_s']:.1f} s)",
          flush=True)
    return res


def fmt_mb(b: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if b is None else f"{b / MB:>{width}.1f}"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    any_res = next(iter(results.values()))
    n = any_res["n_params"]
    P = any_res["param_bytes"]
    g_bytes, g_name = any_res["largest_grad"]
    cuda = args.device.startswith("cuda")
    fused = results.get("torch_adamw_fused")
    print()
    print(f"model: GPT d_model={args.d_model} layers={args.layers} heads={args.heads} "
          f"vocab={args.vocab} (tied head), {n:,} parameters = {P / MB:.1f} MB fp32; "
          f"batch {args.batch} x {args.seq_len} tokens; galore rank {args.rank}")
    print(f"projected matrices (the 2-D leaves): {any_res['projected_param_bytes'] / MB:.1f} MB "
          f"of parameters; largest gradient: {g_name} {g_bytes / MB:.2f} MB")
    print("MB = 1e6 bytes; peak = largest live tensor bytes in step 2, parameters, state and "
          "batch included (LiveTensorTracker)")
    head = (f"{'optimizer':<24}{'state B/param':>14}{'state MB':>10}{'proj. MB':>10}"
            f"{'peak MB':>10}{'peak-P MB':>10}{'x fused':>8}{'  in':<10}{'step1 MB':>10}"
            f"{'act. MB':>9}{'resid MB':>9}")
    if cuda:
        head += f"{'cuda peak-start':>16}{'tracker':>9}"
    print(head)
    print("-" * len(head))
    for key, res in results.items():
        label = OPTIMIZERS[key][0] + (f" ({res['impl']})" if res["impl"] and
                                      key == "torch_adamw" else "")
        ratio = f"{res['peak'] / fused['peak']:8.2f}" if fused else f"{'-':>8}"
        row = (f"{label:<24}{res['state_bytes'] / n:>14.3f}{fmt_mb(res['state_bytes'], 10)}"
               f"{fmt_mb(res['projected_state_bytes'], 10)}{fmt_mb(res['peak'], 10)}"
               f"{fmt_mb(res['peak'] - P, 10)}{ratio}  {res['peak_phase']:<8}"
               f"{fmt_mb(res['peak_step1'], 10)}{fmt_mb(res['activations'], 9)}"
               f"{fmt_mb(res['residual'], 9)}")
        if cuda:
            row += (f"{fmt_mb(res['cuda_peak_delta'], 16)}"
                    f"{fmt_mb(res['peak'] - res['start'], 9)}")
        print(row)
    print("state B/param = distinct state storage bytes after step 2 / parameters; proj. = state "
          "of the projected matrices only; x fused = peak / torch AdamW fused's peak; in = "
          "phase of the peak; step1 = peak of step 1 (allocates the state; GaLore's SVDs); act. "
          "= bytes the forward leaves alive; resid = live after step 2 minus params, state, "
          "batch")
    print("peaks by phase (MB): " + "; ".join(
        f"{key}: " + " ".join(f"{k} {v / MB:.0f}" for k, v in res["sections"].items())
        for key, res in results.items()))
    if not cuda:
        print("process RSS high-water-mark rise during step 2 (coarse: glibc reuses freed pages "
              "and keeps some; MB): " + "; ".join(
                  f"{key} {fmt_mb(res['rss_hwm_delta'], 0)}" for key, res in results.items()))
    notes = []
    for key, res in results.items():
        if res.get("init_state_bytes") is not None and \
                res["init_state_bytes"] != res["compared_state_bytes"]:
            notes.append(f"{key}: state after step 2 {res['compared_state_bytes']:,} bytes != "
                         f"tx.init's {res['init_state_bytes']:,} bytes")
        if res["state_bytes"] != res["state_bytes_after_step1"]:
            notes.append(f"{key}: state after step 1 {res['state_bytes_after_step1'] / MB:.2f} MB"
                         f", after step 2 {res['state_bytes'] / MB:.2f} MB")
        if res["state_tensor_bytes"] != res["state_bytes"]:
            notes.append(f"{key}: state tensors sum to {res['state_tensor_bytes'] / MB:.2f} MB "
                         f"but their distinct storages to {res['state_bytes'] / MB:.2f} MB")
        if abs(res["residual"]) > 1e5:
            notes.append(f"{key}: {res['residual'] / MB:.2f} MB still allocated after the step "
                         "beyond params, state and batch")
    for line in notes:
        print("note: " + line)

    print(f"Targets: adamw_8bit state <= {TARGET_8BIT_BYTES} B/param; galore_adamw "
          f"rank {args.rank} state on the projected matrices <= {TARGET_GALORE_RATIO:.0%} of "
          f"adamw's; adalomo peak <= {TARGET_ADALOMO_SLACK:.2f} x (params + state + activations "
          "+ largest gradient), activations = fwd+bwd only peak - params")

    def verdict(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    if "adamw_8bit" in results:
        b = results["adamw_8bit"]["state_bytes"] / n
        print(f"  adamw_8bit state: {b:.3f} B/param (target <= {TARGET_8BIT_BYTES}): "
              f"{verdict(b <= TARGET_8BIT_BYTES)}")
    else:
        print("  adamw_8bit: not run")
    ref = results.get("adamw") or results.get("torch_adamw")
    if "galore_adamw" in results and ref is not None:
        g = results["galore_adamw"]["projected_state_bytes"]
        a = ref["projected_state_bytes"]
        print(f"  galore_adamw state on the projected matrices: {g / MB:.1f} MB vs "
              f"{OPTIMIZERS[ref['key']][0]} {a / MB:.1f} MB = {g / a:.1%} (target <= "
              f"{TARGET_GALORE_RATIO:.0%}): {verdict(g / a <= TARGET_GALORE_RATIO)}")
        if "galore_adamw_8bit" in results and results["galore_adamw_8bit"]["projected_state_bytes"]:
            g8 = results["galore_adamw_8bit"]["projected_state_bytes"]
            print(f"  (galore_adamw_8bit on the same matrices: {g8 / MB:.1f} MB = {g8 / a:.1%}; "
                  f"whole model {results['galore_adamw_8bit']['state_bytes'] / n:.3f} B/param "
                  f"vs adamw {ref['state_bytes'] / n:.3f})")
    else:
        print("  galore_adamw: not run (needs galore_adamw and adamw)")
    if "adalomo" in results and "none" in results:
        lo, base = results["adalomo"], results["none"]
        work = base["peak"] - base["param_bytes"]
        bound = P + lo["state_bytes"] + work + g_bytes
        print(f"  adalomo peak: {lo['peak'] / MB:.1f} MB vs bound {TARGET_ADALOMO_SLACK:.2f} x "
              f"({P / MB:.1f} params + {lo['state_bytes'] / MB:.2f} state + {work / MB:.1f} "
              f"activations + {g_bytes / MB:.2f} largest grad) = "
              f"{TARGET_ADALOMO_SLACK * bound / MB:.1f} MB ({lo['peak'] / bound:.3f} x the sum): "
              f"{verdict(lo['peak'] <= TARGET_ADALOMO_SLACK * bound)}")
        excess = lo["peak"] - base["peak"] - lo["state_bytes"]
        print(f"    adalomo's peak above the fwd+bwd-only peak + its state: {excess / MB:.1f} MB "
              f"= {excess / g_bytes:.2f} x the largest gradient (saved activations at the end "
              f"of the forward: {base['activations'] / MB:.1f} MB)")
    else:
        print("  adalomo: not run (needs adalomo and none)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~5M-parameter model (smoke run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default="", help="comma-separated keys: " + ",".join(OPTIMIZERS))
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 1; 2 quick)")
    ap.add_argument("--rank", type=int, default=None, help="GaLore rank (default 128; 32 quick)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per subprocess")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    quick = dict(d_model=256, layers=6, heads=4, seq_len=64, batch=2, rank=32)
    full = dict(d_model=768, layers=14, heads=12, seq_len=128, batch=1, rank=128)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    if args.worker is not None:
        print("RESULT " + json.dumps(run_worker(args)), flush=True)
        return

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    print("command: " + " ".join([os.path.relpath(sys.executable)] + sys.argv))
    print("machine: " + machine(device))
    print("tracker self-check:")
    for line in self_check(device):
        print(line)
    keys = [k.strip() for k in args.only.split(",") if k.strip()] or list(OPTIMIZERS)
    unknown = [k for k in keys if k not in OPTIMIZERS]
    if unknown:
        sys.exit(f"unknown --only keys {unknown}; choose from {list(OPTIMIZERS)}")
    results: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    print("runs (one subprocess each):")
    for key in keys:
        if not available(key):
            print(f"  {key}: skipped: opttx.{key} does not exist in this checkout", flush=True)
            continue
        res = run_one(args, key)
        if res is not None:
            results[key] = res
    if not results:
        sys.exit("no run succeeded")
    report(results, args)
    print(f"total {time.perf_counter() - t0:.0f} s; load average at end: "
          + " ".join(f"{v:.2f}" for v in os.getloadavg()))


if __name__ == "__main__":
    main()
