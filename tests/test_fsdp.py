"""FSDP2 (``fully_shard``): every alias trains a sharded model to the single-device result.

Multi-process on CPU with gloo, in the pattern of tests/test_distributed.py: one spawn per
module fixture (world 2, world 4), all cases looped inside the workers, results written as
JSON and asserted below. The model is a small transformer block whose dims (3, 9, 18) do not
split evenly over 2 or 4 ranks (world 4 leaves some ranks empty shards); ``fully_shard`` on the
MLP and on the root gives DTensor ``Shard(0)`` parameters. Each rank trains on its part of the
global batch (FSDP2 averages the gradients); every rank also trains an unwrapped copy of the
model on the whole batch with the same alias, and the parameters (``full_tensor()``) must
agree within float32 rounding after every step, through `opttx.Optimizer` and through the
functional API (``tx.update`` + `opttx.apply_updates_` on the DTensor tree).

The recipe under test: element-wise aliases run on the local shards (``sharded``: no
collective); layer-wise ones through ``sharded`` (specs read from the DTensors; Adafactor and
CAME factor on the global shapes via `global_factor_axes`); matrix transforms through
``sharded(..., on_owners=True)``.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_distributed import _finish, _init, _spawn
from torch import nn

import opttx
from opttx.distributed import (
    CollectiveStats,
    global_factor_axes,
    global_shapes,
    sharded,
    specs_from_dtensors,
)

pytestmark = pytest.mark.timeout(300)

STEPS = 5
RTOL, ATOL = 1e-5, 1e-6
D, HIDDEN, HEADS, OUT, BATCH, SEQ = 6, 9, 2, 3, 8, 4


class Block(nn.Module):
    """A pre-norm transformer block with a linear head: qkv (18, 6), fc1 (9, 6), head (3, 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        # no qkv bias: the key bias has an exactly zero gradient (softmax ignores a shift
        # of every score), and Adam would turn its rounding noise into whole steps
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2)
                   for z in self.qkv(self.norm(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        x = x + self.mlp(x)
        return self.head(x)


def _model() -> Block:
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():          # LayerNorm starts at (1, 0): perturb it so it is a real leaf
        model.norm.weight.add_(0.1 * torch.randn(D))
        model.norm.bias.add_(0.1 * torch.randn(D))
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, SEQ, D, generator=gen), torch.randn(BATCH, SEQ, OUT, generator=gen))
            for _ in range(STEPS)]


def _aliases() -> dict[str, tuple[str, int, Callable[[Any], opttx.GradientTransformation]]]:
    """``name -> (how, max collectives per step, make(factor_axes))``. ``how``: "local"
    (element-wise, `sharded` with no collective), "sharded" (layer-wise), "owners" (whole
    leaves), "dtensor" (the alias on the DTensors themselves, no `sharded`). ``make`` gets the
    named rule on one device and the tree of `global_factor_axes` under FSDP2."""
    def shampoo() -> opttx.GradientTransformation:
        # eps well above float32 rounding: the factors of 5 steps of gradients that differ by
        # rounding (FSDP2 averages per rank) are near-singular, and (L + eps I)^(-1/4) would
        # amplify 1 ulp far beyond rtol (see tests/test_owners.py)
        return opttx.shampoo(1e-2, betas=(0.9, 0.999), epsilon=1e-3, max_preconditioner_dim=8,
                             precondition_frequency=2, start_preconditioning_step=2,
                             grafting="adam", weight_decay=0.01)

    return {
        "adam": ("local", 0, lambda ax: opttx.adam(1e-2)),
        "adamw": ("local", 0, lambda ax: opttx.adamw(1e-2, weight_decay=0.1)),
        "lion": ("local", 0, lambda ax: opttx.lion(1e-3, weight_decay=0.1)),
        "adafactor": ("sharded", 2, lambda ax: opttx.adafactor(
            1e-2, min_dim_size_to_factor=1, momentum=0.9, weight_decay_rate=0.01,
            factor_axes=ax("largest"))),
        "came": ("sharded", 3, lambda ax: opttx.came(1e-3, weight_decay=0.01,
                                                      factor_axes=ax("last"))),
        "lamb": ("sharded", 1, lambda ax: opttx.lamb(1e-2, weight_decay=0.01)),
        "lars": ("sharded", 1, lambda ax: opttx.lars(1e-1, weight_decay=1e-3)),
        "clip_adamw": ("sharded", 1, lambda ax: opttx.chain(opttx.clip_by_global_norm(0.1),
                                                            opttx.adamw(1e-2, weight_decay=0.01))),
        "galore_adamw": ("owners", 2, lambda ax: opttx.galore_adamw(
            1e-2, rank=2, update_proj_gap=2, weight_decay=0.01)),
        "shampoo": ("owners", 2, lambda ax: shampoo()),
        "adamw_8bit": ("owners", 2, lambda ax: opttx.adamw_8bit(1e-2, block_size=16,
                                                                 min_size=16)),
        "adamw_4bit": ("owners", 2, lambda ax: opttx.adamw_4bit(1e-2, block_size=16,
                                                                 min_size=16)),
        "adamw_bf16_ecc": ("owners", 2, lambda ax: opttx.chain(
            opttx.quantize_state(opttx.scale_by_adam(), format="bf16_ecc", min_size=16),
            opttx.scale_by_learning_rate(1e-2))),
        # whole leaves on their owners: the named rule sees the global shapes by itself
        "adafactor_owners": ("owners", 2, lambda ax: opttx.adafactor(
            1e-2, min_dim_size_to_factor=1, factor_axes="largest")),
        "adamw_dtensor": ("dtensor", 0, lambda ax: opttx.adamw(1e-2, weight_decay=0.1)),
    }


def _stepper(model: torch.nn.Module, tx: opttx.GradientTransformation, api: str
             ) -> Callable[[], None]:
    """One optimizer step of ``model`` from its ``.grad``s, then the grads zeroed: through
    `opttx.Optimizer` (``api="optimizer"``) or ``tx.update`` + ``apply_updates_`` on the
    parameters' own storage (``"functional"``)."""
    if api == "optimizer":
        opt = opttx.Optimizer(model.named_parameters(), tx)

        def step() -> None:
            opt.step()
            opt.zero_grad()
        return step
    named = dict(model.named_parameters())
    params = {k: p.detach() for k, p in named.items()}     # the same storage
    state = [tx.init(params)]

    def step() -> None:
        grads = {k: p.grad for k, p in named.items()}
        updates, state[0] = tx.update(grads, state[0], params)
        opttx.apply_updates_(params, updates)
        model.zero_grad()
    return step


def _reference(make: Callable, batches: list, api: str = "optimizer"
               ) -> list[dict[str, torch.Tensor]]:
    """The single-device run: the unwrapped model on the whole batch, every step's params,
    through the same API (`opttx.Optimizer` runs the transform with its hyperparameters
    injected as float32 tensors, the functional path with the Python floats given: CAME's
    instability term tells the two apart by 1e-4 relative at step 0)."""
    model = _model()
    step = _stepper(model, make(lambda rule: rule), api)
    out = []
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        step()
        out.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return out


def _fsdp_model(world: int) -> Block:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    fully_shard(model.mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _run_fsdp(how: str, make: Callable, api: str, batches: list, expected: list,
              rank: int, world: int) -> list[int]:
    """Train the FSDP2 model on this rank's part of every batch; compare the whole params
    with ``expected`` after every step; return the collectives opttx issued per step."""
    model = _fsdp_model(world)
    named = dict(model.named_parameters())
    stats = CollectiveStats()
    axes = (lambda rule: global_factor_axes(named, None, rule, 1))
    inner = make(axes)
    tx = inner if how == "dtensor" else sharded(inner, stats=stats,
                                                on_owners=how == "owners")
    optimizer_step = _stepper(model, tx, api)
    counts, mismatches = [], []
    for step, ((x, y), want) in enumerate(zip(batches, expected)):
        xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
        F.mse_loss(model(xs), ys).backward()
        stats.reset()
        optimizer_step()
        counts.append(stats.collectives)
        # every rank gathers every param (collectives in step) before any comparison fails
        whole = {k: p.detach().full_tensor() for k, p in model.named_parameters()}
        for k, p in whole.items():
            try:
                torch.testing.assert_close(p, want[k], rtol=RTOL, atol=ATOL)
            except AssertionError as e:
                mismatches.append(f"step {step}, {k}: {e}")
    assert not mismatches, "\n".join(mismatches[:3])
    return counts


def _layout(world: int, rank: int) -> dict[str, Any]:
    """Local shapes, spec sizes and global shapes of the FSDP2 params (uneven, padded splits)."""
    model = _fsdp_model(world)
    named = {k: p.detach() for k, p in model.named_parameters()}
    full = dict(_model().named_parameters())
    specs = specs_from_dtensors(named)
    out: dict[str, Any] = {"problems": []}
    shapes = dict(zip(named, global_shapes(named)))
    for k, p in named.items():
        local = p.to_local()
        pieces = torch.chunk(full[k].detach(), world, dim=0)    # FSDP2's split
        piece = pieces[rank] if rank < len(pieces) else full[k].detach()[:0]
        (spec,) = specs[k]
        for what, got, exp in (("local shape", tuple(local.shape), tuple(piece.shape)),
                               ("global shape", shapes[k], tuple(full[k].shape)),
                               ("spec", (spec.dim, spec.size), (0, full[k].shape[0]))):
            if got != exp:
                out["problems"].append(f"{k}: {what} {got}, expected {exp}")
        if local.shape == piece.shape and not torch.equal(local, piece):
            out["problems"].append(f"{k}: the local shard is not its rows of the tensor")
    out["uneven"] = sorted(k for k, p in full.items() if p.shape[0] % world)
    return out


def _resume(how: str, make: Callable, batches: list, rank: int, world: int) -> bool:
    """Train 2 steps, save `opttx.Optimizer.state_dict`, load it into a fresh optimizer over a
    copy of the FSDP2 model, and take the other steps with both: bit-identical params."""
    def build() -> tuple[Block, opttx.Optimizer]:
        model = _fsdp_model(world)
        named = dict(model.named_parameters())
        inner = make(lambda rule: global_factor_axes(named, None, rule, 1))
        return model, opttx.Optimizer(model.named_parameters(), sharded(
            inner, on_owners=how == "owners"))

    def step(model: Block, opt: opttx.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(model(x.tensor_split(world)[rank]), y.tensor_split(world)[rank]).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for x, y in batches[:2]:
        step(model, opt, x, y)
    copy, opt2 = build()
    with torch.no_grad():
        for a, b in zip(copy.parameters(), model.parameters()):
            a.to_local().copy_(b.to_local())
    opt2.load_state_dict(opt.state_dict())
    for x, y in batches[2:]:
        step(model, opt, x, y)
        step(copy, opt2, x, y)
    return all(torch.equal(a.to_local(), b.to_local())
               for a, b in zip(copy.parameters(), model.parameters()))


def _worker(rank: int, world: int, store: str, out: str, apis: list[str],
            names: list[str]) -> None:
    _init(rank, world, store)
    # FSDP2 warns that a wrapped module returned a view (Linear on 3-d input); no in-place op
    # follows here
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    results: dict[str, Any] = {"errors": {}, "counts": {}, "layout": _layout(world, rank)}
    batches = _batches()
    for name in names:
        how, _, make = _aliases()[name]
        for api in apis:
            expected = _reference(make, batches, api)
            key = f"{name}/{api}"
            try:
                results["counts"][key] = _run_fsdp(how, make, api, batches, expected, rank,
                                                   world)
            except Exception:  # noqa: BLE001 - reported by the tests
                results["errors"][key] = traceback.format_exc(limit=3)
    if world == 2:
        for name in ("adamw", "lamb", "adafactor", "shampoo"):
            how, _, make = _aliases()[name]
            try:
                results.setdefault("resume", {})[name] = _resume(how, make, batches, rank,
                                                                 world)
            except Exception:  # noqa: BLE001 - reported by the test
                results.setdefault("resume", {})[name] = traceback.format_exc(limit=3)
        # a matrix transform on local shards: the library's clear error, on every rank
        model = _fsdp_model(world)
        try:
            opt = opttx.Optimizer(model.named_parameters(), sharded(opttx.shampoo(1e-2)))
            F.mse_loss(model(batches[0][0][:4]), batches[0][1][:4]).backward()
            opt.step()
            results["refused"] = None
        except ValueError as e:
            results["refused"] = str(e)
    _finish(out, rank, results)


# ---------------------------------------------------------------------------------------------
# fixtures: one spawn each
# ---------------------------------------------------------------------------------------------


NAMES = list(_aliases())
# world 4 on a 2-core machine is slow: one or two aliases of each kind (local, sharded with
# global factoring decisions on empty shards, sharded, owners)
NAMES_4 = ["adamw", "adafactor", "lamb", "shampoo", "adamw_8bit"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_worker, 2, tmp_path_factory.mktemp("fsdp2"), ["optimizer", "functional"],
                  NAMES)


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(_worker, 4, tmp_path_factory.mktemp("fsdp4"), ["optimizer"], NAMES_4)


def _check(results: list[dict], name: str, apis: list[str]) -> None:
    how, bound, _ = _aliases()[name]
    for rank, res in enumerate(results):
        for api in apis:
            key = f"{name}/{api}"
            assert key not in res["errors"], f"rank {rank}: {res['errors'][key]}"
            counts = res["counts"][key]
            assert len(counts) == STEPS
            assert max(counts) <= bound, f"rank {rank}, {key}: {counts} collectives per step"
            if how == "owners":
                assert min(counts) >= 2, f"{key}: {counts} (gather to owners, scatter back)"


@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_world2_equals_single_device(world2: list[dict], name: str) -> None:
    """World 2, uneven dim-0 splits: the FSDP2 model trained by the alias through
    opttx.Optimizer and through the functional API has the single-device params after each of
    5 steps (rtol 1e-5), with at most the alias's bound of collectives per step."""
    if name == "adamw_dtensor" and torch.__version__ < "2.13":
        pytest.skip("DTensor of torch < 2.13 has no sharding rule for _foreach_lerp.Scalar")
    _check(world2, name, ["optimizer", "functional"])


@pytest.mark.parametrize("name", NAMES_4)
def test_fsdp2_world4_equals_single_device(world4: list[dict], name: str) -> None:
    """World 4 (empty shards on some ranks), through opttx.Optimizer."""
    _check(world4, name, ["optimizer"])


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_layout(world2: list[dict], world4: list[dict], world: int) -> None:
    """FSDP2's local shards are torch.chunk's dim-0 pieces (no padding visible through
    to_local), and the specs and global shapes read from the DTensors are the model's."""
    results = world2 if world == 2 else world4
    for rank, res in enumerate(results):
        assert res["layout"]["problems"] == [], f"rank {rank}: {res['layout']['problems']}"
    uneven = results[0]["layout"]["uneven"]
    assert "head.weight" in uneven and "mlp.0.weight" in uneven


def test_optimizer_state_dict_resumes_fsdp2_training(world2: list[dict]) -> None:
    """state_dict / load_state_dict of an opttx.Optimizer over FSDP2 params (local,
    layer-wise and owner-held state) resumes bit-identically."""
    for rank, res in enumerate(world2):
        assert set(res["resume"]) == {"adamw", "lamb", "adafactor", "shampoo"}
        for name, ok in res["resume"].items():
            assert ok is True, f"rank {rank}, {name}: {ok}"


def test_matrix_transform_on_fsdp2_shards_is_refused(world2: list[dict]) -> None:
    """Shampoo on FSDP2's local shards without on_owners: a ValueError naming the fix."""
    for res in world2:
        assert res["refused"] is not None and "on_owners" in res["refused"], res["refused"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stochastic_rounding", [False, True])
def test_optimizer_writes_dtensor_and_plain_params(world_of_one: None,
                                                   stochastic_rounding: bool) -> None:
    """opttx.Optimizer over DTensor and plain parameters at once (a parallelize_module model,
    bf16 DTensors with stochastic rounding) moves them exactly as over plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen),
              torch.randn(5, 2, generator=gen).bfloat16()]
    grads = [[torch.randn(v.shape, generator=gen).to(v.dtype) for v in values]
             for _ in range(3)]
    is_dt = [True, False, True]

    def run(dtensors: bool) -> list[torch.Tensor]:
        params = [nn.Parameter(distribute_tensor(v.clone(), mesh, [DShard(0)])
                               if dtensors and d else v.clone()) for v, d in zip(values, is_dt)]
        tx = opttx.adamw(1e-2, weight_decay=0.1)
        opt = opttx.Optimizer(params, sharded(tx) if dtensors else tx,
                              stochastic_rounding=stochastic_rounding,
                              generator=torch.Generator().manual_seed(1))
        for step in grads:
            for p, g, d in zip(params, step, is_dt):
                p.grad = distribute_tensor(g, mesh, [DShard(0)]) if dtensors and d else g
            opt.step()
        return [p.detach().full_tensor() if dtensors and d else p.detach()
                for p, d in zip(params, is_dt)]

    for got, want, v in zip(run(True), run(False), values):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not torch.equal(got, v)
