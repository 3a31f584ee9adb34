"""Tools for property-based tests of optimizers: hypothesis strategies for pytrees of tensors,
hyperparameters and sharding specs, closeness assertions on trees, and equivalence runners, in
one process (`assert_equivalent`) and over several processes (`assert_shard_invariant`).

opttx's own test suite uses these; they are public so that users can prove their own
compositions equal a reference, and that they give the single-device result when sharded.

Example:
  >>> from hypothesis import given
  >>> from opttx.testing import param_trees, assert_equivalent, hyperparameters
  >>> @given(tree=param_trees(), hp=hyperparameters("learning_rate", "b1", "b2"))
  ... def test_my_adam_is_adam(tree, hp):
  ...     mine = opttx.chain(opttx.scale_by_adam(hp["b1"], hp["b2"]),
  ...                        opttx.scale(-hp["learning_rate"]))
  ...     assert_equivalent(mine, opttx.adam(**hp), tree.tree, steps=10)
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .base import GradientTransformation, apply_updates
from .closeness import assert_trees_close, gradient_stream, max_relative_error
from .conformance import check_transform
from .tree import (PyTree, keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_map,
                   tree_paths)

__all__ = [
    "check_transform",
    "MeshDim",
    "ParamTree",
    "assert_equivalent",
    "assert_optimizer_resumes",
    "assert_shard_invariant",
    "assert_trees_close",
    "bind_mesh",
    "displacement_gaps",
    "exit_rank",
    "gradient_stream",
    "hyperparameters",
    "log_uniform",
    "max_relative_error",
    "one_ulp",
    "param_trees",
    "run_transform",
    "shapes",
    "sharded_settings",
    "sharding_specs",
    "spawn_ranks",
]


# ---------------------------------------------------------------------------------------------
# running transforms
# ---------------------------------------------------------------------------------------------


def one_ulp(grads: Sequence[PyTree]) -> list[PyTree]:
    """``grads`` with every entry moved by one ulp away from zero (zeros stay): the input
    perturbation whose effect on a reference implementation measures its own rounding
    spread, the bound for comparisons where that spread is large (Shampoo's rank-deficient
    factors at a tiny epsilon)."""
    return [tree_map(lambda g: torch.where(g == 0, g, torch.nextafter(g, g.sign() * torch.inf)),
                     tree) for tree in grads]


def displacement_gaps(actual: PyTree, expected: PyTree, start: PyTree) -> dict[str, float]:
    r"""Per leaf, :math:`\lVert a - e \rVert / \lVert e - s \rVert` in float64: how far
    ``actual`` is from ``expected`` relative to how far ``expected`` moved from ``start``
    (parameters after some steps of two optimizers from the same start). Keyed by the dict's
    keys for a flat dict, else by the leaves' paths."""
    if isinstance(expected, dict) and all(isinstance(v, torch.Tensor) for v in expected.values()):
        return {k: _displacement_gap(actual[k], expected[k], start[k]) for k in expected}
    paths = [keystr(p) for p, _ in tree_flatten_with_path(expected)[0]]
    return {p: _displacement_gap(a, e, s) for p, a, e, s in zip(
        paths, tree_leaves(actual), tree_leaves(expected), tree_leaves(start), strict=True)}


def _displacement_gap(a: torch.Tensor, e: torch.Tensor, s: torch.Tensor) -> float:
    return float((a - e).double().norm() / (e - s).double().norm().clamp_min(1e-30))


def run_transform(tx: GradientTransformation, params: PyTree, grads: Sequence[PyTree],
                  state: Any = None, **extra_args: Any) -> tuple[PyTree, Any]:
    """Apply ``tx`` for each gradient tree in ``grads``, from ``state`` (default
    ``tx.init(params)``); return final params and state."""
    state = tx.init(params) if state is None else state
    for g in grads:
        updates, state = tx.update(g, state, params, **extra_args)
        params = apply_updates(params, updates)
    return params, state


def assert_equivalent(tx_a: GradientTransformation, tx_b: GradientTransformation,
                      params: PyTree, steps: int = 10, grads: Sequence[PyTree] | None = None,
                      rtol: float = 1e-5, atol: float = 0.0, seed: int = 0) -> None:
    """Assert two transforms give the same parameters after every one of ``steps`` updates.

    Both run from ``params`` on the same gradients; after each step the parameters are compared
    with `assert_trees_close`, so a difference is reported at the first step where it shows,
    naming the leaf and its max relative error.

    Args:
      tx_a, tx_b: the transforms to compare (``tx_b`` is the reference).
      params: the starting parameter tree.
      steps: the number of updates (ignored when ``grads`` is given).
      grads: the gradient trees, one per step; default Gaussian (`gradient_stream`).
      rtol, atol: the tolerances of `assert_trees_close`.
      seed: the seed of the default gradients.

    Example:
      >>> mine = opttx.chain(opttx.scale_by_adam(), opttx.scale(-1e-3))
      >>> assert_equivalent(mine, opttx.adam(1e-3), {"w": torch.randn(4, 3)}, steps=10)
    """
    grads = list(grads) if grads is not None else gradient_stream(params, steps, seed)
    pa, pb = params, params
    sa, sb = tx_a.init(params), tx_b.init(params)
    for k, g in enumerate(grads, 1):
        ua, sa = tx_a.update(g, sa, pa)
        pa = apply_updates(pa, ua)
        ub, sb = tx_b.update(g, sb, pb)
        pb = apply_updates(pb, ub)
        assert_trees_close(pa, pb, rtol=rtol, atol=atol, what=f"params after step {k}: ")


# ---------------------------------------------------------------------------------------------
# hypothesis strategies
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamTree:
    """A drawn parameter tree: ``tree`` (a dict of tensors) and the ``seed`` that made it."""
    tree: dict[str, torch.Tensor]
    seed: int

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tree.items()}
        dtypes = {str(v.dtype) for v in self.tree.values()}
        return f"ParamTree(shapes={shapes}, dtypes={dtypes}, seed={self.seed})"


def assert_optimizer_resumes(make_optimizer: Callable[[], torch.optim.Optimizer],
                             model: torch.nn.Module, loss: Callable[[], torch.Tensor],
                             steps: int = 3, resumed_steps: int = 2) -> dict:
    """Assert that an optimizer's ``state_dict`` resumes training bit-identically.

    Trains ``model`` for ``steps`` steps with ``make_optimizer()`` (``zero_grad``,
    ``loss().backward()``, ``step``), saves ``state_dict()``, trains ``resumed_steps`` more and
    keeps the parameters; then puts the parameters back as they were at the save, loads the
    saved dict into a fresh ``make_optimizer()`` and trains ``resumed_steps`` steps: the
    parameters must equal the uninterrupted run's bit for bit (quantized codes, step counts
    and every other state entry round-trip, or a parameter differs).

    Args:
      make_optimizer: builds an optimizer over ``model``'s parameters (called twice).
      model: the model; its parameters are trained in place.
      loss: computes the loss of ``model`` on a fixed batch.
      steps, resumed_steps: the steps before the save, and after it.

    Returns:
      The saved state dict (to check what it holds).

    Example:
      >>> model = torch.nn.Linear(8, 2)
      >>> x, y = torch.randn(16, 8), torch.randn(16, 2)
      >>> saved = assert_optimizer_resumes(
      ...     lambda: opttx.Optimizer(model.parameters(), opttx.adamw_8bit(1e-2)), model,
      ...     lambda: torch.nn.functional.mse_loss(model(x), y))
    """
    def train(opt: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            loss().backward()
            opt.step()

    opt = make_optimizer()
    train(opt, steps)
    saved = opt.state_dict()
    at_save = [p.detach().clone() for p in model.parameters()]
    train(opt, resumed_steps)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, x in zip(model.parameters(), at_save):
            p.copy_(x)
    fresh = make_optimizer()
    fresh.load_state_dict(saved)
    train(fresh, resumed_steps)
    names = [n for n, _ in model.named_parameters()]
    for name, p, expected in zip(names, model.parameters(), uninterrupted):
        assert torch.equal(p.detach(), expected), \
            f"{name}: the resumed run differs from the uninterrupted one " \
            f"(max abs {float((p.detach() - expected).abs().max()):.3e})"
    return saved


def shapes(min_dims: int = 0, max_dims: int = 3, min_side: int = 1, max_side: int = 7):
    """Strategy for tensor shapes (tuples of ints)."""
    from hypothesis import strategies as st
    return st.lists(st.integers(min_side, max_side), min_size=min_dims,
                    max_size=max_dims).map(tuple)


def param_trees(min_leaves: int = 1, max_leaves: int = 4,
                dtypes: Sequence[torch.dtype] = (torch.float32,),
                shape_strategy: Any = None, scale: float = 1.0):
    """Strategy for `ParamTree`: a dict of 1–4 named tensors of drawn shapes and dtype.

    Values are Gaussian from a drawn seed (fast to generate and to shrink on failure).
    """
    from hypothesis import strategies as st

    shape_strategy = shape_strategy if shape_strategy is not None else shapes()

    @st.composite
    def build(draw: Callable) -> ParamTree:
        n = draw(st.integers(min_leaves, max_leaves))
        leaf_shapes = [draw(shape_strategy) for _ in range(n)]
        dtype = draw(st.sampled_from(list(dtypes)))
        seed = draw(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        tree = {f"p{i}": (scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype)
                for i, s in enumerate(leaf_shapes)}
        return ParamTree(tree=tree, seed=seed)

    return build()


def log_uniform(low: float, high: float):
    """Strategy for floats spread evenly in log scale over ``[low, high]`` (both > 0).

    Example:
      >>> lrs = log_uniform(1e-5, 1e-1)       # as many draws below 1e-3 as above
    """
    import math

    from hypothesis import strategies as st
    if not 0 < low <= high:
        raise ValueError(f"log_uniform needs 0 < low <= high, got ({low}, {high}).")
    return st.floats(math.log(low), math.log(high)).map(
        lambda x: min(max(math.exp(x), low), high))


# name -> (scale, low, high, exclude high): the default range of each known hyperparameter
_HYPERPARAMETER_RANGES: dict[str, tuple[str, float, float, bool]] = {
    "learning_rate": ("log", 1e-4, 1e-1, False),
    "lr": ("log", 1e-4, 1e-1, False),
    "b1": ("linear", 0.0, 0.99, False),
    "b2": ("linear", 0.5, 1.0, True),
    "beta1": ("linear", 0.0, 0.99, False),
    "beta2": ("linear", 0.5, 1.0, True),
    "momentum": ("linear", 0.0, 1.0, True),
    "decay": ("linear", 0.0, 1.0, True),
    "eps": ("log", 1e-10, 1e-6, False),
    "epsilon": ("log", 1e-10, 1e-6, False),
    "weight_decay": ("linear", 0.0, 0.1, False),
    "max_norm": ("log", 1e-2, 10.0, False),
    "clipping_threshold": ("log", 1e-1, 10.0, False),
    "clip_threshold": ("log", 1e-1, 10.0, False),
    "trust_coefficient": ("log", 1e-4, 1e-1, False),
}
_BOOLEAN_HYPERPARAMETERS = ("nesterov",)


def _range_strategy(name: str, value: Any):
    from hypothesis import strategies as st
    from hypothesis.strategies import SearchStrategy
    if isinstance(value, SearchStrategy):
        return value
    if isinstance(value, list):
        return st.sampled_from(value)
    if isinstance(value, tuple) and len(value) == 2:
        low, high = (float(v) for v in value)
        if not low <= high:
            raise ValueError(f"hyperparameters: the range of {name} must be (low, high) with "
                             f"low <= high, got {value!r}.")
        if _HYPERPARAMETER_RANGES.get(name, ("linear",))[0] == "log" and low > 0:
            return log_uniform(low, high)
        return st.floats(low, high, allow_nan=False, allow_infinity=False,
                         allow_subnormal=False)
    if isinstance(value, (bool, int, float)):
        return st.just(value)
    raise TypeError(f"hyperparameters: {name}={value!r}; give a (low, high) pair, a list of "
                    "values, a single value or a hypothesis strategy.")


def hyperparameters(*names: str, **ranges: Any):
    """Strategy for a dict of hyperparameters, each drawn from a sensible range.

    A name given positionally takes its default range:

    | name | default range |
    | --- | --- |
    | ``learning_rate``, ``lr`` | log-uniform in [1e-4, 1e-1] |
    | ``b1``, ``beta1`` | uniform in [0, 0.99] |
    | ``b2``, ``beta2`` | uniform in [0.5, 1) |
    | ``momentum``, ``decay`` | uniform in [0, 1) |
    | ``eps``, ``epsilon`` | log-uniform in [1e-10, 1e-6] |
    | ``weight_decay`` | uniform in [0, 0.1] |
    | ``max_norm`` | log-uniform in [1e-2, 10] |
    | ``clipping_threshold``, ``clip_threshold`` | log-uniform in [0.1, 10] |
    | ``trust_coefficient`` | log-uniform in [1e-4, 1e-1] |
    | ``nesterov`` | ``True`` or ``False`` |

    A name given as a keyword takes the range given: a ``(low, high)`` pair (log-uniform for
    the names whose default is, when ``low > 0``; uniform otherwise), a list of values to
    sample from, a single value, or any hypothesis strategy. Keys keep the order given, so the
    dict can be passed as keyword arguments to an alias.

    Args:
      *names: hyperparameters with their default ranges.
      **ranges: hyperparameters with the ranges given.

    Returns:
      A hypothesis strategy of ``dict[str, value]``.

    Example:
      >>> @given(hp=hyperparameters("learning_rate", "b1", "b2", weight_decay=(0.0, 0.5)))
      ... def test_adamw(hp):
      ...     tx = opttx.adamw(**hp)
    """
    from hypothesis import strategies as st
    out: dict[str, Any] = {}
    for name in names:
        if name in _BOOLEAN_HYPERPARAMETERS:
            out[name] = st.booleans()
        elif name in _HYPERPARAMETER_RANGES:
            scale, low, high, open_right = _HYPERPARAMETER_RANGES[name]
            out[name] = (log_uniform(low, high) if scale == "log" else
                         st.floats(low, high, exclude_max=open_right, allow_subnormal=False))
        else:
            known = ", ".join(sorted([*_HYPERPARAMETER_RANGES, *_BOOLEAN_HYPERPARAMETERS]))
            raise ValueError(f"hyperparameters: no default range for {name!r}; give one as a "
                             f"keyword ({name}=(low, high)) or use one of: {known}.")
    for name, value in ranges.items():
        out[name] = _range_strategy(name, value)
    keys = list(out)
    return st.tuples(*out.values()).map(lambda values: dict(zip(keys, values)))


# ---------------------------------------------------------------------------------------------
# sharding specs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshDim:
    """A placeholder for the process group of mesh dim ``index``, standing as the ``group`` of
    an `opttx.distributed.Shard` drawn where no process group exists (in the parent of the
    ranks). `bind_mesh` puts each rank's group in its place; `assert_shard_invariant` does it
    for you.

    Example:
      >>> Shard(1, MeshDim(0))     # dim 1 split over the first mesh dim's group
    """
    index: int

    def __repr__(self) -> str:
        return f"MeshDim({self.index})"


def _is_shape(x: Any) -> bool:
    return type(x) in (tuple, torch.Size) and all(isinstance(i, int) for i in x)


def _shape_tree(shapes: PyTree) -> tuple[list[tuple[int, ...]], Any]:
    """The shapes of a tree whose leaves are shape tuples (or tensors), and its treespec."""
    leaves, treespec = tree_flatten(
        shapes, is_leaf=lambda x: _is_shape(x) or isinstance(x, torch.Tensor))
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(tuple(x.shape))
        elif _is_shape(x):
            out.append(tuple(x))
        else:
            raise TypeError(f"Expected a tree of shapes (tuples of ints) or of tensors, found a "
                            f"leaf {x!r}.")
    return out, treespec


def _draw_leaf_spec(shape: tuple[int, ...], mesh: Sequence[int], groups: Sequence[Any],
                    replicated: bool, uneven: bool, pick: Callable[[list], Any]) -> Any:
    """One leaf's spec, every choice made by ``pick(options)`` (the simplest option first:
    replicated leaves, non-negative dims)."""
    from .distributed.specs import Replicated, Shard
    ndim = len(shape)
    if ndim == 0:
        return Replicated()
    split = [1] * ndim
    shards = []
    for axis, size in enumerate(mesh):
        dims = [d for d in range(ndim) if uneven or shape[d] % (split[d] * size) == 0]
        must = not replicated and not shards and axis == len(mesh) - 1 and dims
        dim = pick(dims if must else [None, *dims])
        if dim is None:
            continue
        negative = pick([False, True])
        split[dim] *= size
        shards.append(Shard(dim - ndim if negative else dim, groups[axis]))
    if not shards:
        return Replicated()
    return shards[0] if len(shards) == 1 else tuple(shards)


def _check_mesh(mesh: Sequence[int], groups: Sequence[Any] | None) -> list[Any]:
    mesh = tuple(mesh)
    if not 1 <= len(mesh) <= 2 or not all(isinstance(m, int) and m >= 1 for m in mesh):
        raise ValueError(f"mesh must be one or two positive group sizes, got {mesh!r}.")
    if groups is None:
        return [None] if len(mesh) == 1 else [MeshDim(i) for i in range(len(mesh))]
    groups = list(groups)
    if len(groups) != len(mesh):
        raise ValueError(f"sharding_specs: {len(groups)} groups for a mesh of {len(mesh)} dims.")
    return groups


def sharding_specs(shapes: PyTree, mesh: Sequence[int] | None = None,
                   groups: Sequence[Any] | None = None, replicated: bool = True,
                   uneven: bool = True):
    """Strategy for sharding-spec trees of parameters of the given global shapes.

    Every leaf of rank one or more is, independently, `Replicated` or split over some of the
    mesh dims: for each mesh dim, not at all or along a drawn dim (a dim may be split by both
    mesh dims, as FSDP on a tensor-parallel shard; some dims are written negative).
    Dims whose size the group size does not divide are drawn too, leaving uneven pieces or,
    for a size below the group size, empty ones. 0-dim leaves are replicated.

    Shrinking stays bounded: one drawn integer seeds every choice of the tree (0 gives the
    simplest spec everywhere), so a failing example is replayed about a dozen times while
    hypothesis shrinks it, whatever the size of the tree (measured: 13 calls in all, against
    80 to 170 with a choice per leaf for 12 to 24 leaves; each is a multi-process run under
    `assert_shard_invariant`). For a test whose other strategies would still shrink for long,
    `sharded_settings` turns shrinking off.

    Draw the specs once, in the process that spawns the ranks, and ship them (deterministic and
    simple; `assert_shard_invariant` takes them): there the groups are placeholders, None for a
    1-D mesh (the default group) and `MeshDim` for a 2-D one, which `bind_mesh` replaces by
    each rank's groups. Or draw inside every rank with the real ``groups``, with hypothesis
    derandomized (``settings(derandomize=True, database=None)``) so that all ranks draw the
    same specs.

    Args:
      shapes: a tree whose leaves are global shapes (tuples of ints) or tensors.
      mesh: the size of each mesh dim (one or two): the number of ranks of its groups.
        Default: the sizes of ``groups`` when given, else ``(2,)``.
      groups: the process group of each mesh dim, to put in the specs (default: placeholders).
      replicated: whether a leaf may be drawn replicated (False: every leaf with a dim that
        may be drawn is sharded over at least one mesh dim).
      uneven: whether dims whose size the group does not divide may be drawn.

    Returns:
      A hypothesis strategy of spec trees shaped like the params.

    Example:
      >>> shapes = {"w": (7, 4), "b": (7,)}
      >>> @settings(max_examples=1)
      ... @given(cases=st.lists(sharding_specs(shapes), min_size=4, max_size=4))
      ... def test_lamb_shards(cases):
      ...     assert_shard_invariant(partial(opttx.lamb, 1e-2), shapes, specs=cases)
    """
    from hypothesis import strategies as st
    leaves, treespec = _shape_tree(shapes)
    if mesh is None:
        if groups is None:
            mesh = (2,)
        else:
            import torch.distributed as dist
            mesh = tuple(dist.get_world_size(g) for g in groups)
    mesh = tuple(mesh)
    groups = _check_mesh(mesh, groups)

    @st.composite
    def build(draw: Callable) -> PyTree:
        # one drawn integer decides the whole tree (a seeded generator makes the choices;
        # 0: the simplest option everywhere): hypothesis shrinks it in about a dozen replays
        # whatever the number of leaves and mesh dims, where a choice per leaf and mesh dim
        # took 80-170 replays of 12-24 leaves, each a multi-process run when the test is
        # assert_shard_invariant (minutes)
        case = draw(st.integers(0, 2**32 - 1))
        rng = random.Random(case)
        pick = (lambda options: options[0]) if case == 0 else rng.choice
        return treespec.unflatten([_draw_leaf_spec(s, mesh, groups, replicated, uneven, pick)
                                   for s in leaves])
    return build()


def sharded_settings(max_examples: int = 4, shrink: bool = False, **kwargs: Any) -> Any:
    """Hypothesis settings for a test whose every example spawns ranks
    (`assert_shard_invariant`, `spawn_ranks`): few examples, no deadline, no health check
    for slow draws, and no shrinking unless asked (each replay of a failing example is a
    multi-process run, several seconds; hypothesis itself allows five minutes of shrinking).
    The failing example is still reported as drawn. ``kwargs`` go to ``settings``.

    Example:
      >>> @sharded_settings()
      ... @given(specs=sharding_specs({"w": (7, 4)}))
      ... def test_lamb_shards(specs):
      ...     assert_shard_invariant(partial(opttx.lamb, 1e-2), {"w": (7, 4)}, specs=specs)
    """
    from hypothesis import HealthCheck, Phase, settings
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    options = dict(max_examples=max_examples, deadline=None, phases=phases,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    options.update(kwargs)
    return settings(**options)


def bind_mesh(specs: PyTree, groups: Sequence[Any]) -> PyTree:
    """The spec tree with every `MeshDim` placeholder replaced by this rank's group of that
    mesh dim (``groups[index]``; None stands for the default group).

    Args:
      specs: a spec tree, as drawn by `sharding_specs` in the parent process.
      groups: this rank's process group of each mesh dim.

    Returns:
      A spec tree for `opttx.distributed.sharded`.

    Example:
      >>> specs = bind_mesh(drawn, (tp_group, dp_group))    # inside each rank
    """
    from .distributed.specs import Shard

    def bind(s: Any) -> Any:
        if isinstance(s, Shard) and isinstance(s.group, MeshDim):
            return Shard(s.dim, groups[s.group.index], s.size)
        if isinstance(s, tuple) and s and all(isinstance(x, Shard) for x in s):
            return tuple(bind(x) for x in s)
        return s
    return tree_map(bind, specs, is_leaf=_is_spec)


def _is_spec(x: Any) -> bool:
    from .distributed.specs import Replicated, Shard
    return (x is None or isinstance(x, (Replicated, Shard))
            or (isinstance(x, tuple) and bool(x) and all(isinstance(s, Shard) for s in x)))


def _spec_str(spec: Any) -> str:
    from .distributed.specs import Shard
    if isinstance(spec, Shard):
        g = spec.group
        where = "" if g is None else f", {g!r}" if isinstance(g, MeshDim) else ", group"
        return f"Shard({spec.dim}{where})"
    if isinstance(spec, tuple):
        return "(" + ", ".join(_spec_str(s) for s in spec) + ")"
    return "Replicated()" if spec is not None else "None"


# ---------------------------------------------------------------------------------------------
# several processes
# ---------------------------------------------------------------------------------------------


def exit_rank(code: int = 0) -> None:
    """End a process that joined a process group: wait for every rank, destroy the group,
    flush stdout and stderr, and leave with ``code`` without the interpreter's shutdown.

    Process groups and the objects that hold them (device meshes, DTensors, compiled graphs)
    may outlive ``destroy_process_group``; freed during interpreter shutdown, a gloo worker
    thread that is still joinable makes the C++ runtime abort ("terminate called without an
    active exception"), so a rank that finished its work dies by SIGABRT and its launcher
    reports a failure. ``os._exit`` skips that shutdown. Call it as a rank's last statement,
    after its results are written; atexit handlers do not run.

    Example:
      >>> def worker(rank, world, out):
      ...     dist.init_process_group("gloo", ...)
      ...     Path(f"{out}.{rank}").write_text(json.dumps(run(rank)))
      ...     exit_rank()
    """
    import os
    import sys

    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_main(rank: int, world: int, tmp: str, fn: Callable, args: tuple,
               timeout: float, consistency_checks: int | None = None,
               environ: dict[str, str] | None = None) -> None:
    """The body of every spawned rank: the caller's environment (a rank forked from the fork
    server has the server's), a gloo process group, ``fn``, its result or its error written
    to ``tmp`` for the parent."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    import datetime
    import pickle
    import traceback
    from pathlib import Path

    import torch.distributed as dist

    from .distributed.consistency import set_consistency_checks
    try:
        torch.set_num_threads(1)
        set_consistency_checks(consistency_checks)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world, *args)
        # whole or not at all: a rank killed while writing leaves no result file
        Path(f"{tmp}/result.{rank}.part").write_bytes(pickle.dumps(result))
        Path(f"{tmp}/result.{rank}.part").replace(f"{tmp}/result.{rank}")
    except BaseException as e:
        text = traceback.format_exc()
        try:
            blob = pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
            blob = None
        Path(f"{tmp}/error.{rank}").write_bytes(pickle.dumps((blob, text)))
        raise
    exit_rank()


def _raise_rank_error(tmp: str, world: int, cause: BaseException) -> None:
    import pickle
    from pathlib import Path
    errors = {}
    for r in range(world):
        f = Path(f"{tmp}/error.{r}")
        if f.exists():
            errors[r] = pickle.loads(f.read_bytes())
    if not errors:
        raise RuntimeError(f"a rank died without raising a Python exception ({cause}): it was "
                           "killed, or failed before running (a spawned process imports the "
                           "parent's __main__ module: guard scripts with "
                           "`if __name__ == '__main__':`).") from None
    rank = min(errors)
    blob, text = errors[rank]
    others = "".join(f"\nrank {r} also raised: {t.strip().splitlines()[-1]}"
                     for r, (_, t) in sorted(errors.items()) if r != rank)
    note = f"raised on rank {rank} of {world}; its traceback:\n{text}{others}"
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if isinstance(exc, BaseException):
        exc.add_note(note)
        raise exc
    raise RuntimeError(note)


def _start_method() -> str:
    """How `spawn_ranks` starts its ranks: from a fork server that has imported torch and
    opttx once (``"forkserver"``, where the platform has it), else as fresh interpreters
    (``"spawn"``)."""
    import multiprocessing
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "opttx", "opttx.distributed", "opttx.testing"])
    return "forkserver"


def spawn_ranks(fn: Callable[..., Any], world_size: int = 2, args: tuple = (),
                timeout: float = 120.0, consistency_checks: int | None = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in a gloo
    process group (CPU); return what each rank returned, in rank order.

    The processes fork from a server that imported torch and opttx once, where the platform
    has one (``"forkserver"``, Linux and macOS; elsewhere each starts a new interpreter): a
    trivial function on two ranks takes 0.06 s instead of 2.6 s (2-core Xeon,
    benchmarks/spawn_ranks.py); a rank still imports the module of ``fn``. Each rank gets
    this process's environment and import path as they are at the call (``os.environ``,
    passed by `spawn_ranks`; ``sys.path``, by multiprocessing), but what torch and opttx
    read from the environment when imported comes from the server's start, at the first
    call in this process.

    Every rank starts with ``torch.distributed`` initialised (``file://`` rendezvous in a
    temporary directory, collectives timing out after ``timeout`` seconds) and one intra-op
    thread, and with opttx's distributed checking mode on (``consistency_checks``: every
    update of `opttx.distributed.sharded` and `opttx.distributed.zero` compares the ranks'
    replicated parameters and step counters, see `opttx.distributed.consistency_checks`). An
    exception in a rank is raised again here, with the rank's traceback attached as a note;
    the other ranks are stopped. Ranks leave by `exit_rank`; one killed after every
    rank has returned its result (a process group's thread aborting at shutdown) loses
    nothing: the results are returned with a ``RuntimeWarning``. If the ranks have not all
    finished after ``timeout`` seconds (a rank waiting in a collective that another never
    issues), all are stopped and a ``TimeoutError`` names the ranks still running.

    ``fn``, ``args`` and the return values travel by pickle: ``fn`` must be importable by a
    fresh process (a function defined at the top level of a module, or a ``functools.partial``
    of one; not a lambda, and not a function defined in ``__main__`` or in a notebook).

    Args:
      fn: ``fn(rank, world_size, *args)``, run on every rank.
      world_size: the number of processes.
      args: further arguments of ``fn``.
      timeout: seconds for the whole run.
      consistency_checks: check every this many updates (None or 0: no checks).

    Returns:
      The list of the ranks' return values.

    Example:
      >>> def total(rank, world):          # in an importable module
      ...     x = torch.tensor([rank + 1.0]); dist.all_reduce(x); return float(x)
      >>> spawn_ranks(total, world_size=2)
      [3.0, 3.0]
    """
    import pickle
    import tempfile
    import time

    import torch.multiprocessing as mp
    try:
        pickle.dumps((fn, args))
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"spawn_ranks: the function and its arguments must be picklable to "
                        f"reach the spawned processes (a function defined at the top level of "
                        f"an importable module, or a functools.partial of one): {e}") from None
    with tempfile.TemporaryDirectory(prefix="opttx-ranks-") as tmp:
        ctx = mp.start_processes(_rank_main, args=(world_size, tmp, fn, tuple(args), timeout,
                                                   consistency_checks, dict(os.environ)),
                                 nprocs=world_size, join=False,
                                 start_method=_start_method())
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    _stop(ctx.processes)
                    raise TimeoutError(
                        f"spawn_ranks: ranks {running} of {world_size} still running after "
                        f"{timeout:g} s, stopped (a rank waiting in a collective that another "
                        "rank never issued, or a slow run: raise timeout=).")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            _stop(ctx.processes)
            done = _results_if_complete(tmp, world_size)
            if done is None or not isinstance(e, mp.ProcessExitedException):
                _raise_rank_error(tmp, world_size, e)
            # every rank returned and none raised: a rank killed while leaving (a process
            # group's thread aborting at shutdown) lost nothing
            import warnings
            warnings.warn(f"spawn_ranks: every rank returned its result, then {e}; the results "
                          "are kept.", RuntimeWarning, stacklevel=2)
            return done
        except BaseException:
            _stop(ctx.processes)
            raise
        from pathlib import Path
        return [pickle.loads(Path(f"{tmp}/result.{r}").read_bytes())
                for r in range(world_size)]


def _results_if_complete(tmp: str, world: int) -> list[Any] | None:
    """Every rank's result when all wrote one and none wrote an error, else None."""
    import pickle
    from pathlib import Path
    if any(Path(f"{tmp}/error.{r}").exists() for r in range(world)):
        return None
    files = [Path(f"{tmp}/result.{r}") for r in range(world)]
    if not all(f.exists() for f in files):
        return None
    try:
        return [pickle.loads(f.read_bytes()) for f in files]
    except Exception:  # noqa: BLE001 - a result file cut short: not complete
        return None


def _stop(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def _mesh_groups(mesh: tuple[int, ...], rank: int) -> list[Any]:
    """This rank's group of each mesh dim (ranks laid out row-major over ``mesh``); every rank
    creates every group, in the same order."""
    import torch.distributed as dist
    if len(mesh) == 1:
        return [None]
    a, b = mesh
    mine = [None, None]
    for j in range(b):                      # mesh dim 0: the ranks of one column
        g = dist.new_group([i * b + j for i in range(a)])
        if rank % b == j:
            mine[0] = g
    for i in range(a):                      # mesh dim 1: the ranks of one row
        g = dist.new_group([i * b + j for j in range(b)])
        if rank // b == i:
            mine[1] = g
    return mine


def _leaf_mismatch(actual: torch.Tensor, expected: torch.Tensor, rtol: float,
                   atol: float) -> tuple[float, str] | None:
    """None when ``actual`` is close to ``expected``; else its max relative error and a
    description."""
    if actual.shape != expected.shape:
        return float("inf"), f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return float("inf"), f"dtype {actual.dtype} != {expected.dtype}"
    if not actual.is_floating_point():
        return None if torch.equal(actual, expected) else (float("inf"), "values differ")
    if not torch.equal(torch.isfinite(actual), torch.isfinite(expected)):
        return float("inf"), "non-finite values differ"
    a, e = torch.nan_to_num(actual.double()), torch.nan_to_num(expected.double())
    err = (a - e).abs().max().item() if a.numel() else 0.0
    scale = e.abs().max().item() if a.numel() else 0.0
    if err <= atol + rtol * scale:
        return None
    rel = max_relative_error(a, e)
    return rel, f"max relative error {rel:.3e} (max abs error {err:.3e}; rtol {rtol:g}, " \
                f"atol {atol:g})"


def _shard_case(make_tx: Callable[[], GradientTransformation], params: PyTree,
                grads: Sequence[PyTree], specs: PyTree, on_owners: bool, rtol: float,
                atol: float, check_state: bool) -> dict[str, Any]:
    """On one rank: the single-device run and the sharded run step by step; every mismatch of
    this rank's parameters (and comparable state leaves) with its slice of the single-device
    ones."""
    from .distributed import local_shard, sharded
    leaves, treespec = tree_flatten(params)
    flat_specs = treespec.flatten_up_to(specs)
    paths = tree_paths(params)

    def shard(tree: PyTree) -> PyTree:
        return treespec.unflatten([local_shard(x, s) for x, s in
                                   zip(treespec.flatten_up_to(tree), flat_specs)])

    tx_full, tx = make_tx(), sharded(make_tx(), specs, on_owners=on_owners)
    p_full, p_loc = params, shard(params)
    s_full, s_loc = tx_full.init(p_full), tx.init(p_loc)
    failures: list[dict[str, Any]] = []
    checked, skipped = 0, set()
    for step, g in enumerate(grads, 1):
        u, s_full = tx_full.update(g, s_full, p_full)
        p_full = apply_updates(p_full, u)
        u, s_loc = tx.update(shard(g), s_loc, p_loc)
        p_loc = apply_updates(p_loc, u)
        pairs = [("params", path, x, local_shard(e, s)) for path, x, e, s in
                 zip(paths, tree_leaves(p_loc), tree_leaves(p_full), flat_specs)]
        if check_state:
            full_state = {keystr(k): v for k, v in tree_flatten_with_path(s_full)[0]}
            for k, y in tree_flatten_with_path(s_loc)[0]:
                path = keystr(k) or "<root>"
                x = full_state.get(keystr(k))
                if not isinstance(y, torch.Tensor) or not isinstance(x, torch.Tensor):
                    continue
                if x.shape == y.shape:
                    pairs.append(("state", path, y, x))
                    continue
                # a leaf like its parameter: compare with the parameter's slice
                owner = max((i for i, p in enumerate(paths) if p in path
                             and tuple(leaves[i].shape) == tuple(x.shape)),
                            key=lambda i: len(paths[i]), default=None)
                if owner is None:
                    skipped.add(path)
                    continue
                pairs.append(("state", path, y, local_shard(x, flat_specs[owner])))
        for what, path, actual, expected in pairs:
            checked += 1
            bad = _leaf_mismatch(actual, expected, rtol, atol)
            if bad is not None:
                failures.append({"step": step, "what": what, "path": path, "rel": bad[0],
                                 "detail": bad[1]})
    return {"failures": failures, "checked": checked, "skipped": sorted(skipped)}


def _shard_worker(rank: int, world: int, make_tx: Callable[[], GradientTransformation],
                  params: PyTree, grads: list[PyTree], cases: list[PyTree],
                  mesh: tuple[int, ...], on_owners: bool, rtol: float, atol: float,
                  check_state: bool) -> list[dict[str, Any]]:
    groups = _mesh_groups(mesh, rank)
    return [_shard_case(make_tx, params, grads, bind_mesh(specs, groups), on_owners, rtol,
                        atol, check_state) for specs in cases]


_DEFAULT_SHAPES = {"w": (9, 6), "u": (6, 5), "t": (3, 5, 4), "b": (5,)}


def assert_shard_invariant(make_tx: Callable[[], GradientTransformation],
                           params: PyTree | None = None, specs: PyTree | None = None, *,
                           world_size: int = 2, mesh: Sequence[int] | None = None,
                           steps: int = 5, on_owners: bool = False, rtol: float = 1e-5,
                           atol: float = 1e-6, seed: int = 0, n_specs: int = 4,
                           check_state: bool = True, timeout: float = 180.0) -> dict[str, Any]:
    """Assert that ``make_tx()`` run sharded over several processes gives the single-device
    result, on every rank, at every step.

    Spawns ``world_size`` processes in a gloo process group (CPU; `spawn_ranks`). For every
    spec tree, each rank runs ``sharded(make_tx(), specs, on_owners=on_owners)`` on its pieces
    (`opttx.distributed.local_shard`) of the same seeded parameters and gradients, and
    ``make_tx()`` on the whole tensors, and after each step compares its parameters with its
    slice of the single-device ones; with ``check_state``, also every state tensor that can be
    matched to the single-device state by its path: tensors of the same shape (statistics that
    every rank holds whole, and the whole leaves an owner holds under ``on_owners``) and
    tensors shaped like their parameter (compared on the parameter's slice). Others (factored
    row and column statistics of a sharded leaf) are left out.

    ``make_tx`` crosses to the spawned processes by pickle: it must be a function defined at
    the top level of an importable module, or a ``functools.partial`` of one (of an alias:
    ``partial(opttx.adamw, 1e-3, weight_decay=0.1)``); not a lambda, nor a function defined in
    a notebook or in ``__main__``. Adafactor's and CAME's factoring rules read the global
    shapes under ``sharded``; a custom transform that decides from a leaf's shape must do the
    same (`opttx.base.current_reducer` gives ``global_shapes_of``).

    Args:
      make_tx: builds the transform (called once per run, single-device and sharded).
      params: the global parameters: a tree of tensors, or of shapes (tuples of ints) for
        Gaussian ones seeded by ``seed``. Default: four leaves of odd sizes, of 1 to 3 dims.
      specs: a spec tree like the params (leaves `opttx.distributed.Replicated`,
        ``Shard(dim)``: the default group; ``Shard(dim, MeshDim(i))`` on a 2-D mesh), or a list
        of them (all run in one spawn), or None for ``n_specs`` trees drawn from
        `sharding_specs` (deterministically, from ``seed``).
      world_size: the number of processes (1-D mesh).
      mesh: two group sizes for a 2-D mesh (ranks row-major; ``world_size`` is their product).
      steps: updates per spec tree, on Gaussian gradients (`gradient_stream`).
      on_owners: run the transform on whole leaves at owner ranks
        (`opttx.distributed.on_owners`), as matrix transforms need.
      rtol, atol: a leaf passes when ``max|a − e| <= atol + rtol · max|e|``.
      seed: seeds the parameters (given shapes), the gradients and the drawn specs.
      n_specs: the number of spec trees drawn when ``specs`` is None.
      check_state: compare the optimizer state too.
      timeout: seconds for the whole run (a hang is stopped and reported).

    Returns:
      What was checked: ``{"cases": spec trees run, "compared": leaf comparisons made (all
      ranks, steps and spec trees), "state_left_out": paths of the state tensors that could
      not be matched to a slice of the single-device state}``.

    Raises:
      AssertionError: a difference, naming the spec tree, the step, the rank, the leaf and its
        max relative error (the first one found; the number of others).
      TimeoutError: the ranks did not finish within ``timeout``.
      Exception: an exception raised on a rank, raised again with that rank's traceback.

    Example:
      >>> from functools import partial
      >>> assert_shard_invariant(partial(opttx.lamb, 1e-2, weight_decay=0.01))
      >>> specs = {"w": Shard(1), "b": Replicated()}
      >>> assert_shard_invariant(partial(opttx.shampoo, 1e-3), {"w": (8, 5), "b": (5,)},
      ...                        specs, on_owners=True)
    """
    import random

    from .distributed.specs import Replicated
    mesh = (world_size,) if mesh is None else tuple(mesh)
    _check_mesh(mesh, None)
    world = 1
    for m in mesh:
        world *= m
    if params is None:
        params = _DEFAULT_SHAPES
    leaves, treespec = tree_flatten(
        params, is_leaf=lambda x: _is_shape(x) or isinstance(x, torch.Tensor))
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        shapes, treespec = _shape_tree(params)
        gen = torch.Generator().manual_seed(seed)
        params = treespec.unflatten([torch.randn(s, generator=gen) for s in shapes])
    else:
        shapes = [tuple(x.shape) for x in leaves]
        params = treespec.unflatten([x.detach().clone() for x in leaves])
    if specs is None:
        rng = random.Random(seed)
        groups = _check_mesh(mesh, None)
        cases = [treespec.unflatten([_draw_leaf_spec(s, mesh, groups, True, True, rng.choice)
                                     for s in shapes]) for _ in range(n_specs)]
    else:
        try:
            treespec.flatten_up_to(specs)
            cases = [specs]
        except (ValueError, TypeError):
            if not isinstance(specs, (list, tuple)):
                raise ValueError("assert_shard_invariant: specs must be a spec tree shaped like "
                                 "the params, or a list of them.") from None
            cases = list(specs)
            for c in cases:
                treespec.flatten_up_to(c)
    cases = [tree_map(lambda s: Replicated() if s is None else s, c, is_leaf=_is_spec)
             for c in cases]
    grads = gradient_stream(params, steps, seed + 1)
    results = spawn_ranks(_shard_worker, world,
                          (make_tx, params, grads, cases, mesh, on_owners, rtol, atol,
                           check_state), timeout=timeout)
    found = []
    for rank, per_case in enumerate(results):
        for c, res in enumerate(per_case):
            found += [(f["step"], c, rank, f) for f in res["failures"]]
    if not found:
        return {"cases": len(cases),
                "compared": sum(res["checked"] for per_case in results for res in per_case),
                "state_left_out": sorted({p for per_case in results for res in per_case
                                          for p in res["skipped"]})}
    found.sort(key=lambda t: (t[1], t[0], t[2]))
    step, c, rank, f = found[0]
    specs_text = ", ".join(f"{p}: {_spec_str(s)}" for p, s in
                           zip(tree_paths(params), treespec.flatten_up_to(cases[c])))
    raise AssertionError(
        f"sharded != single device: {f['what']}{f['path']} on rank {rank} of {world} after "
        f"step {step}: {f['detail']}.\n  specs (case {c + 1} of {len(cases)}): {{{specs_text}}}"
        f"{' on owners' if on_owners else ''}; mesh {mesh}; seed {seed}."
        + (f"\n  {len(found) - 1} more mismatches (other leaves, steps or ranks)."
           if len(found) > 1 else ""))

