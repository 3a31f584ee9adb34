"""Optimizer step time on CPU: torch.optim vs opttx (eager and compiled), side by side.

Only the optimizer step is timed. Gradients are fixed random tensors set once (no model, no
backward), on a GPT-like set of parameter shapes (~59M parameters in 196 tensors at the
default size). Every variant starts from the same parameters and gradients and runs the same
number of steps with the same hyperparameters, and its parameters are checked against a
reference afterwards, so the table cannot silently time a wrong computation.

Groups of variants (``--only`` takes group names, ``group.variant`` keys or globs):

  adamw  torch AdamW foreach=False / foreach=True / fused=True, torch.compile(opt.step) of
         the foreach AdamW, opttx.Optimizer(params, opttx.adamw(...)) (eager), and the
         functional opttx step under torch.compile(fullgraph=True) (in place).
  sgd    torch SGD(momentum=0.9) for-loop / foreach / fused vs opttx.sgd(lr, momentum=0.9).
  lion   hand-written torch Lion (for-loop and foreach; torch.optim has no Lion) vs opttx.lion.
  adafactor  torch.optim.Adafactor (foreach=False / True) and transformers' Adafactor
         (relative_step=True) vs opttx.adafactor configured to equal each (eager, compiled).
  came   came_pytorch.CAME vs opttx.came (eager, compiled).
  muon   torch.optim.Muon vs opttx.muon with torch's numbers (eager, compiled) on the hidden
         matrices, and heavyball's Muon (its kernels uncompiled, and torch.compile'd as it
         ships), checked against each other.
  lamb   pytorch_optimizer.Lamb (for-loop / foreach) vs opttx.lamb (eager, compiled); see
         LAMB_NOTE for how the two are configured to compute the same update.

Examples:
  python benchmarks/step_time.py                      # default size, every variant
  python benchmarks/step_time.py --quick              # tiny smoke run
  python benchmarks/step_time.py --only adamw --steps 20
  python benchmarks/step_time.py --only adafactor,came,lamb
  python benchmarks/step_time.py --only 'adamw.torch_f*,adamw.opttx_*'
  python benchmarks/step_time.py --profile adamw.opttx_eager   # op table of one eager step

Compile time is measured on a fresh, empty Inductor cache (a temporary TORCHINDUCTOR_CACHE_DIR)
unless ``--warm-cache`` is given, so it is the cold compile cost of each compiled variant.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_model, cpu_times, early_cache_dir, fmt, git_state, other_load  # noqa: E402
from _common import wait_idle as _wait_idle  # noqa: E402

early_cache_dir("opttx_step_time_")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import opttx  # noqa: E402

LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WD = 0.01
SGD_LR = 1e-2
SGD_MOMENTUM = 0.9
LION_LR = 1e-4
LION_BETAS = (0.9, 0.99)
LION_WD = 0.1
ADAFACTOR_LR = 1e-2        # torch.optim.Adafactor's lr = the cap of its relative step size
CAME_LR = 1e-3
CAME_WD = 0.01
LAMB_LR = 1e-3
LAMB_BETAS = (0.9, 0.999)
LAMB_EPS = 1e-6
LAMB_WD = 0.01
LAMB_PHI_MAX = 10.0        # pytorch_optimizer.Lamb.clamp: the weight norm is clipped to 10

LAMB_NOTE = (
    "pytorch_optimizer.Lamb(lr, betas, eps, weight_decay, weight_decouple=False) is the paper's "
    "LAMB (r = m/(sqrt(v)+eps) + wd*x, no moment bias correction, trust ratio "
    "min(|x|, 10)/(|r| + eps), ratio 1 if a norm is 0) with step size lr/(1 - b1^t); opttx: "
    "lamb(schedule lr/(1 - b1^t), b1, b2, eps, weight_decay=wd, bias_correction=False, "
    "phi_bounds=(0, 10)). Remaining difference: opttx.lamb adds no eps to |r| in the ratio "
    "(relative effect <= eps/|r| < 1e-7 here, below fp32 resolution). Lamb's default "
    "weight_decouple=True (p *= 1 - lr*wd before the ratio, decay outside the ratio) has no "
    "opttx.lamb equivalent.")

# Agreement with the reference, as max |a - b| / max |b| over all tensors: 1e-6 after one step;
# after T steps 1e-6 * (1 + T / 5), because fp32 rounding differences of two correct
# implementations (torch multiplies p by float32(1 - lr*wd) each step, opttx adds -lr*wd*p)
# accumulate by about one ulp of |p| per step. A wrong update would differ by ~lr (1e-3).
TOLERANCE = 1e-6


def tolerance(total_steps: int) -> float:
    return TOLERANCE * (1 + total_steps / 5)

# ---------------------------------------------------------------------------------------------
# parameter shapes
# ---------------------------------------------------------------------------------------------

SIZES = {
    # vocab, context (learned positions), width, layers
    "quick": dict(vocab=1000, ctx=64, d=64, layers=2),
    "small": dict(vocab=4000, ctx=256, d=256, layers=4),
    "default": dict(vocab=16000, ctx=1024, d=512, layers=16),
}


def gpt_shapes(vocab: int, ctx: int, d: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2-like parameter shapes (untied embeddings not included: the head is tied)."""
    shapes = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(layers):
        shapes += [
            (f"h{i}.ln1.weight", (d,)), (f"h{i}.ln1.bias", (d,)),
            (f"h{i}.attn.qkv.weight", (d, 3 * d)), (f"h{i}.attn.qkv.bias", (3 * d,)),
            (f"h{i}.attn.proj.weight", (d, d)), (f"h{i}.attn.proj.bias", (d,)),
            (f"h{i}.ln2.weight", (d,)), (f"h{i}.ln2.bias", (d,)),
            (f"h{i}.mlp.fc.weight", (d, 4 * d)), (f"h{i}.mlp.fc.bias", (4 * d,)),
            (f"h{i}.mlp.proj.weight", (4 * d, d)), (f"h{i}.mlp.proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def make_problem(size: str, seed: int = 0) -> tuple[list[str], list[torch.Tensor],
                                                     list[torch.Tensor]]:
    """Initial parameters and fixed gradients (float32, CPU)."""
    gen = torch.Generator().manual_seed(seed)
    names, params, grads = [], [], []
    for name, shape in gpt_shapes(**SIZES[size]):
        if name.endswith(".bias"):
            p = torch.randn(shape, generator=gen) * 0.01
        elif "ln" in name:
            p = 1 + torch.randn(shape, generator=gen) * 0.01
        else:
            p = torch.randn(shape, generator=gen) * 0.02
        names.append(name)
        params.append(p)
        grads.append(torch.randn(shape, generator=gen) * 0.01)
    return names, params, grads


# ---------------------------------------------------------------------------------------------
# variants
# ---------------------------------------------------------------------------------------------


class Variant:
    """One way of running the step: own copy of the params and state, shared fixed grads."""

    compiled = False

    def __init__(self, init: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.init = init
        self.grads = grads

    def step(self) -> None:
        raise NotImplementedError

    def params(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the initial params and a fresh state, in place (keeps compiled guards)."""
        raise NotImplementedError


class TorchOptim(Variant):
    def __init__(self, init, grads, make: Callable[[list], torch.optim.Optimizer],
                 compile_step: bool = False) -> None:
        super().__init__(init, grads)
        self._params = [torch.nn.Parameter(p.clone()) for p in init]
        for p, g in zip(self._params, grads):
            p.grad = g
        self.opt = make(self._params)
        self.compiled = compile_step
        if compile_step:
            opt = self.opt

            @torch.compile(fullgraph=False)
            def compiled_step() -> None:
                opt.step()

            self._step = compiled_step
        else:
            self._step = self.opt.step

    def step(self) -> None:
        self._step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params]

    @torch.no_grad()
    def reset(self) -> None:
        for p, p0 in zip(self._params, self.init):
            p.copy_(p0)
        for state in self.opt.state.values():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()  # step, exp_avg, exp_avg_sq, momentum_buffer: all start at 0
                elif isinstance(value, (int, float)):
                    state[name] = type(value)(0)  # transformers/came_pytorch: step, RMS
        for group in self.opt.param_groups:
            if isinstance(group.get("step"), int):
                group["step"] = 0                 # pytorch_optimizer counts steps per group


class HeavyballOptim(TorchOptim):
    """A heavyball optimizer: with ``eager``, its torch.compile'd kernels run uncompiled
    (``heavyball.utils.compile_mode = None`` around each step); its nested per-parameter state
    is reset by clearing it (heavyball re-creates it, zeroed, at the next step). heavyball sets
    ``p.grad = None`` in its step: the fixed gradients are put back before each step."""

    def __init__(self, init, grads, make: Callable[[list], torch.optim.Optimizer],
                 eager: bool) -> None:
        super().__init__(init, grads, make)
        self.compiled = not eager
        self.eager = eager

    def step(self) -> None:
        import heavyball
        mode = heavyball.utils.compile_mode
        if self.eager:
            heavyball.utils.compile_mode = None
        for p, g in zip(self._params, self.grads):
            p.grad = g
        try:
            self.opt.step()
        finally:
            heavyball.utils.compile_mode = mode

    @torch.no_grad()
    def reset(self) -> None:
        for p, p0 in zip(self._params, self.init):
            p.copy_(p0)
        self.opt.state.clear()
        for group in self.opt.param_groups:
            if isinstance(group.get("step_count"), torch.Tensor):
                group["step_count"].zero_()


class OpttxEager(Variant):
    """``opttx.Optimizer(params, tx)`` with ``opt.step()``, grads in ``p.grad``."""

    def __init__(self, init, grads, tx: opttx.GradientTransformation) -> None:
        super().__init__(init, grads)
        self.tx = tx
        self._params = [torch.nn.Parameter(p.clone()) for p in init]
        for p, g in zip(self._params, grads):
            p.grad = g
        self.opt = opttx.Optimizer(self._params, tx)

    def step(self) -> None:
        self.opt.step()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self._params]

    @torch.no_grad()
    def reset(self) -> None:
        for p, p0 in zip(self._params, self.init):
            p.copy_(p0)
        params = self.params()
        for state in self.opt.tx_states:
            opttx.tree_copy_(state, self.tx.init(params))


class OpttxCompiled(Variant):
    """The functional step ``tx.update`` + ``apply_updates_`` + ``tree_copy_`` under
    ``torch.compile(fullgraph=True)``; params, grads and state are plain tensors."""

    compiled = True

    def __init__(self, init, grads, tx: opttx.GradientTransformation) -> None:
        super().__init__(init, grads)
        self.tx = tx
        self._params = [p.clone() for p in init]
        self.state = tx.init(self._params)

        @torch.compile(fullgraph=True)
        def step(params, grads, state):
            updates, new_state = tx.update(grads, state, params)
            opttx.apply_updates_(params, updates)
            opttx.tree_copy_(state, new_state)

        self._step = step

    def step(self) -> None:
        self._step(self._params, self.grads, self.state)

    def params(self) -> list[torch.Tensor]:
        return self._params

    @torch.no_grad()
    def reset(self) -> None:
        for p, p0 in zip(self._params, self.init):
            p.copy_(p0)
        opttx.tree_copy_(self.state, self.tx.init(self._params))


class LionForLoop(Variant):
    """Lion written per tensor with in-place ops (as lion-pytorch); torch.optim has none."""

    def __init__(self, init, grads, foreach: bool) -> None:
        super().__init__(init, grads)
        self._params = [p.clone() for p in init]
        self.mu = [torch.zeros_like(p) for p in init]
        self.foreach = foreach

    @torch.no_grad()
    def step(self) -> None:
        lr, (b1, b2), wd = LION_LR, LION_BETAS, LION_WD
        if self.foreach:
            torch._foreach_mul_(self._params, 1 - lr * wd)
            c = torch._foreach_lerp(self.mu, self.grads, 1 - b1)
            torch._foreach_sign_(c)
            torch._foreach_add_(self._params, c, alpha=-lr)
            torch._foreach_lerp_(self.mu, self.grads, 1 - b2)
            return
        for p, g, m in zip(self._params, self.grads, self.mu):
            p.mul_(1 - lr * wd)
            p.add_(m.lerp(g, 1 - b1).sign_(), alpha=-lr)
            m.lerp_(g, 1 - b2)

    def params(self) -> list[torch.Tensor]:
        return self._params

    @torch.no_grad()
    def reset(self) -> None:
        for p, p0, m in zip(self._params, self.init, self.mu):
            p.copy_(p0)
            m.zero_()


@dataclass
class Spec:
    key: str                      # "group.variant"
    label: str
    build: Callable[[list, list], Variant]
    baseline: str = ""            # "fused" or "foreach": the group's ratio baselines
    reference: bool = False       # a numerical reference of the group (torch for-loop, ...)
    ref: str = ""                 # key of the reference this variant must equal (default: the
                                  # group's first reference)
    tolerance: float = TOLERANCE  # largest relative difference from it after one step


def ref_key(spec: Spec, group: list[Spec]) -> str:
    """The key of the reference ``spec`` is checked against (its own key for a reference)."""
    if spec.reference:
        return spec.key
    return spec.ref or next(s.key for s in group if s.reference)


def _adamw_torch(**kw) -> Callable[[list], torch.optim.Optimizer]:
    return lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)


def _sgd_torch(**kw) -> Callable[[list], torch.optim.Optimizer]:
    return lambda ps: torch.optim.SGD(ps, lr=SGD_LR, momentum=SGD_MOMENTUM, **kw)


def opttx_adamw() -> opttx.GradientTransformation:
    return opttx.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def opttx_sgd() -> opttx.GradientTransformation:
    return opttx.sgd(SGD_LR, momentum=SGD_MOMENTUM)


def opttx_lion() -> opttx.GradientTransformation:
    return opttx.lion(LION_LR, b1=LION_BETAS[0], b2=LION_BETAS[1], weight_decay=LION_WD)


MUON_LR, MUON_MOMENTUM, MUON_WD = 2e-2, 0.95, 0.1


def _hidden_matrices(init: list, grads: list) -> tuple[list, list]:
    """The 2-D tensors but the embeddings (the first two of `gpt_shapes`): what Muon is for
    (torch.optim.Muon takes 2-D parameters only)."""
    keep = [i for i, p in enumerate(init) if p.ndim == 2 and i >= 2]
    return [init[i] for i in keep], [grads[i] for i in keep]


def _muon_torch(ps: list) -> torch.optim.Optimizer:
    return torch.optim.Muon(ps, lr=MUON_LR, momentum=MUON_MOMENTUM, weight_decay=MUON_WD)


def _muon_heavyball(ps: list) -> torch.optim.Optimizer:
    """heavyball 3.2.1's Muon: Nesterov EMA of the gradient (debiased), its own Newton-Schulz
    (``heavyball.utils.zeroth_power_mode``) and shape scaling, decoupled decay lr·wd; its
    ``betas[1]`` is unused by Muon."""
    import heavyball
    return heavyball.Muon(ps, lr=MUON_LR, betas=(MUON_MOMENTUM, 0.99), weight_decay=MUON_WD)


def opttx_muon() -> opttx.GradientTransformation:
    """torch.optim.Muon's numbers: no bias correction of the momentum, bfloat16
    Newton-Schulz, eps 1e-7, decoupled decay lr·wd, torch's "original" shape scaling."""
    return opttx.muon(MUON_LR, beta=MUON_MOMENTUM, weight_decay=MUON_WD, eps=1e-7,
                      bias_correction=False, ns_dtype=torch.bfloat16)


def _adafactor_torch(**kw) -> Callable[[list], torch.optim.Optimizer]:
    return lambda ps: torch.optim.Adafactor(ps, lr=ADAFACTOR_LR, **kw)


def _adafactor_hf(ps: list) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor
    return Adafactor(ps, lr=None, relative_step=True, scale_parameter=True, warmup_init=False)


def opttx_adafactor_torch() -> opttx.GradientTransformation:
    """Equals torch.optim.Adafactor(lr=ADAFACTOR_LR) (tests/test_factored.py)."""
    return opttx.adafactor(opttx.relative_step_schedule(ADAFACTOR_LR), min_dim_size_to_factor=1,
                           eps=0.0, eps_clamp=torch.finfo(torch.float32).eps,
                           factor_axes="last")


def opttx_adafactor_hf() -> opttx.GradientTransformation:
    """Equals transformers' Adafactor(lr=None, relative_step=True, scale_parameter=True)."""
    return opttx.adafactor(relative_step=True, min_dim_size_to_factor=1, factor_axes="last",
                           weight_decay_scaled_by_lr=True)


def _came_ref(ps: list) -> torch.optim.Optimizer:
    from came_pytorch import CAME
    return CAME(ps, lr=CAME_LR, weight_decay=CAME_WD)


def opttx_came() -> opttx.GradientTransformation:
    return opttx.came(CAME_LR, weight_decay=CAME_WD)


def _lamb_ref(**kw) -> Callable[[list], torch.optim.Optimizer]:
    def make(ps: list) -> torch.optim.Optimizer:
        from pytorch_optimizer import Lamb
        return Lamb(ps, lr=LAMB_LR, betas=LAMB_BETAS, eps=LAMB_EPS, weight_decay=LAMB_WD,
                    weight_decouple=False, **kw)
    return make


def lamb_step_size(count: torch.Tensor) -> torch.Tensor:
    """pytorch_optimizer.Lamb's step size lr / (1 - b1^t) (its default adam_debias=False
    divides lr by the first moment's bias correction), t = count + 1."""
    t = (count + 1).to(torch.float64)
    return LAMB_LR / (1 - LAMB_BETAS[0] ** t)


def opttx_lamb() -> opttx.GradientTransformation:
    return opttx.lamb(lamb_step_size, b1=LAMB_BETAS[0], b2=LAMB_BETAS[1], eps=LAMB_EPS,
                      weight_decay=LAMB_WD, bias_correction=False, phi_bounds=(0.0, LAMB_PHI_MAX))


GROUPS: dict[str, tuple[str, list[Spec]]] = {
    "adamw": (f"AdamW  lr={LR} betas={BETAS} eps={EPS} weight_decay={WD}", [
        Spec("adamw.torch_forloop", "torch AdamW foreach=False",
             lambda i, g: TorchOptim(i, g, _adamw_torch(foreach=False)), reference=True),
        Spec("adamw.torch_foreach", "torch AdamW foreach=True",
             lambda i, g: TorchOptim(i, g, _adamw_torch(foreach=True)), baseline="foreach"),
        Spec("adamw.torch_fused", "torch AdamW fused=True",
             lambda i, g: TorchOptim(i, g, _adamw_torch(fused=True)), baseline="fused"),
        Spec("adamw.torch_compiled", "torch.compile(AdamW foreach .step)",
             lambda i, g: TorchOptim(i, g, _adamw_torch(foreach=True), compile_step=True)),
        Spec("adamw.opttx_eager", "opttx.Optimizer(adamw) eager",
             lambda i, g: OpttxEager(i, g, opttx_adamw())),
        Spec("adamw.opttx_compiled", "opttx adamw compiled step",
             lambda i, g: OpttxCompiled(i, g, opttx_adamw())),
    ]),
    "sgd": (f"SGD  lr={SGD_LR} momentum={SGD_MOMENTUM}", [
        Spec("sgd.torch_forloop", "torch SGD foreach=False",
             lambda i, g: TorchOptim(i, g, _sgd_torch(foreach=False)), reference=True),
        Spec("sgd.torch_foreach", "torch SGD foreach=True",
             lambda i, g: TorchOptim(i, g, _sgd_torch(foreach=True)), baseline="foreach"),
        Spec("sgd.torch_fused", "torch SGD fused=True",
             lambda i, g: TorchOptim(i, g, _sgd_torch(fused=True)), baseline="fused"),
        Spec("sgd.opttx_eager", "opttx.Optimizer(sgd) eager",
             lambda i, g: OpttxEager(i, g, opttx_sgd())),
        Spec("sgd.opttx_compiled", "opttx sgd compiled step",
             lambda i, g: OpttxCompiled(i, g, opttx_sgd())),
    ]),
    "lion": (f"Lion  lr={LION_LR} betas={LION_BETAS} weight_decay={LION_WD}  "
             "(torch.optim has no Lion: hand-written torch baselines)", [
        Spec("lion.torch_forloop", "hand-written Lion for-loop",
             lambda i, g: LionForLoop(i, g, foreach=False), reference=True),
        Spec("lion.torch_foreach", "hand-written Lion foreach",
             lambda i, g: LionForLoop(i, g, foreach=True), baseline="foreach"),
        Spec("lion.opttx_eager", "opttx.Optimizer(lion) eager",
             lambda i, g: OpttxEager(i, g, opttx_lion())),
        Spec("lion.opttx_compiled", "opttx lion compiled step",
             lambda i, g: OpttxCompiled(i, g, opttx_lion())),
    ]),
    "muon": (f"Muon  lr={MUON_LR} momentum={MUON_MOMENTUM} weight_decay={MUON_WD}, on the 2-D "
             "hidden matrices only (torch.optim.Muon takes 2-D parameters; embeddings left "
             "out); opttx.muon(bias_correction=False, ns_dtype=bfloat16, eps=1e-7) is "
             "torch.optim.Muon's numbers", [
        Spec("muon.torch", "torch.optim.Muon",
             lambda i, g: TorchOptim(*_hidden_matrices(i, g), _muon_torch), reference=True,
             baseline="foreach"),
        Spec("muon.opttx_eager", "opttx.Optimizer(muon) eager",
             lambda i, g: OpttxEager(*_hidden_matrices(i, g), opttx_muon())),
        # Inductor keeps float32 intermediates inside its fused bfloat16 Newton-Schulz
        # kernels; five steps of the iteration turn that rounding into per-singular-value
        # differences within the iteration's band ([0.68, 1.21]): equal to the update's
        # precision, not to float32 rounding
        Spec("muon.opttx_compiled", "opttx muon compiled step (bf16 NS)",
             lambda i, g: OpttxCompiled(*_hidden_matrices(i, g), opttx_muon()),
             tolerance=1e-2),
        # heavyball computes its own numbers (debiased momentum, its Newton-Schulz and
        # scaling): its rows are checked against each other, not against torch
        Spec("muon.heavyball_eager", "heavyball Muon (kernels uncompiled)",
             lambda i, g: HeavyballOptim(*_hidden_matrices(i, g), _muon_heavyball, eager=True),
             reference=True),
        Spec("muon.heavyball", "heavyball Muon (its compiled kernels)",
             lambda i, g: HeavyballOptim(*_hidden_matrices(i, g), _muon_heavyball, eager=False),
             ref="muon.heavyball_eager", tolerance=1e-2),
    ]),
    "adafactor": (f"Adafactor  relative step min({ADAFACTOR_LR}, 1/sqrt(t)) x RMS(p), factored "
                  "over the last two dims of every >=2-D tensor, update clipping d=1, no momentum "
                  "or weight decay. opttx 'torch cfg' rows equal torch.optim.Adafactor "
                  "(vs torch_forloop), 'HF cfg' rows equal transformers' Adafactor (vs hf)", [
        Spec("adafactor.torch_forloop", "torch Adafactor foreach=False",
             lambda i, g: TorchOptim(i, g, _adafactor_torch(foreach=False)), reference=True),
        Spec("adafactor.torch_foreach", "torch Adafactor foreach=True",
             lambda i, g: TorchOptim(i, g, _adafactor_torch(foreach=True)), baseline="foreach"),
        Spec("adafactor.hf", "transformers Adafactor (relative_step)",
             lambda i, g: TorchOptim(i, g, _adafactor_hf), reference=True),
        Spec("adafactor.opttx_torch_eager", "opttx adafactor torch cfg eager",
             lambda i, g: OpttxEager(i, g, opttx_adafactor_torch()),
             ref="adafactor.torch_forloop"),
        Spec("adafactor.opttx_torch_compiled", "opttx adafactor torch cfg compiled",
             lambda i, g: OpttxCompiled(i, g, opttx_adafactor_torch()),
             ref="adafactor.torch_forloop"),
        Spec("adafactor.opttx_hf_eager", "opttx adafactor HF cfg eager",
             lambda i, g: OpttxEager(i, g, opttx_adafactor_hf()), ref="adafactor.hf"),
        Spec("adafactor.opttx_hf_compiled", "opttx adafactor HF cfg compiled",
             lambda i, g: OpttxCompiled(i, g, opttx_adafactor_hf()), ref="adafactor.hf"),
    ]),
    "came": (f"CAME  lr={CAME_LR} weight_decay={CAME_WD} (came_pytorch defaults otherwise; "
             "factored over the last two dims)", [
        Spec("came.came_pytorch", "came_pytorch CAME",
             lambda i, g: TorchOptim(i, g, _came_ref), reference=True),
        Spec("came.opttx_eager", "opttx.Optimizer(came) eager",
             lambda i, g: OpttxEager(i, g, opttx_came())),
        Spec("came.opttx_compiled", "opttx came compiled step",
             lambda i, g: OpttxCompiled(i, g, opttx_came())),
    ]),
    "lamb": (f"LAMB  lr={LAMB_LR} betas={LAMB_BETAS} eps={LAMB_EPS} weight_decay={LAMB_WD}. "
             + LAMB_NOTE, [
        Spec("lamb.torch_forloop", "pytorch_optimizer Lamb foreach=False",
             lambda i, g: TorchOptim(i, g, _lamb_ref(foreach=False)), reference=True),
        Spec("lamb.torch_foreach", "pytorch_optimizer Lamb foreach=True",
             lambda i, g: TorchOptim(i, g, _lamb_ref(foreach=True)), baseline="foreach"),
        Spec("lamb.opttx_eager", "opttx.Optimizer(lamb) eager",
             lambda i, g: OpttxEager(i, g, opttx_lamb())),
        Spec("lamb.opttx_compiled", "opttx lamb compiled step",
             lambda i, g: OpttxCompiled(i, g, opttx_lamb())),
    ]),
}

# The targets: (variant, baseline, largest allowed time ratio, description).
FACTORED = 1 / 3   # "compiled opttx >= 3x faster than each reference"
TARGETS: dict[str, list[tuple[str, str, float, str]]] = {
    "adamw": [("adamw.opttx_compiled", "adamw.torch_fused", 1.0,
               "compiled opttx adamw vs torch fused AdamW"),
              ("adamw.opttx_eager", "adamw.torch_foreach", 1.3,
               "eager opttx adamw vs torch foreach AdamW")],
    "adafactor": [("adafactor.opttx_torch_compiled", "adafactor.torch_forloop", FACTORED,
                   "compiled opttx (torch cfg) vs torch Adafactor foreach=False"),
                  ("adafactor.opttx_torch_compiled", "adafactor.torch_foreach", FACTORED,
                   "compiled opttx (torch cfg) vs torch Adafactor foreach=True"),
                  ("adafactor.opttx_hf_compiled", "adafactor.hf", FACTORED,
                   "compiled opttx (HF cfg) vs transformers Adafactor")],
    "muon": [("muon.opttx_compiled", "muon.torch", 1.0,
              "compiled opttx muon vs torch.optim.Muon")],
    "came": [("came.opttx_compiled", "came.came_pytorch", FACTORED,
              "compiled opttx came vs came_pytorch CAME")],
    "lamb": [("lamb.opttx_compiled", "lamb.torch_forloop", FACTORED,
              "compiled opttx lamb vs pytorch_optimizer Lamb foreach=False"),
             ("lamb.opttx_compiled", "lamb.torch_foreach", FACTORED,
              "compiled opttx lamb vs pytorch_optimizer Lamb foreach=True")],
}


def select(only: str | None) -> list[Spec]:
    specs = [s for _, (_, group) in GROUPS.items() for s in group]
    if not only:
        return specs
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [s for s in specs
              if any(fnmatch.fnmatch(s.key, p) or s.key.split(".")[0] == p for p in patterns)]
    if not chosen:
        raise SystemExit(f"--only {only!r} matches none of: {', '.join(s.key for s in specs)}")
    return chosen


# ---------------------------------------------------------------------------------------------
# running and checking
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    spec: Spec
    times_ms: list[float] = field(default_factory=list)
    first_call_s: float = 0.0
    compile_s: float | None = None
    err_final: tuple[float, float] | None = None   # (max abs diff, relative) after all steps
    err_one: tuple[float, float] | None = None     # same, one step from a reset
    total_steps: int = 0
    checked: bool = False
    background: float = 0.0  # cores used by other processes while the group was timed
    faults: list[int] = field(default_factory=list)  # minor page faults per timed step

    @property
    def fault_mib(self) -> float:
        """Fresh memory touched per step (median minor page faults x 4 KiB), in MiB."""
        return statistics.median(self.faults) * resource.getpagesize() / 2**20

    @property
    def ok(self) -> bool:
        scale = self.spec.tolerance / TOLERANCE
        return ((self.err_one is None or self.err_one[1] <= self.spec.tolerance) and
                (self.err_final is None
                 or self.err_final[1] <= scale * tolerance(self.total_steps)))
    error: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min(self) -> float:
        return min(self.times_ms)


def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / max |b|) over all tensors."""
    max_abs = max(float((x - y).abs().max()) for x, y in zip(a, b))
    scale = max(float(y.abs().max()) for y in b)
    return max_abs, max_abs / scale


def snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def run_group(chosen: list[Spec], group: list[Spec], init, grads, warmup: int, steps: int,
              check: bool, wait_idle_s: float = 0.0) -> list[Result]:
    """Build the chosen variants of one group, warm them up (compiling the compiled ones),
    then time them round-robin: each round runs one step of every variant (starting at a
    different variant each round), so a change in background load hits all of them alike.

    With ``check``, the references of the chosen variants (the group's torch for-loop, or the
    reference a variant names in ``Spec.ref``) run alongside (untimed if not chosen), and every
    variant's params are compared with its reference after all steps (the timed computation
    itself) and after one step from a reset to the initial params and state.
    """
    members = list(chosen)
    refs = {s.key: ref_key(s, group) for s in group}
    if check:   # the references the chosen variants are checked against run too (untimed)
        for key in dict.fromkeys(refs[s.key] for s in chosen):
            spec = next(s for s in group if s.key == key)
            if spec not in members:
                members.insert(0, spec)
    results = {s.key: Result(s) for s in members}
    variants: dict[str, Variant] = {}
    try:
        for spec in members:
            print(f"  building and warming up {spec.key} ...", flush=True)
            try:
                variant = spec.build(init, grads)
                t0 = time.perf_counter()
                variant.step()                       # compiles, for the compiled variants
                results[spec.key].first_call_s = time.perf_counter() - t0
                for _ in range(warmup - 1):
                    variant.step()
            except Exception as exc:  # report it and go on: a broken variant is a result too
                if check and spec.reference:
                    raise
                results[spec.key].error = f"{type(exc).__name__}: {exc}"[:300]
                continue
            variants[spec.key] = variant
            print(f"    first call {results[spec.key].first_call_s:.1f} s", flush=True)
        timed = [s.key for s in chosen if s.key in variants]
        if wait_idle_s:
            wait_idle(wait_idle_s)
        since = cpu_times()
        for i in range(steps if timed else 0):
            for key in timed[i % len(timed):] + timed[:i % len(timed)]:
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                variants[key].step()
                results[key].times_ms.append((time.perf_counter() - t0) * 1e3)
                results[key].faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                                           - faults)
        background = other_load(since)
        for key in timed:
            r = results[key]
            r.background = background
            print(f"    {key:<32} median {r.median:8.1f} ms   min {r.min:8.1f} ms", flush=True)
            if variants[key].compiled:
                r.compile_s = r.first_call_s - r.median / 1e3
        if check:
            # Untimed members ran fewer steps: bring everyone to the same count first.
            for spec in members:
                if spec.key in variants and spec.key not in timed:
                    for _ in range(steps):
                        variants[spec.key].step()
            checked = [k for k in timed if refs[k] != k]
            ref_keys = set(refs[k] for k in checked)
            snaps = {r: snapshot(variants[r].params()) for r in ref_keys}
            for key in checked:
                results[key].err_final = diff(variants[key].params(), snaps[refs[key]])
                results[key].total_steps = warmup + steps
            # One step from identical starting params/grads, with the very objects that were
            # timed (for the compiled variants: the same compiled function, reset in place).
            for variant in variants.values():
                variant.reset()
                variant.step()
            snaps = {r: snapshot(variants[r].params()) for r in ref_keys}
            for key in checked:
                results[key].err_one = diff(variants[key].params(), snaps[refs[key]])
            for key in timed:
                results[key].checked = True
    finally:
        variants.clear()
        gc.collect()
        torch._dynamo.reset()
    return [results[s.key] for s in chosen]


def wait_idle(max_wait: float, threshold: float = 0.15) -> None:
    _wait_idle(max_wait, threshold, label="  other processes' load")


def print_table(results: list[Result]) -> None:
    header = (f"{'variant':<38} {'median ms':>10} {'min ms':>9} {'x fused':>8} {'x foreach':>10}"
              f" {'x ref':>6} {'compile s':>10} {'faults MiB':>10}   {'max|dp| 1 step':>15}"
              f" {'max|dp| all':>12}  ok   vs")
    by_group: dict[str, list[Result]] = {}
    for r in results:
        by_group.setdefault(r.spec.key.split(".")[0], []).append(r)
    for name, rows in by_group.items():
        group = GROUPS[name][1]
        print()
        print(f"[{name}] {GROUPS[name][0]}")
        print(f"(other processes kept {rows[0].background:.2f} of {os.cpu_count()} cores busy "
              "while this group was timed; faults MiB = fresh pages touched per step, median; "
              "x ref = time / time of the reference in 'vs', which the row is checked against)")
        print(header)
        print("-" * len(header))
        base = {r.spec.baseline: r.median for r in rows if r.spec.baseline and not r.error}
        medians = {r.spec.key: r.median for r in rows if not r.error}
        for r in rows:
            if r.error:
                print(f"{r.spec.label:<38} FAILED: {r.error}")
                continue
            ok = r.ok
            none = "ref" if r.checked and r.spec.reference else "-"
            ref = ref_key(r.spec, group)
            fused = r.median / base["fused"] if "fused" in base else None
            foreach = r.median / base["foreach"] if "foreach" in base else None
            x_ref = r.median / medians[ref] if ref != r.spec.key and ref in medians else None
            print(f"{r.spec.label:<38} {r.median:>10.1f} {r.min:>9.1f} {fmt(fused, '.2f'):>8}"
                  f" {fmt(foreach, '.2f'):>10} {fmt(x_ref, '.2f'):>6} {fmt(r.compile_s):>10}"
                  f" {r.fault_mib:>10.0f}   "
                  f"{fmt(r.err_one and r.err_one[0], '.1e', none):>15}"
                  f" {fmt(r.err_final and r.err_final[0], '.1e', none):>12}"
                  f"  {('yes' if ok else 'NO ') if r.checked else '-  '}"
                  f"  {ref.split('.', 1)[1] if ref != r.spec.key else ''}")


def print_targets(results: list[Result]) -> None:
    ms = {r.spec.key: r.median for r in results if not r.error}
    groups = list(dict.fromkeys(r.spec.key.split(".")[0] for r in results))
    lines = [t for g in groups for t in TARGETS.get(g, [])]
    if not lines:
        return
    print()
    print("Targets: compiled opttx adamw <= 1.0x torch fused AdamW; eager opttx adamw "
          "<= 1.3x torch foreach AdamW; factored family (adafactor, came, lamb): compiled opttx "
          ">= 3x faster than each reference (time ratio <= 0.33)")
    for key, base, limit, what in lines:
        if key in ms and base in ms:
            ratio = ms[key] / ms[base]
            speed = f" ({ms[base] / ms[key]:.1f}x faster)" if limit < 1 else ""
            print(f"  {what}: {ratio:.2f}x{speed} (target <= {limit:.2f}x): "
                  f"{'MET' if ratio <= limit else 'NOT MET'}")
        else:
            print(f"  {what}: not measured (needs {key} and {base} in --only)")


def profile(key: str, init, grads, steps: int) -> None:
    spec = next((s for s in select(None) if s.key == key), None)
    if spec is None:
        raise SystemExit(f"--profile: unknown variant {key!r}")
    variant = spec.build(init, grads)
    for _ in range(3):
        variant.step()
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            variant.step()
    print(f"torch.profiler, {steps} steps of {key}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="default")
    parser.add_argument("--quick", action="store_true", help="--size quick --steps 5")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps, incl. compile")
    parser.add_argument("--only", default=None,
                        help="comma-separated groups (adamw,sgd,lion,muon,adafactor,came,lamb), keys "
                             "or globs")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                        help="before timing each group, wait up to S s for other processes "
                             "to leave the CPU idle (this benchmark is meaningless while "
                             "something else runs on the same cores)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use the usual Inductor cache dir (compile times then vary)")
    parser.add_argument("--profile", default=None, metavar="KEY",
                        help="print a torch.profiler op table of KEY's step and exit")
    args = parser.parse_args()
    if args.quick:
        args.size = "quick"
    steps = args.steps or (5 if args.quick else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    warmup = max(1, args.warmup)

    names, init, grads = make_problem(args.size)
    n_params = sum(p.numel() for p in init)
    print(f"opttx step_time: size={args.size}  {n_params:,} parameters in {len(init)} tensors "
          f"(float32), {n_params * 4 / 2**20:.0f} MiB per copy")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_model()} "
          f"({os.cpu_count()} cores visible), python {platform.python_version()}")
    print(f"opttx {opttx.__version__} from {os.path.dirname(opttx.__file__)} at {git_state()}")
    print(f"timing: {warmup} warm-up steps (compile in the first), then {steps} timed steps "
          "each with time.perf_counter; median and min per step")
    print(f"Inductor cache: {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default (warm)')}")
    print("load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg())
          + "  (other processes on these cores slow every variant; the variants of a group are"
          " timed round-robin so that they share it)")
    if args.profile:
        profile(args.profile, init, grads, steps)
        return

    specs = select(args.only)
    results: list[Result] = []
    for group_name, (_, group) in GROUPS.items():
        chosen = [s for s in group if s in specs]
        if chosen:
            print(f"[{group_name}]", flush=True)
            results += run_group(chosen, group, init, grads, warmup, steps, not args.no_check,
                                 args.wait_idle)

    print_table(results)
    print_targets(results)
    print("load average at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if not args.no_check:
        bad = [r.spec.key for r in results if not r.error and not r.ok]
        print(f"\nCorrectness: max|dp| = largest abs difference of the params from the "
              f"reference named in 'vs', after 1 step from identical params/grads and after "
              f"all {warmup + steps} steps; ok = relative to max|p| <= {TOLERANCE:g} after 1 step and <= "
              f"{tolerance(warmup + steps):.1g} after {warmup + steps} (fp32 rounding drift). "
              + ("All variants agree." if not bad else f"MISMATCH: {', '.join(bad)}"))
        if bad:
            sys.exit(1)


if __name__ == "__main__":
    main()
