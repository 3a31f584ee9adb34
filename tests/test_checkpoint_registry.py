"""Every chain of the conformance registry checkpoints under `opttx.distributed.zero` (stages 1
and 2) as a DCP checkpoint that moves from world 4 to world 2 to one device (docs/design.md,
section 7): saved at world 4 after K steps, loaded at world 2 (through `check_checkpoint` and
`load_checkpoint`) and saved again, loaded on one device into the plain transform, trained N
more steps there: the single-device run's parameters (rtol 1e-5; the keys are the same at
every world size, and each whole leaf is computed by one owner). All entries travel in one
checkpoint per world size, keyed by entry.

Plain `sharded` checkpoints of local shards that reshard (element-wise moments, Adafactor's
declared row and column statistics) are tested in tests/test_checkpoint.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import opttx
from opttx.distributed import (check_checkpoint, load_checkpoint, load_state_dict, state_dict,
                               zero, zero_plan)
from opttx.testing import gradient_stream, spawn_ranks

from registry import CASES

K, N = 2, 2
CHUNK = 256 / (1 << 20)
STAGES = (1, 2)
ENTRIES = [c for c in CASES if c.distributed is None]


def _params(case: Any) -> dict[str, torch.Tensor]:
    from opttx.conformance import standard_params
    return standard_params(seed=21, matrices_only=case.matrices_only)


def _grads(params: dict) -> list:
    return gradient_stream(params, K + N, seed=22)


def _train(tx: opttx.GradientTransformation, params: dict, state: Any, grads: list
           ) -> tuple[dict, Any]:
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
    return params, state


def _owned(params: dict) -> Any:
    return zero_plan(params, dist.get_world_size(), CHUNK) if dist.is_initialized() else None


def _template(tx: opttx.GradientTransformation, params: dict) -> tuple[dict, Any, dict]:
    """A fresh ``tx.init`` of this run: ``(params, state, {"params", "optim"} to load)``."""
    params = {k: torch.zeros_like(v) for k, v in params.items()}
    state = tx.init(params)
    return params, state, {"params": params,
                           "optim": state_dict(state, params, owned=_owned(params))}


def _run_world(root: Path, world: int) -> dict[str, str]:
    """World 4: every entry trained K steps, saved in one checkpoint (an entry per key);
    world 2 (and 1, in the test process): that checkpoint checked entry by entry, loaded
    whole, each state restored, then saved again for the next world."""
    errors: dict[str, str] = {}
    saved: dict[str, Any] = {}
    live: dict[str, Any] = {}
    metadata = None if world == 4 else \
        dcp.FileSystemReader(str(root / f"w{world * 2}")).read_metadata()
    for case in ENTRIES:
        params = _params(case)
        grads = _grads(params)
        for stage in STAGES:
            key = f"{case.name}/stage{stage}".replace("/", ":").replace(".", "_")
            tx = case.make() if world == 1 else zero(case.make(), chunk_size_mb=CHUNK,
                                                      stage=stage)
            try:
                if world == 4:
                    trained, state = _train(tx, params, tx.init(params), grads[:K])
                    saved[key] = {"params": trained,
                                  "optim": state_dict(state, trained, owned=_owned(trained))}
                else:
                    loaded, state, template = _template(tx, params)
                    check_checkpoint(template["optim"], metadata, f"{key}.optim")
                    saved[key] = template
                    live[key] = (tx, loaded, state)
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors[key] = f"{type(e).__name__}: {e}"
    if world == 4:
        dcp.save(saved, checkpoint_id=str(root / "w4"))
        return errors
    load_checkpoint(saved, checkpoint_id=str(root / f"w{world * 2}"))
    for key, (tx, loaded, state) in live.items():
        try:
            state = load_state_dict(state, saved[key]["optim"], loaded,
                                    owned=_owned(loaded))
            live[key] = (tx, loaded, state)
            saved[key] = {"params": loaded,
                          "optim": state_dict(state, loaded, owned=_owned(loaded))}
        except Exception as e:  # noqa: BLE001
            errors[key] = f"{type(e).__name__}: {e}"
    if world == 2:
        dcp.save({k: v for k, v in saved.items() if k not in errors},
                 checkpoint_id=str(root / "w2"))
    else:
        _RESUMED.update(live)
    return errors


_RESUMED: dict[str, Any] = {}


def _worker(rank: int, world: int, root: str) -> dict[str, str]:
    return _run_world(Path(root), world)


@pytest.fixture(scope="module")
def moved() -> tuple[dict, list[dict[str, str]]]:
    root = Path(tempfile.mkdtemp(prefix="opttx_registry_ckpt_"))
    errors = spawn_ranks(_worker, world_size=4, args=(str(root),), timeout=900)
    errors += spawn_ranks(_worker, world_size=2, args=(str(root),), timeout=900)
    errors.append(_run_world(root, 1))          # one device, this process
    return dict(_RESUMED), errors


@pytest.mark.timeout(1900)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", ENTRIES, ids=[c.name for c in ENTRIES])
def test_zero_checkpoint_moves_from_world_4_to_2_to_one_device(case, stage, moved) -> None:
    resumed, errors = moved
    key = f"{case.name}/stage{stage}".replace("/", ":").replace(".", "_")
    for rank_errors in errors:
        assert key not in rank_errors, rank_errors[key]
    params = _params(case)
    grads = _grads(params)
    tx, loaded, state = resumed[key]
    expected = _train(tx, params, tx.init(params), grads)[0]
    got = _train(tx, loaded, state, grads[K:])[0]
    opttx.testing.assert_trees_close(got, expected, rtol=1e-5, atol=1e-7, what=key)
