"""The conformance registry: every public transform and alias of opttx, with a small case.

`tests/test_conformance.py` runs each property of the transform contract (docs/design.md,
section 5) over every entry here; `test_every_public_transform_is_registered` fails when a
name in ``opttx.__all__`` that builds a `GradientTransformation` has no entry. An optimizer
added to opttx has one line here (the other files it touches are listed in
docs/guide/writing.md, "Adding it to opttx")::

    case("adopt", opttx.adopt, learning_rate=1e-2),

`case` keeps the factory and its keyword arguments, so the registry can also build the
transform with its numeric hyperparameters injected (`opttx.inject_hyperparams`) and check
that changing them recompiles nothing. Combinators and wrappers, whose arguments are
transforms, use `built` with a function that builds them.

What the machinery needs from a transform is read from its declared `Traits`; an entry only
says what the traits cannot: that a transform does not run under `opttx.stacked` (and why),
that it is not run distributed (and why), or that a NaN in a gradient does something else
than propagate to that leaf's update (``nonfinite=``: docs/guide/faults.md lists these
entries, and a test checks the page against the registry).
"""

from __future__ import annotations

import functools
from fractions import Fraction
import pathlib
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import opttx

LR = 1e-2


@dataclass(frozen=True)
class Case:
    name: str
    """A unique name; the first word before ``/`` is the public name it covers."""
    make: Callable[[], opttx.GradientTransformation]
    """Builds the transform (a fresh one per call)."""
    factory: Callable[..., opttx.GradientTransformation] | None = None
    """The public factory, when the case is ``factory(**kwargs)`` (hyperparameters injectable)."""
    kwargs: dict = field(default_factory=dict)
    stacked: str | None = None
    """None: ``stacked(tx)`` on stacked leaves equals ``tx`` per leaf (if the traits say
    per-leaf). A string: why it does not run under `opttx.stacked` (it must raise)."""
    distributed: str | None = None
    """None: ``sharded(tx)`` and ``zero(tx)`` on 2 ranks equal one device (with
    ``on_owners=True`` when the traits say it needs whole leaves, and then plain ``sharded``
    refuses it). A string: why it is not run distributed."""
    covers: tuple[str, ...] = ()
    """Other public names this case exercises (a factory that returns a factory, a class)."""
    matrices_only: bool = False
    """True for transforms of matrices (Muon's orthogonalization): the cases' trees hold no
    1-D leaf, which they refuse."""
    known_bugs: tuple[tuple[str, str], ...] = ()
    """(property, why): a property this entry fails today, run as a strict xfail (it
    fails the suite once fixed, so the entry is updated)."""
    nonfinite: str = "propagates"
    """How the entry answers one NaN element in a matrix's gradient (one of
    `opttx.conformance.NONFINITE_BEHAVIOURS`): by default the leaf's update holds a NaN at
    that step; docs/guide/faults.md lists the entries that declare another behaviour."""

    @property
    def public_name(self) -> str:
        return self.name.split("/")[0]


def case(name: str, factory: Callable[..., opttx.GradientTransformation], /,
         stacked: str | None = None, distributed: str | None = None, covers: tuple = (),
         matrices_only: bool = False, known_bugs: tuple = (), nonfinite: str = "propagates",
         **kwargs: Any) -> Case:
    """``factory(**kwargs)``, whose numeric keyword arguments may be injected."""
    return Case(name, lambda: factory(**kwargs), factory, dict(kwargs), stacked, distributed,
                covers, matrices_only, known_bugs, nonfinite)


def built(name: str, make: Callable[[], opttx.GradientTransformation], /,
          stacked: str | None = None, distributed: str | None = None,
          covers: tuple = (), matrices_only: bool = False,
          nonfinite: str = "propagates") -> Case:
    """A transform built by ``make`` (combinators and wrappers, whose arguments are
    transforms)."""
    return Case(name, make, None, {}, stacked, distributed, covers, matrices_only,
                nonfinite=nonfinite)


def _is_matrix(tree: Any) -> Any:
    return opttx.tree.tree_map(lambda x: x.ndim >= 2, tree)


def _labels(tree: Any) -> Any:
    return opttx.tree.tree_map(lambda x: "matrix" if x.ndim >= 2 else "vector", tree)


def _is_2d(tree: Any) -> Any:
    return opttx.tree.tree_map(lambda x: x.ndim == 2, tree)


def _qk_roles(tree: Any) -> Any:
    """w (6 rows) as a fused QKV of 2 heads of 1 row (GQA: 2 key heads), v as 2 query heads."""
    return {k: opttx.QKWeight("attn", "qkv", 2) if k == "w" else
            opttx.QKWeight("attn", "q", 2) if k == "v" else None for k in tree}


def _with_logits(tx: opttx.GradientTransformation) -> opttx.GradientTransformation:
    """``tx`` given the per-head maximum logits of a step in ``extra_args`` (head 0 above the
    threshold 100, head 1 below)."""
    def update(updates, state, params=None, **extra_args):
        logits = {"attn": torch.tensor([150.0, 50.0])}
        return tx.update(updates, state, params, **{**extra_args,
                                                    "max_attention_logits": logits})
    return opttx.GradientTransformation(tx.init, update, tx.traits)


def _ademamix_alpha_warmup(count: Any) -> Any:
    """AdEMAMix's linear warm-up of alpha to 2.0 over 4 steps (the paper's, 1-based)."""
    return ((count + 1).double() * 0.5).clamp(max=2.0)


def _ademamix_b3_warmup(count: Any) -> Any:
    """AdEMAMix's warm-up of b3 from b1 = 0.9 to 0.99 over 4 steps (the paper's, 1-based)."""
    ln1, ln3 = -0.10536051565782628, -0.01005033585350145    # ln 0.9, ln 0.99
    frac = ((count + 1).double() / 4).clamp(max=1.0)
    return (ln1 * ln3 / ((1 - frac) * ln3 + frac * ln1)).exp().clamp(max=0.99)


@functools.cache
def guide() -> dict[str, Any]:
    """The namespace of docs/guide/writing.md's examples, executed as written: its
    transforms are registry entries like opttx's own."""
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide" / "writing.md"
    module = types.ModuleType("writing_guide")      # a real module: Dynamo looks functions'
    sys.modules[module.__name__] = module           # globals up by module name
    text = page.read_text().split("## What to check before you use it")[0]   # the examples
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
        exec(compile(block, f"docs/guide/writing.md[block {i}]", "exec"), module.__dict__)
    return module.__dict__


_VMAP_COND = "data-dependent control flow on per-slice values (vmap refuses it)"


@opttx.extend.declare(hyperparams={"learning_rate": opttx.extend.HyperRole.LEARNING_RATE,
                                   "decay": opttx.extend.HyperRole.MOMENTUM})
def declared_momentum(learning_rate: float, decay: float = 0.9,
                      nesterov: bool = False) -> opttx.GradientTransformation:
    """A user's factory declared with `opttx.extend.declare` (hyperparameters and their roles)."""
    return opttx.chain(opttx.trace(decay, nesterov), opttx.scale_by_learning_rate(learning_rate))


_STATE_FORMATS = ("4bit", "e4m3", "e5m2", "bf16_ecc", "bf16_sr")   # "8bit": adamw_8bit


def _stored(inner: opttx.GradientTransformation, fmt: str) -> opttx.GradientTransformation:
    """``inner`` under `quantize_state` in format ``fmt``: every leaf of the cases but the
    5-element vector compressed, in several blocks of 8 where the format has blocks."""
    blocks = {} if fmt.startswith("bf16") else {"block_size": 8}
    return opttx.quantize_state(inner, format=fmt, min_size=8, **blocks)


def _adamw_stored(fmt: str) -> opttx.GradientTransformation:
    return opttx.chain(_stored(opttx.scale_by_adam(), fmt), opttx.add_decayed_weights(0.1),
                       opttx.scale_by_learning_rate(LR))


def _came_stored(fmt: str) -> opttx.GradientTransformation:
    """CAME's factored chain: its first moment (and the second moment of unfactored leaves)
    compressed; the row and column statistics are not shaped like the leaf and stay fp32."""
    return opttx.chain(_stored(opttx.scale_by_came(min_dim_size_to_factor=2), fmt),
                       opttx.add_decayed_weights(0.01), opttx.scale_by_learning_rate(1e-3))


CASES: list[Case] = [
    # --- aliases --------------------------------------------------------------------------
    case("sgd", opttx.sgd, learning_rate=LR, momentum=0.9, nesterov=True),
    # the hyperparameters are not exact in float32 (0.95, 0.9999, 3e-4, 1e-8): an Optimizer
    # that computed with rounded ones (1 - float32(0.9999) = 1.000166e-4) fails the donation
    # property, which compares it bit for bit with the functional path
    case("adam", opttx.adam, learning_rate=3e-4, b2=0.9999, eps=1e-8),
    case("adamw", opttx.adamw, learning_rate=3e-4, b1=0.9, b2=0.95, weight_decay=0.1),
    # a mask function written as the docs write it: a dict comprehension over the leaves
    case("adamw/mask_function", opttx.adamw, learning_rate=LR, weight_decay=0.1,
         mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    case("nadam", opttx.nadam, learning_rate=LR, momentum_decay=4e-3),
    case("rmsprop", opttx.rmsprop, learning_rate=LR, decay=0.9999, centered=True,
         momentum=0.9),
    case("adagrad", opttx.adagrad, learning_rate=LR),
    case("lion", opttx.lion, learning_rate=1e-3, weight_decay=0.1),
    case("adafactor", opttx.adafactor, learning_rate=LR, min_dim_size_to_factor=2,
         momentum=0.9, weight_decay_rate=0.01),
    case("came", opttx.came, learning_rate=1e-3, min_dim_size_to_factor=2, weight_decay=0.01),
    case("lamb", opttx.lamb, learning_rate=LR, weight_decay=0.01),
    case("lars", opttx.lars, learning_rate=0.1, weight_decay=1e-4),
    case("adalomo", opttx.adalomo, learning_rate=LR, weight_decay=0.01),
    case("shampoo", opttx.shampoo, learning_rate=LR, max_preconditioner_dim=4,
         stacked=_VMAP_COND),
    # the roots by Meta's coupled higher-order iteration: a data-dependent loop
    # (torch.while_loop when compiled)
    case("shampoo/higher_order", opttx.shampoo, learning_rate=LR, max_preconditioner_dim=4,
         root_method="higher_order", root_rel_epsilon=1e-5, stacked=_VMAP_COND),
    # eigendecompositions cached instead of roots, refreshed by Meta's QR algorithm
    case("shampoo/eigendecomposed", opttx.shampoo, learning_rate=LR, max_preconditioner_dim=4,
         preconditioner="eigendecomposed", eigendecomposition="qr", epsilon=1e-3,
         stacked=_VMAP_COND),
    # factors and roots as packed upper triangles (1-D state leaves)
    case("shampoo/packed", opttx.shampoo, learning_rate=LR, max_preconditioner_dim=4,
         use_symmetric_packing=True, stacked=_VMAP_COND),
    # KL-Shampoo: the factors take in the gradient preconditioned by the other dims' roots
    case("shampoo/kl", opttx.shampoo, learning_rate=LR, max_preconditioner_dim=4,
         kl_shampoo=True, stacked=_VMAP_COND),
    # a large epsilon: the factors of a few steps are rank-deficient, their null-space basis
    # is eigh's choice (another one when batched under stacked), and the rounding noise of
    # the gradient along it is divided by sqrt(nu) + epsilon
    case("shampoo/eigenvalue_corrected", opttx.shampoo, learning_rate=LR,
         max_preconditioner_dim=4, preconditioner="eigenvalue_corrected", epsilon=1.0),
    # the filtered gradient kept rotated into the eigenbasis, carried to new bases at refreshes
    case("shampoo/eigenvalue_corrected/eigenbasis_moment", opttx.shampoo, learning_rate=LR,
         max_preconditioner_dim=4, preconditioner="eigenvalue_corrected", epsilon=1.0,
         precondition_frequency=2, grafting="adam", first_moment_in_eigenbasis=True),
    case("soap", opttx.soap, learning_rate=LR, precondition_frequency=2),
    case("galore_adamw", opttx.galore_adamw, learning_rate=LR, rank=2, update_proj_gap=2),
    case("galore_adamw_8bit", opttx.galore_adamw_8bit, learning_rate=LR, rank=2,
         update_proj_gap=2, min_size=8, block_size=8),
    case("adamw_8bit", opttx.adamw_8bit, learning_rate=LR, min_size=8, block_size=8),
    case("radam", opttx.radam, learning_rate=LR, weight_decay=0.01,
         decoupled_weight_decay=True),
    case("adamax", opttx.adamax, learning_rate=LR),
    case("adam/amsgrad", opttx.adam, learning_rate=LR, amsgrad=True),
    case("adabelief", opttx.adabelief, learning_rate=LR),
    case("muon", opttx.muon, learning_rate=LR, weight_decay=0.01, consistent_rms=0.2),
    built("muon/3d", lambda: opttx.muon(LR, muon_mask=_is_matrix, bias_correction=False)),
    case("adamw/amsgrad", opttx.adamw, learning_rate=LR, weight_decay=0.1, amsgrad=True),
    case("sgd/dampening", opttx.sgd, learning_rate=LR, momentum=0.9, dampening=0.1),
    case("radam/torch", opttx.radam, learning_rate=LR, weight_decay=0.01,
         eps_before_debias=True),
    case("schedule_free_adamw", opttx.schedule_free_adamw, learning_rate=LR, warmup_steps=2,
         weight_decay=0.01),
    case("schedule_free_sgd", opttx.schedule_free_sgd, learning_rate=0.1, warmup_steps=2,
         weight_decay=0.01, r=0.5),
    case("mars", opttx.mars, learning_rate=LR, weight_decay=0.01, weight_decay_1d=0.01),
    case("mars/lion", opttx.mars, learning_rate=1e-3, optimizer="lion", optimize_1d=True),
    case("prodigy", opttx.prodigy, learning_rate=1.0, weight_decay=0.01, estim_lr0=1e-3),
    case("muon/momentum_8bit", opttx.muon, learning_rate=LR, muon_mask=_is_2d,
         momentum_8bit=True),
    built("muon/polar_express_split", lambda: opttx.muon(
        LR, method="polar_express", muon_mask=_is_2d, split=lambda p: opttx.tree.tree_map(
            lambda x: 2 if x.shape[-2] % 2 == 0 else None, p))),
    case("normuon", opttx.normuon, learning_rate=LR, weight_decay=0.01),
    case("normuon/nesterov_rms", opttx.normuon, learning_rate=LR, nesterov=True,
         adjust_lr="rms_norm", method="gram_newton_schulz"),
    case("adamuon", opttx.adamuon, learning_rate=LR, weight_decay=0.01),
    case("adamuon/sign", opttx.adamuon, learning_rate=LR, sign=True, consistent_rms=None),
    # fractions that decide shapes are given as Fraction, which inject_hyperparams keeps static
    case("dion", opttx.dion, learning_rate=LR, rank_fraction=Fraction(1, 2),
         weight_decay=0.01),
    case("dion/power_iters", opttx.dion, learning_rate=LR, rank_fraction=Fraction(1),
         power_iters=2),
    case("dion2", opttx.dion2, learning_rate=LR, fraction=Fraction(1, 2), weight_decay=0.01),
    built("muon_clip", lambda: _with_logits(opttx.muon_clip(LR, _qk_roles,
                                                            muon_mask=_is_2d))),
    # blocks (2, 2): the conformance specs' shards (rows of w and t, columns of v) hold whole
    # blocks of this grid, so sharded runs it too
    case("muon_bp", opttx.muon_bp, learning_rate=LR, full_every=2, blocks=(2, 2),
         block_scale=0.5, weight_decay=0.01),
    case("kron", opttx.kron, learning_rate=LR, weight_decay=0.01, max_size_triangular=5,
         memory_save_mode="smart_one_diag"),
    # --- transforms -----------------------------------------------------------------------
    case("scale_by_adam", opttx.scale_by_adam, b1=0.8, b2=0.99),
    case("adopt", opttx.adopt, learning_rate=LR, weight_decay=0.01, nesterov=True),
    case("ademamix", opttx.ademamix, learning_rate=LR, b3=0.99, weight_decay=0.01),
    case("scale_by_adam/nesterov", opttx.scale_by_adam, b1=0.9, nesterov=True),
    case("scale_by_nadam", opttx.scale_by_nadam, b1=0.9, momentum_decay=4e-3),
    case("scale_by_radam", opttx.scale_by_radam, threshold=2.0),
    case("scale_by_adamax", opttx.scale_by_adamax, b1=0.8),
    case("scale_by_belief", opttx.scale_by_belief, eps=1e-8),
    case("orthogonalize", opttx.orthogonalize, ns_steps=5, matrices_only=True),
    built("orthogonalize/svd", lambda: opttx.orthogonalize(method="svd"), matrices_only=True,
          nonfinite="raises"),
    case("scale_by_shape", opttx.scale_by_shape, consistent_rms=0.2, matrices_only=True),
    case("orthogonalize/polar_express", opttx.orthogonalize, method="polar_express",
         matrices_only=True),
    # split given as a function of the params: built, since inject_hyperparams would take a
    # function of one argument named split for a schedule
    built("orthogonalize/gram_split", lambda: opttx.orthogonalize(
        method="gram_newton_schulz", split=lambda p: opttx.tree.tree_map(
            lambda x: (2, x.shape[-2] - 2) if x.ndim == 2 and x.shape[-2] > 2 else None, p)),
        matrices_only=True),
    case("orthogonalize_block_periodic", opttx.orthogonalize_block_periodic, full_every=2,
         blocks=(2, 2), block_scale=0.5, matrices_only=True,
         covers=("OrthogonalizeBlockPeriodicState",)),
    # row- and column-sharded leaves orthogonalized on their shards, the Gram matrix all-reduced
    case("orthogonalize/gram_sharded", opttx.orthogonalize, sharded_mode="gram",
         matrices_only=True),
    built("muon/gram_sharded", lambda: opttx.muon(LR, method="gram_newton_schulz",
                                                  muon_mask=_is_matrix, sharded_mode="gram")),
    built("normuon/gram_sharded", lambda: opttx.normuon(LR, muon_mask=_is_matrix,
                                                        sharded_mode="gram")),
    built("adamuon/gram_sharded", lambda: opttx.adamuon(LR, muon_mask=_is_matrix,
                                                        sharded_mode="gram")),
    case("scale_by_neuron_rms", opttx.scale_by_neuron_rms, b2=0.9, matrices_only=True),
    case("scale_to_orthogonal_norm", opttx.scale_to_orthogonal_norm, matrices_only=True),
    built("scale_by_dion", lambda: opttx.masked(opttx.scale_by_dion(0.5), _is_2d)),
    case("scale_by_dion2", opttx.scale_by_dion2, fraction=Fraction(1, 2), matrices_only=True),
    built("clip_qk", lambda: _with_logits(opttx.clip_qk(_qk_roles, threshold=100.0)),
          covers=("QKWeight",)),
    case("scale_by_kron", opttx.scale_by_kron, preconditioner_update_probability=0.5,
         balance_every=2),
    case("scale_by_mars", opttx.scale_by_mars, gamma=0.025, b1=0.9, max_norm=0.3),
    case("scale_by_prodigy", opttx.scale_by_prodigy, estim_lr0=1e-3, growth_rate=2.0),
    built("cautious", lambda: opttx.cautious(opttx.adamw(LR, weight_decay=0.01))),
    built("cautious/gradient", lambda: opttx.chain(
        opttx.cautious(opttx.scale_by_lion(), "gradient", min_fraction=1e-3),
        opttx.add_decayed_weights(0.1), opttx.scale_by_learning_rate(1e-3))),
    built("schedule_free", lambda: opttx.schedule_free(opttx.adam(LR, b1=0.0), LR, b1=0.9,
                                                       warmup_steps=2)),
    built("lookahead", lambda: opttx.lookahead(opttx.adam(LR), 2, alpha=0.5)),
    built("lookahead/reset_state", lambda: opttx.lookahead(opttx.sgd(LR, momentum=0.9), 3,
                                                           alpha=0.6, reset_state=True)),
    case("scale_by_lion", opttx.scale_by_lion, b1=0.9, b2=0.99),
    case("scale_by_adopt", opttx.scale_by_adopt, b1=0.8, use_clipping=False),
    case("scale_by_ademamix", opttx.scale_by_ademamix, b3=0.99, alpha=2.0),
    case("scale_by_ademamix/warmup", opttx.scale_by_ademamix, b3=_ademamix_b3_warmup,
         alpha=_ademamix_alpha_warmup, eps_root=1e-12),
    case("scale_by_rms", opttx.scale_by_rms, decay=0.999),
    case("scale_by_rss", opttx.scale_by_rss, initial_accumulator_value=0.1),
    case("scale_by_stddev", opttx.scale_by_stddev, decay=0.95),
    case("ema", opttx.ema, decay=0.9),
    case("trace", opttx.trace, decay=0.9, nesterov=True),
    case("trace/dampening", opttx.trace, decay=0.9, dampening=0.1),
    case("ema/nesterov", opttx.ema, decay=0.9, nesterov=True),
    case("scale_by_adam/amsgrad", opttx.scale_by_adam, b1=0.9, amsgrad=True),
    case("scale", opttx.scale, step_size=-0.3),
    case("scale_by_learning_rate", opttx.scale_by_learning_rate, learning_rate=LR),
    built("scale_by_schedule", lambda: opttx.scale_by_schedule(
        opttx.warmup_cosine_decay_schedule(0.0, 1.0, 2, 10))),
    built("scale_by_sign", opttx.scale_by_sign),
    case("add_decayed_weights", opttx.add_decayed_weights, weight_decay=0.1),
    case("add_decayed_weights/cautious", opttx.add_decayed_weights, weight_decay=0.1,
         cautious=True),
    case("adamw/cautious_weight_decay", opttx.adamw, learning_rate=LR, weight_decay=0.1,
         cautious_weight_decay=True),
    case("hyperball_step", opttx.hyperball_step, learning_rate=0.05),
    case("hyperball_step/radius", opttx.hyperball_step, learning_rate=0.05, radius=2.0),
    built("hyperball", lambda: opttx.hyperball(opttx.scale_by_adam(), 0.05)),
    case("hyperball_muon", opttx.hyperball_muon, learning_rate=0.05, adam_learning_rate=LR),
    case("hyperball_adamw", opttx.hyperball_adamw, learning_rate=0.05, adam_learning_rate=LR),
    case("hyperball_normuon", opttx.hyperball_normuon, learning_rate=0.05,
         adam_learning_rate=LR),
    case("hyperball_soap", opttx.hyperball_soap, learning_rate=0.05, precondition_frequency=2,
         adam_learning_rate=LR),
    case("clip", opttx.clip, max_delta=0.3),
    case("clip_by_block_rms", opttx.clip_by_block_rms, threshold=0.3),
    case("clip_by_global_norm", opttx.clip_by_global_norm, max_norm=0.3),
    built("zero_nans", opttx.zero_nans,      # its per-leaf flags: Role.PER_LEAF_SCALAR
          nonfinite="zeroes"),
    case("scale_by_factored_rms", opttx.scale_by_factored_rms, min_dim_size_to_factor=2),
    case("scale_by_came", opttx.scale_by_came, min_dim_size_to_factor=2),
    case("clip_by_rms", opttx.clip_by_rms, threshold=1.0),
    built("clip_by_rms_and_scale_by_param_rms", opttx.clip_by_rms_and_scale_by_param_rms),
    built("scale_by_param_block_rms", opttx.scale_by_param_block_rms),
    built("scale_by_trust_ratio", opttx.scale_by_trust_ratio),
    case("add_step_scaled_decayed_weights", opttx.add_step_scaled_decayed_weights,
         weight_decay=0.1, learning_rate=LR),
    built("precondition_shampoo", lambda: opttx.precondition_shampoo(epsilon=1e-6),
          stacked=_VMAP_COND),
    built("block_by_dims", lambda: opttx.block_by_dims(opttx.precondition_shampoo(
        epsilon=1e-6), 4), stacked=_VMAP_COND),
    built("graft", lambda: opttx.graft(opttx.scale_by_rms(), opttx.precondition_shampoo(
        epsilon=1e-6), beta1=0.9), stacked=_VMAP_COND),
    built("scale_by_grafted_diagonal", opttx.scale_by_grafted_diagonal),
    built("precondition_eigenvalue_corrected", lambda: opttx.precondition_eigenvalue_corrected(
        epsilon=1e-6, precondition_frequency=2)),
    built("precondition_eigenvalue_corrected/qr", lambda: opttx.block_by_dims(
        opttx.precondition_eigenvalue_corrected(epsilon=1.0, eigendecomposition="qr",
                                                qr_iterations=2, tolerance=0.01), 4)),
    built("project_lowrank", lambda: opttx.project_lowrank(opttx.scale_by_adam(), rank=2,
                                                           update_proj_gap=2)),
    built("quantize_state", lambda: opttx.quantize_state(opttx.scale_by_adam(), min_size=8,
                                                         block_size=8)),
    case("adamw_4bit", opttx.adamw_4bit, learning_rate=LR, min_size=8, block_size=8),
    built("quantize_state/came_8bit", lambda: _came_stored("8bit")),
    *[built(f"quantize_state/adamw_{fmt}", functools.partial(_adamw_stored, fmt))
      for fmt in _STATE_FORMATS],
    *[built(f"quantize_state/came_{fmt}", functools.partial(_came_stored, fmt))
      for fmt in _STATE_FORMATS],
    # --- combinators and wrappers ---------------------------------------------------------
    built("identity", opttx.identity),
    built("set_to_zero", opttx.set_to_zero, nonfinite="ignores"),
    built("stateless", lambda: opttx.stateless(
        lambda u, p: opttx.tree.tree_map(lambda x: 2 * x, u))),
    built("stateless_with_tree_map", lambda: opttx.stateless_with_tree_map(
        lambda u, p: -u)),
    built("chain", lambda: opttx.chain(opttx.clip(1.0), opttx.scale_by_adam(),
                                       opttx.scale(-LR))),
    built("named_chain", lambda: opttx.named_chain(("adam", opttx.scale_by_adam()),
                                                   ("lr", opttx.scale(-LR)))),
    built("masked", lambda: opttx.masked(opttx.adam(LR), _is_matrix)),
    built("freeze", lambda: opttx.freeze(_is_matrix), nonfinite="ignores"),
    built("partition", lambda: opttx.partition({"matrix": opttx.adafactor(
        LR, min_dim_size_to_factor=2), "vector": opttx.adamw(LR)}, _labels)),
    built("multi_transform", lambda: opttx.multi_transform(
        {"matrix": opttx.sgd(LR), "vector": opttx.adam(LR)}, _labels)),
    built("inject_hyperparams", lambda: opttx.inject_hyperparams(opttx.adamw)(
        learning_rate=opttx.linear_schedule(LR, LR / 10, 5), weight_decay=0.1)),
    built("apply_if_finite", lambda: opttx.apply_if_finite(opttx.adam(LR), 3),
          nonfinite="skips"),
    built("apply_if_finite/check_state", lambda: opttx.apply_if_finite(
        opttx.adam(LR), 3, check_state=True), nonfinite="skips"),
    built("MultiSteps", lambda: opttx.MultiSteps(opttx.adam(LR), 2).gradient_transformation(),
          nonfinite="at_boundary"),
    built("flatten", lambda: opttx.flatten(opttx.adamw(LR, weight_decay=0.1))),
    case("ema_params", opttx.ema_params, inner=opttx.adamw(LR, weight_decay=0.1), decay=0.9,
         warmup=True, update_after_step=1, min_decay=0.2),
    case("ema_params/every", opttx.ema_params, inner=opttx.sgd(LR, momentum=0.9), decay=0.8,
         every=2, offload=True),
    # declarations: a user's declared factory, and a built chain with its hyperparameters
    # injected from the declarations
    case("declare", declared_momentum, learning_rate=LR, decay=0.8, nesterov=True),
    built("inject_all_hyperparams", lambda: opttx.inject_all_hyperparams(opttx.chain(
        opttx.clip_by_global_norm(1.0), opttx.adamw(LR, weight_decay=0.1)))),
    built("stacked", lambda: opttx.stacked(opttx.adam(LR)),
          stacked="already stacked", distributed="needs stacked leaves, not a plain tree"),
    # --- the worked examples of "Writing a transform" -------------------------------------
    Case("guide/scale_by_sign_momentum", lambda: guide()["scale_by_sign_momentum"](0.9),
         guide()["scale_by_sign_momentum"], {"b": 0.9}),
    Case("guide/scale_to_global_rms", lambda: guide()["scale_to_global_rms"](2.0),
         guide()["scale_to_global_rms"], {"rms": 2.0}, covers=("stateless_with_extra_args",)),
    Case("guide/scale_by_adan", lambda: guide()["scale_by_adan"](b1=0.9),
         guide()["scale_by_adan"], {"b1": 0.9}),
    # KL-SOAP: Meta's KL-Shampoo factor update in the eigenvalue-corrected form (a large
    # epsilon, as the eigenvalue-corrected case above)
    case("shampoo/kl_soap", opttx.shampoo, learning_rate=LR, max_preconditioner_dim=4,
         preconditioner="eigenvalue_corrected", kl_shampoo=True, epsilon=1.0,
         precondition_frequency=2),
    built("precondition_eigenvalue_corrected/kl", lambda: opttx.block_by_dims(
        opttx.precondition_eigenvalue_corrected(epsilon=1.0, precondition_frequency=2,
                                                kl_shampoo=True), 4)),
]

BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "registry names must be unique"
