"""Low-bit optimizer state for any per-leaf chain: `quantize_state` wraps a transform (Adam,
Lion, momentum, CAME, ...) and keeps the statistics its state declares as moments in one of
the compressed formats of `opttx.transforms.state_formats`: 8-bit block-wise codes (the
dynamic map of Dettmers et al.), packed 4-bit codes (Li et al.'s block-wise first moment and
rank-1 second moment), FP8 with block scales, or bfloat16 with an 8-bit error correction.

The inner transform runs leaf by leaf: each large leaf's state is decoded, updated and
encoded again before the next leaf is touched, so the fp32 state of all leaves is never live
at once (a step holds the compressed state plus the fp32 temporaries of one leaf). Leaves
under ``min_size`` elements keep the inner's fp32 state and run together in one grouped call.

Which parameter each part of the state belongs to is declared in the state (`LeafSlot`s in a
tree like the parameters), and every compressed statistic declares its own layout
(`StateLayout`): checkpoints, `opttx.stacked` and the distributed wrappers read them.

Pure torch: the maps, the quantizers (round to nearest on a map by a table lookup that gives
``torch.bucketize``'s codes, float8 casts, bit operations) and the dequantizers compile with the
rest of the step to one graph.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch

from ..base import (EmptyState, GradientTransformation, Params, Role, State, Updates,
                    check_init_params, combine_traits, declare, declare_roles,
                    replace_state, require_whole_leaves, state_roles)
from ..kernels import is_donating
from ..tree import (Static, flatten_matching, register_static_node, tree_flatten,
                    tree_unflatten)
from .state_formats import (FORMATS, STORED, CorrectedTensor, QuantizationMap,
                            QuantizedTensor, StateLayout, decode,
                            dequantize_blockwise, dynamic_map, encode, format_maps, layout_for,
                            linear_map, quantization_map, quantize_blockwise)

__all__ = [
    "CorrectedTensor",
    "LeafSlot",
    "QuantizationMap",
    "QuantizedState",
    "QuantizedTensor",
    "StateLayout",
    "dequantize_blockwise",
    "dynamic_map",
    "leaf_slots",
    "linear_map",
    "quantization_map",
    "quantize_blockwise",
    "quantize_state",
]


# ---------------------------------------------------------------------------------------------
# walking an inner state: which tensors are moments, and what their declared role is
# ---------------------------------------------------------------------------------------------


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


class StateField(NamedTuple):
    """Where a tensor sits in an inner state: the nearest enclosing NamedTuple field, its
    declared role (None: none), and whether that NamedTuple declares roles at all."""
    owner: str            # the NamedTuple's class name ("" above any NamedTuple)
    name: str             # the field's name ("" above any NamedTuple)
    role: Role | None     # its declared role, inherited by everything under the field
    declared: bool        # the owner has ``__roles__`` (False also above any NamedTuple)


_TOP = StateField(owner="", name="", role=None, declared=False)


def walk_state(fn: Callable[..., Any], node: Any, other: Any = None,
               where: StateField = _TOP, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Rebuild ``node`` (a state tree of NamedTuples, tuples, lists and dicts) with
    ``fn(leaf, other_leaf, where)`` at every tensor and compressed statistic
    (`QuantizedTensor`, `CorrectedTensor`), and every node where ``is_leaf`` holds; ``other``
    is a tree of the same structure walked alongside (or None). ``where`` (a `StateField`)
    names the nearest enclosing NamedTuple field; a field with a declared role passes it to
    everything below. `quantize_state` and `project_lowrank` walk their inner state so."""
    if isinstance(node, (torch.Tensor, *STORED)) or (is_leaf is not None and is_leaf(node)):
        return fn(node, other, where)
    if _is_namedtuple(node):
        def child_field(field: str) -> StateField:
            if where.role is not None:
                return where
            roles = getattr(type(node), "__roles__", None)
            return StateField(owner=type(node).__name__, name=field,
                              role=None if roles is None else state_roles(node).get(field),
                              declared=roles is not None)
        return type(node)(*(walk_state(fn, child, None if other is None else other[j],
                                       child_field(field), is_leaf)
                            for j, (field, child) in enumerate(zip(node._fields, node))))
    if isinstance(node, (tuple, list)):
        return type(node)(walk_state(fn, child, None if other is None else other[j], where,
                                     is_leaf)
                          for j, child in enumerate(node))
    if isinstance(node, dict):
        items = [(k, walk_state(fn, v, None if other is None else other[k], where, is_leaf))
                 for k, v in node.items()]
        return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
    return node


def _signed(role: Role | None) -> bool | None:
    """Whether a field of ``role`` is stored as a signed statistic (first moments and
    parameter-like tensors: True) or a non-negative one (second and factored moments: False);
    None for the roles that are never compressed (counts, scalars, factor matrices, bases,
    codes)."""
    if role is None:
        return None
    if role.nonnegative:
        return False
    if role in (Role.FIRST_MOMENT, Role.PARAMS_LIKE):
        return True
    return None


def _undeclared(where: StateField) -> TypeError:
    owner = f"{where.owner}.{where.name}" if where.owner else "a state that is no NamedTuple"
    cls = where.owner or "the state"
    return TypeError(
        f"quantize_state: the inner state's {owner} holds a floating tensor shaped like the "
        f"parameter, but {cls} declares no roles, so quantize_state cannot tell a moment "
        "(compressed as a signed or a non-negative statistic) from anything else (kept fp32). "
        "Declare them in the state class body, for example __roles__ = opttx.extend.declare_roles("
        "step=Role.COUNT, exp_avg=Role.FIRST_MOMENT, exp_avg_sq=Role.SECOND_MOMENT) (see "
        "opttx.extend.Role).")


# ---------------------------------------------------------------------------------------------
# the declared plan: where each parameter's state is
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafSlot:
    """Where `quantize_state` keeps one parameter's state (static, declared metadata: a pytree
    node without tensors, placed in `QuantizedState.plan` at the parameter's position)."""

    quantized: bool
    """True: the state is ``QuantizedState.quantized[index]`` (that leaf's inner state alone,
    its moments compressed); False: it is entry ``index`` of the per-leaf lists of
    ``QuantizedState.dense`` (one inner state over the small leaves, fp32)."""
    index: int


register_static_node(LeafSlot, "opttx.LeafSlot")
torch.serialization.add_safe_globals([LeafSlot])    # as StateLayout: weights_only loads


def leaf_slots(state: QuantizedState, spec: Any) -> list[LeafSlot | None]:
    """The `LeafSlot` of every leaf of a parameter tree of structure ``spec`` (a treespec),
    read from ``state.plan``; None where the leaf is masked out (`opttx.MaskedNode`: another
    rank's leaf under `opttx.distributed.zero`, a leaf outside `opttx.masked`).

    Raises:
      ValueError: ``state`` was built over a tree of another structure.
    """
    if spec.is_leaf():
        nodes = [state.plan]
    else:
        try:
            nodes = spec.flatten_up_to(state.plan)
        except (ValueError, TypeError, RuntimeError) as err:
            raise ValueError("this quantize_state state was built over a parameter tree of "
                             f"another structure: {err}") from None
    return [n if isinstance(n, LeafSlot) else None for n in nodes]


# ---------------------------------------------------------------------------------------------
# the transform
# ---------------------------------------------------------------------------------------------


class QuantizedState(NamedTuple):
    """State of `quantize_state`."""
    dense: State                   # inner state over the list of leaves under min_size, as
                                   # inner.init makes it (fp32); EmptyState() if there are none
    quantized: tuple[State, ...]   # per leaf of >= min_size elements, in leaf order: the inner
                                   # state of that leaf alone, moments as QuantizedTensor or
                                   # CorrectedTensor (each with its StateLayout)
    signed_map: QuantizationMap    # the map of signed statistics (FIRST_MOMENT, PARAMS_LIKE):
                                   # 8-bit or 4-bit dynamic map; empty for FP8 and bfloat16
    unsigned_map: QuantizationMap  # the map of non-negative ones (SECOND_MOMENT,
                                   # FACTORED_MOMENT): 8-bit dynamic map, 4-bit linear map
                                   # without zero; empty for FP8 and bfloat16
    plan: Any                      # a tree like the params: the LeafSlot of each leaf (where
                                   # its state is), MaskedNode where masked; no tensors
    made_by: Static = Static()  # the transform and configuration that made it
    __roles__ = declare_roles(quantized=Role.QUANTIZED)


class _LeafPlan(NamedTuple):
    """Which leaves `quantize_state` quantizes (plain data, from the leaves' shapes alone)."""
    large: tuple[bool, ...]   # per leaf: at least one dim and at least min_size elements

    @property
    def small(self) -> list[int]:
        return [i for i, big in enumerate(self.large) if not big]

    @property
    def big(self) -> list[int]:
        return [i for i, big in enumerate(self.large) if big]

    def slots(self) -> list[LeafSlot]:
        where = {i: j for part in (self.big, self.small) for j, i in enumerate(part)}
        return [LeafSlot(quantized=big, index=where[i]) for i, big in enumerate(self.large)]


def _leaf_plan(leaves: list[torch.Tensor], min_size: int) -> _LeafPlan:
    return _LeafPlan(large=tuple(x.dim() >= 1 and x.numel() >= min_size for x in leaves))


_FORMAT_BITS = {"8bit": 8, "4bit": 4, "e4m3": 8, "e5m2": 8, "bf16_ecc": 16, "bf16_sr": 16}


def _resolve_format(bits: Any, fmt: Any) -> str:
    """The format named by ``bits`` and ``format`` (either, or both when they agree)."""
    if bits is not None and (not isinstance(bits, int) or isinstance(bits, bool)):
        raise ValueError(f"bits must be an integer (8 or 4), got {bits!r}.")
    if fmt is None:
        if bits is None or bits == 8:
            return "8bit"
        if bits == 4:
            return "4bit"
        raise ValueError(
            f"bits must be 8 or 4, got {bits!r}: codes are stored one per byte (8) or two per "
            "byte (4), so another width would save nothing over one of them; other formats: "
            f"format= one of {FORMATS}.")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}.")
    if bits is not None and bits != _FORMAT_BITS[fmt]:
        raise ValueError(f"bits={bits} contradicts format={fmt!r} ({_FORMAT_BITS[fmt]} bits); "
                         "give one of them.")
    return fmt


def _check_arguments(inner: Any, fmt: str, block_size: Any, min_size: Any,
                     scale_dtype: Any) -> None:
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"inner must be a GradientTransformation, got {type(inner).__name__} "
                        "(did you forget to call the factory?).")
    if block_size is not None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}.")
        if fmt in ("bf16_ecc", "bf16_sr"):
            raise ValueError(f"block_size: format {fmt!r} stores every element on its own "
                             "(no block scales); leave block_size out.")
    if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
        raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}.")
    if scale_dtype is not None:
        if scale_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("scale_dtype must be torch.float32 or torch.bfloat16, got "
                             f"{scale_dtype!r}.")
        if fmt in ("bf16_ecc", "bf16_sr"):
            raise ValueError(f"scale_dtype: format {fmt!r} has no scales; leave it out.")


def _init_inner(inner: GradientTransformation, tree: Any) -> State:
    try:
        return inner.init(tree)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(
            "quantize_state runs its inner transform on each large parameter alone (a bare "
            "tensor) and on the list of small ones, and the inner's init failed on that: move "
            "masks and other per-parameter trees out of the inner, for example "
            "chain(quantize_state(scale_by_adam()), add_decayed_weights(wd, mask), ...). "
            f"Inner error: {err}") from err


def _quantize_leaf_state(leaf_state: State, p: torch.Tensor, fmt: str,
                         maps: dict[bool, QuantizationMap], block_size: int | None,
                         scale_dtype: torch.dtype | None) -> State:
    """The inner state of the large leaf ``p`` with every floating tensor shaped like ``p``
    stored in format ``fmt`` as the statistic of its declared role (kept as it is for roles
    never compressed)."""
    def quantize_moment(x: Any, _: Any, where: StateField) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape == p.shape):
            return x
        signed = _signed(where.role)
        if signed is None:
            if where.role is None and not where.declared:
                raise _undeclared(where)
            return x
        return encode(x, layout_for(fmt, x, signed, block_size, scale_dtype), maps)
    return walk_state(quantize_moment, leaf_state)


def _update_leaf(inner: GradientTransformation, g: torch.Tensor, leaf_state: State,
                 p: torch.Tensor | None, maps: dict[bool, QuantizationMap],
                 extra_args: dict[str, Any]) -> tuple[Any, State]:
    """One large leaf: decode, run the inner, encode again (in each statistic's own declared
    layout). Every fp32 temporary is local to this call, so it is freed before the next leaf
    starts."""
    def dequantize(x: Any, _: Any, where: StateField) -> Any:
        if isinstance(x, STORED) and _signed(where.role) is not None:
            return decode(x, maps)
        return x

    def requantize(x: Any, old: Any, where: StateField) -> Any:
        if not isinstance(old, STORED) or _signed(where.role) is None:
            return x
        new = encode(x, old.layout, maps)
        if is_donating():      # the caller gave up the old state: reuse its buffers
            for mine, fresh in zip(old[:2], new[:2]):
                mine.copy_(fresh)
            return old
        return new

    update, new_state = inner.update(g, walk_state(dequantize, leaf_state), p, **extra_args)
    return update, walk_state(requantize, new_state, leaf_state)


def _update_small(inner: GradientTransformation, g: list, p: list, plan: _LeafPlan,
                  dense: State, with_params: bool, extra_args: dict[str, Any]
                  ) -> tuple[list, State]:
    """The leaves under min_size, together in one inner call on their list."""
    small = plan.small
    if not small:
        return [], dense
    params = [p[i] for i in small] if with_params else None
    return inner.update([g[i] for i in small], dense, params, **extra_args)


@declare()
def quantize_state(inner: GradientTransformation, bits: int | None = None,
                   block_size: int | None = None, min_size: int = 4096,
                   format: str | None = None, scale_dtype: torch.dtype | None = None
                   ) -> GradientTransformation:
    r"""Keep the moments of ``inner`` in a compressed format: 8-bit or packed 4-bit codes,
    FP8, or bfloat16 with error correction.

    For every leaf with at least ``min_size`` elements, each state tensor of ``inner`` shaped
    like the leaf (a moment: ``mu``, ``nu``, ``trace``, ...) is stored compressed, and a step,
    leaf by leaf, is

    .. math::
        s = \mathrm{decode}(c), \qquad
        (u, s') = \texttt{inner.update}(g, s, p), \qquad
        c' = \mathrm{encode}(s')

    The fp32 ``s`` and ``s'`` of a leaf are dropped before the next leaf is processed, so a
    step's peak memory is the compressed state plus the temporaries of one leaf, never the
    fp32 state of the whole model. The update ``u`` is computed from the decoded state,
    exactly as ``inner`` would from that state. Leaves under ``min_size`` elements (biases,
    norms) keep ``inner``'s own fp32 state and are updated together in one call, as in
    bitsandbytes.

    The formats (`opttx.transforms.state_formats`; bytes per element of one moment, and for
    Adam's two moments):

    * ``"8bit"`` (default, ``bits=8``): uint8 codes into the dynamic map (signed for first
      moments, unsigned for second ones), one fp32 absmax per block of 256: 1.016 B, 2.03 B
      for Adam (bitsandbytes' ``Adam8bit``, its maps). Unlike bitsandbytes and torchao, a
      positive second moment is never stored as 0: under half the map's first step (1.6e-7
      of its block's absmax, e.g. next to an outlier of 1e6 times the gradient) it is stored
      as the smallest positive value, 3.25e-7 of the absmax, so the update can only shrink
      (bitsandbytes' rounding gave such neighbours steps 50-8000 times fp32 Adam's).
    * ``"4bit"`` (``bits=4``), Li et al. (2023): first moments as 4-bit codes of the signed
      dynamic map with one absmax per block of 128; second moments with rank-1 scales (the
      scale of an element is the smallest of the maxima of its row and its column, and so on
      for every dim; 1-D leaves: blocks of 128) on the linear map without zero
      ``{1/16, ..., 1}`` (a second moment never rounds to 0, which would make the update
      explode). Codes two per byte, scales in bfloat16 (``scale_dtype``): 0.516 + 0.5 +
      2 (m + n) / mn B for Adam on an m x n matrix (1.020 at 1024 x 1024, 1.035 at
      128 x 512), 1.031 B on vectors.
    * ``"e4m3"``, ``"e5m2"``: float8 values times one fp32 scale per block of 256 (the block's
      max ``|x|`` maps to the largest float8 value); non-negative statistics are kept at
      least at the smallest subnormal, never 0: 2.03 B for Adam. e4m3 has 3 mantissa bits
      over about 5 decades per block, e5m2 2 bits over 9.
    * ``"bf16_ecc"``: the bfloat16 nearest to the value plus an int8 correction of the rounding
      error in units of 1/254 of the bfloat16 spacing (heavyball's ``"bf16+8"`` error
      correction, rounded to nearest rather than stochastically, so that every device and
      every sharding gives the same bits): about 16 significant bits in 3 B, 6 B for Adam.
    * ``"bf16_sr"``: bfloat16 alone, stochastically rounded (round-to-nearest would drop the
      small increments of an EMA with ``b2`` near 1): 2 B, 4 B for Adam. The random bits are a
      hash of each value and its position, so the rounding is the same on every device, rank
      and resumed run.

    Which tensors are moments is read from the roles the inner's state classes declare
    (`opttx.extend.Role`, ``__roles__ = opttx.extend.declare_roles(...)``), never from field
    names: a floating tensor shaped like the leaf under a field of a non-negative role
    (``SECOND_MOMENT``, ``FACTORED_MOMENT``) is stored as a non-negative statistic; under
    ``FIRST_MOMENT`` or ``PARAMS_LIKE`` as a signed one; under ``COUNT``, ``SCALAR``,
    ``FACTOR_MATRIX``, ``PROJECTION`` or ``QUANTIZED``, or under a field its class leaves
    without a role, it is kept as it is. Row and column statistics (Adafactor's and CAME's
    factored moments, ``m + n`` values) are not shaped like the leaf and stay fp32. A role
    covers everything below its field, and NamedTuples nested under fields without a role
    (``chain``, ``inject_hyperparams``) are read the same way. Such a tensor in a state that
    declares no roles (a NamedTuple without ``__roles__``, a dict) raises ``TypeError`` at
    ``init``: declare the roles.

    The state declares its own layout: each compressed statistic carries a `StateLayout`
    (format, the statistic's shape and dtype, its blocks), and ``QuantizedState.plan`` holds
    the `LeafSlot` of every parameter, so checkpoints (`opttx.distributed.state_dict`),
    `opttx.stacked` and `opttx.distributed.zero`/``on_owners`` read which state belongs to
    which parameter and how it is laid out.

    ``inner`` must treat leaves independently (element-wise or per-leaf, as Adam, Lion,
    momentum, RMSprop, Adagrad, CAME): it is run on each large leaf on its own, as a bare
    tensor, and on the list of small leaves. Cross-leaf statistics (global-norm clipping) and
    tree-shaped arguments (weight-decay masks) belong outside, in the surrounding `chain` (as
    `opttx.adamw_8bit` does). Compressed moments are decoded to the dtype the inner's state
    has for them. Non-finite moments make the block's scale non-finite: guard the step with
    `opttx.apply_if_finite`.

    Args:
      inner: the transform whose state is compressed.
      bits: 8 (``format="8bit"``) or 4 (``format="4bit"``); give either ``bits`` or
        ``format`` (or both when they agree).
      block_size: elements per scale block: 256 for ``"8bit"`` (bitsandbytes >= 0.44) and
        FP8, 128 for ``"4bit"`` (Li et al.); the bfloat16 formats have no blocks.
      min_size: leaves with fewer elements keep fp32 state (4096, bitsandbytes'
        ``min_8bit_size``); 0-dim leaves always do.
      format: one of ``"8bit"``, ``"4bit"``, ``"e4m3"``, ``"e5m2"``, ``"bf16_ecc"``,
        ``"bf16_sr"``.
      scale_dtype: the dtype of the block (or rank-1) scales: ``torch.bfloat16`` by default at
        4 bits (2 bytes per 128 elements: 1.02 to 1.05 B per parameter for Adam), else
        ``torch.float32``. ``float32`` at 4 bits is torchao's ``AdamW4bit`` layout (its codes
        on block-wise leaves, tested); ``bfloat16`` trained as well in our measurements.

    Returns:
      A `GradientTransformation` whose state is a `QuantizedState`. With ``min_size`` larger
      than every leaf it gives exactly ``inner``'s updates.

    Example:
      >>> tx = opttx.chain(opttx.quantize_state(opttx.scale_by_adam(), bits=4),
      ...                  opttx.add_decayed_weights(1e-2), opttx.scale_by_learning_rate(1e-3))
      >>> state = tx.init(params)   # state[0].quantized[i].nu.codes: uint8, two per byte

    References:
      Dettmers, Lewis, Shleifer and Zettlemoyer, 8-bit Optimizers via Block-wise
      Quantization (arXiv 2110.02861); Li, Chen and Zhu, Memory Efficient Optimizers with
      4-bit States (arXiv 2309.01507); heavyball's ECC states (``ecc="bf16+8"``).
    """
    fmt = _resolve_format(bits, format)
    _check_arguments(inner, fmt, block_size, min_size, scale_dtype)
    maps = format_maps(fmt)
    device_maps: dict[torch.device, tuple[QuantizationMap, QuantizationMap]] = {}  # read-only

    def init(params: Params) -> QuantizedState:
        check_init_params(params)
        leaves, spec = tree_flatten(params)
        device = leaves[0].device if leaves else torch.device("cpu")
        if device not in device_maps:   # one copy per device, shared by every init of this
            device_maps[device] = tuple(  # transform (e.g. FusedBackward's per-leaf states)
                QuantizationMap(*(t.to(device, copy=True) for t in m)) for m in maps)
        signed_map, unsigned_map = device_maps[device]
        kinds = {True: signed_map, False: unsigned_map}
        plan = _leaf_plan(leaves, min_size)
        small = [leaves[i] for i in plan.small]
        dense = _init_inner(inner, small) if small else EmptyState()
        quantized = tuple(_quantize_leaf_state(_init_inner(inner, leaves[i]), leaves[i], fmt,
                                               kinds, block_size, scale_dtype)
                          for i in plan.big)
        return QuantizedState(dense=dense, quantized=quantized, signed_map=signed_map,
                              unsigned_map=unsigned_map,
                              plan=tree_unflatten(plan.slots(), spec))

    def update(updates: Updates, state: QuantizedState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, QuantizedState]:
        # blocks and the small/large decision are taken on the whole leaf
        require_whole_leaves(updates, extra_args, "quantize_state")
        spec, g = flatten_matching(updates)[:2]
        p = (flatten_matching(updates, params, what="updates and params")[2]
             if params is not None else [None] * len(g))
        plan = _leaf_plan(g, min_size)
        declared = tree_flatten(state.plan, is_leaf=lambda x: isinstance(x, LeafSlot))[0]
        if (declared != plan.slots() or len(state.quantized) != len(plan.big)):
            raise ValueError(
                f"quantize_state's state holds {len(state.quantized)} quantized leaves of "
                f"{len(declared)} (its plan) but the updates have {len(plan.big)} leaves of >= "
                f"{min_size} elements of {len(g)}; was the state built by this transform's init "
                "from the same parameters?")
        kinds = {True: state.signed_map, False: state.unsigned_map}
        out: list[Any] = [None] * len(g)
        small_out, dense = _update_small(inner, g, p, plan, state.dense, params is not None,
                                         extra_args)
        for i, u in zip(plan.small, small_out):
            out[i] = u
        quantized = []
        for i, leaf_state in zip(plan.big, state.quantized):
            out[i], leaf_state = _update_leaf(inner, g[i], leaf_state, p[i], kinds, extra_args)
            quantized.append(leaf_state)
        return tree_unflatten(out, spec), replace_state(state, dense=dense,
                                                        quantized=tuple(quantized))

    # blocks of each whole leaf (a shard would cut them elsewhere); per leaf as the inner is
    return GradientTransformation(init, update, combine_traits((inner,), elementwise=False,
                                                               whole_leaves=True))
