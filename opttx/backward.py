r"""Updates fused into the backward pass (LOMO / AdaLomo): no full set of gradients ever exists.

`FusedBackward` registers a ``register_post_accumulate_grad_hook`` on every parameter. When
autograd has finished a parameter's gradient, the hook takes it, frees ``p.grad`` at once,
runs the per-leaf transform on that one leaf, and writes the parameter in place. At any moment
at most one parameter gradient is held (plus the activations' gradients autograd needs), so a
step's peak memory is parameters + optimizer state + activations + the largest single gradient.

The transform sees one-leaf trees ``{name: tensor}`` (each parameter has its own state from
``tx.init({name: p})``), so it must be *per-leaf*: element-wise and layer-wise transforms
(`adalomo`, `adafactor`, `adamw`, `lion`, `clip_by_rms`, trust ratios, ...) work; transforms
that look across leaves (`clip_by_global_norm`) do not: global gradient-norm clipping is done
by the runner itself (``clip_grad_norm``), in one of two modes:

* ``"previous"`` (default): the gradients of step :math:`t` are scaled by
  :math:`\min(1, c / (\lVert g_{t-1} \rVert + 10^{-6}))`, the norm of the previous step's
  gradients, which is accumulated leaf by leaf during backward at no extra pass (the first
  step is not clipped). Step time is unchanged.
* ``"two_pass"``: AdaLomo's reference behaviour — a first backward (``retain_graph=True``)
  only measures :math:`\lVert g_t \rVert`, the second applies the updates with
  :math:`\min(1, c / (\lVert g_t \rVert + 10^{-6}))`. Exact, at the price of a second backward.

Loss scaling for fp16: ``loss_scale=2.0**10`` (AdaLomo's static default) multiplies the loss
in `FusedBackward.backward` and divides every gradient before its update;
``loss_scale="dynamic"`` starts at ``init_scale``, skips (per leaf, without a host sync) the
update of any gradient with an inf/NaN, halves the scale after a step that overflowed and
doubles it after ``growth_interval`` clean steps. In-backward updates cannot be undone, so a
skipped step skips only the leaves whose gradients overflowed.

Example:
  >>> model = torch.nn.Linear(4, 3)
  >>> runner = opttx.FusedBackward(model, opttx.adalomo(1e-3))
  >>> loss = model(torch.randn(8, 4)).square().mean()
  >>> runner.backward(loss)          # or loss.backward(): the hooks are the same

Limits: no gradient accumulation over micro-batches (each backward is a step); the per-leaf
updates run eagerly.

References:
  Lv et al., Full Parameter Fine-tuning for Large Language Models with Limited Resources
  (LOMO, arXiv 2306.09782); Lv et al., AdaLomo (arXiv 2310.10195).
"""

from __future__ import annotations

from typing import Any, Iterable, Literal

import torch

from .base import GradientTransformation, traits_of
from .kernels import donating
from .tree import tree_copy_, tree_flatten, tree_map
from .wrappers import set_hyperparams_

__all__ = ["FusedBackward"]


class FusedBackward:
    """Apply a per-leaf `GradientTransformation` to each parameter inside backward.

    Args:
      params: an ``nn.Module`` or an iterable of ``(name, parameter)`` pairs; parameters that
        do not require grad are left alone.
      tx: the per-leaf transform (see the module docstring).
      clip_grad_norm: global gradient-norm threshold :math:`c` (None: no clipping).
      clip_mode: ``"previous"`` (no extra pass) or ``"two_pass"`` (exact, two backwards).
      loss_scale: None, a number (static) or ``"dynamic"``.
      init_scale, growth_interval: the dynamic loss scale's start and doubling period.
      compute_dtype: 16-bit parameters and gradients are updated in this dtype and the result
        is written back rounded (float32 by default, as AdaLomo).
    """

    def __init__(self, params: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
                 tx: GradientTransformation, *, clip_grad_norm: float | None = None,
                 clip_mode: Literal["previous", "two_pass"] = "previous",
                 loss_scale: float | Literal["dynamic"] | None = None,
                 init_scale: float = 2.0**16, growth_interval: int = 2000,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        if isinstance(params, torch.nn.Module):
            params = params.named_parameters()
        self.named = [(n, p) for n, p in params if p.requires_grad]
        if not self.named:
            raise ValueError("FusedBackward got no parameter that requires grad.")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be positive, got {clip_grad_norm}.")
        if clip_mode not in ("previous", "two_pass"):
            raise ValueError(f"clip_mode must be 'previous' or 'two_pass', got {clip_mode!r}.")
        if loss_scale is not None and loss_scale != "dynamic" and not float(loss_scale) > 0:
            raise ValueError(f"loss_scale must be positive, 'dynamic' or None, got "
                             f"{loss_scale!r}.")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}.")
        if traits_of(tx).across_leaves:
            raise ValueError(
                "FusedBackward runs the transform on one parameter at a time, inside its "
                "gradient hook, but this transform takes a statistic across leaves (a global "
                "norm or a finiteness test, Traits.across_leaves): it would be computed per "
                "parameter. Use clip_grad_norm=... for global-norm clipping, or run the "
                "transform with opttx.Optimizer after a full backward.")
        self.tx = tx
        self.clip_grad_norm = clip_grad_norm
        self.clip_mode = clip_mode
        self.dynamic = loss_scale == "dynamic"
        self._scaled = self.dynamic or loss_scale not in (None, 1, 1.0)
        self.growth_interval = growth_interval
        self.compute_dtype = compute_dtype
        device = self.named[0][1].device
        scale = init_scale if self.dynamic else (1.0 if loss_scale is None else loss_scale)
        # the runner's own state, all tensors so nothing synchronises with the device
        self.scale = torch.tensor(float(scale), dtype=torch.float32, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)
        self.sum_sq = torch.zeros((), dtype=torch.float32, device=device)
        self.prev_norm = torch.full((), float("nan"), dtype=torch.float32, device=device)
        self.clip_coef = torch.ones((), dtype=torch.float32, device=device)
        self.steps = 0
        self.states = {n: tx.init({n: self._compute_view(p)}) for n, p in self.named}
        self._measuring = False        # first pass of two_pass mode: only norms
        self._in_backward = False      # the end-of-backward callback is queued
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(n))
                         for n, p in self.named]

    # -----------------------------------------------------------------------------------------

    def _compute_view(self, p: torch.Tensor) -> torch.Tensor:
        low = p.dtype in (torch.float16, torch.bfloat16)
        return p.detach().to(self.compute_dtype) if low else p.detach()

    def _hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            # the gradient travels in a box that _consume empties, so that no frame keeps it
            # alive once it has been turned into the update
            box = [p.grad]
            p.grad = None
            if box[0] is None:
                return
            self._begin()
            with torch.no_grad():
                self._consume(name, p, box)
        return hook

    def _begin(self) -> None:
        """At the first hook of a backward, queue the end-of-backward bookkeeping."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _consume(self, name: str, p: torch.Tensor, box: list[torch.Tensor]) -> None:
        grad = box.pop()
        if grad.layout != torch.strided:
            raise TypeError(f"FusedBackward: the gradient of {name!r} is a {grad.layout} tensor "
                            "(an nn.Embedding(sparse=True)?); its transforms take dense "
                            "gradients only. Use sparse=False, or torch.optim.SparseAdam for "
                            "that parameter.")
        g = grad.to(self.compute_dtype) if grad.dtype in (torch.float16, torch.bfloat16) \
            else grad
        del grad
        if self._scaled:
            g = g / self.scale.to(g.dtype)
        finite = torch.isfinite(g).all() if self.dynamic else None
        if self.dynamic:
            self.overflow |= ~finite
            g = torch.where(finite, g, torch.zeros((), dtype=g.dtype, device=g.device))
        if self.clip_grad_norm is not None:
            self.sum_sq += g.float().square().sum()
            if self._measuring:
                return
            g = g * self.clip_coef.to(g.dtype)
        x = self._compute_view(p)
        state = self.states[name]
        with donating(not self.dynamic):
            updates, new_state = self.tx.update({name: g}, state, {name: x})
        u = updates[name]
        if self.dynamic:
            u = torch.where(finite, u, torch.zeros((), dtype=u.dtype, device=u.device))
            new_state = tree_map(
                lambda new, old: torch.where(finite, new, old)
                if isinstance(new, torch.Tensor) and new.shape == old.shape else new,
                new_state, state)
        self.states[name] = new_state
        if x.dtype == p.dtype:
            p.add_(u.to(p.dtype))
        else:                       # 16-bit parameter updated in compute_dtype, then rounded
            p.copy_(x + u.to(x.dtype))

    def _finish(self) -> None:
        """End of a backward: finish the norm, move the loss scale, count the step."""
        self._in_backward = False
        if self._measuring:
            return
        if self.clip_grad_norm is not None and self.clip_mode == "previous":
            self.prev_norm = self.sum_sq.sqrt()
            coef = torch.clamp(self.clip_grad_norm / (self.prev_norm + 1e-6), max=1.0)
            # a non-finite norm (an overflow, a NaN gradient) says nothing about the scale of
            # the next step's gradients: keep the last finite coefficient
            self.clip_coef = torch.where(torch.isfinite(self.prev_norm), coef, self.clip_coef)
            self.sum_sq = torch.zeros_like(self.sum_sq)
        if self.dynamic:
            grow = (~self.overflow) & (self.good_steps + 1 >= self.growth_interval)
            self.scale = torch.where(self.overflow, self.scale / 2,
                                     torch.where(grow, self.scale * 2, self.scale))
            self.good_steps = torch.where(self.overflow | grow,
                                          torch.zeros_like(self.good_steps),
                                          self.good_steps + 1)
            self.overflow = torch.zeros_like(self.overflow)
        self.steps += 1

    # -----------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """One training step: backward of ``loss`` (times the loss scale) with the updates
        applied inside it; two backwards in ``clip_mode="two_pass"``."""
        self._in_backward = False    # a previous backward that raised left it set
        scaled = loss * self.scale.to(loss.dtype) if self._scaled else loss
        if self.clip_grad_norm is not None and self.clip_mode == "two_pass":
            self._measuring = True
            self.sum_sq = torch.zeros_like(self.sum_sq)
            try:
                scaled.backward(retain_graph=True)
            finally:
                self._measuring = False
            norm = self.sum_sq.sqrt()
            if self.dynamic:
                # an overflow is re-detected in the second pass, leaf by leaf
                self.overflow = torch.zeros_like(self.overflow)
            self.clip_coef = torch.clamp(self.clip_grad_norm / (norm + 1e-6), max=1.0)
            self.prev_norm = norm
            self.sum_sq = torch.zeros_like(self.sum_sq)
            scaled.backward()
            self.sum_sq = torch.zeros_like(self.sum_sq)
            return
        scaled.backward()

    @property
    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the last step (NaN before the first step or without
        ``clip_grad_norm``)."""
        return self.prev_norm

    def set_hyperparams(self, **values: float) -> None:
        """Set injected hyperparameters (`inject_hyperparams`) in every parameter's state."""
        for state in self.states.values():
            set_hyperparams_(state, **values)

    def remove(self) -> None:
        """Remove the hooks: the parameters get ordinary gradients again."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter transform states (by name) and the runner's counters, as a snapshot:
        copies of the tensors, which later steps (that update the states in place) leave as
        they are."""
        def snapshot(tree: Any) -> Any:
            return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)

        return snapshot({"states": dict(self.states), "steps": self.steps, "scale": self.scale,
                         "good_steps": self.good_steps, "prev_norm": self.prev_norm,
                         "clip_coef": self.clip_coef})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict` (copies into the existing buffers). Everything is checked
        first (parameter names, tree structures, shapes and dtypes of every tensor): a state
        dict that does not match leaves this runner as it was."""
        missing = [k for k in ("states", "steps", "scale", "good_steps", "prev_norm",
                               "clip_coef") if k not in state_dict]
        if missing:
            raise ValueError(f"not a FusedBackward state_dict: missing {missing}.")
        missing = set(self.states) ^ set(state_dict["states"])
        if missing:
            raise KeyError(f"state_dict parameters differ from this runner's: {sorted(missing)}")
        for name, state in state_dict["states"].items():
            theirs, spec = tree_flatten(state)
            mine, my_spec = tree_flatten(self.states[name])
            if spec != my_spec:
                raise ValueError(f"state of {name!r} has a different structure.")
            for a, b in zip(theirs, mine):
                if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                    got = (f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor)
                           else type(a).__name__)
                    raise ValueError(f"state of {name!r} holds {got} where this runner's has "
                                     f"{tuple(b.shape)} {b.dtype}.")
        for key in ("scale", "good_steps", "prev_norm", "clip_coef"):
            value, mine = state_dict[key], getattr(self, key)
            if not isinstance(value, torch.Tensor) or value.shape != mine.shape:
                raise ValueError(f"state_dict[{key!r}] must be a 0-dim tensor, got {value!r}.")
        for name, state in state_dict["states"].items():
            tree_copy_(self.states[name], state)
        self.steps = int(state_dict["steps"])
        for key in ("scale", "good_steps", "prev_norm", "clip_coef"):
            getattr(self, key).copy_(state_dict[key])
