"""Every ``>>>`` example in opttx's docstrings runs.

Examples are written for a reader, so they use the names a reader has at hand: ``params``,
``grads``, ``model``, ``tx``, ``state``, ``loss``, ``data``. Each example runs in a fresh
namespace holding its module's globals and those names (small tensors and a small model), in
order, its statements one after another; outputs are not compared (they print tensors). The
examples that need a process group are listed with that reason; the distributed layer's are
run by the distributed tests and notebook 04 instead.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import pkgutil
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import opttx
import opttx.distributed
import opttx.testing
from opttx.distributed import Replicated, Shard

# examples that need an initialised process group (or spawn processes)
NEEDS_PROCESS_GROUP = {
    "opttx.distributed", "opttx.distributed.checkpoint.load_checkpoint",
    "opttx.distributed.checkpoint.state_dict",
    "opttx.distributed.data_parallel.all_reduce_gradients",
    "opttx.distributed.launch.init_process_group_for_restarts",
    "opttx.distributed.owners.on_owners",
    "opttx.distributed.owners.plan_owners", "opttx.distributed.shapes.global_factor_axes",
    "opttx.distributed.sharded.sharded", "opttx.distributed.specs.Shard",
    "opttx.distributed.zero.zero", "opttx.testing.MeshDim", "opttx.testing.assert_shard_invariant",
    "opttx.testing.exit_rank",
    "opttx.testing.bind_mesh", "opttx.testing.sharding_specs", "opttx.testing.spawn_ranks",
}


def _docstring_examples() -> dict[str, doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    names = ["opttx"] + [m.name for m in pkgutil.walk_packages(opttx.__path__, "opttx.")
                         if not m.name.startswith("opttx.bench")]
    found: dict[str, doctest.DocTest] = {}
    for name in names:
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            if test.examples and test.name not in found:
                found[test.name] = test
    return found


EXAMPLES = _docstring_examples()


def _reader_names() -> dict[str, typing.Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
    tx = opttx.adamw(1e-3)
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(2)]
    return {
        "opttx": opttx, "torch": torch, "NamedTuple": typing.NamedTuple, "partial":
        functools.partial, "given": given, "settings": settings, "st": st, "Shard": Shard,
        "Replicated": Replicated, "model": model, "params": params,
        "grads": {"w": torch.randn(4, 3), "b": torch.randn(3)}, "tx": tx,
        "state": tx.init(params), "data": data, "loss_fn": torch.nn.functional.mse_loss,
        "loss": torch.nn.functional.mse_loss(model(data[0][0]), data[0][1]),
        "train_step": lambda params, state: (params, state),
    }


def test_examples_were_found() -> None:
    assert len(EXAMPLES) >= 60
    assert not NEEDS_PROCESS_GROUP - set(EXAMPLES), "stale names in NEEDS_PROCESS_GROUP"


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - NEEDS_PROCESS_GROUP))
def test_docstring_example_runs(name: str) -> None:
    test = EXAMPLES[name]
    namespace = {**test.globs, **_reader_names()}
    for example in test.examples:
        code = compile(example.source, f"{name} (line {example.lineno + 1})", "exec")
        exec(code, namespace)  # noqa: S102 - the library's own docstrings
