"""Ready-made optimizers composed from transforms, with optax's names, arguments and defaults.

Each alias is a `chain` of public transforms, so its state can be inspected link by link and
any piece swapped. Where torch.optim's numbers differ from optax's defaults, the docstring
says which arguments give torch's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal

import torch

from .base import GradientTransformation, HyperRole, declare, identity
from .combine import chain, masked, partition
from .kernels import is_fixed_zero, is_live
from .schedules import Schedule
from .transforms.ademamix import scale_by_ademamix
from .transforms.adopt import scale_by_adopt
from .transforms.blocking import block_by_dims
from .transforms.block_periodic import BlockGrid, orthogonalize_block_periodic
from .transforms.dion import scale_by_dion, scale_by_dion2
from .transforms.factored import (FactorAxes, add_step_scaled_decayed_weights, clip_by_rms,
                                  clip_by_rms_and_scale_by_param_rms, relative_step_schedule,
                                  scale_by_came, scale_by_factored_rms, scale_by_param_block_rms,
                                  scale_by_trust_ratio)
from .transforms.grafting import graft, scale_by_grafted_diagonal
from .transforms.hyperball import hyperball_step
from .transforms.kron import MemorySaveMode, scale_by_kron
from .transforms.lowrank import MatrixAxes, ProjType, project_lowrank
from .transforms.mars import scale_by_mars
from .transforms.moments import (debias_factor, ema, scale_by_adam, scale_by_adamax,
                                 scale_by_belief, scale_by_lion, scale_by_nadam, scale_by_radam,
                                 scale_by_rms, scale_by_rss, scale_by_stddev, trace)
from .transforms.muon_clip import clip_qk
from .transforms.normuon import scale_by_neuron_rms, scale_to_orthogonal_norm
from .transforms.orthogonalize import (NS_COEFFS, Method, ShardedMode, orthogonalize,
                                      scale_by_shape)
from .transforms.prodigy import scale_by_prodigy
from .transforms.quantized import quantize_state
from .transforms.schedule_free import schedule_free
from .transforms.scaling import (add_decayed_weights, scale, scale_by_learning_rate,
                                 scale_by_schedule, scale_by_sign)
from .transforms.scaling import scale as scale_transform
from .transforms.shampoo import precondition_shampoo
from .transforms.soap import (merge_dims_heavyball, merge_dims_soap,
                              precondition_eigenvalue_corrected)
from .tree import PyTree, mask_leaves, tree_flatten, tree_map, tree_paths, tree_unflatten

__all__ = [
    # torch.optim's first-order set and Adam's relatives
    "sgd", "adam", "adamw", "nadam", "radam", "adamax", "adabelief", "adagrad", "rmsprop",
    "lion", "adopt", "ademamix", "mars",
    # low-bit states
    "adamw_8bit", "adamw_4bit",
    # factored and layer-wise
    "adafactor", "adalomo", "came", "lamb", "lars",
    # low-rank projection
    "galore_adamw", "galore_adamw_8bit",
    # matrix preconditioners
    "shampoo", "soap", "kron",
    # the Muon family
    "muon", "muon_hidden_matrices", "normuon", "adamuon", "dion", "dion2", "muon_clip",
    "muon_bp",
    # learning-rate free and schedule-free
    "prodigy", "schedule_free_adamw", "schedule_free_sgd",
    # Hyperball: weight and update norms held fixed (MuonH, AdamH, NorMuonH, SOAP-H)
    "hyperball", "hyperball_muon", "hyperball_adamw", "hyperball_normuon", "hyperball_soap",
]

ScalarOrSchedule = float | torch.Tensor | Schedule
Mask = PyTree | Callable[[PyTree], PyTree] | None


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "momentum": HyperRole.MOMENTUM,
                      "dampening": None})
def sgd(learning_rate: ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype: torch.dtype | None = None, *,
        dampening: float = 0.0) -> GradientTransformation:
    r"""Stochastic gradient descent, with optional (Nesterov) momentum.

    .. math::
        m_t = g_t + \mu m_{t-1}, \qquad x_{t+1} = x_t - \eta\, m_t
        \quad(\text{Nesterov: } x_{t+1} = x_t - \eta (g_t + \mu m_t))

    Same numbers as ``torch.optim.SGD(lr, momentum, dampening, nesterov=...)``: with a
    ``dampening`` :math:`d`, :math:`m_t = \mu m_{t-1} + (1-d) g_t` after the first step
    (see `trace`). torch's ``weight_decay`` (L2) is
    ``chain(add_decayed_weights(wd), sgd(...))``.

    Example:
      >>> tx = opttx.sgd(0.1, momentum=0.9, nesterov=True)

    References:
      Robbins and Monro (1951); Sutskever et al., ICML 2013.
    """
    links = []
    if momentum is not None:
        links.append(trace(decay=momentum, nesterov=nesterov,
                           accumulator_dtype=accumulator_dtype, dampening=dampening))
    elif isinstance(dampening, (int, float)) and dampening != 0:
        raise ValueError("sgd: dampening applies to the momentum buffer; give a momentum too "
                         "(torch.optim.SGD ignores dampening without momentum).")
    links.append(scale_by_learning_rate(learning_rate))
    return chain(*links)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None})
def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: torch.dtype | None = None, *,
         nesterov: bool = False, nu_dtype: torch.dtype | None = None,
         amsgrad: bool = False) -> GradientTransformation:
    r"""Adam: `scale_by_adam` then `scale_by_learning_rate`.

    .. math::
        x_{t+1} = x_t - \eta\, \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}

    Same numbers as ``torch.optim.Adam(lr, betas=(b1, b2), eps, amsgrad=amsgrad)`` (AMSGrad
    keeps the running maximum of the raw second moment, see `scale_by_adam`); torch's L2
    ``weight_decay`` is ``chain(add_decayed_weights(wd), adam(...))``.

    Example:
      >>> tx = opttx.adam(1e-3)
      >>> tx = opttx.adam(1e-3, amsgrad=True)

    References:
      Kingma and Ba, Adam (arXiv 1412.6980).
    """
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                               nu_dtype=nu_dtype, amsgrad=amsgrad),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None,
                      "weight_decay": HyperRole.WEIGHT_DECAY})
def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: torch.dtype | None = None,
          weight_decay: float = 1e-4, mask: Mask = None, *,
          nesterov: bool = False, nu_dtype: torch.dtype | None = None,
          amsgrad: bool = False, cautious_weight_decay: bool = False) -> GradientTransformation:
    r"""Adam with decoupled weight decay.

    .. math::
        x_{t+1} = x_t - \eta \left(\frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}
        + \lambda x_t\right)

    The decay is scaled by the learning rate, as in ``torch.optim.AdamW`` (which multiplies
    ``p`` by :math:`1 - \eta\lambda` first): same numbers for the same arguments. Note the
    defaults differ: optax's (kept here) ``weight_decay=1e-4``, torch's 1e-2.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2, eps, eps_root, mu_dtype, nesterov, nu_dtype: as in `scale_by_adam` (bf16
        parameters keep fp32 moments unless ``mu_dtype``/``nu_dtype`` say otherwise).
      weight_decay: :math:`\lambda`.
      mask: where to apply the decay (tree of booleans or a function of the params).
      amsgrad: AMSGrad, as ``torch.optim.AdamW(amsgrad=True)`` (see `scale_by_adam`).
      cautious_weight_decay: decay only where the update and the parameter agree in sign
        (`add_decayed_weights` with ``cautious=True``; Chen et al., arXiv 2510.12402).

    Example:
      >>> tx = opttx.adamw(3e-4, weight_decay=0.1,
      ...                  mask=lambda p: {k: v.ndim > 1 for k, v in p.items()})

    References:
      Loshchilov and Hutter, Decoupled Weight Decay Regularization (arXiv 1711.05101).
    """
    return chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                               nu_dtype=nu_dtype, amsgrad=amsgrad),
                 add_decayed_weights(weight_decay, mask, cautious=cautious_weight_decay),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None,
                      "weight_decay": HyperRole.WEIGHT_DECAY})
def adamw_8bit(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-2, block_size: int = 256,
               min_size: int = 4096, mask: Mask = None, *, eps_root: float = 0.0,
               nesterov: bool = False) -> GradientTransformation:
    r"""AdamW with 8-bit block-wise quantized moments, as ``bitsandbytes.optim.AdamW8bit``.

    .. math::
        x_{t+1} = x_t - \eta \left(\frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}
        + \lambda x_t\right)

    with Adam's moments stored between steps as uint8 codes into the dynamic map (signed for
    :math:`m`, unsigned for :math:`v`) and one fp32 absmax per block of ``block_size``
    elements: about 2.03 bytes of state per parameter instead of 8 (see `quantize_state`).
    Leaves under ``min_size`` elements keep fp32 moments. The update of each step is Adam's
    from the dequantized moments; the leaves are processed one at a time, so the fp32
    moments of the whole model are never materialised.

    ``chain(quantize_state(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
    block_size=block_size, min_size=min_size), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``.

    The weight decay default is bitsandbytes' ``AdamW8bit`` (and ``torch.optim.AdamW``'s)
    ``1e-2``, not optax's ``1e-4`` that `adamw` keeps; it is decoupled and scaled by the
    learning rate, as theirs.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2, eps, eps_root, nesterov: as in `scale_by_adam`.
      weight_decay: :math:`\lambda`.
      block_size: elements per absmax block (bitsandbytes >= 0.44: 256).
      min_size: leaves with fewer elements keep fp32 moments (bitsandbytes'
        ``min_8bit_size``, 4096).
      mask: where to apply the decay (tree of booleans or a function of the params).

    Example:
      >>> tx = opttx.adamw_8bit(1e-3, weight_decay=0.1)

    References:
      Dettmers et al., 8-bit Optimizers via Block-wise Quantization (arXiv 2110.02861);
      Loshchilov and Hutter, Decoupled Weight Decay Regularization (arXiv 1711.05101).
    """
    return chain(quantize_state(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
                                block_size=block_size, min_size=min_size),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None,
                      "weight_decay": HyperRole.WEIGHT_DECAY})
def adamw_4bit(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-2, block_size: int = 128,
               min_size: int = 4096, mask: Mask = None, *, eps_root: float = 0.0,
               nesterov: bool = False) -> GradientTransformation:
    r"""AdamW with 4-bit moments, two codes per byte (Li et al., 2023).

    .. math::
        x_{t+1} = x_t - \eta \left(\frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}
        + \lambda x_t\right)

    with Adam's moments stored between steps as 4-bit codes: :math:`m` on the signed 4-bit
    dynamic map with one fp32 absmax per block of ``block_size`` elements, :math:`v` on the
    linear map without zero with rank-1 scales (per element, the smaller of the maxima of its
    row and its column; blocks of ``block_size`` for 1-D leaves). About 1.03 bytes of state per
    parameter of a matrix instead of 8 (see `quantize_state`, ``format="4bit"``). Leaves under
    ``min_size`` elements keep fp32 moments; the leaves are processed one at a time, so the
    fp32 moments of the whole model are never materialised.

    ``chain(quantize_state(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov), bits=4,
    block_size=block_size, min_size=min_size), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2, eps, eps_root, nesterov: as in `scale_by_adam`.
      weight_decay: :math:`\lambda` (decoupled, scaled by the learning rate; ``1e-2`` as
        `adamw_8bit` and torchao's ``AdamW4bit``).
      block_size: elements per absmax block of the first moment (128, the paper's).
      min_size: leaves with fewer elements keep fp32 moments (4096).
      mask: where to apply the decay (tree of booleans or a function of the params).

    Example:
      >>> tx = opttx.adamw_4bit(1e-3, weight_decay=0.1)

    References:
      Li, Chen and Zhu, Memory Efficient Optimizers with 4-bit States (arXiv 2309.01507);
      Loshchilov and Hutter, Decoupled Weight Decay Regularization (arXiv 1711.05101).
    """
    return chain(quantize_state(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov), bits=4,
                                block_size=block_size, min_size=min_size),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None,
                      "momentum_decay": None})
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
        if isinstance(eps_root, (int, float)) and eps_root != 0:
            raise ValueError("eps_root is not supported with momentum_decay (torch's NAdam).")
        direction = scale_by_nadam(b1, b2, eps, momentum_decay, mu_dtype)
    else:
        direction = scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=True)
    return chain(direction, scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None,
                      "threshold": None, "weight_decay": HyperRole.WEIGHT_DECAY})
def radam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, threshold: float = 5.0, *,
          nesterov: bool = False, weight_decay: float = 0.0,
          decoupled_weight_decay: bool = False, mask: Mask = None,
          eps_before_debias: bool = False) -> GradientTransformation:
    r"""RAdam: `scale_by_radam` then `scale_by_learning_rate`, with optional weight decay.

    .. math::
        x_{t+1} = x_t - \eta \left(u_t + \lambda x_t \right)
        \quad\text{(decoupled)}, \qquad
        u_t = \text{RAdam}(g_t + \lambda x_t) \quad\text{(L2, the default)}

    with :math:`u_t` the rectified step of `scale_by_radam`. optax's signature and defaults
    (no weight decay, ``eps`` added after the bias correction). ``torch.optim.RAdam(lr,
    betas=(b1, b2), eps, weight_decay, decoupled_weight_decay)`` is ``radam(lr, b1, b2, eps,
    weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
    eps_before_debias=True)``: same numbers.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2, eps, eps_root, threshold, nesterov, eps_before_debias: see `scale_by_radam`.
      weight_decay: :math:`\lambda`.
      decoupled_weight_decay: decay the weights by :math:`\eta\lambda x_t` (AdamW-style)
        instead of adding :math:`\lambda x_t` to the gradient (torch's flag of that name).
      mask: where the decay applies (tree of booleans or a function of the params).

    Example:
      >>> tx = opttx.radam(1e-3, weight_decay=0.01, decoupled_weight_decay=True)

    References:
      Liu et al., On the Variance of the Adaptive Learning Rate and Beyond
      (arXiv 1908.03265).
    """
    decays = not is_fixed_zero(weight_decay)
    links: list[GradientTransformation] = []
    if decays and not decoupled_weight_decay:
        links.append(add_decayed_weights(weight_decay, mask))
    links.append(scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov,
                                eps_before_debias=eps_before_debias))
    if decays and decoupled_weight_decay:
        links.append(add_decayed_weights(weight_decay, mask))
    links.append(scale_by_learning_rate(learning_rate))
    return chain(*links)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS})
def adamax(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
           eps: float = 1e-8) -> GradientTransformation:
    r"""Adamax: `scale_by_adamax` then `scale_by_learning_rate`.

    .. math::
        v_t = \max(\beta_2 v_{t-1}, |g_t| + \epsilon), \qquad
        x_{t+1} = x_t - \eta\, \frac{m_t}{(1-\beta_1^t)\, v_t}

    Same numbers as ``optax.adamax`` and ``torch.optim.Adamax(lr, betas=(b1, b2), eps)``
    (torch's default ``lr`` is 2e-3); torch's L2 ``weight_decay`` is
    ``chain(add_decayed_weights(wd), adamax(...))``.

    Example:
      >>> tx = opttx.adamax(2e-3)

    References:
      Kingma and Ba, Adam (arXiv 1412.6980), section 7.
    """
    return chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None})
def adabelief(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-16, eps_root: float = 1e-16, *,
              nesterov: bool = False) -> GradientTransformation:
    r"""AdaBelief: `scale_by_belief` then `scale_by_learning_rate`.

    .. math::
        s_t = \beta_2 s_{t-1} + (1-\beta_2)(g_t - m_t)^2 + \epsilon_{root}, \qquad
        x_{t+1} = x_t - \eta\, \frac{\hat m_t}{\sqrt{\hat s_t} + \epsilon}

    Same numbers and defaults as ``optax.adabelief`` (the paper uses ``eps=1e-8,
    eps_root=0``).

    Example:
      >>> tx = opttx.adabelief(1e-3)

    References:
      Zhuang et al., AdaBelief Optimizer (arXiv 2010.07468).
    """
    return chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "initial_accumulator_value": None,
                      "eps": HyperRole.EPS})
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


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "decay": HyperRole.RMS_DECAY,
                      "eps": HyperRole.EPS, "initial_scale": None, "momentum": HyperRole.MOMENTUM})
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


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "weight_decay": HyperRole.WEIGHT_DECAY})
def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
         mu_dtype: torch.dtype | None = None, weight_decay: float = 1e-3,
         mask: Mask = None, *, cautious_weight_decay: bool = False) -> GradientTransformation:
    r"""Lion: the sign of an interpolated momentum, with decoupled weight decay.

    .. math::
        x_{t+1} = x_t - \eta\left(\mathrm{sign}(\beta_1 m_{t-1} + (1-\beta_1) g_t)
        + \lambda x_t\right), \quad m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

    Use a learning rate 3–10× smaller than AdamW's and a larger weight decay.
    ``cautious_weight_decay=True`` decays only where the sign and the parameter agree
    (`add_decayed_weights` with ``cautious=True``; Chen et al., arXiv 2510.12402).

    References:
      Chen et al., Symbolic Discovery of Optimization Algorithms (arXiv 2302.06675).
    """
    return chain(scale_by_lion(b1, b2, mu_dtype),
                 add_decayed_weights(weight_decay, mask, cautious=cautious_weight_decay),
                 scale_by_learning_rate(learning_rate))


# ---------------------------------------------------------------------------------------------
# MARS
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "gamma": None, "eps": HyperRole.EPS,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "max_norm": None,
                      "learning_rate_1d": HyperRole.LEARNING_RATE,
                      "weight_decay_1d": HyperRole.WEIGHT_DECAY})
def mars(learning_rate: ScalarOrSchedule = 3e-3, b1: float = 0.95, b2: float = 0.99,
         gamma: float = 0.025, eps: float = 1e-8, weight_decay: float = 0.0,
         optimizer: str = "adamw", max_norm: float | None = 1.0,
         mu_dtype: torch.dtype | None = None, *, optimize_1d: bool = False,
         learning_rate_1d: ScalarOrSchedule | None = None,
         betas_1d: tuple[float, float] = (0.9, 0.95),
         weight_decay_1d: float = 0.1,
         eps_before_debias: bool = True) -> GradientTransformation:
    r"""MARS: AdamW or Lion on the variance-reduced gradient of `scale_by_mars`.

    .. math::
        c_t = \mathrm{clip}_1\!\Big(g_t + \gamma \tfrac{\beta_1}{1-\beta_1}
        (g_t - g_{t-1})\Big), \qquad
        x_{t+1} = x_t - \eta\,(\mathrm{Adam}(c_t) \text{ or }
        \mathrm{sign}(m_t) + \lambda x_t)

    with :math:`m_t = \beta_1 m_{t-1} + (1-\beta_1) c_t` for Lion (``optimizer="lion"``:
    `scale_by_lion` with both decays :math:`\beta_1`; ``b2`` is unused). Composed as
    ``chain(scale_by_mars(gamma, b1, max_norm), scale_by_adam(b1, b2, eps) or
    scale_by_lion(b1, b1), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``
    on the leaves with 2 or more dims; unless ``optimize_1d``, the other leaves take plain
    `adamw` with ``betas_1d``, ``weight_decay_1d`` and ``learning_rate_1d`` (a `partition`,
    labels ``"mars"`` and ``"adamw"``).

    Defaults and numbers are ``pytorch_optimizer.MARS``'s (``mars_type="adamw"``/``"lion"``),
    except that ``learning_rate_1d`` defaults to ``learning_rate`` (their ``lr_1d``: 3e-3).
    Their Adam adds ``eps`` before the bias correction, with :math:`10^{-15}` inside the
    root: :math:`u_t = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}
    \frac{m_t}{\sqrt{v_t + 10^{-15}} + \epsilon}`, which ``eps_before_debias=True`` (the
    default) reproduces as ``chain(scale_by_adam(..., eps_root=1e-15,
    bias_correction=False), scale_by_schedule(...))``; ``False`` gives `adamw`'s (and
    torch.optim's) :math:`\hat m_t / (\sqrt{\hat v_t} + \epsilon)`. The two differ where
    :math:`|c_t|` is near ``eps``. For ``heavyball``'s ``mars=True`` see `scale_by_mars`.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2: Adam's decays (:math:`\beta_1` also sets the correction's coefficient).
      gamma: :math:`\gamma`, the strength of the correction (`scale_by_mars`).
      eps: Adam's epsilon.
      weight_decay: :math:`\lambda`, decoupled and scaled by the learning rate.
      optimizer: ``"adamw"`` or ``"lion"``.
      max_norm: the per-leaf clipping norm of :math:`c_t` (None: no clipping).
      mu_dtype: dtype of the first moment (default: fp32 for 16-bit leaves).
      optimize_1d: apply MARS to every leaf (False: only to leaves with 2 or more dims).
      learning_rate_1d: the 1-D leaves' learning rate (default ``learning_rate``).
      betas_1d: the 1-D leaves' AdamW decays.
      weight_decay_1d: the 1-D leaves' weight decay.
      eps_before_debias: ``pytorch_optimizer``'s placement of ``eps`` (above).

    Example:
      >>> tx = opttx.mars(3e-3, weight_decay=0.01)
      >>> tx = opttx.mars(1e-4, optimizer="lion", optimize_1d=True)

    References:
      Yuan, Liu, Wu, Zhou, Gu, MARS: Unleashing the Power of Variance Reduction for
      Training Large Models (arXiv 2411.10438).
    """
    if optimizer == "adamw":
        inner = _mars_adam(b1, b2, eps, mu_dtype, eps_before_debias)
    elif optimizer == "lion":
        inner = scale_by_lion(b1, b1, mu_dtype)
    else:
        raise ValueError(f"optimizer must be 'adamw' or 'lion', got {optimizer!r}.")
    group = chain(scale_by_mars(gamma, b1, max_norm), inner,
                  add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))
    if optimize_1d:
        return group
    if not isinstance(betas_1d, (tuple, list)) or len(betas_1d) != 2:
        raise ValueError(f"betas_1d must be a pair (b1, b2), got {betas_1d!r}.")

    def labels(params: PyTree) -> PyTree:
        leaves, spec = tree_flatten(params)
        return tree_unflatten(["mars" if p.ndim >= 2 else "adamw" for p in leaves], spec)

    vectors = chain(_mars_adam(betas_1d[0], betas_1d[1], eps, mu_dtype, eps_before_debias),
                    add_decayed_weights(weight_decay_1d),
                    scale_by_learning_rate(learning_rate if learning_rate_1d is None
                                           else learning_rate_1d))
    return partition({"mars": group, "adamw": vectors}, labels)


def _mars_adam(b1: float, b2: float, eps: float, mu_dtype: torch.dtype | None,
               eps_before_debias: bool) -> GradientTransformation:
    """Adam as `mars` uses it: `scale_by_adam`, or with ``eps_before_debias``
    ``pytorch_optimizer``'s ``sqrt(1-b2^t)/(1-b1^t) · m / (sqrt(v + 1e-15) + eps)``."""
    if not eps_before_debias:
        return scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype)

    def debias(count: torch.Tensor) -> torch.Tensor:     # count: the 0-based step
        t = count + 1
        return torch.sqrt(debias_factor(b2, t)) / debias_factor(b1, t)

    return chain(scale_by_adam(b1, b2, eps, 1e-15, mu_dtype, bias_correction=False),
                 scale_by_schedule(debias))


# ---------------------------------------------------------------------------------------------
# factored and layer-wise
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "decay_rate": None,
                      "clipping_threshold": None, "momentum": HyperRole.MOMENTUM,
                      "weight_decay_rate": HyperRole.WEIGHT_DECAY, "eps": HyperRole.EPS,
                      "param_scale_eps": None, "eps_clamp": None}, runtime=("decay_offset",))
def adafactor(learning_rate: ScalarOrSchedule | None = None, min_dim_size_to_factor: int = 128,
              decay_rate: float = 0.8, decay_offset: int = 0,
              multiply_by_parameter_scale: bool = True, clipping_threshold: float | None = 1.0,
              momentum: float | None = None, dtype_momentum: torch.dtype = torch.float32,
              weight_decay_rate: float | None = None, eps: float = 1e-30, factored: bool = True,
              weight_decay_mask: Mask = None, *, relative_step: bool = False,
              warmup_init: bool = False, factor_axes: FactorAxes = "largest",
              weight_decay_scaled_by_lr: bool = False, param_scale_eps: float = 1e-3,
              eps_clamp: float | None = None) -> GradientTransformation:
    r"""Adafactor: factored second moments, update clipping, relative step sizes.

    .. math::
        u_t = \mathrm{clip}_d\!\left(g_t \hat v_t^{-1/2}\right) \cdot \eta_t \cdot
        \max(\epsilon_2, \mathrm{RMS}(x_t)), \qquad
        m_t = \beta_1 m_{t-1} + (1-\beta_1) u_t \ (\text{with momentum}), \qquad
        x_{t+1} = x_t - m_t - \lambda\, x_t

    composed as ``chain(scale_by_factored_rms, clip_by_rms, scale_by_learning_rate,
    scale_by_param_block_rms, ema, add_decayed_weights, scale(-1))`` (with clipping and
    parameter scaling both on, the two are one link, `clip_by_rms_and_scale_by_param_rms`,
    placed before the learning rate: one reduction instead of two). The positional
    signature and defaults are optax's; the keywords reproduce the other implementations:

    * transformers' ``Adafactor(lr, eps=(e1, e2), clip_threshold, decay_rate=-c, beta1,
      weight_decay, scale_parameter, relative_step, warmup_init)`` is
      ``adafactor(lr, min_dim_size_to_factor=1, decay_rate=c, clipping_threshold=...,
      momentum=beta1, weight_decay_rate=weight_decay, eps=e1, param_scale_eps=e2,
      multiply_by_parameter_scale=scale_parameter, relative_step=..., warmup_init=...,
      factor_axes="last", weight_decay_scaled_by_lr=True)``;
    * ``torch.optim.Adafactor(lr, beta2_decay=-c, eps=(None, e2), d, weight_decay)`` is
      ``adafactor(relative_step_schedule(lr), min_dim_size_to_factor=1, decay_rate=c,
      clipping_threshold=d, weight_decay_rate=lr * weight_decay, eps=0.0,
      eps_clamp=torch.finfo(dtype).eps, factor_axes="last", param_scale_eps=e2)``.

    Args:
      learning_rate: :math:`\eta_t` (a number or schedule); None with
        ``relative_step=False`` means no learning-rate factor (optax).
      min_dim_size_to_factor, decay_rate, decay_offset, eps, factored, factor_axes,
        eps_clamp: see `scale_by_factored_rms`.
      multiply_by_parameter_scale: multiply by :math:`\max(\epsilon_2, \mathrm{RMS}(x))`.
      clipping_threshold: :math:`d` of the update clipping (None: no clipping).
      momentum: :math:`\beta_1` (None: no first moment, the memory-lean default).
      dtype_momentum: dtype of the first moment.
      weight_decay_rate: :math:`\lambda`; added after the step size (optax), or scaled by the
        per-leaf step size with ``weight_decay_scaled_by_lr`` (transformers).
      weight_decay_mask: where weight decay applies.
      relative_step: :math:`\eta_t = \min(10^{-2}, 1/\sqrt t)` (transformers' default).
      warmup_init: :math:`\eta_t = \min(10^{-6} t, 1/\sqrt t)` (needs ``relative_step``).
      param_scale_eps: :math:`\epsilon_2`.

    Example:
      >>> tx = opttx.adafactor(learning_rate=1e-2)                     # optax's
      >>> tx = opttx.adafactor(relative_step=True, factor_axes="last",
      ...                      min_dim_size_to_factor=1)                 # transformers'

    References:
      Shazeer and Stern, Adafactor (arXiv 1804.04235).
    """
    if relative_step and learning_rate is not None:
        raise ValueError("relative_step=True computes the learning rate; do not also pass "
                         "learning_rate (as transformers' Adafactor).")
    if warmup_init and not relative_step:
        raise ValueError("warmup_init=True requires relative_step=True.")
    lr = relative_step_schedule(1e-2, warmup_init) if relative_step else learning_rate
    links: list[GradientTransformation] = [scale_by_factored_rms(
        factored, decay_rate, decay_offset, min_dim_size_to_factor, eps,
        factor_axes=factor_axes, eps_clamp=eps_clamp)]
    if clipping_threshold is not None and multiply_by_parameter_scale:
        # both per-leaf RMS values in one reduction (one collective when sharded); the
        # learning rate, a scalar, commutes with both
        links.append(clip_by_rms_and_scale_by_param_rms(clipping_threshold, param_scale_eps))
    elif clipping_threshold is not None:
        links.append(clip_by_rms(clipping_threshold))
    if lr is not None:
        links.append(scale_by_learning_rate(lr, flip_sign=False))
    if multiply_by_parameter_scale and clipping_threshold is None:
        links.append(scale_by_param_block_rms(param_scale_eps))
    if momentum is not None:
        links.append(ema(momentum, debias=False, accumulator_dtype=dtype_momentum))
    if weight_decay_rate is not None and not is_fixed_zero(weight_decay_rate):
        if weight_decay_scaled_by_lr:
            links.append(add_step_scaled_decayed_weights(
                weight_decay_rate, lr if lr is not None else 1.0,
                param_scale_eps if multiply_by_parameter_scale else None, weight_decay_mask))
        else:
            links.append(add_decayed_weights(weight_decay_rate, weight_decay_mask))
    links.append(scale(-1.0))
    return chain(*links)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "clip_threshold": None,
                      "decay_rate": None, "weight_decay": HyperRole.WEIGHT_DECAY})
def adalomo(learning_rate: ScalarOrSchedule = 1e-3, eps: tuple[float, float] = (1e-30, 1e-3),
            clip_threshold: float = 1.0, decay_rate: float = 0.8, weight_decay: float = 0.0,
            weight_decay_mask: Mask = None) -> GradientTransformation:
    r"""AdaLomo: Adafactor's factored second moment without momentum, grouped update
    normalisation and a parameter-scaled learning rate.

    .. math::
        \beta_t = 1 - t^{-c}, \quad u_t = \mathrm{clip}_d\!\left(g_t \hat v_t^{-1/2}\right),
        \quad \eta_t = \eta \max(\epsilon_2, \mathrm{RMS}(x_t)), \quad
        x_{t+1} = x_t - \eta_t (u_t + \lambda x_t)

    with :math:`\hat v_t` factored over the last two dims of every tensor of two or more dims
    (:math:`\epsilon_1` added to :math:`g^2`) and kept whole for vectors, and
    :math:`\mathrm{clip}_d(u) = u / \max(1, \mathrm{RMS}(u)/d)` per parameter. Composed as
    ``chain(scale_by_factored_rms, clip_by_rms, add_decayed_weights, scale_by_param_block_rms,
    scale_by_learning_rate)``; the numbers of ``lomo_optim.AdaLomo(model, lr, eps, clip_threshold,
    decay_rate=-c, weight_decay)`` (its loss scale and gradient-norm clipping belong to the
    runner, `opttx.FusedBackward`, which applies this transform inside backward as AdaLomo
    does). Every piece is per-leaf, so it also runs as an ordinary optimizer after backward.

    Args:
      learning_rate: :math:`\eta` (a number or schedule).
      eps: :math:`(\epsilon_1, \epsilon_2)`: added to :math:`g^2`; floor of the parameter RMS.
      clip_threshold: :math:`d` of the update normalisation.
      decay_rate: the exponent :math:`c` (AdaLomo writes ``-0.8``).
      weight_decay: :math:`\lambda`, decoupled and scaled by :math:`\eta_t`.
      weight_decay_mask: where weight decay applies.

    Example:
      >>> runner = opttx.FusedBackward(model, opttx.adalomo(1e-3, weight_decay=0.01))
      >>> runner.backward(loss)       # updates applied inside backward, grads freed at once

    References:
      Lv et al., AdaLomo: Low-memory Optimization with Adaptive Learning Rate
      (arXiv 2310.10195).
    """
    links = [scale_by_factored_rms(True, decay_rate, 0, 1, eps[0], factor_axes="last"),
             clip_by_rms(clip_threshold)]
    if not is_fixed_zero(weight_decay):
        links.append(add_decayed_weights(weight_decay, weight_decay_mask))
    links += [scale_by_param_block_rms(eps[1]), scale_by_learning_rate(learning_rate)]
    return chain(*links)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "b3": None, "eps1": None, "eps2": None,
                      "clip_threshold": None, "weight_decay": HyperRole.WEIGHT_DECAY})
def came(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
         b3: float = 0.9999, eps1: float = 1e-30, eps2: float = 1e-16,
         clip_threshold: float = 1.0, weight_decay: float = 0.0, mask: Mask = None, *,
         factor_axes: FactorAxes = "last", min_dim_size_to_factor: int = 1
         ) -> GradientTransformation:
    r"""CAME: `scale_by_came`, decoupled weight decay, learning rate.

    .. math::
        x_{t+1} = x_t - \eta \left(m_t \hat S_t^{-1/2} + \lambda x_t\right)

    Defaults and numbers of ``came_pytorch.CAME(lr, betas=(b1, b2, b3), eps=(eps1, eps2),
    clip_threshold, weight_decay)``.

    Example:
      >>> tx = opttx.came(2e-4, weight_decay=0.01)

    References:
      Luo et al., CAME (arXiv 2307.02047).
    """
    return chain(scale_by_came(b1, b2, b3, eps1, eps2, clip_threshold, factor_axes,
                               min_dim_size_to_factor),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS, "eps_root": None,
                      "weight_decay": HyperRole.WEIGHT_DECAY})
def lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         eps_root: float = 0.0, weight_decay: float = 0.0, mask: Mask = None, *,
         bias_correction: bool = True, trust_ratio_mask: Mask = None,
         phi_bounds: tuple[float, float] | None = None) -> GradientTransformation:
    r"""LAMB: Adam directions with a layer-wise trust ratio.

    .. math::
        r_t = \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon} + \lambda x_t, \qquad
        x_{t+1} = x_t - \eta\, \frac{\phi(\lVert x_t \rVert)}{\lVert r_t \rVert}\, r_t

    (ratio 1 when either norm is 0). Bias correction is on by default, as in the paper
    (ColossalAI's single-device Lamb defaults it off: ``bias_correction=False``).

    Args:
      learning_rate, b1, b2, eps, eps_root: as in `adam` (optax's defaults, ``eps=1e-6``).
      weight_decay: :math:`\lambda`; ``mask`` says where it applies.
      bias_correction: debias Adam's moments.
      trust_ratio_mask: where the trust ratio applies (elsewhere ratio 1; commonly biases and
        norm scales are excluded).
      phi_bounds: ``(γl, γu)`` clipping of the parameter norm.

    References:
      You et al., Large Batch Optimization for Deep Learning (arXiv 1904.00962).
    """
    return chain(scale_by_adam(b1, b2, eps, eps_root, bias_correction=bias_correction),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_trust_ratio(phi_bounds=phi_bounds, mask=trust_ratio_mask),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "trust_coefficient": None,
                      "eps": HyperRole.EPS, "momentum": HyperRole.MOMENTUM})
def lars(learning_rate: ScalarOrSchedule, weight_decay: float = 0.0,
         weight_decay_mask: Mask = True, trust_coefficient: float = 0.001, eps: float = 0.0,
         trust_ratio_mask: Mask = True, momentum: float = 0.9,
         nesterov: bool = False) -> GradientTransformation:
    r"""LARS: SGD with momentum on trust-ratio-scaled gradients.

    .. math::
        u_t = \tau \frac{\lVert x_t \rVert}{\lVert g_t + \lambda x_t \rVert + \epsilon}
        (g_t + \lambda x_t), \qquad m_t = \mu m_{t-1} - \eta u_t, \qquad x_{t+1} = x_t + m_t

    optax's signature and defaults.

    References:
      You, Gitman and Ginsburg, Large Batch Training of Convolutional Networks
      (arXiv 1708.03888).
    """
    return chain(add_decayed_weights(weight_decay, weight_decay_mask),
                 scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps,
                                      mask=trust_ratio_mask),
                 scale_by_learning_rate(learning_rate),
                 trace(decay=momentum, nesterov=nesterov))


# ---------------------------------------------------------------------------------------------
# low-rank projection
# ---------------------------------------------------------------------------------------------


def _lr_then_decay(learning_rate: ScalarOrSchedule, weight_decay: float,
                   mask: Mask) -> list[GradientTransformation]:
    r"""galore_torch's tail: the step, then :math:`p \leftarrow (1 - \eta\lambda) p` on the
    stepped parameter, written as :math:`-\eta((1 - \eta\lambda) u + \lambda p)`."""
    links: list[GradientTransformation] = []
    if not is_fixed_zero(weight_decay):
        if callable(learning_rate):
            shrink = scale_by_schedule(lambda count: 1 - learning_rate(count) * weight_decay)
        else:
            shrink = scale_transform(1 - learning_rate * weight_decay)
        links.append(shrink if mask is None else masked(shrink, mask))
        links.append(add_decayed_weights(weight_decay, mask))
    links.append(scale_by_learning_rate(learning_rate))
    return links


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "scale": None, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "weight_decay": HyperRole.WEIGHT_DECAY}, runtime=("update_proj_gap",))
def galore_adamw(learning_rate: ScalarOrSchedule, rank: int = 128, update_proj_gap: int = 200,
                 scale: float = 0.25, proj_type: ProjType = "std", b1: float = 0.9,
                 b2: float = 0.999, eps: float = 1e-6, weight_decay: float = 0.0,
                 correct_bias: bool = True, mask: Mask = None, *,
                 projection_mask: Mask = None, matrix_axes: MatrixAxes = (-2, -1),
                 reproject_moments: bool = False,
                 mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""GaLore-AdamW: Adam on low-rank projections of the gradients, as
    ``galore_torch.GaLoreAdamW``.

    .. math::
        N_t = \frac{m_t}{\sqrt{v_t} + \epsilon}, \qquad
        y_t = x_t - \eta\, \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\, \alpha\,
        \mathrm{back}(N_t), \qquad x_{t+1} = y_t - \eta \lambda\, y_t

    with :math:`m_t, v_t` Adam's moments of the projected gradient (see `project_lowrank`;
    full-size moments of the leaves that are not projected, where :math:`\mathrm{back}` is the
    identity and :math:`\alpha = 1`). This is the transformers-style AdamW that galore_torch
    ships: :math:`\epsilon` is added to :math:`\sqrt{v_t}` before any bias correction, which
    is folded into the step size (so it is not `adamw`'s :math:`\hat m / (\sqrt{\hat v} +
    \epsilon)`), and the weight decay :math:`p \leftarrow p - \eta\lambda p` is applied to
    the full parameter after the Adam step. Composed as

    ``chain(project_lowrank(scale_by_adam(b1, b2, eps, bias_correction=False), rank,
    update_proj_gap, scale, proj_type), scale_by_schedule(sqrt(1 - b2^t) / (1 - b1^t)),
    scale(1 - lr·wd), add_decayed_weights(wd), scale_by_learning_rate(lr))``

    (the last three expand :math:`x_{t+1} = x_t - \eta(c(1 - \eta\lambda)u + \lambda x_t)`).
    Same numbers as ``GaLoreAdamW`` with the projected leaves in a group with ``rank``,
    ``update_proj_gap``, ``scale``, ``proj_type`` and the others in a plain group (both with
    ``lr``, ``betas=(b1, b2)``, ``eps``, ``weight_decay``, ``correct_bias``). galore_torch
    keeps the bases of 16-bit weights in their dtype; here bases, projected gradients and
    moments are float32.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      rank, update_proj_gap, scale, proj_type, matrix_axes, reproject_moments: see
        `project_lowrank`. The defaults are those of galore_torch's README (rank 128, gap
        200, scale 0.25); its projector's own default scale is 1.0. For 7B models the paper
        uses rank 1024 and gap 500.
      b1, b2, eps: Adam's decays and :math:`\epsilon` (galore_torch's defaults).
      weight_decay: :math:`\lambda`, applied as :math:`p \leftarrow (1 - \eta\lambda) p` after
        the step.
      correct_bias: fold the bias corrections into the step size (False: none, as BERT).
      mask: where weight decay applies (optax's meaning of ``mask`` in `adamw`).
      projection_mask: which leaves are projected (default: every 2-D leaf); the others run
        the same Adam at full size.
      mu_dtype: dtype of the first moment.

    Example:
      >>> tx = opttx.galore_adamw(1e-2, rank=128, update_proj_gap=200, scale=0.25,
      ...                         projection_mask=lambda p: {k: v.ndim == 2 and "embed" not in k
      ...                                                    for k, v in p.items()})

    References:
      Zhao et al., GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection
      (arXiv 2403.03507).
    """
    links: list[GradientTransformation] = [project_lowrank(
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, bias_correction=False), rank,
        update_proj_gap, scale, proj_type, mask=projection_mask, matrix_axes=matrix_axes,
        reproject_moments=reproject_moments)]
    if correct_bias:
        links.append(scale_by_schedule(
            lambda count: torch.sqrt(debias_factor(b2, count + 1)) / debias_factor(b1, count + 1)))
    return chain(*links, *_lr_then_decay(learning_rate, weight_decay, mask))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "scale": None, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "weight_decay": HyperRole.WEIGHT_DECAY}, runtime=("update_proj_gap",))
def galore_adamw_8bit(learning_rate: ScalarOrSchedule, rank: int = 128,
                      update_proj_gap: int = 200, scale: float = 0.25,
                      proj_type: ProjType = "std", b1: float = 0.9, b2: float = 0.999,
                      eps: float = 1e-8, weight_decay: float = 1e-2, correct_bias: bool = True,
                      mask: Mask = None, *, projection_mask: Mask = None,
                      matrix_axes: MatrixAxes = (-2, -1), reproject_moments: bool = False,
                      mu_dtype: torch.dtype | None = None, block_size: int = 256,
                      min_size: int = 4096) -> GradientTransformation:
    r"""GaLore with 8-bit block-wise Adam states, as ``galore_torch.GaLoreAdamW8bit``.

    .. math::
        N_t = \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon}, \qquad
        y_t = x_t - \eta\, \alpha\, \mathrm{back}(N_t), \qquad
        x_{t+1} = y_t - \eta \lambda\, y_t

    with :math:`\hat m_t, \hat v_t` Adam's bias-corrected moments of the projected
    gradient (see `project_lowrank`), stored between steps as 8-bit block-wise codes (see
    `quantize_state`) wherever the projected leaf (shape ``(k, n)`` or ``(m, k)``, not the
    parameter's) has at least ``min_size`` elements, as bitsandbytes decides on the projected
    gradient. Leaves that are not projected run the same 8-bit Adam at full size
    (:math:`\mathrm{back}` the identity, :math:`\alpha = 1`). Composed as

    ``chain(project_lowrank(quantize_state(scale_by_adam(b1, b2, eps), block_size=block_size,
    min_size=min_size), rank, update_proj_gap, scale, proj_type), scale(1 - lr·wd),
    add_decayed_weights(wd), scale_by_learning_rate(lr))``.

    It differs from `galore_adamw` where galore_torch's 8-bit optimizer differs from its
    32-bit one: the Adam step is bitsandbytes' (:math:`\epsilon` added to the bias-corrected
    :math:`\sqrt{\hat v_t}`), and the defaults are ``GaLoreAdamW8bit``'s (``eps=1e-8``,
    ``weight_decay=1e-2``). The decay is applied after the step, as galore_torch does on
    projected leaves; on the others bitsandbytes decays first (:math:`(1-\eta\lambda) x_t -
    \eta N_t`), a difference of :math:`\eta^2 \lambda N_t`.

    Args:
      learning_rate, rank, update_proj_gap, scale, proj_type, b1, b2, mask, projection_mask,
        matrix_axes, mu_dtype: as in `galore_adamw` (``mu_dtype`` matters only for the
        moments kept in fp32).
      eps: :math:`\epsilon`, added to :math:`\sqrt{\hat v_t}`.
      weight_decay: :math:`\lambda`, applied as :math:`p \leftarrow (1 - \eta\lambda) p`
        after the step.
      correct_bias: use the bias-corrected moments (False: the raw ones).
      reproject_moments: not supported with quantized moments (must be False).
      block_size, min_size: as in `quantize_state` (bitsandbytes' 256 and 4096).

    Example:
      >>> tx = opttx.galore_adamw_8bit(1e-2, rank=128, update_proj_gap=200, scale=0.25)

    References:
      Zhao et al., GaLore (arXiv 2403.03507); Dettmers et al., 8-bit Optimizers via
      Block-wise Quantization (arXiv 2110.02861).
    """
    if reproject_moments:
        raise ValueError("galore_adamw_8bit keeps the moments quantized, and project_lowrank "
                         "cannot rotate quantized moments into a new basis: pass "
                         "reproject_moments=False (galore_torch's behaviour), or use "
                         "galore_adamw.")
    adam = quantize_state(scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype,
                                        bias_correction=correct_bias),
                          block_size=block_size, min_size=min_size)
    links: list[GradientTransformation] = [project_lowrank(
        adam, rank, update_proj_gap, scale, proj_type, mask=projection_mask,
        matrix_axes=matrix_axes)]
    return chain(*links, *_lr_then_decay(learning_rate, weight_decay, mask))


# ---------------------------------------------------------------------------------------------
# matrix preconditioners
# ---------------------------------------------------------------------------------------------


def _nonzero(value: Any) -> bool:
    """Whether an optional term is present: an injected hyperparameter (a 0-dim tensor or a
    `opttx.kernels.LiveFloat`, whose value may change between steps) always is; a number
    when it is not 0."""
    return is_live(value) or value != 0


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "epsilon": HyperRole.EPS,
                      "momentum": HyperRole.MOMENTUM, "weight_decay": HyperRole.WEIGHT_DECAY,
                      "grafting_beta2": None, "grafting_epsilon": None, "beta3": None},
         runtime=("precondition_frequency", "start_preconditioning_step",
                  "trace_scaling_exponent", "inverse_exponent_override", "rank_atol", "rank_rtol",
                  "qr_iterations", "eigendecomposition_tolerance", "root_max_iterations",
                  "root_tolerance", "root_order", "root_rel_epsilon", "root_abs_epsilon",
                  "root_method"))
def shampoo(learning_rate: ScalarOrSchedule = 1e-2, betas: tuple[float, float] = (0.9, 1.0),
            epsilon: float = 1e-12, momentum: float = 0.0, nesterov: bool = False,
            weight_decay: float = 0.0, use_decoupled_weight_decay: bool = True,
            max_preconditioner_dim: int | float = 1024, precondition_frequency: int = 1,
            start_preconditioning_step: int | None = None,
            grafting: str | None = None, grafting_beta2: float = 0.999,
            grafting_epsilon: float = 1e-8, use_bias_correction: bool = True,
            root_method: str = "eigh",
            preconditioner_dtype: torch.dtype = torch.float32,
            inv_factor_matrix_dtype: torch.dtype | None = None, beta3: float | None = None,
            use_trace_scaling: bool = False, trace_scaling_exponent: float = 0.5,
            inverse_exponent_override: dict | None = None,
            drop_weighting_factor_on_gsquare: bool = False,
            weight_decay_type: str | None = None, rank_deficient: str = "perturb_before",
            rank_atol: float = 0.0, rank_rtol: float | None = 0.0, *,
            preconditioner: str = "root_inverse", eigendecomposition: str = "eigh",
            qr_iterations: int = 1, eigendecomposition_tolerance: float = 0.0,
            ignored_basis_change_dims: dict | None = None,
            root_max_iterations: int | None = None, root_tolerance: float | None = None,
            root_order: int = 3, root_rel_epsilon: float | None = None,
            root_abs_epsilon: float | None = None,
            use_symmetric_packing: bool = False,
            target_parameter_dimensionality: int | float = 1,
            kl_shampoo: bool = False,
            first_moment_in_eigenbasis: bool = False) -> GradientTransformation:
    r"""Shampoo as Meta's Distributed Shampoo computes it, composed from transforms.

    ``block_by_dims(chain(graft(grafted method, precondition_shampoo, beta1),
    add_decayed_weights, trace, scale_by_learning_rate), max_preconditioner_dim)``, with
    coupled weight decay added to the gradient first when ``use_decoupled_weight_decay`` is
    False. Arguments and defaults are Meta's (``betas = (beta1, beta2)``: the gradient EMA
    that is preconditioned, and the factor decay; ``start_preconditioning_step`` defaults to
    the frequency). Meta's README examples map to:

    * SGD with Nesterov momentum: ``shampoo(lr, betas=(0.0, 1.0), momentum=0.5,
      nesterov=True, grafting="sgd", ...)``;
    * Adam: ``shampoo(lr, betas=(0.9, 0.999), grafting="adam", grafting_beta2=0.999,
      grafting_epsilon=1e-8, use_decoupled_weight_decay=False, weight_decay=wd)``;
    * AdamW: the same with ``use_decoupled_weight_decay=True``;
    * Adagrad: ``shampoo(lr, betas=(0.0, 1.0), grafting="adagrad", grafting_epsilon=1e-10)``.

    With preconditioning never started these equal the torch.optim optimizer they graft.

    Args:
      grafting: ``"adam"``, ``"adagrad"``, ``"rmsprop"``, ``"sgd"`` or None (Shampoo's own
        norm; Meta's default).
      grafting_beta2, grafting_epsilon: the grafted method's second-moment decay and epsilon.
      root_method, preconditioner_dtype, epsilon, precondition_frequency: see
        `precondition_shampoo`. Meta's ``amortized_computation_config`` of its root-inverse
        config: ``EigenConfig()`` is ``root_method="eigh"``, ``CoupledNewtonConfig(
        max_iterations, tolerance)`` is ``root_method="newton", root_max_iterations=...,
        root_tolerance=...``, ``CoupledHigherOrderConfig(rel_epsilon, abs_epsilon,
        max_iterations, tolerance, order)`` is ``root_method="higher_order"`` with
        ``root_rel_epsilon``, ``root_abs_epsilon``, ``root_max_iterations``,
        ``root_tolerance``, ``root_order``.
      use_symmetric_packing: Meta's option (its default True): factors and roots stored as
        packed upper triangles, about half the state; the same numbers (see
        `precondition_shampoo`). Root-inverse preconditioner only.
      target_parameter_dimensionality: Meta's option of its ``distributed_config`` (default
        1): dims are merged only while more than this many remain (`merge_small_dims`);
        with ``max_preconditioner_dim=math.inf`` and 2, every leaf of 2 or more dims is
        preconditioned as one matrix.
      inv_factor_matrix_dtype, beta3, use_trace_scaling, trace_scaling_exponent,
        inverse_exponent_override, drop_weighting_factor_on_gsquare (of the Shampoo factors):
        Meta's options of these names (``inv_factor_matrix_dtype`` defaults to float32 as
        Meta's, also with ``preconditioner_dtype=torch.float64``: give both for float64
        roots, bases and second moments)
      rank_deficient, rank_atol, rank_rtol: Meta's ``rank_deficient_stability_config`` of its
        ``EigenConfig``: ``"perturb_before"`` (default) / ``"perturb_after"``
        (``PerturbationConfig(perturb_before_computation=...)``), ``"pseudo_inverse"``
        (``PseudoInverseConfig(rank_atol, rank_rtol)``, with ``epsilon=0``)
      weight_decay_type: Meta's ``WeightDecayType`` by name (or the enum itself): ``"L2"``,
        ``"DECOUPLED"``, or, with a constant ``learning_rate`` (Meta's peak lr),
        ``"INDEPENDENT"`` (decay ``weight_decay / lr``) and ``"CORRECTED"`` (decay
        ``weight_decay * lr / peak lr``, lr read in float32 as Meta's); overrides
        ``use_decoupled_weight_decay`` (see `precondition_shampoo` and `graft`);
        ``preconditioner_dtype`` is Meta's ``factor_matrix_dtype``.

    ``preconditioner="eigenvalue_corrected"`` (SOAP in Meta's form, Meta's
    ``EigenvalueCorrectedShampooPreconditionerConfig``) uses
    `precondition_eigenvalue_corrected` as the direction: Adam's second moment (decay
    ``betas[1]``) in the eigenbasis of the factors, refreshed every ``precondition_frequency``
    steps by ``eigendecomposition="eigh"`` (Meta's default) or ``"qr"`` (Meta's
    ``QREigendecompositionConfig(max_iterations=qr_iterations,
    tolerance=eigendecomposition_tolerance)``, its ``DefaultSOAPConfig``); ``epsilon`` is added
    to the factors before ``eigh`` and to the root of the second moment;
    ``inverse_exponent_override`` is Meta's ``{order: exponent}`` of the second moment (1/2 by
    default) and ``inv_factor_matrix_dtype`` the dtype of the bases and second moment.
    Without grafting, steps before the first refresh run Adam in the standard basis (as Meta's).
    ``first_moment_in_eigenbasis=True`` (eigenvalue-corrected only, ``betas[0] > 0``; not
    Meta's option) keeps a copy of the filtered gradient rotated into the eigenbasis, as
    heavyball's SOAP does, so the step rotates only the gradient into the basis: six matrix
    products per 2-D block instead of Meta's eight, for one more parameter-sized buffer
    (none without grafting, where the grafted method needs no filtered gradient of its own).
    The same numbers as Meta's up to rounding (see `precondition_eigenvalue_corrected`).

    ``preconditioner="eigendecomposed"`` (Meta's ``EigendecomposedShampooPreconditionerConfig``)
    caches each factor's eigendecomposition instead of its root and forms the roots from it
    at every step; ``eigendecomposition``, ``qr_iterations`` and
    ``eigendecomposition_tolerance`` choose how it is refreshed, as above (Meta's
    ``amortized_computation_config``), ``inv_factor_matrix_dtype`` the dtype of the
    eigenvectors and eigenvalues (see `precondition_shampoo`).

    ``kl_shampoo=True`` is KL-Shampoo (Meta's ``RootInvKLShampooPreconditionerConfig``, with
    ``preconditioner="eigendecomposed"`` its ``EigendecomposedKLShampooPreconditionerConfig``):
    each factor takes in the gradient preconditioned along the other dims by the roots in use
    (see `precondition_shampoo`). With ``preconditioner="eigenvalue_corrected"`` it is
    KL-SOAP: Meta's KL-Shampoo factor update in the eigenvalue-corrected form, the roots
    formed from the eigendecompositions of the last refresh (``eigendecomposition`` ``"eigh"``
    or ``"qr"``; see `precondition_eigenvalue_corrected`'s ``kl_shampoo``). Meta has no
    eigenvalue-corrected KL config: ``tests/test_kl_soap.py`` checks it against a float64
    derivation of the algorithm.

    Equal to ``DistributedShampoo`` with its default ``RootInvShampooPreconditionerConfig``
    on one device (``tests/test_shampoo_meta.py``: drawn trees and settings, float64 to 1e-8
    relative, float32 to 1e-5 or Meta's own one-ulp spread; measured bitwise equal on CPU in
    both, rank-deficient factors at ``epsilon=1e-12`` included, where Meta moves by up to
    41 % when its gradients move by one ulp; see the `opttx.transforms.shampoo` module for
    what is not equal). Meta keeps ``lr`` in a float32 tensor: an ``lr`` not exact in float32
    differs from Meta's by its float32 rounding (2.2e-8 relative for 1e-2). ``weight_decay`` with
    ``use_decoupled_weight_decay`` is Meta's ``WeightDecayType.DECOUPLED``, without it
    ``WeightDecayType.L2``; ``momentum``/``nesterov`` are Meta's ``ClassicMomentumConfig``
    (dampening 0).

    References:
      Gupta, Koren and Singer (arXiv 1802.09568); Shi et al. (arXiv 2309.06497).
    """
    beta1, beta2 = betas
    start = precondition_frequency if start_preconditioning_step is None \
        else start_preconditioning_step
    weight_decay, use_decoupled_weight_decay = _shampoo_weight_decay(
        weight_decay_type, learning_rate, weight_decay, use_decoupled_weight_decay)
    magnitude = _grafted_magnitude(grafting, grafting_beta2, grafting_epsilon)
    _check_preconditioner_options(
        preconditioner, kl_shampoo, first_moment_in_eigenbasis, root_method, root_max_iterations,
        root_tolerance, root_rel_epsilon, root_abs_epsilon, use_symmetric_packing,
        eigendecomposition)
    if preconditioner == "eigenvalue_corrected":
        direction = _eigenvalue_corrected_direction(
            beta1, beta2, epsilon, precondition_frequency, start, beta3=beta3,
            eigendecomposition=eigendecomposition, qr_iterations=qr_iterations,
            eigendecomposition_tolerance=eigendecomposition_tolerance,
            preconditioner_dtype=preconditioner_dtype, use_trace_scaling=use_trace_scaling,
            inv_factor_matrix_dtype=inv_factor_matrix_dtype, rank_deficient=rank_deficient,
            use_bias_correction=use_bias_correction, trace_scaling_exponent=trace_scaling_exponent,
            inverse_exponent_override=inverse_exponent_override,
            ignored_basis_change_dims=ignored_basis_change_dims,
            drop_weighting_factor_on_gsquare=drop_weighting_factor_on_gsquare,
            first_moment_in_eigenbasis=first_moment_in_eigenbasis, kl_shampoo=kl_shampoo)
        # without grafting, Meta runs its (identity-basis) direction from the first step
        graft_start = start if grafting is not None else 0
        graft_beta1 = 0.0 if first_moment_in_eigenbasis and grafting is None else beta1
    else:
        graft_start, graft_beta1 = start, beta1
        direction = _root_inverse_direction(
            beta2, epsilon, precondition_frequency, start, root_method,
            preconditioner=preconditioner, eigendecomposition=eigendecomposition,
            qr_iterations=qr_iterations, eigendecomposition_tolerance=eigendecomposition_tolerance,
            preconditioner_dtype=preconditioner_dtype, use_bias_correction=use_bias_correction,
            inv_factor_matrix_dtype=inv_factor_matrix_dtype, kl_shampoo=kl_shampoo,
            use_trace_scaling=use_trace_scaling, trace_scaling_exponent=trace_scaling_exponent,
            inverse_exponent_override=inverse_exponent_override,
            drop_weighting_factor_on_gsquare=drop_weighting_factor_on_gsquare,
            rank_deficient=rank_deficient, rank_atol=rank_atol, rank_rtol=rank_rtol,
            root_max_iterations=root_max_iterations, root_tolerance=root_tolerance,
            root_order=root_order, root_rel_epsilon=root_rel_epsilon,
            root_abs_epsilon=root_abs_epsilon, use_symmetric_packing=use_symmetric_packing)
    links: list[GradientTransformation] = [
        graft(magnitude(), direction, graft_start, graft_beta1, use_bias_correction,
              rescale=grafting is not None, beta3=beta3 if graft_beta1 else None)]
    if _nonzero(weight_decay) and use_decoupled_weight_decay:
        links.append(add_decayed_weights(weight_decay))
    if _nonzero(momentum):
        links.append(trace(momentum, nesterov=nesterov))
    links.append(scale_by_learning_rate(learning_rate))
    body = block_by_dims(chain(*links), max_preconditioner_dim, target_parameter_dimensionality)
    if _nonzero(weight_decay) and not use_decoupled_weight_decay:
        return chain(add_decayed_weights(weight_decay), body)
    return body


def _check_preconditioner_options(
        preconditioner: str, kl_shampoo: bool, first_moment_in_eigenbasis: bool,
        root_method: str, root_max_iterations: int | None, root_tolerance: float | None,
        root_rel_epsilon: float | None, root_abs_epsilon: float | None,
        use_symmetric_packing: bool, eigendecomposition: str = "eigh") -> None:
    """`shampoo`'s ``preconditioner`` is one it knows, given only the options it takes."""
    if preconditioner not in ("root_inverse", "eigendecomposed", "eigenvalue_corrected"):
        raise ValueError("preconditioner must be 'root_inverse', 'eigendecomposed' or "
                         f"'eigenvalue_corrected', got {preconditioner!r}.")
    if preconditioner == "eigenvalue_corrected":
        if kl_shampoo and eigendecomposition not in ("eigh", "qr"):
            raise ValueError("kl_shampoo with the eigenvalue-corrected preconditioner (KL-SOAP) "
                             "takes eigendecomposition 'eigh' or 'qr', got "
                             f"{eigendecomposition!r}.")
        if root_method != "eigh" or root_max_iterations is not None \
                or root_tolerance is not None or root_rel_epsilon is not None \
                or root_abs_epsilon is not None or use_symmetric_packing:
            raise ValueError("root_method, the root_* options and use_symmetric_packing set "
                             "the root-inverse preconditioner; the eigenvalue-corrected one "
                             "takes eigendecomposition=, qr_iterations=, "
                             "eigendecomposition_tolerance=.")
    elif first_moment_in_eigenbasis:
        raise ValueError("first_moment_in_eigenbasis is a setting of the "
                         "eigenvalue-corrected preconditioner.")


def _shampoo_weight_decay(weight_decay_type: Any, learning_rate: ScalarOrSchedule,
                          weight_decay: float, use_decoupled_weight_decay: bool
                          ) -> tuple[float, bool]:
    """`shampoo`'s weight decay under Meta's ``WeightDecayType`` (by name or the enum): the
    decay to apply and whether it is decoupled (unchanged when the type is None)."""
    if weight_decay_type is None:
        return weight_decay, use_decoupled_weight_decay
    kind = getattr(weight_decay_type, "value", weight_decay_type)
    if kind not in ("L2", "DECOUPLED", "CORRECTED", "INDEPENDENT"):
        raise ValueError("weight_decay_type must be 'L2', 'DECOUPLED', 'CORRECTED' or "
                         f"'INDEPENDENT', got {weight_decay_type!r}.")
    if kind in ("CORRECTED", "INDEPENDENT"):
        if not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
            raise ValueError(f"weight_decay_type={kind!r} needs a constant positive "
                             f"learning_rate (Meta's peak lr), got {learning_rate!r}.")
        # Meta: alpha = wd * lr / peak_lr (lr read back from a float32 tensor), wd / peak_lr
        lr32 = float(torch.tensor(float(learning_rate), dtype=torch.float32))
        weight_decay = weight_decay * lr32 / learning_rate if kind == "CORRECTED" \
            else weight_decay / learning_rate
    return weight_decay, kind != "L2"


def _grafted_magnitude(grafting: str | None, grafting_beta2: float, grafting_epsilon: float
                       ) -> Callable[[], GradientTransformation | None]:
    """`shampoo`'s grafted method by name: a function that builds it (None for SGD and no
    grafting), built after the direction as before. Meta's diagonal grafting, op for op (see
    `scale_by_grafted_diagonal`)."""
    magnitudes = {
        "adam": lambda: scale_by_grafted_diagonal(grafting_beta2, grafting_epsilon,
                                                  1 - grafting_beta2, True),
        "rmsprop": lambda: scale_by_grafted_diagonal(grafting_beta2, grafting_epsilon,
                                                     1 - grafting_beta2, False),
        "adagrad": lambda: scale_by_grafted_diagonal(1.0, grafting_epsilon, 1.0, False),
        "sgd": lambda: None,
        None: lambda: None,
    }
    if grafting not in magnitudes:
        raise ValueError(f"grafting must be 'adam', 'adagrad', 'rmsprop', 'sgd' or None, got "
                         f"{grafting!r}.")
    return magnitudes[grafting]


def _eigenvalue_corrected_direction(
        beta1: float, beta2: float, epsilon: float, precondition_frequency: int, start: int, *,
        eigendecomposition: str, qr_iterations: int, eigendecomposition_tolerance: float,
        preconditioner_dtype: torch.dtype, inv_factor_matrix_dtype: torch.dtype | None,
        use_bias_correction: bool, inverse_exponent_override: dict | None,
        ignored_basis_change_dims: dict | None, drop_weighting_factor_on_gsquare: bool,
        rank_deficient: str, use_trace_scaling: bool, trace_scaling_exponent: float,
        beta3: float | None, first_moment_in_eigenbasis: bool,
        kl_shampoo: bool = False) -> GradientTransformation:
    """`shampoo`'s direction for ``preconditioner="eigenvalue_corrected"`` (SOAP in Meta's
    form; KL-SOAP with ``kl_shampoo``), from `shampoo`'s arguments."""
    # (keywords spelled out: Dynamo of torch 2.11 cannot trace locals(), and
    # inject_hyperparams calls this factory inside a compiled step)
    return precondition_eigenvalue_corrected(
        beta2, epsilon, precondition_frequency, start,
        eigendecomposition=eigendecomposition, qr_iterations=qr_iterations,
        tolerance=eigendecomposition_tolerance, preconditioner_dtype=preconditioner_dtype,
        # Meta's factor_matrix_eigenvectors_dtype / corrected_eigenvalues_dtype: float32
        # by default, whatever the factors' dtype
        basis_dtype=torch.float32 if inv_factor_matrix_dtype is None
        else inv_factor_matrix_dtype, use_bias_correction=use_bias_correction,
        eigenvalue_exponent=inverse_exponent_override or {},
        ignored_basis_change_dims=ignored_basis_change_dims,
        drop_weighting_factor_on_gsquare=drop_weighting_factor_on_gsquare,
        rank_deficient=rank_deficient, use_trace_scaling=use_trace_scaling,
        trace_scaling_exponent=trace_scaling_exponent,
        # with first_moment_in_eigenbasis the direction keeps its own (rotated) filtered
        # gradient (refused with betas[0] = 0); graft keeps one only for the grafted
        # method, so none without grafting
        beta1=beta1 if first_moment_in_eigenbasis else 0.0,
        beta3=beta3 if first_moment_in_eigenbasis else None,
        first_moment_in_eigenbasis=first_moment_in_eigenbasis, kl_shampoo=kl_shampoo)


def _root_inverse_direction(
        beta2: float, epsilon: float, precondition_frequency: int, start: int,
        root_method: str, *, preconditioner: str, eigendecomposition: str, qr_iterations: int,
        eigendecomposition_tolerance: float, preconditioner_dtype: torch.dtype,
        use_bias_correction: bool, inv_factor_matrix_dtype: torch.dtype | None,
        use_trace_scaling: bool, trace_scaling_exponent: float,
        inverse_exponent_override: dict | None, drop_weighting_factor_on_gsquare: bool,
        rank_deficient: str, rank_atol: float, rank_rtol: float | None,
        root_max_iterations: int | None, root_tolerance: float | None, root_order: int,
        root_rel_epsilon: float | None, root_abs_epsilon: float | None,
        use_symmetric_packing: bool, kl_shampoo: bool) -> GradientTransformation:
    """`shampoo`'s direction for ``preconditioner="root_inverse"`` or ``"eigendecomposed"``
    (`precondition_shampoo`), from `shampoo`'s arguments."""
    eigendecomposed = dict(
        eigendecomposed=True, eigendecomposition=eigendecomposition,
        qr_iterations=qr_iterations,
        eigendecomposition_tolerance=eigendecomposition_tolerance,
    ) if preconditioner == "eigendecomposed" else {}
    return precondition_shampoo(beta2, epsilon, precondition_frequency, start,
                                root_method, preconditioner_dtype=preconditioner_dtype,
                                use_bias_correction=use_bias_correction,
                                inv_factor_matrix_dtype=inv_factor_matrix_dtype,
                                use_trace_scaling=use_trace_scaling,
                                trace_scaling_exponent=trace_scaling_exponent,
                                inverse_exponent_override=inverse_exponent_override,
                                drop_weighting_factor_on_gsquare=(
                                    drop_weighting_factor_on_gsquare),
                                rank_deficient=rank_deficient, rank_atol=rank_atol,
                                rank_rtol=rank_rtol,
                                root_max_iterations=root_max_iterations,
                                root_tolerance=root_tolerance, root_order=root_order,
                                root_rel_epsilon=0.0 if root_rel_epsilon is None
                                else root_rel_epsilon,
                                root_abs_epsilon=root_abs_epsilon,
                                use_symmetric_packing=use_symmetric_packing,
                                kl_shampoo=kl_shampoo, **eigendecomposed)


# ---------------------------------------------------------------------------------------------
# Muon
# ---------------------------------------------------------------------------------------------

# words of a path that mark an embedding, a position table or an output head (not a hidden
# matrix): ``tok_emb``, ``pos_emb`` (nanoGPT-style names), ``wte``/``wpe`` (GPT-2), ``lm_head``
_NOT_HIDDEN_WORDS = ("head", "wte", "wpe", "classifier", "emb", "tok", "token", "tokens", "pos",
                     "position", "positions")


def _path_words(path: str) -> list[str]:
    for sep in "[]'\".,_-/:":
        path = path.replace(sep, " ")
    return path.lower().split()


def muon_hidden_matrices(params: PyTree) -> PyTree:
    """The default rule of `muon`: a tree of booleans like ``params``, True for the hidden
    weight matrices that Muon updates.

    A leaf is a hidden matrix when it has exactly 2 dims and no word of its path (the path
    split at ``. _ - / [ ] '``, lower-cased) contains ``embed`` or is ``emb``, ``tok``,
    ``token(s)``, ``pos``, ``position(s)``, ``head``, ``wte``, ``wpe`` or ``classifier``:
    ``layers.0.mlp.fc1.weight`` is one; ``embed_tokens.weight``, ``tok_emb.weight``,
    ``pos_emb.weight``, ``lm_head.weight``, ``transformer.wte.weight``, biases, norm scales
    and conv kernels are not (they go to AdamW). Pass ``muon_mask=`` to `muon` for any other rule (for example to
    add 3-D conv or stacked-expert weights, with ``matrix_axes``).
    """
    leaves, spec = tree_flatten(params)
    paths = tree_paths(params)
    return tree_unflatten(
        [x.dim() == 2 and not any("embed" in w or w in _NOT_HIDDEN_WORDS
                                  for w in _path_words(path))
         for x, path in zip(leaves, paths)], spec)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "beta": HyperRole.MOMENTUM,
                      "eps": HyperRole.EPS, "weight_decay": HyperRole.WEIGHT_DECAY,
                      "consistent_rms": None, "adam_b1": HyperRole.B1, "adam_b2": HyperRole.B2,
                      "adam_eps_root": None, "adam_weight_decay": HyperRole.WEIGHT_DECAY,
                      "adam_learning_rate": HyperRole.LEARNING_RATE}, runtime=("ns_steps",
                                                                               "ns_coeffs"))
def muon(learning_rate: ScalarOrSchedule, ns_coeffs: Any = NS_COEFFS, ns_steps: int = 5,
         beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
         weight_decay_mask: Mask = None, mu_dtype: torch.dtype | None = None, *,
         nesterov: bool = True, bias_correction: bool = True,
         ns_dtype: torch.dtype | None = None, method: Method = "newton_schulz",
         consistent_rms: float | None = None, matrix_axes: MatrixAxes = (-2, -1),
         muon_mask: Mask = None, adam_b1: float = 0.9, adam_b2: float = 0.999,
         adam_eps_root: float = 0.0, adam_weight_decay: float = 0.0,
         adam_learning_rate: ScalarOrSchedule | None = None,
         split: Any = None, momentum_8bit: bool = False,
         sharded_mode: ShardedMode = "owners",
         cautious_weight_decay: bool = False) -> GradientTransformation:
    r"""Muon: momentum orthogonalized by Newton–Schulz on hidden matrices, AdamW elsewhere.

    .. math::
        m_t = \beta m_{t-1} + (1-\beta) g_t, \quad
        \tilde m_t = \beta \hat m_t + (1-\beta) \hat g_t \ (\text{Nesterov}), \quad
        O_t = \mathrm{NS}_K(\tilde m_t), \quad
        x_{t+1} = x_t - \eta \left(s(m, n)\, O_t + \lambda x_t\right)

    on the leaves that ``muon_mask`` selects, composed as ``chain(ema(beta, bias_correction,
    mu_dtype, nesterov=nesterov), orthogonalize(ns_steps, ns_coeffs, eps, method,
    matrix_axes, ns_dtype=ns_dtype), scale_by_shape(consistent_rms, matrix_axes),
    add_decayed_weights(weight_decay, weight_decay_mask), scale_by_learning_rate(lr))``
    (hats: divided by :math:`1-\beta^t`, :math:`1-\beta^{t+1}` as in `ema`; none with
    ``bias_correction=False``). Every other leaf runs ``adamw(adam_learning_rate or lr,
    adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, adam_weight_decay, nesterov=nesterov)``.
    The two groups are a `partition`, labels ``"muon"`` and ``"adam"``.

    Which leaves are Muon's: ``muon_mask`` (a tree of booleans like the params, or a
    function of them), by default `muon_hidden_matrices` (2-D weights whose path names no
    embedding or head). Muon is for hidden layers; embeddings, output heads, biases and
    norm scales do better with AdamW. Weights of 3 or more dims (convolutions, stacked
    experts) that the mask selects are orthogonalized per matrix over ``matrix_axes``.

    Defaults and numbers of ``optax.contrib.muon`` (for its (in, out) weight layout pass
    ``matrix_axes=(-1, -2)``; its ``muon_weight_dimension_numbers`` is ``muon_mask`` plus
    ``matrix_axes``). ``torch.optim.Muon(lr, weight_decay, momentum, nesterov,
    ns_coefficients, eps, ns_steps, adjust_lr_fn)`` on 2-D weights is
    ``muon(lr, ns_coefficients, ns_steps, beta=momentum, eps=eps, weight_decay=weight_decay,
    nesterov=nesterov, bias_correction=False, ns_dtype=torch.bfloat16,
    consistent_rms=None if adjust_lr_fn in (None, "original") else 0.2)`` with every
    leaf selected: same numbers (torch clamps the norm at ``eps`` where this adds it, a
    difference below bfloat16's resolution).

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      ns_coeffs, ns_steps, method, ns_dtype: see `orthogonalize`.
      beta: the momentum :math:`\beta`, in [0, 1).
      eps: added to the Frobenius norm before Newton–Schulz, and AdamW's :math:`\epsilon`.
      weight_decay: :math:`\lambda` of the Muon group (decoupled, scaled by :math:`\eta`);
        ``weight_decay_mask`` says where it applies.
      mu_dtype: dtype of the momentum (and of AdamW's first moment).
      nesterov: Nesterov momentum (both groups, as optax).
      bias_correction: debias the momentum (optax); off for torch.optim.Muon's numbers.
      consistent_rms: see `scale_by_shape` (None: :math:`\sqrt{\max(1, m/n)}`; 0.2: Moonlight's
        and torch's ``"match_rms_adamw"``).
      matrix_axes: the (row, column) axes of each matrix, rows being the fan-out.
      muon_mask: which leaves Muon updates (default `muon_hidden_matrices`).
      split: row blocks orthogonalized and scaled on their own (heads, fused QKV): see
        `orthogonalize`.
      momentum_8bit: keep the Muon momentum in 8-bit block-wise form
        (``quantize_state(ema(...))``, blocks of 256, leaves of 4096 elements or more):
        1.016 bytes per parameter instead of 4 (benchmarks/RESULTS.md); the AdamW group is
        unchanged.
      sharded_mode: how `orthogonalize` takes matrices sharded over a matrix axis under
        `opttx.distributed.sharded` (``"owners"``: refused, run on owners; ``"gram"`` or
        ``"auto"``: on the shards, the Gram matrix all-reduced): see `orthogonalize`.
      adam_b1, adam_b2, adam_eps_root, adam_weight_decay, adam_learning_rate: the AdamW of
        the other leaves (its learning rate defaults to ``learning_rate``).
      cautious_weight_decay: both groups decay only where the update (Muon's scaled
        orthogonalized momentum, Adam's direction) and the parameter agree in sign
        (`add_decayed_weights` with ``cautious=True``; Chen et al., arXiv 2510.12402).

    Example:
      >>> tx = opttx.muon(0.02, weight_decay=0.01, adam_learning_rate=3e-4)
      >>> tx = opttx.muon(0.02, consistent_rms=0.2,            # Moonlight's scaling
      ...                 muon_mask=lambda p: {k: v.ndim >= 2 and "embed" not in k
      ...                                      for k, v in p.items()})

    References:
      Jordan et al., Muon: An optimizer for hidden layers in neural networks (2024),
      https://kellerjordan.github.io/posts/muon/; Liu et al., Muon is Scalable for LLM
      Training (arXiv 2502.16982).
    """
    selected = muon_hidden_matrices if muon_mask is None else muon_mask

    def labels(params: PyTree) -> PyTree:
        spec = tree_flatten(params)[1]
        return tree_unflatten(["muon" if keep else "adam"
                               for keep in mask_leaves(selected, params)], spec)

    momentum = ema(beta, debias=bias_correction, accumulator_dtype=mu_dtype, nesterov=nesterov)
    muon_group = chain(
        quantize_state(momentum) if momentum_8bit else momentum,
        orthogonalize(ns_steps, ns_coeffs, eps, method, matrix_axes, ns_dtype=ns_dtype,
                      split=split, sharded_mode=sharded_mode),
        scale_by_shape(consistent_rms, matrix_axes, split=split),
        add_decayed_weights(weight_decay, weight_decay_mask, cautious=cautious_weight_decay),
        scale_by_learning_rate(learning_rate))
    adam_group = adamw(learning_rate if adam_learning_rate is None else adam_learning_rate,
                       adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, adam_weight_decay,
                       nesterov=nesterov, cautious_weight_decay=cautious_weight_decay)
    return partition({"muon": muon_group, "adam": adam_group}, labels)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "beta": HyperRole.MOMENTUM,
                      "eps": HyperRole.EPS, "weight_decay": HyperRole.WEIGHT_DECAY,
                      "block_scale": None, "consistent_rms": None, "adam_b1": HyperRole.B1,
                      "adam_b2": HyperRole.B2, "adam_eps_root": None,
                      "adam_weight_decay": HyperRole.WEIGHT_DECAY,
                      "adam_learning_rate": HyperRole.LEARNING_RATE},
         runtime=("ns_steps", "ns_coeffs"))
def muon_bp(learning_rate: ScalarOrSchedule, full_every: int | None = 5,
            blocks: BlockGrid = None, block_scale: float = 1.0, ns_coeffs: Any = NS_COEFFS,
            ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.0,
            weight_decay_mask: Mask = None, mu_dtype: torch.dtype | None = None, *,
            nesterov: bool = True, bias_correction: bool = True,
            ns_dtype: torch.dtype | None = None, method: Method = "newton_schulz",
            consistent_rms: float | None = 0.2, matrix_axes: MatrixAxes = (-2, -1),
            muon_mask: Mask = None, adam_b1: float = 0.9, adam_b2: float = 0.999,
            adam_eps_root: float = 0.0, adam_weight_decay: float = 0.0,
            adam_learning_rate: ScalarOrSchedule | None = None) -> GradientTransformation:
    r"""MuonBP: `muon` whose orthogonalization is block-wise on most steps and of the whole
    matrix every ``full_every`` steps (`orthogonalize_block_periodic`).

    .. math::
        m_t = \beta m_{t-1} + (1-\beta) g_t, \qquad
        x_{t+1} = x_t - \eta \left(D_t + \lambda x_t\right), \qquad
        D_t = \begin{cases} s(m, n)\, \mathrm{Orth}(\tilde m_t) & t \bmod P = 0 \\
        \rho\, s(m_i, n_j)\, \mathrm{Orth}(\tilde m_{t, ij}) \text{ per block} &
        \text{otherwise} \end{cases}

    on the leaves ``muon_mask`` selects (step :math:`t` from 0; :math:`\tilde m_t` the
    Nesterov momentum as in `muon`), composed as ``chain(ema(beta, bias_correction, mu_dtype,
    nesterov=nesterov), orthogonalize_block_periodic(full_every, blocks, consistent_rms,
    block_scale, ...), add_decayed_weights(weight_decay, weight_decay_mask),
    scale_by_learning_rate(learning_rate))``; AdamW on the other leaves, as in `muon`.

    MuonBP's two step sizes: ``learning_rate`` is :math:`\eta_{full}`, and a block step moves
    by :math:`\eta_{block} = \rho\,\eta_{full}` with :math:`\rho` = ``block_scale``;
    each kind of step is scaled by the shape of what it orthogonalized (the whole matrix, or
    the block), :math:`s(m, n) = 0.2\sqrt{\max(m, n)}` by default (``consistent_rms=0.2``:
    the RMS matching to AdamW the paper uses, so AdamW's learning rate carries over). The
    decoupled weight decay is :math:`\eta_{full}\lambda` on every step.

    ``blocks`` are the blocks of the block step (`BlockGrid`): for tensor-parallel or FSDP
    shards, the shards (``blocks=None`` under `opttx.distributed.sharded`: each rank's
    shard; ``(k, 1)`` or ``(1, k)``: ``k`` row or column blocks cut as the shards of ``k``
    ranks, which one device runs too). Under `opttx.distributed.sharded` the block steps
    need no collective and the full steps equal one device (see
    `orthogonalize_block_periodic`). ``full_every=1`` is `muon` with this scaling;
    ``None`` never takes a full step.

    Args:
      learning_rate: :math:`\eta_{full}`, a number or a schedule.
      full_every: :math:`P` (the paper's experiments: 5), or None.
      blocks: the block grid of each matrix (above).
      block_scale: :math:`\rho = \eta_{block} / \eta_{full}`.
      consistent_rms: :math:`\gamma` of `scale_by_shape` for both kinds of step (None: the
        width scaling :math:`\sqrt{\max(1, m/n)}`).
      ns_coeffs, ns_steps, method, ns_dtype, beta, eps, weight_decay, weight_decay_mask,
        mu_dtype, nesterov, bias_correction, matrix_axes, muon_mask: as in `muon`.
      adam_b1, adam_b2, adam_eps_root, adam_weight_decay, adam_learning_rate: the AdamW of
        the other leaves, as in `muon`.

    Example:
      >>> tx = opttx.muon_bp(0.02, full_every=5, blocks=(8, 1), weight_decay=0.01)
      >>> tx = opttx.distributed.sharded(opttx.muon_bp(0.02),    # blocks: the shards
      ...                                {"w": Shard(0), "b": Replicated()})

    References:
      Khaled, Ozkara, Yu, Hong and Park, MuonBP: Faster Muon via Block-Periodic
      Orthogonalization (arXiv 2510.16981).
    """
    muon_group = chain(
        ema(beta, debias=bias_correction, accumulator_dtype=mu_dtype, nesterov=nesterov),
        orthogonalize_block_periodic(full_every, blocks, consistent_rms, block_scale, ns_steps,
                                     ns_coeffs, eps, method, matrix_axes, ns_dtype=ns_dtype),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(learning_rate))
    adam_group = adamw(learning_rate if adam_learning_rate is None else adam_learning_rate,
                       adam_b1, adam_b2, eps, adam_eps_root, mu_dtype, adam_weight_decay,
                       nesterov=nesterov)
    return _matrices_and_adamw("muon", muon_group, muon_mask, adam_group)


# ---------------------------------------------------------------------------------------------
# Schedule-Free and Prodigy
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "weight_lr_power": None, "r": None},
         runtime=("warmup_steps",))
def schedule_free_adamw(learning_rate: float = 0.0025, warmup_steps: int = 0, b1: float = 0.9,
                        b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                        weight_lr_power: float = 2.0, r: float = 0.0,
                        state_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Schedule-Free AdamW: `schedule_free` around Adam without momentum.

    .. math::
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \qquad
        z_{t+1} = z_t - \gamma_t \left(\frac{g_t}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}
        + \lambda y_t\right)

    with :math:`y_t` the parameters, :math:`\gamma_t` the warmed-up learning rate, and the
    interpolation and averaging of `schedule_free`. Same numbers as
    ``schedulefree.AdamWScheduleFree(lr, betas=(b1, b2), eps, weight_decay, warmup_steps, r,
    weight_lr_power)`` (weight decay at :math:`y`, scaled by the warmed-up learning rate),
    and as ``optax.contrib.schedule_free_adamw`` without warmup. With ``warmup_steps`` optax
    scales the :math:`z` step by its warm-up schedule at the 0-based step and the averaging
    weight at the 1-based one; this alias (as ``schedulefree``) uses the 1-based step for
    both (optax's numbers: `schedule_free` around ``chain(scale_by_rms(b2, eps,
    eps_in_sqrt=False, bias_correction=True), add_decayed_weights(wd),
    scale_by_learning_rate(sched))`` with ``learning_rate=sched``).

    Evaluate at `schedule_free_eval_params`, or call `opttx.Optimizer.eval` /
    ``train`` as with ``schedulefree``'s optimizers.

    Example:
      >>> tx = opttx.schedule_free_adamw(1e-3, warmup_steps=100, weight_decay=0.01)

    References:
      Defazio et al., The Road Less Scheduled (arXiv 2405.15682).
    """
    inner = chain(scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True),
                  add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))
    return schedule_free(inner, learning_rate, b1, weight_lr_power, warmup_steps, r,
                         state_dtype)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "weight_lr_power": None, "r": None},
         runtime=("warmup_steps",))
def schedule_free_sgd(learning_rate: float = 1.0, warmup_steps: int = 0, b1: float = 0.9,
                      weight_decay: float = 0.0, weight_lr_power: float = 2.0, r: float = 0.0,
                      state_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Schedule-Free SGD: `schedule_free` around SGD,
    :math:`z_{t+1} = z_t - \gamma_t (g_t + \lambda y_t)`.

    Same numbers as ``schedulefree.SGDScheduleFree(lr, momentum=b1, weight_decay,
    warmup_steps, r, weight_lr_power)`` and, without warmup, as
    ``optax.contrib.schedule_free_sgd`` (see `schedule_free_adamw` for the warmup).

    Example:
      >>> tx = opttx.schedule_free_sgd(1.0, warmup_steps=50)

    References:
      Defazio et al., The Road Less Scheduled (arXiv 2405.15682).
    """
    inner = chain(add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))
    return schedule_free(inner, learning_rate, b1, weight_lr_power, warmup_steps, r,
                         state_dtype)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "beta3": None,
                      "eps": HyperRole.EPS, "estim_lr0": None, "estim_lr_coef": None,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "growth_rate": None})
def prodigy(learning_rate: ScalarOrSchedule = 1.0, betas: tuple[float, float] = (0.9, 0.999),
            beta3: float | None = None, eps: float = 1e-8, estim_lr0: float = 1e-6,
            estim_lr_coef: float = 1.0, weight_decay: float = 0.0,
            safeguard_warmup: bool = False, growth_rate: float = float("inf")
            ) -> GradientTransformation:
    r"""Prodigy: learning-rate-free AdamW (`scale_by_prodigy`, as a descent step).

    Same signature, defaults and numbers as ``optax.contrib.prodigy`` (plus
    ``prodigyopt``'s ``growth_rate``). ``learning_rate`` multiplies the estimated step size
    and enters the estimate; use a schedule with peak 1.0 (for example a linear decay to 0).
    Its sums over all leaves are reduced over shards and ranks, so it is exact under
    `opttx.distributed`.

    Example:
      >>> tx = opttx.prodigy(weight_decay=0.01)

    References:
      Mishchenko and Defazio, Prodigy (arXiv 2306.06101).
    """
    return scale_by_prodigy(learning_rate, betas, beta3, eps, estim_lr0, estim_lr_coef,
                            weight_decay, safeguard_warmup, growth_rate, flip_sign=True)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "b3": None, "alpha": None, "eps": HyperRole.EPS,
                      "eps_root": None, "weight_decay": HyperRole.WEIGHT_DECAY})
def ademamix(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
             b3: float | Schedule = 0.9999, alpha: float | Schedule = 5.0, eps: float = 1e-8,
             eps_root: float = 0.0, mu_dtype: torch.dtype | None = None,
             weight_decay: float = 0.0, mask: Mask = None) -> GradientTransformation:
    r"""AdEMAMix (`scale_by_ademamix`) with decoupled weight decay.

    .. math::
        x_{t+1} = x_t - \eta \left(u_t + \lambda x_t\right)

    with :math:`u_t` the output of `scale_by_ademamix`. Arguments, defaults and numbers are
    ``optax.contrib.ademamix``'s. The decay is scaled by the learning rate (AdamW's
    convention, as optax): ``pytorch_optimizer.AdEMAMix(weight_decouple=True)``'s numbers.

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2, b3, alpha, eps, eps_root, mu_dtype: as in `scale_by_ademamix` (``b3`` and
        ``alpha`` may be schedules: the paper's warm-ups).
      weight_decay: :math:`\lambda` >= 0.
      mask: where to apply the decay (tree of booleans or a function of the params).

    Example:
      >>> tx = opttx.ademamix(1e-3, b3=0.999, alpha=8.0, weight_decay=0.1)

    References:
      Pagliardini, Ablin and Grangier, The AdEMAMix Optimizer (arXiv 2409.03137).
    """
    return chain(scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "clip_value_fn": None})
def adopt(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.9999, eps: float = 1e-6,
          mu_dtype: torch.dtype | None = None, weight_decay: float = 0.0, mask: Mask = None, *,
          nesterov: bool = False, use_clipping: bool = True,
          clip_value_fn: Callable[[torch.Tensor], Any] | float | None = None
          ) -> GradientTransformation:
    r"""ADOPT (`scale_by_adopt`), with decoupled weight decay (ADOPTW).

    .. math::
        x_{t+1} = x_t - \eta \left(u_t + \lambda x_t\right)

    with :math:`u_t` the output of `scale_by_adopt` (0 at the first step). Positional
    arguments, defaults and numbers are ``optax.contrib.adopt``'s (which has no weight decay:
    ``weight_decay=0``, the default, is exactly it). The decay is decoupled and scaled by the
    learning rate, as ``torch.optim.AdamW`` and the ADOPT authors' ``decouple=True``: the
    same numbers as ``pytorch_optimizer.ADOPT(weight_decouple=True)`` (which multiplies
    ``p`` by :math:`1 - \eta\lambda` first, the first step included) when its
    ``clip_lambda`` is given the 0-based step (see ``clip_value_fn``).

    Args:
      learning_rate: :math:`\eta`, a number or a schedule.
      b1, b2, eps, mu_dtype, nesterov, use_clipping: as in `scale_by_adopt`.
      weight_decay: :math:`\lambda` >= 0.
      mask: where to apply the decay (tree of booleans or a function of the params).
      clip_value_fn: the clipping bound as a function of the 0-based step (default
        :math:`t^{1/4}`, optax's; see `scale_by_adopt`).

    Example:
      >>> tx = opttx.adopt(1e-3, weight_decay=0.01)

    References:
      Taniguchi et al., ADOPT (arXiv 2411.02853).
    """
    clip = {} if clip_value_fn is None else {"clip_value_fn": clip_value_fn}
    return chain(scale_by_adopt(b1, b2, eps, mu_dtype, nesterov=nesterov,
                                use_clipping=use_clipping, **clip),
                 add_decayed_weights(weight_decay, mask),
                 scale_by_learning_rate(learning_rate))


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "shampoo_beta": None, "eps": HyperRole.EPS,
                      "weight_decay": HyperRole.WEIGHT_DECAY}, runtime=("precondition_frequency",))
def soap(learning_rate: ScalarOrSchedule = 3e-3, b1: float = 0.95, b2: float = 0.95,
         shampoo_beta: float | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
         precondition_frequency: int = 10, max_precond_dim: int = 10000,
         merge_dims: bool | Literal["heavyball"] = False, precondition_1d: bool = False, *,
         eigendecomposition: str = "power", preconditioner_dtype: torch.dtype = torch.float32,
         mask: Mask = None, first_moment_in_eigenbasis: bool = False) -> GradientTransformation:
    r"""SOAP: Adam in the eigenbasis of Shampoo's factors, as the SOAP paper's algorithm.

    ``chain(precondition_eigenvalue_corrected(b2, eps, precondition_frequency, beta1=b1,
    shampoo_beta=..., schedule="soap", eigendecomposition="power", ...),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``:

    .. math::
        L \leftarrow \beta_s L + (1 - \beta_s) G G^\top, \quad
        R \leftarrow \beta_s R + (1 - \beta_s) G^\top G, \quad
        \tilde G = Q_L^\top G Q_R,\quad
        u = Q_L \frac{Q_L^\top \hat m Q_R}{\sqrt{\hat v} + \epsilon} Q_R^\top

    with :math:`\hat m, \hat v` Adam's bias-corrected moments (of :math:`G` and of
    :math:`\tilde G^2`), :math:`\beta_s` = ``shampoo_beta`` (default ``b2``). The first
    gradient only initialises :math:`L, R` and their eigenbases (``eigh``; the first update is
    zero); later updates use the bases from before the current gradient; every
    ``precondition_frequency`` Adam steps the bases are refreshed by one power step with QR
    (columns sorted by estimated eigenvalue, :math:`\hat v` permuted with them). Dims larger
    than ``max_precond_dim`` and 1-D leaves (unless ``precondition_1d``) stay in the standard
    basis. Arguments and defaults are the SOAP paper's reference code's (Vyas et al.;
    ``pytorch_optimizer.SOAP``); heavyball's ``SOAP`` takes the same names with other defaults
    (``betas=(0.9, 0.95)``, ``precondition_frequency=2``, ``max_precond_dim=2048``,
    ``merge_dims=True``). ``merge_dims=True`` reshapes each leaf as the reference code does
    (`merge_dims_soap`: dims multiplied together from the first while the product stays
    <= ``max_precond_dim``, so a convolution ``(128, 64, 3, 3)`` is preconditioned as
    ``(8192, 9)`` below 10000, and a matrix that fits as one dim); ``merge_dims="heavyball"``
    as heavyball does (`merge_dims_heavyball`: dim 0 kept, the kernel merged into the fan-in:
    ``(128, 576)``). The moments keep the leaves' shapes; the factors and bases are those of
    the merged dims. 1-D leaves follow ``precondition_1d``; a leaf merged into one dim is
    rotated, as in the reference code (heavyball leaves one, e.g. an ``(n, 1)`` leaf, in the
    standard basis unless ``precondition_1d``).
    ``first_moment_in_eigenbasis=True`` keeps Adam's first moment rotated into the eigenbasis
    (heavyball's layout): six matrix products per 2-D block and step instead of eight, the
    same numbers up to rounding (see `precondition_eigenvalue_corrected`).

    Same numbers as ``pytorch_optimizer.SOAP`` (float32) and heavyball's ``SOAP`` where their
    definitions agree; the differences (weight decay applied after the update and the
    ``eps`` inside the bias correction in the reference code, heavyball's lifted QR and its
    refresh one step earlier) are listed in `opttx.transforms.soap` and tested in
    ``tests/test_soap.py``. Meta's form of the same method is
    ``shampoo(preconditioner="eigenvalue_corrected")``.

    Example:
      >>> tx = opttx.soap(3e-3, precondition_frequency=10)

    SOAP's direction then Muon's orthogonalization (the "SOAP -> Muon" of the modded-nanogpt
    speedrun records) is a chain: the direction of the eigenvalue-corrected preconditioner
    with the SOAP schedule, each matrix replaced by its orthogonal polar factor, then the
    step size (``tests/test_kl_soap.py`` checks it against a float64 derivation):

      >>> tx = opttx.chain(
      ...     opttx.precondition_eigenvalue_corrected(0.95, 1e-8, 10, beta1=0.9,
      ...                                             schedule="soap",
      ...                                             eigendecomposition="eigh"),
      ...     opttx.orthogonalize(), opttx.scale_by_learning_rate(0.02))

    With ``kl_shampoo=True`` (and ``schedule="meta"``) the direction is KL-SOAP's.

    References:
      Vyas et al., SOAP: Improving and Stabilizing Shampoo using Adam (arXiv 2409.11321).
    """
    if merge_dims not in (False, True, "heavyball"):
        raise ValueError(f"soap: merge_dims must be False, True (the SOAP reference code's "
                         f"merging) or 'heavyball', got {merge_dims!r}.")
    rule = {True: merge_dims_soap, "heavyball": merge_dims_heavyball}.get(merge_dims)
    links = [precondition_eigenvalue_corrected(
        b2, eps, precondition_frequency, beta1=b1, shampoo_beta=shampoo_beta,
        eigendecomposition=eigendecomposition, schedule="soap",
        preconditioner_dtype=preconditioner_dtype,
        first_moment_in_eigenbasis=first_moment_in_eigenbasis,
        ignored_basis_change_dims=None if precondition_1d else {1: [0]},
        max_basis_dim=max_precond_dim,
        merge_dims=None if rule is None else functools.partial(rule, max_dim=max_precond_dim))]
    if _nonzero(weight_decay):
        links.append(add_decayed_weights(weight_decay, mask))
    links.append(scale_by_learning_rate(learning_rate))
    return chain(*links)


# ---------------------------------------------------------------------------------------------
# The Muon family: NorMuon, AdaMuon, Dion, Dion2
# ---------------------------------------------------------------------------------------------

AdjustLr = Literal["spectral_norm", "rms_norm"] | None


def _shape_scaling(adjust_lr: AdjustLr, matrix_axes: Any, split: Any = None
                   ) -> GradientTransformation:
    """The ``dion`` package's ``adjust_lr`` as a `scale_by_shape`."""
    if adjust_lr == "spectral_norm":
        return scale_by_shape(None, matrix_axes, split=split, convention="spectral")
    if adjust_lr == "rms_norm":
        return scale_by_shape(0.2, matrix_axes, split=split)
    if adjust_lr is None:
        return identity()
    raise ValueError(f"adjust_lr must be 'spectral_norm', 'rms_norm' or None, got "
                     f"{adjust_lr!r}.")


def _adam_group(learning_rate: ScalarOrSchedule, adam_learning_rate: Any, b1: float, b2: float,
                eps: float, weight_decay: float, adam_weight_decay: float | None
                ) -> GradientTransformation:
    """The AdamW of the leaves that are not matrices: the matrices' learning rate and decay
    unless its own are given (the ``dion`` package's param-group defaults)."""
    return adamw(learning_rate if adam_learning_rate is None else adam_learning_rate, b1, b2,
                 eps, weight_decay=weight_decay if adam_weight_decay is None
                 else adam_weight_decay)


def _matrices_and_adamw(name: str, matrix_group: GradientTransformation, mask: Mask,
                        adam_group: GradientTransformation) -> GradientTransformation:
    """``partition`` of the leaves ``mask`` selects (default `muon_hidden_matrices`) to
    ``matrix_group`` (label ``name``), the others to ``adam_group`` (label ``"adam"``)."""
    selected = muon_hidden_matrices if mask is None else mask

    def labels(params: PyTree) -> PyTree:
        spec = tree_flatten(params)[1]
        return tree_unflatten([name if keep else "adam" for keep in
                               mask_leaves(selected, params)], spec)

    return partition({name: matrix_group, "adam": adam_group}, labels)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "momentum": HyperRole.MOMENTUM,
                      "b2": HyperRole.B2, "weight_decay": HyperRole.WEIGHT_DECAY,
                      "eps": HyperRole.EPS, "adam_b1": HyperRole.B1, "adam_b2": HyperRole.B2,
                      "adam_weight_decay": HyperRole.WEIGHT_DECAY,
                      "adam_learning_rate": HyperRole.LEARNING_RATE})
def normuon(learning_rate: ScalarOrSchedule = 0.01, momentum: float = 0.95, b2: float = 0.95,
            weight_decay: float = 0.01, eps: float = 1e-8, *, nesterov: bool = False,
            method: Method = "polar_express", ns_dtype: torch.dtype | None = None,
            adjust_lr: AdjustLr = "spectral_norm", split: Any = None,
            matrix_axes: MatrixAxes = (-2, -1), muon_mask: Mask = None, adam_b1: float = 0.9,
            adam_b2: float = 0.95, adam_weight_decay: float | None = None,
            adam_learning_rate: ScalarOrSchedule | None = None,
            sharded_mode: ShardedMode = "owners",
            cautious_weight_decay: bool = False) -> GradientTransformation:
    r"""NorMuon: Muon with a neuron-wise second moment of the orthogonalized update.

    .. math::
        m_t = \mu m_{t-1} + g_t, \quad O_t = \mathrm{orth}(m_t \text{ or } \mu m_t + g_t), \quad
        u_t = \mathrm{NorMuon}(O_t), \quad x_{t+1} = x_t - \eta (s\, u_t + \lambda x_t)

    on the leaves ``muon_mask`` selects: ``chain(trace(momentum, nesterov),
    orthogonalize(method=method, eps=eps), scale_by_neuron_rms(b2, eps), shape scaling,
    add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))``, the shape
    scaling :math:`s` being the ``dion`` package's ``adjust_lr`` (``"spectral_norm"``:
    :math:`\sqrt{m/n}`; ``"rms_norm"``: :math:`0.2\sqrt{\max(m, n)}`; None: 1). Other leaves
    run ``adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, eps,
    weight_decay=adam_weight_decay or weight_decay)``.

    Defaults and numbers of the ``dion`` package's ``NorMuon`` (``lr, mu, muon_beta2,
    weight_decay, epsilon, nesterov, adjust_lr``, Polar Express), whose iteration runs in
    bfloat16: ``ns_dtype=torch.bfloat16`` for that (tests/test_muon_family.py compares in
    float64 with the bfloat16 casts of the reference undone, <= 1e-8).
    ``cautious_weight_decay=True``: the matrices decay only where their update and the
    parameter agree in sign (`add_decayed_weights` with ``cautious=True``, arXiv 2510.12402).

    ``sharded_mode`` as in `muon` (the neuron statistics and norms are summed over the
    shards through the reduction hook).

    Example:
      >>> tx = opttx.normuon(0.01, weight_decay=0.01, adam_learning_rate=3e-4)

    References:
      Li et al., NorMuon: Making Muon more efficient and scalable (arXiv 2510.05491).
    """
    group = chain(trace(momentum, nesterov=nesterov),
                  orthogonalize(5, NS_COEFFS, eps, method, matrix_axes, ns_dtype=ns_dtype,
                                split=split, sharded_mode=sharded_mode),
                  scale_by_neuron_rms(b2, eps, matrix_axes, split=split),
                  _shape_scaling(adjust_lr, matrix_axes, split),
                  add_decayed_weights(weight_decay, cautious=cautious_weight_decay),
                  scale_by_learning_rate(learning_rate))
    adam = _adam_group(learning_rate, adam_learning_rate, adam_b1, adam_b2, eps, weight_decay,
                       adam_weight_decay)
    return _matrices_and_adamw("normuon", group, muon_mask, adam)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "b2": HyperRole.B2, "weight_decay": HyperRole.WEIGHT_DECAY,
                      "eps": HyperRole.EPS, "ns_eps": None, "consistent_rms": None,
                      "adam_learning_rate": HyperRole.LEARNING_RATE, "adam_b1": HyperRole.B1,
                      "adam_b2": HyperRole.B2, "adam_weight_decay": HyperRole.WEIGHT_DECAY},
         runtime=("ns_steps", "ns_coeffs"))
def adamuon(learning_rate: ScalarOrSchedule = 0.02, b1: float = 0.9, b2: float = 0.95,
            weight_decay: float = 0.0, eps: float = 1e-10, *, sign: bool = False,
            ns_steps: int = 5, ns_coeffs: Any = NS_COEFFS, ns_eps: float = 1e-7,
            ns_dtype: torch.dtype | None = None, consistent_rms: float | None = 0.2,
            matrix_axes: MatrixAxes = (-2, -1), muon_mask: Mask = None,
            adam_learning_rate: ScalarOrSchedule = 3e-4, adam_b1: float = 0.9,
            adam_b2: float = 0.999, adam_weight_decay: float = 0.0,
            sharded_mode: ShardedMode = "owners") -> GradientTransformation:
    r"""AdaMuon: an element-wise second moment of Muon's orthogonalized update, rescaled to
    Adam's update RMS.

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad O_t = \mathrm{NS}(m_t) \
        (\mathrm{NS}(\mathrm{sign}\, m_t) \text{ with } \texttt{sign}), \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) O_t^2,

    .. math::
        \hat O_t = O_t / (\sqrt{v_t / (1-\beta_2^t)} + \epsilon), \quad
        u_t = 0.2 \sqrt{mn}\, \hat O_t / (\lVert \hat O_t \rVert_F + \epsilon), \quad
        x_{t+1} = x_t - \eta (u_t + \lambda x_t)

    on the leaves ``muon_mask`` selects: ``chain(ema(b1, debias=False), [scale_by_sign()],
    orthogonalize(ns_steps, ns_coeffs, ns_eps), scale_by_rms(b2, eps, eps_in_sqrt=False,
    bias_correction=True), scale_to_orthogonal_norm(eps), scale_by_shape(consistent_rms),
    add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))``; other leaves
    run ``adamw(adam_learning_rate, adam_b1, adam_b2, eps, weight_decay=adam_weight_decay)``.

    Defaults and numbers of ``pytorch_optimizer.AdaMuon`` (``use_adjusted_lr=True``;
    ``consistent_rms=None`` for ``False``), which follows the first version of the paper:
    no sign before the orthogonalization. The paper's later versions add that
    "sign-stabilized" step: ``sign=True``. The reference flattens leaves of more than two
    dims to (rows, rest); here they are batches of matrices over ``matrix_axes``.
    ``sharded_mode`` as in `muon`.

    Example:
      >>> tx = opttx.adamuon(0.02, weight_decay=0.1, sign=True)

    References:
      Si, Zhang and Shen, AdaMuon: Adaptive Muon Optimizer (arXiv 2507.11005).
    """
    links = [ema(b1, debias=False)]
    if sign:
        links.append(scale_by_sign())
    links += [orthogonalize(ns_steps, ns_coeffs, ns_eps, "newton_schulz", matrix_axes,
                            ns_dtype=ns_dtype, sharded_mode=sharded_mode),
              scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True),
              scale_to_orthogonal_norm(eps, matrix_axes),
              scale_by_shape(consistent_rms, matrix_axes),
              add_decayed_weights(weight_decay),
              scale_by_learning_rate(learning_rate)]
    adam = adamw(adam_learning_rate, adam_b1, adam_b2, eps, weight_decay=adam_weight_decay)
    return _matrices_and_adamw("adamuon", chain(*links), muon_mask, adam)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "mu": HyperRole.MOMENTUM,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "eps": HyperRole.EPS,
                      "adam_b1": HyperRole.B1, "adam_b2": HyperRole.B2,
                      "adam_weight_decay": HyperRole.WEIGHT_DECAY,
                      "adam_learning_rate": HyperRole.LEARNING_RATE}, runtime=("power_iters",
                                                                               "seed"))
def dion(learning_rate: ScalarOrSchedule = 0.01, rank_fraction: float = 1.0, mu: float = 0.95,
         weight_decay: float = 0.01, eps: float = 1e-8, *, power_iters: int = 1,
         rank_multiple_of: int = 1, seed: int = 0, muon_mask: Mask = None,
         adam_b1: float = 0.9, adam_b2: float = 0.95, adam_weight_decay: float | None = None,
         adam_learning_rate: ScalarOrSchedule | None = None) -> GradientTransformation:
    r"""Dion: low-rank orthonormal updates by power iteration with error feedback
    (`scale_by_dion`) on hidden matrices, AdamW elsewhere.

    .. math::
        x_{t+1} = x_t - \eta \left(\sqrt{m/n}\; P_t Q_t^\top + \lambda x_t\right)

    on the 2-D leaves ``muon_mask`` selects (default `muon_hidden_matrices`): ``chain(
    scale_by_dion(rank_fraction, mu, eps), scale_by_shape(convention="spectral"),
    add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))``; other leaves
    run ``adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, eps,
    weight_decay=adam_weight_decay or weight_decay)``. Defaults of the ``dion`` package's
    ``Dion``/``DionReference``; its numbers up to its randomized QR and float32 column
    normalization (see `scale_by_dion`).

    Under `opttx.distributed.sharded` (tensor parallel, FSDP) only the :math:`r`-column
    factors are reduced, through the reduction hook: no gather of whole matrices.

    Example:
      >>> tx = opttx.dion(0.01, rank_fraction=0.25)

    References:
      Ahn et al., Dion: Distributed Orthonormalized Updates (arXiv 2504.05295).
    """
    group = chain(scale_by_dion(rank_fraction, mu, eps, power_iters=power_iters,
                                rank_multiple_of=rank_multiple_of, seed=seed),
                  scale_by_shape(convention="spectral"),
                  add_decayed_weights(weight_decay),
                  scale_by_learning_rate(learning_rate))
    adam = _adam_group(learning_rate, adam_learning_rate, adam_b1, adam_b2, eps, weight_decay,
                       adam_weight_decay)
    return _matrices_and_adamw("dion", group, muon_mask, adam)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "ef_decay": HyperRole.MOMENTUM,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "eps": HyperRole.EPS,
                      "adam_b1": HyperRole.B1, "adam_b2": HyperRole.B2,
                      "adam_weight_decay": HyperRole.WEIGHT_DECAY,
                      "adam_learning_rate": HyperRole.LEARNING_RATE})
def dion2(learning_rate: ScalarOrSchedule = 0.01, fraction: float = 0.25,
          ef_decay: float = 0.95, weight_decay: float = 0.01, eps: float = 1e-8, *,
          method: Method = "polar_express", ns_dtype: torch.dtype | None = None,
          adjust_lr: AdjustLr = "spectral_norm", muon_mask: Mask = None,
          adam_b1: float = 0.9, adam_b2: float = 0.95, adam_weight_decay: float | None = None,
          adam_learning_rate: ScalarOrSchedule | None = None,
          sharded_mode: ShardedMode = "owners") -> GradientTransformation:
    r"""Dion2: Muon on the top ``fraction`` of each matrix's rows or columns, with error
    feedback (`scale_by_dion2`), AdamW elsewhere.

    ``chain(scale_by_dion2(fraction, ef_decay, eps, method=method), shape scaling,
    add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))`` on the
    leaves ``muon_mask`` selects (``adjust_lr`` as in `normuon`); other leaves run
    ``adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, eps,
    weight_decay=adam_weight_decay or weight_decay)``. Defaults and numbers of the ``dion``
    package's ``Dion2`` (its Polar Express in bfloat16: ``ns_dtype=torch.bfloat16``).
    ``sharded_mode``: see `scale_by_dion2` (matrices sharded over the side not selected run
    on their shards).

    Example:
      >>> tx = opttx.dion2(0.01, fraction=0.25)

    References:
      Ahn et al., Dion2 (2026); Microsoft's ``dion`` package.
    """
    group = chain(scale_by_dion2(fraction, ef_decay, eps, method=method, ns_dtype=ns_dtype,
                                 sharded_mode=sharded_mode),
                  _shape_scaling(adjust_lr, (-2, -1)),
                  add_decayed_weights(weight_decay),
                  scale_by_learning_rate(learning_rate))
    adam = _adam_group(learning_rate, adam_learning_rate, adam_b1, adam_b2, eps, weight_decay,
                       adam_weight_decay)
    return _matrices_and_adamw("dion2", group, muon_mask, adam)


# ---------------------------------------------------------------------------------------------
# MuonClip
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "threshold": None, "alpha": None,
                      "weight_decay": HyperRole.WEIGHT_DECAY, "consistent_rms": None})
def muon_clip(learning_rate: ScalarOrSchedule, qk_roles: Any, threshold: float = 100.0,
              alpha: float = 0.5, weight_decay: float = 0.1, consistent_rms: float = 0.2,
              **muon_kwargs: Any) -> GradientTransformation:
    r"""MuonClip (Kimi K2): `muon` with Moonlight's update RMS (``consistent_rms=0.2``) and
    weight decay, then `clip_qk` on the query and key weights that ``qk_roles`` declares.

    ``chain(muon(learning_rate, weight_decay=weight_decay, consistent_rms=consistent_rms,
    **muon_kwargs), clip_qk(qk_roles, threshold, alpha))``; each step takes the recorded
    per-head maximum logits: ``tx.update(grads, state, params,
    max_attention_logits=recorder.pop())`` (see `opttx.MaxAttentionLogits`).

    Example:
      >>> roles = lambda p: {k: opttx.QKWeight(k.rsplit(".", 2)[0], "qkv", 4)
      ...                    if k.endswith("qkv.weight") else None for k in p}
      >>> tx = opttx.muon_clip(0.02, roles, threshold=100.0)

    References:
      Kimi Team, Kimi K2: Open Agentic Intelligence (arXiv 2507.20534).
    """
    return chain(muon(learning_rate, weight_decay=weight_decay, consistent_rms=consistent_rms,
                      **muon_kwargs),
                 clip_qk(qk_roles, threshold, alpha))


# ---------------------------------------------------------------------------------------------
# PSGD-Kron
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "weight_decay": HyperRole.WEIGHT_DECAY,
                      "preconditioner_update_probability": None, "precond_lr": None,
                      "precond_init_scale": None}, runtime=("balance_every", "seed"))
def kron(learning_rate: ScalarOrSchedule = 3e-4, b1: float = 0.9, weight_decay: float = 0.0,
         preconditioner_update_probability: Any = None, max_size_triangular: int = 8192,
         min_ndim_triangular: int = 2, memory_save_mode: MemorySaveMode = None,
         momentum_into_precond_update: bool = True, precond_lr: float = 0.1,
         precond_init_scale: float = 1.0, merge_dims: bool = True, *,
         balance_every: int | None = 100, seed: int = 0, mu_dtype: torch.dtype | None = None,
         precond_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""PSGD-Kron (`scale_by_kron`), with weight decay on matrices and the learning rate.

    ``chain(scale_by_kron(...), add_decayed_weights(weight_decay, mask=ndim >= 2),
    scale_by_learning_rate(learning_rate))``: ``kron_torch.Kron``'s arguments, defaults and
    numbers (up to its random probes and balancing, see `scale_by_kron`).

    Example:
      >>> tx = opttx.kron(3e-4, weight_decay=0.01)

    References:
      Li, Preconditioned Stochastic Gradient Descent (arXiv 1512.04202); ``kron_torch``.
    """
    return chain(scale_by_kron(b1, preconditioner_update_probability, max_size_triangular,
                               min_ndim_triangular, memory_save_mode,
                               momentum_into_precond_update, precond_lr, precond_init_scale,
                               merge_dims, balance_every, seed, mu_dtype, precond_dtype),
                 add_decayed_weights(weight_decay,
                                     lambda p: tree_map(lambda x: x.ndim >= 2, p)),
                 scale_by_learning_rate(learning_rate))


# ---------------------------------------------------------------------------------------------
# Hyperball: weight and update norms held fixed in place of weight decay
# ---------------------------------------------------------------------------------------------


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "eps": HyperRole.EPS})
def hyperball(tx: GradientTransformation, learning_rate: ScalarOrSchedule,
              radius: float | None = None, eps: float = 1e-12) -> GradientTransformation:
    r"""Any direction ``tx`` on the hyperball: ``chain(tx, hyperball_step(learning_rate,
    radius, eps))``.

    .. math::
        W_{t+1} = R\, \mathrm{Normalize}\big(W_t - \eta_t R\, \mathrm{Normalize}(u_t)\big)

    per leaf, :math:`u_t` the updates of ``tx`` (a direction without learning rate or weight
    decay: `scale_by_adam`, Muon's orthogonalized momentum), :math:`R` the leaf's Frobenius
    norm at the first step (or ``radius``), :math:`\mathrm{Normalize}(x) = x / \lVert x
    \rVert_F` (see `hyperball_step`). Every leaf given is projected: route vectors and
    embeddings to another optimizer with `partition`, as `hyperball_muon` and the other
    pairings do.

    Example:
      >>> tx = opttx.hyperball(opttx.scale_by_lion(), 0.01)

    References:
      Wen, Dang, Lyu, Ma and Liang, Fantastic Pretraining Optimizers and Where to Find Them
      II: Hyperball Optimization (arXiv 2606.16899).
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"hyperball: tx must be a GradientTransformation, got "
                        f"{type(tx).__name__}.")
    return chain(tx, hyperball_step(learning_rate, radius, eps))


def _hyperball_pairing(name: str, direction: GradientTransformation,
                       learning_rate: ScalarOrSchedule, radius: float | None, mask: Mask,
                       adam_learning_rate: Any, adam_b1: float, adam_b2: float, eps: float,
                       adam_weight_decay: float, nesterov: bool = False
                       ) -> GradientTransformation:
    """``direction`` on the hyperball for the leaves ``mask`` selects (default
    `muon_hidden_matrices`: the projection matrices), AdamW for the others."""
    adam = adamw(learning_rate if adam_learning_rate is None else adam_learning_rate,
                 adam_b1, adam_b2, eps, weight_decay=adam_weight_decay, nesterov=nesterov)
    return _matrices_and_adamw(name, hyperball(direction, learning_rate, radius), mask, adam)


_PAIRING_HYPERPARAMS = {"learning_rate": HyperRole.LEARNING_RATE,
                        "adam_learning_rate": HyperRole.LEARNING_RATE,
                        "adam_b1": HyperRole.B1, "adam_b2": HyperRole.B2,
                        "adam_weight_decay": HyperRole.WEIGHT_DECAY}


@declare(hyperparams={**_PAIRING_HYPERPARAMS, "beta": HyperRole.MOMENTUM, "eps": HyperRole.EPS},
         runtime=("ns_steps", "ns_coeffs"))
def hyperball_muon(learning_rate: ScalarOrSchedule, ns_coeffs: Any = NS_COEFFS,
                   ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8,
                   radius: float | None = None, mu_dtype: torch.dtype | None = None, *,
                   nesterov: bool = True, bias_correction: bool = True,
                   ns_dtype: torch.dtype | None = None, method: Method = "newton_schulz",
                   matrix_axes: MatrixAxes = (-2, -1), split: Any = None,
                   muon_mask: Mask = None, adam_learning_rate: ScalarOrSchedule | None = None,
                   adam_b1: float = 0.9, adam_b2: float = 0.999,
                   adam_weight_decay: float = 0.0) -> GradientTransformation:
    r"""MuonH: Muon's orthogonalized momentum on the hyperball, AdamW elsewhere.

    On the leaves ``muon_mask`` selects (default `muon_hidden_matrices`)
    ``hyperball(chain(ema(beta, bias_correction, mu_dtype, nesterov=nesterov),
    orthogonalize(ns_steps, ns_coeffs, eps, method, matrix_axes)), learning_rate, radius)``:

    .. math::
        O_t = \mathrm{NS}_K(\tilde m_t), \qquad
        W_{t+1} = R\, \mathrm{Normalize}\big(W_t - \eta_t R\, O_t / \lVert O_t \rVert_F\big)

    (no shape scaling and no weight decay: the norms are fixed); the other leaves run
    ``adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, eps,
    weight_decay=adam_weight_decay, nesterov=nesterov)`` (as `muon`'s), as the paper keeps
    Adam for embeddings, the output head and vectors. ``learning_rate`` is the angular step (:math:`\lVert W_{t+1} - W_t
    \rVert_F \approx \eta_t R`), not Muon's.

    Example:
      >>> tx = opttx.hyperball_muon(0.02, adam_learning_rate=3e-3)

    References:
      Wen et al., Hyperball Optimization (arXiv 2606.16899); Jordan et al., Muon (2024).
    """
    direction = chain(ema(beta, debias=bias_correction, accumulator_dtype=mu_dtype,
                          nesterov=nesterov),
                      orthogonalize(ns_steps, ns_coeffs, eps, method, matrix_axes,
                                    ns_dtype=ns_dtype, split=split))
    return _hyperball_pairing("hyperball_muon", direction, learning_rate, radius, muon_mask,
                              adam_learning_rate, adam_b1, adam_b2, eps, adam_weight_decay,
                              nesterov)


@declare(hyperparams={**_PAIRING_HYPERPARAMS, "b1": HyperRole.B1, "b2": HyperRole.B2,
                      "eps": HyperRole.EPS})
def hyperball_adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
                    eps: float = 1e-8, radius: float | None = None,
                    mu_dtype: torch.dtype | None = None, *, mask: Mask = None,
                    adam_learning_rate: ScalarOrSchedule | None = None,
                    adam_b1: float | None = None, adam_b2: float | None = None,
                    adam_weight_decay: float = 0.0) -> GradientTransformation:
    r"""AdamH: Adam's direction on the hyperball for the matrices, AdamW elsewhere.

    ``hyperball(scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype), learning_rate, radius)`` on
    the leaves ``mask`` selects (default `muon_hidden_matrices`), ``adamw(adam_learning_rate
    or learning_rate, adam_b1 or b1, adam_b2 or b2, eps, weight_decay=adam_weight_decay)``
    on the others.

    .. math::
        W_{t+1} = R\, \mathrm{Normalize}\Big(W_t - \eta_t R\, \mathrm{Normalize}\big(
        \hat m_t / (\sqrt{\hat v_t} + \epsilon)\big)\Big)

    heavyball's ``HyperBallAdamW`` keeps no first moment (its direction is
    :math:`g_t / \max(\sqrt{\hat v_t}, \epsilon)`, RMSprop's) and routes every leaf of two or
    more dims to the hyperball: ``hyperball(scale_by_rms(b2, eps, eps_in_sqrt=False,
    bias_correction=True), lr)`` beside ``rmsprop``'s step, tested in tests/test_hyperball.py.

    Example:
      >>> tx = opttx.hyperball_adamw(0.01, adam_learning_rate=3e-3)

    References:
      Wen et al., Hyperball Optimization (arXiv 2606.16899).
    """
    direction = scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype)
    return _hyperball_pairing("hyperball_adamw", direction, learning_rate, radius, mask,
                              adam_learning_rate, b1 if adam_b1 is None else adam_b1,
                              b2 if adam_b2 is None else adam_b2, eps, adam_weight_decay)


@declare(hyperparams={**_PAIRING_HYPERPARAMS, "momentum": HyperRole.MOMENTUM,
                      "b2": HyperRole.B2, "eps": HyperRole.EPS})
def hyperball_normuon(learning_rate: ScalarOrSchedule, momentum: float = 0.95,
                      b2: float = 0.95, eps: float = 1e-8, radius: float | None = None, *,
                      nesterov: bool = False, method: Method = "polar_express",
                      ns_dtype: torch.dtype | None = None, split: Any = None,
                      matrix_axes: MatrixAxes = (-2, -1), muon_mask: Mask = None,
                      adam_learning_rate: ScalarOrSchedule | None = None,
                      adam_b1: float = 0.9, adam_b2: float = 0.95,
                      adam_weight_decay: float = 0.0) -> GradientTransformation:
    r"""NorMuonH: NorMuon's direction on the hyperball, AdamW elsewhere.

    ``hyperball(chain(trace(momentum, nesterov), orthogonalize(method=method, eps=eps),
    scale_by_neuron_rms(b2, eps)), learning_rate, radius)`` on the leaves ``muon_mask``
    selects (default `muon_hidden_matrices`); `normuon`'s shape scaling and weight decay are
    left out (the norms are fixed). Other leaves: ``adamw(adam_learning_rate or
    learning_rate, adam_b1, adam_b2, eps, weight_decay=adam_weight_decay)``.

    Example:
      >>> tx = opttx.hyperball_normuon(0.02, adam_learning_rate=3e-3)

    References:
      Wen et al., Hyperball Optimization (arXiv 2606.16899); Li et al., NorMuon
      (arXiv 2510.05491).
    """
    direction = chain(trace(momentum, nesterov=nesterov),
                      orthogonalize(5, NS_COEFFS, eps, method, matrix_axes, ns_dtype=ns_dtype,
                                    split=split),
                      scale_by_neuron_rms(b2, eps, matrix_axes, split=split))
    return _hyperball_pairing("hyperball_normuon", direction, learning_rate, radius,
                              muon_mask, adam_learning_rate, adam_b1, adam_b2, eps,
                              adam_weight_decay)


@declare(hyperparams={**_PAIRING_HYPERPARAMS, "b1": HyperRole.B1, "b2": HyperRole.B2,
                      "shampoo_beta": None, "eps": HyperRole.EPS},
         runtime=("precondition_frequency",))
def hyperball_soap(learning_rate: ScalarOrSchedule, b1: float = 0.95, b2: float = 0.95,
                   shampoo_beta: float | None = None, eps: float = 1e-8,
                   radius: float | None = None, precondition_frequency: int = 10,
                   max_precond_dim: int = 10000, *, mask: Mask = None,
                   adam_learning_rate: ScalarOrSchedule | None = None,
                   adam_b1: float | None = None, adam_b2: float | None = None,
                   adam_weight_decay: float = 0.0) -> GradientTransformation:
    r"""SOAP-H: SOAP's direction on the hyperball for the matrices, AdamW elsewhere.

    ``hyperball(precondition_eigenvalue_corrected(b2, eps, precondition_frequency, beta1=b1,
    shampoo_beta=shampoo_beta, schedule="soap", eigendecomposition="power",
    max_basis_dim=max_precond_dim), learning_rate, radius)`` (`soap`'s direction, without its
    weight decay and learning rate) on the leaves ``mask`` selects (default
    `muon_hidden_matrices`); ``adamw(adam_learning_rate or learning_rate, adam_b1 or b1,
    adam_b2 or b2, eps, weight_decay=adam_weight_decay)`` on the others. SOAP's first update
    is zero (it only sets up the bases): the hyperball leaves those weights where they are.

    Example:
      >>> tx = opttx.hyperball_soap(0.01, adam_learning_rate=3e-3)

    References:
      Wen et al., Hyperball Optimization (arXiv 2606.16899); Vyas et al., SOAP
      (arXiv 2409.11321).
    """
    direction = precondition_eigenvalue_corrected(
        b2, eps, precondition_frequency, beta1=b1, shampoo_beta=shampoo_beta,
        eigendecomposition="power", schedule="soap", max_basis_dim=max_precond_dim)
    return _hyperball_pairing("hyperball_soap", direction, learning_rate, radius, mask,
                              adam_learning_rate, b1 if adam_b1 is None else adam_b1,
                              b2 if adam_b2 is None else adam_b2, eps, adam_weight_decay)
