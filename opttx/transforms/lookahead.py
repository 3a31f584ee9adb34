r"""Lookahead: `lookahead` wraps any transform with a slow copy of the parameters that follows
the fast ones every ``sync_period`` steps (Zhang, Lucas, Hinton and Ba, arXiv 1907.08610).

The parameters the user trains (and computes gradients at) are the *fast* ones; the *slow*
ones live in the state (`LookaheadState.slow`, read with `lookahead_slow_params`), so the
wrapper drops into `opttx.Optimizer` and a plain torch loop like any other transform. optax's
``lookahead`` keeps both in the parameters instead (``LookaheadParams(fast, slow)``); the
numbers are the same (``tests/test_lookahead.py`` compares them in float64).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._checks import check_gradient_leaves, check_number
from ..base import (GradientTransformation, Params, Role, State, Updates, check_init_params,
                    check_state_type, combine_traits, declare, declare_roles, replace_state,
                    require_params, safe_increment, zero_count)
from ..kernels import cast_like, foreach, foreach_, is_donating, mark_scratch
from ..tree import PyTree, Static, find_instances, flatten_matching, tree_map, tree_unflatten

__all__ = ["LookaheadState", "lookahead", "lookahead_slow_params"]


class LookaheadState(NamedTuple):
    """State of `lookahead`."""
    count: torch.Tensor        # shape (), int32: fast steps taken; a sync follows every k-th
    slow: Updates              # like params (fp32 for 16-bit leaves): the slow parameters
    fast_state: State          # the wrapped (fast) transform's state
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(count=Role.COUNT, slow=Role.PARAMS_LIKE)


def _slow_dtype(p: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


@declare(hyperparams={"alpha": None})
def lookahead(tx: GradientTransformation, sync_period: int, alpha: float = 0.5,
              reset_state: bool = False, state_dtype: torch.dtype | None = None
              ) -> GradientTransformation:
    r"""Lookahead around ``tx``: ``sync_period`` fast steps, then the slow parameters move a
    fraction ``alpha`` of the way to the fast ones and the fast ones restart from there.

    With :math:`\theta` the fast parameters (the ones trained), :math:`\phi` the slow ones,
    :math:`u_t` the update of ``tx`` and :math:`k` = ``sync_period``: every step
    :math:`\theta \leftarrow \theta + u_t`, and after every :math:`k`-th one

    .. math::
        \phi \leftarrow \phi + \alpha (\theta - \phi), \qquad \theta \leftarrow \phi .

    Both happen in the step's one update (as optax writes it): with
    :math:`d = \theta_t + u_t - \phi` and :math:`s = 1` on a sync step, else 0,

    .. math::
        \phi \leftarrow \phi + s\,\alpha\, d, \qquad
        \text{returned update} = u_t - s\,(1-\alpha)\, d .

    :math:`s` is computed in the graph from the step count (no branch, no recompile), so a
    compiled step is one graph whichever step it is. Equal to ``optax.lookahead(tx, k,
    slow_step_size=alpha, reset_state)`` with the parameters the user trains being optax's
    ``params.fast`` (``tests/test_lookahead.py``, float64).

    **Where the slow parameters are.** optax puts them in the parameters
    (``LookaheadParams``); opttx keeps them in the state (`LookaheadState.slow`), so the
    trained parameters are a plain tree (a module's ``parameters()``, `opttx.Optimizer`'s
    groups, a DTensor, a `zero` shard) and ``update`` takes the usual
    ``(grads, state, params)``: the fast parameters. Evaluate at the slow ones with
    `lookahead_slow_params`. Memory: ``tx``'s plus one parameter-sized buffer.

    Args:
      tx: the fast transform (its learning rate included).
      sync_period: :math:`k` >= 1, fast steps between synchronizations (``1``: every step).
      alpha: :math:`\alpha`, the slow step size (optax's ``slow_step_size``; the paper's
        default 0.5). ``alpha=1`` leaves ``tx`` unchanged.
      reset_state: re-initialize ``tx``'s state (``tx.init`` of the fast parameters) after
        every synchronization, as optax's ``reset_state``.
      state_dtype: dtype of the slow parameters (default: the parameters', float32 for
        16-bit ones).

    Returns:
      A `GradientTransformation` that needs ``params`` in ``update``; its state is a
      `LookaheadState`.

    Example:
      >>> tx = opttx.lookahead(opttx.adam(1e-3), sync_period=5, alpha=0.5)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = opttx.apply_updates(params, updates)
      >>> slow = opttx.lookahead_slow_params(state)     # evaluate here

    References:
      Zhang, Lucas, Hinton and Ba, Lookahead Optimizer: k steps forward, 1 step back
      (arXiv 1907.08610).
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"lookahead: tx must be a GradientTransformation, got "
                        f"{type(tx).__name__}.")
    if not isinstance(sync_period, int) or isinstance(sync_period, bool) or sync_period < 1:
        raise ValueError(f"sync_period must be an integer >= 1, got {sync_period!r}.")
    check_number("alpha", alpha)
    if isinstance(alpha, (int, float)) and not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1] (the fraction of the way the slow "
                         f"parameters move), got {alpha}.")
    if not isinstance(reset_state, bool):
        raise TypeError(f"reset_state must be a bool, got {reset_state!r}.")

    def init(params: Params) -> LookaheadState:
        check_init_params(params)
        slow = tree_map(lambda p: p.detach().to(dtype=_slow_dtype(p, state_dtype), copy=True),
                        params)
        return LookaheadState(count=zero_count(params), slow=slow, fast_state=tx.init(params))

    def update(updates: Updates, state: LookaheadState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, LookaheadState]:
        params = require_params(params, "lookahead")
        check_state_type(state, LookaheadState, "lookahead")
        _, g, slow = flatten_matching(updates, state.slow, what="updates and the slow params")
        check_gradient_leaves(g, slow, updates, "LookaheadState.slow")
        count = safe_increment(state.count)
        sync = torch.remainder(count, sync_period) == 0          # s: this step synchronizes
        a = _f64(alpha, count)
        zero = torch.zeros((), dtype=torch.float64, device=count.device)
        slow_factor = torch.where(sync, a, zero)                 # s * alpha
        fast_factor = torch.where(sync, 1 - a, zero)             # s * (1 - alpha)

        fast_updates, fast_state = tx.update(updates, state.fast_state, params, **extra_args)
        spec, u, slow, y = flatten_matching(fast_updates, state.slow, params,
                                            what="updates, slow params and params")
        new_slow, out = slow, []
        if u:
            # d = theta + u - phi, in the slow parameters' dtype
            diff = foreach("add", cast_like(y, slow), cast_like(u, slow))
            diff = foreach_("sub", diff, slow)
            step = foreach("mul", diff, slow_factor)
            new_slow = foreach_("add", slow, step) if is_donating() else \
                cast_like(foreach("add", slow, step), slow)
            out = foreach("sub", cast_like(u, slow), foreach("mul", diff, fast_factor))
            out = mark_scratch(cast_like(out, u))
        if reset_state:
            fresh = tx.init(params)
            fast_state = tree_map(lambda cur, new: torch.where(sync, new, cur)
                                  if isinstance(cur, torch.Tensor) else cur,
                                  fast_state, fresh)
        new_state = replace_state(state, count=count, slow=tree_unflatten(list(new_slow), spec),
                                  fast_state=fast_state)
        return tree_unflatten(out, spec), new_state

    return GradientTransformation(init, update, combine_traits((tx,)))


def _f64(value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a float64 0-dim tensor on ``like``'s device."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64)
    return torch.tensor(value, dtype=torch.float64, device=like.device)


def lookahead_slow_params(state: PyTree) -> Params:
    """The slow parameters :math:`\\phi` of the one `lookahead` state inside ``state`` (at any
    depth: an `opttx.inject_hyperparams` or chain state around it is searched): where the
    lookahead paper evaluates the model. The state's own tensors (copy them before changing
    them); under `opttx.distributed.zero` or ``on_owners`` a rank holds only the leaves it
    owns (`opttx.MaskedNode` elsewhere).

    Example:
      >>> tx = opttx.lookahead(opttx.sgd(0.1), sync_period=5)
      >>> state = tx.init(params)
      >>> slow = opttx.lookahead_slow_params(state)   # equals params at step 0
    """
    found = find_instances(state, LookaheadState)
    if len(found) != 1:
        raise ValueError("lookahead_slow_params needs the state of a transform built with "
                         f"opttx.lookahead; found {len(found)} LookaheadState(s) in the given "
                         "state.")
    return found[0].slow
