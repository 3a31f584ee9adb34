"""Combinators: `chain`, `named_chain`, `partition` (`multi_transform`), `masked`, `freeze`."""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, NamedTuple

from .base import (DEFERRED_SCALE, GradientTransformation, Params, State, Traits, Updates,
                   check_state_type, combine_traits, declare, declare_roles, set_to_zero,
                   step_local_transforms, traits_of)
from .tree import (MaskedNode, PyTree, Static, flatten_matching, leaf_labels, mask_leaves,
                   tree_flatten, tree_leaves, tree_structure, tree_unflatten)

__all__ = [
    "MaskedState",
    "PartitionState",
    "chain",
    "chain_links",
    "freeze",
    "masked",
    "multi_transform",
    "named_chain",
    "partition",
]


@declare()
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms one after another; the state is the tuple of their states.

    ``extra_args`` given to ``update`` reach every link.

    Example:
      >>> tx = opttx.chain(opttx.clip_by_global_norm(1.0), opttx.scale_by_adam(),
      ...                  opttx.scale_by_learning_rate(1e-3))
    """
    for i, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain argument {i} is a {type(tx).__name__}, not a "
                            "GradientTransformation (did you forget to call the factory?).")

    def init(params: Params) -> tuple:
        return tuple(tx.init(params) for tx in transforms)

    def update(updates: Updates, state: tuple, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, tuple]:
        check_state_type(state, tuple, f"chain of {len(transforms)} transforms",
                         "the tuple its init returns (state = tx.init(params))")
        if len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transforms got a state of "
                             f"{len(state)} entries; was it built by this chain's init?")
        # only the last link may leave its final scale to the caller (Traits.final_scale)
        inner_args = {k: v for k, v in extra_args.items() if k != DEFERRED_SCALE}
        new_state = []
        for i, (tx, s) in enumerate(zip(transforms, state)):
            last = i == len(transforms) - 1
            updates, s = tx.update(updates, s, params, **(extra_args if last else inner_args))
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update, _sequence_traits(transforms))


def _sequence_traits(transforms: tuple[GradientTransformation, ...]) -> Traits:
    """The traits of links run in order: `combine_traits`, with `Traits.final_scale` from the
    last link (a chain ends with its last link's scale)."""
    return combine_traits(transforms, final_scale=bool(
        transforms and traits_of(transforms[-1]).final_scale))


def chain_links(tx: GradientTransformation) -> tuple[GradientTransformation, ...]:
    """The transforms of a `chain`, in order, as its recipe records them; ``()`` for any
    other transform (a chain's state is the tuple of its links' states, so machinery that runs
    the links one by one, as `opttx.distributed.offload` does, may split it the same way).

    Example:
      >>> opttx.chain_links(opttx.chain(opttx.clip(1.0), opttx.adamw(1e-3)))  # two links
    """
    recipe = tx.recipe
    if recipe is None or recipe.factory is not chain:
        return ()
    return tuple(recipe.arguments["transforms"])


@declare()
def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """`chain` whose state is a dict keyed by the given names (easier to inspect and edit).

    Example:
      >>> tx = opttx.named_chain(("clip", opttx.clip_by_global_norm(1.0)),
      ...                        ("adam", opttx.adam(1e-3)))
      >>> state = tx.init(params); state["adam"]
    """
    names = [name for name, _ in transforms]
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain names must be unique, got {names}.")

    def init(params: Params) -> dict[str, State]:
        return {name: tx.init(params) for name, tx in transforms}

    def update(updates: Updates, state: dict[str, State], params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, dict[str, State]]:
        inner_args = {k: v for k, v in extra_args.items() if k != DEFERRED_SCALE}
        new_state = {}
        for i, (name, tx) in enumerate(transforms):
            args = extra_args if i == len(transforms) - 1 else inner_args
            updates, new_state[name] = tx.update(updates, state[name], params, **args)
        return updates, new_state

    return GradientTransformation(init, update, _sequence_traits(tuple(tx for _, tx in transforms)))


# ---------------------------------------------------------------------------------------------
# masking
# ---------------------------------------------------------------------------------------------


class MaskedState(NamedTuple):
    """State of `masked`."""
    inner_state: State  # the inner transform's state over the masked-in leaves only
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles()


def _mask_tree(tree: PyTree, keep: list[bool]) -> PyTree:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([x if k else MaskedNode() for x, k in zip(leaves, keep)], spec)


# which leaves a mask selects is not part of the state's identity: it follows the tree (a
# partition's masks are computed from it, with MaskedNode where a rank holds no leaf), and
# the state's structure carries it
@declare(runtime=("mask",))
def masked(inner: GradientTransformation,
           mask: PyTree | Callable[[Params], PyTree]) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; pass the others through unchanged.

    The inner transform sees a tree where masked-out leaves are `MaskedNode` placeholders, so
    it holds no state for them.

    Args:
      inner: the transform to apply.
      mask: a tree of Python booleans like the params (or a prefix of it), or a function of
        the params (of the updates when no params are given) returning one.

    Example:
      >>> decay_matrices = lambda p: {k: v.ndim >= 2 for k, v in p.items()}
      >>> tx = opttx.masked(opttx.add_decayed_weights(0.1), decay_matrices)
    """

    def keep_of(tree: PyTree) -> list[bool]:
        return mask_leaves(mask, tree)

    def init(params: Params) -> MaskedState:
        return MaskedState(inner_state=inner.init(_mask_tree(params, keep_of(params))))

    def update(updates: Updates, state: MaskedState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, MaskedState]:
        check_state_type(state, MaskedState, "masked")
        keep = keep_of(params if params is not None else updates)
        spec, leaves = flatten_matching(updates)
        masked_params = None if params is None else _mask_tree(params, keep)
        new, inner_state = inner.update(_mask_tree(updates, keep), state.inner_state,
                                        masked_params, **extra_args)
        new_leaves = iter(tree_leaves(new))
        out = [next(new_leaves) if k else x for x, k in zip(leaves, keep)]
        return tree_unflatten(out, spec), MaskedState(inner_state=inner_state,
                                                      made_by=state.made_by)

    return GradientTransformation(init, update, combine_traits((inner,)))


@declare(runtime=("mask",))
def freeze(mask: PyTree | Callable[[Params], PyTree]) -> GradientTransformation:
    """Zero the updates of the leaves where ``mask`` is True (those parameters do not move).

    Example:
      >>> tx = opttx.chain(opttx.freeze(lambda p: {k: k.startswith("embed") for k in p}),
      ...                  opttx.adam(1e-3))
    """
    return masked(set_to_zero(), mask)


# ---------------------------------------------------------------------------------------------
# partition
# ---------------------------------------------------------------------------------------------


class PartitionState(NamedTuple):
    """State of `partition`."""
    inner_states: dict  # label -> MaskedState of that label's transform
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles()


@declare(runtime=("param_labels",))
def partition(transforms: Mapping[Hashable, GradientTransformation],
              param_labels: PyTree | Callable[[Params], PyTree]) -> GradientTransformation:
    """Apply a different transform to each group of leaves, chosen by a label per leaf.

    Args:
      transforms: label -> transform.
      param_labels: a tree like the params holding one label per leaf, or a function of the
        params returning one. Every label must be a key of ``transforms``.

    Example:
      >>> labels = lambda p: {k: "decay" if v.ndim > 1 else "no_decay" for k, v in p.items()}
      >>> tx = opttx.partition({"decay": opttx.adamw(1e-3, weight_decay=0.1),
      ...                       "no_decay": opttx.adam(1e-3)}, labels)
    """
    transforms = dict(transforms)

    def labels_of(tree: PyTree) -> list[Hashable]:
        flat = leaf_labels(param_labels, tree, "param_labels")
        unknown = sorted({repr(l) for l in flat if l not in transforms})
        if unknown:
            raise ValueError(f"param_labels has labels {unknown} with no transform; "
                             f"transforms are given for {sorted(map(repr, transforms))}.")
        return flat

    def group_masks(tree: PyTree) -> dict[Hashable, PyTree]:
        labels = labels_of(tree)
        spec = tree_structure(tree)
        return {name: tree_unflatten([l == name for l in labels], spec) for name in transforms}

    def init(params: Params) -> PartitionState:
        masks = group_masks(params)
        return PartitionState(inner_states={
            name: masked(tx, masks[name]).init(params) for name, tx in transforms.items()})

    def update(updates: Updates, state: PartitionState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, PartitionState]:
        check_state_type(state, PartitionState, "partition")
        masks = group_masks(params if params is not None else updates)
        new_states = {}
        for name, tx in transforms.items():
            with step_local_transforms():
                label_tx = masked(tx, masks[name])
            updates, new_states[name] = label_tx.update(
                updates, state.inner_states[name], params, **extra_args)
        return updates, PartitionState(inner_states=new_states, made_by=state.made_by)

    return GradientTransformation(init, update, combine_traits(tuple(transforms.values())))


multi_transform = partition
"""optax's older name for `partition`: the same function."""
