"""Where the offloaded host step's time goes: the loop, and the Python per chunk.

1. One 96 M float32 tensor, AdamW's update as one Inductor loop, four ways, interleaved:
   writing the updates into a separate buffer (what offload's compiled step does without the
   master copy), writing the parameters in place (with ``master_params=True``), the same
   with the C++ compiler allowed to contract multiply-adds into FMAs (the Inductor option
   offload's compiled host step sets), the last on one thread (the loop runs out of
   arithmetic before bandwidth when this takes twice as long), and DeepSpeed's
   ``DeepSpeedCPUAdam`` on the same tensor (medians of ``--steps``).
2. The cost of one host-chunk step beside its loop: ``offload(adamw, 1.0, layout="flat",
   compile=True, master_params=True)`` on a 1000-element parameter (one chunk), per
   ``update``'s host step (`OffloadStats.host_seconds`), against a plain compiled function of
   the same tensors doing the same arithmetic (`adamw_in_place`, below).
3. The 96 M parameters of benchmarks/offload.py in 12 chunks of 32 MiB, the master step's
   host seconds with Dynamo's guards evaluated and with
   ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (unsafe: opttx does not use it;
   this measures what the guards cost).
4. What a call costs beside its loop: the 96 M tensor of part 1 as 12 pieces, stepped by 12
   calls of one compiled function, by one compiled call whose graph holds the 12 loops
   (Inductor's horizontal fusion off, so still 12 loops), and by one loop over the whole
   tensor (with the FMA option, as offload compiles).
5. Why a call costs more after a loop: a small compiled call (the AdamW arithmetic on 1000
   elements), the opaque op `opttx.kernels.coefficient` puts in compiled CPU steps
   (``opttx::computed_once``) and aten's ``clone`` on a 0-dim tensor, each timed warm (right
   after itself) and right after an 800 MB copy has streamed through the caches, as a host
   chunk's loop does.

Example:
  DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/offload_host_loop.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import opttx  # noqa: E402
from opttx.distributed import OffloadStats, offload  # noqa: E402


def adamw_tensors(n: int) -> tuple[torch.Tensor, ...]:
    """Gradient, parameters, the two moments of ``n`` elements, and AdamW's two bias
    correction scalars (0-dim float64, as the compiled step reads them)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen) * 1e-3
    p = torch.randn(n, generator=gen) * 0.02
    return (g, p, torch.zeros(n), torch.zeros(n), torch.tensor(0.5, dtype=torch.float64),
            torch.tensor(1e-8, dtype=torch.float64))


def adamw_update(g, p, m, v, c1, c2):
    """AdamW's moments updated in place; returns the update (lr 1e-3, weight decay 0.01)."""
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)
    return -(m / (v.sqrt() * c1 + c2) + 0.01 * p) * 1e-3


def adamw_in_place(g, p, m, v, c1, c2):
    p.add_(adamw_update(g, p, m, v, c1, c2))


def adamw_into(g, p, m, v, c1, c2, u):
    u.copy_(adamw_update(g, p, m, v, c1, c2))


def one_tensor(steps: int, n: int = 96_000_000) -> None:
    from opttx.distributed.host_step import host_compile_options
    g, p, m, v, c1, c2 = tensors = adamw_tensors(n)
    u = torch.empty(n)
    rows = {name: (torch.compile(fn, fullgraph=True, dynamic=True, options=options), args)
            for name, fn, options, args in [
                ("updates into a buffer", adamw_into, None, (*tensors, u)),
                ("parameters in place", adamw_in_place, None, tensors),
                ("in place, FMAs", adamw_in_place, host_compile_options(), tensors)]}
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    dp = torch.nn.Parameter(p.clone())
    dp.grad = g
    ds = DeepSpeedCPUAdam([dp], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                          adamw_mode=True)
    times: dict[str, list[float]] = {k: [] for k in [*rows, "in place, FMAs, 1 thread",
                                                     "DeepSpeedCPUAdam"]}
    threads = torch.get_num_threads()
    for i in range(steps + 3):
        for name, (fn, args) in rows.items():
            t = time.perf_counter()
            fn(*args)
            if i >= 3:
                times[name].append(time.perf_counter() - t)
        torch.set_num_threads(1)
        t = time.perf_counter()
        rows["in place, FMAs"][0](*tensors)
        if i >= 3:
            times["in place, FMAs, 1 thread"].append(time.perf_counter() - t)
        torch.set_num_threads(threads)
        t = time.perf_counter()
        ds.step()
        if i >= 3:
            times["DeepSpeedCPUAdam"].append(time.perf_counter() - t)
    print(f"\n1. AdamW's loop on one {n / 1e6:.0f} M tensor (median ms)")
    for name, ts in times.items():
        print(f"   {name:<24}{1e3 * statistics.median(ts):8.1f}")


def per_chunk(steps: int = 300) -> None:
    params, grads = {"w": torch.randn(1000)}, {"w": torch.randn(1000)}
    stats = OffloadStats()
    tx = offload(opttx.adamw(1e-3, weight_decay=0.01), 1.0, layout="flat", compile=True,
                 master_params=True, stats=stats)
    state = tx.init(params)
    for _ in range(5):
        with opttx.donating():
            _, state = tx.update(grads, state, params)
    stats.reset()
    for _ in range(steps):
        with opttx.donating():
            _, state = tx.update(grads, state, params)
    host = stats.host_seconds / steps

    fn = torch.compile(adamw_in_place, fullgraph=True, dynamic=True)
    tensors = adamw_tensors(1000)
    for _ in range(5):
        fn(*tensors)
    t = time.perf_counter()
    for _ in range(steps):
        fn(*tensors)
    print("\n2. one host-chunk step of 1000 elements (us per call)")
    print(f"   offload master step      {1e6 * host:8.0f}")
    print(f"   plain compiled function  {1e6 * (time.perf_counter() - t) / steps:8.0f}")


def guards(steps: int) -> None:
    from offload import OpttxVariant, shapes
    gen = torch.Generator().manual_seed(0)
    sizes = shapes(5)
    params = [torch.randn(s, generator=gen) * 0.02 for s in sizes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in sizes]
    variant = OpttxVariant(params, grads, True, 32.0, True)
    for _ in range(4):
        variant.step()
    times: dict[str, list[float]] = {"guards evaluated": [], "guards skipped (unsafe)": []}
    for _ in range(steps):
        times["guards evaluated"].append(variant.step())
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            times["guards skipped (unsafe)"].append(variant.step())
    print(f"\n3. the master step's host seconds, {len(variant.stats.plan.chunks)} chunks "
          "(median ms)")
    for name, ts in times.items():
        print(f"   {name:<24}{1e3 * statistics.median(ts):8.1f}")


def calls(steps: int, n: int = 96_000_000, pieces: int = 12) -> None:
    from opttx.distributed.host_step import host_compile_options
    g, p, m, v, c1, c2 = adamw_tensors(n)

    def all_pieces(parts, c1, c2):
        for part in parts:
            adamw_in_place(*part, c1, c2)
    options = host_compile_options()
    one = torch.compile(adamw_in_place, fullgraph=True, dynamic=True, options=options)
    many = torch.compile(all_pieces, fullgraph=True, dynamic=True,
                         options={**options, "cpp.max_horizontal_fusion_size": 1})
    s = n // pieces
    parts = [tuple(x[i * s:(i + 1) * s] for x in (g, p, m, v)) for i in range(pieces)]
    rows = {f"{pieces} calls": lambda: [one(*part, c1, c2) for part in parts],
            f"1 call of {pieces} loops": lambda: many(parts, c1, c2),
            "1 call, 1 loop": lambda: one(g, p, m, v, c1, c2)}
    times: dict[str, list[float]] = {k: [] for k in rows}
    for i in range(steps + 3):
        for name, fn in rows.items():
            t = time.perf_counter()
            fn()
            if i >= 3:
                times[name].append(time.perf_counter() - t)
    print(f"\n4. the {n / 1e6:.0f} M tensor in {pieces} pieces (median ms)")
    for name, ts in times.items():
        print(f"   {name:<24}{1e3 * statistics.median(ts):8.1f}")


def cold_calls(steps: int) -> None:
    import opttx.kernels  # noqa: F401 - registers opttx::computed_once

    small = adamw_tensors(1000)
    compiled = torch.compile(adamw_in_place, fullgraph=True, dynamic=True)
    scalar = torch.tensor(0.5, dtype=torch.float64)
    rows = {"small compiled call": lambda: compiled(*small),
            "opttx::computed_once": lambda: torch.ops.opttx.computed_once.default(scalar),
            "aten clone, 0-dim": lambda: torch.ops.aten.clone.default(scalar)}
    src, dst = torch.ones(100_000_000), torch.empty(100_000_000)
    print("\n5. a call warm, and right after an 800 MB copy (median us)")
    for name, fn in rows.items():
        for _ in range(20):
            fn()
        warm, cold = [], []
        for _ in range(max(steps, 10) * 3):
            t = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - t)
            dst.copy_(src)
            t = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - t)
        print(f"   {name:<24}{1e6 * statistics.median(warm):8.1f}"
              f"{1e6 * statistics.median(cold):8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    one_tensor(args.steps)
    per_chunk()
    guards(args.steps)
    calls(args.steps)
    cold_calls(args.steps)


if __name__ == "__main__":
    main()
