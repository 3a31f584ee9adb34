r"""Schedule-Free learning: `schedule_free` turns any transform into its schedule-free form.

Schedule-Free (Defazio et al., 2024) replaces momentum and the learning-rate decay by an
interpolation and an average of three sequences: the base iterate :math:`z`, its weighted
average :math:`x` (where the model is evaluated) and the point :math:`y` between them where
gradients are taken (the parameters during training). Two of them determine the third,
:math:`y = (1-\beta_1) z + \beta_1 x`, so only :math:`z` is state: the parameters are
:math:`y`, and :math:`x` is recomputed from them when needed (`schedule_free_eval_params`;
`opttx.Optimizer.eval` swaps it into the model), as in ``schedulefree`` and
``optax.contrib.schedule_free``. The memory is that of the wrapped transform plus one
parameter-sized buffer (AdamW's momentum is replaced by :math:`z`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._checks import (check_gradient_leaves, check_learning_rate, check_nonnegative,
                       check_number)
from ..base import (GradientTransformation, HyperRole, Params, Role, State, Updates,
                    check_init_params, combine_traits, declare, declare_roles, replace_state,
                    require_params, safe_increment, zero_count)
from ..kernels import (Scalar, cast_like, foreach, foreach_, is_donating, is_fixed_zero,
                       mark_scratch)
from ..schedules import Schedule
from ..tree import (MaskedNode, PyTree, Static, find_instances, flatten_matching, tree_flatten,
                    tree_map, tree_paths, tree_unflatten)

__all__ = [
    "ScheduleFreeState",
    "find_schedule_free_states",
    "schedule_free",
    "schedule_free_eval_params",
    "schedule_free_params_",
    "schedule_free_train_params",
]


class ScheduleFreeState(NamedTuple):
    """State of `schedule_free`."""
    count: torch.Tensor        # shape (), int32: steps taken
    b1: torch.Tensor           # shape (), float64: beta_1 of the last step, y = (1-b1) z + b1 x
    weight_sum: torch.Tensor   # shape (), float64: sum of the averaging weights so far
    max_lr: torch.Tensor       # shape (), float64: largest (warmed-up) learning rate so far
    z: Updates                 # like params (fp32 for 16-bit leaves): the base iterate z
    inner_state: State         # the wrapped transform's state
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, b1=Role.SCALAR, weight_sum=Role.SCALAR,
                              max_lr=Role.SCALAR, z=Role.PARAMS_LIKE)


def _f64(value: Scalar, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a float64 0-dim tensor on ``like``'s device."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64)
    return torch.tensor(value, dtype=torch.float64, device=like.device)


@declare(hyperparams={"learning_rate": HyperRole.LEARNING_RATE, "b1": HyperRole.B1,
                      "weight_lr_power": None, "r": None, "averaging_weight": None,
                      "z_weight_decay": HyperRole.WEIGHT_DECAY}, runtime=("warmup_steps",))
def schedule_free(inner: GradientTransformation, learning_rate: float | Schedule,
                  b1: float = 0.9, weight_lr_power: float = 2.0, warmup_steps: int = 0,
                  r: float = 0.0, state_dtype: torch.dtype | None = None, *,
                  averaging_weight: float | None = None,
                  z_weight_decay: float = 0.0) -> GradientTransformation:
    r"""Make ``inner`` schedule-free: its updates move :math:`z`; the parameters are :math:`y`.

    With :math:`u_t` the update of ``inner`` at :math:`y_t` (for SGD :math:`-\gamma g_t`),
    :math:`s_t` the warmup factor and :math:`c_{t+1}` the averaging weight,

    .. math::
        z_{t+1} = z_t + s_t u_t, \qquad x_{t+1} = (1 - c_{t+1}) x_t + c_{t+1} z_{t+1},
        \qquad y_{t+1} = (1-\beta_1) z_{t+1} + \beta_1 x_{t+1},

    .. math::
        s_t = \min(1, t / T_{warmup}), \quad \gamma_t = s_t\,\eta(t), \quad
        w_t = t^r (\max_{k \le t} \gamma_k)^{p}, \quad c_{t+1} = w_t / \textstyle\sum_{k\le t} w_k

    with :math:`t` the 1-based step and :math:`p` = ``weight_lr_power``. :math:`x` is not
    stored: the returned update is
    :math:`y_{t+1} - y_t = c_{t+1}(z_t - y_t) + (1 - \beta_1 (1 - c_{t+1}))\, s_t u_t`,
    computed from the parameters :math:`y_t` (so it stays right if something else moves
    them). Evaluate the model at :math:`x` (`schedule_free_eval_params`, or
    `opttx.Optimizer.eval`).

    ``inner`` must have no momentum of its own (Schedule-Free replaces it): SGD, or Adam
    with ``b1=0`` (`scale_by_rms` with ``bias_correction=True, eps_in_sqrt=False``). The
    warmup (``warmup_steps`` > 0) multiplies the updates of ``inner`` by :math:`s_t`, as
    ``schedulefree``'s optimizers do, so ``inner`` takes the peak learning rate; with a
    warm-up schedule inside ``inner`` instead (optax's recipe), pass the same schedule as
    ``learning_rate`` and leave ``warmup_steps`` at 0.

    Args:
      inner: the transform whose updates move :math:`z` (the learning rate included).
      learning_rate: :math:`\eta`, the peak learning rate of ``inner`` (a number or a
        schedule, evaluated at the 1-based step as optax does); it enters only the
        averaging weights.
      b1: :math:`\beta_1` in (0, 1]: the interpolation between :math:`z` and :math:`x`
        (``schedulefree``'s ``betas[0]``/``momentum``).
      weight_lr_power: :math:`p`: the averaging weights are the largest learning rate so far
        to this power (0: uniform average).
      warmup_steps: linear warmup of the updates over this many steps (0: none).
      r: :math:`r`: polynomial weighting :math:`t^r` of the average (``schedulefree``'s
        ``r``; optax has none, i.e. 0).
      state_dtype: dtype of :math:`z` (default: the parameters', float32 for 16-bit ones).
      averaging_weight: a constant :math:`c_{t+1} = c` in (0, 1] instead of the weighted
        average above (``weight_lr_power`` and ``r`` then play no part): generalized primal
        averaging (Defazio et al., arXiv 2512.17131), Meta's
        ``GeneralizedPrimalAveragingConfig(eval_interp_coeff=1 - c, train_interp_coeff=b1)``;
        with ``b1=1`` it is heavy-ball momentum on ``inner``'s updates with the learning rate
        scaled by ``1 - c`` (``tests/test_shampoo_meta.py``).
      z_weight_decay: :math:`\lambda`: decoupled weight decay of :math:`z` before each step,
        :math:`z_t \leftarrow (1 - \gamma_t \lambda) z_t` (the factor in float32), where
        Meta's Distributed Shampoo decays under iterate averaging (its
        ``WeightDecayType.DECOUPLED`` with ``weight_decay=``:math:`\lambda`; for ``CORRECTED``
        and ``INDEPENDENT`` pass the :math:`\lambda` Meta derives). ``schedulefree``'s
        optimizers decay at :math:`y` instead: put ``add_decayed_weights`` in ``inner``.

    Returns:
      A `GradientTransformation` that needs ``params`` in ``update``; its state is a
      `ScheduleFreeState`.

    Example:
      >>> inner = opttx.chain(opttx.scale_by_rms(0.999, eps_in_sqrt=False,
      ...                                        bias_correction=True),
      ...                     opttx.scale_by_learning_rate(1e-3))
      >>> tx = opttx.schedule_free(inner, 1e-3, b1=0.9, warmup_steps=100)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = opttx.apply_updates(params, updates)
      >>> eval_params = opttx.schedule_free_eval_params(state, params)

    References:
      Defazio, Yang, Mehta, Mishchenko, Khaled and Cutkosky, The Road Less Scheduled
      (arXiv 2405.15682).
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"schedule_free: inner must be a GradientTransformation, got "
                        f"{type(inner).__name__}.")
    check_learning_rate(learning_rate)
    check_number("b1", b1)
    if isinstance(b1, (int, float)) and not 0 < b1 <= 1:
        raise ValueError(f"b1 must be in (0, 1] (the evaluation point x = (y - (1-b1) z) / b1 "
                         f"divides by it), got {b1}.")
    check_nonnegative("weight_lr_power", weight_lr_power)
    check_nonnegative("r", r)
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}.")
    if averaging_weight is not None and not (isinstance(averaging_weight, (int, float))
                                             and 0 < averaging_weight <= 1):
        raise ValueError(f"averaging_weight must be a number in (0, 1] (x <- (1 - c) x + c z), "
                         f"got {averaging_weight!r}.")
    check_nonnegative("z_weight_decay", z_weight_decay)
    decay_z = not is_fixed_zero(z_weight_decay)

    def init(params: Params) -> ScheduleFreeState:
        check_init_params(params)
        count = zero_count(params)
        zeros = torch.zeros((), dtype=torch.float64, device=count.device)
        z = tree_map(lambda p: p.detach().to(dtype=_z_dtype(p, state_dtype), copy=True), params)
        return ScheduleFreeState(count=count, b1=_f64(b1, count), weight_sum=zeros,
                                 max_lr=zeros.clone(), z=z, inner_state=inner.init(params))

    def update(updates: Updates, state: ScheduleFreeState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, ScheduleFreeState]:
        params = require_params(params, "schedule_free")
        if not isinstance(state, ScheduleFreeState):
            raise TypeError(f"schedule_free.update got a state of type {type(state).__name__}, "
                            "expected ScheduleFreeState: pass the state made by its init.")
        # a state made by init on other params: refused naming the leaf, before torch's
        # broadcasting error in the z update (or a silent broadcast of a 1-row z)
        _, g, z = flatten_matching(updates, state.z, what="updates and z")
        check_gradient_leaves(g, z, updates, "ScheduleFreeState.z")
        count = safe_increment(state.count)
        t = count.to(torch.float64)
        # the averaging weight of this step, from scalars only (also on a rank with no leaf)
        lr = _f64(learning_rate(count) if callable(learning_rate) else learning_rate, count)
        warm = torch.clamp(t / warmup_steps, max=1.0) if warmup_steps else None
        if warm is not None:
            lr = lr * warm
        max_lr = torch.maximum(state.max_lr, lr)
        weight = max_lr ** _f64(weight_lr_power, count)
        if not (isinstance(r, (int, float)) and r == 0):
            weight = weight * t ** _f64(r, count)
        weight_sum = state.weight_sum + weight
        ck = torch.where(weight_sum == 0, torch.zeros_like(weight), weight / weight_sum) \
            if averaging_weight is None else _f64(averaging_weight, count)
        beta = _f64(b1, count)

        inner_updates, inner_state = inner.update(updates, state.inner_state, params,
                                                  **extra_args)
        spec, u, z, y = flatten_matching(inner_updates, state.z, params,
                                         what="updates, z and params")
        new_z, out = z, []
        if u:
            if decay_z:   # z <- (1 - lr wd) z, the factor in float32 (Meta keeps lr so)
                factor = 1 - lr.to(torch.float32) * z_weight_decay
                z = foreach_("mul", z, factor) if is_donating() else foreach("mul", z, factor)
            u = cast_like(u, z)
            if warm is not None:
                u = foreach("mul", u, warm)
            # y_{t+1} - y_t = ck (z_t - y_t) + (1 - b1 (1 - ck)) u_t   (z_t: before the step)
            out = foreach("sub", z, cast_like(y, z))
            out = foreach_("mul", out, ck)
            out = foreach_("add", out, foreach("mul", u, 1 - beta * (1 - ck)))
            # in z's dtype (a 0-dim leaf's u is float64 after the float64 warm-up factor)
            new_z = foreach_("add", z, u) if is_donating() else \
                cast_like(foreach("add", z, u), z)
            out = mark_scratch(cast_like(out, tree_flatten(updates)[0]))
        new_state = replace_state(state, count=count, b1=beta, weight_sum=weight_sum,
                                  max_lr=max_lr, z=tree_unflatten(list(new_z), spec),
                                  inner_state=inner_state)
        return tree_unflatten(out, spec), new_state

    return GradientTransformation(init, update, combine_traits((inner,)))


def _z_dtype(p: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


# ---------------------------------------------------------------------------------------------
# the evaluation point x
# ---------------------------------------------------------------------------------------------


def find_schedule_free_states(state: PyTree) -> list[ScheduleFreeState]:
    """Every `ScheduleFreeState` in ``state`` (outermost first), at any depth (inside
    `opttx.inject_hyperparams`, a chain, ...)."""
    return find_instances(state, ScheduleFreeState)


def the_schedule_free_state(state: PyTree, name: str) -> ScheduleFreeState:
    """The one `ScheduleFreeState` inside ``state`` (at any depth); a ValueError naming the
    caller ``name`` when there is none or more than one (the evaluation-parameter functions,
    here and in `opttx.distributed`, read it so)."""
    found = find_schedule_free_states(state)
    if len(found) != 1:
        raise ValueError(f"{name} needs the state of a transform built with "
                         f"opttx.schedule_free (or schedule_free_adamw/_sgd); found "
                         f"{len(found)} ScheduleFreeState(s) in the given state.")
    return found[0]


def _moved(state: PyTree, params: Params, weight_of: Any, name: str) -> Params:
    sf = the_schedule_free_state(state, name)
    if find_instances(sf.z, MaskedNode) and not find_instances(params, MaskedNode):
        raise ValueError(f"{name}: this state holds z for some parameters only (a rank's part "
                         "under opttx.distributed.zero or on_owners): call "
                         f"opttx.distributed.{name} on every rank instead, which gathers the "
                         "evaluation parameters from their owners.")
    spec, y, z = flatten_matching(params, sf.z, what="params and the schedule-free z")
    if not y:
        return params
    check_params_like_z(y, z, params, name)
    w = weight_of(sf.b1)
    out = foreach("lerp", y, cast_like(z, y), w)
    return tree_unflatten(out, spec)


def check_params_like_z(y: list[Any], z: list[torch.Tensor], params: Params, name: str) -> None:
    """Every leaf of ``params`` is a floating-point tensor of its ``z``'s shape (the state was
    built on these parameters); else a clear error naming the leaf, before anything is
    computed (a broadcastable shape would silently give parameters of another shape)."""
    for path, yi, zi in zip(tree_paths(params), y, z):
        local_z = zi.to_local() if hasattr(zi, "to_local") else zi
        local_y = yi.to_local() if hasattr(yi, "to_local") else yi
        if not isinstance(yi, torch.Tensor) or not yi.is_floating_point():
            got = type(yi).__name__ if not isinstance(yi, torch.Tensor) else str(yi.dtype)
            raise TypeError(f"{name}: params{path} is {got}, expected a floating-point tensor "
                            f"of shape {tuple(local_z.shape)} (the schedule-free z's).")
        if local_y.shape != local_z.shape:
            raise ValueError(f"{name}: params{path} has shape {tuple(local_y.shape)}, but the "
                             f"schedule-free state's z has {tuple(local_z.shape)}: pass the "
                             "parameters the state was built on (under zero or on_owners, a "
                             "rank's state holds z only for the leaves it owns: see "
                             "opttx.distributed.schedule_free_eval_params).")


def schedule_free_eval_params(state: PyTree, params: Params) -> Params:
    r"""The evaluation parameters :math:`x = (y - (1-\beta_1) z) / \beta_1` from the training
    parameters :math:`y` (``params``) and the state of a `schedule_free` transform (given
    whole: an `opttx.inject_hyperparams` or chain state around it is searched).

    Computed as ``schedulefree``'s ``eval()`` does: :math:`x = y + (1 - 1/\beta_1)(z - y)`.
    New tensors; ``params`` is not modified (see `schedule_free_params_` for in place).

    Example:
      >>> tx = opttx.schedule_free_adamw(1e-3)
      >>> state = tx.init(params)
      >>> x = opttx.schedule_free_eval_params(state, params)   # equals params at step 0
    """
    return _moved(state, params, lambda b1: 1 - 1 / b1, "schedule_free_eval_params")


def schedule_free_train_params(state: PyTree, eval_params: Params) -> Params:
    r"""The inverse of `schedule_free_eval_params`: the training parameters
    :math:`y = (1-\beta_1) z + \beta_1 x` from the evaluation parameters :math:`x`
    (``schedulefree``'s ``train()``: :math:`y = x + (1-\beta_1)(z - x)`)."""
    return _moved(state, eval_params, lambda b1: 1 - b1, "schedule_free_train_params")


@torch.no_grad()
def schedule_free_params_(state: PyTree, params: list[torch.Tensor], to_eval: bool) -> None:
    """Swap ``params`` (the leaves of the tree the state was built on, in its order) in place
    between the training point :math:`y` and the evaluation point :math:`x`, for every
    `ScheduleFreeState` in ``state`` (what `opttx.Optimizer.train`/``eval`` do). The
    coefficient is computed in double precision from the state's :math:`\\beta_1`, as
    ``schedulefree`` computes it from its Python float."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    for sf in find_schedule_free_states(state):
        z = [x.to_local() if hasattr(x, "to_local") else x for x in tree_flatten(sf.z)[0]]
        if len(z) != len(local) or any(a.shape != b.shape for a, b in zip(z, local)):
            raise ValueError("Optimizer.train()/eval(): the schedule-free state does not hold "
                             "one z per parameter of its group (schedule_free nested inside "
                             "partition/masked or a distributed wrapper); swap the parameters "
                             "with opttx.schedule_free_eval_params on the tree it was built on.")
        b1 = float(sf.b1)
        weight = (1 - 1 / b1) if to_eval else (1 - b1)
        if weight == 0 or not local:
            continue
        foreach_("lerp", local, cast_like(z, local), weight)
