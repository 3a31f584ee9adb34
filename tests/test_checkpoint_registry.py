"""Every chain of the conformance registry checkpoints under `opttx.distributed.zero` (stage 2)
as a DCP checkpoint that moves from world 4 to world 2 to one device, and under
`opttx.distributed.on_owners` (each whole leaf's state on its owner) from world 2 to one
device (docs/design.md, section 7).

The entries run in groups of `GROUP_SIZE`, each group one `opttx.partition` with a label per
entry over a tree with a subtree per entry, so each world size makes one plan, one checkpoint
and one load a group (a partition's inner transforms each walk the whole tree: one partition
of all ~150 entries spent five minutes in tree flattening alone): saved at
the first world after K steps; loaded at world 2 (through `check_checkpoint` and
`load_checkpoint`) and saved again; loaded on one device into the plain transforms (a zero
checkpoint has the keys of the single-device state), which train N more steps: each entry's
parameters are those of its single-device run (rtol 1e-5: the keys are the same at every world
size and each whole leaf is computed by one owner; statistics across leaves are summed over the
owners in another order).

on_owners starts at world 2, not 4 (the suite's time): its checkpoint keys are the single-device ones whatever the world, so
the move from 2 ranks to one device is the resharding it needs; zero's own plans differ with
the world, so it also moves from 4 ranks to 2.

Plain `sharded` checkpoints of local shards that reshard (element-wise moments, Adafactor's
declared row and column statistics) are tested in tests/test_checkpoint.py.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import opttx
from opttx.conformance import standard_params
from opttx.distributed import (check_checkpoint, load_checkpoint, load_state_dict, on_owners,
                               sharded, state_dict, zero, zero_plan)
from opttx.testing import assert_trees_close, gradient_stream, spawn_ranks

from registry import CASES

K, N = 2, 2
CHUNK = 256 / (1 << 20)
# zero's stage decides how gradients are reduced, not the state or its keys (the state is
# partitioned alike in stages 1 and 2): stage 2 stands for both
MODES = ("zero2", "on_owners")
FIRST_WORLD = {"zero2": 4, "on_owners": 2}      # the world each mode's checkpoint starts at


def _runs_in_a_partition(case: Any) -> bool:
    """Whether the entry runs as one label of a partition (its subtree's other labels are
    MaskedNode there): a mask function written for a tree of tensors only does not."""
    params = {"x": standard_params(matrices_only=case.matrices_only),
              "y": {"w": torch.zeros(2, 2)}}
    tx = opttx.partition({"x": case.make(), "y": opttx.sgd(0.1)},
                         lambda tree: {k: opttx.tree.tree_map(lambda _, k=k: k, v)
                                       for k, v in tree.items()})
    try:
        tx.update(params, tx.init(params), params)
    except Exception:  # noqa: BLE001 - the entry is then tested alone, in the conformance suite
        return False
    return True


# entries whose zero checkpoint does not move between world sizes, and why
NOT_RESHARDED = {
    "flatten": "its state is one flat buffer over the leaves a rank holds, not keyed per "
               "parameter: a zero checkpoint of it reloads at the same world size only "
               "(flatten would have to declare each leaf's slice of its buffers)",
}
# entries whose functions of the tree read the registry's flat tree ({"w", "b", "t", "v"}):
# inside the partition they see the entries' keys (tested alone, in tests/test_conformance.py)
FLAT_TREE_ONLY = {"clip_qk", "muon_clip"}
DISTRIBUTED = [c for c in CASES if c.distributed is None]
ENTRIES = [c for c in DISTRIBUTED if c.name not in set(NOT_RESHARDED) | FLAT_TREE_ONLY
           and _runs_in_a_partition(c)]
ALONE = sorted(c.name for c in DISTRIBUTED if c not in ENTRIES and c.name not in NOT_RESHARDED)


def _label(case: Any) -> str:
    return case.name.replace("/", ":").replace(".", "_")


GROUP_SIZE = 16
GROUPS = [ENTRIES[i:i + GROUP_SIZE] for i in range(0, len(ENTRIES), GROUP_SIZE)]


def _params(group: list) -> dict[str, dict[str, torch.Tensor]]:
    """One subtree per entry of the group (matrices only where the entry takes matrices
    only)."""
    return {_label(c): standard_params(seed=21 + ENTRIES.index(c), matrices_only=c.matrices_only)
            for c in group}


def _grads(params: dict) -> list:
    return gradient_stream(params, K + N, seed=22)


def _everything(group: list) -> opttx.GradientTransformation:
    """Every entry of the group on its own subtree: a partition labelled by the subtree's
    key."""
    return opttx.partition({_label(c): c.make() for c in group},
                           lambda tree: {k: opttx.tree.tree_map(lambda _, k=k: k, v)
                                         for k, v in tree.items()})


def _train(tx: opttx.GradientTransformation, params: dict, state: Any, grads: list
           ) -> tuple[dict, Any]:
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
    return params, state


def _owned(params: dict, mode: str) -> Any:
    """zero's plan (its states record their leaves too; given here as a user of zero would);
    on_owners's states say which leaves they cover by their masked leaves."""
    if dist.is_initialized() and mode.startswith("zero"):
        return zero_plan(params, dist.get_world_size(), CHUNK)
    return None


def _distributed(mode: str, group: list) -> opttx.GradientTransformation:
    if mode == "on_owners":
        return sharded(on_owners(_everything(group)))  # whole (replicated) leaves on owners
    return zero(_everything(group), chunk_size_mb=CHUNK, stage=int(mode[-1]))


def _run_world(root: Path, world: int, mode: str, g: int) -> tuple[dict, Any]:
    """World 4: K steps and a checkpoint; world 2 and one device: the previous world's
    checkpoint checked, loaded and (at world 2) saved again. Returns (params, state)."""
    group = GROUPS[g]
    params = _params(group)
    tx = _everything(group) if world == 1 else _distributed(mode, group)
    where = root / mode / f"group{g}"
    if world == FIRST_WORLD[mode]:
        params, state = _train(tx, params, tx.init(params), _grads(params)[:K])
        dcp.save({"params": params,
                  "optim": state_dict(state, params, owned=_owned(params, mode))},
                 checkpoint_id=str(where / f"w{world}"))
        return params, state
    params = opttx.tree.tree_map(torch.zeros_like, params)
    state = tx.init(params)
    owned = _owned(params, mode)
    sd = {"params": params, "optim": state_dict(state, params, owned=owned)}
    source = str(where / f"w{world * 2}")
    check_checkpoint(sd["optim"], dcp.FileSystemReader(source).read_metadata(), "optim")
    load_checkpoint(sd, checkpoint_id=source)
    state = load_state_dict(state, sd["optim"], params, owned=owned)
    if world > 1:
        dcp.save({"params": params, "optim": state_dict(state, params, owned=owned)},
                 checkpoint_id=str(where / "w2"))
    return params, state


def _worker(rank: int, world: int, root: str) -> bool:
    for mode in MODES:
        if world <= FIRST_WORLD[mode]:
            for g in range(len(GROUPS)):
                _run_world(Path(root), world, mode, g)
                dist.barrier()
    return True


@pytest.fixture(scope="module")
def resumed() -> dict[int, dict]:
    """Per mode: every entry's parameters after K steps at world 4, the move to world 2 and
    to one device, and N steps there."""
    root = Path(tempfile.mkdtemp(prefix="opttx_registry_ckpt_"))
    spawn_ranks(_worker, world_size=4, args=(str(root),), timeout=600)
    spawn_ranks(_worker, world_size=2, args=(str(root),), timeout=600)
    out: dict[str, dict] = {}
    for mode in MODES:
        out[mode] = {}
        for g, group in enumerate(GROUPS):
            params, state = _run_world(root, 1, mode, g)
            out[mode].update(_train(_everything(group), params, state,
                                    _grads(_params(group))[K:])[0])
    return out


def test_every_distributed_entry_takes_part() -> None:
    """Only entries whose mask function reads every leaf as a tensor stay out (they see
    MaskedNode inside a partition); their zero runs are in tests/test_conformance.py."""
    assert ALONE == ["adamw/mask_function"] + sorted(FLAT_TREE_ONLY), ALONE


@functools.cache
def _single_device(name: str) -> dict:
    """The entry's parameters after K + N steps on one device, never interrupted."""
    group = next(group for group in GROUPS if any(c.name == name for c in group))
    case = next(c for c in group if c.name == name)
    params = _params(group)[_label(case)]
    grads = [g[_label(case)] for g in _grads(_params(group))]
    tx = case.make()
    return _train(tx, params, tx.init(params), grads)[0]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ENTRIES, ids=[c.name for c in ENTRIES])
def test_checkpoint_moves_between_world_sizes_to_one_device(case, mode, resumed) -> None:
    worlds = " -> ".join(str(w) for w in (4, 2, 1) if w <= FIRST_WORLD[mode])
    assert_trees_close(resumed[mode][_label(case)], _single_device(case.name), rtol=1e-5,
                       atol=1e-7, what=f"{case.name} ({mode}, world {worlds})")
