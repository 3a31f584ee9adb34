"""Moment-based first-order transforms: momentum (`trace`), `ema`, Adam, NAdam, RMS, RSS, Lion.

Every transform here is elementwise: its hot path is a handful of ``torch._foreach_*``
kernels over all leaves at once (docs/design.md, rule 4). Statistics of 16-bit leaves are kept in
fp32 unless a ``*_dtype`` argument says otherwise; updates come back in the gradient's dtype.
Bias corrections are computed from the 0-dim step tensor in float64, so a compiled step never
recompiles as the step advances and float64 training matches torch.optim to 1e-10.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .._checks import check_nonnegative, check_unit_interval
from .._tracing import is_tracing
from ..base import (ELEMENTWISE, GradientTransformation, HyperRole, PRECONDITIONER, Params,
                    Role, Updates, check_init_params, declare, declare_roles,
                    precondition_leaves, replace_state, safe_increment, zero_count)
from ..skeleton import leafwise
from ..kernels import (Scalar, cast_like, foreach, foreach_, foreach_accumulate_sq,
                       foreach_axpy, foreach_ema, foreach_ema_sq, foreach_op_,
                       foreach_scale_add, is_donating, is_fixed_zero, new_buffers)
from ..tree import Static, stats_like
from .common import (as_float64, debias_factor, divide_consuming, float64_power,
                     fresh_updates)
from .scaling import signs

__all__ = [
    "DampedTraceState",
    "EmaState",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByRadamState",
    "ScaleByLionState",
    "ScaleByNadamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByStddevState",
    "TraceState",
    "ema",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_belief",
    "scale_by_lion",
    "scale_by_nadam",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_stddev",
    "trace",
]


_LOG_096 = math.log(0.96)


def _float64(count: torch.Tensor) -> torch.Tensor:
    return count.to(torch.float64)


def _check_adam_args(b1: float, b2: float, eps: float, eps_root: float = 0.0) -> None:
    """The checks every Adam-like transform makes of its decays and epsilons."""
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_nonnegative("eps", eps)
    check_nonnegative("eps_root", eps_root)


def _moments_init(state_type: type) -> Any:
    """The ``init`` of a transform whose state is (count, mu, nu): a zero count and two zero
    moments like the params (float32 for 16-bit params)."""

    def init(params: Params) -> Any:
        check_init_params(params)
        return state_type(count=zero_count(params), mu=stats_like(params),
                          nu=stats_like(params))
    return init


def _div_by(tensors: list[torch.Tensor], divisor: Scalar) -> list[torch.Tensor]:
    return foreach("div", tensors, divisor)


# ---------------------------------------------------------------------------------------------
# momentum and averages
# ---------------------------------------------------------------------------------------------


class TraceState(NamedTuple):
    """State of `trace`."""
    trace: Updates  # like params (fp32 for 16-bit leaves): the momentum buffer
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(trace=Role.FIRST_MOMENT)


class DampedTraceState(NamedTuple):
    """State of `trace` with a ``dampening``."""
    count: torch.Tensor  # shape (), int32: steps taken (the first step is not dampened)
    trace: Updates       # like params (fp32 for 16-bit leaves): the momentum buffer
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, trace=Role.FIRST_MOMENT)


@declare(hyperparams={"decay": HyperRole.MOMENTUM, "dampening": None})
def trace(decay: float, nesterov: bool = False,
          accumulator_dtype: torch.dtype | None = None, *,
          dampening: float = 0.0) -> GradientTransformation:
    r"""Momentum (heavy ball, or Nesterov's variant), with torch.optim.SGD's dampening.

    .. math::
        m_1 = g_1, \qquad m_t = \beta m_{t-1} + (1 - d)\, g_t, \qquad
        u_t = m_t \quad(\text{or } g_t + \beta m_t \text{ with } \texttt{nesterov})

    With the default ``dampening`` :math:`d = 0` this is :math:`m_t = g_t + \beta m_{t-1}`
    from :math:`m_0 = 0` (optax's ``trace``); with :math:`d \neq 0` the first step takes the
    gradient undampened, as ``torch.optim.SGD`` initialises its buffer, and the state counts
    steps (`DampedTraceState`). Either way the numbers are ``torch.optim.SGD``'s momentum
    buffer for the same ``momentum``, ``dampening`` and ``nesterov`` (torch refuses Nesterov
    with dampening; here it is allowed and means the formula above).

    Args:
      decay: the momentum coefficient :math:`\beta` (>= 0).
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the buffer (default: the parameter's, fp32 for 16-bit).
      dampening: :math:`d`, the fraction of the gradient left out of the buffer after the
        first step (torch.optim.SGD's ``dampening``).

    Example:
      >>> tx = opttx.chain(opttx.trace(0.9), opttx.scale_by_learning_rate(0.1))
      >>> tx = opttx.chain(opttx.trace(0.9, dampening=0.9), opttx.scale_by_learning_rate(0.1))

    References:
      Polyak (1964); Sutskever et al., ICML 2013.
    """
    check_nonnegative("decay", decay)
    check_unit_interval("dampening", dampening, closed_right=True)
    damped = not is_fixed_zero(dampening)

    def nesterov_out(g, buf):
        if nesterov:
            # g + β·m in one fused add (torch's grad.add(buf, alpha=momentum))
            return fresh_updates(foreach_axpy(decay, buf, cast_like(g, buf)), g)
        return cast_like(buf, g)      # aliases the state: not a temporary

    if not damped:
        def init(params: Params) -> TraceState:
            check_init_params(params)
            return TraceState(trace=stats_like(params, accumulator_dtype))

        def step(g, state, params, extra_args):
            buf = foreach_scale_add(state.trace, decay, cast_like(g, state.trace))
            return nesterov_out(g, buf), replace_state(state, trace=buf)

        return GradientTransformation(init, leafwise(TraceState, step), ELEMENTWISE)

    def damped_init(params: Params) -> DampedTraceState:
        check_init_params(params)
        return DampedTraceState(count=zero_count(params),
                                trace=stats_like(params, accumulator_dtype))

    def damped_step(g, state, params, extra_args):
        # the buffer is 0 before the first step, so m_1 = β·0 + 1·g_1 = g_1 exactly
        if (not is_tracing() and state.count.device.type == "cpu"
                and isinstance(dampening, (int, float)) and isinstance(decay, (int, float))):
            # eager, the count read for free: torch's buf.mul_(μ).add_(g, alpha=1-τ), the
            # gradient's factor fused into the add (one rounding)
            keep_now = 1.0 if int(state.count) == 1 else 1 - dampening
            buf = (foreach_ if is_donating() else foreach)("mul", state.trace, decay)
            buf = foreach_("add", buf, cast_like(g, buf), alpha=keep_now)
            return nesterov_out(g, buf), replace_state(state, trace=buf)
        keep = torch.where(state.count == 1, torch.ones((), dtype=torch.float64,
                                                        device=state.count.device),
                           as_float64(1 - dampening, state.count))
        buf = foreach_scale_add(state.trace, decay,
                                foreach("mul", cast_like(g, state.trace), keep))
        return nesterov_out(g, buf), replace_state(state, trace=buf)

    return GradientTransformation(damped_init, leafwise(DampedTraceState, damped_step),
                                  ELEMENTWISE)


class EmaState(NamedTuple):
    """State of `ema`."""
    count: torch.Tensor  # shape (), int32: steps taken
    ema: Updates         # like params (fp32 for 16-bit leaves): the moving average
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, ema=Role.FIRST_MOMENT)


@declare(hyperparams={"decay": None})
def ema(decay: float, debias: bool = True,
        accumulator_dtype: torch.dtype | None = None, *,
        nesterov: bool = False) -> GradientTransformation:
    r"""Exponential moving average of the updates, optionally with a Nesterov look-ahead.

    .. math::
        a_t = \beta a_{t-1} + (1 - \beta) g_t, \qquad
        u_t = a_t / (1 - \beta^t) \quad(\text{or } a_t \text{ without debiasing})

    With ``nesterov=True`` the output looks one step ahead:
    :math:`u_t = \beta a_t + (1-\beta) g_t` without debiasing (``torch.optim.Muon``'s
    ``grad.lerp(buf, momentum)``), and with it optax's
    :math:`u_t = \beta a_t / (1-\beta^{t+1}) + (1-\beta) g_t / (1-\beta^t)`
    (``optax.contrib.scale_by_muon``'s momentum).

    Args:
      decay: :math:`\beta` in [0, 1).
      debias: divide by :math:`1 - \beta^t` to remove the bias of the zero start.
      accumulator_dtype: dtype of the average (default: the parameter's, fp32 for 16-bit).
      nesterov: output the Nesterov look-ahead instead of the average.

    Example:
      >>> tx = opttx.chain(opttx.ema(0.95, debias=False, nesterov=True), opttx.orthogonalize())
    """
    check_unit_interval("decay", decay)

    def init(params: Params) -> EmaState:
        check_init_params(params)
        return EmaState(count=zero_count(params), ema=stats_like(params, accumulator_dtype))

    def step(g, state, params, extra_args):
        avg = foreach_ema(state.ema, g, decay)
        if nesterov and debias:
            out = fresh_updates(_nesterov_or_debiased(avg, g, decay, state.count, True), g)
        elif nesterov:
            out = fresh_updates(foreach("lerp", cast_like(g, avg), avg, decay), g)
        elif debias:
            out = fresh_updates(_div_by(avg, debias_factor(decay, state.count)), g)
        else:
            out = cast_like(avg, g)
        return out, replace_state(state, ema=avg)

    return GradientTransformation(init, leafwise(EmaState, step), ELEMENTWISE)


# ---------------------------------------------------------------------------------------------
# Adam and NAdam
# ---------------------------------------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """State of `scale_by_adam`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): first moment
    nu: Updates          # like params (fp32 for 16-bit leaves): second moment
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


class ScaleByAmsgradState(NamedTuple):
    """State of `scale_by_adam` with ``amsgrad=True``."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): first moment
    nu: Updates          # like params (fp32 for 16-bit leaves): second moment
    nu_max: Updates      # like params, nu's dtype: running maximum of nu (not bias-corrected)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT,
                              nu_max=Role.SECOND_MOMENT)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "eps_root": None})
def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: torch.dtype | None = None, *,
                  nesterov: bool = False, bias_correction: bool = True,
                  nu_dtype: torch.dtype | None = None,
                  amsgrad: bool = False) -> GradientTransformation:
    r"""Rescale updates by Adam's bias-corrected moment estimates.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
        \hat m_t = \frac{m_t}{1-\beta_1^t}, \quad \hat v_t = \frac{v_t}{1-\beta_2^t}, \quad
        u_t = \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}

    With ``nesterov=True`` (NAdam as in optax),
    :math:`\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t / (1-\beta_1^t)`.

    With ``amsgrad=True`` (AMSGrad) the denominator uses the running maximum of the raw
    second moment, :math:`\bar v_t = \max(\bar v_{t-1}, v_t)` and
    :math:`\hat v_t = \bar v_t / (1-\beta_2^t)`: ``torch.optim.Adam(amsgrad=True)``'s
    ``max_exp_avg_sq``, same numbers. (optax's ``scale_by_amsgrad`` takes the maximum of the
    bias-corrected :math:`\hat v` instead, which differs while :math:`1-\beta_2^t` grows.)
    The state is then a `ScaleByAmsgradState` (one more buffer like the params).

    Args:
      b1: decay of the first moment, in [0, 1).
      b2: decay of the second moment, in [0, 1).
      eps: added to the denominator outside the square root (torch.optim's ``eps``).
      eps_root: added inside the square root (for differentiating through the update).
      mu_dtype: dtype of the first moment (default: fp32 for 16-bit leaves, else the leaf's).
      nesterov: use Nesterov momentum (NAdam).
      bias_correction: divide the moments by :math:`1-\beta^t` (off: use them raw, as
        ColossalAI's LAMB does by default).
      nu_dtype: dtype of the second moment (same default). ``mu_dtype=nu_dtype=torch.bfloat16``
        halves the state (4 instead of 8 bytes per parameter); the moments are then updated
        and used at bfloat16 precision.
      amsgrad: keep the running maximum of the second moment (torch's semantics, above).

    Returns:
      A `GradientTransformation`; same numbers as ``optax.scale_by_adam`` (and, with
      ``amsgrad=True``, as ``torch.optim.Adam(amsgrad=True)``).

    Example:
      >>> tx = opttx.chain(opttx.scale_by_adam(), opttx.scale_by_learning_rate(1e-3))
      >>> tx = opttx.chain(opttx.scale_by_adam(amsgrad=True), opttx.scale_by_learning_rate(1e-3))

    References:
      Kingma and Ba, Adam (arXiv 1412.6980); Dozat, NAdam (ICLR 2016 workshop);
      Reddi, Kale and Kumar, On the Convergence of Adam and Beyond (ICLR 2018) for AMSGrad.
    """
    _check_adam_args(b1, b2, eps, eps_root)
    if not isinstance(amsgrad, bool):
        raise TypeError(f"amsgrad must be a bool, got {amsgrad!r}.")
    fast_path = not nesterov and isinstance(eps_root, (int, float)) and eps_root == 0
    state_type = ScaleByAmsgradState if amsgrad else ScaleByAdamState

    def init(params: Params) -> ScaleByAdamState | ScaleByAmsgradState:
        check_init_params(params)
        moments = dict(count=zero_count(params), mu=stats_like(params, mu_dtype),
                       nu=stats_like(params, nu_dtype))
        if amsgrad:
            return ScaleByAmsgradState(**moments, nu_max=stats_like(params, nu_dtype))
        return ScaleByAdamState(**moments)

    def step(g, state, params, extra_args):
        mu = foreach_ema(state.mu, g, b1)
        nu = foreach_ema_sq(state.nu, g, b2)
        new_state = replace_state(state, mu=mu, nu=nu)
        if amsgrad:
            nu_max = new_buffers(state.nu_max, foreach("maximum", state.nu_max, nu))
            new_state = replace_state(new_state, nu_max=nu_max)
        else:
            nu_max = nu
        if bias_correction:
            bc1, bc2 = debias_factor(b1, state.count), debias_factor(b2, state.count)
        else:
            bc1 = bc2 = torch.ones((), dtype=torch.float64, device=state.count.device)
        if fast_path:
            # m̂ / (sqrt(v̂) + eps) == m / (sqrt(v) · bc1/sqrt(bc2) + eps · bc1): four passes.
            denom = foreach_op_("mul", foreach("sqrt", nu_max), bc1 / torch.sqrt(bc2))
            denom = foreach_op_("add", denom, eps * bc1)
            out = divide_consuming(cast_like(mu, nu), denom)
        else:
            if nesterov:
                c_mu = b1 / (debias_factor(b1, safe_increment(state.count))
                             if bias_correction else bc1)
                mu_hat = foreach("add", foreach("mul", mu, c_mu),
                                 foreach("mul", cast_like(g, mu), (1 - b1) / bc1))
            else:
                mu_hat = _div_by(mu, bc1)
            denom = foreach_op_("add", _div_by(nu_max, bc2), eps_root)
            denom = foreach_op_("add", foreach_op_("sqrt", denom), eps)
            out = divide_consuming(cast_like(mu_hat, nu), denom)
        return fresh_updates(out, g), new_state

    return GradientTransformation(init, leafwise(state_type, step), ELEMENTWISE)


class ScaleByNadamState(NamedTuple):
    """State of `scale_by_nadam`."""
    count: torch.Tensor       # shape (), int32: steps taken
    mu_product: torch.Tensor  # shape (), float64: product of the momentum schedule so far
    mu: Updates               # like params (fp32 for 16-bit leaves): first moment
    nu: Updates               # like params (fp32 for 16-bit leaves): second moment
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu_product=Role.SCALAR, mu=Role.FIRST_MOMENT,
                           nu=Role.SECOND_MOMENT)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "momentum_decay": None})
def scale_by_nadam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   momentum_decay: float = 4e-3,
                   mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""NAdam with Dozat's momentum schedule, as ``torch.optim.NAdam``.

    .. math::
        \mu_t = \beta_1 (1 - \tfrac12 \cdot 0.96^{t\psi}), \quad
        \Pi_t = \textstyle\prod_{i \le t} \mu_i, \quad
        u_t = \frac{1}{\sqrt{\hat v_t} + \epsilon}\left(
        \frac{(1-\mu_t)\, g_t}{1 - \Pi_t} + \frac{\mu_{t+1}\, m_t}{1 - \Pi_t \mu_{t+1}}\right)

    with :math:`m_t, v_t` Adam's moments and :math:`\hat v_t = v_t / (1-\beta_2^t)`.
    optax's ``nadam`` is instead `scale_by_adam` with ``nesterov=True``.

    Args:
      b1, b2, eps: as in `scale_by_adam`.
      momentum_decay: :math:`\psi` (torch's default 4e-3).
      mu_dtype: dtype of the first moment.

    References:
      Dozat, Incorporating Nesterov Momentum into Adam (ICLR 2016 workshop).
    """
    _check_adam_args(b1, b2, eps)
    check_nonnegative("momentum_decay", momentum_decay)

    def init(params: Params) -> ScaleByNadamState:
        check_init_params(params)
        count = zero_count(params)
        return ScaleByNadamState(count=count,
                                 mu_product=torch.ones((), dtype=torch.float64,
                                                       device=count.device),
                                 mu=stats_like(params, mu_dtype), nu=stats_like(params))

    def step(g, state, params, extra_args):
        t = _float64(state.count)
        b1_64 = b1.to(torch.float64) if isinstance(b1, torch.Tensor) else b1
        # 0.96^(t·ψ) written as exp(t·ψ·ln 0.96): a tensor expression with no Python-float base
        mu_t = b1_64 * (1 - 0.5 * torch.exp(t * (momentum_decay * _LOG_096)))
        mu_next = b1_64 * (1 - 0.5 * torch.exp((t + 1) * (momentum_decay * _LOG_096)))
        mu_product = state.mu_product * mu_t
        mu = foreach_ema(state.mu, g, b1)
        nu = foreach_ema_sq(state.nu, g, b2)
        denom = foreach_op_("sqrt", _div_by(nu, debias_factor(b2, state.count)))
        denom = foreach_op_("add", denom, eps)
        grad_part = foreach("mul", cast_like(g, nu), (1 - mu_t) / (1 - mu_product))
        mom_part = foreach("mul", cast_like(mu, nu), mu_next / (1 - mu_product * mu_next))
        out = foreach("div", foreach("add", grad_part, mom_part), denom)
        return fresh_updates(out, g), replace_state(state, mu_product=mu_product, mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByNadamState, step), ELEMENTWISE)


def _nesterov_or_debiased(mu: list[torch.Tensor], g: list[torch.Tensor], b1: Scalar,
                          count: torch.Tensor, nesterov: bool) -> list[torch.Tensor]:
    r""":math:`\hat m_t = m_t / (1-\beta_1^t)`, or with ``nesterov`` optax's
    :math:`\beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t / (1-\beta_1^t)`."""
    bc1 = debias_factor(b1, count)
    if not nesterov:
        return _div_by(mu, bc1)
    c_mu = b1 / debias_factor(b1, safe_increment(count))
    return foreach("add", foreach("mul", mu, c_mu),
                   foreach("mul", cast_like(g, mu), (1 - b1) / bc1))


# ---------------------------------------------------------------------------------------------
# RAdam, Adamax, AdaBelief
# ---------------------------------------------------------------------------------------------


class ScaleByRadamState(NamedTuple):
    """State of `scale_by_radam`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params (fp32 for 16-bit leaves): first moment
    nu: Updates          # like params (fp32 for 16-bit leaves): second moment
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "eps_root": None, "threshold": None})
def scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   eps_root: float = 0.0, threshold: float = 5.0, *, nesterov: bool = False,
                   eps_before_debias: bool = False) -> GradientTransformation:
    r"""Rectified Adam: Adam's step where the variance of its adaptive rate is tractable,
    momentum alone before.

    .. math::
        \rho_\infty = \frac{2}{1-\beta_2} - 1, \quad
        \rho_t = \rho_\infty - \frac{2 t \beta_2^t}{1 - \beta_2^t}, \quad
        r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}{(\rho_\infty-4)(\rho_\infty-2)\rho_t}}

    .. math::
        u_t = \begin{cases} r_t\, \hat m_t / (\sqrt{\hat v_t + \epsilon_{root}} + \epsilon)
        & \rho_t \ge \text{threshold} \\ \hat m_t & \text{otherwise} \end{cases}

    with :math:`\hat m_t, \hat v_t` Adam's bias-corrected moments (see `scale_by_adam`;
    ``nesterov`` as there). With ``eps_before_debias=True`` the adaptive factor is
    :math:`r_t \sqrt{1-\beta_2^t} / (\sqrt{v_t + \epsilon_{root}} + \epsilon)`:
    :math:`\epsilon` added before the bias correction, as ``torch.optim.RAdam`` computes it
    (it also compares
    :math:`\rho_t > 5` strictly; :math:`\rho_t` is never exactly 5 in floating point).

    Args:
      b1, b2: decays of the moments, in [0, 1).
      eps: added to the denominator outside the square root.
      eps_root: added inside the square root.
      threshold: the :math:`\rho_t` from which the rectified step is taken (5, as the paper).
      nesterov: use Nesterov momentum (optax's NAdam-style :math:`\hat m_t`).
      eps_before_debias: torch.optim.RAdam's placement of ``eps``.

    Returns:
      A `GradientTransformation`; same numbers as ``optax.scale_by_radam`` (and with
      ``eps_before_debias=True``, as ``torch.optim.RAdam``).

    Example:
      >>> tx = opttx.chain(opttx.scale_by_radam(), opttx.scale_by_learning_rate(1e-3))

    References:
      Liu et al., On the Variance of the Adaptive Learning Rate and Beyond
      (arXiv 1908.03265).
    """
    _check_adam_args(b1, b2, eps, eps_root)
    check_nonnegative("threshold", threshold)

    init = _moments_init(ScaleByRadamState)

    def step(g, state, params, extra_args):
        mu = foreach_ema(state.mu, g, b1)
        nu = foreach_ema_sq(state.nu, g, b2)
        t = _float64(state.count)
        b2_64 = b2.to(torch.float64) if isinstance(b2, torch.Tensor) else b2
        b2t = float64_power(b2_64, t)
        bc2 = 1 - b2t
        rho_inf = 2 / (1 - b2_64) - 1
        rho = rho_inf - 2 * t * b2t / bc2
        tractable = rho >= threshold
        # r_t where the rectified step is taken, 0 elsewhere (no NaN from sqrt of a negative)
        ratio = (rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho)
        rect = torch.where(tractable, torch.sqrt(torch.clamp(ratio, min=0)),
                           torch.zeros_like(ratio))
        mu_hat = _nesterov_or_debiased(mu, g, b1, state.count, nesterov)
        if eps_before_debias:
            denom = foreach_op_("add", foreach_op_("sqrt", foreach("add", nu, eps_root)), eps)
            adaptive = foreach("mul", cast_like(mu_hat, nu), rect * torch.sqrt(bc2))
        else:
            denom = foreach_op_("add", _div_by(nu, bc2), eps_root)
            denom = foreach_op_("add", foreach_op_("sqrt", denom), eps)
            adaptive = foreach("mul", cast_like(mu_hat, nu), rect)
        adaptive = divide_consuming(adaptive, denom)
        out = [torch.where(tractable, a, m.to(a.dtype)) for a, m in zip(adaptive, mu_hat)]
        return fresh_updates(out, g), replace_state(state, mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByRadamState, step), ELEMENTWISE)


class ScaleByAdamaxState(NamedTuple):
    """State of `scale_by_adamax`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params (fp32 for 16-bit leaves): first moment
    nu: Updates          # like params (fp32 for 16-bit leaves): decayed maximum of |g| + eps
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "eps": HyperRole.EPS})
def scale_by_adamax(b1: float = 0.9, b2: float = 0.999,
                    eps: float = 1e-8) -> GradientTransformation:
    r"""Adamax: Adam with the infinity norm in place of the second moment.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
        v_t = \max(\beta_2 v_{t-1},\ |g_t| + \epsilon), \quad
        u_t = \frac{m_t}{(1-\beta_1^t)\, v_t}

    (:math:`v_t` needs no bias correction.)

    Args:
      b1: decay of the first moment, in [0, 1).
      b2: decay of the infinity norm, in [0, 1).
      eps: added to :math:`|g_t|` (keeps :math:`v_t > 0`).

    Returns:
      A `GradientTransformation`; same numbers as ``optax.scale_by_adamax`` and
      ``torch.optim.Adamax``.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_adamax(), opttx.scale_by_learning_rate(2e-3))

    References:
      Kingma and Ba, Adam (arXiv 1412.6980), section 7.
    """
    _check_adam_args(b1, b2, eps)

    init = _moments_init(ScaleByAdamaxState)

    def step(g, state, params, extra_args):
        mu = foreach_ema(state.mu, g, b1)
        magnitude = foreach_op_("add", foreach("abs", cast_like(g, state.nu)), eps)
        nu = new_buffers(state.nu, foreach("maximum", foreach("mul", state.nu, b2),
                                           magnitude))
        out = _div_by(foreach("div", cast_like(mu, nu), nu), debias_factor(b1, state.count))
        return fresh_updates(out, g), replace_state(state, mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByAdamaxState, step), ELEMENTWISE)


class ScaleByBeliefState(NamedTuple):
    """State of `scale_by_belief`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params (fp32 for 16-bit leaves): first moment
    nu: Updates          # like params (fp32 for 16-bit leaves): EMA of (g - m)² (+ eps_root)
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "eps_root": None})
def scale_by_belief(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16,
                    eps_root: float = 1e-16, *, nesterov: bool = False
                    ) -> GradientTransformation:
    r"""AdaBelief: Adam whose second moment is the EMA of the squared prediction error
    :math:`g_t - m_t` (the "belief" in the observed gradient).

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
        s_t = \beta_2 s_{t-1} + (1-\beta_2) (g_t - m_t)^2 + \epsilon_{root}, \quad
        u_t = \frac{\hat m_t}{\sqrt{s_t / (1-\beta_2^t)} + \epsilon}

    (:math:`\epsilon_{root}` is added to the stored :math:`s_t`, as optax does;
    :math:`\hat m_t` as in `scale_by_adam`, ``nesterov`` included.)

    Args:
      b1, b2: decays of the moments, in [0, 1).
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment every step.
      nesterov: use Nesterov momentum.

    Returns:
      A `GradientTransformation`; same numbers and defaults as ``optax.scale_by_belief``
      (the paper's are ``eps=1e-8, eps_root=0``).

    Example:
      >>> tx = opttx.chain(opttx.scale_by_belief(), opttx.scale_by_learning_rate(1e-3))

    References:
      Zhuang et al., AdaBelief Optimizer (arXiv 2010.07468).
    """
    _check_adam_args(b1, b2, eps, eps_root)

    init = _moments_init(ScaleByBeliefState)

    def step(g, state, params, extra_args):
        mu = foreach_ema(state.mu, g, b1)
        error = foreach("sub", cast_like(g, mu), mu)
        nu = foreach_ema_sq(state.nu, error, b2)
        if not (isinstance(eps_root, (int, float)) and eps_root == 0):
            nu = foreach_op_("add", nu, eps_root)
        mu_hat = _nesterov_or_debiased(mu, g, b1, state.count, nesterov)
        denom = foreach_op_("sqrt", _div_by(nu, debias_factor(b2, state.count)))
        denom = foreach_op_("add", denom, eps)
        out = divide_consuming(cast_like(mu_hat, nu), denom)
        return fresh_updates(out, g), replace_state(state, mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByBeliefState, step), ELEMENTWISE)


# ---------------------------------------------------------------------------------------------
# RMSprop family and Adagrad
# ---------------------------------------------------------------------------------------------


def _divide_by_root(g: list[torch.Tensor], stat: list[torch.Tensor], eps: Scalar,
                    eps_in_sqrt: bool) -> list[torch.Tensor]:
    """``g / sqrt(stat + eps)`` or ``g / (sqrt(stat) + eps)``, in the dtype of ``stat``."""
    if eps_in_sqrt:
        denom = foreach_op_("sqrt", foreach("add", stat, eps))
    else:
        denom = foreach_op_("add", foreach("sqrt", stat), eps)
    return divide_consuming(cast_like(g, stat), denom)


class ScaleByRmsState(NamedTuple):
    """State of `scale_by_rms`."""
    count: torch.Tensor  # shape (), int32: steps taken
    nu: Updates          # like params (fp32 for 16-bit leaves): EMA of squared updates
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, nu=Role.SECOND_MOMENT)


@declare(hyperparams={"decay": HyperRole.RMS_DECAY, "eps": HyperRole.EPS, "initial_scale": None})
def scale_by_rms(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
                 eps_in_sqrt: bool = True, bias_correction: bool = False
                 ) -> GradientTransformation:
    r"""Rescale by the root of an EMA of squared updates (RMSprop).

    .. math::
        \nu_t = \beta \nu_{t-1} + (1-\beta) g_t^2, \qquad
        u_t = g_t / \sqrt{\hat\nu_t + \epsilon}
        \quad(\text{or } g_t / (\sqrt{\hat\nu_t} + \epsilon) \text{ with }
        \texttt{eps\_in\_sqrt=False})

    where :math:`\hat\nu_t = \nu_t / (1-\beta^t)` with ``bias_correction`` and
    :math:`\nu_t` otherwise.

    Args:
      decay: :math:`\beta` in [0, 1) (torch.optim.RMSprop calls it ``alpha``).
      eps: regulariser of the denominator.
      initial_scale: starting value of :math:`\nu`.
      eps_in_sqrt: ``eps`` inside the root (optax's default) or outside (torch.optim's).
      bias_correction: debias :math:`\nu` as Adam does.

    Inside `opttx.graft` the statistics come from the raw gradient and the division is applied
    to the filtered gradient (``extra_args[PRECONDITION_INPUT]``).

    References:
      Tieleman and Hinton, Lecture 6.5 (2012).
    """
    check_unit_interval("decay", decay)
    check_nonnegative("eps", eps)

    def init(params: Params) -> ScaleByRmsState:
        check_init_params(params)
        return ScaleByRmsState(count=zero_count(params),
                               nu=stats_like(params, value=initial_scale))

    def step(g, state, params, extra_args):
        nu = foreach_ema_sq(state.nu, g, decay)
        nu_hat = _div_by(nu, debias_factor(decay, state.count)) if bias_correction else nu
        out = _divide_by_root(precondition_leaves(g, extra_args), nu_hat, eps, eps_in_sqrt)
        return fresh_updates(out, g), replace_state(state, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByRmsState, step), PRECONDITIONER)



class ScaleByStddevState(NamedTuple):
    """State of `scale_by_stddev`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params (fp32 for 16-bit leaves): EMA of updates
    nu: Updates          # like params (fp32 for 16-bit leaves): EMA of squared updates
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


@declare(hyperparams={"decay": HyperRole.RMS_DECAY, "eps": HyperRole.EPS, "initial_scale": None})
def scale_by_stddev(decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0,
                    eps_in_sqrt: bool = True, bias_correction: bool = False
                    ) -> GradientTransformation:
    r"""Rescale by the centred root mean square (centred RMSprop).

    .. math::
        \mu_t = \beta \mu_{t-1} + (1-\beta) g_t, \quad
        \nu_t = \beta \nu_{t-1} + (1-\beta) g_t^2, \quad
        u_t = g_t / \sqrt{\nu_t - \mu_t^2 + \epsilon}

    (``eps`` outside the root with ``eps_in_sqrt=False``, as ``torch.optim.RMSprop(centered=True)``).

    References:
      Graves, Generating Sequences With Recurrent Neural Networks (arXiv 1308.0850).
    """
    check_unit_interval("decay", decay)
    check_nonnegative("eps", eps)

    def init(params: Params) -> ScaleByStddevState:
        check_init_params(params)
        return ScaleByStddevState(count=zero_count(params), mu=stats_like(params),
                                  nu=stats_like(params, value=initial_scale))

    def step(g, state, params, extra_args):
        mu = foreach_ema(state.mu, g, decay)
        nu = foreach_ema_sq(state.nu, g, decay)
        if bias_correction:
            bc = debias_factor(decay, state.count)
            mu_hat, nu_hat = _div_by(mu, bc), _div_by(nu, bc)
        else:
            mu_hat, nu_hat = mu, nu
        variance = foreach("sub", nu_hat, foreach("mul", mu_hat, mu_hat))
        out = _divide_by_root(g, variance, eps, eps_in_sqrt)
        return fresh_updates(out, g), replace_state(state, mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByStddevState, step), ELEMENTWISE)


class ScaleByRssState(NamedTuple):
    """State of `scale_by_rss`."""
    sum_of_squares: Updates  # like params (fp32 for 16-bit leaves): running sum of g²
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(sum_of_squares=Role.SECOND_MOMENT)


@declare(hyperparams={"initial_accumulator_value": None, "eps": HyperRole.EPS})
def scale_by_rss(initial_accumulator_value: float = 0.1, eps: float = 1e-7,
                 eps_in_sqrt: bool = True) -> GradientTransformation:
    r"""Rescale by the root of the running sum of squared updates (Adagrad).

    .. math::
        s_t = s_{t-1} + g_t^2, \qquad u_t = g_t / \sqrt{s_t + \epsilon}
        \quad(\text{or } g_t / (\sqrt{s_t} + \epsilon) \text{ with } \texttt{eps\_in\_sqrt=False})

    Where :math:`s_t = 0` the update is 0. ``eps_in_sqrt=False`` with
    ``initial_accumulator_value=0`` and ``eps=1e-10`` is ``torch.optim.Adagrad``.

    References:
      Duchi, Hazan and Singer, JMLR 2011.
    """
    check_nonnegative("initial_accumulator_value", initial_accumulator_value)
    check_nonnegative("eps", eps)

    def init(params: Params) -> ScaleByRssState:
        check_init_params(params)
        return ScaleByRssState(
            sum_of_squares=stats_like(params, value=initial_accumulator_value))

    def step(g, state, params, extra_args):
        sos = foreach_accumulate_sq(state.sum_of_squares, g)
        out = _divide_by_root(precondition_leaves(g, extra_args), sos, eps, eps_in_sqrt)
        if not (isinstance(eps, (int, float)) and eps > 0):
            out = [torch.where(s > 0, u, torch.zeros_like(u)) for s, u in zip(sos, out)]
        return fresh_updates(out, g), replace_state(state, sum_of_squares=sos)

    return GradientTransformation(init, leafwise(ScaleByRssState, step), PRECONDITIONER)


# ---------------------------------------------------------------------------------------------
# Lion
# ---------------------------------------------------------------------------------------------


class ScaleByLionState(NamedTuple):
    """State of `scale_by_lion`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): momentum
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT)


@declare(hyperparams={"b1": HyperRole.B1, "b2": HyperRole.B2})
def scale_by_lion(b1: float = 0.9, b2: float = 0.99,
                  mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Lion's sign update.

    .. math::
        c_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad u_t = \mathrm{sign}(c_t), \quad
        m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

    Args:
      b1: interpolation of the update, in [0, 1).
      b2: decay of the momentum, in [0, 1).
      mu_dtype: dtype of the momentum.

    References:
      Chen et al., Symbolic Discovery of Optimization Algorithms (arXiv 2302.06675).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)

    def init(params: Params) -> ScaleByLionState:
        check_init_params(params)
        return ScaleByLionState(count=zero_count(params), mu=stats_like(params, mu_dtype))

    def step(g, state, params, extra_args):
        g_mu = cast_like(g, state.mu)
        direction = signs(foreach("lerp", state.mu, g_mu, 1 - b1))   # non-finite: NaN
        return fresh_updates(direction, g), replace_state(state, mu=foreach_ema(state.mu, g_mu, b2))

    return GradientTransformation(init, leafwise(ScaleByLionState, step), ELEMENTWISE)
