"""The host step of `opttx.distributed.offload` against the CPU Adams of torch and DeepSpeed.

What the offloaded path runs on the CPU for each chunk of state that lives there: AdamW over
the chunk's gradients and parameters (copied into its staging buffers), its moments updated in
place, its updates written into a staging buffer. Variants, all AdamW (lr 1e-3, betas (0.9,
0.999), eps 1e-8, weight decay 0.01, decoupled) on the same ~100 M float32 parameters of a
GPT-like shape set (an embedding and transformer layers of width 1024):

  opttx flat compiled   offload(adamw, 1.0, layout="flat", compile=True): Inductor's one
                        vectorized C++ loop per chunk (the path the guide recommends on CPU)
  opttx master compiled the same with master_params=True: the parameters kept on the host
                        and stepped there in place (read g, m, v, p; write m, v, p, as
                        DeepSpeed), their new values sent back instead of the updates
  opttx master grouped  the same with host_group_mb=--host-group-mb (default 1024): the host
                        chunks' steps in groups, one compiled call per group (no Python
                        between their loops; on CUDA a group waits for all its copies)
    ... in trace order  the same without opttx.kernels.CoefficientsFirst (the ablation): each
                        chunk's scalar work (bias corrections) is computed again for each
                        chunk (not merged) and stays after the previous chunk's loop, as
                        traced, where its opaque calls run with cold caches
  opttx flat eager      offload(adamw, 1.0, layout="flat"): torch's eager grouped kernels,
                        one pass per op and chunk
  torch fused           torch.optim.AdamW(fused=True) on CPU: one fused kernel per tensor
  DeepSpeedCPUAdam      deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True): DeepSpeed's
                        AVX C++ Adam (built on first use with DS_ACCELERATOR=cpu; a benchmark
                        dependency only)

The opttx rows time the host chunks' updates alone (`OffloadStats.host_seconds`: what the CPU
does while the device computes; the staging copies are the device's copy engines' work on a
GPU), the others their ``step()``. Each variant runs ``--steps`` timed steps after 3 untimed
ones, the variants interleaved step by step (so a change in the machine's load hits all of
them). Reported: the median; "paired", the median over the rounds of the variant's time
over DeepSpeed's in the same round (a slow stretch of the machine then hits both sides); GB/s
at 28 bytes per parameter (read p, g, m, v; write p or u, m, v) against the machine's copy
bandwidth, measured first by a 400 MB copy (read + write bytes over time). After the timed
steps every variant's parameters (opttx's: the starting ones plus its updates) are compared
with torch's.

Examples:
  DS_ACCELERATOR=cpu python benchmarks/offload.py                # about 100 M parameters
  python benchmarks/offload.py --layers 1 --steps 5 --no-deepspeed   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, git_state, wait_idle  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import opttx  # noqa: E402
from opttx.distributed import OffloadStats, offload  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def shapes(layers: int, hidden: int = 1024, vocab: int = 32000) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden,), (3 * hidden, hidden), (hidden, hidden), (hidden,),
                (4 * hidden, hidden), (hidden, 4 * hidden)]
    return out + [(hidden,)]


def copy_bandwidth(n: int = 100_000_000) -> float:
    """GB/s of a large copy: (read + written bytes) / time, best of 5."""
    a, b = torch.ones(n), torch.empty(n)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    del a, b
    return 2 * n * 4 / best / 1e9


@contextlib.contextmanager
def host_options(coefficients_first: bool) -> Iterator[None]:
    """The ablation row: offload's host-step compile options without
    `opttx.kernels.CoefficientsFirst` (the scalar work of each chunk left in trace order,
    after the previous chunk's loop). Swapped in around ``update``, where the first step
    compiles."""
    module = sys.modules["opttx.distributed.offload"]
    options = module._host_compile_options
    if not coefficients_first:
        module._host_compile_options = lambda: {
            k: v for k, v in options().items() if k != "post_grad_custom_pre_pass"}
    try:
        yield
    finally:
        module._host_compile_options = options


class OpttxVariant:
    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], compile: bool,
                 chunk_mb: float, master_params: bool = False,
                 host_group_mb: float | None = None, coefficients_first: bool = True) -> None:
        self.coefficients_first = coefficients_first
        self.params = {str(i): p.clone() for i, p in enumerate(params)}
        self.start = {k: v.clone() for k, v in self.params.items()}
        self.grads = {str(i): g for i, g in enumerate(grads)}
        self.stats = OffloadStats()
        self.tx = offload(opttx.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD),
                          1.0, layout="flat", compile=compile, chunk_size_mb=chunk_mb,
                          stats=self.stats, master_params=master_params,
                          host_group_mb=host_group_mb)
        self.state = self.tx.init(self.params)

    def step(self) -> float:
        self.stats.reset()
        with opttx.donating(), host_options(self.coefficients_first):
            updates, self.state = self.tx.update(self.grads, self.state, self.params)
        opttx.apply_updates_(self.params, updates)
        return self.stats.host_seconds

    def result(self) -> list[torch.Tensor]:
        return list(self.params.values())


class TorchVariant:
    def __init__(self, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
        self.opt, self.params = opt, params

    def step(self) -> float:
        t = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t

    def result(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]


def torch_params(params: list[torch.Tensor], grads: list[torch.Tensor]
                 ) -> list[torch.nn.Parameter]:
    out = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(out, grads):
        p.grad = g
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--chunk-mb", type=float, default=32.0,
                    help="chunk capacity in MiB of parameters (offload's default: 32)")
    ap.add_argument("--host-group-mb", type=float, default=1024.0,
                    help="host_group_mb of the grouped variant (MiB of parameters per call)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--wait-idle", type=float, default=60.0)
    args = ap.parse_args()

    print(f"torch {torch.__version__}, {cpu_model()}, {torch.get_num_threads()} threads, "
          f"opttx {git_state()}", flush=True)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth:.1f} GB/s (a 400 MB copy, read + written bytes)",
          flush=True)
    gen = torch.Generator().manual_seed(0)
    sizes = shapes(args.layers)
    params = [torch.randn(s, generator=gen) * 0.02 for s in sizes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in sizes]
    n = sum(p.numel() for p in params)
    print(f"{n / 1e6:.1f} M parameters in {len(sizes)} tensors", flush=True)

    variants: dict[str, object] = {}
    t = time.perf_counter()
    variants["opttx flat compiled"] = OpttxVariant(params, grads, True, args.chunk_mb)
    variants["opttx master compiled"] = OpttxVariant(params, grads, True, args.chunk_mb, True)
    variants["opttx master grouped"] = OpttxVariant(params, grads, True, args.chunk_mb, True,
                                                    args.host_group_mb)
    variants["  ... in trace order"] = OpttxVariant(params, grads, True, args.chunk_mb, True,
                                                 args.host_group_mb, coefficients_first=False)
    variants["opttx flat eager"] = OpttxVariant(params, grads, False, args.chunk_mb)
    tp = torch_params(params, grads)
    variants["torch fused"] = TorchVariant(torch.optim.AdamW(
        tp, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True), tp)
    if not args.no_deepspeed:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        dp = torch_params(params, grads)
        variants["DeepSpeedCPUAdam"] = TorchVariant(DeepSpeedCPUAdam(
            dp, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True), dp)
    chunks = variants["opttx flat compiled"].stats.plan.chunks
    print(f"opttx: {len(chunks)} chunks of {min(c.numel for c in chunks) / 1e6:.1f} to "
          f"{max(c.numel for c in chunks) / 1e6:.1f} M elements; "
          f"set-up {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    for _ in range(3):                       # untimed: compiles, builds, first touches
        for v in variants.values():
            v.step()
    print(f"untimed steps (compile included): {time.perf_counter() - t:.0f} s", flush=True)
    wait_idle(args.wait_idle)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.steps):
        for name, v in variants.items():
            times[name].append(v.step())
    reference = variants["torch fused"].result()
    ds = statistics.median(times["DeepSpeedCPUAdam"]) if "DeepSpeedCPUAdam" in times else None
    print(f"\n{'variant':<22}{'median s':>10}{'min s':>9}{'GB/s':>8}{'of copy':>9}"
          f"{'x DeepSpeed':>13}{'paired':>8}{'max |dp| vs torch':>19}")
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = 28 * n / med / 1e9
        diff = max(float((a - b).abs().max()) for a, b in zip(variants[name].result(), reference))
        ratio = f"{med / ds:.2f}" if ds else "-"
        paired = (f"{statistics.median(a / b for a, b in zip(ts, times['DeepSpeedCPUAdam'])):.3f}"
                  if ds else "-")
        print(f"{name:<22}{med:>10.3f}{min(ts):>9.3f}{gbs:>8.1f}{gbs / bandwidth:>9.2f}"
              f"{ratio:>13}{paired:>8}{diff:>19.2e}")


if __name__ == "__main__":
    main()
