"""Tensor parallel x data parallel training of a small byte-level GPT with an opttx optimizer.

Run (CPU, gloo; ``nproc_per_node`` must equal ``tp * dp``):

    torchrun --standalone --nproc_per_node 4 examples/tp_dp_train.py --tp 2 --dp 2 --check
    torchrun --standalone --nproc_per_node 2 examples/tp_dp_train.py --tp 2 --dp 1 \
        --optimizer lamb --check
    torchrun --standalone --nproc_per_node 4 examples/tp_dp_train.py --tp 2 --dp 2 \
        --zero 2 --optimizer came --check

What it shows:

* the ranks form a 2-D device mesh ``(dp, tp)``; every block's attention (q, k, v column-
  parallel, output row-parallel) and MLP (up column-parallel, down row-parallel) are split over
  the ``tp`` mesh dim with `torch.distributed.tensor.parallel.parallelize_module`, so those
  weights are `DTensor` shards; embeddings, layer norms and the head stay plain, whole tensors;
* each ``dp`` rank trains on its own micro-batch of the global batch;
* the optimizer is one opttx chain, unchanged from single-device code apart from two wrappers:
  ``sharded(chain(all_reduce_gradients(dp_group), alias))``. `all_reduce_gradients` averages
  gradients over the data-parallel group in flat buckets; `sharded` reads the specs from the
  `DTensor` placements and turns every layer-wise statistic of the alias (Adafactor's row and
  column means and RMS, LAMB's trust-ratio norms) into a few batched all-reduces over the
  tensor-parallel group, so the sharded step is exact;
* with ``--zero 1|2`` the chain is ``sharded(zero(alias, dp_group, stage))`` instead: each
  data-parallel rank keeps the optimizer state of the parameters it owns (chosen on the global
  shapes, so both tensor-parallel shards of a parameter have the same owner), gradients are
  reduce-scattered (stage 2) or all-reduced (stage 1) over ``dp`` in chunks and the updates
  all-gathered, while the alias's statistics are still reduced over ``tp``. GaLore, which
  needs whole matrices, runs on owner ranks of the ``tp`` group (`on_owners`) either way;
* with ``--check``, rank 0 also trains the unsharded model (same seed, the whole global batch,
  the plain alias) in one process and the script fails unless the two loss curves agree to a
  relative difference of at most ``1e-4`` at every step (``--rtol``). It also checks, every
  step, that the gradients of the parameters outside tensor parallelism are the same on all
  tensor-parallel ranks (so the replicated weights never drift apart) and counts the `DTensor`
  gradients not placed like their parameter (a ``Partial`` one is reduced before the optimizer
  sees it; with this plan autograd gives none).

Adafactor and CAME decide which leaves to factor from their shapes; the decision is made once
on the global shapes (`opttx.distributed.global_factor_axes`): with ``--tp 4`` a column-
parallel (64, 64) weight is a (16, 64) shard, below ``min_dim_size_to_factor=32`` locally but
factored on one device.
"""

from __future__ import annotations

import argparse
import ast
import copy
import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import opttx
from opttx.distributed import (CollectiveStats, all_reduce_gradients, global_factor_axes,
                               on_owners, sharded, zero)
from opttx.testing import exit_rank

OPTIMIZERS = ("adafactor", "lamb", "adamw", "came", "lars", "galore_adamw")
WHOLE_MATRICES = ("galore_adamw",)  # run on owner ranks of the TP group (on_owners)
GRAD_RTOL = 1e-6    # plain gradients across TP ranks (they come out bit-identical)

# ---------------------------------------------------------------------------------------------
# the model: a pre-norm GPT whose attention works on however many heads its shard holds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Sizes of the model and of one step's batch."""
    vocab: int = 256            # byte-level
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 32
    micro_batch: int = 4        # sequences per data-parallel rank and step


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (each column-parallel: a rank
    holds whole heads) and an output projection (row-parallel)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:     # (b, t, local heads * hd) -> (b, h, t, hd)
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                           is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """``down(gelu(up(x)))``: up column-parallel, down row-parallel."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, a final norm and an untied head."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def tp_plan(cfg: Config) -> dict[str, Any]:
    """Megatron-style plan for `parallelize_module`: column-parallel projections into the
    heads and the MLP's hidden layer, row-parallel projections out of them."""
    plan: dict[str, Any] = {}
    for i in range(cfg.n_layers):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.out", "mlp.down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---------------------------------------------------------------------------------------------
# data: bytes of a standard-library source file, no download
# ---------------------------------------------------------------------------------------------


def corpus() -> torch.Tensor:
    """The bytes of the ``ast`` module's source, as int64 token ids."""
    data = Path(ast.__file__).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def global_batch(data: torch.Tensor, step: int, seed: int, n: int, seq_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` sequences (inputs, next-byte targets) of one step, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, data.numel() - seq_len - 1, (n,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    rows = data[idx]
    return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------------------------
# the optimizer
# ---------------------------------------------------------------------------------------------


def make_alias(name: str, lr: float, factor_axes: Any = "largest") -> opttx.GradientTransformation:
    """The plain (single-device) opttx alias ``name``; ``factor_axes`` for the factored ones."""
    makers: dict[str, Callable[[], opttx.GradientTransformation]] = {
        "adafactor": lambda: opttx.adafactor(lr, min_dim_size_to_factor=32,
                                             factor_axes=factor_axes),
        "lamb": lambda: opttx.lamb(lr, weight_decay=0.01),
        "adamw": lambda: opttx.adamw(lr, weight_decay=0.01),
        "came": lambda: opttx.came(lr / 20, weight_decay=0.01, factor_axes=factor_axes,
                                   min_dim_size_to_factor=32),
        "lars": lambda: opttx.lars(50 * lr, weight_decay=1e-4, momentum=0.9),
        "galore_adamw": lambda: opttx.galore_adamw(lr, rank=8, update_proj_gap=4,
                                                   weight_decay=0.01),
    }
    return makers[name]()


def distributed_optimizer(name: str, lr: float, params: dict[str, torch.Tensor], dp_group: Any,
                          tp_group: Any, stats: CollectiveStats | None = None,
                          zero_stage: int = 0) -> opttx.GradientTransformation:
    """``sharded(chain(all_reduce_gradients(dp_group), alias))``, or with ``zero_stage``
    ``sharded(zero(alias, dp_group, stage))``; specs read from the DTensor parameters. The
    factored aliases decide which leaves to factor (and over which axes) on the global shapes:
    on a column-parallel shard the "largest" dims could rank differently or fall below
    ``min_dim_size_to_factor`` (see `global_factor_axes`). GaLore needs whole matrices: it runs
    on owner ranks of the tensor-parallel group (`on_owners`)."""
    axes = (global_factor_axes(params, None, "largest", 32) if name in ("adafactor", "came")
            else "largest")
    alias = make_alias(name, lr, axes)
    if name in WHOLE_MATRICES:
        alias = on_owners(alias, owner_group=tp_group)
    if zero_stage:
        return sharded(zero(alias, dp_group, stage=zero_stage, stats=stats), stats=stats)
    return sharded(opttx.chain(all_reduce_gradients(dp_group, stats=stats), alias),
                   stats=stats)


# ---------------------------------------------------------------------------------------------
# gradients under tensor parallelism
# ---------------------------------------------------------------------------------------------


def gradients(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradient of every parameter, a DTensor gradient with its parameter's placements.

    Autograd through `parallelize_module` gives a `DTensor` parameter a gradient with the same
    placements; should one come back ``Partial`` (a sum still owed over the mesh dim), it is
    reduced here, since the optimizer must see the whole gradient of its shard.
    """
    out = {}
    for k, p in params.items():
        g = p.grad
        if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
        out[k] = g
    return out


def describe_placements(params: dict[str, torch.Tensor]) -> str:
    """How many parameter tensors have each placement (plain tensors: "whole")."""
    counts: dict[str, int] = {}
    for p in params.values():
        key = str(tuple(p.placements)) if isinstance(p, DTensor) else "whole"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def apply_updates_(params: dict[str, torch.Tensor], updates: dict[str, torch.Tensor]) -> None:
    """`opttx.apply_updates_` once on the DTensor leaves and once on the plain ones (one
    grouped ``_foreach_add_`` cannot take a mix of the two)."""
    is_dt = {k: isinstance(p, DTensor) for k, p in params.items()}
    for kind in (True, False):
        keys = [k for k in params if is_dt[k] is kind]
        opttx.apply_updates_({k: params[k] for k in keys}, {k: updates[k] for k in keys})


def check_gradients(params: dict[str, torch.Tensor], tp_group: Any) -> tuple[int, float]:
    """Check the gradients autograd left on ``params`` (before `gradients`).

    Returns the number of DTensor gradients whose placements differ from their parameter's
    (a ``Partial`` one among them: `gradients` reduces it), and the largest relative
    difference across ``tp_group`` of the plain gradients (embeddings, norms, head: outside
    tensor parallelism, so they must agree on every tensor-parallel rank for the replicated
    weights to stay identical; 0 when bit-identical).
    """
    plain, differ = [], 0
    for k, p in params.items():
        g = p.grad
        assert isinstance(g, DTensor) == isinstance(p, DTensor), k
        if isinstance(p, DTensor):
            differ += tuple(g.placements) != tuple(p.placements)
        else:
            plain.append(g.reshape(-1))
    flat = torch.cat(plain)
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, dist.ReduceOp.MAX, group=tp_group)
    dist.all_reduce(low, dist.ReduceOp.MIN, group=tp_group)
    return differ, float((high - low).abs().max() / flat.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def train_distributed(model: nn.Module, args: argparse.Namespace, cfg: Config, mesh: DeviceMesh,
                      data: torch.Tensor) -> tuple[list[float], bool]:
    """Tensor-parallel x data-parallel training: the loss curve (mean over the global batch)
    and, with ``--check``, whether the plain gradients agreed across the TP ranks."""
    parallelize_module(model, mesh["tp"], tp_plan(cfg))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    dp_rank = mesh.get_local_rank("dp")
    params = dict(model.named_parameters())
    stats = CollectiveStats()
    tx = distributed_optimizer(args.optimizer, args.lr, params, dp_group, tp_group, stats,
                               args.zero)
    state = tx.init(params)
    curve, worst, differ = [], 0.0, 0
    for step in range(args.steps):
        x, y = global_batch(data, step, args.seed, cfg.micro_batch * args.dp, cfg.seq_len)
        mine = slice(dp_rank * cfg.micro_batch, (dp_rank + 1) * cfg.micro_batch)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x[mine], y[mine])
        loss.backward()
        if args.check:
            n, diff = check_gradients(params, tp_group)
            differ, worst = differ + n, max(worst, diff)
        grads = gradients(params)
        stats.reset()
        with torch.no_grad():         # the step builds no autograd graph (nor does its state)
            updates, state = tx.update(grads, state, params)
            apply_updates_(params, updates)
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        curve.append(mean.item() / args.dp)
    if dist.get_rank() == 0:
        what = (f"ZeRO stage {args.zero} chunks over dp" if args.zero else
                "data-parallel gradient buckets")
        print(f"optimizer step: {stats.collectives} collectives, {stats.bytes / 1024:.1f} KiB "
              f"({what} and tensor-parallel statistics)")
    if args.check and dist.get_rank() == 0:
        print(f"parameter placements on the tp mesh dim: {describe_placements(params)}")
        print(f"DTensor gradients not placed like their parameter (reduced first): {differ}; "
              f"plain gradients across TP ranks: max relative difference {worst:.1e} "
              f"(tolerance {GRAD_RTOL:.0e})")
    return curve, worst <= GRAD_RTOL


def train_reference(model: nn.Module, args: argparse.Namespace, cfg: Config,
                    data: torch.Tensor) -> list[float]:
    """The same run in one process: the unsharded model, the whole global batch, the plain
    alias (factored on the same global shapes)."""
    params = dict(model.named_parameters())
    tx = make_alias(args.optimizer, args.lr)
    state = tx.init(params)
    curve = []
    for step in range(args.steps):
        x, y = global_batch(data, step, args.seed, cfg.micro_batch * args.dp, cfg.seq_len)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        grads = {k: p.grad for k, p in params.items()}
        with torch.no_grad():
            updates, state = tx.update(grads, state, params)
            opttx.apply_updates_(params, updates)
        curve.append(loss.item())
    return curve


def compare(dist_curve: list[float], ref_curve: list[float], rtol: float) -> bool:
    """Print both curves side by side; whether every step agrees to ``rtol`` (relative)."""
    print(f"{'step':>4}  {'TPxDP loss':>12}  {'reference':>12}  {'rel. diff':>9}")
    ok = True
    for i, (a, b) in enumerate(zip(dist_curve, ref_curve)):
        rel = abs(a - b) / max(abs(b), 1e-30)
        ok &= rel <= rtol
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {rel:>9.1e}")
    worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(dist_curve, ref_curve))
    verdict = "MATCH" if ok else "MISMATCH"
    print(f"{verdict}: loss curves agree to max relative difference {worst:.1e} "
          f"(tolerance {rtol:.0e}) over {len(dist_curve)} steps")
    return ok


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adafactor")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel degree (default: world size // tp)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2), default=0,
                        help="ZeRO stage over the data-parallel group (0: none; state "
                             "replicated, gradients all-reduced)")
    parser.add_argument("--check", action="store_true",
                        help="also train the single-process reference and compare")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="largest relative loss difference per step that --check accepts")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)            # ranks share few cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    world, rank = dist.get_world_size(), dist.get_rank()
    args.dp = args.dp or world // args.tp
    cfg = Config()
    if args.tp * args.dp != world or cfg.n_heads % args.tp:
        raise SystemExit(f"--tp {args.tp} x --dp {args.dp} must equal the world size {world}, "
                         f"and tp must divide n_heads={cfg.n_heads}")
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    data = corpus()
    torch.manual_seed(args.seed)        # the same initial weights on every rank
    model = GPT(cfg)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    curve, ok = train_distributed(model, args, cfg, mesh, data)
    if rank == 0:
        print(f"{args.optimizer}: tp={args.tp} dp={args.dp} zero={args.zero}, "
              f"{sum(1 for _ in model.parameters())} "
              f"parameter tensors, {args.steps} steps, final loss {curve[-1]:.4f} "
              f"(log 256 = {math.log(256):.4f})")
        if reference is not None:
            ok &= compare(curve, train_reference(reference, args, cfg, data), args.rtol)
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)               # every rank exits with the common verdict
    dist.barrier()
    dist.destroy_process_group()
    return int(flag.item() != 0)


if __name__ == "__main__":
    # The device mesh and the DTensors still hold gloo process groups after
    # destroy_process_group; exit without the interpreter's shutdown (see
    # opttx.testing.exit_rank).
    exit_rank(main())
