r"""The communication and flops of one optimizer step per rank, and an α–β estimate of its
time, for the ways opttx runs an optimizer over :math:`W` ranks (benchmarks/scale_model.py
prints the table; tests/test_scale_model.py checks the byte and call counts of the modes that
exist against gloo runs counted by `opttx.distributed.counting.count_collectives`).

Layouts. ``adamw_zero2`` takes replicated (data-parallel) gradients, as `zero` does: one
``reduce_scatter`` of each chunk of gradients and one ``all_gather`` of the updates (these
replace plain data parallelism's all-reduce). Every other mode takes parameters and gradients
sharded ``Shard(0)`` over the :math:`W` ranks (FSDP-like; a leaf with fewer rows than ranks is
split as ``torch.tensor_split`` splits it), and counts only what the optimizer issues:

* ``owners`` (`on_owners`): one ``all_to_all`` of gradient (and parameter) pieces to each
  leaf's owner (chosen greedily as `make_plan` chooses, `default_cost`), one of the update
  pieces back; ``owners_overlap`` the same bytes in :math:`2B` collectives (B buckets,
  `owners_overlap.make_buckets`), time :math:`\max(C, X) + \min(C, X)/B` instead of
  :math:`C + X` (communication :math:`C`, computation :math:`X`).
* ``gram`` (`orthogonalize` with ``sharded_mode="gram"`` on row or column shards,
  :math:`X^\top X = \sum_i X_i^\top X_i`; `gram_traffic`): per step one ``all_reduce`` of
  every matrix's max (the exact power-of-two scale), one of its squared norm and
  :math:`K \times K` Gram matrix (:math:`K` the unsharded dim), then one of the Grams per
  further exchange: :math:`1 + E` all-reduces for all leaves together, :math:`E` the
  Newton–Schulz steps (``gram_iter``: the Gram of every iterate) or one plus the restarts
  of Gram Newton–Schulz (``gram_once``); a leaf whose Gram would be larger than the matrix
  (:math:`K` above the sharded dim: ``sharded_mode="auto"`` refuses it) goes to owners.
* ``muonbp`` (`orthogonalize_block_periodic`: block steps on the local shard, no collective;
  the full step every ``P`` sums the zero-padded shards in one ``all_reduce`` of the whole
  matrices, `muonbp_full_traffic`): per-step averages, :math:`(P-1)/P` of the block step
  plus :math:`1/P` of the full one (every rank orthogonalizes every whole matrix there);
  ``muonbp_owners_full`` models the full step on owners instead (the paper's layout; not
  what opttx runs today).
* ``dion``: the rank-:math:`r` factors reduced over the row shards (modeled: one batched
  ``all_reduce`` per hook call, 6 per step as opttx's Dion makes, carrying :math:`nr` and
  :math:`2r^2` per matrix).
* ``shampoo`` and ``soap``: whole leaves on owners (``owners`` traffic, owners balanced by
  their blocks), with the flops of their factor products, preconditioning and refresh (every
  ``precondition_frequency`` steps).

Times: a collective over :math:`W` ranks costs :math:`\alpha\,\ell + b/\beta` (``b`` the bytes
the busiest rank sends or receives, :math:`\ell` the latency hops: :math:`W-1` for
all_to_all, all_gather and reduce_scatter, :math:`2(W-1)` for a ring all_reduce), with
NVLink's :math:`(\alpha, \beta)` up to ``gpus_per_node`` ranks and the inter-node network's
beyond; computation :math:`F / R` at the busiest rank (``R`` the sustained flop rate).
Estimates, not measurements: they say which term dominates where. Steps are steady-state ones
(the first eager step of an owners plan adds one all-reduce of an int64, the ranks' agreement
on their pieces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Interconnect", "Leaf", "MODELS", "ModeCost", "RankTraffic", "bucket_count",
           "gram_traffic", "model_shapes", "muonbp_full_traffic", "owners_traffic",
           "step_costs", "zero_traffic"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Interconnect:
    """The links and flop rate of the estimate (defaults: an H100 node of 8 GPUs on NVLink 4,
    nodes on 400 Gb/s InfiniBand NDR per GPU)."""
    nvlink_gbps: float = 450.0       # GB/s per GPU per direction (NVLink 4: 900 GB/s both)
    nvlink_latency_us: float = 3.0   # per hop
    ib_gbps: float = 50.0            # GB/s per GPU per direction (400 Gb/s NDR)
    ib_latency_us: float = 10.0      # per hop
    gpus_per_node: int = 8
    tflops: float = 400.0            # sustained dense flop rate of the optimizer's matmuls

    def link(self, world: int) -> tuple[float, float]:
        """``(alpha seconds, beta bytes per second)`` of a collective over ``world`` ranks."""
        if world <= self.gpus_per_node:
            return self.nvlink_latency_us * 1e-6, self.nvlink_gbps * 1e9
        return self.ib_latency_us * 1e-6, self.ib_gbps * 1e9


@dataclass(frozen=True)
class Leaf:
    """One parameter: its shape, and whether a matrix optimizer takes it (hidden matrices;
    embeddings, the head, norms and biases take AdamW on their local shards)."""
    name: str
    shape: Shape
    matrix: bool


def _llama(layers: int, d: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           tied: bool) -> list[Leaf]:
    kv = d // heads * kv_heads
    out = [Leaf("embed", (vocab, d), False)]
    for i in range(layers):
        out += [Leaf(f"{i}.q", (d, d), True), Leaf(f"{i}.k", (kv, d), True),
                Leaf(f"{i}.v", (kv, d), True), Leaf(f"{i}.o", (d, d), True),
                Leaf(f"{i}.gate", (ffn, d), True), Leaf(f"{i}.up", (ffn, d), True),
                Leaf(f"{i}.down", (d, ffn), True), Leaf(f"{i}.attn_norm", (d,), False),
                Leaf(f"{i}.mlp_norm", (d,), False)]
    out.append(Leaf("norm", (d,), False))
    if not tied:
        out.append(Leaf("head", (vocab, d), False))
    return out


def _gpt(layers: int, d: int, vocab: int, context: int) -> list[Leaf]:
    out = [Leaf("wte", (vocab, d), False), Leaf("wpe", (context, d), False)]
    for i in range(layers):
        out += [Leaf(f"{i}.ln1", (d,), False), Leaf(f"{i}.ln1.bias", (d,), False),
                Leaf(f"{i}.q", (d, d), True), Leaf(f"{i}.k", (d, d), True),
                Leaf(f"{i}.v", (d, d), True), Leaf(f"{i}.qkv.bias", (3 * d,), False),
                Leaf(f"{i}.o", (d, d), True), Leaf(f"{i}.o.bias", (d,), False),
                Leaf(f"{i}.ln2", (d,), False), Leaf(f"{i}.ln2.bias", (d,), False),
                Leaf(f"{i}.fc", (4 * d, d), True), Leaf(f"{i}.fc.bias", (4 * d,), False),
                Leaf(f"{i}.proj", (d, 4 * d), True), Leaf(f"{i}.proj.bias", (d,), False)]
    return out + [Leaf("ln_f", (d,), False), Leaf("ln_f.bias", (d,), False)]


MODELS = {
    # Meta Llama 3 8B config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads,
    # intermediate 14336, vocab 128256, untied embeddings
    "llama3-8b": lambda: _llama(32, 4096, 32, 8, 14336, 128256, tied=False),
    # Meta Llama 3 70B: hidden 8192, 80 layers, 64 heads, 8 KV heads, intermediate 28672
    "llama3-70b": lambda: _llama(80, 8192, 64, 8, 28672, 128256, tied=False),
    # GPT-3 XL (Brown et al. 2020, table 2.1): 1.3 B, 24 layers, d 2048, 4d MLP, GPT-2 BPE
    # vocabulary (50257), context 2048, tied embeddings, biases and layer norms
    "gpt-1.3b": lambda: _gpt(24, 2048, 50257, 2048),
}


def model_shapes(name: str) -> list[Leaf]:
    """The parameters of a named model (`MODELS`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[name]()


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _pieces(shape: Shape, world: int, dim: int | None) -> list[int]:
    """Elements of each rank's piece (``torch.tensor_split`` sizes; the whole where None)."""
    if dim is None:
        return [_numel(shape)] * world
    n, rest = shape[dim], _numel(shape) // max(shape[dim], 1) if shape[dim] else 0
    if shape[dim] == 0:
        rest = 0
    sizes = [n // world + (1 if r < n % world else 0) for r in range(world)]
    return [s * rest for s in sizes]


@dataclass
class RankTraffic:
    """Per rank, per step: bytes sent and received, and collectives issued."""
    sent: list[int]
    received: list[int]
    calls: int
    kinds: dict[str, int] = field(default_factory=dict)


def owner_assignment(shapes: Sequence[Shape], world: int, block_rows: int | None = None
                     ) -> list[int]:
    """The owner of each leaf as `make_plan` assigns it (greedy by `default_cost`, summed over
    Shampoo's blocks for a blocked transform: largest first, to the least loaded rank)."""
    from .owners import blocked_cost, default_cost
    cost = blocked_cost(default_cost, block_rows)
    costs = [cost(s) for s in shapes]
    loads = [0.0] * world
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda k: (loads[k], k))
        owner[i] = r
        loads[r] += costs[i]
    return owner


def owners_traffic(shapes: Sequence[Shape], dims: Sequence[int | None], world: int, *,
                   itemsize: int = 4, trees: int = 2, back_itemsize: int | None = None,
                   block_rows: int | None = None, buckets: int = 1) -> RankTraffic:
    """`on_owners`' traffic: ``trees`` trees (gradients, and parameters when given) of pieces
    to the owners, the update pieces back (``back_itemsize``: ``communication_dtype``'s);
    ``dims``: each leaf's sharded dim over all ranks (None: replicated); ``buckets``: the
    number of buckets (2 collectives each)."""
    back = itemsize if back_itemsize is None else back_itemsize
    owner = owner_assignment(shapes, world, block_rows)
    sent, received = [0] * world, [0] * world
    for shape, dim, o in zip(shapes, dims, owner):
        if dim is None:                       # whole everywhere: only the update goes back
            for r in range(world):
                if r == o:
                    sent[r] += (world - 1) * _numel(shape) * back
                else:
                    received[r] += _numel(shape) * back
            continue
        pieces = _pieces(shape, world, dim)
        for r in range(world):
            if r == o:
                others = sum(pieces) - pieces[r]
                received[r] += others * itemsize * trees
                sent[r] += others * back
            else:
                sent[r] += pieces[r] * itemsize * trees
                received[r] += pieces[r] * back
    return RankTraffic(sent, received, 2 * buckets, {"all_to_all": 2 * buckets})


def zero_traffic(shapes: Sequence[Shape], world: int, *, itemsize: int = 4,
                 chunk_size_mb: float | None = None, counters: int = 1) -> RankTraffic:
    """`zero` (stage 2)'s traffic, from its own chunk layout (`zero_plan`): per chunk one
    ``reduce_scatter`` of the chunk and one ``all_gather`` of a segment (the first carrying
    ``counters`` step counters, compared across ranks in eager steps)."""
    import torch
    from .chunk_plan import zero_plan
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[itemsize]
    plan = zero_plan([torch.empty(s, dtype=dtype, device="meta") for s in shapes], world,
                     chunk_size_mb)
    total, calls, first = 0, 0, True
    for c in plan.chunks:
        if c.segment == 0:
            continue
        total += (world - 1) * c.numel * itemsize // world          # reduce_scatter
        total += (world - 1) * (c.segment + (counters if first else 0)) * itemsize
        first = False
        calls += 2
    return RankTraffic([total] * world, [total] * world, calls,
                       {"reduce_scatter": calls // 2, "all_gather": calls // 2})


def _all_reduces(payloads: Sequence[int], world: int) -> RankTraffic:
    """Ring all-reduces of these payloads (bytes), as `count_collectives` counts them."""
    b = sum(2 * (world - 1) * n // world for n in payloads)
    return RankTraffic([b] * world, [b] * world, len(payloads), {"all_reduce": len(payloads)})


def gram_traffic(shapes: Sequence[Shape], dims: Sequence[int], world: int, exchanges: int, *,
                 itemsize: int = 4, counters: int = 0) -> RankTraffic:
    """`orthogonalize(sharded_mode="gram")`'s traffic for matrices (``shapes``, each sharded
    over ``dims``: 0 its rows, 1 its columns): the max of each matrix, then its squared norm
    with its Gram matrix (:math:`K^2`, :math:`K` the unsharded dim), then ``exchanges - 1``
    more all-reduces of the Gram matrices (``exchanges``: the Newton–Schulz steps, or one
    plus the restarts of Gram Newton–Schulz). ``counters``: step counters the eager
    `sharded` update carries with its first all-reduce (two values each; 0 for the stateless
    `orthogonalize`)."""
    grams = sum(s[1 - d] ** 2 for s, d in zip(shapes, dims))
    m = len(shapes)
    payloads = [(m + 2 * counters) * itemsize, (m + grams) * itemsize]
    payloads += [grams * itemsize] * (exchanges - 1)
    return _all_reduces(payloads, world)


def muonbp_full_traffic(shapes: Sequence[Shape], world: int, *, itemsize: int = 4,
                        counters: int = 1) -> RankTraffic:
    """The full step of `orthogonalize_block_periodic` on shards: one all-reduce of every
    matrix whole (each rank's shard in place, zeros elsewhere), carrying ``counters`` step
    counters (two values each) in an eager `sharded` update; block steps send nothing."""
    return _all_reduces([(sum(map(_numel, shapes)) + 2 * counters) * itemsize], world)


def ideal_zero_traffic(numel: int, world: int, itemsize: int, chunk_mb: float) -> RankTraffic:
    """ZeRO-2 at scale without the whole-leaf layout's padding (leaves split over ranks):
    ``numel`` elements in chunks of ``chunk_mb`` MiB."""
    chunks = max(1, math.ceil(numel * itemsize / (chunk_mb * 2**20)))
    b = 2 * (world - 1) * numel * itemsize // world
    return RankTraffic([b] * world, [b] * world, 2 * chunks,
                       {"reduce_scatter": chunks, "all_gather": chunks})


# --- flops -----------------------------------------------------------------------------------

NS_STEPS = 5


def ns_flops(m: int, n: int, steps: int = NS_STEPS) -> float:
    """Newton–Schulz (quintic) on an m x n matrix: per step :math:`4 s^2 l + 2 s^3` (``s``,
    ``l`` the short and long sides)."""
    s, l = min(m, n), max(m, n)
    return steps * (4.0 * s * s * l + 2.0 * s ** 3)


def _blocks(shape: Shape, b: int) -> list[Shape]:
    m, n = shape
    return [(min(b, m - i), min(b, n - j)) for i in range(0, m, b) for j in range(0, n, b)]


def shampoo_flops(shape: Shape, block: int, frequency: int) -> float:
    """Shampoo per step on one matrix in blocks: factors :math:`GG^\\top, G^\\top G`, the
    preconditioned :math:`L^{-1/4} G R^{-1/4}`, and the eigendecompositions (about
    :math:`9p^3`) every ``frequency`` steps."""
    out = 0.0
    for p, q in _blocks(shape, block):
        out += 2 * p * p * q + 2 * p * q * q          # statistics
        out += 2 * p * p * q + 2 * p * q * q          # preconditioning
        out += 9.0 * (p ** 3 + q ** 3) / frequency    # roots
    return out + 10.0 * _numel(shape)                 # grafting (Adam)


def soap_flops(shape: Shape, block: int, frequency: int) -> float:
    """SOAP per step: statistics, projection into the eigenbases and back, Adam in the
    rotated space, and a QR-based refresh of the eigenbases every ``frequency`` steps."""
    out = 0.0
    for p, q in _blocks(shape, block):
        out += 3 * (2 * p * p * q + 2 * p * q * q)    # statistics, project, project back
        out += (2 * p ** 3 + 4.0 / 3 * p ** 3 + 2 * q ** 3 + 4.0 / 3 * q ** 3) / frequency
    return out + 10.0 * _numel(shape)


# --- the step ---------------------------------------------------------------------------------

@dataclass
class ModeCost:
    """One row of the table: per rank per step (the busiest rank's bytes and flops)."""
    mode: str
    sent: float
    received: float
    calls: float
    flops: float
    comm_s: float
    compute_s: float
    time_s: float
    note: str = ""


def _time(kinds: dict[str, float], nbytes: float, world: int, net: Interconnect) -> float:
    alpha, beta = net.link(world)
    hops = {"all_to_all": world - 1, "all_gather": world - 1, "reduce_scatter": world - 1,
            "all_reduce": 2 * (world - 1)}
    return sum(n * hops[k] * alpha for k, n in kinds.items()) + nbytes / beta


def _row(mode: str, t: RankTraffic, flops: float, world: int, net: Interconnect,
         overlap_buckets: int = 0, note: str = "") -> ModeCost:
    nbytes = max(max(t.sent), max(t.received))
    comm = _time(t.kinds, nbytes, world, net) if world > 1 else 0.0
    compute = flops / (net.tflops * 1e12)
    total = comm + compute
    if overlap_buckets:
        total = max(comm, compute) + min(comm, compute) / overlap_buckets
    return ModeCost(mode, max(t.sent), max(t.received), t.calls, flops, comm, compute, total,
                    note)


def _loads(shapes: list[Shape], owner: list[int], world: int, flops) -> float:
    per = [0.0] * world
    for s, o in zip(shapes, owner):
        per[o] += flops(s)
    return max(per)


def _scaled(t: RankTraffic, f: float) -> RankTraffic:
    return RankTraffic([x * f for x in t.sent], [x * f for x in t.received], t.calls * f,
                       {k: v * f for k, v in t.kinds.items()})


def step_costs(leaves: list[Leaf], world: int, net: Interconnect | None = None, *,
               itemsize: int = 4, buckets: int = 4, muonbp_every: int = 5,
               dion_rank_fraction: float = 0.25, block: int = 1024, frequency: int = 10,
               chunk_mb: float = 32.0, gram_restarts: int = 1) -> list[ModeCost]:
    """Every mode's row for ``leaves`` over ``world`` ranks (see the module docstring)."""
    net = net or Interconnect()
    mats = [lf.shape for lf in leaves if lf.matrix]
    rest = [lf.shape for lf in leaves if not lf.matrix]
    numel = sum(_numel(lf.shape) for lf in leaves)
    rest_flops = 12.0 * sum(_numel(s) for s in rest) / world      # AdamW on local shards
    rows = []
    # AdamW under ZeRO-2: gradients reduce-scattered, updates all-gathered, 1/W of the work
    rows.append(_row("adamw_zero2", ideal_zero_traffic(numel, world, itemsize, chunk_mb),
                     12.0 * numel / world, world, net, note="replicated grads in"))
    rows.append(_row("adamw_fsdp", RankTraffic([0], [0], 0, {}), 12.0 * numel / world,
                     world, net, note="local shards, no collective"))
    dims = [0] * len(mats)
    owners = owners_traffic(mats, dims, world, itemsize=itemsize)
    owner = owner_assignment(mats, world)
    muon_x = _loads(mats, owner, world, lambda s: ns_flops(*s)) + rest_flops
    n_buckets = bucket_count(mats, itemsize, buckets=buckets, by_shape=True)
    rows.append(_row("muon_owners", owners, muon_x, world, net))
    rows.append(_row("muon_owners_overlap", _with_buckets(owners, n_buckets), muon_x, world,
                     net, overlap_buckets=n_buckets, note=f"{n_buckets} buckets"))
    rows.append(_row("normuon_owners", owners, muon_x + 6.0 * sum(map(_numel, mats)) / world,
                     world, net))
    # Gram: the unsharded dim is K; a Gram larger than the matrix goes to owners
    grams = [s for s in mats if s[1] <= s[0]]
    fallback = [s for s in mats if s[1] > s[0]]
    for variant in ("iter", "once"):
        exchanges = NS_STEPS if variant == "iter" else 1 + gram_restarts
        t = gram_traffic(grams, [0] * len(grams), world, exchanges, itemsize=itemsize)
        x = rest_flops
        for m, k in grams:
            ml = math.ceil(m / world)
            if variant == "iter":
                x += NS_STEPS * (4.0 * ml * k * k + 2.0 * k ** 3)
            else:
                x += NS_STEPS * 4.0 * k ** 3 + (1 + gram_restarts) * 4.0 * ml * k * k
        if fallback:
            fb = owners_traffic(fallback, [0] * len(fallback), world, itemsize=itemsize)
            fo = owner_assignment(fallback, world)
            x += _loads(fallback, fo, world, lambda s: ns_flops(*s))
            t = RankTraffic([a + c for a, c in zip(t.sent, fb.sent)],
                            [a + c for a, c in zip(t.received, fb.received)], t.calls + fb.calls,
                            {**t.kinds, "all_to_all": fb.calls})
        rows.append(_row(f"muon_gram_{variant}", t, x, world, net,
                         note=f"{len(fallback)} leaves to owners" if fallback else ""))
    # MuonBP: block steps on the local shard, the full step (one all-reduce of the whole
    # matrices) every P
    p = muonbp_every
    block_x = sum(ns_flops(math.ceil(m / world), n) for m, n in mats) + rest_flops
    full_x = sum(ns_flops(m, n) for m, n in mats) + rest_flops   # every rank, every matrix
    t = _scaled(muonbp_full_traffic(mats, world, itemsize=itemsize, counters=0), 1.0 / p)
    rows.append(_row("muonbp", t, (p - 1) / p * block_x + full_x / p, world, net,
                     note=f"full every {p}: averages"))
    # the paper's layout of the full step, not what opttx runs: whole matrices on owners
    rows.append(_row("muonbp_owners_full", _scaled(owners, 1.0 / p),
                     (p - 1) / p * block_x + muon_x / p, world, net,
                     note=f"full step on owners every {p} (not built)"))
    # Dion: rank-r factors reduced over the row shards
    b, x = 0, rest_flops
    for m, n in mats:
        r = max(1, int(dion_rank_fraction * min(m, n)))
        b += 2 * (world - 1) * (n * r + 2 * r * r) * itemsize // world
        x += 4 * 2.0 * math.ceil(m / world) * n * r + 2.0 * r ** 3
    rows.append(_row("dion", RankTraffic([b] * world, [b] * world, 6, {"all_reduce": 6}), x,
                     world, net, note=f"rank {dion_rank_fraction:g} min(m,n)"))
    # Shampoo, SOAP: whole leaves on owners, balanced by their blocks
    blocked = owners_traffic(mats, dims, world, itemsize=itemsize, block_rows=block)
    bowner = owner_assignment(mats, world, block)
    for name, fl in (("shampoo", shampoo_flops), ("soap", soap_flops)):
        x = _loads(mats, bowner, world, lambda s, fl=fl: fl(s, block, frequency)) + rest_flops
        rows.append(_row(f"{name}_owners", blocked, x, world, net,
                         note=f"blocks {block}, refresh every {frequency}"))
    return rows


def bucket_count(shapes: Sequence[Shape], itemsize: int, buckets: int | None = None,
                 bucket_mb: float | None = None, by_shape: bool = False) -> int:
    """The number of buckets `on_owners` makes of these leaves (`owners_overlap.make_buckets`;
    ``by_shape`` for a transform that batches leaves of one shape, Muon)."""
    from .owners import OwnerPlan
    from .owners_overlap import make_buckets
    plan = OwnerPlan.of_whole_leaves(shapes)
    return len(make_buckets(plan, [_numel(s) * itemsize for s in shapes], buckets, bucket_mb,
                            by_shape))


def _with_buckets(t: RankTraffic, buckets: int) -> RankTraffic:
    return RankTraffic(t.sent, t.received, 2 * buckets, {"all_to_all": 2 * buckets})
