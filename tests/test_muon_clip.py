"""MuonClip's QK-clip (`clip_qk`, `MaxAttentionLogits`, the alias `muon_clip`), against a
float64 transcription of the Kimi K2 report's rule (section 2.1: per head,
:math:`\\gamma_h = \\min(1, \\tau / S^h_{max})`, query and key weights of the head scaled by
:math:`\\sqrt{\\gamma_h}`):

* with a zero step (learning rate 0) the clipped weights' largest logit per head on the same
  batch is exactly :math:`\\min(S_h, \\tau)` (float64, <= 1e-12 relative), heads below the
  threshold untouched bit for bit, values and other parameters untouched;
* with GQA a key head takes the smallest factor of its group and every head ends at or below
  the threshold;
* the recorder equals the logits computed by hand (causal and not);
* a compiled step with the logits in ``extra_args`` is one graph, equal to eager.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import opttx
from opttx.testing import assert_trees_close

F64 = torch.float64


def attention_logits(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, heads: int,
                     kv_heads: int, causal: bool = True) -> torch.Tensor:
    """Per-head max of q k^T / sqrt(d) for inputs ``x`` (b, t, d_model): the transcription."""
    b, t, _ = x.shape
    d = w_q.shape[0] // heads
    q = (x @ w_q.T).view(b, t, heads, d).transpose(1, 2)
    k = (x @ w_k.T).view(b, t, kv_heads, d).transpose(1, 2)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    s = q @ k.mT / math.sqrt(d)
    if causal:
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return s.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_a_zero_step_clips_each_heads_logits_to_the_threshold(kv_heads) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, d, model = 4, 3, 8
    rows = (heads + 2 * kv_heads) * d
    params = {"qkv": torch.randn(rows, model, generator=gen, dtype=F64) * 2,
              "out": torch.randn(model, heads * d, generator=gen, dtype=F64)}
    x = torch.randn(2, 5, model, generator=gen, dtype=F64)

    def split(w):
        return w[:heads * d], w[heads * d:(heads + kv_heads) * d], w[(heads + kv_heads) * d:]

    before = attention_logits(x, *split(params["qkv"])[:2], heads, kv_heads)
    tau = float(before.median())               # about half the heads above it
    rec = opttx.MaxAttentionLogits()
    q, k = [(x @ w.T).view(2, 5, -1, d).transpose(1, 2) for w in split(params["qkv"])[:2]]
    logits = rec.record("attn", q, k, causal=True)
    assert_trees_close(logits, before, rtol=1e-14)
    roles = {"qkv": opttx.QKWeight("attn", "qkv", heads, kv_heads), "out": None}
    tx = opttx.muon_clip(0.0, roles, threshold=tau, weight_decay=0.0, muon_mask=True)
    grads = {k: torch.randn(v.shape, generator=gen, dtype=F64) for k, v in params.items()}
    u, _ = tx.update(grads, tx.init(params), params, max_attention_logits=rec.pop())
    new = opttx.apply_updates(params, u)
    after = attention_logits(x, *split(new["qkv"])[:2], heads, kv_heads)
    if kv_heads == heads:       # MHA: exactly min(S_h, tau)
        assert_trees_close(after, before.clamp(max=tau), rtol=1e-12)
    assert (after <= tau * (1 + 1e-12)).all()
    gamma = (tau / before).clamp(max=1.0)
    q_new, k_new, v_new = split(new["qkv"])
    q_old, k_old, v_old = split(params["qkv"])
    assert_trees_close(q_new, q_old * gamma.sqrt().repeat_interleave(d)[:, None], rtol=1e-13)
    k_gamma = gamma.sqrt().reshape(kv_heads, -1).amin(-1)
    assert_trees_close(k_new, k_old * k_gamma.repeat_interleave(d)[:, None], rtol=1e-13)
    assert torch.equal(v_new, v_old) and torch.equal(new["out"], params["out"])
    keep = (before <= tau).repeat_interleave(d)
    assert torch.equal(q_new[keep], q_old[keep])


def test_separate_q_and_k_weights_and_alpha() -> None:
    gen = torch.Generator().manual_seed(1)
    p = {"q": torch.randn(4, 3, generator=gen, dtype=F64),
         "k": torch.randn(4, 3, generator=gen, dtype=F64)}
    roles = {"q": opttx.QKWeight("l", "q", 2), "k": opttx.QKWeight("l", "k", 2)}
    tx = opttx.clip_qk(roles, threshold=10.0, alpha=0.25)
    zero = {k: torch.zeros_like(v) for k, v in p.items()}
    u, _ = tx.update(zero, tx.init(p), p, max_attention_logits={"l": torch.tensor([40.0, 5.0])})
    new = opttx.apply_updates(p, u)
    assert_trees_close(new["q"][:2], p["q"][:2] * 0.25 ** 0.25, rtol=1e-14)
    assert_trees_close(new["k"][:2], p["k"][:2] * 0.25 ** 0.75, rtol=1e-14)
    assert torch.equal(new["q"][2:], p["q"][2:]) and torch.equal(new["k"][2:], p["k"][2:])


def test_missing_logits_and_bad_roles_raise() -> None:
    p = {"q": torch.randn(4, 3)}
    tx = opttx.clip_qk({"q": opttx.QKWeight("l", "q", 2)})
    with pytest.raises(ValueError, match="max_attention_logits"):
        tx.update(p, tx.init(p), p)
    with pytest.raises(ValueError, match="heads"):
        opttx.clip_qk({"q": opttx.QKWeight("l", "q", 3)}).init(p)
    with pytest.raises(ValueError, match="threshold"):
        opttx.clip_qk({"q": None}, threshold=0.0)
    with pytest.raises(ValueError, match="kind"):
        opttx.QKWeight("l", "o", 2)


def test_recorder_takes_the_max_over_calls_without_causal_mask() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 3, 6, 5, generator=gen)
    rec = opttx.MaxAttentionLogits()
    rec.record("a", q, k)
    rec.record("a", q * 0.5, k)
    expected = (q @ k.mT / math.sqrt(5)).amax(dim=(0, 2, 3))
    assert_trees_close(rec.pop()["a"], expected, rtol=1e-6)
    assert rec.pop() == {}


def test_muon_clip_step_compiles_to_one_graph() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    params = {"qkv": torch.randn(12, 4, generator=gen), "mlp": torch.randn(6, 4, generator=gen)}
    roles = lambda p: {k: opttx.QKWeight("a", "qkv", 2) if k == "qkv" else None  # noqa: E731
                       for k in p}
    tx = opttx.muon_clip(0.02, roles, threshold=1.0, muon_mask=True)

    def step(p, s, g, logits):
        u, s = tx.update(g, s, p, max_attention_logits=logits)
        return opttx.apply_updates(p, u), s

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    pe, se = params, tx.init(params)
    pc, sc = params, tx.init(params)
    for i in range(3):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        logits = {"a": torch.tensor([3.0 + i, 0.5])}
        pe, se = step(pe, se, g, logits)
        pc, sc = compiled(pc, sc, g, logits)
    assert counter.frame_count == 1
    assert_trees_close(pc, pe, rtol=1e-5)
    torch._dynamo.reset()


def test_logits_of_the_wrong_shape_are_a_value_error_naming_the_argument() -> None:
    """Logits of shape (3,) for a layer of 4 query heads: a ValueError naming
    ``max_attention_logits``, the layer and the shape expected (was torch's reshape error)."""
    tx = opttx.clip_qk(lambda p: {"w": opttx.QKWeight("attn", "q", 4)})
    params = {"w": torch.randn(8, 3)}
    with pytest.raises(ValueError, match=r"max_attention_logits\['attn'\] has shape \(3,\); "
                                         r"layer 'attn' has 4 query heads.*shape \(4,\)"):
        tx.update(params, tx.init(params), params,
                  max_attention_logits={"attn": torch.ones(3)})
    updates, _ = tx.update(params, tx.init(params), params,
                           max_attention_logits={"attn": torch.full((4,), 50.0)})
    assert updates["w"].shape == (8, 3)
