"""Optimizer step time on a ~1B-parameter Llama shape set, on a GPU (or on CPU at a small size).

Only the optimizer step is timed: parameters start from one fixed random init and the
gradients are fixed random tensors generated once (no model, no backward), so every variant
sees the same numbers and the timing measures the step alone.

Shapes (``--size``), Llama-style (untied embedding and lm head, per layer q/k/v/o, gate/up/
down MLP and two RMSNorm weights, a final RMSNorm):

  1b     TinyLlama-1.1B: vocab 32000, hidden 2048, MLP 5632, 22 layers, 32 heads, 4 KV heads
         (1,100,048,384 parameters in 201 tensors) -- the default on a GPU
  small  vocab 4096, hidden 512, MLP 1408, 5 layers, 8 KV heads (~20M in 48 tensors) -- the
         default on CPU
  quick  vocab 512, hidden 64, MLP 176, 1 layer (a smoke run, with --quick)

Variants (``--only`` takes group names, ``group.variant`` keys or globs):

  adamw   torch AdamW foreach=False / foreach=True (the numerical reference) / fused=True /
          torch.compile(opt.step) of the foreach AdamW; opttx.Optimizer(params, opttx.adamw)
          (eager); the functional opttx step under torch.compile(fullgraph=True) (in place:
          ``tx.update``, ``opttx.apply_updates_``, ``opttx.tree_copy_``); the same step with
          mode="reduce-overhead" (CUDA graphs; every leaf marked static with
          ``torch._dynamo.mark_static_address``, as CUDA graph trees need for in-place
          mutation of inputs); the compiled step of ``opttx.flatten(opttx.adamw(...))``; and
          the compiled ``opttx.stacked(opttx.adamw(...))`` on `opttx.StackedParams` (the
          same-shaped layer tensors in stacks: one copy of the chain per stack length).
  lion    a hand-written foreach Lion (torch.optim has none; the reference) vs opttx.lion
          eager and compiled.
  adafactor  torch.optim.Adafactor foreach=False (the reference) / foreach=True vs
          opttx.adafactor configured to equal it (eager, compiled, stacked-compiled).
  bf16    mixed precision: bfloat16 parameters and gradients, float32 optimizer state (opttx
          keeps fp32 statistics for 16-bit leaves). A hand-written foreach AdamW with fp32
          m, v (the reference: update in fp32, cast to bf16, added to p), torch fused AdamW on
          the bf16 parameters (its state is then bf16 too: a time reference for a different
          algorithm), opttx adamw eager, compiled, flatten-compiled and stacked-compiled.

Method.
  * Timing, GPU: each step is bracketed by CUDA events after a device synchronize, and the
    end event is synchronized before the next step (so host launch overhead of an eager
    variant shows up when it exceeds the device time); median and min over ``--steps``
    timed steps after ``--warmup`` untimed ones. Variants run one at a time (one 1B-parameter
    AdamW copy is ~13 GiB; ``--sequential``): build, check, warm up, time, free (Dynamo is
    reset after each, dropping its graphs and CUDA graph pool). torch fused AdamW is timed
    again (a fresh build) at the end of the adamw group; the two medians show the run-to-run
    spread.
  * Timing, CPU: time.perf_counter around each step; the variants of a group live together
    and are timed round-robin (one step of each per round, starting at a different variant
    each round; ``--together``), so background load on the shared cores hits all of them
    alike. The load other processes put on the cores while a group was timed is printed.
  * Copy bandwidth, measured in the same run, before and after the variants: ``dst.copy_(src)``
    of a float32 tensor with as many elements as the model has parameters (4.4 GB at 1b; at
    least 2^25 elements, 128 MiB), timed like a step (CUDA events / perf_counter), median of
    20. Convention: bandwidth = (bytes read + bytes written) / time = 2 * nbytes / t. The
    larger of the two medians is used (the stricter roofline). On a CPU the copy also pays a
    read-for-ownership of every destination line (3 streams move, 2 are counted), which an
    in-place optimizer update does not (its written lines were just read), so there "% roof"
    can exceed 100 (by up to 1.5x); on a GPU the copy is the right ceiling.
  * Roofline of an element-wise step: time = bytes moved per parameter * N / bandwidth, each
    input read once and each output written once: AdamW fp32 28 B/param (read p, g, m, v;
    write p, m, v), Lion fp32 20 B/param (read p, g, m; write p, m), AdamW with bf16 p and g
    and fp32 m, v 22 B/param (read 2+2+4+4, write 2+4+4), all-bf16 AdamW 14 B/param.
    "% roofline" = roofline time / median time. Adafactor reduces over rows and columns (no
    single-pass roofline): "-".
  * Compile time: the first call's wall time (synchronized) minus one median step, on a fresh
    empty Inductor cache (a temporary TORCHINDUCTOR_CACHE_DIR) unless ``--warm-cache``.
    Each compiled opttx step has a code object of its own, so Dynamo caches and counts its
    graphs separately ("graphs" = cache entries; 1 = never recompiled). With CUDA graph trees
    the recording happens in the 2nd/3rd call (inside the check steps, not in "compile s").
  * Correctness: every variant runs ``--check-steps`` steps from the same init with the same
    gradients (the first calls of the very objects that are then timed, so a compiled variant
    is checked through its compiled code, a reduce-overhead one through its graph replays),
    then its parameters are compared with the group's reference after as many steps.
    float32: max|a - b| / max|b| <= 1e-6 * (1 + k/5) after k steps (fp32 rounding of two
    correct implementations drifts by about an ulp of |p| per step; a wrong update would
    differ by ~lr = 1e-3 relative). bf16: elementwise |a - b| <= k * (ulp_bf16(m) + lr/128)
    after k steps with m = max(|p0|, |a|, |b|), printed as the largest ratio to
    (ulp + lr/128) per step taken (<= 1 ok: one rounding flip of p per step -- an update near
    a rounding tie flips in every step -- plus bf16-state rounding of the update). The
    reduce-overhead variant is also compared with the default compiled one (expected equal).
  * State B/param: bytes of the optimizer state tensors / parameter count. Peak GiB (GPU):
    max_memory_allocated while the variant lived minus what was allocated before it was
    built (its params, state and temporaries; the shared gradients are not counted).

``--quick`` is a smoke run of every variant and every path of the script: the quick size, a
few steps, one thread, and the compiled variants traced by Dynamo (fullgraph) and AOTAutograd
with ``backend="aot_eager"`` instead of compiled by Inductor (an Inductor compile takes 10-30 s
per variant on a small CPU); its numbers mean nothing.

Targets printed (stated for an H100, informational elsewhere): compiled opttx adamw
>= 93% of the copy roofline and <= 0.9x torch fused AdamW; eager opttx adamw <= 1.5x fused;
compile <= 15 s for each compiled opttx variant; the reduce-overhead variant runs, uses CUDA
graphs (no cudagraph skips) and gives the default compiled variant's parameters.

Examples:
  python benchmarks/gpu_step.py                       # GPU if there is one (1b), else CPU small
  python benchmarks/gpu_step.py --quick               # smoke run, < 1 min on CPU (see --quick)
  python benchmarks/gpu_step.py --device cuda --only adamw,bf16 --json $OUT/gpu_step.json
  python benchmarks/gpu_step.py --device cpu --size small --wait-idle 300
  python benchmarks/gpu_step.py --only 'adamw.torch_fused,adamw.opttx_*'
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (cpu_model, cpu_times, early_cache_dir, fmt, git_state, other_load,  # noqa: E402
                     own_code, wait_idle)

early_cache_dir("opttx_gpu_step_")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import opttx  # noqa: E402
from opttx.tree import tree_leaves  # noqa: E402

LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WD = 0.01
LION_LR = 1e-4
LION_BETAS = (0.9, 0.99)
LION_WD = 0.1
ADAFACTOR_LR = 1e-2   # torch.optim.Adafactor's lr: the cap of its relative step size

TOLERANCE = 1e-6      # fp32: relative to max|p| after one step; grows by 1/5 per step
BF16_ULP_FRACTION = 2.0 ** -7   # the lr allowance of the bf16 check, per step

# Bytes each element-wise step must move per parameter (each input read once, each output
# written once).
BYTES_ADAMW_FP32 = 28     # read p, g, m, v (4 each); write p, m, v
BYTES_LION_FP32 = 20      # read p, g, m; write p, m
BYTES_ADAMW_MIXED = 22    # bf16 p, g; fp32 m, v: read 2+2+4+4, write 2+4+4
BYTES_ADAMW_BF16 = 14     # all bf16: read 2*4, write 2*3

# The torch.compile backend of every compiled variant (--backend; --quick: aot_eager).
BACKEND = {"name": "inductor"}

TARGET_ROOFLINE = 0.93
TARGET_VS_FUSED = 0.9
TARGET_EAGER_VS_FUSED = 1.5
TARGET_COMPILE_S = 15.0


# ---------------------------------------------------------------------------------------------
# shapes and the fixed problem
# ---------------------------------------------------------------------------------------------

SIZES = {
    "1b": dict(vocab=32000, hidden=2048, mlp=5632, layers=22, heads=32, kv_heads=4),
    "small": dict(vocab=4096, hidden=512, mlp=1408, layers=5, heads=8, kv_heads=8),
    "quick": dict(vocab=512, hidden=64, mlp=176, layers=1, heads=4, kv_heads=4),
}


def llama_shapes(vocab: int, hidden: int, mlp: int, layers: int, heads: int,
                 kv_heads: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of a Llama decoder (HF naming; Linear weights are (out, in))."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    shapes = [("embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        pre = f"layers.{i}."
        shapes += [
            (pre + "input_layernorm.weight", (hidden,)),
            (pre + "self_attn.q_proj.weight", (hidden, hidden)),
            (pre + "self_attn.k_proj.weight", (kv, hidden)),
            (pre + "self_attn.v_proj.weight", (kv, hidden)),
            (pre + "self_attn.o_proj.weight", (hidden, hidden)),
            (pre + "post_attention_layernorm.weight", (hidden,)),
            (pre + "mlp.gate_proj.weight", (mlp, hidden)),
            (pre + "mlp.up_proj.weight", (mlp, hidden)),
            (pre + "mlp.down_proj.weight", (hidden, mlp)),
        ]
    shapes += [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def make_problem(size: str, device: torch.device, seed: int = 0
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Initial parameters and fixed gradients (float32, on ``device``), drawn once."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params, grads = [], []
    for name, shape in llama_shapes(**SIZES[size]):
        p = torch.randn(shape, generator=gen, device=device)
        if name.endswith("norm.weight"):
            p.mul_(0.01).add_(1.0)            # RMSNorm weights near 1
        else:
            p.mul_(0.02)
        g = torch.randn(shape, generator=gen, device=device).mul_(0.01)
        params.append(p)
        grads.append(g)
    return params, grads


# ---------------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------------


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Variant:
    """One way of running the step: own params and state, the shared fixed gradients."""

    compiled = False
    code: types.CodeType | None = None   # the compiled function's code object (opttx)

    def step(self) -> None:
        raise NotImplementedError

    def params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def state_bytes(self) -> int:
        raise NotImplementedError


class TorchOptim(Variant):
    def __init__(self, init, grads, make: Callable[[list], torch.optim.Optimizer],
                 compile_step: bool = False) -> None:
        self._params = [torch.nn.Parameter(p.clone()) for p in init]
        for p, g in zip(self._params, grads):
            p.grad = g
        self.opt = make(self._params)
        self.compiled = compile_step
        if compile_step:
            opt = self.opt

            @torch.compile(fullgraph=False, backend=BACKEND["name"])
            def compiled_step() -> None:
                opt.step()

            self._step = compiled_step
        else:
            self._step = self.opt.step

    def step(self) -> None:
        self._step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params]

    def state_bytes(self) -> int:
        return sum(_nbytes(s.values()) for s in self.opt.state.values())


class OpttxEager(Variant):
    """``opttx.Optimizer(params, tx)`` with ``opt.step()``, grads in ``p.grad``."""

    def __init__(self, init, grads, tx: opttx.GradientTransformation) -> None:
        self._params = [torch.nn.Parameter(p.clone()) for p in init]
        for p, g in zip(self._params, grads):
            p.grad = g
        self.opt = opttx.Optimizer(self._params, tx)

    def step(self) -> None:
        self.opt.step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params]

    def state_bytes(self) -> int:
        return _nbytes(tree_leaves(self.opt.tx_states))


class OpttxCompiled(Variant):
    """The functional step ``tx.update`` + ``apply_updates_`` + ``tree_copy_`` under
    ``torch.compile(fullgraph=True, mode=mode)``; params, grads and state are plain tensors.
    ``static`` marks every leaf with ``torch._dynamo.mark_static_address`` (what CUDA graph
    trees need to capture a graph that mutates its inputs)."""

    compiled = True

    def __init__(self, init, grads, tx: opttx.GradientTransformation, name: str,
                 mode: str | None = None, static: bool = False) -> None:
        self._params = [p.clone() for p in init]
        # A static variant gets its own gradients: marking the shared ones would turn them
        # into graph constants (ID_MATCH guards) in every variant compiled after it.
        self.grads = [g.clone() for g in grads] if static else grads
        self.state = tx.init(self._params)
        if static:   # as torch's own compiled optimizer does (guard=True)
            for t in self._params + self.grads + tree_leaves(self.state):
                if isinstance(t, torch.Tensor):
                    torch._dynamo.mark_static_address(t)

        def step(params, grads, state):
            updates, new_state = tx.update(grads, state, params)
            opttx.apply_updates_(params, updates)
            opttx.tree_copy_(state, new_state)

        step = own_code(step, "opttx_step_" + name.replace(".", "_"))
        self.code = step.__code__
        if BACKEND["name"] == "inductor":
            self._step = torch.compile(step, fullgraph=True, mode=mode)
        else:   # modes are Inductor's
            self._step = torch.compile(step, fullgraph=True, backend=BACKEND["name"])

    def step(self) -> None:
        self._step(self._params, self.grads, self.state)

    def params(self) -> list[torch.Tensor]:
        return self._params

    def state_bytes(self) -> int:
        return _nbytes(tree_leaves(self.state))


class OpttxStacked(OpttxCompiled):
    """`OpttxCompiled` on the stacked layout: the same-shaped tensors (the layers' q/o, k/v,
    gate/up, down and norm weights; embedding and head) live in `opttx.StackedParams` stacks,
    the fixed gradients are stacked once, and the step runs ``opttx.stacked(tx)`` on the
    stacks, so the compiled graph holds one copy of the chain per stack length instead of one
    per tensor."""

    def __init__(self, init, grads, tx: opttx.GradientTransformation, name: str,
                 mode: str | None = None, static: bool = False) -> None:
        keys = [f"{i:04d}" for i in range(len(init))]
        self.stack = opttx.StackedParams(dict(zip(keys, init)))
        stacked_grads = self.stack.stack(dict(zip(keys, grads)))
        super().__init__(list(self.stack.buffers.values()), list(stacked_grads.values()),
                         opttx.stacked(tx), name, mode=mode, static=static)

    def params(self) -> list[torch.Tensor]:
        return tree_leaves(self.stack.unstack(dict(zip(self.stack.names, self._params))))


class LionForeach(Variant):
    """Lion with torch foreach ops (as lion-pytorch, batched); torch.optim has no Lion."""

    def __init__(self, init, grads) -> None:
        self._params = [p.clone() for p in init]
        self.grads = grads
        self.mu = [torch.zeros_like(p) for p in init]

    @torch.no_grad()
    def step(self) -> None:
        lr, (b1, b2), wd = LION_LR, LION_BETAS, LION_WD
        torch._foreach_mul_(self._params, 1 - lr * wd)
        c = torch._foreach_lerp(self.mu, self.grads, 1 - b1)
        torch._foreach_sign_(c)
        torch._foreach_add_(self._params, c, alpha=-lr)
        torch._foreach_lerp_(self.mu, self.grads, 1 - b2)

    def params(self) -> list[torch.Tensor]:
        return self._params

    def state_bytes(self) -> int:
        return _nbytes(self.mu)


class MixedAdamWForeach(Variant):
    """AdamW for 16-bit parameters with float32 m, v, written with torch foreach ops:
    g32 = g.float(); m, v updated in fp32; u = -lr (m/bc1 / (sqrt(v/bc2) + eps) + wd p32);
    p += u.to(p.dtype). The mixed-precision reference (what opttx.adamw computes for bf16
    leaves, written independently)."""

    def __init__(self, init, grads) -> None:
        self._params = [p.clone() for p in init]
        self.grads = grads
        self.m = [torch.zeros_like(p, dtype=torch.float32) for p in init]
        self.v = [torch.zeros_like(p, dtype=torch.float32) for p in init]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        (b1, b2), lr = BETAS, LR
        self.t += 1
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        g32 = [g.float() for g in self.grads]
        torch._foreach_lerp_(self.m, g32, 1 - b1)
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, g32, g32, value=1 - b2)
        denom = torch._foreach_sqrt(self.v)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, EPS)
        u = torch._foreach_div(self.m, denom)
        torch._foreach_div_(u, bc1)
        p32 = [p.float() for p in self._params]
        torch._foreach_add_(u, p32, alpha=WD)
        torch._foreach_mul_(u, -lr)
        torch._foreach_add_(self._params, [x.to(p.dtype) for x, p in zip(u, self._params)])

    def params(self) -> list[torch.Tensor]:
        return self._params

    def state_bytes(self) -> int:
        return _nbytes(self.m) + _nbytes(self.v)


# ---------------------------------------------------------------------------------------------
# the variant table
# ---------------------------------------------------------------------------------------------


@dataclass
class Spec:
    key: str                        # "group.variant"
    label: str
    build: Callable[..., Variant]   # (init, grads, key) -> Variant
    bytes_per_param: int | None = None   # for the roofline (element-wise steps)
    reference: bool = False         # the group's numerical reference
    also_vs: str = ""               # a second variant this one must equal (reported)
    base: bool = False              # the group's time baseline ("x base")
    cuda_graphs: bool = False       # compiled with mode="reduce-overhead"


def _adamw_torch(**kw) -> Callable[[list], torch.optim.Optimizer]:
    return lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)


def opttx_adamw() -> opttx.GradientTransformation:
    return opttx.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def opttx_lion() -> opttx.GradientTransformation:
    return opttx.lion(LION_LR, b1=LION_BETAS[0], b2=LION_BETAS[1], weight_decay=LION_WD)


def _adafactor_torch(**kw) -> Callable[[list], torch.optim.Optimizer]:
    return lambda ps: torch.optim.Adafactor(ps, lr=ADAFACTOR_LR, **kw)


def opttx_adafactor() -> opttx.GradientTransformation:
    """Equals torch.optim.Adafactor(lr=ADAFACTOR_LR) (tests/test_factored.py)."""
    return opttx.adafactor(opttx.relative_step_schedule(ADAFACTOR_LR), min_dim_size_to_factor=1,
                           eps=0.0, eps_clamp=torch.finfo(torch.float32).eps,
                           factor_axes="last")


GROUPS: dict[str, tuple[str, str, list[Spec]]] = {
    # name: (title, dtype of params and grads, variants; the reference first)
    "adamw": (f"AdamW fp32  lr={LR} betas={BETAS} eps={EPS} weight_decay={WD}", "float32", [
        Spec("adamw.torch_foreach", "torch AdamW foreach=True",
             lambda i, g, k: TorchOptim(i, g, _adamw_torch(foreach=True)),
             BYTES_ADAMW_FP32, reference=True),
        Spec("adamw.torch_forloop", "torch AdamW foreach=False",
             lambda i, g, k: TorchOptim(i, g, _adamw_torch(foreach=False)), BYTES_ADAMW_FP32),
        Spec("adamw.torch_fused", "torch AdamW fused=True",
             lambda i, g, k: TorchOptim(i, g, _adamw_torch(fused=True)), BYTES_ADAMW_FP32,
             base=True),
        Spec("adamw.torch_compiled", "torch.compile(AdamW foreach .step)",
             lambda i, g, k: TorchOptim(i, g, _adamw_torch(foreach=True), compile_step=True),
             BYTES_ADAMW_FP32),
        Spec("adamw.opttx_eager", "opttx.Optimizer(adamw) eager",
             lambda i, g, k: OpttxEager(i, g, opttx_adamw()), BYTES_ADAMW_FP32),
        Spec("adamw.opttx_compiled", "opttx adamw compiled",
             lambda i, g, k: OpttxCompiled(i, g, opttx_adamw(), k), BYTES_ADAMW_FP32),
        Spec("adamw.opttx_compiled_cg", "opttx adamw compiled reduce-overhead",
             lambda i, g, k: OpttxCompiled(i, g, opttx_adamw(), k, mode="reduce-overhead",
                                           static=True),
             BYTES_ADAMW_FP32, also_vs="adamw.opttx_compiled", cuda_graphs=True),
        Spec("adamw.opttx_flatten", "opttx flatten(adamw) compiled",
             lambda i, g, k: OpttxCompiled(i, g, opttx.flatten(opttx_adamw()), k),
             BYTES_ADAMW_FP32),
        Spec("adamw.opttx_stacked", "opttx stacked(adamw) compiled",
             lambda i, g, k: OpttxStacked(i, g, opttx_adamw(), k), BYTES_ADAMW_FP32),
    ]),
    "lion": (f"Lion fp32  lr={LION_LR} betas={LION_BETAS} weight_decay={LION_WD} "
             "(torch.optim has no Lion: hand-written foreach reference)", "float32", [
        Spec("lion.torch_foreach", "hand-written Lion foreach",
             lambda i, g, k: LionForeach(i, g), BYTES_LION_FP32, reference=True, base=True),
        Spec("lion.opttx_eager", "opttx.Optimizer(lion) eager",
             lambda i, g, k: OpttxEager(i, g, opttx_lion()), BYTES_LION_FP32),
        Spec("lion.opttx_compiled", "opttx lion compiled",
             lambda i, g, k: OpttxCompiled(i, g, opttx_lion(), k), BYTES_LION_FP32),
    ]),
    "adafactor": (f"Adafactor fp32  torch.optim.Adafactor(lr={ADAFACTOR_LR}) and the opttx "
                  "configuration equal to it (factored over the last two dims, no momentum)",
                  "float32", [
        Spec("adafactor.torch_forloop", "torch Adafactor foreach=False",
             lambda i, g, k: TorchOptim(i, g, _adafactor_torch(foreach=False)),
             reference=True),
        Spec("adafactor.torch_foreach", "torch Adafactor foreach=True",
             lambda i, g, k: TorchOptim(i, g, _adafactor_torch(foreach=True)), base=True),
        Spec("adafactor.opttx_eager", "opttx.Optimizer(adafactor) eager",
             lambda i, g, k: OpttxEager(i, g, opttx_adafactor())),
        Spec("adafactor.opttx_compiled", "opttx adafactor compiled",
             lambda i, g, k: OpttxCompiled(i, g, opttx_adafactor(), k)),
        Spec("adafactor.opttx_stacked", "opttx stacked(adafactor) compiled",
             lambda i, g, k: OpttxStacked(i, g, opttx_adafactor(), k)),
    ]),
    "bf16": (f"Mixed precision AdamW: bf16 params and grads, fp32 m and v (hyperparameters as "
             f"adamw). torch fused keeps bf16 state (a time reference, checked with the bf16 "
             f"rule)", "bfloat16", [
        Spec("bf16.reference", "hand-written foreach AdamW fp32 state",
             lambda i, g, k: MixedAdamWForeach(i, g), BYTES_ADAMW_MIXED, reference=True),
        Spec("bf16.torch_fused", "torch AdamW fused=True (bf16 state)",
             lambda i, g, k: TorchOptim(i, g, _adamw_torch(fused=True)), BYTES_ADAMW_BF16,
             base=True),
        Spec("bf16.opttx_eager", "opttx.Optimizer(adamw) eager bf16",
             lambda i, g, k: OpttxEager(i, g, opttx_adamw()), BYTES_ADAMW_MIXED),
        Spec("bf16.opttx_compiled", "opttx adamw compiled bf16",
             lambda i, g, k: OpttxCompiled(i, g, opttx_adamw(), k), BYTES_ADAMW_MIXED),
        Spec("bf16.opttx_flatten", "opttx flatten(adamw) compiled bf16",
             lambda i, g, k: OpttxCompiled(i, g, opttx.flatten(opttx_adamw()), k),
             BYTES_ADAMW_MIXED),
        Spec("bf16.opttx_stacked", "opttx stacked(adamw) compiled bf16",
             lambda i, g, k: OpttxStacked(i, g, opttx_adamw(), k), BYTES_ADAMW_MIXED),
    ]),
}


def select(only: str | None) -> list[Spec]:
    specs = [s for _, (_, _, group) in GROUPS.items() for s in group]
    if not only:
        return specs
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [s for s in specs
              if any(fnmatch.fnmatch(s.key, p) or s.key.split(".")[0] == p for p in patterns)]
    if not chosen:
        raise SystemExit(f"--only {only!r} matches none of: {', '.join(s.key for s in specs)}")
    return chosen


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


class Clock:
    """Time one call: CUDA events after a synchronize on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()   # eager CPU ops and a compiled CPU step return when their work is done
        return (time.perf_counter() - t0) * 1e3

    def wall_s(self, fn: Callable[[], Any]) -> float:
        """Host wall time of ``fn`` including everything it queued (for compile times)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def copy_bandwidth(n: int, device: torch.device, clock: Clock, repeats: int = 20
                   ) -> tuple[float, float]:
    """(GB/s, median ms) of ``dst.copy_(src)`` for ``n`` float32 elements; bytes read plus
    bytes written over the median time."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = [clock.time_ms(lambda: dst.copy_(src)) for _ in range(repeats)]
    med = statistics.median(times)
    nbytes = 2 * n * 4
    del src, dst
    return nbytes / (med / 1e3) / 1e9, med


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at |x| (8 significant bits), in float32."""
    _, e = torch.frexp(x.float().abs())               # |x| = m 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), (e - 8).clamp_min(-133))


def compare(a: list[torch.Tensor], b: list[torch.Tensor], init: list[torch.Tensor],
            dtype: torch.dtype, steps: int) -> tuple[float, float, float]:
    """(max|a - b|, err, tol) after ``steps`` steps from ``init``.

    fp32: err = max|a-b| / max|b|, tol = 1e-6 (1 + k/5).
    bf16: err = max over elements of |a-b| / (ulp_bf16(max(|p0|, |a|, |b|)) + lr/128) / k,
    tol = 1. Two correct implementations whose fp32 updates differ in the last bits can round
    p + u to neighbouring bf16 numbers in any step (an update that lands near a rounding tie
    does so in every step, coherently), so they may drift apart by one ulp of |p| per step;
    |p| moves monotonically here (fixed gradients) and stays within max(|p0|, |p_k|), whose
    ulp bounds each step's. The lr/128 term allows for bf16 optimizer state (torch fused).
    """
    max_abs = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    if dtype == torch.float32:
        scale = max(float(y.abs().max()) for y in b)
        return max_abs, max_abs / scale, TOLERANCE * (1 + steps / 5)
    worst = 0.0
    for x, y, p0 in zip(a, b, init):
        x, y = x.float(), y.float()
        mag = torch.maximum(torch.maximum(x.abs(), y.abs()), p0.float().abs())
        allowance = _ulp_bf16(mag).add_(LR * BF16_ULP_FRACTION)
        worst = max(worst, float(((x - y).abs() / allowance).max()))
    return max_abs, worst / steps, 1.0


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    key: str
    label: str
    group: str
    times_ms: list[float] = field(default_factory=list)
    first_call_s: float | None = None
    compile_s: float | None = None
    compiled: bool = False
    graphs: int | None = None            # Dynamo cache entries of the compiled opttx step
    cudagraph_skips: int | None = None   # inductor cudagraph_skips during its compile/run
    state_bytes_per_param: float | None = None
    bytes_per_param: int | None = None
    peak_gib: float | None = None
    check: tuple[float, float, float] | None = None     # vs the reference (max|dp|, err, tol)
    check_also: tuple[float, float, float] | None = None  # vs ``also_vs``
    vs: str = ""
    also_vs: str = ""
    reference: bool = False
    base: bool = False
    error: str = ""
    background: float | None = None      # CPU: cores used by other processes while timed
    repeat_median_ms: float | None = None  # torch fused timed again at the end (GPU)

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min(self) -> float:
        return min(self.times_ms)

    @property
    def ok(self) -> bool | None:
        if self.error:
            return False
        checks = [c for c in (self.check, self.check_also) if c is not None]
        if not checks:
            return None
        return all(c[1] <= c[2] and math.isfinite(c[1]) for c in checks)


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["cudagraph_skips"])


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_group(name: str, chosen: list[Spec], init: list[torch.Tensor], grads: list[torch.Tensor],
              device: torch.device, clock: Clock, a: argparse.Namespace) -> list[Result]:
    """Build, check, warm up and time the chosen variants of one group.

    The group's reference always runs (untimed if not chosen). Together (CPU): all variants
    live at once and are timed round-robin. Sequential (GPU): one variant lives at a time.
    """
    _, dtype_name, group = GROUPS[name]
    dtype = getattr(torch, dtype_name)
    ref_spec = next(s for s in group if s.reference)
    needed = {ref_spec.key} | {s.also_vs for s in chosen if s.also_vs}
    members = [s for s in group if s in chosen or s.key in needed]   # group order: ref first
    n_params = sum(p.numel() for p in init)
    results = {s.key: Result(s.key, s.label, name, bytes_per_param=s.bytes_per_param,
                             vs="" if s.reference else ref_spec.key, also_vs=s.also_vs,
                             reference=s.reference, base=s.base) for s in members}
    snaps: dict[str, list[torch.Tensor]] = {}
    k = a.check_steps
    batches = [members] if a.together else [[s] for s in members]
    timed_keys = {s.key for s in chosen}

    for batch in batches:
        live: dict[str, Variant] = {}
        try:
            for spec in batch:
                r = results[spec.key]
                print(f"  {spec.key}: build, {k} check steps ...", flush=True)
                _free(device)
                base_alloc = 0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    base_alloc = torch.cuda.memory_allocated()
                skips0 = _cudagraph_skips()
                variant = None
                try:
                    variant = spec.build(init, grads, spec.key)
                    r.compiled = variant.compiled
                    r.first_call_s = clock.wall_s(variant.step)   # compiles a compiled one
                    for _ in range(k - 1):
                        variant.step()
                    clock.sync()
                except Exception as exc:   # a broken variant is a result too
                    if spec.reference:
                        raise
                    r.error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
                    print(f"    FAILED: {r.error}", flush=True)
                    variant = exc = None
                    _free(device)
                    continue
                r.state_bytes_per_param = variant.state_bytes() / n_params
                if spec.key in needed:
                    snaps[spec.key] = [p.detach().clone() for p in variant.params()]
                if not spec.reference:
                    r.check = compare(variant.params(), snaps[ref_spec.key], init, dtype, k)
                if spec.also_vs:
                    if spec.also_vs in snaps:
                        r.check_also = compare(variant.params(), snaps[spec.also_vs], init,
                                               dtype, k)
                    else:
                        r.also_vs = ""   # that variant failed: nothing to compare with
                for _ in range(a.warmup):
                    variant.step()
                clock.sync()
                if spec.cuda_graphs or variant.compiled:
                    r.cudagraph_skips = _cudagraph_skips() - skips0
                if variant.code is not None:
                    try:
                        r.graphs = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(
                            variant.code))
                    except Exception:   # a private helper: not in every torch version
                        r.graphs = None
                if device.type == "cuda":
                    r.peak_gib = (torch.cuda.max_memory_allocated() - base_alloc) / 2**30
                if spec.key in timed_keys:
                    live[spec.key] = variant
                    first = f"first call {r.first_call_s:.1f} s, " if variant.compiled else ""
                    chk = (f"err {r.check[1]:.1e} (tol {r.check[2]:.0e})" if r.check
                           else "reference")
                    print(f"    {first}{chk}", flush=True)
                variant = None   # only ``live`` holds it now: freed with the batch
            if not live:
                continue
            order = list(live)
            since = cpu_times()
            for i in range(a.steps):
                for key in order[i % len(order):] + order[:i % len(order)]:
                    results[key].times_ms.append(clock.time_ms(live[key].step))
            background = other_load(since) if device.type == "cpu" else None
            for key in order:
                r = results[key]
                r.background = background
                if r.compiled and r.first_call_s is not None:
                    r.compile_s = max(0.0, r.first_call_s - r.median / 1e3)
                print(f"    {key:<28} median {r.median:9.2f} ms   min {r.min:9.2f} ms",
                      flush=True)
        finally:
            live.clear()
            if not a.together:
                # Compiled graphs can hold their inputs (static ones are graph constants) and
                # CUDA graph trees a memory pool: drop them before the next variant is built.
                torch._dynamo.reset()
            _free(device)
    snaps.clear()
    _free(device)
    torch._dynamo.reset()
    return [results[s.key] for s in chosen]


def repeat_timing(spec: Spec, init, grads, clock: Clock, a: argparse.Namespace
                  ) -> float:
    """Median of a fresh build of ``spec`` timed again (the run-to-run spread on a GPU)."""
    variant = spec.build(init, grads, spec.key)
    for _ in range(a.check_steps + a.warmup):
        variant.step()
    times = [clock.time_ms(variant.step) for _ in range(a.steps)]
    del variant
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------


def roofline_pct(r: Result, n_params: int, bw_gbs: float) -> float | None:
    if r.bytes_per_param is None or r.error or not r.times_ms:
        return None
    return 100.0 * (r.bytes_per_param * n_params / (bw_gbs * 1e9)) / (r.median / 1e3)


def print_table(results: list[Result], n_params: int, bw_gbs: float, cuda: bool) -> None:
    header = (f"{'variant':<38} {'median ms':>10} {'min ms':>9} {'x base':>7} {'% roof':>7}"
              f" {'B/p':>4} {'state B/p':>9} {'compile s':>9} {'graphs':>6}"
              + (f" {'peak GiB':>8}" if cuda else "")
              + f" {'max|dp|':>9} {'err':>8} {'tol':>6}  ok    vs")
    by_group: dict[str, list[Result]] = {}
    for r in results:
        by_group.setdefault(r.group, []).append(r)
    for name, rows in by_group.items():
        title = GROUPS[name][0]
        base = next((r for r in rows if r.base and not r.error and r.times_ms), None)
        print()
        print(f"[{name}] {title}")
        notes = [f"x base = time / time of '{base.label}'" if base else "x base: base not run",
                 "B/p = bytes/param the roofline counts", "err/tol: see Correctness below"]
        if rows[0].background is not None:
            notes.insert(0, f"other processes kept {rows[0].background:.2f} of "
                            f"{os.cpu_count()} cores busy while this group was timed")
        print("(" + "; ".join(notes) + ")")
        print(header)
        print("-" * len(header))
        for r in rows:
            if r.error or not r.times_ms:
                print(f"{r.label:<38} FAILED: {r.error or 'not timed'}")
                continue
            ok = r.ok
            ok_s = "ref" if r.reference else {True: "ok", False: "FAIL", None: "-"}[ok]
            x_base = r.median / base.median if base else None
            chk = r.check
            vs = r.vs.split(".", 1)[1] if r.vs else ""
            if r.check_also is not None:
                vs += f"; vs {r.also_vs.split('.', 1)[1]}: max|dp| {r.check_also[0]:.1e}"
            print(f"{r.label:<38} {r.median:>10.2f} {r.min:>9.2f} {fmt(x_base, '.2f'):>7}"
                  f" {fmt(roofline_pct(r, n_params, bw_gbs), '.1f'):>7}"
                  f" {fmt(r.bytes_per_param, 'd'):>4} {fmt(r.state_bytes_per_param, '.2f'):>9}"
                  f" {fmt(r.compile_s):>9} {fmt(r.graphs, 'd'):>6}"
                  + (f" {fmt(r.peak_gib, '.2f'):>8}" if cuda else "")
                  + f" {fmt(chk and chk[0], '.1e'):>9} {fmt(chk and chk[1], '.1e'):>8}"
                  f" {fmt(chk and chk[2], '.0e'):>6}  {ok_s:<4}  {vs}")
            if r.repeat_median_ms is not None:
                print(f"{'  (timed again at the end)':<38} {r.repeat_median_ms:>10.2f}")


def print_targets(results: list[Result], n_params: int, bw_gbs: float, cuda: bool,
                  device_name: str) -> None:
    by = {r.key: r for r in results if not r.error and r.times_ms}
    where = ("" if cuda and "H100" in device_name else
             f"  [targets are stated for an H100; this is {device_name}: informational]")
    if BACKEND["name"] != "inductor":
        where += (f"  [compiled with backend={BACKEND['name']}: the compiled rows are not "
                  "Inductor's]")
    print()
    print("Targets" + where)

    def verdict(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    comp, fused, eager = (by.get("adamw.opttx_compiled"), by.get("adamw.torch_fused"),
                          by.get("adamw.opttx_eager"))
    if comp:
        pct = roofline_pct(comp, n_params, bw_gbs)
        print(f"  compiled opttx adamw at {pct:.1f}% of the copy roofline "
              f"(target >= {TARGET_ROOFLINE * 100:.0f}%): {verdict(pct >= TARGET_ROOFLINE * 100)}")
    else:
        print("  compiled opttx adamw vs roofline: not measured")
    for r, limit, what in ((comp, TARGET_VS_FUSED, "compiled opttx adamw"),
                           (eager, TARGET_EAGER_VS_FUSED, "eager opttx adamw")):
        if r and fused:
            ratio = r.median / fused.median
            print(f"  {what} / torch fused AdamW = {r.median:.2f} / {fused.median:.2f} ms = "
                  f"{ratio:.2f}x (target <= {limit}x): {verdict(ratio <= limit)}")
        else:
            print(f"  {what} vs torch fused AdamW: not measured")
    for r in results:
        if r.compiled and r.key.split(".", 1)[1].startswith("opttx") and r.compile_s is not None:
            ok = r.compile_s <= TARGET_COMPILE_S
            print(f"  compile time of {r.label}: {r.compile_s:.1f} s "
                  f"(target <= {TARGET_COMPILE_S:.0f} s): {verdict(ok)}")
    cg = next((r for r in results if r.key == "adamw.opttx_compiled_cg"), None)
    if cg is None:
        print("  CUDA graphs (reduce-overhead): not run")
    elif cg.error:
        print(f"  CUDA graphs (reduce-overhead): FAILED to run: {cg.error}")
    else:
        same = cg.check_also
        same_s = ("not compared (default compiled variant not run)" if same is None else
                  "bitwise equal to the default compiled one" if same[0] == 0 else
                  f"max|dp| {same[0]:.1e} from the default compiled one "
                  f"({'within' if same[1] <= same[2] else 'OUTSIDE'} fp32 tolerance)")
        if cuda:
            used = cg.cudagraph_skips == 0
            print(f"  CUDA graphs (reduce-overhead): runs, {same_s}; cudagraph skips "
                  f"{cg.cudagraph_skips} ({'graphs used' if used else 'graphs NOT used'}): "
                  f"{verdict(used and cg.ok is True)}")
        else:
            print(f"  CUDA graphs (reduce-overhead): runs, {same_s}; on CPU Inductor skips "
                  f"CUDA graphs ({cg.cudagraph_skips} skip(s) counted): n/a here")
    mixed = [by[k] for k in ("bf16.opttx_compiled", "bf16.opttx_flatten", "bf16.opttx_stacked",
                             "bf16.opttx_eager") if k in by]
    for r in mixed:
        print(f"  mixed precision, {r.label}: state {r.state_bytes_per_param:.2f} B/param "
              f"(fp32 m and v), step {r.median:.2f} ms, "
              f"{roofline_pct(r, n_params, bw_gbs):.1f}% of its {BYTES_ADAMW_MIXED} B/param "
              f"roofline" + (f", {r.median / by['adamw.opttx_compiled'].median:.2f}x the fp32 "
                             f"compiled step" if "adamw.opttx_compiled" in by else ""))


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help="default: 1b on cuda, small on cpu (quick with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="--size quick --steps 3 --warmup 0 --check-steps 2 --backend "
                             "aot_eager --threads 1 (a smoke run of every path of the script)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per variant (default: 50 cuda, 10 cpu)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps after the check steps (default: 5 cuda, 1 cpu)")
    parser.add_argument("--check-steps", type=int, default=None,
                        help="steps before the correctness check, the compile included "
                             "(default 5: CUDA graph trees record in the 2nd-3rd call, so "
                             "the check sees replays)")
    parser.add_argument("--only", default=None,
                        help="comma-separated groups (adamw,lion,adafactor,bf16), keys or globs")
    parser.add_argument("--sequential", dest="together", action="store_false", default=None,
                        help="one variant alive at a time (the default on cuda)")
    parser.add_argument("--together", dest="together", action="store_true",
                        help="a group's variants alive together, timed round-robin "
                             "(the default on cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend of the compiled variants (default inductor; "
                             "--quick: aot_eager, which traces the same fullgraph step through "
                             "Dynamo and AOTAutograd's functionalization but skips Inductor's "
                             "code generation, so the smoke run takes seconds, not minutes)")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="CPU: before each group wait up to S s for other processes to "
                             "leave the cores idle")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use the usual Inductor cache dir (compile times then vary)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all results here")
    a = parser.parse_args()

    t_start = time.perf_counter()
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if a.quick:
        a.size = a.size or "quick"
    a.size = a.size or ("1b" if cuda else "small")
    a.steps = a.steps or (3 if a.quick else 50 if cuda else 10)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.quick else 5 if cuda else 1)
    a.check_steps = max(1, a.check_steps or (2 if a.quick else 5))
    if a.together is None:
        a.together = not cuda
    a.backend = a.backend or ("aot_eager" if a.quick else "inductor")
    BACKEND["name"] = a.backend
    if a.quick and a.threads is None:
        a.threads = 1   # tiny tensors: no OpenMP barriers on shared cores
    if a.threads:
        torch.set_num_threads(a.threads)

    init32, grads32 = make_problem(a.size, device)
    n_params = sum(p.numel() for p in init32)
    clock = Clock(device)
    if cuda:
        props = torch.cuda.get_device_properties(device)
        device_name = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
                       f"{props.multi_processor_count} SMs, CUDA {torch.version.cuda}")
    else:
        device_name = f"CPU {cpu_model()} ({os.cpu_count()} cores visible, " \
                      f"{torch.get_num_threads()} threads)"
    cfg = SIZES[a.size]
    print(f"opttx gpu_step: size={a.size} {cfg}: {n_params:,} parameters in {len(init32)} "
          f"tensors ({n_params * 4 / 2**30:.2f} GiB per fp32 copy)")
    print(f"device: {device_name}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, opttx "
          f"{opttx.__version__} at {git_state()}")
    print(f"timing: {a.check_steps} check steps (the compile in the first), {a.warmup} warm-up "
          f"steps, then {a.steps} timed steps per variant; "
          + ("CUDA events around each step after a synchronize; variants one at a time"
             if cuda else "time.perf_counter around each step; "
             + ("a group's variants timed round-robin" if a.together else "one at a time"))
          + "; median and min")
    print(f"compiled variants: torch.compile backend={a.backend}"
          + ("" if a.backend == "inductor" else " (NOT Inductor: their times and compile times "
             "say nothing about opttx's compiled speed; mode='reduce-overhead' is Inductor's, "
             "so the CUDA graph variant is only traced)")
          + f"; Inductor cache: {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default (warm)')}")
    if not cuda:
        print("load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))

    n_copy = max(n_params, 2**25)   # at least 128 MiB: past the caches even at a small size
    bw_before = copy_bandwidth(n_copy, device, clock)
    print(f"copy bandwidth (before): {bw_before[0]:.1f} GB/s "
          f"({n_copy * 4 / 1e9:.3f} GB copied in {bw_before[1]:.3f} ms, read+write counted)",
          flush=True)

    specs = select(a.only)
    results: list[Result] = []
    for name, (_, dtype_name, group) in GROUPS.items():
        chosen = [s for s in group if s in specs]
        if not chosen:
            continue
        print(f"[{name}]", flush=True)
        if dtype_name == "float32":
            init, grads = init32, grads32
        else:
            dt = getattr(torch, dtype_name)
            init, grads = [p.to(dt) for p in init32], [g.to(dt) for g in grads32]
        if a.wait_idle and not cuda:
            wait_idle(a.wait_idle)
        results += run_group(name, chosen, init, grads, device, clock, a)
        if not a.together and name == "adamw":   # sequential: show the run-to-run spread
            fused = next((r for r in results if r.key == "adamw.torch_fused" and r.times_ms),
                         None)
            if fused is not None:
                spec = next(s for s in group if s.key == "adamw.torch_fused")
                fused.repeat_median_ms = repeat_timing(spec, init, grads, clock, a)
                _free(device)
        del init, grads
        _free(device)

    bw_after = copy_bandwidth(n_copy, device, clock)
    bw = max(bw_before[0], bw_after[0])
    print(f"copy bandwidth (after): {bw_after[0]:.1f} GB/s; the roofline uses {bw:.1f} GB/s")

    print_table(results, n_params, bw, cuda)
    print_targets(results, n_params, bw, cuda, device_name)
    if not cuda:
        print("load average at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    bad = [r.key for r in results if r.ok is False]
    print(f"\nCorrectness: after {a.check_steps} steps from the same init with the same fixed "
          f"gradients, each variant's parameters vs its group's reference ('vs'). fp32: err = "
          f"max|dp| / max|p_ref|, tol = {TOLERANCE:g} * (1 + k/5). bf16: err = max over "
          f"elements of |dp| / (ulp_bf16(max |p0|, |p|, |p_ref|) + lr/128) / k, "
          f"tol = 1. "
          f"Copy roofline: bytes/param (B/p) * {n_params:,} / {bw:.1f} GB/s (copy bandwidth "
          f"= bytes read + written per second). " + ("All variants agree." if not bad
                                     else f"MISMATCH: {', '.join(bad)}"))
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size": a.size, "n_params": n_params, "device": device_name,
                       "torch": torch.__version__, "copy_gbs": [bw_before[0], bw_after[0]],
                       "args": vars(a),
                       "results": [dict(asdict(r), median_ms=r.median if r.times_ms else None,
                                        roofline_pct=roofline_pct(r, n_params, bw))
                                   for r in results]}, f, indent=1, default=str)
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
