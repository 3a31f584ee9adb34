"""The optimizer step alone: compiled opttx Shampoo against Meta's DistributedShampoo.

`shampoo_step.py` times whole training steps (forward, backward, update); at its default size
the forward and backward are half of every row's step, so it cannot say how the optimizers
themselves compare. Here only the update runs, on the parameters of the same GPT
(``opttx.bench.model``, d_model 128, 2 layers by default: 443,008 parameters in 15 tensors)
with fixed seeded gradients:

  opttx   ``tx.update`` + ``opttx.apply_updates_`` under ``torch.compile(fullgraph=True)``
          (Inductor), state carried functionally
  meta    ``DistributedShampoo.step()`` with the gradients in ``.grad`` (eager, as Meta runs)

for the root-inverse pair (``opttx.shampoo`` / ``RootInvShampooPreconditionerConfig``) and the
eigenvalue-corrected pair (``preconditioner="eigenvalue_corrected"`` /
``EigenvalueCorrectedShampooPreconditionerConfig``), plus opttx's eigenvalue-corrected step with
``first_moment_in_eigenbasis=True`` (the filtered gradient kept rotated into the eigenbasis:
six matrix products per 2-D block instead of eight; the same numbers up to rounding), all at
lr 1e-3, betas (0.9, 0.999), epsilon 1e-12, Adam grafting (0.999, 1e-8),
max_preconditioner_dim 1024,
precondition_frequency = start_preconditioning_step = ``--frequency`` (default 2: every other
step recomputes roots or bases, so both kinds of step are timed with preconditioning active).
After 2 x frequency warm-up steps (compilation included), ``--steps`` steps per optimizer are
timed round-robin (one step of each per round), ``time.perf_counter`` (after a device
synchronize on a GPU);
the table gives the median of the steps that recompute (``refresh``) and of the others.
Meta's package is read from ``shared/refs/meta-optimizers`` beside the repository (or from
``$OPTTX_META_OPTIMIZERS``).

``--cpp-wrapper`` compiles the opttx rows with Inductor's ``cpp_wrapper`` (the compiled step
calls its kernels from C++ instead of Python: less overhead per kernel, a longer compile).
``--no-size-asserts`` turns off Inductor's ``size_asserts`` and ``alignment_asserts`` (the
Python checks of buffers' sizes, strides and alignment that the generated wrapper runs
around extern kernels and ``torch.cond``: 431 of them written in the generated module of the
``first_moment_in_eigenbasis`` row here, some inside the cond's branches).

Examples:
  python benchmarks/shampoo_update.py
  python benchmarks/shampoo_update.py --cpp-wrapper
  python benchmarks/shampoo_update.py --cpp-wrapper --no-size-asserts
  python benchmarks/shampoo_update.py --steps 40 --kernel-profile \
      --profile "opttx eigenvalue-corr., m in Q"     # where that row's step goes
  python benchmarks/shampoo_update.py --d-model 256 --steps 40
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, git_state, inductor_workarounds, meta_optimizers_dir  # noqa: E402

import torch  # noqa: E402

import opttx  # noqa: E402
from opttx.bench.model import GPT, GPTConfig  # noqa: E402

META = meta_optimizers_dir()
EIGEN_MOMENT = "opttx eigenvalue-corr., m in Q"


def problem(d_model: int, layers: int, device: torch.device) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=128, d_model=d_model, n_layers=layers, n_heads=4)).to(device)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator(device=device).manual_seed(1)
    grads = {n: 1e-2 * torch.randn(p.shape, generator=gen, device=device)
             for n, p in params.items()}
    return params, grads


def opttx_step(tx: opttx.GradientTransformation, params: dict, grads: dict):
    """A closure running one compiled update in place (params and state carried)."""
    params = {k: v.clone() for k, v in params.items()}
    box = {"state": tx.init(params)}

    @torch.compile(fullgraph=True)
    def update(g, state, p):
        u, state = tx.update(g, state, p)
        opttx.apply_updates_(p, u)
        return state

    def run() -> None:
        box["state"] = update(grads, box["state"], params)
    return run


def meta_step(ds, config, params: dict, grads: dict, frequency: int):
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = ds.DistributedShampoo(
        ps, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, weight_decay=0.0,
        max_preconditioner_dim=1024, precondition_frequency=frequency,
        start_preconditioning_step=frequency, use_bias_correction=True,
        grafting_config=ds.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        preconditioner_config=config)
    for p, g in zip(ps, grads.values()):
        p.grad = g.clone()
    return opt.step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--frequency", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="timed steps per optimizer")
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", metavar="NAME", default=None,
                   help="after the timing, profile 10 more steps of this row that refresh "
                        "nothing (e.g. 'opttx eigenvalue-corrected') with torch.profiler: "
                        "its costliest ops and the share of the matrix products")
    p.add_argument("--kernel-profile", action="store_true",
                   help="with --profile, on CPU: Inductor records each generated kernel (its "
                        "cpp.enable_kernel_profile, set before compiling), so the profile "
                        "names them")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="compile the opttx rows with torch._inductor.config.cpp_wrapper")
    p.add_argument("--no-size-asserts", action="store_true",
                   help="compile the opttx rows with Inductor's size_asserts and "
                        "alignment_asserts off")
    p.add_argument("--report-frequency", type=int, default=100,
                   help="the refresh frequency of the per-step mean reported (default 100, "
                        "shampoo_step.py's): (other x (f - 1) + refresh) / f")
    a = p.parse_args()
    if a.kernel_profile and not a.profile:
        p.error("--kernel-profile only names the kernels of --profile's row (and slows every "
                "compiled row's timing): give --profile too")
    if not (META / "distributed_shampoo").is_dir():
        print(f"Meta's DistributedShampoo is not at {META}: nothing to compare", file=sys.stderr)
        return 2
    sys.path.insert(0, str(META))
    import distributed_shampoo as ds
    logging.getLogger("distributed_shampoo").setLevel(logging.ERROR)
    device = torch.device(a.device)
    inductor_workarounds(device.type)
    import torch._inductor.config as inductor_config
    if a.cpp_wrapper:
        inductor_config.cpp_wrapper = True
    if a.no_size_asserts:
        inductor_config.size_asserts = False
        inductor_config.alignment_asserts = False
    if a.kernel_profile:
        inductor_config.cpp.enable_kernel_profile = True
    params, grads = problem(a.d_model, a.layers, device)
    kw = dict(betas=(0.9, 0.999), grafting="adam", grafting_beta2=0.999, grafting_epsilon=1e-8,
              precondition_frequency=a.frequency, start_preconditioning_step=a.frequency,
              max_preconditioner_dim=1024, epsilon=1e-12)
    runs = {
        "opttx root-inverse": opttx_step(opttx.shampoo(1e-3, **kw), params, grads),
        "meta root-inverse": meta_step(ds, ds.RootInvShampooPreconditionerConfig(), params,
                                       grads, a.frequency),
        "opttx eigenvalue-corrected": opttx_step(
            opttx.shampoo(1e-3, preconditioner="eigenvalue_corrected", **kw), params, grads),
        "meta eigenvalue-corrected": meta_step(
            ds, ds.EigenvalueCorrectedShampooPreconditionerConfig(), params, grads,
            a.frequency),
        EIGEN_MOMENT: opttx_step(
            opttx.shampoo(1e-3, preconditioner="eigenvalue_corrected",
                          first_moment_in_eigenbasis=True, **kw), params, grads),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for run in runs.values():                      # compile, then reach preconditioning
        for _ in range(2 * a.frequency):
            run()
    sync()
    times: dict[str, list[tuple[int, float]]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(a.steps):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            t0 = time.perf_counter()
            runs[name]()
            sync()
            times[name].append((i, time.perf_counter() - t0))
    step0 = 2 * a.frequency + 1                       # 1-based number of the first timed step

    def median(name: str, refresh: bool) -> float:
        return 1e3 * statistics.median(t for i, t in times[name]
                                       if refreshes(step0 + i, a.frequency) == refresh)
    n = sum(x.numel() for x in params.values())
    print(f"opttx shampoo_update: GPT d_model={a.d_model} layers={a.layers}: {n:,} parameters "
          f"in {len(params)} tensors; frequency {a.frequency}; {a.steps} timed steps each, "
          f"round-robin; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{cpu_model() if device.type == 'cpu' else torch.cuda.get_device_name(device)}; "
          f"opttx {git_state()}; Inductor cpp_wrapper={inductor_config.cpp_wrapper}, "
          f"size_asserts={inductor_config.size_asserts}")
    print(f"{'optimizer':32s} {'other ms':>9s} {'refresh ms':>11s}")
    for name in names:
        print(f"{name:32s} {median(name, False):9.2f} {median(name, True):11.2f}")
    f = a.report_frequency
    for kind, ours, theirs in (
            ("root-inverse", "opttx root-inverse", "meta root-inverse"),
            ("eigenvalue-corrected", "opttx eigenvalue-corrected", "meta eigenvalue-corrected"),
            ("eigenvalue-corrected, opttx's first moment in the eigenbasis", EIGEN_MOMENT,
             "meta eigenvalue-corrected")):
        mean = [(median(n, False) * (f - 1) + median(n, True)) / f for n in (ours, theirs)]
        print(f"{kind}: opttx / meta = {median(ours, False) / median(theirs, False):.2f}x "
              f"(other steps), {median(ours, True) / median(theirs, True):.2f}x (refresh steps), "
              f"{mean[0] / mean[1]:.2f}x per step at a refresh every {f} steps "
              f"(target: <= 0.5x)")
    if a.profile:
        profile(runs[a.profile], a.profile, sync, step0 + a.steps, a.frequency,
                rows=12 if a.kernel_profile else 6)
    return 0


def refreshes(step: int, frequency: int) -> bool:
    """Whether the 1-based ``step`` recomputes roots or bases (start step = frequency)."""
    return step % frequency == 0


def profile(run, name: str, sync, next_step: int, frequency: int, rows: int) -> None:
    """torch.profiler over 10 steps of ``run`` that refresh nothing (a refresh step in between
    runs unprofiled): self CPU time per step of its ``rows`` costliest ops (with
    ``--kernel-profile`` Inductor's generated kernels among them), and the share of
    ``aten::mm`` (the matrix products both implementations compute alike)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    totals: dict[str, float] = {}
    calls: dict[str, int] = {}
    profiled = 0
    while profiled < 10:
        if refreshes(next_step, frequency):
            run()
            sync()
        else:
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
                sync()
            for e in prof.key_averages():
                totals[e.key] = totals.get(e.key, 0.0) + e.self_cpu_time_total
                calls[e.key] = calls.get(e.key, 0) + e.count
            profiled += 1
        next_step += 1
    per_step = {k: v / 1e3 / profiled for k, v in totals.items()}     # ms
    print(f"\nprofile of {name!r}, {profiled} steps without a refresh (self CPU ms per step):")
    for key, ms in sorted(per_step.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {key[:45]:45s} {ms:8.2f}  ({calls[key] / profiled:.0f} calls)")
    mm, total = per_step.get("aten::mm", 0.0), sum(per_step.values())
    print(f"aten::mm: {calls.get('aten::mm', 0) / profiled:.0f} calls per step, {mm:.2f} of "
          f"{total:.2f} ms per step ({100 * mm / max(total, 1e-9):.0f} %)")


if __name__ == "__main__":
    sys.exit(main())
