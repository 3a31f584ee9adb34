"""MuonClip's QK-clip (`clip_qk`): after a step, shrink the query and key weights of every
attention head whose largest attention logit went above a threshold; and
`MaxAttentionLogits`, which records those logits from an attention module's forward pass.

The alias `opttx.muon_clip` is ``chain(muon(...), clip_qk(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from .._checks import check_nonnegative, check_positive
from ..base import (EmptyState, GradientTransformation, Params, Traits, Updates,
                    check_init_params, current_reducer, declare, require_params,
                    require_whole_leaves)
from ..kernels import mark_scratch
from ..tree import PyTree, leaf_labels, tree_flatten, tree_paths, tree_unflatten

__all__ = ["LOGITS_KEY", "MaxAttentionLogits", "QKWeight", "clip_qk"]

LOGITS_KEY = "max_attention_logits"
"""The ``extra_args`` key of the per-head maximum attention logits `clip_qk` reads: a dict
``{layer: tensor of shape (num_heads,)}``."""


@dataclass(frozen=True)
class QKWeight:
    """What a weight leaf is to `clip_qk`: the query (``"q"``), key (``"k"``) or fused
    query-key-value (``"qkv"``: rows ``[q; k; v]``) projection of attention layer ``layer``,
    with ``num_heads`` query heads and ``num_kv_heads`` key heads (GQA; default
    ``num_heads``). Rows are the output features (``nn.Linear.weight``), head by head."""

    layer: str
    kind: Literal["q", "k", "qkv"]
    num_heads: int
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("q", "k", "qkv"):
            raise ValueError(f"QKWeight.kind must be 'q', 'k' or 'qkv', got {self.kind!r}.")
        if self.num_heads < 1 or (self.num_kv_heads is not None and (
                self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads)):
            raise ValueError(f"QKWeight: num_heads {self.num_heads} must be >= 1 and a "
                             f"multiple of num_kv_heads {self.num_kv_heads}.")


def _is_role(x: Any) -> bool:
    return x is None or isinstance(x, QKWeight)


@declare(hyperparams={"threshold": None, "alpha": None})
def clip_qk(roles: PyTree | Callable[[Params], PyTree], threshold: float = 100.0,
            alpha: float = 0.5) -> GradientTransformation:
    r"""QK-clip (MuonClip, Kimi K2): rescale the query and key weights of each head whose
    maximum attention logit exceeded :math:`\tau`, after the step.

    With :math:`S_h` the largest pre-softmax logit :math:`q_i^\top k_j / \sqrt{d}` of head
    :math:`h` in the step's forward pass (``extra_args[LOGITS_KEY][layer]``, shape
    ``(num_heads,)``, recorded by `MaxAttentionLogits`) and
    :math:`\gamma_h = \min(1, \tau / S_h)`:

    .. math::
        W_q^{(h)} \leftarrow \gamma_h^{\alpha}\, W_q^{(h)}, \qquad
        W_k^{(h)} \leftarrow \gamma_h^{1-\alpha}\, W_k^{(h)}

    applied to the parameters after this step's update (the update returned is
    :math:`\gamma (p + u) - p` on those rows), so the head's logits on the same inputs shrink
    by :math:`\gamma_h` to at most :math:`\tau`. Heads under the threshold are untouched.
    With GQA (``num_kv_heads`` < ``num_heads``) a key head shared by several query heads is
    scaled by the smallest :math:`\gamma_h^{1-\alpha}` of its group (each logit still shrinks
    by at least :math:`\gamma_h`). The Kimi K2 report uses :math:`\tau = 100`,
    :math:`\alpha = 0.5` for multi-head attention; for MLA it scales only the head-specific
    parts (declare those leaves, leave the shared rotary key out).

    Args:
      roles: a tree like the params (or a function of them) with a `QKWeight` for each query,
        key or fused QKV weight and None elsewhere.
      threshold: :math:`\tau` > 0.
      alpha: :math:`\alpha` in [0, 1], the query's share of the rescaling.

    Traced compiled as one graph (tensor ops only); it reads the parameters and whole head
    rows (``Traits.whole_leaves``). Raises when a step has no logits for a declared layer.

    Example:
      >>> roles = {"w": opttx.QKWeight("attn", "q", num_heads=2), "b": None}
      >>> tx = opttx.chain(opttx.sgd(0.1), opttx.clip_qk(roles, threshold=100.0))
      >>> logits = {"attn": torch.tensor([150.0, 20.0])}   # from MaxAttentionLogits.pop()
      >>> updates, state = tx.update(grads, tx.init(params), params,
      ...                            max_attention_logits=logits)

    References:
      Kimi Team, Kimi K2: Open Agentic Intelligence (arXiv 2507.20534), section 2.1.
    """
    check_positive("threshold", threshold)
    check_nonnegative("alpha", alpha)
    if isinstance(alpha, (int, float)) and alpha > 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}.")

    def resolve(tree: PyTree, check_shapes: bool = True) -> list[QKWeight | None]:
        values = leaf_labels(roles, tree, "roles", is_leaf=_is_role)
        for v, x, path in zip(values, tree_flatten(tree)[0], tree_paths(tree)):
            if v is None or not check_shapes:
                continue
            if not isinstance(v, QKWeight):
                raise ValueError(f"clip_qk: the role of {path} is {v!r}; give a QKWeight or None.")
            kv = v.num_kv_heads or v.num_heads
            rows = {"q": v.num_heads, "k": kv, "qkv": v.num_heads + 2 * kv}[v.kind]
            if x.dim() != 2 or x.shape[0] % rows:
                raise ValueError(f"clip_qk: {path} (shape {tuple(x.shape)}) must be a matrix "
                                 f"whose rows split into {rows} heads ({v}).")
        return values

    def init(params: Params) -> EmptyState:
        check_init_params(params)
        # on local shards (inside opttx.distributed.sharded) the update refuses them, naming
        # on_owners; the head rows are checked on whole leaves
        resolve(params, check_shapes=current_reducer() is None)
        return EmptyState()

    def row_factors(v: QKWeight, s: torch.Tensor, rows: int, dtype: torch.dtype
                    ) -> torch.Tensor:
        """The factor of every row of the leaf, from the per-head gammas ``s``."""
        kv = v.num_kv_heads or v.num_heads
        q = s ** alpha
        k = (s ** (1 - alpha)).reshape(kv, v.num_heads // kv).amin(dim=-1)
        parts = {"q": [q], "k": [k], "qkv": [q, k, torch.ones_like(k)]}[v.kind]
        heads = {"q": [v.num_heads], "k": [kv], "qkv": [v.num_heads, kv, kv]}[v.kind]
        head_dim = rows // sum(heads)
        return torch.cat([p.repeat_interleave(head_dim) for p in parts]).to(dtype)

    def update(updates: Updates, state: EmptyState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, EmptyState]:
        leaves, spec = tree_flatten(updates)
        if not leaves:
            return updates, state
        params = require_params(params, "clip_qk")
        require_whole_leaves(updates, extra_args, "clip_qk")
        values = resolve(updates)
        p_leaves = tree_flatten(params)[0]
        for u, p, path in zip(leaves, p_leaves, tree_paths(updates)):
            if u.shape != p.shape:
                raise ValueError(f"clip_qk: updates{path} has shape {tuple(u.shape)}, the "
                                 f"params {tuple(p.shape)}: pass the params of these updates.")
        logits = extra_args.get(LOGITS_KEY)
        out = list(leaves)
        for i, (u, p, v, path) in enumerate(zip(leaves, p_leaves, values, tree_paths(updates))):
            if v is None:
                continue
            if logits is None or v.layer not in logits:
                raise ValueError(f"clip_qk: no maximum attention logits for layer {v.layer!r}; "
                                 f"pass tx.update(..., {LOGITS_KEY}={{layer: tensor of shape "
                                 "(num_heads,)}}), e.g. from opttx.MaxAttentionLogits.")
            s = torch.as_tensor(logits[v.layer])
            if tuple(s.shape) != (v.num_heads,):
                raise ValueError(f"clip_qk: {LOGITS_KEY}[{v.layer!r}] has shape "
                                 f"{tuple(s.shape)}; layer {v.layer!r} has {v.num_heads} query "
                                 f"heads ({path} is {v}): pass one maximum logit per query "
                                 f"head, shape ({v.num_heads},).")
            work = torch.promote_types(u.dtype, torch.float32)
            s = s.to(work)
            gamma = torch.clamp(threshold / s.clamp(min=1e-30), max=1.0)
            f = row_factors(v, gamma, u.shape[0], work).unsqueeze(-1)
            pw = p.to(work)
            new = ((pw + u.to(work)) * f - pw).to(u.dtype)
            out[i] = new
        mark_scratch([out[i] for i, v in enumerate(values) if v is not None])
        return tree_unflatten(out, spec), state

    # not per_leaf: the logits are per named layer, so `opttx.stacked` (whose slices are
    # layers with logits of their own) must refuse it
    return GradientTransformation(init, update, Traits(whole_leaves=True))


class MaxAttentionLogits:
    """Records the largest pre-softmax attention logit of each head, per layer, for
    `clip_qk`.

    Call ``record(layer, q, k)`` in the attention's forward pass (``q``: ``(batch, heads, t,
    d)``, ``k``: ``(batch, kv_heads, s, d)``, ``scale`` default :math:`1/\\sqrt{d}`, the
    ``causal`` mask of the attention); it computes :math:`\\max_{b,i,j} q_{bhi}^\\top
    k_{bhj} \\cdot \\text{scale}` per head without autograd (one extra ``q k^T`` of the
    attention's size) and keeps the largest over the calls since the last `pop`. Pass
    ``pop()`` (a dict ``{layer: tensor (heads,)}``) to the step as
    ``max_attention_logits=``. Under data parallelism take the max over ranks first
    (``dist.all_reduce(t, op=MAX)``).

    Example:
      >>> recorder = opttx.MaxAttentionLogits()
      >>> q = k = torch.randn(2, 4, 8, 16)       # (batch, heads, time, head dim)
      >>> # in the attention module's forward, before scaled_dot_product_attention:
      >>> _ = recorder.record("blocks.0", q, k, causal=True)
      >>> logits = recorder.pop()                # {"blocks.0": tensor of shape (4,)}
      >>> # then: tx.update(grads, state, params, max_attention_logits=logits)
    """

    def __init__(self) -> None:
        self.logits: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def record(self, layer: str, q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
               causal: bool = False) -> torch.Tensor:
        d = q.shape[-1]
        if k.shape[-3] != q.shape[-3]:       # GQA: repeat the key heads
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        work = torch.promote_types(q.dtype, torch.float32)
        s = (q.to(work) @ k.to(work).mT) * (d ** -0.5 if scale is None else scale)
        if causal:
            t, u = s.shape[-2:]
            mask = torch.ones(t, u, dtype=torch.bool, device=s.device).tril(u - t)
            s = s.masked_fill(~mask, float("-inf"))
        per_head = s.transpose(0, -3).reshape(s.shape[-3], -1).amax(dim=-1)
        old = self.logits.get(layer)
        self.logits[layer] = per_head if old is None else torch.maximum(old, per_head)
        return self.logits[layer]

    def pop(self) -> dict[str, torch.Tensor]:
        """The recorded maxima since the last call, and start again."""
        out, self.logits = self.logits, {}
        return out
