"""torch.optim's optimizers under their own names, built on opttx transforms.

``opttx.optim.AdamW(model.parameters(), lr=1e-3)`` takes exactly ``torch.optim.AdamW``'s
constructor (parameter names, order, defaults, keyword-only flags), raises torch's errors for
invalid values (same types, same messages), shows torch's keys in its param groups and steps
with torch's numbers, so swapping ``torch.optim`` for ``opttx.optim`` is a one-word change.
Each class is an `opttx.Optimizer` over a declared opttx chain (the factories below), so it
keeps what `opttx.Optimizer` gives: one grouped-kernel implementation, a compiled ``step`` that
is one graph, torch LR schedulers writing live hyperparameters, state dicts keyed by field
path.

What torch's classes do that these do too:

* complex parameters are optimized as their real views (``torch.view_as_real``), as torch
  does; the states of complex parameters are kept as real views too (torch keeps them
  complex), so their state-dict entries have a trailing dimension of 2;
* sparse gradients are accepted where torch accepts them (`SGD`, `Adagrad`; they are
  densified, which gives the same numbers) and refused with torch's ``RuntimeError`` where it
  refuses them (the others, and `Adagrad` with ``weight_decay``);
* ``maximize``, ``amsgrad``, ``nesterov``/``dampening``, ``centered``, ``lr_decay``,
  ``decoupled_weight_decay``, ``momentum_decay``; per-group values of every key.

What they do not: ``differentiable=True`` (opttx steps under ``no_grad``) raises
``NotImplementedError``; ``foreach``, ``fused`` and ``capturable`` are accepted, checked as
torch checks them, and change nothing (one implementation). torch's ``Adadelta``, ``ASGD``,
``Rprop``, ``LBFGS`` and ``SparseAdam`` are not here: opttx has none of those algorithms.

Numbers: the same formulas as torch's single-tensor ("forloop") implementations, composed
from opttx links, so they agree with torch to float32 rounding (the links round their
intermediate products separately where torch fuses them into one ``addcdiv_``); see
``tests/test_torch_optim_names.py`` for the measured agreement of every class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..aliases import adam, adamax, adamw
from ..base import (
    GradientTransformation,
    HyperRole,
    combine_traits,
    declare,
    require_params,
    safe_increment,
    traits_of,
    zero_count,
)
from ..combine import chain
from ..transforms.factored import (
    clip_by_rms_and_scale_by_param_rms,
    scale_by_factored_rms,
)
from ..transforms.moments import (
    ema,
    scale_by_nadam,
    scale_by_radam,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
    trace,
)
from ..transforms.orthogonalize import orthogonalize, scale_by_shape
from ..transforms.scaling import (
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
)
from ..tree import flatten_matching, tree_flatten, tree_unflatten
from .optimizer import Optimizer

__all__ = [
    "SGD",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Muon",
    "NAdam",
    "RAdam",
    "RMSprop",
]

LR, B1, B2 = HyperRole.LEARNING_RATE, HyperRole.B1, HyperRole.B2
MOM, WD, EPS = HyperRole.MOMENTUM, HyperRole.WEIGHT_DECAY, HyperRole.EPS


# ---------------------------------------------------------------------------------------------
# torch's inputs: complex parameters as real views, sparse gradients
# ---------------------------------------------------------------------------------------------


def _as_real(x: Any) -> Any:
    return torch.view_as_real(x) if isinstance(x, torch.Tensor) and x.is_complex() else x


def _dense(g: torch.Tensor) -> torch.Tensor:
    """A sparse COO gradient as a dense tensor, repeated indices summed (``to_dense()``'s
    result; torch 2.13's CPU ``to_dense`` takes 19 ms on a 2-element tensor, this 0.04 ms)."""
    c = g.coalesce()
    out = torch.zeros(g.shape, dtype=g.dtype, device=g.device)
    return out.index_put_(tuple(c.indices()), c.values())


def torch_inputs(inner: GradientTransformation, name: str, *, sparse: bool = False,
                 complex_params: bool = True,
                 sparse_refusal: Callable[[], str | None] | None = None
                 ) -> GradientTransformation:
    """``inner`` taking gradients and parameters as torch.optim's class ``name`` takes them.

    * Complex parameters and their gradients go through ``inner`` as real views
      (``torch.view_as_real``: a ``(..., 2)`` float tensor), and the updates come back
      complex, as torch's optimizers do; with ``complex_params=False`` a complex parameter
      raises torch's ``RuntimeError`` at ``update``.
    * Sparse gradients are densified (repeated indices summed, as ``to_dense()``) when
      ``sparse``; otherwise they raise torch's ``RuntimeError`` naming ``name``.
      ``sparse_refusal`` (called only when a sparse gradient arrives) may return a message
      for a configuration torch refuses with sparse gradients.

    The state is ``inner``'s, built on the real views.
    """

    def init(params: Any) -> Any:
        leaves, spec = tree_flatten(params)
        return inner.init(tree_unflatten([_as_real(p) for p in leaves], spec))

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        g, spec = tree_flatten(updates)
        p = tree_flatten(params)[0] if params is not None else [None] * len(g)
        complex_at = []
        for i, (gi, pi) in enumerate(zip(g, p)):
            if not isinstance(gi, torch.Tensor):
                continue
            if gi.is_sparse:
                if not sparse:
                    suffix = ", please consider SparseAdam instead" if name == "Adam" else ""
                    raise RuntimeError(f"{name} does not support sparse gradients{suffix}")
                refused = sparse_refusal() if sparse_refusal is not None else None
                if refused:
                    raise RuntimeError(refused)
                gi = g[i] = _dense(gi)
            if gi.is_complex() or (pi is not None and pi.is_complex()):
                if not complex_params:
                    raise RuntimeError(f"{name} does not support complex parameters")
                complex_at.append(i)
                g[i] = torch.view_as_real(gi)
                if pi is not None:
                    p[i] = torch.view_as_real(pi)
        if complex_at:
            real_params = tree_unflatten(p, spec) if params is not None else None
            out, state = inner.update(tree_unflatten(g, spec), state, real_params, **extra_args)
            leaves = tree_flatten(out)[0]
            for i in complex_at:
                leaves[i] = torch.view_as_complex(leaves[i].contiguous())
            return tree_unflatten(leaves, spec), state
        return inner.update(tree_unflatten(g, spec), state, params, **extra_args)

    # the updates are inner's, leaf by leaf (complex ones viewed back): its final scale too
    return GradientTransformation(init, update, combine_traits(
        (inner,), final_scale=traits_of(inner).final_scale))


def _maximized(links: list, maximize: bool) -> list:
    # torch negates the gradient first (weight decay then adds to the negated gradient)
    return [scale(-1.0), *links] if maximize else links


def _nonzero(value: Any) -> bool:
    return bool(value != 0)


# ---------------------------------------------------------------------------------------------
# the factories: torch's algorithms as opttx chains (declared: their hyperparameters are the
# param groups' live keys)
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"learning_rate": LR, "momentum": MOM, "weight_decay": WD})
def torch_sgd(learning_rate: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
              weight_decay: float = 0.0, nesterov: bool = False,
              maximize: bool = False) -> GradientTransformation:
    r"""``torch.optim.SGD``: :math:`d_t = g_t + \lambda x_t`, momentum buffer
    :math:`b_t = \mu b_{t-1} + (1-\tau) d_t` (:math:`b_1 = d_1`), Nesterov
    :math:`d_t + \mu b_t`, :math:`x_{t+1} = x_t - \eta\, b_t`.

    The momentum link is always there (a buffer like the parameters, also with momentum 0,
    where it holds :math:`d_t`), so a scheduler may cycle ``momentum`` as torch allows.
    ``dampening`` is a configuration argument (with a nonzero one the buffer's first step
    is counted, `opttx.trace`), fixed once a group is built.
    """
    links = _maximized([add_decayed_weights(weight_decay),
                        trace(decay=momentum, nesterov=nesterov, dampening=dampening),
                        scale_by_learning_rate(learning_rate)], maximize)
    return torch_inputs(chain(*links), "SGD", sparse=True)


def _decayed(direction: GradientTransformation, weight_decay: Any, decoupled: bool,
             learning_rate: Any) -> list[GradientTransformation]:
    """The links of torch's NAdam and RAdam around their ``direction``: the weight decay
    added to the gradient before it (L2), or to the direction after it (decoupled:
    :math:`-\\eta(u + \\lambda x)`, torch's :math:`x(1 - \\eta\\lambda)` on the same
    :math:`x`), then the learning rate. The decay link is there even for a weight decay of 0,
    so the groups of one optimizer have one structure."""
    if decoupled:
        return [direction, add_decayed_weights(weight_decay),
                scale_by_learning_rate(learning_rate)]
    return [add_decayed_weights(weight_decay), direction, scale_by_learning_rate(learning_rate)]


@declare(hyperparams={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD})
def torch_adam(learning_rate: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
               maximize: bool = False, decoupled_weight_decay: bool = False
               ) -> GradientTransformation:
    r"""``torch.optim.Adam`` (L2 weight decay added to the gradient) and, with
    ``decoupled_weight_decay``, ``torch.optim.AdamW`` (:math:`x \leftarrow x(1-\eta\lambda)`):
    `opttx.adam` / `opttx.adamw` with torch's defaults."""
    if decoupled_weight_decay:
        links = [adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay, amsgrad=amsgrad)]
    else:
        links = [add_decayed_weights(weight_decay),
                 adam(learning_rate, b1, b2, eps, amsgrad=amsgrad)]
    return torch_inputs(chain(*_maximized(links, maximize)), "Adam")


@declare(hyperparams={"learning_rate": LR, "decay": HyperRole.RMS_DECAY, "eps": EPS,
                      "weight_decay": WD, "momentum": MOM})
def torch_rmsprop(learning_rate: float = 1e-2, decay: float = 0.99, eps: float = 1e-8,
                  weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False,
                  maximize: bool = False) -> GradientTransformation:
    r"""``torch.optim.RMSprop``: :math:`v_t = \alpha v_{t-1} + (1-\alpha) d_t^2`,
    :math:`b_t = \mu b_{t-1} + d_t / (\sqrt{v_t} + \epsilon)` (centred: :math:`\sqrt{v_t -
    \bar g_t^2}`), :math:`x_{t+1} = x_t - \eta b_t`: the momentum buffer holds the scaled
    gradient and the learning rate applies after it, as torch (`opttx.rmsprop` applies it
    before, as optax: the same numbers only while the learning rate is constant)."""
    direction = (scale_by_stddev if centered else scale_by_rms)(decay, eps, eps_in_sqrt=False)
    links = _maximized([add_decayed_weights(weight_decay), direction, trace(decay=momentum),
                        scale_by_learning_rate(learning_rate)], maximize)
    return torch_inputs(chain(*links), "RMSprop")


@declare(hyperparams={"learning_rate": LR, "weight_decay": WD,
                      "initial_accumulator_value": None, "eps": EPS})
def torch_adagrad(learning_rate: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                  initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                  maximize: bool = False) -> GradientTransformation:
    r"""``torch.optim.Adagrad``: :math:`s_t = s_{t-1} + d_t^2`, :math:`x_{t+1} = x_t -
    \frac{\eta}{1 + (t-1)\delta}\, d_t / (\sqrt{s_t} + \epsilon)` (``lr_decay`` :math:`\delta`
    a configuration argument)."""
    links = [add_decayed_weights(weight_decay),
             scale_by_rss(initial_accumulator_value, eps, eps_in_sqrt=False)]
    if lr_decay != 0:
        links.append(scale_by_schedule(_InverseTimeDecay(lr_decay)))
    links.append(scale_by_learning_rate(learning_rate))

    def refusal() -> str | None:
        if _nonzero(weight_decay):
            return "weight_decay option is not compatible with sparse gradients"
        return None
    return torch_inputs(chain(*_maximized(links, maximize)), "Adagrad", sparse=True,
                        sparse_refusal=refusal)


class _InverseTimeDecay:
    """``1 / (1 + t * lr_decay)`` of the 0-based step ``t`` (picklable)."""

    def __init__(self, lr_decay: float) -> None:
        self.lr_decay = lr_decay

    def __call__(self, count: torch.Tensor) -> torch.Tensor:
        return 1.0 / (1.0 + count.to(torch.float64) * self.lr_decay)


@declare(hyperparams={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD,
                      "momentum_decay": None})
def torch_nadam(learning_rate: float = 2e-3, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, momentum_decay: float = 4e-3,
                decoupled_weight_decay: bool = False, maximize: bool = False
                ) -> GradientTransformation:
    r"""``torch.optim.NAdam``: `opttx.scale_by_nadam` (Dozat's momentum schedule), L2 or
    decoupled weight decay."""
    links = _decayed(scale_by_nadam(b1, b2, eps, momentum_decay), weight_decay,
                     decoupled_weight_decay, learning_rate)
    return torch_inputs(chain(*_maximized(links, maximize)), "NAdam")


@declare(hyperparams={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD})
def torch_radam(learning_rate: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0,
                decoupled_weight_decay: bool = False, maximize: bool = False
                ) -> GradientTransformation:
    r"""``torch.optim.RAdam``: `opttx.scale_by_radam` with ``eps_before_debias=True``, L2 or
    decoupled weight decay (as `opttx.radam`)."""
    links = _decayed(scale_by_radam(b1, b2, eps, eps_before_debias=True), weight_decay,
                     decoupled_weight_decay, learning_rate)
    return torch_inputs(chain(*_maximized(links, maximize)), "RAdam")


@declare(hyperparams={"learning_rate": LR, "b1": B1, "b2": B2, "eps": EPS, "weight_decay": WD})
def torch_adamax(learning_rate: float = 2e-3, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0, maximize: bool = False
                 ) -> GradientTransformation:
    r"""``torch.optim.Adamax``: L2 weight decay, then `opttx.adamax`."""
    links = [add_decayed_weights(weight_decay), adamax(learning_rate, b1, b2, eps)]
    return torch_inputs(chain(*_maximized(links, maximize)), "Adamax")


@declare(hyperparams={"learning_rate": LR, "weight_decay": WD})
def scale_by_relative_step_and_decay(learning_rate: float = 1e-2, weight_decay: float = 0.0
                                     ) -> GradientTransformation:
    r"""torch.optim.Adafactor's last link: :math:`u_t \min(\eta, 1/\sqrt t) + \eta\lambda
    x_t`, with :math:`t` counting from 1 (the relative step size :math:`\rho_t` with the
    group's live ``lr`` as its cap, and the decoupled weight decay scaled by ``lr`` itself,
    not by :math:`\rho_t`)."""

    def init(params: Any) -> torch.Tensor:
        return zero_count(params)

    def update(updates: Any, state: torch.Tensor, params: Any = None,
               **extra_args: Any) -> tuple[Any, torch.Tensor]:
        params = require_params(params, "scale_by_relative_step_and_decay")
        spec, g, p = flatten_matching(updates, params, what="updates and params")
        t = (state + 1).to(torch.float64)
        lr = torch.as_tensor(learning_rate, dtype=torch.float64)
        rho = torch.minimum(lr, torch.rsqrt(t))
        decay = lr * weight_decay
        out = [(x * rho.to(x.dtype)) + (pi * decay.to(x.dtype)).to(x.dtype)
               for x, pi in zip(g, p)]
        return tree_unflatten(out, spec), safe_increment(state)

    from ..base import LEAFWISE
    return GradientTransformation(init, update, LEAFWISE)


class _TorchBeta2:
    r"""torch.optim.Adafactor's :math:`\beta_{2,t} = 1 - t^{c}` (``beta2_decay`` :math:`c \le
    0`, any: 0 keeps no average) of the 0-based step, as `scale_by_factored_rms`'s
    ``decay_rate_fn`` (picklable)."""

    def __init__(self, beta2_decay: float) -> None:
        self.beta2_decay = beta2_decay

    def __call__(self, step: torch.Tensor, decay_rate: float) -> torch.Tensor:
        return 1 - torch.pow((step + 1).to(torch.float64), self.beta2_decay)


@declare(hyperparams={"learning_rate": LR, "weight_decay": WD})
def torch_adafactor(learning_rate: float = 1e-2, beta2_decay: float = -0.8,
                    eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0,
                    weight_decay: float = 0.0, maximize: bool = False,
                    eps1_dtype: torch.dtype = torch.float32) -> GradientTransformation:
    r"""``torch.optim.Adafactor``: the second moment factored over the last two dims of every
    tensor of 2 or more dims (:math:`\beta_{2,t} = 1 - t^{c}`, ``beta2_decay`` :math:`c`),
    :math:`\hat v` clamped at :math:`\epsilon_1^2`, the update's RMS clipped at :math:`d`,
    scaled by :math:`\max(\epsilon_2, \mathrm{RMS}(x))\min(\eta, 1/\sqrt t)`, decoupled
    weight decay :math:`\eta\lambda`. ``eps=(None, e2)``: :math:`\epsilon_1` is the machine
    epsilon of ``eps1_dtype`` (the parameters' dtype; torch takes each parameter's)."""
    eps1, eps2 = eps
    if eps1 is None:
        eps1 = torch.finfo(eps1_dtype).eps
    links = _maximized([
        scale_by_factored_rms(True, 1.0, 0, 1, 0.0, _TorchBeta2(beta2_decay),
                              factor_axes="last", eps_clamp=eps1),
        clip_by_rms_and_scale_by_param_rms(d, eps2),
        scale_by_relative_step_and_decay(learning_rate, weight_decay),
        scale(-1.0)], maximize)
    return torch_inputs(chain(*links), "Adafactor", complex_params=False)


@declare(hyperparams={"learning_rate": LR, "weight_decay": WD, "momentum": MOM, "eps": EPS})
def torch_muon(learning_rate: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
               nesterov: bool = True,
               ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
               eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None
               ) -> GradientTransformation:
    r"""``torch.optim.Muon`` on 2-D parameters: momentum (``lerp``, Nesterov by default, no
    bias correction), Newton–Schulz orthogonalization in bfloat16, torch's ``adjust_lr_fn``
    shape scaling, decoupled weight decay :math:`\eta\lambda`."""
    links = [ema(momentum, debias=False, nesterov=nesterov),
             orthogonalize(ns_steps, tuple(ns_coefficients), eps, ns_dtype=torch.bfloat16),
             scale_by_shape(0.2 if adjust_lr_fn == "match_rms_adamw" else None),
             add_decayed_weights(weight_decay),
             scale_by_learning_rate(learning_rate)]
    return torch_inputs(chain(*links), "Muon", complex_params=False)


# ---------------------------------------------------------------------------------------------
# torch's checks, with torch's messages
# ---------------------------------------------------------------------------------------------


def _check_tensor_lr(lr: Any) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")


def _check(ok: Any, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_betas(betas: Any) -> None:
    _check(0.0 <= betas[0] < 1.0, f"Invalid beta parameter at index 0: {betas[0]}")
    _check(0.0 <= betas[1] < 1.0, f"Invalid beta parameter at index 1: {betas[1]}")


def _check_fused(fused: Any, foreach: Any, differentiable: bool) -> None:
    if fused:
        if differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


# ---------------------------------------------------------------------------------------------
# the classes
# ---------------------------------------------------------------------------------------------


class TorchOptimizer(Optimizer):
    """`opttx.Optimizer` over one of the factories above, with torch.optim's constructor.

    Every param group holds every key torch's class puts in its groups (``lr``, ``betas``,
    ``amsgrad``, ``maximize``, ``foreach``, ...), with the constructor's values unless the
    group gives its own; ``defaults`` is torch's dict.
    """

    factory: Callable[..., GradientTransformation]
    """The declared factory (torch's algorithm as an opttx chain)."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        if defaults.get("differentiable"):
            raise NotImplementedError(
                f"opttx.optim.{type(self).__name__} does not support differentiable=True "
                "(opttx steps under torch.no_grad); use torch.optim for a differentiable "
                "optimizer step.")
        defaults = _scalar_views(defaults)
        self._torch_defaults = dict(defaults)
        factory = type(self).factory
        accepted = set(_factory_arguments(factory))
        hyperparameters = {k: v for k, v in defaults.items()
                           if k in accepted or k in ("lr", "betas", "alpha")}
        if params is not None and not isinstance(params, (torch.Tensor, list)):
            params = list(params)       # read once (a generator), as torch.optim does
        extra = self._factory_extras(params)
        # torch writes p.add_(u, alpha=-lr): the learning rate in the write, as torch rounds
        super().__init__(params, factory, fold_learning_rate=True, **hyperparameters, **extra)
        self.defaults = dict(defaults)

    def _factory_extras(self, params: Any) -> dict[str, Any]:
        """Factory arguments that are not torch's (derived from the parameters)."""
        return {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            param_group = _scalar_views(dict(param_group))
            for key, value in self._torch_defaults.items():
                if key not in param_group:
                    param_group[key] = value
            if param_group.get("differentiable"):
                raise NotImplementedError(
                    f"opttx.optim.{type(self).__name__} does not support differentiable=True.")
        super().add_param_group(param_group)


def _scalar_views(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with a one-element tensor ``lr`` of any shape (torch accepts ``(1,)``,
    ``(1, 1)``) as a 0-dim view of it: the same storage, so an in-place change of the
    tensor given is the optimizer's learning rate, as in torch."""
    lr = values.get("lr")
    if isinstance(lr, torch.Tensor) and lr.dim() > 0 and lr.numel() == 1:
        values = dict(values, lr=lr.view(()))
    return values


def _factory_arguments(factory: Callable) -> list[str]:
    import inspect
    return list(inspect.signature(factory).parameters)


class SGD(TorchOptimizer):
    """``torch.optim.SGD`` on opttx (`torch_sgd`): same signature, defaults, errors and
    numbers; sparse gradients accepted. The momentum buffer exists also with
    ``momentum=0`` (torch keeps none then), so ``momentum`` may be cycled by a scheduler.

    Example:
      >>> opt = opttx.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    """

    factory = staticmethod(torch_sgd)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 momentum: float = 0, dampening: float = 0,
                 weight_decay: float | torch.Tensor = 0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None) -> None:
        _check_tensor_lr(lr)
        _check(not lr < 0.0, f"Invalid learning rate: {lr}")
        _check(not momentum < 0.0, f"Invalid momentum value: {momentum}")
        _check(not weight_decay < 0.0, f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _check_fused(fused, foreach, differentiable)
        super().__init__(params, {
            "lr": lr, "momentum": momentum, "dampening": dampening,
            "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize,
            "foreach": foreach, "differentiable": differentiable, "fused": fused})


def _adam_checks(lr: Any, betas: Any, eps: float, weight_decay: float, foreach: Any,
                 capturable: bool) -> None:
    if isinstance(lr, torch.Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and "
                             "foreach=True")
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
    _check(0.0 <= lr, f"Invalid learning rate: {lr}")
    _check(0.0 <= eps, f"Invalid epsilon value: {eps}")
    _check_betas(betas)
    _check(0.0 <= weight_decay, f"Invalid weight_decay value: {weight_decay}")
    if not ((isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))):
        raise ValueError("betas must be either both floats or both Tensors")  # noqa: TRY004 - torch's type
    for i in (0, 1):
        if isinstance(betas[i], torch.Tensor):
            if not capturable and foreach:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for "
                                 "capturable=False and foreach=True")
            if betas[i].numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")


class Adam(TorchOptimizer):
    """``torch.optim.Adam`` on opttx (`torch_adam`): same signature, defaults (no weight
    decay; L2 unless ``decoupled_weight_decay``), errors and numbers.

    Example:
      >>> opt = opttx.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    """

    factory = staticmethod(torch_adam)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False) -> None:
        _adam_checks(lr, betas, eps, weight_decay, foreach, capturable)
        betas = tuple(float(b) if isinstance(b, torch.Tensor) else b for b in betas)
        _check_fused(fused, foreach, differentiable)
        super().__init__(params, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "amsgrad": amsgrad, "maximize": maximize, "foreach": foreach,
            "capturable": capturable, "differentiable": differentiable, "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay})


class AdamW(Adam):
    """``torch.optim.AdamW`` on opttx: torch's defaults (``weight_decay=1e-2``; opttx.adamw
    keeps optax's 1e-4), decay :math:`x \\leftarrow x(1 - \\eta\\lambda)`, torch's numbers.

    Example:
      >>> opt = opttx.optim.AdamW(model.parameters(), lr=3e-4)
    """

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)


class RMSprop(TorchOptimizer):
    """``torch.optim.RMSprop`` on opttx (`torch_rmsprop`): torch's ``alpha=0.99``
    (opttx.rmsprop keeps optax's 0.9), momentum buffer before the learning rate, errors and
    numbers as torch.

    Example:
      >>> opt = opttx.optim.RMSprop(model.parameters(), lr=1e-2, momentum=0.9)
    """

    factory = staticmethod(torch_rmsprop)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-2,
                 alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0,
                 momentum: float = 0, centered: bool = False, capturable: bool = False,
                 foreach: bool | None = None, maximize: bool = False,
                 differentiable: bool = False) -> None:
        _check_tensor_lr(lr)
        _check(0.0 <= lr, f"Invalid learning rate: {lr}")
        _check(0.0 <= eps, f"Invalid epsilon value: {eps}")
        _check(0.0 <= momentum, f"Invalid momentum value: {momentum}")
        _check(0.0 <= weight_decay, f"Invalid weight_decay value: {weight_decay}")
        _check(0.0 <= alpha, f"Invalid alpha value: {alpha}")
        super().__init__(params, {
            "lr": lr, "momentum": momentum, "alpha": alpha, "eps": eps, "centered": centered,
            "weight_decay": weight_decay, "capturable": capturable, "foreach": foreach,
            "maximize": maximize, "differentiable": differentiable})


class Adagrad(TorchOptimizer):
    """``torch.optim.Adagrad`` on opttx (`torch_adagrad`): torch's defaults
    (``initial_accumulator_value=0``, ``eps=1e-10`` outside the root), ``lr_decay``, sparse
    gradients (refused with ``weight_decay``, as torch).

    Example:
      >>> opt = opttx.optim.Adagrad(model.parameters(), lr=1e-2, lr_decay=1e-4)
    """

    factory = staticmethod(torch_adagrad)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-2,
                 lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10,
                 foreach: bool | None = None, *, maximize: bool = False,
                 differentiable: bool = False, fused: bool | None = None) -> None:
        _check_tensor_lr(lr)
        _check(0.0 <= lr, f"Invalid learning rate: {lr}")
        _check(0.0 <= lr_decay, f"Invalid lr_decay value: {lr_decay}")
        _check(0.0 <= weight_decay, f"Invalid weight_decay value: {weight_decay}")
        _check(0.0 <= initial_accumulator_value,
               f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
        _check(0.0 <= eps, f"Invalid epsilon value: {eps}")
        _check_fused(fused, foreach, differentiable)
        super().__init__(params, {
            "lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value, "foreach": foreach,
            "maximize": maximize, "differentiable": differentiable, "fused": fused})


def _nadam_like_checks(lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    _check_tensor_lr(lr)
    _check(0.0 <= lr, f"Invalid learning rate: {lr}")
    _check(0.0 <= eps, f"Invalid epsilon value: {eps}")
    _check_betas(betas)
    _check(0.0 <= weight_decay, f"Invalid weight_decay value: {weight_decay}")


class NAdam(TorchOptimizer):
    """``torch.optim.NAdam`` on opttx (`torch_nadam`): Dozat's momentum schedule
    (``momentum_decay``), L2 or decoupled weight decay, torch's numbers.

    Example:
      >>> opt = opttx.optim.NAdam(model.parameters(), lr=2e-3)
    """

    factory = staticmethod(torch_nadam)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 2e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, momentum_decay: float = 4e-3,
                 decoupled_weight_decay: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False) -> None:
        _nadam_like_checks(lr, betas, eps, weight_decay)
        _check(0.0 <= momentum_decay, f"Invalid momentum_decay value: {momentum_decay}")
        super().__init__(params, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "momentum_decay": momentum_decay, "decoupled_weight_decay": decoupled_weight_decay,
            "maximize": maximize, "foreach": foreach, "capturable": capturable,
            "differentiable": differentiable})


class RAdam(TorchOptimizer):
    """``torch.optim.RAdam`` on opttx (`torch_radam`): torch's ``eps`` placement (before
    the bias correction), L2 or decoupled weight decay, torch's numbers.

    Example:
      >>> opt = opttx.optim.RAdam(model.parameters(), lr=1e-3)
    """

    factory = staticmethod(torch_radam)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, decoupled_weight_decay: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False) -> None:
        _nadam_like_checks(lr, betas, eps, weight_decay)
        super().__init__(params, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "maximize": maximize, "foreach": foreach, "capturable": capturable,
            "decoupled_weight_decay": decoupled_weight_decay,
            "differentiable": differentiable})


class Adamax(TorchOptimizer):
    """``torch.optim.Adamax`` on opttx (`torch_adamax`): torch's ``lr=2e-3``, L2 weight
    decay, torch's numbers.

    Example:
      >>> opt = opttx.optim.Adamax(model.parameters())
    """

    factory = staticmethod(torch_adamax)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 2e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, foreach: bool | None = None, *,
                 maximize: bool = False, differentiable: bool = False,
                 capturable: bool = False) -> None:
        _nadam_like_checks(lr, betas, eps, weight_decay)
        super().__init__(params, {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "foreach": foreach, "maximize": maximize, "differentiable": differentiable,
            "capturable": capturable})


class Adafactor(TorchOptimizer):
    """``torch.optim.Adafactor`` on opttx (`torch_adafactor`): torch's algorithm and
    defaults, which are not `opttx.adafactor`'s (optax's): every tensor of 2 or more dims is
    factored over its last two, the relative step :math:`\\min(\\eta, 1/\\sqrt t)` follows the
    live ``lr``, no momentum. ``eps=(None, e2)`` takes the machine epsilon of the
    parameters' dtype (float64 when every parameter is float64, else float32's; torch takes
    each parameter's). Complex parameters and sparse gradients raise torch's errors.

    Example:
      >>> opt = opttx.optim.Adafactor(model.parameters(), lr=1e-2)
    """

    factory = staticmethod(torch_adafactor)

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-2,
                 beta2_decay: float = -0.8, eps: tuple[float | None, float] = (None, 1e-3),
                 d: float = 1.0, weight_decay: float = 0.0, *, foreach: bool | None = None,
                 maximize: bool = False) -> None:
        _check_tensor_lr(lr)
        _check(0.0 <= lr, f"Learning rate should be >= 0 but is: {lr}")
        _check(0.0 >= beta2_decay, f"beta2_decay should be <= 0 but is: {beta2_decay}")
        _check(eps[0] is None or 0.0 <= eps[0], f"epsilon1 should be >= 0 but is: {eps[0]}")
        _check(0.0 <= eps[1], f"epsilon2 should be >= 0 but is: {eps[1]}")
        _check(1.0 <= d, f"Clipping threshold d should be >= 1 but is: {d}")
        _check(0.0 <= weight_decay, f"weight_decay should be >= 0 but is: {weight_decay}")
        super().__init__(params, {
            "lr": lr, "beta2_decay": beta2_decay, "eps": eps, "d": d,
            "weight_decay": weight_decay, "foreach": foreach, "maximize": maximize})

    def _factory_extras(self, params: Any) -> dict[str, Any]:
        leaves = []
        for entry in params if isinstance(params, list) else []:
            inner = entry.get("params", []) if isinstance(entry, dict) else [entry]
            inner = [inner] if isinstance(inner, torch.Tensor) else inner
            if isinstance(inner, (list, tuple)):
                leaves += [p[1] if isinstance(p, tuple) else p for p in inner]
        wide = bool(leaves) and all(p.dtype == torch.float64 for p in leaves)
        return {"eps1_dtype": torch.float64 if wide else torch.float32}


class Muon(TorchOptimizer):
    """``torch.optim.Muon`` on opttx (`torch_muon`): 2-D parameters only (torch's
    ``ValueError`` otherwise), Newton–Schulz in bfloat16 as torch, ``adjust_lr_fn``.

    Example:
      >>> hidden = [p for p in model.parameters() if p.ndim == 2]
      >>> opt = opttx.optim.Muon(hidden, lr=2e-2, weight_decay=0.01)
    """

    factory = staticmethod(torch_muon)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None
                 ) -> None:
        _check_tensor_lr(lr)
        _check(0.0 <= lr, f"Learning rate should be >= 0 but is: {lr}")
        _check(0.0 <= momentum, f"momentum should be >= 0 but is: {momentum}")
        _check(0.0 <= weight_decay, f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ["original", "match_rms_adamw"]:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if params is not None and not isinstance(params, (torch.Tensor, list)):
            params = list(params)
        for entry in params if isinstance(params, list) else []:
            inner = entry.get("params", []) if isinstance(entry, dict) else [entry]
            inner = [inner] if isinstance(inner, torch.Tensor) else inner
            if not isinstance(inner, (list, tuple)):
                continue
            for p in inner:
                p = p[1] if isinstance(p, tuple) else p
                if isinstance(p, torch.Tensor) and p.ndim != 2:
                    raise ValueError("Muon only supports 2D parameters whereas we found a "
                                     f"parameter with size: {p.size()}")
        super().__init__(params, {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
            "nesterov": nesterov, "ns_coefficients": ns_coefficients, "eps": eps,
            "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn})

