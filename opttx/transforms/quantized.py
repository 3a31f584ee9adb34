"""8-bit block-wise optimizer state: `quantize_state` wraps a per-leaf transform (Adam, Lion,
momentum, ...) and keeps its moment tensors as uint8 codes into the dynamic (tree)
quantization map of Dettmers et al., with one fp32 absolute maximum per block.

The inner transform runs leaf by leaf: each large leaf's state is dequantized, updated and
requantized before the next leaf is touched, so the fp32 state of all leaves is never live
at once (a step holds the quantized state plus the fp32 temporaries of one leaf). Leaves
under ``min_size`` elements keep the inner's fp32 state and run together in one grouped call.

Pure torch: the map, the quantizer (round to nearest on the map's midpoints, by a table
lookup that gives ``torch.bucketize``'s codes) and the dequantizer (a lookup times the
block's absmax) compile with the rest of the step to one graph.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from ..base import (EmptyState, GradientTransformation, Params, Role, State, Updates,
                    check_init_params, combine_traits, declare, declare_roles,
                    require_whole_leaves, state_roles)
from ..kernels import is_donating
from ..tree import Static, flatten_matching, tree_flatten, tree_unflatten

__all__ = [
    "QuantizationMap",
    "QuantizedState",
    "QuantizedTensor",
    "dequantize_blockwise",
    "dynamic_map",
    "quantization_map",
    "quantize_blockwise",
    "quantize_state",
]


# ---------------------------------------------------------------------------------------------
# the dynamic map and block-wise (de)quantization
# ---------------------------------------------------------------------------------------------


def dynamic_map(signed: bool = True, bits: int = 8) -> torch.Tensor:
    r"""The dynamic (tree) quantization map: ``2**bits`` sorted fp32 values in [-1, 1].

    With :math:`E = \texttt{bits} - 1` exponent levels, level :math:`i = 0, \dots, E-1` holds
    the midpoints of ``linspace(0.1, 1, n_i + 1)`` scaled by :math:`10^{i - E + 1}`, with
    :math:`n_i = 2^i` values of each sign (signed map) or :math:`n_i = 2^{i+1}` non-negative
    values (unsigned map); then 0 and 1. Small magnitudes get fine steps and large ones
    coarse steps, so values far below their block's absmax (down to about 1e-6 of it at 8
    bits) keep a few significant digits instead of rounding to 0.

    At 8 bits this equals ``bitsandbytes.functional.create_dynamic_map(signed)`` value for
    value (the same float32 arithmetic); at fewer bits it is bitsandbytes'
    ``create_dynamic_map(signed, bits - 1, bits)`` without the zeros that pad it to 256.

    Args:
      signed: a map for values of both signs (first moments) or for non-negative values only
        (second moments).
      bits: code width, 2 to 8 (codes are stored one per byte whatever the width).

    References:
      Dettmers, 8-Bit Approximations for Parallelism in Deep Learning (arXiv 1511.04561);
      Dettmers et al., 8-bit Optimizers via Block-wise Quantization (arXiv 2110.02861).
    """
    _check_bits(bits)
    exponent_bits = bits - 1
    data: list[float] = []
    for i in range(exponent_bits):
        count = 2 ** i if signed else 2 ** (i + 1)
        boundaries = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        decade = 10 ** (-(exponent_bits - 1) + i)
        data += (decade * means).tolist()         # products in float32, as bitsandbytes
        if signed:
            data += (-decade * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


# Rounding to the map without a binary search per element: the float32 bit patterns are cut
# into 2**17 cells of 2**15 consecutive patterns (sign, exponent and the top 8 mantissa bits),
# a table holds the code of each cell's lowest value, and since no cell holds more than one
# midpoint of the map, one comparison with the midpoint above that code finishes the rounding.
# Same codes as ``torch.bucketize`` on the midpoints (tested on every kind of float), in two
# gathers instead of eight dependent comparisons: quantizing 1M elements takes 12 ms on one
# CPU thread against 60 ms for bucketize alone.
_CELL_BITS = 15
_CELLS = 1 << (32 - _CELL_BITS)


class QuantizationMap(NamedTuple):
    """A sorted quantization map and the tables that round to it (`quantization_map`)."""
    values: torch.Tensor     # (K,) fp32, sorted: the representable values, K <= 256
    midpoints: torch.Tensor  # (K,) fp32: midpoints of neighbouring values, then +inf
    cells: torch.Tensor      # (2**17,) uint8: code of the lowest value of each float32 cell
    __roles__ = declare_roles()


def _cell_bounds() -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest and highest float32 value of every cell, indexed as in `_round_to_map`:
    ``(bits >> 15) + 2**16``, so negative floats (their magnitude growing with the index)
    come first, then positive ones."""
    shifted = torch.arange(_CELLS, dtype=torch.int64) - _CELLS // 2
    first = (shifted << _CELL_BITS).to(torch.int32).view(torch.float32)
    last = ((shifted << _CELL_BITS) + (1 << _CELL_BITS) - 1).to(torch.int32).view(torch.float32)
    negative = shifted < 0
    low, high = torch.where(negative, last, first), torch.where(negative, first, last)
    infinity = torch.where(negative, -math.inf, math.inf)      # NaN patterns: ±inf's side
    return torch.where(low.isnan(), infinity, low), torch.where(high.isnan(), infinity, high)


def quantization_map(values: torch.Tensor) -> QuantizationMap:
    """The `QuantizationMap` of a sorted map of at most 256 values in [-1, 1] (for example
    `dynamic_map`); raises ``ValueError`` for a map too fine for the rounding table."""
    values = torch.as_tensor(values, dtype=torch.float32).detach().cpu().reshape(-1)
    if not 2 <= values.numel() <= 256 or not bool((values.diff() > 0).all()) \
            or values.abs().max() > 1:
        raise ValueError("a quantization map holds 2 to 256 strictly increasing values in "
                         "[-1, 1].")
    midpoints = (values[1:] + values[:-1]) * 0.5
    low, high = _cell_bounds()
    cells = torch.bucketize(low, midpoints)
    inside = torch.bucketize(high, midpoints, right=True) - cells    # midpoints in each cell
    finite = torch.isfinite(low) & torch.isfinite(high)
    if int(inside[finite].max()) > 1:
        raise ValueError("the quantization map has neighbours closer than 1/256 of their "
                         "magnitude; quantize_blockwise cannot round to it.")
    midpoints = torch.cat([midpoints, midpoints.new_full((1,), math.inf)])
    return QuantizationMap(values=values, midpoints=midpoints, cells=cells.to(torch.uint8))


_MAPS: dict[tuple[bool, int], QuantizationMap] = {}


def _dynamic_quantization_map(signed: bool, bits: int) -> QuantizationMap:
    """`quantization_map` of `dynamic_map`, built once per process (copied into each state).

    A plain dict rather than ``functools.lru_cache``: the map is built by the first
    (eager) construction, and a factory called again inside a compiled step
    (`opttx.inject_hyperparams` rebuilds its inner transform there) reads the dict, which
    Dynamo traces, instead of rebuilding the map with host-side ``tolist`` calls."""
    key = (signed, bits)
    if key not in _MAPS:
        _MAPS[key] = quantization_map(dynamic_map(signed, bits))
    return _MAPS[key]


def _round_to_map(v: torch.Tensor, qmap: QuantizationMap) -> torch.Tensor:
    """uint8 index of the map value nearest to each element of ``v`` (fp32); ties go down."""
    cell = (v.reshape(-1).view(torch.int32) >> _CELL_BITS) + _CELLS // 2
    codes = torch.index_select(qmap.cells, 0, cell)
    upper = torch.index_select(qmap.midpoints, 0, codes.to(torch.int32))
    return (codes + (upper < v.reshape(-1))).view(v.shape)


class QuantizedTensor(NamedTuple):
    """A tensor stored block-wise: ``x ≈ map[codes] * absmax[block]`` (see
    `quantize_blockwise`). A pytree node, so ``tree_map``, ``torch.compile`` and checkpoints
    see its two tensors."""
    codes: torch.Tensor   # uint8, the tensor's shape: index of each element's map value
    absmax: torch.Tensor  # fp32, (ceil(numel / block_size),): max |x| over each block
    __roles__ = declare_roles(codes=Role.QUANTIZED, absmax=Role.QUANTIZED)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` (1-D) as rows of ``block_size``, zero-padded at the end when needed."""
    pad = -flat.numel() % block_size
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def quantize_blockwise(x: torch.Tensor, qmap: QuantizationMap, block_size: int = 256
                       ) -> QuantizedTensor:
    r"""Block-wise quantization of ``x`` on the map ``qmap`` (a `QuantizationMap`).

    ``x`` is flattened and cut into blocks :math:`B_j` of ``block_size`` elements (the last
    zero-padded); then

    .. math::
        a_j = \max_{i \in B_j} |x_i|, \qquad
        c_i = \arg\min_k \left| q_k - x_i / a_j \right|

    (round to nearest: the same codes as ``torch.bucketize`` on the midpoints of the map,
    ties to the lower value; a block of zeros has :math:`a_j = 0` and the codes of the map's
    0). Values beyond the map's range are clamped to its ends (negative values on the
    unsigned map become 0).

    Returns:
      `QuantizedTensor` with uint8 codes of ``x``'s shape and fp32 ``absmax`` per block.
    """
    n = x.numel()
    blocks = _blocks(x.detach().reshape(-1).to(torch.float32), block_size)
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = _round_to_map(blocks / scale.unsqueeze(1), _on(qmap, x.device)).view(-1)
    if codes.numel() != n:
        codes = codes[:n]
    return QuantizedTensor(codes=codes.view(x.shape), absmax=absmax)


def dequantize_blockwise(q: QuantizedTensor, qmap: QuantizationMap, block_size: int = 256
                         ) -> torch.Tensor:
    r"""The fp32 tensor :math:`\hat x_i = q_{c_i} \cdot a_j` of a `QuantizedTensor` (same
    map and block size as when quantized)."""
    codes = q.codes
    n = codes.numel()
    values = _on(qmap, codes.device).values
    padded = _blocks(codes.reshape(-1), block_size).reshape(-1)
    out = torch.index_select(values, 0, padded.to(torch.int32))
    out = (out.view(-1, block_size) * q.absmax.unsqueeze(1)).view(-1)
    if out.numel() != n:
        out = out[:n]
    return out.view(codes.shape)


def _on(qmap: QuantizationMap, device: torch.device) -> QuantizationMap:
    if not isinstance(qmap, QuantizationMap):
        raise TypeError("qmap must be a QuantizationMap: build one with "
                        "quantization_map(dynamic_map(signed)).")
    return QuantizationMap(*(t.to(device) for t in qmap))


# ---------------------------------------------------------------------------------------------
# walking an inner state: which tensors are moments, and what their declared role is
# ---------------------------------------------------------------------------------------------


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


class _Field(NamedTuple):
    """Where a tensor sits in an inner state: the nearest enclosing NamedTuple field, its
    declared role (None: none), and whether that NamedTuple declares roles at all."""
    owner: str            # the NamedTuple's class name ("" above any NamedTuple)
    name: str             # the field's name ("" above any NamedTuple)
    role: Role | None     # its declared role, inherited by everything under the field
    declared: bool        # the owner has ``__roles__`` (False also above any NamedTuple)


_TOP = _Field(owner="", name="", role=None, declared=False)


def _walk(fn: Callable[..., Any], node: Any, other: Any = None, where: _Field = _TOP,
          is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Rebuild ``node`` (a state tree of NamedTuples, tuples, lists and dicts) with
    ``fn(leaf, other_leaf, where)`` at every tensor and `QuantizedTensor` (and every node
    where ``is_leaf`` holds); ``other`` is a tree of the same structure walked alongside (or
    None). ``where`` (a `_Field`) names the nearest enclosing NamedTuple field; a field with a
    declared role passes it to everything below. `project_lowrank` walks its inner state so."""
    if isinstance(node, (torch.Tensor, QuantizedTensor)) or (is_leaf is not None
                                                              and is_leaf(node)):
        return fn(node, other, where)
    if _is_namedtuple(node):
        def child_field(field: str) -> _Field:
            if where.role is not None:
                return where
            roles = getattr(type(node), "__roles__", None)
            return _Field(owner=type(node).__name__, name=field,
                          role=None if roles is None else state_roles(node).get(field),
                          declared=roles is not None)
        return type(node)(*(_walk(fn, child, None if other is None else other[j],
                                  child_field(field), is_leaf)
                            for j, (field, child) in enumerate(zip(node._fields, node))))
    if isinstance(node, (tuple, list)):
        return type(node)(_walk(fn, child, None if other is None else other[j], where, is_leaf)
                          for j, child in enumerate(node))
    if isinstance(node, dict):
        items = [(k, _walk(fn, v, None if other is None else other[k], where, is_leaf))
                 for k, v in node.items()]
        return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
    return node


def _map_kind(role: Role | None) -> str | None:
    """Which map stores a field of ``role``: "unsigned" for non-negative roles (second and
    factored moments), "signed" for first moments and parameter-like tensors, None for the
    roles that are never quantized (counts, scalars, factor matrices, bases, codes)."""
    if role is None:
        return None
    if role.nonnegative:
        return "unsigned"
    if role in (Role.FIRST_MOMENT, Role.PARAMS_LIKE):
        return "signed"
    return None


def _undeclared(where: _Field) -> TypeError:
    owner = f"{where.owner}.{where.name}" if where.owner else "a state that is no NamedTuple"
    cls = where.owner or "the state"
    return TypeError(
        f"quantize_state: the inner state's {owner} holds a floating tensor shaped like the "
        f"parameter, but {cls} declares no roles, so quantize_state cannot tell a moment "
        "(quantized, signed or unsigned map) from anything else (kept fp32). Declare them in "
        "the state class body, for example __roles__ = opttx.declare_roles(step=Role.COUNT, "
        "exp_avg=Role.FIRST_MOMENT, exp_avg_sq=Role.SECOND_MOMENT) (see opttx.Role).")


# ---------------------------------------------------------------------------------------------
# the transform
# ---------------------------------------------------------------------------------------------


class QuantizedState(NamedTuple):
    """State of `quantize_state`."""
    dense: State                   # inner state over the list of leaves under min_size, as
                                   # inner.init makes it (fp32); EmptyState() if there are none
    quantized: tuple[State, ...]   # per leaf of >= min_size elements, in leaf order: the inner
                                   # state of that leaf alone, moments as QuantizedTensor
    signed_map: QuantizationMap    # the signed dynamic map: fields declared FIRST_MOMENT or
                                   # PARAMS_LIKE
    unsigned_map: QuantizationMap  # the unsigned dynamic map: fields of a non-negative role
                                   # (SECOND_MOMENT, FACTORED_MOMENT)
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


def _leaf_plan(leaves: list[torch.Tensor], min_size: int) -> _LeafPlan:
    return _LeafPlan(large=tuple(x.dim() >= 1 and x.numel() >= min_size for x in leaves))


def _check_bits(bits: Any) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 2 to 8, got {bits!r}.")


def _check_arguments(inner: Any, bits: Any, block_size: Any, min_size: Any) -> None:
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"inner must be a GradientTransformation, got {type(inner).__name__} "
                        "(did you forget to call the factory?).")
    _check_bits(bits)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}.")
    if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
        raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}.")


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


def _quantize_leaf_state(leaf_state: State, p: torch.Tensor, maps: dict[str, QuantizationMap],
                         block_size: int) -> State:
    """The inner state of the large leaf ``p`` with every floating tensor shaped like ``p``
    quantized on the map of its declared role (kept as it is for roles never quantized)."""
    def quantize_moment(x: Any, _: Any, where: _Field) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape == p.shape):
            return x
        kind = _map_kind(where.role)
        if kind is None:
            if where.role is None and not where.declared:
                raise _undeclared(where)
            return x
        return quantize_blockwise(x, maps[kind], block_size)
    return _walk(quantize_moment, leaf_state)


def _update_leaf(inner: GradientTransformation, g: torch.Tensor, leaf_state: State,
                 p: torch.Tensor | None, maps: dict[str, QuantizationMap], block_size: int,
                 extra_args: dict[str, Any]) -> tuple[Any, State]:
    """One large leaf: dequantize, run the inner, requantize. Every fp32 temporary is local to
    this call, so it is freed before the next leaf starts."""
    def dequantize(x: Any, _: Any, where: _Field) -> Any:
        kind = _map_kind(where.role)
        if isinstance(x, QuantizedTensor) and kind is not None:
            return dequantize_blockwise(x, maps[kind], block_size)
        return x

    def requantize(x: Any, old: Any, where: _Field) -> Any:
        kind = _map_kind(where.role)
        if not isinstance(old, QuantizedTensor) or kind is None:
            return x
        new = quantize_blockwise(x, maps[kind], block_size)
        if is_donating():      # the caller gave up the old state: reuse its buffers
            old.codes.copy_(new.codes)
            old.absmax.copy_(new.absmax)
            return old
        return new

    update, new_state = inner.update(g, _walk(dequantize, leaf_state), p, **extra_args)
    return update, _walk(requantize, new_state, leaf_state)


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
def quantize_state(inner: GradientTransformation, bits: int = 8, block_size: int = 256,
                   min_size: int = 4096) -> GradientTransformation:
    r"""Keep the moments of ``inner`` in 8-bit block-wise quantized form.

    For every leaf with at least ``min_size`` elements, each state tensor of ``inner`` shaped
    like the leaf (a moment: ``mu``, ``nu``, ``trace``, ...) is stored as uint8 codes ``c``
    into the dynamic map ``q`` (`dynamic_map`) with one fp32 absmax ``a`` per block of
    ``block_size`` consecutive elements. A step, leaf by leaf:

    .. math::
        s = q_{c} \cdot a \ (\text{dequantize}), \qquad
        (u, s') = \texttt{inner.update}(g, s, p), \qquad
        a' = \max_{\text{block}} |s'|, \quad c' = \arg\min_k |q_k - s' / a'|

    The fp32 ``s`` and ``s'`` of a leaf are dropped before the next leaf is processed, so a
    step's peak memory is the quantized state plus the temporaries of one leaf, never the
    fp32 state of the whole model. The update ``u`` is computed from the dequantized state,
    exactly as ``inner`` would from that state. Leaves under ``min_size`` elements (biases,
    norms) keep ``inner``'s own fp32 state and are updated together in one call, as in
    bitsandbytes.

    Which tensors are moments, and which map stores them, is read from the roles the inner's
    state classes declare (`opttx.Role`, ``__roles__ = opttx.declare_roles(...)``), never from
    field names: a floating tensor shaped like the leaf under a field of a non-negative role
    (``SECOND_MOMENT``, ``FACTORED_MOMENT``) uses the unsigned map; under ``FIRST_MOMENT`` or
    ``PARAMS_LIKE`` the signed one; under ``COUNT``, ``SCALAR``, ``FACTOR_MATRIX``,
    ``PROJECTION`` or ``QUANTIZED``, or under a field its class leaves without a role, it is
    kept as it is (fp32). A role covers everything below its field, and NamedTuples nested
    under fields without a role (``chain``, ``inject_hyperparams``) are read the same way.
    Such a tensor in a state that declares no roles (a NamedTuple without ``__roles__``, a
    dict) raises ``TypeError`` at ``init``: declare the roles.

    Memory: 1 byte per element and moment plus 4 bytes per block (2.03 bytes per parameter
    for Adam at ``block_size=256``, against 8 for fp32 state), plus the two maps and their
    rounding tables (130 KB each, once per state). Eager on CPU a step costs about 5x fp32
    Adam's (the table lookups of the quantizer); compiled, the leaf loop is one graph.

    ``inner`` must treat leaves independently (element-wise or per-leaf, as Adam, Lion,
    momentum, RMSprop, Adagrad, Adafactor): it is run on each large leaf on its own, as a
    bare tensor, and on the list of small leaves. Cross-leaf statistics (global-norm
    clipping) and tree-shaped arguments (weight-decay masks) belong outside, in the
    surrounding `chain` (as `opttx.adamw_8bit` does). Quantized moments are dequantized to
    fp32 whatever ``inner``'s ``mu_dtype``. Non-finite moments make the block's absmax
    non-finite: guard the step with `opttx.apply_if_finite`.

    Args:
      inner: the transform whose state is quantized.
      bits: code width of the map (2 to 8; codes are stored one per byte, so only 8 saves
        memory against a narrower map).
      block_size: elements per absmax block (256, bitsandbytes >= 0.44).
      min_size: leaves with fewer elements keep fp32 state (4096, bitsandbytes'
        ``min_8bit_size``); 0-dim leaves always do.

    Returns:
      A `GradientTransformation` whose state is a `QuantizedState`. With ``min_size`` larger
      than every leaf it gives exactly ``inner``'s updates.

    Example:
      >>> tx = opttx.chain(opttx.quantize_state(opttx.scale_by_adam()),
      ...                  opttx.add_decayed_weights(1e-2), opttx.scale_by_learning_rate(1e-3))
      >>> state = tx.init(params)   # state[0].quantized[i].nu.codes: uint8

    References:
      Dettmers, Lewis, Shleifer and Zettlemoyer, 8-bit Optimizers via Block-wise
      Quantization (arXiv 2110.02861); bitsandbytes' ``Adam8bit``.
    """
    _check_arguments(inner, bits, block_size, min_size)
    maps = (_dynamic_quantization_map(True, bits), _dynamic_quantization_map(False, bits))
    device_maps: dict[torch.device, tuple[QuantizationMap, QuantizationMap]] = {}  # read-only

    def init(params: Params) -> QuantizedState:
        check_init_params(params)
        leaves = tree_flatten(params)[0]
        device = leaves[0].device if leaves else torch.device("cpu")
        if device not in device_maps:   # one copy per device, shared by every init of this
            device_maps[device] = tuple(  # transform (e.g. FusedBackward's per-leaf states)
                QuantizationMap(*(t.to(device, copy=True) for t in m)) for m in maps)
        signed_map, unsigned_map = device_maps[device]
        kinds = {"signed": signed_map, "unsigned": unsigned_map}
        plan = _leaf_plan(leaves, min_size)
        small = [leaves[i] for i in plan.small]
        dense = _init_inner(inner, small) if small else EmptyState()
        quantized = tuple(_quantize_leaf_state(_init_inner(inner, leaves[i]), leaves[i], kinds,
                                               block_size) for i in plan.big)
        return QuantizedState(dense=dense, quantized=quantized, signed_map=signed_map,
                              unsigned_map=unsigned_map)

    def update(updates: Updates, state: QuantizedState, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, QuantizedState]:
        # blocks of 256 elements and the small/large decision are taken on the whole leaf
        require_whole_leaves(updates, extra_args, "quantize_state")
        spec, g = flatten_matching(updates)[:2]
        p = (flatten_matching(updates, params, what="updates and params")[2]
             if params is not None else [None] * len(g))
        plan = _leaf_plan(g, min_size)
        if len(plan.big) != len(state.quantized):
            raise ValueError(
                f"quantize_state's state holds {len(state.quantized)} quantized leaves but the "
                f"updates have {len(plan.big)} leaves of >= {min_size} elements; was the state "
                "built by this transform's init from the same parameters?")
        kinds = {"signed": state.signed_map, "unsigned": state.unsigned_map}
        out: list[Any] = [None] * len(g)
        small_out, dense = _update_small(inner, g, p, plan, state.dense, params is not None,
                                         extra_args)
        for i, u in zip(plan.small, small_out):
            out[i] = u
        quantized = []
        for i, leaf_state in zip(plan.big, state.quantized):
            out[i], leaf_state = _update_leaf(inner, g[i], leaf_state, p[i], kinds, block_size,
                                              extra_args)
            quantized.append(leaf_state)
        return tree_unflatten(out, spec), QuantizedState(
            dense=dense, quantized=tuple(quantized), signed_map=state.signed_map,
            unsigned_map=state.unsigned_map, made_by=state.made_by)

    # blocks of each whole leaf (a shard would cut them elsewhere); per leaf as the inner is
    return GradientTransformation(init, update, combine_traits((inner,), elementwise=False,
                                                               whole_leaves=True))
