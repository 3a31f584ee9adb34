"""Ready-made optimizers composed from transforms, with optax's names, arguments and defaults.

Each alias is a `chain` of public transforms, so its state can be inspected link by link and
any piece swapped. Where torch.optim's numbers differ from optax's defaults, the docstring
says which arguments give torch's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import GradientTransformation
from .combine import chain
from .schedules import Schedule
from .transforms.moments import (scale_by_adam, scale_by_lion, scale_by_nadam, scale_by_rms,
                                 scale_by_rss, scale_by_stddev, trace)
from .transforms.scaling import add_decayed_weights, scale_by_learning_rate
from .tree import PyTree

__all__ = ["adagrad", "adam", "adamw", "lion", "nadam", "rmsprop", "sgd"]

ScalarOrSchedule = float | torch.Tensor | Schedule
Mask = PyTree | Callable[[PyTree], PyTree] | None


def sgd(learning_rate: ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Stochastic gradient descent, with optional (Nesterov) momentum.

    .. math::
        m_t = g_t + \mu m_{t-1}, \qquad x_{t+1} = x_t - \eta\, m_t
        \quad(\text{Nesterov: } x_{t+1} = x_t - \eta (g_t + \mu m_t))

    Same numbers as ``torch.optim.SGD(lr, momentum, nesterov=...)`` (dampening 0). torch's
    ``weight_decay`` (L2) is ``chain(add_decayed_weights(wd), sgd(...))``.

    Example:
      >>> tx = opttx.sgd(0.1, momentum=0.9, nesterov=True)

    References:
      Robbins and Monro (1951); Sutskever et al., ICML 2013.
    """
    links = []
    if momentum is not None:
        links.append(trace(decay=momentum, nesterov=nesterov,
                           accumulator_dtype=accumulator_dtype))
    links.append(scale_by_learning_rate(learning_rate))
    return chain(*links)


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: torch.dtype | None = None, *,
         nesterov: bool = False) -> GradientTransformation:
    r"""Adam: `scale_by_adam` then `scale_by_learning_rate`.

    .. math::
        x_{t+1} = x_t - \eta\, \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}

    Same numbers as ``torch.optim.Adam(lr, betas=(b1, b2), eps)``; torch's L2
    ``weight_decay`` is ``chain(add_decayed_weights(wd), adam(...))``.

    Example:
      >>> tx = opttx.adam(1e-3)

    References:
      Kingma and Ba, Adam (arXiv 1412.6980).
    """
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: torch.dtype | None = None,
          weight_decay: float = 1e-4, mask: Mask = None, *,
          nesterov: bool = False) -> GradientTransformation:
    r"""Adam with decoupled weight decay.

    .. math::
        x_{t+1} = x_t - \eta \left(\frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}
        + \lambda x_t\right)

    The decay is scaled by the learning rate, as in ``torch.optim.AdamW`` (which multiplies
    ``p`` by :math:`1 - \eta\lambda` first): same numbers for the same arguments. Note the
    defaults differ: optax's (kept here) ``weight_decay=1e-4``, torch's 1e-2.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2, eps, eps_root, mu_dtype, nesterov: as in `scale_by_adam`.
      weight_decay: :math:`\lambda`.
      mask: where to apply the decay (tree of booleans or a function of the params).

    Example:
      >>> tx = opttx.adamw(3e-4, weight_decay=0.1,
      ...                  mask=lambda p: {k: v.ndim > 1 for k, v in p.items()})

    References:
      Loshchilov and Hutter, Decoupled Weight Decay Regularization (arXiv 1711.05101).
    """
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


def nadam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: torch.dtype | None = None,
          momentum_decay: float | None = None) -> GradientTransformation:
    r"""NAdam: Adam with Nesterov momentum.

    By default optax's NAdam (`scale_by_adam` with ``nesterov=True``). With
    ``momentum_decay`` set (torch's default is 4e-3) it is ``torch.optim.NAdam`` with Dozat's
    momentum schedule (`scale_by_nadam`), same numbers.

    Example:
      >>> tx = opttx.nadam(2e-3, momentum_decay=4e-3)   # as torch.optim.NAdam(lr=2e-3)

    References:
      Dozat, Incorporating Nesterov Momentum into Adam (ICLR 2016 workshop).
    """
    if momentum_decay is not None:
        if eps_root:
            raise ValueError("eps_root is not supported with momentum_decay (torch's NAdam).")
        direction = scale_by_nadam(b1, b2, eps, momentum_decay, mu_dtype)
    else:
        direction = scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=True)
    return chain(direction, scale_by_learning_rate(learning_rate))


def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1,
            eps: float = 1e-7, eps_in_sqrt: bool = True) -> GradientTransformation:
    r"""Adagrad: `scale_by_rss` then `scale_by_learning_rate`.

    .. math::
        s_t = s_{t-1} + g_t^2, \qquad x_{t+1} = x_t - \eta\, g_t / \sqrt{s_t + \epsilon}

    optax's defaults. ``torch.optim.Adagrad(lr)`` is
    ``adagrad(lr, initial_accumulator_value=0.0, eps=1e-10, eps_in_sqrt=False)``; its
    ``lr_decay`` is the schedule ``lambda t: lr / (1 + t * lr_decay)``.

    References:
      Duchi, Hazan and Singer, JMLR 2011.
    """
    return chain(scale_by_rss(initial_accumulator_value, eps, eps_in_sqrt),
                 scale_by_learning_rate(learning_rate))


def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9, eps: float = 1e-8,
            initial_scale: float = 0.0, eps_in_sqrt: bool = True, centered: bool = False,
            momentum: float | None = None, nesterov: bool = False,
            bias_correction: bool = False) -> GradientTransformation:
    r"""RMSprop, optionally centred and with momentum (applied after the learning rate).

    .. math::
        \nu_t = \beta \nu_{t-1} + (1-\beta) g_t^2, \quad
        x_{t+1} = x_t - \eta\, g_t / \sqrt{\nu_t + \epsilon}

    optax's defaults. ``torch.optim.RMSprop(lr, alpha, eps, momentum, centered)`` is
    ``rmsprop(lr, decay=alpha, eps=eps, eps_in_sqrt=False, momentum=momentum or None,
    centered=centered)``.

    References:
      Tieleman and Hinton, Lecture 6.5 (2012); Graves (arXiv 1308.0850) for ``centered``.
    """
    if centered:
        direction = scale_by_stddev(decay, eps, initial_scale, eps_in_sqrt, bias_correction)
    else:
        direction = scale_by_rms(decay, eps, initial_scale, eps_in_sqrt, bias_correction)
    links: list[Any] = [direction, scale_by_learning_rate(learning_rate)]
    if momentum is not None:
        links.append(trace(decay=momentum, nesterov=nesterov))
    return chain(*links)


def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
         mu_dtype: torch.dtype | None = None, weight_decay: float = 1e-3,
         mask: Mask = None) -> GradientTransformation:
    r"""Lion: the sign of an interpolated momentum, with decoupled weight decay.

    .. math::
        x_{t+1} = x_t - \eta\left(\mathrm{sign}(\beta_1 m_{t-1} + (1-\beta_1) g_t)
        + \lambda x_t\right), \quad m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

    Use a learning rate 3–10× smaller than AdamW's and a larger weight decay.

    References:
      Chen et al., Symbolic Discovery of Optimization Algorithms (arXiv 2302.06675).
    """
    return chain(scale_by_lion(b1, b2, mu_dtype), add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))
