r"""An exponential moving average of the parameters kept in the optimizer state:
`ema_params` wraps any transform, `ema_eval_params` reads the average out.

The average :math:`\bar\theta` is what ``timm``'s ``ModelEmaV3`` and
``torch.optim.swa_utils.AveragedModel(..., multi_avg_fn=get_ema_multi_avg_fn(decay))`` keep
in a second copy of the model: evaluated, and often shipped as the final model, while
training moves the parameters :math:`\theta`. Here it is one more parameter-sized buffer
of the optimizer state, so it is updated in the optimizer's step (one compiled graph, in
place under `opttx.Optimizer`), exact under `opttx.distributed.sharded` and ``zero`` (it is
element-wise: each rank averages the shards or leaves it holds), and saved and resharded
with the rest of the state by `opttx.distributed.state_dict` and
``torch.distributed.checkpoint``. `opttx.swap_ema` puts it into the model for evaluation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._checks import check_nonnegative, check_number, check_positive, check_unit_interval
from ..base import (DEFERRED_SCALE, GradientTransformation, Params, Role, State, Updates,
                    check_init_params, check_state_type, combine_traits, declare,
                    declare_roles, replace_state, require_params, safe_increment, traits_of,
                    zero_count)
from ..kernels import Scalar, cast_like, foreach_ema
from ..schedules import Schedule
from ..tree import (MaskedNode, PyTree, Static, find_instances, flatten_matching, tree_cond,
                    tree_map, tree_paths, tree_unflatten)
from ..updates import add_leaves, scaled_updates

__all__ = [
    "EmaParamsState",
    "ema_decay",
    "ema_eval_params",
    "ema_params",
    "find_ema_params_states",
]


class EmaParamsState(NamedTuple):
    """State of `ema_params`."""
    count: torch.Tensor        # shape (), int32: steps taken (t after this step)
    ema: Updates               # like params (fp32 for 16-bit leaves; on the CPU with
    #                            offload=True): the average of the parameters
    inner_state: State         # the wrapped transform's state
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, ema=Role.PARAMS_LIKE)


def _f64(value: Scalar, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a float64 0-dim tensor on ``like``'s device (a Python float exactly)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64)
    return torch.tensor(value, dtype=torch.float64, device=like.device)


def ema_decay(count: torch.Tensor, decay: Scalar | Schedule = 0.9999, *,
              update_after_step: int = 0, warmup: bool = False, warmup_gamma: Scalar = 1.0,
              warmup_power: Scalar = 2 / 3, min_decay: Scalar = 0.0) -> torch.Tensor:
    r"""The decay :math:`d_t` `ema_params` uses at step ``count`` (:math:`t`, 1-based: the
    number of optimizer steps taken, this one included), as a float64 0-dim tensor.

    ``timm``'s ``ModelEmaV3.get_decay(step=t)``: with :math:`s = \max(0, t - a - 1)`
    (:math:`a` = ``update_after_step``),

    .. math::
        d_t = \begin{cases} 0 & s = 0 \\
        \max\bigl(\min(1 - (1 + s/\gamma)^{-p},\ d),\ d_{\min}\bigr) & \text{warmup} \\
        d & \text{otherwise} \end{cases}

    with :math:`d` = ``decay`` (a number, or a schedule of :math:`t`), :math:`\gamma` =
    ``warmup_gamma``, :math:`p` = ``warmup_power`` and :math:`d_{\min}` = ``min_decay``. So
    the first :math:`a + 1` steps copy the parameters into the average.
    """
    t = count.to(torch.float64)
    d = _f64(decay(count) if callable(decay) else decay, count)
    s = torch.clamp(t - float(update_after_step + 1), min=0.0)
    if warmup:
        warm = 1 - (1 + s / _f64(warmup_gamma, count)) ** (-_f64(warmup_power, count))
        d = torch.maximum(torch.minimum(warm, d), _f64(min_decay, count))
    return torch.where(s <= 0, torch.zeros_like(d), d)


@declare(hyperparams={"decay": None, "warmup_gamma": None, "warmup_power": None,
                      "min_decay": None}, runtime=("update_after_step", "every"))
def ema_params(inner: GradientTransformation, decay: float | Schedule = 0.9999, *,
               update_after_step: int = 0, warmup: bool = False, warmup_gamma: float = 1.0,
               warmup_power: float = 2 / 3, min_decay: float = 0.0, every: int = 1,
               offload: bool = False,
               state_dtype: torch.dtype | None = None) -> GradientTransformation:
    r"""Keep an exponential moving average of the parameters beside ``inner``.

    ``inner``'s updates :math:`u_t` are returned unchanged; the state also holds the
    average :math:`\bar\theta` of the parameters *after* each step,
    :math:`\theta_t = \theta_{t-1} + u_t` (computed here as `opttx.apply_updates` computes
    it: :math:`u_t` cast to the parameter's dtype, then added):

    .. math::
        \bar\theta_0 = \theta_0, \qquad
        \bar\theta_t = d_t\,\bar\theta_{t-1} + (1 - d_t)\,\theta_t
        \quad (\text{a } \mathrm{lerp} \text{ with weight } 1 - d_t),

    with :math:`d_t` = `ema_decay` at the 1-based step :math:`t`: ``timm``'s
    ``ModelEmaV3`` decay, warm-up included (:math:`d_t = 0` for
    :math:`t \le` ``update_after_step`` + 1, so the first step *copies* the parameters, as
    ``AveragedModel``'s first ``update_parameters`` does; then ``decay``, or with
    ``warmup=True`` :math:`\max(\min(1 - (1 + s/\gamma)^{-p}, d), d_{\min})`,
    :math:`s = t - a - 1`).

    So ``ema_params(tx, decay)`` equals
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` with
    ``update_parameters(model)`` called after every optimizer step, and
    ``ModelEmaV3(model, decay, ...)`` with ``update(model, step=t)`` after step :math:`t`
    (``tests/test_weight_ema.py`` checks both in float64). With ``every=k`` the average is
    updated at the steps :math:`t` that are multiples of :math:`k` only (``ModelEmaV3``'s
    ``update(model, step=t)`` called every k-th step: :math:`d_t` is that of step :math:`t`
    and is not adjusted, so pass :math:`d^k` to keep the same horizon in steps); under
    ``torch.compile`` the skip is a ``torch.cond`` (one graph), in eager code a branch on
    the step count.

    The average is element-wise, so it is exact on local shards (`opttx.distributed.sharded`)
    and on the leaves a rank owns (``zero``, ``on_owners``); its state field has the role
    `opttx.extend.Role.PARAMS_LIKE` and checkpoints as the parameters do. Evaluate with
    `opttx.swap_ema` (in place, around an `opttx.Optimizer` or a state and its model) or
    `ema_eval_params` (a new tree).

    The average is of the parameters the optimizer steps; a model's buffers (BatchNorm's
    running statistics), which ``ModelEmaV3`` also averages unless ``exclude_buffers=True``,
    are not part of it.

    ``ema_params`` must be the outermost transform whose updates are the ones written to the
    parameters (around the whole chain, learning rate included): it reads
    :math:`\theta_{t-1} + u_t` from its own updates. Its traits are ``inner``'s, final scale
    included: asked for the final scale (`opttx.update_deferring_scale`,
    ``opttx.Optimizer(fold_learning_rate=True)``) it asks ``inner`` for it, reports it, and
    averages :math:`\theta_{t-1} + s\,u_t` written as the caller writes it (one fused add),
    so the parameters it averages are exactly those written. Parameters written with
    stochastic rounding differ from that sum by the rounding; the average is of the
    round-to-nearest sum.

    Args:
      inner: the transform whose updates move the parameters.
      decay: :math:`d \in [0, 1]`, the decay after the warm-up (a number or a schedule of
        the 1-based step). timm's and ``AveragedModel``'s ``decay``.
      update_after_step: :math:`a`: the average copies the parameters for the first
        :math:`a + 1` steps (timm's ``update_after_step``).
      warmup: ramp the decay up as :math:`1 - (1 + s/\gamma)^{-p}` (timm's ``use_warmup``).
      warmup_gamma: :math:`\gamma` (timm's ``warmup_gamma``).
      warmup_power: :math:`p` (timm's ``warmup_power``; 2/3 for runs of a million steps,
        3/4 for shorter ones, 1 with :math:`\gamma = 1` for a plain running mean).
      min_decay: :math:`d_{\min}`, a floor of the warmed-up decay (timm's ``min_decay``).
      every: update the average every ``every`` steps only.
      offload: keep the average in host memory (pinned when the parameters are on a CUDA
        device), as ``ModelEmaV3(device="cpu")``: each update copies the new parameters to
        the host and averages there. The functional path returns a new (pageable) host
        tensor; `opttx.Optimizer` and `opttx.donating` write into the pinned buffers.
      state_dtype: dtype of the average (default: the parameters', float32 for 16-bit
        parameters; ``AveragedModel`` keeps the model's dtype).

    Returns:
      A `GradientTransformation` that needs ``params`` in ``update``; its state is an
      `EmaParamsState` (``state.ema``: the average, like the parameters).

    Example:
      >>> tx = opttx.ema_params(opttx.adamw(1e-3), decay=0.999, warmup=True)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = opttx.apply_updates(params, updates)
      >>> averaged = opttx.ema_eval_params(state, params)      # a new tree
      >>> opt = opttx.Optimizer(model.parameters(), tx)
      >>> x, y = data[0]
      >>> with opttx.swap_ema(opt), torch.no_grad():           # the model holds the average
      ...     out = model(x)

    References:
      Polyak and Juditsky, Acceleration of stochastic approximation by averaging (SIAM J.
      Control Optim. 30(4), 1992); ``timm.utils.ModelEmaV3``;
      ``torch.optim.swa_utils.get_ema_multi_avg_fn``.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"ema_params: inner must be a GradientTransformation, got "
                        f"{type(inner).__name__}.")
    if callable(decay):
        check_number("decay", decay)
    else:
        check_unit_interval("decay", decay, closed_right=True)
    check_unit_interval("min_decay", min_decay, closed_right=True)
    check_positive("warmup_gamma", warmup_gamma)
    check_nonnegative("warmup_power", warmup_power)
    if not isinstance(update_after_step, int) or isinstance(update_after_step, bool) or \
            update_after_step < 0:
        raise ValueError(f"update_after_step must be an integer >= 0, got "
                         f"{update_after_step!r}.")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be an integer >= 1, got {every!r}.")
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup must be a bool, got {type(warmup).__name__}.")
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__}.")
    folds = traits_of(inner).final_scale
    schedule = {"decay": decay, "update_after_step": update_after_step, "warmup": warmup,
                "warmup_gamma": warmup_gamma, "warmup_power": warmup_power,
                "min_decay": min_decay}

    def init(params: Params) -> EmaParamsState:
        check_init_params(params)
        return EmaParamsState(count=zero_count(params), ema=tree_map(_average_of, params),
                              inner_state=inner.init(params))

    def _average_of(p: torch.Tensor) -> torch.Tensor:
        dtype = state_dtype if state_dtype is not None else \
            torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        if not offload or p.device.type == "cpu":
            return p.detach().to(dtype=dtype, copy=True)
        if hasattr(p, "to_local"):
            raise ValueError("ema_params(offload=True) keeps plain host tensors: DTensor "
                             "parameters (FSDP2) are not supported; keep the average on the "
                             "device (offload=False).")
        host = torch.empty(p.shape, dtype=dtype, device="cpu",
                           pin_memory=p.device.type == "cuda")
        return host.copy_(p.detach())

    def update(updates: Updates, state: EmaParamsState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EmaParamsState]:
        params = require_params(params, "ema_params")
        check_state_type(state, EmaParamsState, "ema_params")
        count = safe_increment(state.count)
        sink = extra_args.get(DEFERRED_SCALE) if folds else None
        args = {k: v for k, v in extra_args.items() if k != DEFERRED_SCALE}
        scale = None
        if sink is None:
            out, inner_state = inner.update(updates, state.inner_state, params, **args)
        else:      # inner leaves its final scale s to the caller, who writes theta + s u
            asked: list[Any] = []
            out, inner_state = inner.update(updates, state.inner_state, params, **args,
                                            **{DEFERRED_SCALE: asked})
            if len(asked) != 1:
                raise RuntimeError(f"ema_params: the inner transform declares a final scale "
                                   f"but reported {len(asked)} scalars.")
            scale = asked[0]
            sink.append(scale)
        spec, u, ema, p = flatten_matching(out, state.ema, params,
                                           what="updates, the average and params")
        d = ema_decay(count, **schedule)

        def averaged(old: list[torch.Tensor]) -> list[torch.Tensor]:
            if not old:
                return []
            # theta_t = theta_{t-1} + s u_t, as apply_updates (scale=s) writes it
            su, alpha = scaled_updates(list(u), scale)
            new = add_leaves(list(p), [x.to(q.dtype) for x, q in zip(su, p)], inplace=False,
                             alpha=alpha)
            if offload:
                new = [x.to(device=e.device) for x, e in zip(new, old)]
            return foreach_ema(old, cast_like(new, old), d.to(old[0].device))

        if every == 1:
            ema = averaged(list(ema))
        else:      # both branches return the operands' structure (tree_cond's contract)
            ema, = tree_cond(count % every == 0, lambda old: (averaged(old),),
                             lambda old: (old,), (list(ema),))
        return out, replace_state(state, count=count, ema=tree_unflatten(list(ema), spec),
                                  inner_state=inner_state)

    # inner's traits, its final scale included (reported, and in the sum it averages)
    return GradientTransformation(init, update, combine_traits((inner,), final_scale=folds))


# ---------------------------------------------------------------------------------------------
# reading the average
# ---------------------------------------------------------------------------------------------


def find_ema_params_states(state: PyTree) -> list[EmaParamsState]:
    """Every `EmaParamsState` in ``state`` (outermost first), at any depth (inside
    `opttx.inject_hyperparams`, a chain, `opttx.Optimizer`'s group states, ...)."""
    return find_instances(state, EmaParamsState)


def the_ema_params_state(state: PyTree, name: str) -> EmaParamsState:
    """The one `EmaParamsState` inside ``state``; a ValueError naming the caller ``name``
    when there is none or more than one."""
    found = find_ema_params_states(state)
    if len(found) != 1:
        raise ValueError(f"{name} needs the state of a transform built with opttx.ema_params; "
                         f"found {len(found)} EmaParamsState(s) in the given state.")
    return found[0]


def ema_leaves_for(ema_state: EmaParamsState, params: Params, name: str
                   ) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """``(spec, param_leaves, average_leaves)`` of a state's average paired with ``params``
    by path; a clear error when the state holds the average of some leaves only (a rank's
    part under ``zero`` or ``on_owners``) or of other shapes."""
    if find_instances(ema_state.ema, MaskedNode) and not find_instances(params, MaskedNode):
        raise ValueError(f"{name}: this state holds the average of some parameters only (a "
                         "rank's part under opttx.distributed.zero or on_owners): call "
                         "opttx.distributed.ema_eval_params on every rank instead, which "
                         "gathers the average from the owners.")
    spec, p, ema = flatten_matching(params, ema_state.ema, what="params and the average")
    for path, x, e in zip(tree_paths(params), p, ema):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(e.shape):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: params{path} is {got}, but the average has shape "
                             f"{tuple(e.shape)}: pass the parameters the state was built on.")
    return spec, p, ema


def ema_eval_params(state: PyTree, params: Params) -> Params:
    r"""The average :math:`\bar\theta` of an `ema_params` state (given whole: an
    `opttx.inject_hyperparams` or chain state around it is searched), as new tensors in the
    dtype and on the device of ``params`` (the tree the state was built on).

    Example:
      >>> tx = opttx.ema_params(opttx.adamw(1e-3), decay=0.999)
      >>> state = tx.init(params)
      >>> averaged = opttx.ema_eval_params(state, params)   # equals params at step 0
    """
    name = "ema_eval_params"
    spec, p, ema = ema_leaves_for(the_ema_params_state(state, name), params, name)
    return tree_unflatten([e.to(device=x.device, dtype=x.dtype, copy=True)
                           for e, x in zip(ema, p)], spec)
