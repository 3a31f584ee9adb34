"""Grouped kernels: every ``torch._foreach_*`` call of opttx, and the rules around them.

The element-wise hot paths of opttx work on *lists of leaves* with torch's grouped
(``_foreach``) kernels, one call for a whole group of tensors (docs/design.md, rule 4). This
module is the only place that calls them. Three things are decided here once, for every
transform:

* **Coefficients.** A scalar argument may be a Python number or a 0-dim tensor (an injected
  hyperparameter, a bias correction computed from the step count). `coefficient` prepares a
  0-dim tensor for the kernel that consumes it, so that a compiled step neither recompiles as
  it changes nor syncs the device to read it (see its docstring). `foreach` and `foreach_`
  apply it to every scalar argument: callers never prepare coefficients themselves.
* **Donation.** Inside `donating` the caller gives up the old state it passes to ``update``,
  and the helpers that update optimizer state write into the old buffers instead of
  allocating new ones (docs/design.md, rule 5). It is a context variable, so two optimizers
  stepping in two threads do not see each other's setting.
* **Scratch buffers.** Fresh update tensors created by a link of a chain inside `donating` are
  registered as scratch (`mark_scratch`); a later link may overwrite them in place
  (`is_scratch`). Buffers that alias state or ``p.grad`` are never registered. The registry
  lives in the same context variable as the donation flag.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Iterator, NamedTuple, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ._tracing import is_tracing

Scalar = float | int | torch.Tensor
Tensors = Sequence[torch.Tensor]

__all__ = [
    "Scalar",
    "Tensors",
    "cast_like",
    "coefficient",
    "donating",
    "foreach",
    "foreach_",
    "foreach_accumulate_sq",
    "foreach_axpy",
    "foreach_copy_",
    "foreach_ema",
    "foreach_ema_sq",
    "foreach_norm",
    "foreach_op_",
    "foreach_scale",
    "foreach_scale_add",
    "foreach_sum_of_squares",
    "is_donating",
    "is_fixed_zero",
    "is_live",
    "is_scratch",
    "keeping_state",
    "LiveFloat",
    "mark_scratch",
    "new_buffers",
]


# ---------------------------------------------------------------------------------------------
# donation and scratch buffers (a context variable: per thread, per task)
# ---------------------------------------------------------------------------------------------


class _Donation(NamedTuple):
    enabled: bool
    # id -> tensor, weakly: fresh temporaries that a later link may overwrite in place
    scratch: "weakref.WeakValueDictionary[int, torch.Tensor]"


_DONATION: contextvars.ContextVar[_Donation | None] = contextvars.ContextVar("opttx_donation",
                                                                            default=None)


def is_donating() -> bool:
    """Whether the caller has donated the old state buffers (see `donating`).

    Always False while ``torch.compile`` traces: a compiled step is functional and its final
    ``copy_`` into the inputs (`opttx.tree_copy_`) is what lowers to in-place writes.
    """
    if is_tracing():   # first: Dynamo cannot trace ContextVar.get
        return False
    current = _DONATION.get()
    return current is not None and current.enabled


@contextlib.contextmanager
def donating(enabled: bool = True) -> Iterator[None]:
    """Let transforms write their new state into the old state buffers.

    Inside this context the caller promises not to use the state it passes to ``update``
    again (it is replaced by the returned state, which then aliases the same storage). The
    numbers are unchanged; only allocations are saved. ``donating(False)`` switches it off for
    a block, as wrappers do that must keep the old state (`opttx.apply_if_finite`,
    `opttx.MultiSteps`). The setting is a context variable: other threads are unaffected.
    """
    outer = _DONATION.get()
    scratch = outer.scratch if outer is not None else weakref.WeakValueDictionary()
    token = _DONATION.set(_Donation(enabled, scratch))
    try:
        yield
    finally:
        _DONATION.reset(token)


def keeping_state() -> contextlib.AbstractContextManager:
    """``donating(False)`` in eager mode, nothing under ``torch.compile`` (where donation is
    off anyway and Dynamo cannot enter the context variable): for code that reads an old
    state buffer after a helper that would otherwise overwrite it in place (a step that keeps
    the old moment on some condition, a wrapper that may drop the new state)."""
    if is_tracing():
        return contextlib.nullcontext()
    return donating(False)


def mark_scratch(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Record fresh temporaries (inside `donating`) so later links may reuse them; returns
    ``tensors``."""
    if is_donating():
        registry = _DONATION.get().scratch
        for t in tensors:
            registry[id(t)] = t
    return tensors


def is_scratch(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is a temporary registered with `mark_scratch` (so it may be
    overwritten in place)."""
    if not tensors or not is_donating():
        return False
    registry = _DONATION.get().scratch
    return all(registry.get(id(t)) is t for t in tensors)


# ---------------------------------------------------------------------------------------------
# coefficients
# ---------------------------------------------------------------------------------------------

class LiveFloat(float):
    """An injected hyperparameter as an eager step gives it to its factory
    (`opttx.inject_hyperparams`, `opttx.Optimizer`): the Python float the state holds (so the
    factory takes the functional path's decisions and kernels, with the number given),
    marked *live*: its value may differ at the next step, as a 0-dim tensor's may under
    tracing. A factory that leaves out an optional term when a number is 0 (a momentum, a
    weight decay) keeps it for a live value (it decides with `is_fixed_zero`), so the state's
    structure does not depend on the value and a scheduler may move it away from 0."""
    __slots__ = ()

    def __repr__(self) -> str:      # in error messages: the number, as the user gave it
        return float.__repr__(self)


def is_live(value: Any) -> bool:
    """Whether ``value`` is a hyperparameter that may change between steps: a 0-dim tensor
    (injected, under tracing or off the CPU) or a `LiveFloat` (injected, in an eager step).
    A plain number is fixed for the transform's life."""
    return isinstance(value, (torch.Tensor, LiveFloat))


def is_fixed_zero(value: Any) -> bool:
    """Whether an optional term (a weight decay, a dampening) can be left out of a transform
    for good: ``value`` is a plain number equal to 0. An injected value (`is_live`) is never,
    whatever it holds now, so the state's structure is the same in an eager step (a
    `LiveFloat`), in a traced one (a 0-dim tensor) and after a scheduler moves it off 0."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not is_live(value) and value == 0)


# Devices whose 0-dim tensors a compiled step may read back to the host as a scalar kernel
# argument (free on the CPU). On any other device that read is a device-to-host sync in every
# step, and Inductor will not put such a graph in a CUDA graph.
HOST_READABLE_DEVICES: tuple[str, ...] = ("cpu",)

# grouped ops with a List overload, where a 0-dim tensor repeated per tensor broadcasts
_LIST_OVERLOADS = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "clamp_min",
                             "clamp_max", "pow", "lerp"})


def coefficient(value: Any, tensors: Sequence[torch.Tensor], op: str | None = None) -> Any:
    """``value`` prepared as the scalar argument of ``torch._foreach_<op>(tensors, ...)``.

    Python numbers, lists and eager steps pass through unchanged. A 0-dim tensor in a
    compiled step is prepared for the kernel:

    * on the CPU, it is passed through a grouped add: Inductor then reads it once as a scalar
      kernel argument, instead of inlining the arithmetic that produced it (a bias
      correction's ``pow``, a schedule's ``cos``) into every element loop (measured: compiled
      AdamW 4.97x -> 1.02x torch's fused kernel). That scalar is a C ``float``, so float64
      tensors keep the inlined (exact) form. ``value * 1`` makes it an intermediate, or
      Dynamo would specialize on an input's value (a recompile whenever an injected weight
      decay changes).
    * on other devices, for ops with a List overload (``op``), it is repeated once per
      tensor: given a 0-dim tensor where a grouped kernel takes a Scalar, torch would pick the
      Scalar overload and read it back to the host (a sync per step that also keeps the graph
      out of CUDA graphs); the List overload broadcasts it on the device.
    """
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and tensors
            and is_tracing()):
        return value
    if op in _LIST_OVERLOADS and value.device.type not in HOST_READABLE_DEVICES:
        return [value] * len(tensors)
    if value.device.type == "cpu" and all(t.dtype != torch.float64 for t in tensors):
        # The Tensor-scalar overload, not the list form ``[value * 1]``: with the list form
        # Inductor inlines the scalar's arithmetic again (compiled AdamW measured 2.68x torch
        # fused, against 1.03x with this form, benchmarks/step_time.py on the 2-core VM)
        # (aten's Tensor overload named explicitly: Dynamo without fullgraph=True resolves
        # the Python binding to the Scalar overload, whose .item() breaks the graph)
        return _computed_once(value)
    return value


# Defined with `torch.library.Library`, not `torch.library.custom_op`: the op is called by
# every compiled step that has a bias correction (offload's grouped host step: twice per
# chunk), and custom_op's Python wrapper costs 10 us a call where this one costs 2.9 us
# (aten's clone on a 0-dim tensor: 2.4 us), timed warm on the 2-core Xeon VM.
_LIBRARY = torch.library.Library("opttx", "FRAGMENT")
_LIBRARY.define("computed_once(Tensor value) -> Tensor")


def _computed_once_impl(value: torch.Tensor) -> torch.Tensor:
    return value.clone()


_LIBRARY.impl("computed_once", _computed_once_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("opttx::computed_once", lib=_LIBRARY)
def _(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


def _computed_once_batched(info: Any, in_dims: tuple, value: torch.Tensor) -> tuple:
    return _computed_once(value), in_dims[0]     # under vmap (opttx.stacked): elementwise


torch.library.register_vmap("opttx::computed_once", _computed_once_batched, lib=_LIBRARY)


def _computed_once(value: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` that Inductor cannot fuse into its consumers (an opaque op): the
    scalar's arithmetic (a bias correction's ``pow``) runs once, into a 0-dim buffer that the
    element loops read, instead of once per element. Traced as one node, with or without
    ``fullgraph`` (an ``.item()`` would break the graph without it)."""
    return torch.ops.opttx.computed_once.default(value)


def coefficients_first(graph: torch.fx.Graph) -> int:
    """Move every `_computed_once` node of a post-grad graph, with the nodes it depends on,
    ahead of the graph's other work (Inductor's ``post_grad_custom_pre_pass``; see
    `CoefficientsFirst`). Returns how many nodes moved: 0 when the graph has none to move,
    when any of them is not a pure, unseeded op (a mutation, a random draw), or when one of
    them reads a tensor that another node writes in place before it (moved ahead of the
    write, it would read the old value); the graph is then left as it was.

    Why: a compiled step over several groups of state (offload's host groups) is traced
    group after group, so the scalar work of group k+1 (its step count, its bias
    corrections, ending in the opaque `_computed_once`) comes after group k's element loop.
    That Python call then runs with the caches full of the loop's data: 195 us instead of
    15 us (benchmarks/offload_host_loop.py, part 5). Moved first, all of them run before any
    loop. The values are unchanged: the moved nodes read only inputs and each other."""
    needed = _coefficient_work(graph)
    if not needed:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = next((n for n in graph.nodes
                  if n.op not in ("placeholder", "get_attr") and n not in needed), None)
    if first is None:
        return 0
    moved = sorted((n for n in needed if n.op != "placeholder" and order[n] > order[first]),
                   key=order.__getitem__)
    # a node it would move ahead of a write into something it reads (an input written in
    # place mid-graph) would read the old value: leave such a graph alone
    moving = set(moved)
    for n in graph.nodes:
        if n not in needed and _writes_before_a_reader(n, needed, moving, order):
            return 0
    for n in moved:
        first.prepend(n)
    return len(moved)


def _coefficient_work(graph: torch.fx.Graph) -> set[torch.fx.Node] | None:
    """Every `_computed_once` node of ``graph`` with the nodes it depends on; None when one
    of them is not a pure, unseeded op (a mutation, a random draw) or there is none."""
    target = torch.ops.opttx.computed_once.default
    needed: set[torch.fx.Node] = set()
    stack = [n for n in graph.nodes if n.target is target]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    for n in needed:
        if n.op in ("placeholder", "get_attr") or \
                getattr(n.target, "__module__", None) == "_operator":
            continue          # (inputs, constants, getitem, arithmetic on symbolic sizes)
        op = n.target
        if (n.op != "call_function" or not isinstance(op, torch._ops.OpOverload)
                or op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags):
            return None
    return needed or None


def merge_coefficients(graph: torch.fx.Graph) -> int:
    """Merge the repeated scalar work of a post-grad graph: of the `_computed_once` nodes
    and the nodes they depend on (all pure and unseeded, as `coefficients_first` requires,
    else nothing is merged), each node that applies the same op to the same arguments as
    an earlier one is replaced by it. Returns how many nodes were removed.

    Why: offload's grouped host step (``host_group_mb``) gives every chunk of a group the
    same step count; each chunk's transform then computes the same bias corrections, two
    opaque calls per chunk that run one after another before the loops. Merged, a group of
    12 chunks makes 2 calls instead of 24. A node whose output some op writes in place is
    never merged (two writers would share one buffer)."""
    needed = _coefficient_work(graph)
    if not needed:
        return 0
    seen: dict[Any, torch.fx.Node] = {}
    removed = 0
    for n in list(graph.nodes):
        if n not in needed or n.op != "call_function" or _written_in_place(n):
            continue
        try:
            key = (n.target, _hashable(n.args), _hashable(n.kwargs))
            hash(key)
        except TypeError:
            continue
        earlier = seen.get(key)
        if earlier is None:
            seen[key] = n
            continue
        n.replace_all_uses_with(earlier)
        graph.erase_node(n)
        removed += 1
    return removed


def _hashable(x: Any) -> Any:
    """``x`` (a node's arguments) with its lists and dicts as tuples, to key a node by."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_hashable(v) for v in x))
    if isinstance(x, dict):
        return ("dict", *((k, _hashable(v)) for k, v in x.items()))
    return x


def _written_in_place(node: torch.fx.Node) -> bool:
    """Whether some user of ``node`` writes into it in place (or is a call whose schema
    cannot say it does not)."""
    for user in node.users:
        op = user.target
        if user.op != "call_function" or getattr(op, "__module__", None) == "_operator":
            continue
        if not isinstance(op, torch._ops.OpOverload):
            return True
        for target in _written_arguments(user):
            if target is node or (isinstance(target, (list, tuple)) and node in target):
                return True
    return False


def _written_arguments(node: torch.fx.Node) -> list[Any]:
    """The arguments that ``node`` (a call of an op overload) writes in place, by its
    schema's alias annotations."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) \
            or not op._schema.is_mutable:
        return []
    return [node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for i, arg in enumerate(op._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write]


def _writes_before_a_reader(node: torch.fx.Node, needed: set, moving: set,
                            order: dict) -> bool:
    """Whether ``node`` writes in place into a node of ``needed`` that a node of ``moving``
    placed after it reads."""
    return any(isinstance(target, torch.fx.Node) and target in needed and any(
        user in moving and order[user] > order[node] for user in target.users)
        for target in _written_arguments(node))


class CoefficientsFirst(CustomGraphPass):
    """`merge_coefficients`, then `coefficients_first`, as an Inductor custom pass, for
    ``torch.compile(..., options={"post_grad_custom_pre_pass": CoefficientsFirst()})``:
    the repeated scalar work computed once, and all of it ahead of the element loops. Its
    ``uuid`` is this file's hash, so Inductor's graph cache keys on it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        merge_coefficients(graph)
        coefficients_first(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


# ---------------------------------------------------------------------------------------------
# grouped kernels
# ---------------------------------------------------------------------------------------------


def _prepared(op: str, tensors: Sequence[torch.Tensor], args: tuple) -> tuple:
    return tuple(coefficient(a, tensors, op) if isinstance(a, torch.Tensor) else a
                 for a in args)


# grouped ops whose Tensor overload takes a 0-dim tensor as the scalar
_TENSOR_OVERLOADS = frozenset({"add", "mul", "div"})


def _grouped(name: str, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """``torch._foreach_<name>(tensors, *args, **kwargs)``. Compiled, a 0-dim tensor scalar
    goes to an overload that takes a tensor (the Tensor overload, or the List overload with
    it repeated): the Python binding picks the Scalar overload, whose ``.item()`` is a
    data-dependent output that breaks the graph unless ``fullgraph=True`` (where Dynamo
    captures scalar outputs), so ``torch.compile(opt.step)`` would be many graphs. An empty
    list gives an empty list (a rank without leaves still steps its shared scalars)."""
    if not tensors:
        return []
    if is_tracing() and any(
            isinstance(a, torch.Tensor) and a.dim() == 0 for a in args):
        base = name.rstrip("_")
        if base in _TENSOR_OVERLOADS and len(args) == 1:
            return getattr(getattr(torch.ops.aten, f"_foreach_{name}"), "Tensor")(
                tensors, *args, **kwargs)
        if base in _LIST_OVERLOADS:
            args = tuple([a] * len(tensors) if isinstance(a, torch.Tensor) and a.dim() == 0
                         else a for a in args)
    elif name == "mul_" and args and tensors[0].device.type == "cpu" \
            and tensors[0].is_floating_point():
        # torch 2.13's CPU _foreach_mul_(xs, s) rounds a Python number s to a 16-bit
        # tensor's dtype before multiplying (0.0039 apart for bfloat16 values of magnitude 1
        # times 0.3337), where _foreach_mul, x.mul_ and the Tensor overloads multiply by s in
        # float32: the in-place (donating) path must equal the functional one bit for bit.
        # Passed as a 0-dim tensor of the op's compute dtype (float64 for a float64 list,
        # else float32: a 0-dim leaf times a 0-dim float64 tensor would compute in float64),
        # the Tensor overload equals the out-of-place op for every floating dtype, so every
        # CPU list takes it (no scan of the list's dtypes on this hot path; a list is on one
        # device).
        wide = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
        args = (_scalar_tensors(args[0], wide),) + tuple(args[1:])
    return getattr(torch, f"_foreach_{name}")(tensors, *args, **kwargs)


def _scalar_tensors(arg: Any, dtype: torch.dtype) -> Any:
    """A Python number (or list of them) as 0-dim ``dtype`` tensors, for the Tensor (List)
    overload of a grouped op; anything else as it is."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return torch.tensor(arg, dtype=dtype)
    if isinstance(arg, (list, tuple)) and arg and all(
            isinstance(a, (int, float)) and not isinstance(a, bool) for a in arg):
        return [torch.tensor(a, dtype=dtype) for a in arg]
    return arg


def foreach(op: str, tensors: Tensors, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """``torch._foreach_<op>(tensors, *args, **kwargs)`` as new tensors, 0-dim tensor
    arguments prepared with `coefficient`."""
    tensors = list(tensors)
    return list(_grouped(op, tensors, _prepared(op, tensors, args), kwargs))


def foreach_(op: str, tensors: Tensors, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    """``torch._foreach_<op>_(tensors, *args, **kwargs)``: in place on ``tensors`` (which the
    caller owns), 0-dim tensor arguments prepared with `coefficient`; returns the list."""
    tensors = list(tensors)
    _grouped(f"{op}_", tensors, _prepared(op, tensors, args), kwargs)
    return tensors


def foreach_op_(op: str, tensors: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
    """``torch._foreach_<op>(tensors, *args)`` on *temporaries* the caller owns.

    In eager mode it runs in place (no new allocation); under ``torch.compile`` out of place
    (Inductor fuses it anyway, and in-place foreach ops are refused inside ``torch.cond``
    branches). Returns the result list.
    """
    if is_tracing():
        return foreach(op, tensors, *args)
    if tensors:
        _grouped(f"{op}_", tensors, args, {})
    return tensors


def foreach_copy_(dst: Tensors, src: Tensors) -> None:
    """``d.copy_(s)`` for every pair: one grouped kernel in eager mode, one ``copy_`` per pair
    under ``torch.compile``.

    Compiled, Inductor folds a per-tensor ``copy_`` into the graph input into the kernel that
    computes the value, while on CUDA it does not fold ``_foreach_copy_``: it then writes
    part of the update (Adam's denominator) into a temporary and recomputes the new state in a
    second pass. Measured on an H100 (torch 2.11, 307 M parameters in 39 tensors, compiled
    opttx AdamW step ending in this copy of its state; `benchmarks/state_copy.py`): 6.13 ms
    with ``_foreach_copy_``, 3.51 ms with per-tensor ``copy_``, torch's fused AdamW 3.60 ms."""
    if is_tracing():
        for d, s in zip(dst, src):
            d.copy_(s)
        return
    dst = list(dst)
    if dst:
        torch._foreach_copy_(dst, list(src))


def foreach_norm(tensors: Tensors, ord: float = 2, dtype: torch.dtype | None = None
                 ) -> list[torch.Tensor]:
    """The ``ord``-norm of every tensor, as 0-dim tensors (``dtype``: of the result)."""
    if dtype is None:
        return list(torch._foreach_norm(list(tensors), ord))
    return list(torch._foreach_norm(list(tensors), ord, dtype=dtype))


def foreach_sum_of_squares(tensors: Tensors, dtype: torch.dtype | None = None
                           ) -> list[torch.Tensor]:
    r""":math:`\sum x^2` of every tensor, as 0-dim tensors in ``dtype`` (default: float64 if
    any tensor is float64, else float32).

    Eager: one grouped ``_foreach_norm`` pass, squared. Compiled: one ``sum(x * x)`` reduction
    per tensor, which Inductor fuses with the producer of ``x`` (it lowers ``_foreach_norm``
    to separate, slower reductions: about 1.8x slower for clip-by-RMS + apply on CPU).
    """
    if not tensors:
        return []
    if dtype is None:
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in tensors) \
            else torch.float32
    if is_tracing():
        return [torch.sum(torch.square(x.to(dtype))) for x in tensors]
    norms = foreach_norm(tensors, 2, dtype=dtype)
    return list(torch._foreach_mul(norms, norms))


def _maybe_inplace(op: str, tensors: Tensors, *args: Any) -> list[torch.Tensor]:
    """``op`` in place on ``tensors`` when donating, else out of place; either way in the
    dtypes of ``tensors`` (a 0-dim leaf times a 0-dim float64 coefficient would otherwise be
    promoted to float64 out of place, while the in-place op rounds back to the leaf's dtype)."""
    if is_donating():
        return foreach_(op, tensors, *args)
    return cast_like(foreach(op, tensors, *args), tensors)


def cast_like(tensors: Tensors, like: Tensors) -> list[torch.Tensor]:
    """``tensors`` each cast to the dtype of the matching tensor of ``like``."""
    return [t if t.dtype == l.dtype else t.to(l.dtype) for t, l in zip(tensors, like)]


def foreach_ema(old: Tensors, new: Tensors, decay: Scalar) -> list[torch.Tensor]:
    """``decay * old + (1 - decay) * new`` for every pair; in place on ``old`` when donating.

    Written as a ``lerp`` (one pass) when ``old`` and ``new`` share a dtype.
    """
    if not old:
        return []
    return _maybe_inplace("lerp", old, cast_like(new, old), 1 - decay)


def foreach_ema_sq(old: Tensors, new: Tensors, decay: Scalar) -> list[torch.Tensor]:
    """``decay * old + (1 - decay) * new²`` for every pair; in place on ``old`` when donating."""
    if not old:
        return []
    new = cast_like(new, old)
    out = _maybe_inplace("mul", old, decay)
    if isinstance(decay, torch.Tensor):
        return cast_like(foreach_op_("add", out, foreach("mul", foreach("mul", new, new),
                                                         1 - decay)), old)
    return foreach_op_("addcmul", out, new, new, 1 - decay)


def foreach_accumulate_sq(old: Tensors, new: Tensors) -> list[torch.Tensor]:
    """``old + new²`` for every pair; in place on ``old`` when donating."""
    if not old:
        return []
    new = cast_like(new, old)
    return _maybe_inplace("addcmul", old, new, new)


def foreach_axpy(a: Scalar, x: Tensors, y: Tensors) -> list[torch.Tensor]:
    """``a * x + y`` for every pair. ``x`` is left untouched; ``y`` is overwritten in place
    only when it is a scratch buffer of the running chain (`is_scratch`), else a new list is
    made."""
    if not x:
        return []
    y = list(y)
    inplace = is_scratch(y)
    if isinstance(a, torch.Tensor):
        ax = foreach("mul", x, a)
        return foreach_("add", y, ax) if inplace else mark_scratch(foreach("add", y, ax))
    if inplace:
        return foreach_("add", y, x, alpha=a)
    return mark_scratch(foreach("add", y, x, alpha=a))


def foreach_scale(x: Tensors, factor: Scalar) -> list[torch.Tensor]:
    """``factor * x`` for every leaf; in place when ``x`` is a scratch buffer of the running
    chain (`is_scratch`), else as new tensors."""
    if not x:
        return []
    x = list(x)
    if is_scratch(x):
        return foreach_("mul", x, factor)
    return mark_scratch(foreach("mul", x, factor))


def foreach_scale_add(old: Tensors, decay: Scalar, new: Tensors) -> list[torch.Tensor]:
    """``decay * old + new`` for every pair; in place on ``old`` when donating."""
    if not old:
        return []
    new = cast_like(new, old)
    out = _maybe_inplace("mul", old, decay)
    return foreach_op_("add", out, new)


def new_buffers(tensors: Tensors, fresh: Tensors) -> list[torch.Tensor]:
    """Return ``fresh``, written into the buffers ``tensors`` when donating (state replaced by
    values computed out of place, for example a running maximum or a where-select)."""
    if is_donating() and tensors:
        foreach_copy_(tensors, fresh)
        return list(tensors)
    return list(fresh)
