"""The transform contract (docs/design.md, section 5), checked for every entry of the
conformance registry (tests/registry.py) with the checks users run on their own transforms
(`opttx.testing.check_transform`, in opttx/conformance.py): purity, trees without leaves, state dtypes and
shapes, float64 determinism, one compiled graph with no recompile when injected
hyperparameters change, compiled equal to eager, `stacked` equal to per-leaf (or refused),
checkpoint keys and a save/load round trip, clear errors on integer leaves and mismatched
trees, degenerate shapes (zero-size, 1×N, N×1, 0-D leaves), a NaN gradient element never
hidden (the behaviour each entry declares, docs/guide/faults.md), no state sharing memory with its
inputs; and, on 2 gloo ranks in one spawn, `sharded` and `zero` equal to one device (a few
entries on the degenerate shapes in a second spawn)."""

from __future__ import annotations

import inspect

import pytest
import torch

import opttx
from opttx import conformance
from opttx.testing import assert_trees_close, gradient_stream
from opttx.tree import tree_map

from registry import CASES, Case

IDS = [c.name for c in CASES]
STEPS = 3


def cases_for(prop: str, cases: list[Case] = CASES) -> list:
    """The cases as pytest params, those with a known bug of ``prop`` as strict xfails."""
    out = []
    for c in cases:
        reasons = [why for p, why in c.known_bugs if p == prop]
        marks = [pytest.mark.xfail(strict=True, reason=reasons[0])] if reasons else []
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


def params_of(case: Case, dtype: torch.dtype = torch.float32, seed: int = 0
              ) -> dict[str, torch.Tensor]:
    """A matrix, a vector (left out for transforms of matrices only), a 3-D leaf and a second
    matrix of the first one's shape (so that `stacked` has a stack of two)."""
    return conformance.standard_params(dtype, seed, case.matrices_only)


def run(tx: opttx.GradientTransformation, params, grads, state=None):
    state = tx.init(params) if state is None else state
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = opttx.apply_updates(params, updates)
    return params, state


def clone(tree):
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def public_transform_names() -> set[str]:
    """Every name in ``opttx.__all__`` that builds a transform: functions annotated to return
    a `GradientTransformation` (or a factory of them), and `MultiSteps`; not those that
    read transforms back (`opttx.chain_links` returns a chain's tuple of links)."""
    names = set()
    for name in opttx.__all__:
        obj = getattr(opttx, name)
        if isinstance(obj, type):
            if hasattr(obj, "gradient_transformation"):
                names.add(name)
            continue
        if not callable(obj):
            continue
        try:
            annotation = inspect.signature(obj).return_annotation
        except (TypeError, ValueError):
            continue
        if "GradientTransformation" in str(annotation) and \
                not str(annotation).startswith("tuple"):
            names.add(name)
    return names


def test_every_public_transform_is_registered() -> None:
    covered = {c.public_name for c in CASES} | {n for c in CASES for n in c.covers}
    missing = sorted(public_transform_names() - covered)
    assert not missing, f"add a line to tests/registry.py for: {missing}"
    assert len(public_transform_names()) >= 60


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_update_leaves_its_inputs_untouched(case: Case) -> None:
    """Purity: ``update`` writes into none of the updates, state or params it is given."""
    conformance.check_purity(case.make, params_of(case), case.name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_tree_without_leaves(case: Case) -> None:
    """A rank with no leaf of its own (zero, on_owners): init and update run, nothing to
    compute, the result keeps the tree."""
    if case.name == "stacked":
        pytest.skip("stacked needs at least one stacked leaf (it says so: tested in "
                    "test_stacked)")
    conformance.check_tree_without_leaves(case.make, case.name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_keeps_its_structure_shapes_and_dtypes(case: Case) -> None:
    """The state after steps has the structure, shapes and dtypes of the state at init (a
    compiled step, donation and checkpoints rely on it); with bfloat16 params, the
    floating-point statistics are float32 (docs/design.md, rule 3) and the updates come
    back in the params' dtype."""
    conformance.check_state_structure_and_dtypes(
        case.make, lambda dtype: params_of(case, dtype), case.name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float64_runs_are_bitwise_reproducible(case: Case) -> None:
    conformance.check_float64_determinism(case.make, params_of(case, torch.float64), case.name)


INJECTABLE = [c for c in CASES if c.factory is not None]


def _injects_a_hyperparameter(case: Case) -> bool:
    if case.factory is None:
        return False
    tx = opttx.inject_hyperparams(case.factory)(**case.kwargs)
    return bool(tx.init(params_of(case)).hyperparams)


# compiled as built (Python-float hyperparameters, constants of the graph) where the entry is
# not compiled with its hyperparameters injected below (the form opttx.Optimizer runs): the
# same update code, and Dynamo's tracing of it is what costs (~1.4 s an entry on 2 cores);
# tests/test_compile.py compiles built aliases in whole train steps

PLAIN_COMPILED = [c for c in CASES if not _injects_a_hyperparameter(c)]


@pytest.mark.parametrize("case", PLAIN_COMPILED, ids=[c.name for c in PLAIN_COMPILED])
def test_compiles_to_one_graph_and_equals_eager(case: Case) -> None:
    conformance.check_one_compiled_graph(case.make, params_of(case), case.name)


@pytest.mark.parametrize("case", INJECTABLE, ids=[c.name for c in INJECTABLE])
def test_changing_injected_hyperparameters_recompiles_nothing(case: Case) -> None:
    if not conformance.check_injected_hyperparameters(case.factory, case.kwargs,
                                                      params_of(case), case.name):
        pytest.skip(f"{case.name} has no numeric hyperparameter to inject")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_stacked_equals_per_leaf_or_is_refused(case: Case) -> None:
    """Per-leaf transforms (declared ``Traits.per_leaf``, no statistic across leaves) give
    their per-leaf numbers on stacked slices; the others are refused when ``stacked`` is
    built; the entries with a reason raise (vmap's own error)."""
    conformance.check_stacked(case.make, params_of(case), refused=case.stacked is not None,
                              name=case.name)


@pytest.mark.parametrize("case", cases_for("checkpoint"))
def test_checkpoint_round_trip_resumes_bitwise(case: Case) -> None:
    """Checkpoint keys are the same for a fresh state and a trained one; saved with
    ``torch.save`` and loaded with ``weights_only=True`` into a fresh state, training goes on
    bit-identically."""
    conformance.check_checkpoint_round_trip(case.make, params_of(case), case.name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_integer_leaves_and_mismatched_trees_raise(case: Case) -> None:
    """Integer parameters are refused at init; updates whose tree differs from the params'
    raise before a parameter moves: in ``update`` when the state is laid out like the
    params, at the latest in ``apply_updates`` (a stateless transform has nothing to compare
    with)."""
    conformance.check_errors(case.make, params_of(case), case.name)


@pytest.mark.parametrize("case", cases_for("donation"))
def test_donating_paths_equal_the_functional_path_bitwise(case: Case) -> None:
    """The in-place paths give the functional numbers bit for bit over 30 steps, on 0-D to
    4-D leaves (first steps, warm-ups and periodic refreshes included): ``update`` inside
    `opttx.donating` with `opttx.apply_updates_`, and `opttx.Optimizer` (which donates its
    state) against ``update`` and `opttx.apply_updates` of the transform the user gave (its
    hyperparameters as Python numbers, not injected). A transform
    that writes a state buffer in place and reads the old value afterwards (SOAP's kept first
    moment, once) fails here."""
    params = conformance.leaves_0d_to_4d(matrices_only=case.matrices_only)
    if case.name == "stacked":      # its leaves are stacks: two matrices and two vectors
        params = opttx.StackedParams({"w": params["w"], "v": params["v"]}).buffers
    conformance.check_donation(case.make, params, name=case.name)


@pytest.mark.parametrize("case", cases_for("compile_on_another_thread"))
def test_an_eager_step_while_another_thread_compiles_is_unchanged(case: Case) -> None:
    """Dynamo's "compiling" flag is one per process: raised by hand around an eager run (as a
    compile on another thread leaves it: offload's worker, a user's thread), every entry
    steps to the same numbers bit for bit, functional and donating (6 steps, first steps
    and the refreshes of the cases, every 2 steps, included). The library branches on
    `opttx.is_tracing`, which also asks whether this thread is the one traced."""
    params = conformance.leaves_0d_to_4d(matrices_only=case.matrices_only)
    if case.name == "stacked":      # its leaves are stacks: two matrices and two vectors
        params = opttx.StackedParams({"w": params["w"], "v": params["v"]}).buffers
    conformance.check_compile_on_another_thread(case.make, params, steps=6, name=case.name)


def test_the_library_reads_the_compiling_flag_only_through_is_tracing() -> None:
    """``torch.compiler.is_compiling()`` appears in one place of the package, `is_tracing`:
    a new bare read would take the traced branch in eager code whenever another thread
    compiles (the registry-wide property above then catches it only if that branch changes
    the numbers)."""
    import pathlib
    root = pathlib.Path(opttx.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "torch.compiler.is_compiling()" in p.read_text())
    assert readers == ["_tracing.py"], readers


def test_is_tracing_is_true_in_a_trace_and_false_in_eager_code_while_another_thread_compiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from opttx._tracing import is_tracing
    seen = []

    def step(x):
        seen.append(is_tracing())
        return x * 2 if is_tracing() else x * 3
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert seen == [True]
    assert not is_tracing()
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling() and not is_tracing()


# ---------------------------------------------------------------------------------------------
# sharded and zero on 2 gloo ranks: every entry in one spawn
# ---------------------------------------------------------------------------------------------

DISTRIBUTED = [c for c in CASES if c.distributed is None]


def _specs():
    from opttx.distributed import Replicated, Shard
    # dim 0 and dim 1 shards, uneven (5 = 3 + 2, 3 = 2 + 1), and a replicated vector
    return {"w": Shard(0), "b": Replicated(), "t": Shard(1), "v": Shard(1)}


def _distributed_worker(rank: int, world: int) -> dict[str, str]:
    """On each rank, for every entry: ``sharded`` on this rank's shards and ``zero`` on the
    whole (replicated) tree, each against the single-device run of the same steps. Returns
    ``{entry/mode: error}`` for what failed (empty when all agree)."""
    from opttx.distributed import local_shard, sharded
    errors: dict[str, str] = {}
    for case in DISTRIBUTED:
        params = params_of(case, seed=11)
        specs = {k: v for k, v in _specs().items() if k in params}
        grads = gradient_stream(params, STEPS, seed=12)
        try:
            expected, _ = run(case.make(), params, grads)
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[f"{case.name}/sharded"] = errors[f"{case.name}/zero"] = \
                f"the single-device run failed: {type(e).__name__}: {e}"
            continue
        on_owners = opttx.base.traits_of(case.make()).whole_leaves
        local = {k: local_shard(v, specs[k]) for k, v in params.items()}
        local_grads = [{k: local_shard(v, specs[k]) for k, v in g.items()} for g in grads]
        if on_owners:     # a transform that needs whole leaves is refused on local shards
            try:
                run(sharded(case.make(), specs), local, local_grads[:1])
                errors[f"{case.name}/refused"] = "plain sharded ran on local shards"
            except ValueError as e:
                if "on_owners" not in str(e):
                    errors[f"{case.name}/refused"] = f"unclear refusal: {e}"
        errors.update(_sharded_and_zero_errors(case, params, grads, specs, expected, rank))
    return errors


def _sharded_and_zero_errors(case: Case, params: dict, grads: list, specs: dict,
                             expected: dict, rank: int) -> dict[str, str]:
    """``sharded`` on this rank's pieces (``on_owners`` where the traits need whole leaves)
    and ``zero`` on the whole tree against the single-device ``expected`` (rtol 1e-5):
    ``{entry/mode: error}`` for what differs or raises."""
    from opttx.distributed import local_shard, sharded, zero
    errors: dict[str, str] = {}
    on_owners = opttx.base.traits_of(case.make()).whole_leaves
    local = {k: local_shard(v, specs[k]) for k, v in params.items()}
    local_grads = [{k: local_shard(v, specs[k]) for k, v in g.items()} for g in grads]
    try:
        got, _ = run(sharded(case.make(), specs, on_owners=on_owners), local, local_grads)
        want = {k: local_shard(v, specs[k]) for k, v in expected.items()}
        assert_trees_close(got, want, rtol=1e-5, atol=1e-7, what=f"rank {rank} params")
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors[f"{case.name}/sharded"] = f"{type(e).__name__}: {e}"
    try:
        got, _ = run(zero(case.make()), params, grads)
        assert_trees_close(got, expected, rtol=1e-5, atol=1e-7, what=f"rank {rank} params")
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors[f"{case.name}/zero"] = f"{type(e).__name__}: {e}"
    return errors


@pytest.fixture(scope="module")
def distributed_errors() -> list[dict[str, str]]:
    from opttx.testing import spawn_ranks
    return spawn_ranks(_distributed_worker, world_size=2, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("mode", ["sharded", "zero"])
@pytest.mark.parametrize("case", DISTRIBUTED, ids=[c.name for c in DISTRIBUTED])
def test_sharded_and_zero_equal_one_device(case: Case, mode: str,
                                           distributed_errors: list[dict[str, str]]) -> None:
    """On 2 gloo ranks, params sharded on dim 0 and dim 1 (uneven) with a replicated leaf:
    ``sharded(tx)`` (``on_owners=True`` for transforms that need whole leaves) gives every
    rank its piece of the single-device result, and ``zero(tx)`` the whole of it."""
    for rank, errors in enumerate(distributed_errors):
        assert f"{case.name}/{mode}" not in errors, \
            f"rank {rank}: {errors[f'{case.name}/{mode}']}"


WHOLE_LEAVES = [c for c in DISTRIBUTED if opttx.base.traits_of(c.make()).whole_leaves]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("case", WHOLE_LEAVES, ids=[c.name for c in WHOLE_LEAVES])
def test_whole_leaf_transforms_are_refused_on_local_shards(
        case: Case, distributed_errors: list[dict[str, str]]) -> None:
    """Plain ``sharded`` refuses, naming ``on_owners``, a transform whose traits say it needs
    whole leaves (an SVD, an eigendecomposition, quantization blocks)."""
    for rank, errors in enumerate(distributed_errors):
        assert f"{case.name}/refused" not in errors, \
            f"rank {rank}: {errors[f'{case.name}/refused']}"


# ---------------------------------------------------------------------------------------------
# degenerate shapes, a NaN in a gradient, and states that keep an input
# ---------------------------------------------------------------------------------------------


def degenerate_params_of(case: Case) -> dict[str, torch.Tensor]:
    """Zero-size, 1×N and N×1 matrices beside a matrix, and (unless the case takes matrices
    only) a 0-D leaf, an empty vector and a vector; for `stacked`, stacks of two of each
    matrix (its leaves are stacks)."""
    params = conformance.degenerate_params(case.matrices_only)
    if case.name == "stacked":
        return opttx.StackedParams({f"{k}{i}": v.clone() for k, v in params.items()
                                    if v.ndim == 2 for i in (0, 1)}).buffers
    return params


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_degenerate_shapes_give_finite_updates_of_their_shapes(case: Case) -> None:
    """Zero-size matrices ((0, 5), (6, 0)), a row, a column, a 0-D leaf and an empty vector:
    every step gives finite updates of the params' shapes (empty for empty leaves), and the
    state round-trips through a checkpoint (muon's orthogonalization, dion, dion2 and kron
    crashed on a zero-size matrix)."""
    conformance.check_degenerate_shapes(case.make, degenerate_params_of(case), case.name)


def faults_page_exceptions() -> dict[str, str]:
    """docs/guide/faults.md's table of the registry entries that do not propagate a NaN
    gradient: {entry: behaviour}."""
    import pathlib
    import re
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide" / "faults.md"
    text = page.read_text().split("### Non-finite gradients, entry by entry")[1]
    table = next(block for block in text.split("\n\n") if block.startswith("| behaviour"))
    out: dict[str, str] = {}
    for row in table.splitlines()[2:]:          # | `behaviour` | meaning | `entry`, ... |
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        behaviour = cells[0].strip("`")
        for name in re.findall(r"`([^`]+)`", cells[-1]):
            assert name not in out, f"faults.md lists {name} twice"
            out[name] = behaviour
    return out


def test_registry_declares_known_nonfinite_behaviours_and_faults_guide_lists_them() -> None:
    """Each entry declares one of `opttx.conformance.NONFINITE_BEHAVIOURS` (``nonfinite=``,
    "propagates" by default), and docs/guide/faults.md lists exactly the entries that declare
    another one, with the behaviour they declare."""
    unknown = {c.name: c.nonfinite for c in CASES
               if c.nonfinite not in conformance.NONFINITE_BEHAVIOURS}
    assert not unknown, f"tests/registry.py: unknown nonfinite= behaviours {unknown}"
    declared = {c.name: c.nonfinite for c in CASES if c.nonfinite != "propagates"}
    listed = faults_page_exceptions()
    assert listed == declared, (
        "docs/guide/faults.md, 'Non-finite gradients, entry by entry', must list the entries "
        f"that tests/registry.py declares with nonfinite=: the registry says {declared}, the "
        f"page says {listed}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_nan_gradient_is_never_hidden(case: Case) -> None:
    """One NaN element in a matrix's gradient: the entry's update holds a NaN at that step,
    or the entry does what its registry line declares (``nonfinite=``, listed in
    docs/guide/faults.md: apply_if_finite skips the step, zero_nans zeroes the element,
    MultiSteps shows it at its boundary, an SVD raises)."""
    params = params_of(case)
    if case.name == "stacked":
        params = opttx.StackedParams({"w": params["w"], "v": params["v"]}).buffers
    conformance.check_nonfinite_gradients(case.make, params, case.nonfinite, case.name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_state_never_shares_memory_with_its_inputs(case: Case) -> None:
    """No state tensor shares storage with the params given to ``init``, nor with the
    gradients or params given to ``update`` (functional and donating): the caller may
    overwrite those after the step."""
    conformance.check_no_aliasing(case.make, params_of(case), case.name)


DEGENERATE_DISTRIBUTED = ["muon", "adamw", "adafactor", "shampoo", "dion2"]


def _degenerate_specs(params: dict) -> dict:
    """Matrices on dim 0 (the row (1, 5) and the (0, 5) matrix leave a rank an empty piece),
    the column on dim 1 (a (5, 0) piece), the rest replicated."""
    from opttx.distributed import Replicated, Shard
    return {k: Shard(1) if k == "col" else Shard(0) if v.ndim == 2 else Replicated()
            for k, v in params.items()}


def _degenerate_distributed_worker(rank: int, world: int) -> dict[str, str]:
    """``sharded`` (on this rank's pieces, ``on_owners`` where the traits need whole leaves)
    and ``zero`` of a few entries on the degenerate tree, each against one device: finite,
    of the right shapes, equal (rtol 1e-5). Returns ``{entry/mode: error}``."""
    from registry import BY_NAME
    errors: dict[str, str] = {}
    for name in DEGENERATE_DISTRIBUTED:
        case = BY_NAME[name]
        params = degenerate_params_of(case)
        specs = _degenerate_specs(params)
        grads = gradient_stream(params, STEPS, seed=14)
        try:
            expected, _ = run(case.make(), params, grads)
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors[f"{name}/sharded"] = errors[f"{name}/zero"] = \
                f"the single-device run failed: {type(e).__name__}: {e}"
            continue
        errors.update(_sharded_and_zero_errors(case, params, grads, specs, expected, rank))
    return errors


@pytest.fixture(scope="module")
def degenerate_distributed_errors() -> list[dict[str, str]]:
    from opttx.testing import spawn_ranks
    return spawn_ranks(_degenerate_distributed_worker, world_size=2, timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["sharded", "zero"])
@pytest.mark.parametrize("name", DEGENERATE_DISTRIBUTED)
def test_degenerate_shapes_sharded_and_zero_equal_one_device(
        name: str, mode: str, degenerate_distributed_errors: list[dict[str, str]]) -> None:
    """On 2 gloo ranks, the degenerate tree (zero-size matrices, a row whose dim-0 split
    leaves one rank an empty piece, a column split on dim 1, a 0-D leaf): ``sharded`` and
    ``zero`` give every rank the single-device result (finite, since that one is)."""
    for rank, errors in enumerate(degenerate_distributed_errors):
        assert f"{name}/{mode}" not in errors, f"rank {rank}: {errors[f'{name}/{mode}']}"
