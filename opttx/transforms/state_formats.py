"""Compressed storage of optimizer statistics: the formats of `opttx.quantize_state`.

A statistic shaped like a parameter (a first or second moment) is stored as a
`QuantizedTensor` (codes and fp32 scales: 8-bit and 4-bit maps, FP8) or a `CorrectedTensor`
(bfloat16 values with an 8-bit error correction, or bfloat16 values alone). Each carries a
`StateLayout`: static, declared metadata (a pytree node without tensors, so it is part of the
state's tree structure) that says how to read the tensors back, the shape and dtype of the
statistic they stand for and how its blocks are laid out. Dequantizing, checkpoint keys,
`opttx.stacked` and the distributed wrappers read that declaration instead of inferring it
from the tensors' shapes.

The formats (bytes per element of one statistic):

* ``"8bit"``: a uint8 index into the dynamic map (signed or unsigned), an fp32 absmax per
  block of 256: 1.016. A positive non-negative statistic never takes the unsigned map's 0
  (`_never_zero`): below the first step it is stored as the smallest positive value.
* ``"4bit"``: 4-bit indices, two per byte; first moments on the signed 4-bit dynamic map with
  a bfloat16 absmax per block of 128 (0.516); second moments on the linear map without zero
  ``{1/16, ..., 1}`` with bfloat16 rank-1 scales, the maxima of every row and column (about
  0.5; 1-D: blocks of 128).
* ``"e4m3"``, ``"e5m2"``: the float8 value (its bits, as uint8) times its block's scale, an
  fp32 absmax per block of 256: 1.016.
* ``"bf16_ecc"``: bfloat16 (round to nearest) and an int8 correction of its rounding error in
  1/254 of the bfloat16 spacing: 3.
* ``"bf16_sr"``: bfloat16, stochastically rounded (a hash dither): 2.

All of it is pure torch: the (de)quantizers are table lookups, bit operations and
element-wise arithmetic that compile with the rest of a step into one graph.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn.functional as F

from ..base import Role, declare_roles
from ..tree import register_static_node

__all__ = [
    "FORMATS",
    "CorrectedTensor",
    "QuantizationMap",
    "QuantizedTensor",
    "StateLayout",
    "decode",
    "dequantize_blockwise",
    "dynamic_map",
    "encode",
    "linear_map",
    "quantization_map",
    "quantize_blockwise",
]

FORMATS = ("8bit", "4bit", "e4m3", "e5m2", "bf16_ecc", "bf16_sr")
"""The storage formats of `opttx.quantize_state`."""

_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_DEFAULT_BLOCK = {"8bit": 256, "4bit": 128, "e4m3": 256, "e5m2": 256}


# ---------------------------------------------------------------------------------------------
# maps
# ---------------------------------------------------------------------------------------------


def _check_bits(bits: Any) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 2 to 8, got {bits!r}.")


def dynamic_map(signed: bool = True, bits: int = 8) -> torch.Tensor:
    r"""The dynamic (tree) quantization map: ``2**bits`` sorted fp32 values in [-1, 1].

    With :math:`E = \texttt{bits} - 1` exponent levels, level :math:`i = 0, \dots, E-1` holds
    the midpoints of ``linspace(0.1, 1, n_i + 1)`` scaled by :math:`10^{i - E + 1}`, with
    :math:`n_i = 2^i` values of each sign (signed map) or :math:`n_i = 2^{i+1}` non-negative
    values (unsigned map); then 0 and 1. Small magnitudes get fine steps and large ones
    coarse steps, so values far below their block's absmax (down to about 1e-6 of it at 8
    bits) keep a few significant digits instead of rounding to 0. The unsigned map keeps 0
    (bitsandbytes' values) but encoding a non-negative statistic gives 0 to exact zeros
    only: a positive value under half the first step (``1.6e-7`` of the absmax at 8 bits)
    takes the smallest positive value, ``3.25e-7`` (a second moment next to an outlier of its
    block would otherwise round to 0 and blow up Adam's update).

    At 8 bits this equals ``bitsandbytes.functional.create_dynamic_map(signed)`` value for
    value (the same float32 arithmetic); at fewer bits it is bitsandbytes'
    ``create_dynamic_map(signed, bits - 1, bits)`` without the zeros that pad it to 256. The
    signed 4-bit map is the first-moment map of Li et al. (2023).

    Args:
      signed: a map for values of both signs (first moments) or for non-negative values only
        (second moments).
      bits: code width, 2 to 8.

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


def linear_map(bits: int = 4) -> torch.Tensor:
    r"""The linear map without zero: :math:`\{k / 2^b : k = 1, \dots, 2^b\}` (fp32, sorted).

    The second-moment map of Li et al. (2023): a second moment that rounds to zero makes
    Adam's update :math:`m / (\sqrt{v} + \epsilon)` explode (the "zero-point problem"), so
    the smallest value this map can store is :math:`2^{-b}` of the scale, never 0.

    References:
      Li, Chen and Zhu, Memory Efficient Optimizers with 4-bit States (arXiv 2309.01507),
      section 4.
    """
    _check_bits(bits)
    return torch.arange(1, 2 ** bits + 1, dtype=torch.float32) / 2 ** bits


# Rounding to the map without a binary search per element: the float32 bit patterns are cut
# into cells of consecutive patterns (sign, exponent and the top mantissa bits: as few as the
# map allows, 8 for the 8-bit dynamic map: 2**17 cells; 3 for the 4-bit maps: 2**12), a table
# holds the code of each cell's lowest value, and since no cell holds more than one midpoint of
# the map, one comparison with the midpoint above that code finishes the rounding. Same codes
# as ``torch.bucketize`` on the midpoints (tested on every kind of float), in two gathers
# instead of eight dependent comparisons: quantizing 1M elements takes 12 ms on one CPU thread
# against 60 ms for bucketize alone.
_MANTISSA_BITS = 23


class QuantizationMap(NamedTuple):
    """A sorted quantization map and the tables that round to it (`quantization_map`)."""
    values: torch.Tensor     # (K,) fp32, sorted: the representable values, K <= 256
    midpoints: torch.Tensor  # (K,) fp32: midpoints of neighbouring values, then +inf
    cells: torch.Tensor      # (2**(9 + m),) uint8: code of the lowest value of each cell of
                             # float32 patterns sharing the sign, exponent, top m mantissa bits
    __roles__ = declare_roles()


def _cell_bounds(cell_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest and highest float32 value of every cell of ``2**cell_bits`` patterns, indexed as
    in `_round_to_map`: ``(bits >> cell_bits) + cells / 2``, so negative floats (their
    magnitude growing with the index) come first, then positive ones."""
    n = 1 << (32 - cell_bits)
    shifted = torch.arange(n, dtype=torch.int64) - n // 2
    first = (shifted << cell_bits).to(torch.int32).view(torch.float32)
    last = ((shifted << cell_bits) + (1 << cell_bits) - 1).to(torch.int32).view(torch.float32)
    negative = shifted < 0
    low, high = torch.where(negative, last, first), torch.where(negative, first, last)
    infinity = torch.where(negative, -math.inf, math.inf)      # NaN patterns: ±inf's side
    return torch.where(low.isnan(), infinity, low), torch.where(high.isnan(), infinity, high)


def quantization_map(values: torch.Tensor, mantissa_bits: int | None = None
                     ) -> QuantizationMap:
    """The `QuantizationMap` of a sorted map of at most 256 values in [-1, 1] (for example
    `dynamic_map` or `linear_map`), its rounding table over float32 patterns cut after
    ``mantissa_bits`` mantissa bits (default: the fewest, 0 to 8, that leave at most one
    midpoint of the map in a cell); raises ``ValueError`` for a map too fine for the table."""
    values = torch.as_tensor(values, dtype=torch.float32).detach().cpu().reshape(-1)
    if not 2 <= values.numel() <= 256 or not bool((values.diff() > 0).all()) \
            or values.abs().max() > 1:
        raise ValueError("a quantization map holds 2 to 256 strictly increasing values in "
                         "[-1, 1].")
    midpoints = (values[1:] + values[:-1]) * 0.5
    for kept in range(9) if mantissa_bits is None else (mantissa_bits,):
        low, high = _cell_bounds(_MANTISSA_BITS - kept)
        cells = torch.bucketize(low, midpoints)
        inside = torch.bucketize(high, midpoints, right=True) - cells   # midpoints per cell
        finite = torch.isfinite(low) & torch.isfinite(high)
        if int(inside[finite].max()) <= 1:
            break
    else:
        raise ValueError("the quantization map has neighbours closer than 1/256 of their "
                         "magnitude; quantize_blockwise cannot round to it.")
    midpoints = torch.cat([midpoints, midpoints.new_full((1,), math.inf)])
    return QuantizationMap(values=values, midpoints=midpoints, cells=cells.to(torch.uint8))


def _no_map() -> QuantizationMap:
    """The map of a format that stores no map codes (FP8, bfloat16): three empty tensors."""
    return QuantizationMap(values=torch.zeros(0), midpoints=torch.zeros(0),
                           cells=torch.zeros(0, dtype=torch.uint8))


_MAPS: dict[tuple[str, bool], QuantizationMap] = {}


def format_maps(fmt: str) -> tuple[QuantizationMap, QuantizationMap]:
    """The (signed, unsigned) maps of a format, built once per process: the dynamic maps at 8
    bits; at 4 bits the signed dynamic map and the linear map without zero; empty maps for
    formats without map codes.

    A plain dict rather than ``functools.lru_cache``: the maps are built by the first (eager)
    construction, and a factory called again inside a compiled step (`opttx.inject_hyperparams`
    rebuilds its inner transform there) reads the dict, which Dynamo traces, instead of
    rebuilding a map with host-side ``tolist`` calls."""
    for signed in (True, False):
        key = (fmt, signed)
        if key not in _MAPS:
            if fmt == "8bit":     # the table of 2**17 cells it always had (tests/golden)
                _MAPS[key] = quantization_map(dynamic_map(signed, 8), mantissa_bits=8)
            elif fmt == "4bit":
                _MAPS[key] = quantization_map(dynamic_map(True, 4) if signed else linear_map(4))
            else:
                _MAPS[key] = _no_map()
    return _MAPS[(fmt, True)], _MAPS[(fmt, False)]


def _round_to_map(v: torch.Tensor, qmap: QuantizationMap) -> torch.Tensor:
    """uint8 index of the map value nearest to each element of ``v`` (fp32); ties go down."""
    n = qmap.cells.numel()
    cell = (v.reshape(-1).view(torch.int32) >> (32 - n.bit_length() + 1)) + n // 2
    codes = torch.index_select(qmap.cells, 0, cell)
    upper = torch.index_select(qmap.midpoints, 0, codes.to(torch.int32))
    return (codes + (upper < v.reshape(-1))).view(v.shape)


def _on(qmap: QuantizationMap, device: torch.device) -> QuantizationMap:
    if not isinstance(qmap, QuantizationMap):
        raise TypeError("qmap must be a QuantizationMap: build one with "
                        "quantization_map(dynamic_map(signed)).")
    return QuantizationMap(*(t.to(device) for t in qmap))


# ---------------------------------------------------------------------------------------------
# the declared layout and the two storage types
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a statistic is stored (static metadata of a `QuantizedTensor` or `CorrectedTensor`).

    A pytree node without children: it is part of the state's tree structure (two states with
    other layouts have other structures), and ``tree_map``, ``torch.compile``,
    ``torch.func.vmap`` and ``torch.load(weights_only=True)`` carry it unchanged. Under
    `opttx.stacked` it describes one slice (the tensors have the stack dim in front)."""

    format: str
    """One of `FORMATS`: ``"8bit"``, ``"4bit"``, ``"e4m3"``, ``"e5m2"``, ``"bf16_ecc"``,
    ``"bf16_sr"``."""
    signed: bool
    """A statistic of both signs (first moment, parameter-like: the signed map) or a
    non-negative one (second or factored moment: the unsigned map, no value below zero)."""
    shape: tuple[int, ...]
    """The shape of the statistic it stands for (the parameter's, or the projected leaf's under
    `opttx.project_lowrank`)."""
    dtype: torch.dtype
    """The statistic's dtype in the inner transform's own state (what `decode` returns)."""
    scaling: str
    """``"block"``: one fp32 max ``|x|`` per ``block_size`` consecutive elements (of the
    flattened statistic, the last block zero-padded); ``"rank1"``: the max ``|x|`` along every
    dim, concatenated (``sum(shape)`` values; an element's scale is the smallest of its
    indices' maxima); ``"none"``."""
    block_size: int
    """Elements per block with ``"block"`` scaling, else 0."""
    scale_dtype: torch.dtype = torch.float32
    """The dtype of the scales: float32, or bfloat16 (rounded to nearest; a normalized value
    up to 2**-8 above 1 takes the map's top code), the 4-bit format's default, where fp32 block
    scales alone would cost 0.03 B per element."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def codes_shape(self) -> tuple[int, ...]:
        """The shape of the stored elements: the statistic's, or ``(ceil(numel / 2),)`` for
        packed 4-bit codes (element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the
        high one)."""
        return ((self.numel + 1) // 2,) if self.format == "4bit" else self.shape

    @property
    def scales_shape(self) -> tuple[int, ...]:
        """The shape of the scales (`QuantizedTensor.absmax`)."""
        if self.scaling == "block":
            return (-(-self.numel // self.block_size),)
        if self.scaling == "rank1":
            return (sum(self.shape),)
        return (0,)

    @property
    def nbytes(self) -> int:
        """Bytes of storage: codes plus scales (plus corrections)."""
        per = {"8bit": 1, "e4m3": 1, "e5m2": 1, "bf16_ecc": 3, "bf16_sr": 2}
        codes = self.codes_shape[0] if self.format == "4bit" else per[self.format] * self.numel
        scale = 2 if self.scale_dtype == torch.bfloat16 else 4
        return codes + scale * math.prod(self.scales_shape)


register_static_node(StateLayout, "opttx.StateLayout")
# a whole state saved with torch.save loads with weights_only=True (`opttx.register_safe_globals`
# registers the NamedTuple classes; this one is a frozen dataclass of plain values)
torch.serialization.add_safe_globals([StateLayout])


class QuantizedTensor(NamedTuple):
    """A statistic stored as codes and fp32 scales (formats ``"8bit"``, ``"4bit"``,
    ``"e4m3"``, ``"e5m2"``): ``x ≈ value(codes) * scale``, as its `StateLayout` says. A
    pytree node, so ``tree_map``, ``torch.compile`` and checkpoints see its two tensors."""
    codes: torch.Tensor   # uint8, layout.codes_shape: map indices (4-bit: two per byte) or
                          # the bits of float8 values (FP8 ops are few on CPU; uint8 has all)
    absmax: torch.Tensor  # layout.scales_shape, layout.scale_dtype (fp32; bfloat16 at 4 bits):
                          # max |x| per block, or along every dim (rank-1)
    layout: StateLayout   # static: the format, the statistic's shape and dtype, the blocks
    __roles__ = declare_roles(codes=Role.QUANTIZED, absmax=Role.QUANTIZED)


class CorrectedTensor(NamedTuple):
    """A statistic stored in bfloat16 (formats ``"bf16_ecc"``, ``"bf16_sr"``):
    ``x ≈ value + correction · ulp(value) / 254`` with ``"bf16_ecc"``; ``value`` alone,
    stochastically rounded, with ``"bf16_sr"`` (``correction`` is then empty)."""
    value: torch.Tensor       # bfloat16, layout.shape
    correction: torch.Tensor  # int8, layout.shape ("bf16_ecc"); empty (0,) for "bf16_sr"
    layout: StateLayout       # static: the format, the statistic's shape and dtype
    __roles__ = declare_roles(value=Role.QUANTIZED, correction=Role.QUANTIZED)


STORED = (QuantizedTensor, CorrectedTensor)
"""The types that stand for a statistic in compressed form."""


def default_scale_dtype(fmt: str) -> torch.dtype:
    """bfloat16 scales for ``"4bit"`` (1.02 to 1.05 B per parameter for Adam instead of 1.04
    to 1.07 with fp32 ones), float32 for the others (bitsandbytes' and torchao's)."""
    return torch.bfloat16 if fmt == "4bit" else torch.float32


def layout_for(fmt: str, x: torch.Tensor, signed: bool, block_size: int | None = None,
               scale_dtype: torch.dtype | None = None) -> StateLayout:
    """The `StateLayout` of statistic ``x`` in format ``fmt``: block-wise scales (the format's
    default block, or ``block_size``), except the second moments of the 4-bit format with at
    least 2 dims, which get Li et al.'s rank-1 scales; scales in ``scale_dtype`` (default:
    `default_scale_dtype`)."""
    shape, dtype = tuple(x.shape), x.dtype
    if fmt in ("bf16_ecc", "bf16_sr"):
        return StateLayout(fmt, signed, shape, dtype, "none", 0)
    scale_dtype = scale_dtype or default_scale_dtype(fmt)
    if fmt == "4bit" and not signed and len(shape) >= 2:
        return StateLayout(fmt, signed, shape, dtype, "rank1", 0, scale_dtype)
    return StateLayout(fmt, signed, shape, dtype, "block", block_size or _DEFAULT_BLOCK[fmt],
                       scale_dtype)


# ---------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` (1-D) as rows of ``block_size``, zero-padded at the end when needed."""
    pad = -flat.numel() % block_size
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def _trim(flat: torch.Tensor, n: int) -> torch.Tensor:
    return flat[:n] if flat.numel() != n else flat


def _rank1_maxima(x: torch.Tensor) -> torch.Tensor:
    """max |x| along every dim of ``x`` (over all the other dims), concatenated."""
    a = x.abs()
    if a.numel() == 0:     # an empty statistic: no element, every max over nothing is 0
        return a.new_zeros(sum(a.shape))
    return torch.cat([a.amax(dim=tuple(d for d in range(x.dim()) if d != i))
                      for i in range(x.dim())])


def _rank1_scale(maxima: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The scale of each element: the smallest of its indices' maxima (Li et al.'s rank-1
    normalization, SM3's cover of the tensor by its rows, columns, ...)."""
    scale = None
    for i, part in enumerate(maxima.split(list(shape))):
        view = part.view([n if d == i else 1 for d, n in enumerate(shape)])
        scale = view if scale is None else torch.minimum(scale, view)
    return scale.expand(shape)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# ---------------------------------------------------------------------------------------------
# 8-bit and 4-bit map codes
# ---------------------------------------------------------------------------------------------


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 < 16, 1-D) two per byte: element ``2i`` in the low nibble of byte
    ``i``, ``2i + 1`` in the high one (a zero nibble pads an odd count)."""
    if codes.numel() % 2:
        codes = F.pad(codes, (0, 1))
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` 4-bit codes of `_pack4`, one per uint8."""
    return _trim(torch.stack([packed & 15, packed >> 4], dim=-1).view(-1), n)


def _encode_map(x: torch.Tensor, layout: StateLayout, qmap: QuantizationMap) -> QuantizedTensor:
    x = x.detach().to(torch.float32)
    n = x.numel()
    # bfloat16 scales are rounded to nearest (a normalized value up to 2**-8 above 1 takes the
    # map's top code); rounding them up instead would inflate the largest element of a block
    # at every step, which an EMA compounds (measured: 40 % higher loss at 4 bits)
    low = layout.scale_dtype == torch.bfloat16
    if layout.scaling == "rank1":
        absmax = _rank1_maxima(x)
        absmax = absmax.to(torch.bfloat16) if low else absmax
        normed = (x / _nonzero(_rank1_scale(absmax.to(torch.float32), layout.shape))).reshape(-1)
    else:
        blocks = _blocks(x.reshape(-1), layout.block_size)
        absmax = blocks.abs().amax(dim=1)
        absmax = absmax.to(torch.bfloat16) if low else absmax
        normed = (blocks / _nonzero(absmax.to(torch.float32)).unsqueeze(1)).reshape(-1)
    qmap = _on(qmap, x.device)
    codes = _round_to_map(normed, qmap)
    if not layout.signed:
        codes = _never_zero(codes, normed, qmap)
    codes = _trim(codes, n)
    codes = _pack4(codes) if layout.format == "4bit" else codes.view(layout.shape)
    return QuantizedTensor(codes=codes, absmax=absmax, layout=layout)


def _never_zero(codes: torch.Tensor, normed: torch.Tensor, qmap: QuantizationMap
                ) -> torch.Tensor:
    r"""Codes of a non-negative statistic where no positive value decodes to 0: a positive
    element that rounds to a code of a value <= 0 (the 0 of the unsigned dynamic map, for an
    element under half the map's smallest step, ``1.6e-7`` of its block's absmax at 8 bits)
    takes the code of the smallest positive value instead. A second moment next to an outlier
    in its block would otherwise round to 0 and make Adam's update :math:`m / (\sqrt v +
    \epsilon)` explode; rounded up, it is over-estimated and the update can only shrink. Exact
    zeros (and negative values, clamped) keep the code of 0. A no-op on maps without 0 (the
    4-bit linear map). Applied when encoding, so codes written before it decode unchanged."""
    first_positive = (qmap.values <= 0).sum().to(codes.dtype)
    return torch.where(normed.view(codes.shape) > 0, torch.maximum(codes, first_positive), codes)


def _decode_map(q: QuantizedTensor, qmap: QuantizationMap) -> torch.Tensor:
    layout = q.layout
    n = layout.numel
    codes = _unpack4(q.codes, n) if layout.format == "4bit" else q.codes.reshape(-1)
    values = _on(qmap, codes.device).values
    if layout.scaling == "rank1":
        out = torch.index_select(values, 0, codes.to(torch.int32)).view(layout.shape)
        return out * _rank1_scale(q.absmax.to(torch.float32), layout.shape)
    padded = _blocks(codes, layout.block_size).reshape(-1)
    out = torch.index_select(values, 0, padded.to(torch.int32))
    out = (out.view(-1, layout.block_size) * q.absmax.to(torch.float32).unsqueeze(1)).view(-1)
    return _trim(out, n).view(layout.shape)


def quantize_blockwise(x: torch.Tensor, qmap: QuantizationMap, block_size: int = 256
                       ) -> QuantizedTensor:
    r"""Block-wise quantization of ``x`` on the map ``qmap`` (a `QuantizationMap`), one uint8
    code per element (the ``"8bit"`` layout).

    ``x`` is flattened and cut into blocks :math:`B_j` of ``block_size`` elements (the last
    zero-padded); then

    .. math::
        a_j = \max_{i \in B_j} |x_i|, \qquad
        c_i = \arg\min_k \left| q_k - x_i / a_j \right|

    (round to nearest: the same codes as ``torch.bucketize`` on the midpoints of the map,
    ties to the lower value; a block of zeros has :math:`a_j = 0` and the codes of the map's
    0). Values beyond the map's range are clamped to its ends (negative values on the
    unsigned map become its lowest value). On a map without negative values (an unsigned map:
    ``qmap.values[0] >= 0``) a positive value never takes a code of a value <= 0: one that
    rounds there takes the smallest positive value's code instead (`_never_zero`).

    Returns:
      `QuantizedTensor` with uint8 codes of ``x``'s shape and fp32 ``absmax`` per block.
    """
    signed = bool(qmap.values[0] < 0)
    layout = StateLayout("8bit", signed, tuple(x.shape), x.dtype, "block", block_size)
    return _encode_map(x, layout, qmap)


def dequantize_blockwise(q: QuantizedTensor, qmap: QuantizationMap,
                         block_size: int | None = None) -> torch.Tensor:
    r"""The fp32 tensor :math:`\hat x_i = q_{c_i} \cdot a_j` of a `QuantizedTensor` of map
    codes (same map as when quantized; the block size is read from ``q.layout``, and a
    ``block_size`` given must agree with it)."""
    layout = q.layout
    if block_size is not None and layout.scaling == "block" and block_size != layout.block_size:
        raise ValueError(f"dequantize_blockwise: block_size={block_size}, but the tensor was "
                         f"quantized in blocks of {layout.block_size} (q.layout).")
    return _decode_map(q, qmap)


# ---------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------


def _encode_fp8(x: torch.Tensor, layout: StateLayout) -> QuantizedTensor:
    dtype = _FLOAT8[layout.format]
    info = torch.finfo(dtype)
    x = x.detach().to(torch.float32)
    blocks = _blocks(x.reshape(-1), layout.block_size)
    absmax = blocks.abs().amax(dim=1).to(layout.scale_dtype)
    # a block's max |x| goes to the largest float8 value
    normed = blocks * (info.max / _nonzero(absmax.to(torch.float32))).unsqueeze(1)
    if layout.signed:
        normed = normed.clamp(-info.max, info.max)
    else:    # no zero for a non-negative statistic: at least the smallest subnormal
        normed = normed.clamp(_smallest_subnormal(dtype), info.max)
    codes = _trim(normed.reshape(-1), x.numel()).to(dtype).view(torch.uint8)
    return QuantizedTensor(codes=codes.view(layout.shape), absmax=absmax, layout=layout)


def _smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive value of a float8 dtype (a subnormal)."""
    info = torch.finfo(dtype)
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    return info.smallest_normal * 2.0 ** -mantissa


def _decode_fp8(q: QuantizedTensor) -> torch.Tensor:
    layout = q.layout
    dtype = _FLOAT8[layout.format]
    info = torch.finfo(dtype)
    values = _blocks(q.codes.reshape(-1).view(dtype).to(torch.float32), layout.block_size)
    out = (values * (q.absmax.to(torch.float32) / info.max).unsqueeze(1)).view(-1)
    return _trim(out, layout.numel).view(layout.shape)


# ---------------------------------------------------------------------------------------------
# bfloat16 with error correction, bfloat16 stochastically rounded
# ---------------------------------------------------------------------------------------------

_ECC_STEPS = 127     # int8 correction: multiples of half the bfloat16 spacing / 127


def _bf16_as_fp32(v: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``v`` as float32, exactly, through its bits (a ``to`` round trip could be
    folded away by a compiler as the identity)."""
    return (v.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _half_spacing(v: torch.Tensor) -> torch.Tensor:
    """Half the distance from bfloat16 ``v`` to its neighbour away from zero (fp32): the
    largest rounding error of round-to-nearest, :math:`2^{e - 8}` for exponent :math:`e`,
    built from the exponent bits (a compiled step fuses this; ``exp2`` cost it half its time);
    below :math:`2^{-118}` that of :math:`2^{-118}`, a coarser unit for values that small."""
    biased = (v.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    return ((biased.clamp(min=9) - 8) << 23).view(torch.float32)


def _encode_ecc(x: torch.Tensor, layout: StateLayout) -> CorrectedTensor:
    x = x.detach().to(torch.float32)
    if not layout.signed:
        x = x.clamp(min=0)
    value = x.to(torch.bfloat16)
    half = _half_spacing(value)
    error = (x - _bf16_as_fp32(value)) / half            # in [-1, 1]: round to nearest
    error = torch.where(torch.isfinite(error), error, torch.zeros_like(error))
    correction = (error * _ECC_STEPS).round().clamp(-_ECC_STEPS, _ECC_STEPS).to(torch.int8)
    return CorrectedTensor(value=value, correction=correction, layout=layout)


def _decode_ecc(q: CorrectedTensor) -> torch.Tensor:
    value = _bf16_as_fp32(q.value)
    return value + q.correction.to(torch.float32) * (_half_spacing(q.value) / _ECC_STEPS)


def _dither(bits: torch.Tensor) -> torch.Tensor:
    """16 pseudo-random bits per element (int64): a hash of the upper 16 bits of its float32
    pattern ``bits`` (int32: the bfloat16 it truncates to) and of its position. The same on
    every device, rank and resumed run; a float32 value that changes in its last bits (another
    summation order, a compiled graph) keeps its dither, so it rounds the same way unless it
    crosses the threshold, as rarely as round-to-nearest crosses a midpoint."""
    mask = 0xFFFFFFFF
    where = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64).view(bits.shape)
    h = (((bits.to(torch.int64) >> 16) & 0xFFFF) * 0x7FEB352D + where * 0x68E31DA5) & mask
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & mask
    h = h ^ (h >> 12)
    h = (h * 0x297A2D39) & mask
    h = h ^ (h >> 15)
    return h & 0xFFFF


def _encode_sr(x: torch.Tensor, layout: StateLayout) -> CorrectedTensor:
    x = x.detach().to(torch.float32)
    if not layout.signed:
        x = x.clamp(min=0)
    bits = x.view(torch.int32)
    rounded = ((bits.to(torch.int64) + _dither(bits)) >> 16).to(torch.int16)
    value = torch.where(torch.isfinite(x), rounded.view(torch.bfloat16), x.to(torch.bfloat16))
    empty = torch.zeros(0, dtype=torch.int8, device=x.device)
    return CorrectedTensor(value=value, correction=empty, layout=layout)


# ---------------------------------------------------------------------------------------------
# the two entry points
# ---------------------------------------------------------------------------------------------


def encode(x: torch.Tensor, layout: StateLayout,
           maps: Mapping[bool, QuantizationMap] | None = None) -> QuantizedTensor | CorrectedTensor:
    """Store statistic ``x`` (of ``layout.shape``) as ``layout`` says; ``maps[signed]`` is the
    map of the map-code formats (``"8bit"``, ``"4bit"``: see `format_maps`)."""
    if tuple(x.shape) != layout.shape:
        raise ValueError(f"encode: a statistic of shape {tuple(x.shape)} for a layout of shape "
                         f"{layout.shape}.")
    if layout.format in ("8bit", "4bit"):
        qmap = (maps or dict(zip((True, False), format_maps(layout.format))))[layout.signed]
        return _encode_map(x, layout, qmap)
    if layout.format in _FLOAT8:
        return _encode_fp8(x, layout)
    if layout.format == "bf16_ecc":
        return _encode_ecc(x, layout)
    return _encode_sr(x, layout)


def decode(q: QuantizedTensor | CorrectedTensor,
           maps: Mapping[bool, QuantizationMap] | None = None) -> torch.Tensor:
    """The statistic that ``q`` stands for, in ``q.layout.dtype`` (computed in float32)."""
    layout = q.layout
    if layout.format in ("8bit", "4bit"):
        qmap = (maps or dict(zip((True, False), format_maps(layout.format))))[layout.signed]
        out = _decode_map(q, qmap)
    elif layout.format in _FLOAT8:
        out = _decode_fp8(q)
    elif layout.format == "bf16_ecc":
        out = _decode_ecc(q)
    else:
        out = _bf16_as_fp32(q.value)
    return out if out.dtype == layout.dtype else out.to(layout.dtype)
