"""Which transforms `opttx.distributed.offload` can run chunk by chunk, read from their
declared `opttx.extend.Traits` (`check_offloadable`), and the declared wrappers that run around the
chunks instead (`peel_wrappers`, `inside_wrappers`: ``offload(apply_if_finite(adamw(...),
5))`` runs as ``apply_if_finite(offload(adamw(...)), 5)``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..base import GradientTransformation, Params, State, Updates, traits_of
from ..combine import chain_links

__all__ = ["check_offloadable", "chunkable", "inside_wrappers", "peel_wrappers",
           "why_not_chunkable"]


def chunkable(traits: Any, layout: str) -> bool:
    """Whether a transform of these `opttx.extend.Traits` runs chunk by chunk in ``layout``: with
    ``"flat"`` element-wise, with ``"leaves"`` leaf by leaf; never across leaves."""
    if layout == "flat":
        return traits.elementwise and not traits.across_leaves
    return traits.per_leaf and not traits.across_leaves


def check_offloadable(tx: GradientTransformation, layout: str = "leaves") -> int:
    """Refuse, with the reason, a transform that cannot run chunk by chunk; return the number
    of leading links of a `opttx.chain` that run on the device over every leaf first.

    Read from the declared `opttx.extend.Traits`: with ``layout="leaves"`` every link must be
    ``per_leaf`` (each leaf's output from that leaf alone: element-wise chains, Adafactor's
    and CAME's factored moments, LAMB's trust ratios, 8-bit states, Shampoo's blocks) and
    not ``across_leaves``; with ``layout="flat"`` ``elementwise``. Links at the head of a
    chain that do not qualify (a statistic across leaves, or undeclared) are allowed when
    they keep no state (checked at ``init``): they run before the chunks, on every leaf.

    Raises:
      ValueError: naming the link and the trait that keeps it from running by chunks.
    """
    if layout not in ("leaves", "flat"):
        raise ValueError(f"offload: layout must be 'leaves' or 'flat', got {layout!r}.")
    links = chain_links(tx) or (tx,)
    head = 0                  # links that do not work leaf by leaf, run first if stateless
    while head < len(links) and not chunkable(traits_of(links[head]), "leaves"):
        head += 1
    for j in range(head, len(links)):
        t = traits_of(links[j])
        if not chunkable(t, layout):
            what = f"link {j} of the chain" if chain_links(tx) else "the transform"
            raise ValueError(f"offload: {what} cannot run chunk by chunk: "
                             f"{why_not_chunkable(t, layout)}.")
    return head


def peel_wrappers(tx: GradientTransformation, layout: str = "leaves"
                  ) -> tuple[list[tuple[Any, str]], GradientTransformation]:
    """``(wrappers, core)``: ``tx`` as declared wrappers around a transform that runs chunk by
    chunk. A transform that cannot run by chunks but wraps another on the whole updates,
    keeping its state whole (`opttx.extend.declare`'s ``wraps``: `opttx.apply_if_finite`,
    `opttx.multi_steps`), is peeled off, outermost first, as ``(recipe, argument)``; the
    offloaded run of ``core`` then goes inside it (`inside_wrappers`), so
    ``offload(apply_if_finite(adamw(...), 5))`` is ``apply_if_finite(offload(adamw(...)),
    5)`` with the same state.

    Raises:
      ValueError: `check_offloadable`'s, for ``core``.
    """
    wrappers: list[tuple[Any, str]] = []
    core = tx
    while not chunkable(traits_of(core), layout):
        recipe = getattr(core, "recipe", None)
        name = recipe.declaration.wraps if recipe is not None else None
        if name is None or not isinstance(recipe.arguments.get(name), GradientTransformation):
            break
        wrappers.append((recipe, name))
        core = recipe.arguments[name]
    check_offloadable(core, layout)
    return wrappers, core


def inside_wrappers(wrappers: list[tuple[Any, str]], core: GradientTransformation,
                    engine_of: Callable[[], Any], adopt: list[bool]
                    ) -> GradientTransformation:
    """The offloaded run of ``core`` (by ``engine_of()``, an
    `opttx.distributed.offload_engine.Offloader`) as a transform with ``core``'s
    traits and recipe (so the wrappers' identities, and their states' ``made_by``, are those
    without offload), inside the ``wrappers`` of `peel_wrappers`, rebuilt around it. A
    restored state (``adopt[0]``) is adopted by the engine at its first run."""
    def init(params: Params) -> State:
        return engine_of().init(params)

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        engine = engine_of()
        if adopt[0]:
            state = engine.adopt(state)
            adopt[0] = False
        return engine.update(updates, state, params, extra_args)

    # the engine runs the links itself and applies every scale (no deferred final scale)
    traits = dataclasses.replace(traits_of(core), final_scale=False)
    tx = GradientTransformation(init, update, traits, core.recipe)
    for recipe, name in reversed(wrappers):
        tx = recipe.rebuild(**{name: tx})
    return tx


def why_not_chunkable(t: Any, layout: str) -> str:
    """The reason, for an error message, why a transform of traits ``t`` cannot run chunk by
    chunk in ``layout``."""
    if t.across_leaves:
        return ("its traits say it takes a statistic across leaves (Traits.across_leaves: a "
                "global norm, a finiteness test, Prodigy's estimate), so no chunk could be "
                "updated before every gradient is in. A stateless one may lead the chain "
                "(chain(clip_by_global_norm(1.0), adamw(...)): it runs on the device first), "
                "and a wrapper declared to call its inner transform on the whole updates runs "
                "around the chunks (offload(apply_if_finite(adamw(...), 5)) runs as "
                "apply_if_finite(offload(adamw(...)), 5)); wrap other stateful ones around the "
                "offloaded transform")
    if layout == "flat" and t.per_leaf:
        return ("layout='flat' needs an element-wise chain (Traits.elementwise) and this one "
                "takes statistics of whole leaves (factored moments, norms, blocks); use "
                "layout='leaves'")
    if t.whole_leaves:
        return ("its traits say it needs whole tensors but not that it works leaf by leaf "
                "(Traits.whole_leaves without Traits.per_leaf)")
    return ("its traits do not say it works leaf by leaf (Traits.per_leaf), so running it on "
            "a part of the leaves could change its numbers; declare the traits of a "
            "transform of your own (opttx.extend.LEAFWISE or opttx.extend.ELEMENTWISE) if "
            "they hold")
