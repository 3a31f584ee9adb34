"""opttx.distributed.state_dict / load_state_dict with torch.distributed.checkpoint: a state
saved at one world size loads at another and training continues bit-identically.

The problem is built so that every run is exact: every rank passes the same full gradient
(dyadic values, a function of the parameters and the step), so the mean over 1, 2 or 4 ranks
is the gradient itself, bit for bit, and a transform on whole leaves gives the single-device
numbers wherever it runs. So a run checkpointed after ``K`` steps at one world size and resumed
at another must end, after ``N`` more steps, with parameters ``torch.equal`` to the
uninterrupted single-device run.

Order of the runs (module fixtures): single device saves (``1``); world 4 loads that and goes
on (``1 -> 4``), and saves its own; world 2 loads the world-4 checkpoint (``4 -> 2``); the
test process loads it again on one device (``4 -> 1``). One spawn per world size.
"""

from __future__ import annotations

import datetime
import io
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import opttx
from opttx.distributed import (Shard, check_checkpoint, global_factor_axes, load_checkpoint,
                               load_state_dict, on_owners, param_paths, sharded, state_dict,
                               zero, zero_plan)
from opttx.testing import _start_method, exit_rank, gradient_stream, run_transform
from opttx.tree import tree_flatten, tree_map

pytestmark = pytest.mark.timeout(300)

K, N = 3, 3        # steps before the checkpoint, steps after it
CHUNK = 256 / (1 << 20)

INNER: dict[str, Callable[[], opttx.GradientTransformation]] = {
    "zero_adamw": lambda: opttx.adamw(1e-2, weight_decay=0.01),
    "zero_adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=1, momentum=0.9),
    "zero_adamw_8bit": lambda: opttx.adamw_8bit(1e-3, min_size=12, block_size=16),
    "owners_shampoo": lambda: opttx.shampoo(1e-2, max_preconditioner_dim=6,
                                            precondition_frequency=2,
                                            start_preconditioning_step=2),
    "owners_galore": lambda: opttx.galore_adamw(1e-2, rank=2, update_proj_gap=2),
}
CASES = list(INNER)


def _params() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(6, 5, generator=gen),
            "layers": [{"w": torch.randn(5, 5, generator=gen),
                        "n": torch.randn(5, generator=gen)} for _ in range(3)],
            "head": torch.randn(5, 2, 4, generator=gen)}


def _grad(params: dict, step: int) -> dict:
    """Multiples of 1/64 from the parameters and the step: exact sums and means."""
    gen = torch.Generator().manual_seed(1000 + step)
    return tree_map(lambda p: ((p * 0.5 + torch.randn(p.shape, generator=gen)) * 64).round()
                    / 64, params)


def _distributed(name: str) -> opttx.GradientTransformation:
    if name.startswith("zero"):
        return zero(INNER[name](), chunk_size_mb=CHUNK)
    return sharded(on_owners(INNER[name]()))


def _owned(name: str, params: dict) -> Any:
    """`quantize_state` alone under zero has no field to read ownership from: give the plan."""
    if name == "zero_adamw_8bit" and dist.is_initialized():
        return zero_plan(params, dist.get_world_size(), CHUNK)
    return None


def _train(tx: opttx.GradientTransformation, params: dict, state: Any, start: int,
           stop: int) -> tuple[dict, Any]:
    for step in range(start, stop):
        updates, state = tx.update(_grad(params, step), state, params)
        params = opttx.apply_updates(params, updates)
    return params, state


def _reference(name: str) -> dict:
    tx = INNER[name]()
    params = _params()
    return _train(tx, params, tx.init(params), 0, K + N)[0]


def _equal(a: Any, b: Any) -> bool:
    """The same tree structure and every leaf bitwise equal."""
    (xs, spec_a), (ys, spec_b) = tree_flatten(a), tree_flatten(b)
    return spec_a == spec_b and all(torch.equal(x, y) for x, y in zip(xs, ys))


def _save(tx: opttx.GradientTransformation, name: str, path: Path) -> None:
    params = _params()
    params, state = _train(tx, params, tx.init(params), 0, K)
    dcp.save({"params": params, "optim": state_dict(state, params, owned=_owned(name, params))},
             checkpoint_id=str(path))


def _resume(tx: opttx.GradientTransformation, name: str, path: Path) -> dict:
    """Load ``path`` into a fresh ``tx.init`` of this run and train to the end."""
    params = tree_map(torch.zeros_like, _params())
    state = tx.init(params)
    owned = _owned(name, params)
    sd = {"params": params, "optim": state_dict(state, params, owned=owned)}
    check_checkpoint(sd["optim"], dcp.FileSystemReader(str(path)).read_metadata(), "optim")
    dcp.load(sd, checkpoint_id=str(path))
    state = load_state_dict(state, sd["optim"], params, owned=owned)
    return _train(tx, params, state, K, K + N)[0]


def _writers(path: Path, world: int) -> bool:
    """Each parameter's optimizer state is written by its owner under zero, and only by it;
    the step count once."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    owners = zero_plan(_params(), world, CHUNK).owners
    names = {p: i for i, p in enumerate(param_paths(_params()))}
    files: dict[str, set[str]] = {}
    for index, info in meta.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    shared = [k for k in files if k.startswith("optim.shared.")]
    assert shared and all(len(files[k]) == 1 for k in shared), {k: files[k] for k in shared}
    for fqn, where in files.items():
        if fqn.startswith("optim.state."):
            param = next(p for p in sorted(names, key=len, reverse=True)
                         if fqn.startswith(f"optim.state.{p}."))
            assert where == {f"__{owners[names[param]]}_0.distcp"}, (fqn, where)
    return True


# ---------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------


def _attempt(results: dict, key: str, fn: Callable[[], Any]) -> None:
    try:
        results[key] = fn()
    except Exception:  # noqa: BLE001 - reported to the test
        results[key] = "error: " + traceback.format_exc(limit=4)


def _errors(root: Path, results: dict) -> None:
    """Loading a checkpoint into another chain or parameter set fails, naming the mismatch."""
    path = str(root / "w4" / "zero_adamw")
    meta = dcp.FileSystemReader(path).read_metadata()

    def message(params: dict, inner: opttx.GradientTransformation) -> str:
        tx = zero(inner, chunk_size_mb=CHUNK)
        state = tx.init(params)
        try:
            check_checkpoint(state_dict(state, params), meta, "optim")
        except ValueError as e:
            return str(e)
        return "no error"

    results["other_chain"] = message(_params(), opttx.adafactor(1e-2, min_dim_size_to_factor=1))
    extra = _params()
    extra["bias"] = torch.zeros(3)
    results["extra_param"] = message(extra, opttx.adamw(1e-2, weight_decay=0.01))
    fewer = _params()
    fewer["layers"].pop()
    results["fewer_params"] = message(fewer, opttx.adamw(1e-2, weight_decay=0.01))
    wider = _params()
    wider["head"] = torch.zeros(5, 2, 5)
    results["shape"] = message(wider, opttx.adamw(1e-2, weight_decay=0.01))


def _sharded_dtensor(root: Path, rank: int, world: int, results: dict) -> None:
    """Plain `sharded` (local shards, dim 0, even and torch.chunk-like splits): element-wise
    statistics saved as DTensors at this world size load at the other one."""
    full = _params()
    specs = {"embed": Shard(0, dist.group.WORLD), "layers": [
        {"w": Shard(1, dist.group.WORLD), "n": Shard(0, dist.group.WORLD)} for _ in range(3)],
        "head": Shard(0, dist.group.WORLD)}
    axes = {"embed": 0, "layers": [{"w": 1, "n": 0} for _ in range(3)], "head": 0}

    def local(tree: dict) -> dict:
        return tree_map(lambda x, d: torch.chunk(x, world, d)[rank].clone()
                        if len(torch.chunk(x, world, d)) > rank
                        else x.narrow(d, 0, 0).clone(), tree, axes)

    tx = sharded(opttx.adamw(1e-2, weight_decay=0.01), specs)
    ref = opttx.adamw(1e-2, weight_decay=0.01)
    p_ref = _train(ref, full, ref.init(full), 0, K + N)[0]
    path = root / f"sharded_w{world}"
    params = local(full)
    state = tx.init(params)
    for step in range(K):
        u, state = tx.update(local(_grad(_unshard(params, axes, world), step)), state, params)
        params = opttx.apply_updates(params, u)
    dcp.save({"optim": state_dict(state, params, specs=specs)}, checkpoint_id=str(path))
    dist.barrier()
    other = root / f"sharded_w{6 - world}"      # world 2 reads world 4's and the reverse
    if not other.exists():
        return
    params = local(_train(ref, full, ref.init(full), 0, K)[0])
    state = tx.init(params)
    sd = {"optim": state_dict(state, params, specs=specs)}
    check_checkpoint(sd["optim"], dcp.FileSystemReader(str(other)).read_metadata(), "optim")
    dcp.load(sd, checkpoint_id=str(other))
    state = load_state_dict(state, sd["optim"], params, specs=specs)
    for step in range(K, K + N):
        u, state = tx.update(local(_grad(_unshard(params, axes, world), step)), state, params)
        params = opttx.apply_updates(params, u)
    results["sharded_resumed"] = _equal(_unshard(params, axes, world), p_ref)


def _sharded_factored(root: Path, rank: int, world: int, results: dict) -> None:
    """Plain `sharded` Adafactor: its row and column means on local shards are DTensors laid
    out from the state's declared ``reduced_dims`` (sharded on the dims they keep, replicated
    over the one they reduced), so a checkpoint saved at world 4 resumes at world 2 (within
    float32 rounding of the sums' order, 1e-5); ``per_rank=True`` saves them per rank and
    resumes bit-identically at the same world size, while another world size is refused by
    check_checkpoint naming the per-rank entries and saying why."""
    full = _params()
    group = dist.group.WORLD
    specs = {"embed": Shard(0, group), "layers": [
        {"w": Shard(1, group), "n": Shard(0, group)} for _ in range(3)], "head": Shard(0, group)}
    dims = {"embed": 0, "layers": [{"w": 1, "n": 0} for _ in range(3)], "head": 0}

    def local(tree: dict) -> dict:
        return tree_map(lambda x, d: x.narrow(d, 0, 0).clone()
                        if len(torch.chunk(x, world, d)) <= rank
                        else torch.chunk(x, world, d)[rank].clone(), tree, dims)

    start = local(full)
    axes = global_factor_axes(start, specs, "largest", 1)

    def make() -> opttx.GradientTransformation:
        return sharded(opttx.adafactor(1e-2, factor_axes=axes, momentum=0.9), specs)

    def run(tx: opttx.GradientTransformation, params: dict, state: Any, first: int,
            stop: int) -> tuple[dict, Any]:
        for step in range(first, stop):
            u, state = tx.update(local(_grad(_unshard(params, dims, world), step)), state,
                                 params)
            params = opttx.apply_updates(params, u)
        return params, state

    tx = make()
    uninterrupted = run(tx, start, tx.init(start), 0, K + N)[0]
    tx = make()
    at_k, state = run(tx, start, tx.init(start), 0, K)
    saved = state_dict(state, at_k, specs=specs)
    factored = [x for fields in saved["state"].values() for name, x in fields.items()
                if ("v_row" in name or "v_col" in name) and x.numel()]  # not placeholders
    results["factored_dtensors"] = bool(factored) and all(hasattr(x, "placements")
                                                          for x in factored)
    resharded = str(root / f"factored_dcp_w{world}")
    dcp.save({"optim": saved}, checkpoint_id=resharded)
    dist.barrier()
    other_dcp = root / "factored_dcp_w4"
    if world == 2 and other_dcp.exists():
        fresh = make()
        moved = fresh.init(at_k)
        sd = {"optim": state_dict(moved, at_k, specs=specs)}
        check_checkpoint(sd["optim"], dcp.FileSystemReader(str(other_dcp)).read_metadata(),
                         "optim")
        load_checkpoint(sd, checkpoint_id=str(other_dcp))
        moved = load_state_dict(moved, sd["optim"], at_k, specs=specs)
        got = _unshard(run(fresh, at_k, moved, K, K + N)[0], dims, world)
        want = _unshard(uninterrupted, dims, world)
        results["factored_resharded"] = all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-7)
            for a, b in zip(tree_flatten(got)[0], tree_flatten(want)[0]))
    path = str(root / f"factored_w{world}")
    dcp.save({"optim": state_dict(state, at_k, specs=specs, per_rank=True)}, checkpoint_id=path)
    dist.barrier()
    tx = make()
    state = tx.init(at_k)
    sd = {"optim": state_dict(state, at_k, specs=specs, per_rank=True)}
    check_checkpoint(sd["optim"], dcp.FileSystemReader(path).read_metadata(), "optim")
    dcp.load(sd, checkpoint_id=path)
    state = load_state_dict(state, sd["optim"], at_k, specs=specs, per_rank=True)
    results["factored_resumed"] = _equal(run(tx, at_k, state, K, K + N)[0], uninterrupted)
    other = root / "factored_w4"
    if world == 2 and other.exists():
        # adafactor declares its layout, so even its per_rank=True checkpoint reshards
        fresh = make()
        moved = fresh.init(at_k)
        sd = {"optim": state_dict(moved, at_k, specs=specs, per_rank=True)}
        check_checkpoint(sd["optim"], dcp.FileSystemReader(str(other)).read_metadata(),
                         "optim")
        load_checkpoint(sd, checkpoint_id=str(other))
        moved = load_state_dict(moved, sd["optim"], at_k, specs=specs, per_rank=True)
        got = _unshard(run(fresh, at_k, moved, K, K + N)[0], dims, world)
        want = _unshard(uninterrupted, dims, world)
        results["factored_per_rank_moved"] = all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-7)
            for a, b in zip(tree_flatten(got)[0], tree_flatten(want)[0]))
    # a state that declares no layout for a statistic of the local shard: per rank only
    matrices = {k: v for k, v in start.items() if k != "layers"}
    row_specs = {k: specs[k] for k in matrices}
    undeclared = sharded(_row_sums(), row_specs)
    local_state = undeclared.init(matrices)
    undeclared_path = str(root / f"row_sums_w{world}")
    dcp.save({"optim": state_dict(local_state, matrices, specs=row_specs, per_rank=True)},
             checkpoint_id=undeclared_path)
    dist.barrier()
    if world == 2 and (root / "row_sums_w4").exists():
        try:
            check_checkpoint(state_dict(local_state, matrices, specs=row_specs, per_rank=True),
                             dcp.FileSystemReader(str(root / "row_sums_w4")).read_metadata(),
                             "optim")
            results["factored_other_world"] = "no error"
        except ValueError as e:
            results["factored_other_world"] = str(e)


class _RowSumsState(NamedTuple):
    rows: Any      # per leaf: a running sum of g² over its last dim, on the local shard
    __roles__ = opttx.extend.declare_roles(rows=opttx.extend.Role.FACTORED_MOMENT)


def _row_sums() -> opttx.GradientTransformation:
    """A user's transform whose row statistic declares no ``reduced_dims``: checkpoints of
    its local-shard statistics can only be saved per rank."""
    def init(params: Any) -> _RowSumsState:
        return _RowSumsState(rows=tree_map(lambda p: torch.zeros(p.shape[:-1]), params))

    def update(updates: Any, state: _RowSumsState, params: Any = None, **extra: Any):
        return updates, _RowSumsState(rows=tree_map(lambda r, g: r + g.square().sum(-1),
                                                    state.rows, updates))
    return opttx.GradientTransformation(init, update, opttx.extend.LEAFWISE)


def _optimizer_dtensors(root: Path, world: int, results: dict) -> None:
    """opttx.Optimizer over DTensor parameters (dim-0 shards, 7 rows over 4 ranks uneven as
    FSDP2's) with ``sharded(adamw)``: DCP's get/set_optimizer_state_dict save the moments as
    DTensors at world 4 and reshard them at world 2; training goes on bit-identically."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(3)
    full = {"a": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen),
            "c": torch.randn(7, 3, generator=gen)}
    make = lambda: opttx.adamw(1e-2, weight_decay=0.1)  # noqa: E731

    def build() -> tuple[torch.nn.Module, opttx.Optimizer]:
        module = torch.nn.Module()
        for name, x in full.items():
            module.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(x.clone(), mesh, [DShard(0)])))
        return module, opttx.Optimizer(module.named_parameters(), sharded(make()))

    def steps(module: torch.nn.Module, opt: opttx.Optimizer, start: int, stop: int) -> None:
        for step in range(start, stop):
            whole = {n: p.detach().full_tensor() for n, p in module.named_parameters()}
            grads = _grad(whole, step)
            for n, p in module.named_parameters():
                p.grad = distribute_tensor(grads[n], mesh, [DShard(0)])
            opt.step()
            opt.zero_grad()

    path = str(root / "optimizer_dtensors")
    if world == 4:
        module, opt = build()
        steps(module, opt, 0, K)
        osd = get_optimizer_state_dict(module, opt)
        entries = {k: v for k, v in osd["state"]["c"].items() if not k.startswith("shared")}
        results["dtensor_entries"] = bool(entries) and all(hasattr(v, "placements")
                                                           for v in entries.values())
        dcp.save({"model": get_model_state_dict(module), "optim": osd}, checkpoint_id=path)
        return
    module, opt = build()
    sd = {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(module, sd["model"])
    set_optimizer_state_dict(module, opt, sd["optim"])
    steps(module, opt, K, K + N)
    ref = make()   # the Optimizer computes with the numbers given: the functional path
    expected = _train(ref, full, ref.init(full), 0, K + N)[0]
    results["optimizer_resumed"] = _equal(
        {n: p.detach().full_tensor() for n, p in module.named_parameters()}, expected)


FSDP_TXS: dict[str, Callable[[], opttx.GradientTransformation]] = {
    "adamw": lambda: sharded(opttx.adamw(1e-2, weight_decay=0.1)),
    "owners_adafactor": lambda: sharded(opttx.adafactor(1e-2, min_dim_size_to_factor=1),
                                        on_owners=True),
}


def _fsdp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    from test_fsdp import BATCH, OUT, SEQ, D
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, SEQ, D, generator=gen), torch.randn(BATCH, SEQ, OUT, generator=gen))
            for _ in range(K + N)]


def _fsdp_reference(name: str) -> dict:
    """The single-device run: the plain transform on the whole batches, K + N steps."""
    from test_fsdp import _model
    model = _model()
    inner = {"adamw": lambda: opttx.adamw(1e-2, weight_decay=0.1),
             "owners_adafactor": lambda: opttx.adafactor(1e-2, min_dim_size_to_factor=1)}
    opt = opttx.Optimizer(model.named_parameters(), inner[name]())
    for x, y in _fsdp_batches():
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: p.detach() for k, p in model.named_parameters()}


def _fsdp(root: Path, rank: int, world: int, results: dict) -> None:
    """FSDP2 (fully_shard, uneven dim-0 splits) with opttx.Optimizer: DCP's optimizer state
    dict saved at world 4 loads at world 2 (element-wise moments resharded as DTensors,
    on_owners whole-leaf state read by the new owners) and training ends at the single-device
    result (to float32 rounding: FSDP2 reduces gradients in another order per world size)."""
    from test_fsdp import _fsdp_model
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    def train(model: torch.nn.Module, opt: opttx.Optimizer, start: int, stop: int) -> None:
        for x, y in _fsdp_batches()[start:stop]:
            xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
            opt.zero_grad()

    for name, make in FSDP_TXS.items():
        path = str(root / f"fsdp_{name}")
        model = _fsdp_model(world)
        opt = opttx.Optimizer(model.named_parameters(), make())
        if world == 4:
            train(model, opt, 0, K)
            dcp.save({"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
            continue
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        train(model, opt, K, K + N)
        expected = _fsdp_reference(name)
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.detach().full_tensor(), expected[k], rtol=1e-5,
                                       atol=1e-6, msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
        results[f"fsdp_resumed/{name}"] = True


def _unshard(local: dict, axes: dict, world: int) -> dict:
    def gather(x: torch.Tensor, d: int) -> torch.Tensor:
        pieces = [None] * world
        dist.all_gather_object(pieces, x)
        return torch.cat(pieces, d)
    return tree_map(gather, local, axes)


def _worker(rank: int, world: int, store: str, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    root_path = Path(root)
    results: dict[str, Any] = {}
    for name in CASES:
        tx = _distributed(name)
        reference = _reference(name)
        source = root_path / ("w1" if world == 4 else "w4") / name
        _attempt(results, f"resumed/{name}",
                 lambda tx=tx, name=name, source=source, reference=reference:
                 _equal(_resume(tx, name, source), reference))
        if world == 4:
            _attempt(results, f"saved/{name}",
                     lambda name=name: _save(_distributed(name), name,
                                             root_path / "w4" / name) or True)
            if name.startswith("zero"):
                _attempt(results, f"writers/{name}",
                         lambda name=name: _writers(root_path / "w4" / name, world))
    if world == 2:
        _attempt(results, "errors", lambda: _errors(root_path, results) or True)
    _attempt(results, "sharded", lambda: _sharded_dtensor(root_path, rank, world, results)
             or True)
    _attempt(results, "optimizer", lambda: _optimizer_dtensors(root_path, world, results)
             or True)
    _attempt(results, "factored", lambda: _sharded_factored(root_path, rank, world, results)
             or True)
    _attempt(results, "fsdp", lambda: _fsdp(root_path, rank, world, results) or True)
    Path(f"{out}.{rank}").write_text(json.dumps(results))
    exit_rank()


def _spawn(world: int, root: Path, tmp: Path) -> list[dict]:
    out = tmp / f"out{world}"
    mp.start_processes(_worker, args=(world, str(tmp / f"store{world}"), str(root), str(out)),
                       nprocs=world, join=True, start_method=_start_method())
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


# ---------------------------------------------------------------------------------------------
# fixtures: single device, then world 4, then world 2
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Single-device checkpoints after K steps of the plain transforms."""
    path = tmp_path_factory.mktemp("checkpoints")
    for name in CASES:
        _save(INNER[name](), name, path / "w1" / name)
    return path


@pytest.fixture(scope="module")
def world4(root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(4, root, tmp_path_factory.mktemp("w4"))


@pytest.fixture(scope="module")
def world2(root: Path, world4: list[dict], tmp_path_factory: pytest.TempPathFactory
           ) -> list[dict]:
    return _spawn(2, root, tmp_path_factory.mktemp("w2"))


def _check(results: list[dict], key: str) -> None:
    for rank, r in enumerate(results):
        assert r[key] is True, f"{key} rank {rank}: {r[key]}"


@pytest.mark.parametrize("name", CASES)
def test_single_device_checkpoint_resumes_at_world_4(world4: list[dict], name: str) -> None:
    _check(world4, f"resumed/{name}")
    _check(world4, f"saved/{name}")
    if name.startswith("zero"):
        _check(world4, f"writers/{name}")


@pytest.mark.parametrize("name", CASES)
def test_world_4_checkpoint_resumes_at_world_2(world2: list[dict], name: str) -> None:
    _check(world2, f"resumed/{name}")


@pytest.mark.parametrize("name", CASES)
def test_world_4_checkpoint_resumes_on_one_device(root: Path, world4: list[dict],
                                                  name: str) -> None:
    """A zero / on_owners checkpoint loads into the plain transform: the keys are the same."""
    resumed = _resume(INNER[name](), name, root / "w4" / name)
    assert _equal(resumed, _reference(name))


def test_local_shards_reshard_between_world_2_and_4(world2: list[dict]) -> None:
    _check(world2, "sharded")
    _check(world2, "sharded_resumed")


def test_sharded_factored_statistics_reshard_or_are_saved_per_rank(world4: list[dict],
                                                        world2: list[dict]) -> None:
    for results in (world4, world2):
        _check(results, "factored")
        _check(results, "factored_resumed")
        _check(results, "factored_dtensors")
    _check(world2, "factored_resharded")
    _check(world2, "factored_per_rank_moved")
    for r in world2:
        message = r["factored_other_world"]
        assert "unexpected" in message and "@rank3" in message, message
        assert "per_rank=True" in message and "world size" in message, message


def test_optimizer_over_dtensors_reshards_between_world_4_and_2(world4: list[dict],
                                                                world2: list[dict]) -> None:
    _check(world4, "optimizer")
    _check(world4, "dtensor_entries")
    _check(world2, "optimizer")
    _check(world2, "optimizer_resumed")


@pytest.mark.parametrize("name", list(FSDP_TXS))
def test_fsdp2_optimizer_state_reshards_from_world_4_to_2(world4: list[dict], world2: list[dict],
                                                          name: str) -> None:
    _check(world4, "fsdp")
    _check(world2, "fsdp")
    _check(world2, f"fsdp_resumed/{name}")


def test_another_chain_or_parameter_set_is_refused(world2: list[dict]) -> None:
    _check(world2, "errors")
    for r in world2:
        # another chain: refused by what made its state before any entry is compared
        assert "another transform" in r["other_chain"] and \
            "scale_by_factored_rms" in r["other_chain"], r["other_chain"]
        assert "missing" in r["extra_param"] and "bias" in r["extra_param"], r["extra_param"]
        assert "unexpected" in r["fewer_params"] and "layers.2" in r["fewer_params"], \
            r["fewer_params"]
        assert "shape" in r["shape"] and "head" in r["shape"], r["shape"]


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------


def test_keys_name_parameters_and_fields() -> None:
    params = _params()
    tx = opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adamw(1e-2))
    sd = state_dict(tx.init(params), params)
    assert set(sd["state"]) == {"embed", "head", "layers.0.w", "layers.0.n", "layers.1.w",
                                "layers.1.n", "layers.2.w", "layers.2.n"}
    assert set(sd["state"]["layers.1.w"]) == {"1.0.mu", "1.0.nu"}
    assert set(sd["shared"]) == {"1.0.count"}


def test_keys_do_not_depend_on_the_leaves_present() -> None:
    """A state over some leaves (masked, as zero and on_owners build it) has the entries of
    those leaves, under the keys of the state over all of them; 8-bit states included."""
    params = _params()
    for make in (lambda: opttx.shampoo(1e-2, max_preconditioner_dim=4),
                 lambda: opttx.adamw_8bit(1e-3, min_size=12, block_size=16)):
        full = state_dict(make().init(params), params)
        keep = [i % 2 == 0 for i in range(len(tree_flatten(params)[0]))]
        leaves, spec = tree_flatten(params)
        masked = spec.unflatten([x if k else opttx.MaskedNode() for x, k in zip(leaves, keep)])
        part = state_dict(make().init(masked), params, owned=keep)
        assert part["state"]
        for path, fields in part["state"].items():
            assert set(fields) == set(full["state"][path])
            for f, x in fields.items():
                assert torch.equal(x, full["state"][path][f]), (path, f)
        assert set(part["state"]) < set(full["state"])


def test_load_state_dict_names_the_mismatch() -> None:
    params = _params()
    adamw, lion = opttx.adamw(1e-2), opttx.lion(1e-3)
    saved = state_dict(adamw.init(params), params)
    with pytest.raises(ValueError, match=r"made by scale_by_lion.*checkpoint's by scale_by_adam"):
        load_state_dict(lion.init(params), saved, params)
    anonymous = {k: v for k, v in saved.items() if k != "made_by"}   # saved before made_by
    with pytest.raises(ValueError, match=r"unexpected 8 entries .*state\.embed\.0\.nu"):
        load_state_dict(lion.init(params), anonymous, params)
    with pytest.raises(ValueError, match=r"missing 8 entries .*state\.embed\.0\.trace"):
        load_state_dict(opttx.sgd(1e-2, momentum=0.9).init(params), anonymous, params)
    fewer = {k: v for k, v in params.items() if k != "head"}
    with pytest.raises(ValueError, match=r"unexpected 2 entries .*state\.head\.0\.mu"):
        load_state_dict(adamw.init(fewer), saved, fewer)
    wider = dict(params, embed=torch.zeros(6, 6))
    with pytest.raises(ValueError, match=r"state\.embed\.0\.mu is \(6, 5\).*\(6, 6\)"):
        load_state_dict(adamw.init(wider), saved, wider)


# ---------------------------------------------------------------------------------------------
# opttx.Optimizer with torch.distributed.checkpoint.state_dict
# ---------------------------------------------------------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _fit(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], opttx.Optimizer]] = {
    "adamw": lambda m: opttx.Optimizer(m.named_parameters(),
                                       opttx.adamw(1e-2, weight_decay=0.1)),
    "injected": lambda m: opttx.Optimizer(m.parameters(), opttx.inject_hyperparams(
        opttx.adamw)(learning_rate=1e-2, weight_decay=0.1)),
    "shampoo": lambda m: opttx.Optimizer(m.named_parameters(), opttx.shampoo(
        1e-2, max_preconditioner_dim=4, precondition_frequency=2,
        start_preconditioning_step=2)),
    "8bit_two_groups": lambda m: opttx.Optimizer(
        [{"params": [p for p in m.parameters() if p.dim() == 2]},
         {"params": [p for p in m.parameters() if p.dim() == 1],
          "tx": opttx.lion(1e-3, weight_decay=0.1)}],
        opttx.adamw_8bit(1e-3, min_size=20, block_size=16)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_dict_with_dcp(world_of_one: None, tmp_path: Path, name: str,
                                       flatten: bool) -> None:
    """get_optimizer_state_dict / dcp.save, then dcp.load / set_optimizer_state_dict into a
    fresh optimizer: training goes on bit-identically. DCP's helpers do not step a fresh
    opttx optimizer (they do a zero-gradient step when ``optimizer.state`` looks empty)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = _model(0)
    opt = OPTIMIZERS[name](model)
    before = [p.detach().clone() for p in model.parameters()]
    states = [x.clone() for x in tree_flatten(opt.tx_states)[0]]
    get_optimizer_state_dict(model, opt, options=options)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(states, tree_flatten(opt.tx_states)[0]))

    _fit(model, opt, 0, K)
    sd = {"model": get_model_state_dict(model),
          "optim": get_optimizer_state_dict(model, opt, options=options)}
    if not flatten:
        assert set(sd["optim"]["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    dcp.save(sd, checkpoint_id=str(tmp_path / "ck"))
    _fit(model, opt, K, K + N)

    resumed = _model(1)
    opt2 = OPTIMIZERS[name](resumed)
    sd2 = {"model": get_model_state_dict(resumed),
           "optim": get_optimizer_state_dict(resumed, opt2, options=options)}
    dcp.load(sd2, checkpoint_id=str(tmp_path / "ck"))
    set_model_state_dict(resumed, sd2["model"])
    set_optimizer_state_dict(resumed, opt2, sd2["optim"], options=options)
    _fit(resumed, opt2, K, K + N)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(tree_flatten(opt.tx_states)[0], tree_flatten(opt2.tx_states)[0]):
        assert torch.equal(a, b)


def test_optimizer_state_dict_names_fields_per_parameter() -> None:
    model = _model(0)
    opt = opttx.Optimizer(model.parameters(), opttx.chain(opttx.clip_by_global_norm(1.0),
                                                          opttx.adamw(1e-2)))
    sd = opt.state_dict()
    assert set(sd["state"]) == {0, 1, 2, 3}
    # the Optimizer runs the chain with each link's hyperparameters injected: link 1 is
    # adamw's InjectHyperparamsState, its inner_state the adamw chain; the injected values
    # and counts are the group's shared entries, on its first parameter
    moments = {"1.inner_state.0.mu", "1.inner_state.0.nu"}
    shared = {"shared.0.count", "shared.0.hyperparams.max_norm", "shared.1.count",
              "shared.1.inner_state.0.count"} | {
        f"shared.1.hyperparams.{n}" for n in ("learning_rate", "b1", "b2", "eps", "eps_root",
                                             "weight_decay")}
    assert set(sd["state"][0]) == moments | shared
    assert set(sd["state"][3]) == moments
    assert bool(opt.state) and set(opt.state[model[2].bias]) == moments
    other = opttx.Optimizer(model.parameters(), opttx.lion(1e-3))
    with pytest.raises(ValueError, match="made by chain.*inner=adamw.*this group's transform "
                                         "is inject_hyperparams\\(inner=lion"):
        other.load_state_dict(sd)
    del sd["param_groups"][0]["transform"]        # a state dict saved before it was recorded
    with pytest.raises(ValueError, match=r"unexpected \['0: 1.inner_state.0.mu'"):
        other.load_state_dict(sd)


def test_quantized_state_over_masked_leaves_is_keyed_by_its_declared_plan() -> None:
    """quantize_state under masked keeps lists over the masked-in leaves only: its declared
    plan (a LeafSlot per parameter, MaskedNode where masked) says which leaves those are, also
    where shapes could not (two leaves of one shape, one quantized, the other masked out);
    ``owned`` changes nothing."""
    params = {"a": torch.randn(10, 10), "b": torch.randn(10), "c": torch.randn(50)}
    inner = opttx.quantize_state(opttx.scale_by_adam(), min_size=5, block_size=4)
    tx = opttx.chain(opttx.masked(inner, {"a": True, "b": True, "c": False}), opttx.scale(-1e-3))
    state = tx.init(params)
    read = state_dict(state, params)
    sd = state_dict(state, params, owned=[True, True, False])
    assert set(sd["state"]) == set(read["state"]) == {"a", "b"}
    assert sd["state"]["b"]["0.inner_state.quantized.mu.codes"].shape == (10,)
    for path, fields in sd["state"].items():
        assert {k: v.data_ptr() for k, v in fields.items()} == {
            k: v.data_ptr() for k, v in read["state"][path].items()}

    params = {"a": torch.randn(10), "b": torch.randn(10), "c": torch.randn(3)}
    tx = opttx.chain(opttx.masked(inner, {"a": False, "b": True, "c": True}), opttx.scale(-1e-3))
    state = tx.init(params)
    read = state_dict(state, params)
    sd = state_dict(state, params, owned=[False, True, True])
    assert set(sd["state"]) == set(read["state"]) == {"b", "c"}
    assert read["state"]["b"]["0.inner_state.quantized.mu.codes"].data_ptr() == \
        state[0].inner_state.quantized[0].mu.codes.data_ptr()
    assert sd["state"]["b"]["0.inner_state.quantized.mu.codes"].shape == (10,)
    assert sd["state"]["c"]["0.inner_state.dense.mu"].shape == (3,)


def test_quantized_state_inside_project_lowrank_is_keyed_by_the_projected_shapes() -> None:
    """galore_adamw_8bit: quantize_state runs on the projected leaves, so its codes have the
    projected shapes ((k, n) for a left projection, (m, k) for a right one), not the
    parameters'; the keys still name the right parameters, the projected leaf's codes
    under its path, and a round trip through torch.save restores every tensor."""
    params = {"wide": torch.randn(8, 24), "tall": torch.randn(24, 8), "b": torch.randn(24),
              "small": torch.randn(2, 3)}
    tx = opttx.galore_adamw_8bit(1e-2, rank=2, update_proj_gap=2, min_size=8, block_size=8)
    params, state = run_transform(tx, params, gradient_stream(params, 3, seed=11))
    sd = state_dict(state, params)
    codes = {path: {k: tuple(v.shape) for k, v in fields.items() if k.endswith("mu.codes")}
             for path, fields in sd["state"].items()}
    assert list(codes["wide"].values()) == [(2, 24)]     # U^T G: U is 8 x 2
    assert list(codes["tall"].values()) == [(24, 2)]     # G V^T: V^T is 2 x 8
    assert list(codes["b"].values()) == [(24,)]          # 1-D: not projected, quantized
    assert codes["small"] == {}                           # 6 elements < min_size: dense
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = load_state_dict(tx.init(params), torch.load(buffer, weights_only=True), params)
    assert _equal(loaded, state)


# ---------------------------------------------------------------------------------------------
# nothing in a checkpoint runs code: the metadata allowlist, entries with weights_only
# ---------------------------------------------------------------------------------------------

_PLANTED = Path("/nonexistent")       # replaced per test by a file under tmp_path


class _Payload:
    """A pickled object whose unpickling writes a file (what a planted .metadata can do)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.write_text, (Path(self.target), "ran"))


def _small_checkpoint(tmp_path: Path, with_checksums: bool = False):
    params = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}
    tx = opttx.adamw(1e-2)
    state = tx.init(params)
    state = tx.update(tree_map(torch.ones_like, params), state, params)[1]
    sd = {"params": params, "optim": state_dict(state, params), "step": 7}
    path = tmp_path / "ckpt"
    if with_checksums:
        opttx.distributed.save_checkpoint(sd, path)
    else:
        dcp.save(sd, checkpoint_id=str(path))
    live_params = {k: torch.zeros_like(v) for k, v in params.items()}
    live = {"params": live_params, "optim": state_dict(tx.init(live_params), live_params),
            "step": 0}
    return path, live, sd


def _leaves(tree) -> list[torch.Tensor]:
    return [x.clone() for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _plant(path: Path, target: Path, wrap: bool) -> None:
    """Replace the checkpoint's .metadata by a pickle that writes ``target`` when loaded:
    alone, or inside the real Metadata (its storage_meta), as an attacker who keeps the
    checkpoint loadable would."""
    import pickle
    payload = _Payload(str(target))
    if wrap:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()    # trusted: ours
        metadata.planner_data = {"x": payload}
        payload = metadata
    (path / ".metadata").write_bytes(pickle.dumps(payload))


@pytest.mark.parametrize("wrap", [False, True])
def test_a_planted_metadata_payload_is_refused_and_does_not_run(tmp_path: Path,
                                                                wrap: bool) -> None:
    """A .metadata whose unpickling calls Path.write_text (alone, or inside a real Metadata):
    load_checkpoint, check_checkpoint given the directory and read_metadata refuse it with a
    ValueError naming the file and the global, the file is never written and nothing of the
    live state changes. Torch itself runs it (the control)."""
    path, live, _ = _small_checkpoint(tmp_path)
    target = tmp_path / "pwned"
    _plant(path, target, wrap)
    before = _leaves(live)
    text = r"\.metadata: refused .* names the global pathlib.Path.write_text"
    with pytest.raises(ValueError, match=text):
        load_checkpoint(live, checkpoint_id=str(path))
    with pytest.raises(ValueError, match=text):
        opttx.distributed.read_metadata(path)
    with pytest.raises(ValueError, match=text):
        check_checkpoint(live["optim"], str(path), "optim")
    with pytest.raises(ValueError, match=text):      # a plain FileSystemReader is replaced
        load_checkpoint(live, storage_reader=dcp.FileSystemReader(str(path)))
    assert not target.exists()
    assert all(torch.equal(a, b) for a, b in zip(_leaves(live), before))
    if wrap:                                                 # the control: torch runs it
        dcp.FileSystemReader(str(path)).read_metadata()
    else:            # (then fails on the payload's result, the int write_text returns)
        with pytest.raises(AttributeError):
            dcp.FileSystemReader(str(path)).read_metadata()
    assert target.read_text() == "ran"


def test_a_planted_non_tensor_entry_is_refused_and_does_not_run(tmp_path: Path) -> None:
    """DCP reads non-tensor entries with torch.load(weights_only=False); load_checkpoint reads
    them with weights_only=True: an entry holding a payload raises a ValueError naming the
    entry, and nothing runs."""
    target = tmp_path / "pwned"
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(3), "extra": _Payload(str(target))}, checkpoint_id=str(path))
    assert not target.exists()
    live = {"w": torch.zeros(3), "extra": None}
    with pytest.raises(ValueError, match=r"entry 'extra' .*weights_only=True.* refuses.*"
                                         r"Unsupported global: GLOBAL getattr"):
        load_checkpoint(live, checkpoint_id=str(path))
    assert not target.exists() and float(live["w"].sum()) == 0.0


@pytest.mark.parametrize("garbage", [b"not a pickle at all", b"\x80\x04\x95", b"\x80\x04K\x07."])
def test_a_garbage_metadata_is_an_error_naming_the_file(tmp_path: Path, garbage: bytes) -> None:
    """Garbage, a truncated pickle, or a pickle of something else (the int 7) as .metadata:
    a ValueError naming the file (before: pickle's 'invalid load key' out of DCP), nothing
    loaded. Without checksums (with them the SHA-256 check names the file first)."""
    path, live, _ = _small_checkpoint(tmp_path)
    (path / ".metadata").write_bytes(garbage)
    before = _leaves(live)
    with pytest.raises(ValueError, match=r"ckpt/\.metadata (is not DCP checkpoint metadata|"
                                         r"holds a int)"):
        load_checkpoint(live, checkpoint_id=str(path))
    with pytest.raises(ValueError, match=r"\.metadata"):
        check_checkpoint(live["optim"], str(path), "optim")
    assert all(torch.equal(a, b) for a, b in zip(_leaves(live), before))


@pytest.mark.parametrize("with_checksums", [False, True])
def test_real_checkpoints_load_through_the_allowlist(tmp_path: Path,
                                                     with_checksums: bool) -> None:
    """A checkpoint DCP wrote (tensors of several dtypes, an int entry, opttx's made_by
    strings) loads through the allowlisted reader and the weights_only planner, equal to what
    was saved; the metadata read here equals torch's."""
    path, live, sd = _small_checkpoint(tmp_path, with_checksums)
    load_checkpoint(live, checkpoint_id=str(path))
    assert all(torch.equal(a, b) for a, b in zip(_leaves(live), _leaves(sd)))
    assert live["step"] == 7
    mine = opttx.distributed.read_metadata(path)
    theirs = dcp.FileSystemReader(str(path)).read_metadata()
    assert mine.state_dict_metadata == theirs.state_dict_metadata
    assert mine.storage_data == theirs.storage_data
    check_checkpoint(live["optim"], str(path), "optim")
    check_checkpoint(live["optim"], mine, "optim")
    other = {"w": torch.ones(5)}
    with pytest.raises(ValueError):
        check_checkpoint(state_dict(opttx.adamw(1e-2).init(other), other), str(path), "optim")
