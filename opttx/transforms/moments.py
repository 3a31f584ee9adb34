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
from ..base import (ELEMENTWISE, PRECONDITIONER, GradientTransformation, Params, Role, Updates,
                    check_init_params, declare_roles, leafwise, precondition_leaves,
                    safe_increment, zero_count)
from ..kernels import (Scalar, cast_like, foreach, foreach_, foreach_accumulate_sq, foreach_ema,
                       foreach_ema_sq, foreach_op_, foreach_scale_add, mark_scratch)
from ..tree import stats_like

__all__ = [
    "EmaState",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByNadamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "ScaleByStddevState",
    "TraceState",
    "ema",
    "scale_by_adam",
    "scale_by_lion",
    "scale_by_nadam",
    "scale_by_rms",
    "scale_by_rss",
    "scale_by_stddev",
    "trace",
]


_LOG_096 = math.log(0.96)


def _float64(count: torch.Tensor) -> torch.Tensor:
    return count.to(torch.float64)


def _pow(base: Scalar, exponent: torch.Tensor) -> torch.Tensor:
    """``base ** exponent`` as a float64 0-dim tensor (``base`` a number or 0-dim tensor)."""
    if isinstance(base, torch.Tensor):
        base = base.to(torch.float64)
    return torch.pow(base, exponent)


def debias_factor(decay: Scalar, count: torch.Tensor) -> torch.Tensor:
    """``1 − decay^count`` in float64 (``count`` the 1-based step)."""
    return 1 - _pow(decay, _float64(count))


def _div_by(tensors: list[torch.Tensor], divisor: Scalar) -> list[torch.Tensor]:
    return foreach("div", tensors, divisor)


def _divide(numerators: list[torch.Tensor], denominators: list[torch.Tensor]
            ) -> list[torch.Tensor]:
    """``numerators / denominators``, overwriting the denominators (temporaries the caller
    owns). In eager mode as ``reciprocal_`` then ``mul_``: one more pass but no new
    parameter-sized allocation, which on CPU costs more than a pass in page faults."""
    if torch.compiler.is_compiling():
        return foreach("div", numerators, denominators)
    foreach_("reciprocal", denominators)
    return foreach_("mul", denominators, numerators)


def _fresh(out: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """New update tensors, cast to the gradients' dtypes and registered as temporaries that
    later links of the chain may overwrite (see `opttx.kernels.mark_scratch`)."""
    return mark_scratch(cast_like(out, like))


# ---------------------------------------------------------------------------------------------
# momentum and averages
# ---------------------------------------------------------------------------------------------


class TraceState(NamedTuple):
    """State of `trace`."""
    trace: Updates  # like params (fp32 for 16-bit leaves): the momentum buffer
    __roles__ = declare_roles(trace=Role.FIRST_MOMENT)


def trace(decay: float, nesterov: bool = False,
          accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Momentum (heavy ball, or Nesterov's variant).

    .. math::
        m_t = g_t + \beta m_{t-1}, \qquad
        u_t = m_t \quad(\text{or } g_t + \beta m_t \text{ with } \texttt{nesterov})

    With ``m_0 = 0`` this equals ``torch.optim.SGD``'s momentum buffer (dampening 0).

    Args:
      decay: the momentum coefficient :math:`\beta` (>= 0).
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the buffer (default: the parameter's, fp32 for 16-bit).

    Example:
      >>> tx = opttx.chain(opttx.trace(0.9), opttx.scale_by_learning_rate(0.1))

    References:
      Polyak (1964); Sutskever et al., ICML 2013.
    """
    check_nonnegative("decay", decay)

    def init(params: Params) -> TraceState:
        check_init_params(params)
        return TraceState(trace=stats_like(params, accumulator_dtype))

    def step(g, state, params, extra_args):
        buf = foreach_scale_add(state.trace, decay, cast_like(g, state.trace))
        if nesterov:
            out = _fresh(foreach("add", cast_like(g, buf), foreach("mul", buf, decay)), g)
        else:
            out = cast_like(buf, g)      # aliases the state: not a temporary
        return out, state._replace(trace=buf)

    return GradientTransformation(init, leafwise(TraceState, step), ELEMENTWISE)


class EmaState(NamedTuple):
    """State of `ema`."""
    count: torch.Tensor  # shape (), int32: steps taken
    ema: Updates         # like params (fp32 for 16-bit leaves): the moving average
    __roles__ = declare_roles(count=Role.COUNT, ema=Role.FIRST_MOMENT)


def ema(decay: float, debias: bool = True,
        accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Exponential moving average of the updates.

    .. math::
        a_t = \beta a_{t-1} + (1 - \beta) g_t, \qquad
        u_t = a_t / (1 - \beta^t) \quad(\text{or } a_t \text{ without debiasing})

    Args:
      decay: :math:`\beta` in [0, 1).
      debias: divide by :math:`1 - \beta^t` to remove the bias of the zero start.
      accumulator_dtype: dtype of the average (default: the parameter's, fp32 for 16-bit).
    """
    check_unit_interval("decay", decay)

    def init(params: Params) -> EmaState:
        check_init_params(params)
        return EmaState(count=zero_count(params), ema=stats_like(params, accumulator_dtype))

    def step(g, state, params, extra_args):
        avg = foreach_ema(state.ema, g, decay)
        out = _fresh(_div_by(avg, debias_factor(decay, state.count)), g) if debias else \
            cast_like(avg, g)
        return out, state._replace(ema=avg)

    return GradientTransformation(init, leafwise(EmaState, step), ELEMENTWISE)


# ---------------------------------------------------------------------------------------------
# Adam and NAdam
# ---------------------------------------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """State of `scale_by_adam`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): first moment
    nu: Updates          # like params (fp32 for 16-bit leaves): second moment
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: torch.dtype | None = None, *,
                  nesterov: bool = False, bias_correction: bool = True,
                  nu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Rescale updates by Adam's bias-corrected moment estimates.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \quad
        \hat m_t = \frac{m_t}{1-\beta_1^t}, \quad \hat v_t = \frac{v_t}{1-\beta_2^t}, \quad
        u_t = \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}

    With ``nesterov=True`` (NAdam as in optax),
    :math:`\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t / (1-\beta_1^t)`.

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

    Returns:
      A `GradientTransformation`; same numbers as ``optax.scale_by_adam``.

    Example:
      >>> tx = opttx.chain(opttx.scale_by_adam(), opttx.scale_by_learning_rate(1e-3))

    References:
      Kingma and Ba, Adam (arXiv 1412.6980); Dozat, NAdam (ICLR 2016 workshop).
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_nonnegative("eps", eps)
    check_nonnegative("eps_root", eps_root)
    fast_path = not nesterov and isinstance(eps_root, (int, float)) and eps_root == 0

    def init(params: Params) -> ScaleByAdamState:
        check_init_params(params)
        return ScaleByAdamState(count=zero_count(params), mu=stats_like(params, mu_dtype),
                                nu=stats_like(params, nu_dtype))

    def step(g, state, params, extra_args):
        mu = foreach_ema(state.mu, g, b1)
        nu = foreach_ema_sq(state.nu, g, b2)
        if bias_correction:
            bc1, bc2 = debias_factor(b1, state.count), debias_factor(b2, state.count)
        else:
            bc1 = bc2 = torch.ones((), dtype=torch.float64, device=state.count.device)
        if fast_path:
            # m̂ / (sqrt(v̂) + eps) == m / (sqrt(v) · bc1/sqrt(bc2) + eps · bc1): four passes.
            denom = foreach_op_("mul", foreach("sqrt", nu), bc1 / torch.sqrt(bc2))
            denom = foreach_op_("add", denom, eps * bc1)
            out = _divide(cast_like(mu, nu), denom)
        else:
            if nesterov:
                c_mu = b1 / (debias_factor(b1, safe_increment(state.count))
                             if bias_correction else bc1)
                mu_hat = foreach("add", foreach("mul", mu, c_mu),
                                 foreach("mul", cast_like(g, mu), (1 - b1) / bc1))
            else:
                mu_hat = _div_by(mu, bc1)
            denom = foreach_op_("add", _div_by(nu, bc2), eps_root)
            denom = foreach_op_("add", foreach_op_("sqrt", denom), eps)
            out = _divide(cast_like(mu_hat, nu), denom)
        return _fresh(out, g), state._replace(mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByAdamState, step), ELEMENTWISE)


class ScaleByNadamState(NamedTuple):
    """State of `scale_by_nadam`."""
    count: torch.Tensor       # shape (), int32: steps taken
    mu_product: torch.Tensor  # shape (), float64: product of the momentum schedule so far
    mu: Updates               # like params (fp32 for 16-bit leaves): first moment
    nu: Updates               # like params (fp32 for 16-bit leaves): second moment
    __roles__ = declare_roles(count=Role.COUNT, mu_product=Role.SCALAR, mu=Role.FIRST_MOMENT,
                           nu=Role.SECOND_MOMENT)


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
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_nonnegative("eps", eps)
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
        return _fresh(out, g), state._replace(mu_product=mu_product, mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByNadamState, step), ELEMENTWISE)


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
    return _divide(cast_like(g, stat), denom)


class ScaleByRmsState(NamedTuple):
    """State of `scale_by_rms`."""
    count: torch.Tensor  # shape (), int32: steps taken
    nu: Updates          # like params (fp32 for 16-bit leaves): EMA of squared updates
    __roles__ = declare_roles(count=Role.COUNT, nu=Role.SECOND_MOMENT)


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
        return _fresh(out, g), state._replace(nu=nu)

    return GradientTransformation(init, leafwise(ScaleByRmsState, step), PRECONDITIONER)



class ScaleByStddevState(NamedTuple):
    """State of `scale_by_stddev`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params (fp32 for 16-bit leaves): EMA of updates
    nu: Updates          # like params (fp32 for 16-bit leaves): EMA of squared updates
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT, nu=Role.SECOND_MOMENT)


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
        return _fresh(out, g), state._replace(mu=mu, nu=nu)

    return GradientTransformation(init, leafwise(ScaleByStddevState, step), ELEMENTWISE)


class ScaleByRssState(NamedTuple):
    """State of `scale_by_rss`."""
    sum_of_squares: Updates  # like params (fp32 for 16-bit leaves): running sum of g²
    __roles__ = declare_roles(sum_of_squares=Role.SECOND_MOMENT)


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
        return _fresh(out, g), state._replace(sum_of_squares=sos)

    return GradientTransformation(init, leafwise(ScaleByRssState, step), PRECONDITIONER)


# ---------------------------------------------------------------------------------------------
# Lion
# ---------------------------------------------------------------------------------------------


class ScaleByLionState(NamedTuple):
    """State of `scale_by_lion`."""
    count: torch.Tensor  # shape (), int32: steps taken
    mu: Updates          # like params, mu_dtype (fp32 for 16-bit leaves): momentum
    __roles__ = declare_roles(count=Role.COUNT, mu=Role.FIRST_MOMENT)


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
        direction = foreach_op_("sign", foreach("lerp", state.mu, g_mu, 1 - b1))
        return _fresh(direction, g), state._replace(mu=foreach_ema(state.mu, g_mu, b2))

    return GradientTransformation(init, leafwise(ScaleByLionState, step), ELEMENTWISE)
