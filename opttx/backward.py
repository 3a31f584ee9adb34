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

Sharded models. With ``group=dp_group`` (data parallel, ZeRO-style) every rank holds the whole
(replicated) model and computes the gradient :math:`g^{(r)}` of its own batch. In the hook of a
parameter with :math:`R` rows (dim 0) on :math:`N` ranks, the gradient is padded to
:math:`N \lceil R / N \rceil` rows and reduce-scattered, so rank :math:`r` receives its rows
:math:`P_r` of the mean gradient

.. math::
    \bar g_{P_r} = \frac{1}{N} \sum_{s=1}^{N} g^{(s)}_{P_r},

runs the transform on that piece (its state covers only :math:`P_r`: about :math:`1/N` of the
single-device state) with a `opttx.distributed.ShardedReducer` whose spec is
``Shard(0, group)``, so every layer-wise statistic (AdaLomo's and Adafactor's row and column
means, update RMS clipping, parameter RMS, trust ratios) is reduced over the group and equals
the single-device one; decisions read the whole parameter's shape (Adafactor's factoring).
The updated pieces are all-gathered into the parameter, which stays replicated (bit-identical
on every rank), and the gradient is freed at once. A 0-dim parameter is all-reduced and
updated whole on every rank. Per parameter and step: 1 reduce-scatter, 1 all-gather, the
transform's statistics (small all-reduces: AdaLomo 3 per matrix and 2 per vector, Adafactor
2 and 1, AdamW none); ``clip_grad_norm`` adds one all-reduce of
:math:`\sum \lVert \bar g_{P_r} \rVert^2` per backward (the single-device norm of the mean
gradient), ``"two_pass"`` also one more reduce-scatter per parameter (its measuring pass),
``loss_scale="dynamic"`` one all-reduce of each parameter's overflow flag (every rank skips a
leaf alike). 16-bit gradients are reduced in ``compute_dtype``. `state_dict` holds this rank's
pieces. Every rank must run the same graph (the hooks issue their collectives in autograd's
order).

FSDP2 (``torch.distributed.fsdp.fully_shard``): the parameters are DTensors sharded on dim 0;
FSDP2 calls the post-accumulate-grad hooks of its sharded parameters itself, right after its
reduce-scatter (torch 2.13, ``_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``), with
the averaged gradient shard in ``.grad``. The runner then updates the local shard with a
reducer built from the placements (`opttx.distributed.specs_from_dtensors`), writes the local
shard of the parameter and frees the gradient; FSDP2 all-gathers the parameters at the next
forward, so the runner issues only the statistics' collectives (and the norm's). Pass no
``group``: the DTensors say how the parameters are split.

Example:
  >>> model = torch.nn.Linear(4, 3)
  >>> runner = opttx.FusedBackward(model, opttx.adalomo(1e-3))
  >>> loss = model(torch.randn(8, 4)).square().mean()
  >>> runner.backward(loss)          # or loss.backward(): the hooks are the same

  On N data-parallel ranks, each with its own batch (needs a process group, so not run here;
  tests/test_backward_distributed.py runs it), or on an FSDP2 model::

    runner = opttx.FusedBackward(model, opttx.adalomo(1e-3), group=dist.group.WORLD,
                                 clip_grad_norm=1.0)
    runner.backward(loss_fn(model(x_rank), y_rank))   # every rank: its own batch

    fully_shard(model.block); fully_shard(model)        # FSDP2: no group, read from DTensors
    runner = opttx.FusedBackward(model, opttx.adalomo(1e-3), clip_grad_norm=1.0)

Limits: gradient accumulation (``accumulate=k``) keeps the gradients of the first k - 1
micro-batches as ordinary training does (the memory saving is on the last one); the per-leaf
updates and their collectives run eagerly, one parameter after another (no overlap of a
parameter's collectives with the rest of backward beyond what autograd's order gives).

References:
  Lv et al., Full Parameter Fine-tuning for Large Language Models with Limited Resources
  (LOMO, arXiv 2306.09782); Lv et al., AdaLomo (arXiv 2310.10195).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .base import REDUCER_KEY, GradientTransformation, reducer_during_init, traits_of
from .kernels import donating
from .tree import tree_copy_, tree_flatten, tree_map
from .wrappers import set_hyperparams_

__all__ = ["FusedBackward"]


@dataclass
class _Leaf:
    """How one parameter is split across ranks (one device: the whole of it, no reducer)."""

    reducer: Any           # ShardedReducer of the one-leaf tree (Shard(0, group)); None: whole
    rows: int              # dim 0 of the parameter (the padded pieces are `chunk` rows each)
    chunk: int             # rows per rank: ceil(rows / world)
    start: int             # this rank's rows are [start, stop) of the parameter
    stop: int
    groups: tuple          # the groups the leaf is split over (overflow flags are reduced there)
    counts: bool           # whether this rank adds the leaf's (piece's) squares to the norm


def _whole(p: torch.Tensor) -> _Leaf:
    rows = p.shape[0] if p.ndim else 1
    return _Leaf(None, rows, rows, 0, rows, (), True)


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
      group: data parallelism, ZeRO-style (module docstring): each rank's gradients are
        reduce-scattered over this process group in row pieces, each rank updates and keeps
        the state of its piece, the pieces are all-gathered into the replicated parameters.
        None: one device, or FSDP2 (DTensor parameters, detected by themselves).
      stats: a `opttx.distributed.CollectiveStats` counting the collectives (eager).
      accumulate: gradient accumulation over this many backwards (micro-batches): the first
        ``accumulate - 1`` leave the gradients in ``.grad`` (autograd sums them; nothing is
        updated or communicated), the last one updates every parameter with the mean of the
        micro-batches' gradients inside its hook, as one step on their mean (`opttx.MultiSteps`
        for `opttx.Optimizer`). Memory during the earlier micro-batches is that of ordinary
        training. Not with ``clip_mode="two_pass"``.
    """

    def __init__(self, params: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
                 tx: GradientTransformation, *, clip_grad_norm: float | None = None,
                 clip_mode: Literal["previous", "two_pass"] = "previous",
                 loss_scale: float | Literal["dynamic"] | None = None,
                 init_scale: float = 2.0**16, growth_interval: int = 2000,
                 compute_dtype: torch.dtype = torch.float32, group: Any = None,
                 stats: Any = None, accumulate: int = 1) -> None:
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
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be an integer >= 1, got {accumulate!r}.")
        if accumulate > 1 and clip_grad_norm is not None and clip_mode == "two_pass":
            raise ValueError("accumulate > 1 with clip_mode='two_pass' is not supported: the "
                             "measuring pass would take the gradients accumulated so far. Use "
                             "clip_mode='previous'.")
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
        self.group, self.stats = group, stats
        self.accumulate = accumulate
        self._micro = 0                # backwards accumulated since the last update
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
        self.leaves, self._norm_groups = self._plan()
        self.states = {n: self._init_state(n, p) for n, p in self.named}
        self._measuring = False        # first pass of two_pass mode: only norms
        self._in_backward = False      # the end-of-backward callback is queued
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(n))
                         for n, p in self.named]

    # -----------------------------------------------------------------------------------------
    # the split of every parameter across ranks

    def _plan(self) -> tuple[dict[str, _Leaf], list[Any]]:
        """Per parameter, its `_Leaf`; and the groups the squared norm is summed over."""
        from .distributed.shapes import is_dtensor
        dtensors = [is_dtensor(p) for _, p in self.named]
        if self.group is None and not any(dtensors):
            return {n: _whole(p) for n, p in self.named}, []
        if any(dtensors):
            if self.group is not None or not all(dtensors):
                raise ValueError(
                    "FusedBackward: DTensor parameters (FSDP2's fully_shard) carry their own "
                    "sharding: pass group=None, and shard every parameter that requires grad "
                    "(fully_shard the root module too).")
            return self._plan_dtensors()
        return self._plan_rows()

    def _plan_rows(self) -> tuple[dict[str, _Leaf], list[Any]]:
        import torch.distributed as dist

        from .distributed.reducer import ShardedReducer
        from .distributed.shapes import agree_on_tree, require_member
        from .distributed.specs import Shard
        require_member(self.group, "FusedBackward(group=...)")
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        params = {n: p.detach() for n, p in self.named}
        agree_on_tree(params, self.group, self.sum_sq.device,
                      "FusedBackward(group=...): the ranks' parameters differ; every rank must "
                      "hold the same (replicated) model.")
        group = self.group if self.group is not None else dist.group.WORLD
        leaves = {}
        for n, p in params.items():
            if p.ndim == 0:          # a scalar is averaged whole and updated on every rank
                leaves[n] = _Leaf(None, 1, 1, 0, 1, (group,), rank == 0)
                continue
            rows = p.shape[0]
            chunk = -(-rows // world)
            start = min(rank * chunk, rows)
            treespec = tree_flatten({n: p})[1]
            reducer = ShardedReducer(treespec, [(Shard(0, group),)], [group], self.stats,
                                     ndims=[p.ndim])
            reducer.global_shapes = [tuple(p.shape)]   # decisions on the whole parameter
            leaves[n] = _Leaf(reducer, rows, chunk, start, min(start + chunk, rows), (group,),
                              True)
        return leaves, [group]

    def _plan_dtensors(self) -> tuple[dict[str, _Leaf], list[Any]]:
        import torch.distributed as dist

        from .distributed.reducer import ShardedReducer
        from .distributed.specs import flatten_specs, shard_groups, specs_from_dtensors
        flat = {n: flatten_specs({n: p}, specs_from_dtensors({n: p}))[0] for n, p in self.named}
        norm_groups = shard_groups(list(flat.values()))
        leaves = {}
        for n, p in self.named:
            groups = tuple(s.group for s in flat[n])
            mine = {id(g) for g in groups}
            # a leaf replicated over a group that shards others counts once across it
            counts = all(dist.get_rank(g) == 0 for g in norm_groups if id(g) not in mine)
            local = p.to_local()
            reducer = ShardedReducer(tree_flatten({n: local})[1], [flat[n]], list(groups),
                                     self.stats, ndims=[p.ndim])
            reducer.global_shapes = [tuple(p.shape)]
            rows = local.shape[0] if local.ndim else 1
            leaves[n] = _Leaf(reducer, rows, rows, 0, rows, groups, counts)
        return leaves, norm_groups

    def _piece(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the parameter, in the compute dtype."""
        leaf = self.leaves[name]
        x = p.detach()
        if hasattr(x, "to_local"):
            x = x.to_local()
        elif leaf.reducer is not None:
            x = x[leaf.start:leaf.stop]
        low = x.dtype in (torch.float16, torch.bfloat16)
        return x.to(self.compute_dtype) if low else x

    def _init_state(self, name: str, p: torch.Tensor) -> Any:
        with reducer_during_init(self.leaves[name].reducer):
            return self.tx.init({name: self._piece(name, p)})

    # -----------------------------------------------------------------------------------------
    # collectives (eager, counted into `stats`)

    def _record(self, group: Any, buffer: torch.Tensor) -> None:
        if self.stats is not None:
            self.stats.record(group, buffer)

    def _reduce_scatter(self, leaf: _Leaf, g: torch.Tensor) -> torch.Tensor:
        """The mean over the group of every rank's ``g``, this rank's rows of it."""
        import torch.distributed._functional_collectives as funcol
        group = leaf.groups[0]
        world = _world(group)
        if g.ndim == 0:
            self._record(group, g.reshape(1))
            return funcol.wait_tensor(funcol.all_reduce(g.reshape(1), "sum", group))[0] / world
        flat = g.reshape(-1)
        padded_rows = leaf.chunk * world
        if padded_rows != leaf.rows:
            row = math.prod(g.shape[1:])
            flat = torch.cat([flat, flat.new_zeros((padded_rows - leaf.rows) * row)])
        self._record(group, flat)
        piece = funcol.wait_tensor(_reduce_scatter(flat, "sum", 0, group))
        piece = piece.view(leaf.chunk, *g.shape[1:])[:leaf.stop - leaf.start]
        return piece / world

    def _all_gather(self, leaf: _Leaf, p: torch.Tensor, new: torch.Tensor) -> None:
        """Write every rank's new piece into the (replicated) parameter ``p``."""
        import torch.distributed._functional_collectives as funcol
        if new.ndim == 0:            # every rank computed the same whole scalar
            p.copy_(new)
            return
        group = leaf.groups[0]
        flat = new.reshape(-1)
        row = math.prod(new.shape[1:])
        if new.shape[0] != leaf.chunk:
            flat = torch.cat([flat, flat.new_zeros((leaf.chunk - new.shape[0]) * row)])
        self._record(group, flat)
        full = funcol.wait_tensor(_all_gather(flat, 0, group))
        p.copy_(full[:leaf.rows * row].view(p.shape))

    def _any_overflow(self, leaf: _Leaf, finite: torch.Tensor) -> torch.Tensor:
        """Whether the leaf's gradient is finite on every rank (one all-reduce per group)."""
        from .distributed.reducer import pack_all_reduce
        bad = (~finite).to(torch.float32).reshape(1)
        for g in leaf.groups:
            (bad,) = pack_all_reduce([bad], "max", g, self.stats)
        return bad[0] == 0

    def _global_sum_sq(self) -> torch.Tensor:
        """The squared norm of the whole (mean) gradient: this rank's pieces summed over the
        groups that split the parameters (one all-reduce per group, once per backward)."""
        from .distributed.reducer import pack_all_reduce
        total = self.sum_sq
        for g in self._norm_groups:
            (total,) = pack_all_reduce([total], "sum", g, self.stats)
        return total

    # -----------------------------------------------------------------------------------------

    def _hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            # the gradient travels in a box that _consume empties, so that no frame keeps it
            # alive once it has been turned into the update
            if p.grad is None:
                return
            self._begin()
            if self._micro + 1 < self.accumulate:
                return             # an earlier micro-batch: autograd keeps accumulating .grad
            box = [p.grad]
            p.grad = None
            with torch.no_grad():
                self._consume(name, p, box)
        return hook

    def _begin(self) -> None:
        """At the first hook of a backward, queue the end-of-backward bookkeeping."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _gradient(self, name: str, box: list[torch.Tensor]) -> torch.Tensor:
        """The gradient this rank updates with, in the compute dtype: the whole one (one
        device), the mean over the group of this rank's rows (``group``), the local shard of
        the already averaged one (FSDP2)."""
        grad = box.pop()
        if grad.layout != torch.strided:
            raise TypeError(f"FusedBackward: the gradient of {name!r} is a {grad.layout} tensor "
                            "(an nn.Embedding(sparse=True)?); its transforms take dense "
                            "gradients only. Use sparse=False, or torch.optim.SparseAdam for "
                            "that parameter.")
        if hasattr(grad, "to_local"):
            grad = grad.to_local()
        g = grad.to(self.compute_dtype) if grad.dtype in (torch.float16, torch.bfloat16) \
            else grad
        del grad
        if self.group is not None:
            g = self._reduce_scatter(self.leaves[name], g)
        return g

    def _consume(self, name: str, p: torch.Tensor, box: list[torch.Tensor]) -> None:
        leaf = self.leaves[name]
        g = self._gradient(name, box)
        if self.accumulate > 1:        # the sum of the micro-batches' gradients: their mean
            g = g / self.accumulate
        if self._scaled:
            g = g / self.scale.to(g.dtype)
        finite = torch.isfinite(g).all() if self.dynamic else None
        if self.dynamic:
            if leaf.groups:          # every rank skips the leaf alike
                finite = self._any_overflow(leaf, finite)
            self.overflow |= ~finite
            g = torch.where(finite, g, torch.zeros((), dtype=g.dtype, device=g.device))
        if self.clip_grad_norm is not None:
            if leaf.counts:
                self.sum_sq += g.float().square().sum()
            if self._measuring:
                return
            g = g * self.clip_coef.to(g.dtype)
        x = self._piece(name, p)
        state = self.states[name]
        extra = {} if leaf.reducer is None else {REDUCER_KEY: leaf.reducer}
        with donating(not self.dynamic):
            updates, new_state = self.tx.update({name: g}, state, {name: x}, **extra)
        u = updates[name]
        if self.dynamic:
            u = torch.where(finite, u, torch.zeros((), dtype=u.dtype, device=u.device))
            new_state = tree_map(
                lambda new, old: torch.where(finite, new, old)
                if isinstance(new, torch.Tensor) and new.shape == old.shape else new,
                new_state, state)
        self.states[name] = new_state
        self._write(leaf, p, x, u)

    def _write(self, leaf: _Leaf, p: torch.Tensor, x: torch.Tensor, u: torch.Tensor) -> None:
        """Apply the update ``u`` of this rank's piece ``x`` to the parameter ``p``."""
        target = p.to_local() if hasattr(p, "to_local") else p
        if self.group is None:          # one device, or FSDP2's local shard
            if x.dtype == target.dtype:
                target.add_(u.to(target.dtype))
            else:                       # 16-bit parameter updated in compute_dtype, rounded
                target.copy_(x + u.to(x.dtype))
            return
        new = (x + u.to(x.dtype)).to(p.dtype)       # as p.add_(u) / the rounded copy above
        self._all_gather(leaf, p, new)

    def _finish(self) -> None:
        """End of a backward: finish the norm, move the loss scale, count the step."""
        self._in_backward = False
        if self._measuring:
            return
        if self._micro + 1 < self.accumulate:
            self._micro += 1
            return
        self._micro = 0
        if self.clip_grad_norm is not None and self.clip_mode == "previous":
            self.prev_norm = self._global_sum_sq().sqrt()
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
            norm = self._global_sum_sq().sqrt()
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


def _world(group: Any) -> int:
    import torch.distributed as dist
    return dist.get_world_size(group)


def _reduce_scatter(flat: torch.Tensor, op: str, dim: int, group: Any) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol
    fn = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
    return fn(flat, op, dim, group)


def _all_gather(flat: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol
    fn = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return fn(flat, dim, group)
