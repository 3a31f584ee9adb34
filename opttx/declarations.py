"""What a transform factory declares (`declare`): its hyperparameters and their roles
(`HyperRole`), its configuration, and from them the `Recipe` of every transform it makes, the
identity its states carry (``made_by``) and the checks that refuse a state of another
transform or configuration (`check_made_by`, `check_state_type`); `describe_transform` and
`configuration_items`, what the ranks of a distributed run compare (docs/design.md,
section 3).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from ._tracing import is_tracing
from .core import GradientTransformation, Params, State, Updates, replace_state
from .tree import Static

__all__ = [
    "Declaration",
    "HyperRole",
    "Recipe",
    "check_made_by",
    "check_state_type",
    "configuration_items",
    "declaration_of",
    "declare",
    "describe_transform",
    "describe_value",
    "format_identity",
    "identity_differences",
    "public_name",
    "recipe_of",
    "step_local_transforms",
]


class HyperRole(str, enum.Enum):
    """What a hyperparameter of a transform is, for the machinery that exposes it: the role
    decides its key in an `opttx.Optimizer` param group (torch.optim's names), so LR
    schedulers, ``OneCycleLR``'s momentum cycling and hand-written warm-ups find it.

    A factory declares its hyperparameters with `declare`; one without a role is shown under
    its own name."""

    LEARNING_RATE = "learning_rate"
    """A step size: the group's ``"lr"``. A transform with several (muon's
    ``adam_learning_rate``, a partition's links) shows the first under ``"lr"``; see
    `opttx.Optimizer` for how the others follow it."""
    B1 = "b1"
    """The decay of a first moment (Adam's beta1): ``group["betas"][0]``."""
    B2 = "b2"
    """The decay of a second moment (Adam's beta2): ``group["betas"][1]``."""
    MOMENTUM = "momentum"
    """A heavy-ball or Nesterov momentum coefficient: ``group["momentum"]``."""
    WEIGHT_DECAY = "weight_decay"
    """A weight decay coefficient: ``group["weight_decay"]``."""
    EPS = "eps"
    """A denominator's regulariser: ``group["eps"]``."""
    RMS_DECAY = "rms_decay"
    """The decay of RMSprop's average of squares: ``group["alpha"]`` (torch's name)."""

    @property
    def group_key(self) -> str:
        """The param-group key of torch.optim for this role (``"betas"`` for both betas)."""
        return {"learning_rate": "lr", "b1": "betas", "b2": "betas",
                "rms_decay": "alpha"}.get(self.value, self.value)


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What a factory declares about its arguments (see `declare`)."""

    signature: inspect.Signature
    """The factory's signature (its arguments are bound to it)."""
    hyperparams: Mapping[str, "HyperRole | None"]
    """The arguments that are hyperparameters: numbers (or 0-dim tensors, or schedules of the
    step count) that may change between steps without changing what the state means;
    `opttx.inject_hyperparams` makes them 0-dim tensors in the state. Each with its role
    (None: no torch.optim name)."""
    runtime: frozenset[str]
    """Other arguments that may differ between a checkpoint and the run that resumes it
    (a refresh frequency, a warm-up length): part of the configuration that ranks must agree
    on, not of the state's identity."""
    same_state_as: str | None = None
    """The argument holding the transform whose state this one keeps as its own (a
    distributed layout of it: `opttx.distributed.sharded`, ``zero``, ``on_owners``): the
    identity is that transform's, so a checkpoint moves between layouts."""
    wraps: str | None = None
    """The argument holding the transform this wrapper calls from its ``update`` on the whole
    updates, keeping that transform's state whole inside its own (`opttx.apply_if_finite`,
    `opttx.multi_steps`): the wrapper may be rebuilt (`Recipe.rebuild`) around another way of
    running that transform with the same state, as `opttx.distributed.offload` does to run
    its chunks inside the wrapper."""


def rebuild_transform(factory: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``factory(*args, **kwargs)``: how a declared transform is unpickled.

    Pickles name it ``opttx.base._rebuild``, where it lived before the declarations had a
    module of their own, so transforms pickled before and after load alike (`opttx.base`
    keeps that name bound to this function)."""
    return factory(*args, **kwargs)


rebuild_transform.__module__, rebuild_transform.__qualname__ = "opttx.base", "_rebuild"


_LONG = 160      # a tree argument described longer than this is named by its digest


def describe_value(value: Any, values: bool) -> str:
    """A canonical, deterministic description of an argument (the same in every process).

    Transforms are described by `describe_transform`; scalars by their ``repr``; enums,
    dtypes and tensors by their kind (a one-element tensor by its value when ``values``);
    lists and mappings item by item, a long tree of plain values by its digest; any other
    callable or object by its qualified name. The declared configurations of wrappers
    (`configuration_items`) are built from it."""
    if isinstance(value, GradientTransformation):
        return describe_transform(value, values=values)
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Tensor):
        if values and value.numel() == 1:
            return f"tensor({value.item()!r})"
        return f"tensor{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, (list, tuple)):
        items = list(value)
        text = "[" + ", ".join(describe_value(v, values) for v in items) + "]"
    elif isinstance(value, Mapping):
        items = list(value.values())
        text = "{" + ", ".join(f"{k!r}: {describe_value(v, values)}"
                               for k, v in value.items()) + "}"
    elif callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"<function {name}>"
    else:
        return f"<{type(value).__qualname__}>"
    # a long tree of plain values (a mask, labels) is named by its digest; transforms never
    if len(text) > _LONG and not any(isinstance(v, GradientTransformation) for v in items):
        import hashlib
        return f"<tree {hashlib.sha1(text.encode()).hexdigest()[:12]}>"
    return text


def public_name(factory: Callable[..., Any]) -> str:
    """The name a factory is known by in messages and identities: its qualified name, prefixed
    by its module unless it is defined inside ``opttx``."""
    module = getattr(factory, "__module__", "") or ""
    name = getattr(factory, "__qualname__", None) or repr(factory)
    return name if module == "opttx" or module.startswith("opttx.") else f"{module}.{name}"


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """How a declared transform was made: its factory and every argument, by name (defaults
    included). `opttx.Optimizer` rebuilds a transform from it with its hyperparameters
    injected; pickling rebuilds from it; its `identity` names the state the transform makes."""

    factory: Callable[..., "GradientTransformation"]
    arguments: Mapping[str, Any]
    declaration: Declaration

    def __repr__(self) -> str:
        return f"Recipe({self.name}, {len(self.arguments)} arguments)"

    @property
    def name(self) -> str:
        """The factory's name (``"adamw"``; module-qualified outside opttx)."""
        return public_name(self.factory)

    @property
    def args(self) -> tuple:
        return inspect.BoundArguments(self.declaration.signature, dict(self.arguments)).args

    @property
    def kwargs(self) -> dict:
        return inspect.BoundArguments(self.declaration.signature, dict(self.arguments)).kwargs

    def configuration(self) -> tuple[tuple[str, str], ...]:
        """``(argument, description)`` of the arguments that decide what the state means:
        all but the hyperparameters and the runtime arguments."""
        skip = set(self.declaration.hyperparams) | self.declaration.runtime
        return tuple((k, describe_value(v, False)) for k, v in self.arguments.items()
                     if k not in skip)

    @property
    def identity(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """``(name, configuration)``: equal for two transforms whose states mean the same (the
        same factory and configuration; hyperparameters may differ). The ``made_by`` of the
        states it makes."""
        cached = self.__dict__.get("_identity")
        if cached is None:
            inner = self.declaration.same_state_as
            if inner is not None:
                recipe = recipe_of(self.arguments[inner])
                cached = recipe.identity if recipe is not None else \
                    ("<undeclared transform>", ())
            else:
                cached = (self.name, self.configuration())
            object.__setattr__(self, "_identity", cached)
        return cached

    @property
    def stamped_by(self) -> Any:
        """The identity its states carry in ``made_by``: its own, or, when the factory returned
        another declared factory's transform (``muon`` returns a ``partition``), that one's."""
        return self.__dict__.get("_stamped_by") or self.identity

    def describe(self, values: bool = True) -> str:
        """The transform it made as ``factory(argument=value, ...)`` (`describe_transform`):
        with ``values=False`` its `identity`, else every argument."""
        if not values:
            return format_identity(self.identity)
        return f"{self.name}(" + ", ".join(f"{k}={describe_value(v, True)}"
                                           for k, v in self.arguments.items()) + ")"

    def pickled(self) -> tuple:
        """How the transform it made pickles (its ``__reduce__``): the factory called again
        with the same arguments."""
        return (rebuild_transform, (self.factory, self.args, self.kwargs))

    def rebuild(self, **changes: Any) -> "GradientTransformation":
        """The factory called again with ``changes`` to its arguments."""
        unknown = set(changes) - set(self.arguments)
        if unknown:
            raise TypeError(f"{self.name} has no argument(s) {sorted(unknown)}.")
        bound = inspect.BoundArguments(self.declaration.signature,
                                       {**dict(self.arguments), **changes})
        return self.factory(*bound.args, **bound.kwargs)


def format_identity(identity: Any) -> str:
    """``name(arg=value, ...)`` of an identity (`Recipe.identity`, a state's ``made_by``)."""
    if not (isinstance(identity, tuple) and len(identity) == 2):
        return repr(identity)
    name, config = identity
    return f"{name}(" + ", ".join(f"{k}={v}" for k, v in config) + ")"


def identity_differences(a: Any, b: Any) -> str:
    """What differs between two identities, in words (for error messages)."""
    if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2):
        return f"{format_identity(a)} vs {format_identity(b)}"
    if a[0] != b[0]:
        return f"made by {a[0]}, not {b[0]}"
    da, db = dict(a[1]), dict(b[1])
    diffs = [f"{k}: {da.get(k, '<absent>')} vs {db.get(k, '<absent>')}"
             for k in dict.fromkeys(list(da) + list(db)) if da.get(k) != db.get(k)]
    return "; ".join(diffs) or "the same configuration"


def recipe_of(tx: Any) -> "Recipe | None":
    """The `Recipe` of a declared transform, else None."""
    recipe = getattr(tx, "recipe", None)
    return recipe if isinstance(recipe, Recipe) else None


def describe_transform(tx: Any, values: bool = True) -> str:
    """``tx`` as ``factory(argument=value, ...)``, nested transforms described alike; with
    ``values=False`` only what decides the state's meaning (`Recipe.identity`), else every
    argument, hyperparameter values included (what ranks must agree on). An undeclared
    transform is ``"<undeclared transform>"``."""
    recipe = recipe_of(tx)
    if recipe is None:
        return "<undeclared transform>"
    return recipe.describe(values)


def configuration_items(tx: Any, prefix: str | None = None) -> list[tuple[str, str]]:
    """Every argument of ``tx``'s recipe and of the recipes nested in it, hyperparameter
    values included, as ``(path, description)`` (``("adamw.learning_rate", "0.001")``): what
    the ranks of a distributed run must agree on. An undeclared transform is one item."""
    recipe = recipe_of(tx)
    prefix = (recipe.name if recipe is not None else "transform") if prefix is None else prefix
    if recipe is None:
        return [(prefix, "<undeclared transform>")]
    items: list[tuple[str, str]] = []

    def visit(path: str, value: Any) -> None:
        if isinstance(value, GradientTransformation):
            inner = recipe_of(value)
            items.extend(configuration_items(value, f"{path}:{inner.name}" if inner else path))
        elif isinstance(value, (list, tuple)) and any(
                isinstance(v, GradientTransformation) for v in value):
            for i, v in enumerate(value):
                visit(f"{path}[{i}]", v)
        elif isinstance(value, Mapping) and any(
                isinstance(v, GradientTransformation) for v in value.values()):
            for k, v in value.items():
                visit(f"{path}[{k!r}]", v)
        else:
            items.append((path, describe_value(value, True)))

    for name, value in recipe.arguments.items():
        visit(f"{prefix}.{name}", value)
    return items


def _stamp(state: Any, stamp: Static) -> Any:
    """``state`` with ``made_by = stamp`` when its root declares that field and no transform
    stamped it yet (a wrapper whose state is its inner transform's leaves it to that one)."""
    if isinstance(state, tuple) and "made_by" in getattr(type(state), "_fields", ()) and \
            isinstance(state.made_by, Static) and state.made_by.value is None:
        # a new Static each time: the closure's own instance in the state would make
        # torch.compile guard on the two being one object
        return replace_state(state, made_by=Static(stamp.value))
    return state


def _nested_identities(value: Any) -> list:
    """The identities of the declared transforms among ``value`` (an argument of a factory:
    a transform, or a list, tuple or dict of them), and of the transforms nested in those."""
    if isinstance(value, GradientTransformation):
        recipe = recipe_of(value)
        if recipe is None:
            return []
        found = [recipe.identity, recipe.stamped_by]
        for v in recipe.arguments.values():
            found += _nested_identities(v)
        return found
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _nested_identities(v)]
    if isinstance(value, Mapping):
        return [i for v in value.values() for i in _nested_identities(v)]
    return []


def _makers(state: Any, limit: int = 2) -> list[str]:
    """The outermost ``made_by`` stamps inside ``state``, formatted (at most ``limit``)."""
    found: list[str] = []

    def visit(node: Any) -> None:
        if len(found) >= limit:
            return
        made = getattr(node, "made_by", None) if isinstance(node, tuple) else None
        if isinstance(made, Static) and made.value is not None:
            found.append(format_identity(made.value))
            return
        children = node.values() if isinstance(node, Mapping) else \
            node if isinstance(node, (tuple, list)) else ()
        for child in children:
            visit(child)

    visit(state)
    return found


def check_state_type(state: Any, expected: type | tuple[type, ...], name: str,
                     what: str | None = None) -> None:
    """Refuse a ``state`` that is not of the ``expected`` type, naming what made it (its
    ``made_by`` stamps) so a state given to the wrong transform says whose it is; ``what``
    describes the expected state in words (default: the type's name)."""
    if isinstance(state, expected):
        return
    kinds = expected if isinstance(expected, tuple) else (expected,)
    makers = _makers(state)
    made = f" (made by {' and '.join(makers)})" if makers else ""
    raise TypeError(f"{name}.update got a state of type {type(state).__name__}{made}, "
                    f"expected {what or ' or '.join(k.__name__ for k in kinds)}: pass the "
                    "state made by this transform's init (a state of another transform or "
                    "configuration cannot be used).")


def check_made_by(state: Any, identity: Any, what: str | None = None,
                  also: Any = ()) -> None:
    """Refuse a state whose ``made_by`` names another transform or configuration than
    ``identity`` (or one of ``also``: the transforms a wrapper passes its state to). A state
    whose root has no ``made_by``, or an unset one, passes. A trace-time check under
    ``torch.compile``: ``made_by`` is a `Static`, part of the state's structure."""
    made = getattr(state, "made_by", None)
    if not isinstance(made, Static) or made.value is None or made.value == identity or \
            made.value in also:
        return
    name = what or (identity[0] if isinstance(identity, tuple) else "transform")
    raise TypeError(f"{name}.update got a state made by {format_identity(made.value)}, but this "
                    f"transform is {format_identity(identity)} "
                    f"({identity_differences(made.value, identity)}): a state of another "
                    "transform or configuration cannot be used; build the state with this "
                    "transform's init (or load a checkpoint made by the same configuration).")


def _declared_transform(tx: GradientTransformation, recipe: Recipe) -> GradientTransformation:
    """``tx`` with its recipe; when the factory built ``tx`` itself (no recipe yet) its init
    stamps ``made_by`` on a state that has the field and its update checks it."""
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"{recipe.name} is declared with opttx.extend.declare but returned a "
                        f"{type(tx).__name__}, not a GradientTransformation.")
    if tx.recipe is not None:       # made by another declared factory: it stamps its states
        object.__setattr__(recipe, "_stamped_by", tx.recipe.stamped_by)
        return GradientTransformation(tx.init, tx.update, tx.traits, recipe)
    inner_init, inner_update = tx.init, tx.update
    stamp = Static(recipe.identity)
    # a wrapper may hand its whole state to a transform it wraps (cautious, graft's
    # direction): a state stamped by one of those is its state too
    nested = tuple(i for v in recipe.arguments.values() for i in _nested_identities(v))

    def init(params: Params) -> State:
        return _stamp(inner_init(params), stamp)

    def update(updates: Updates, state: State, params: Params | None = None,
               **extra_args: Any) -> tuple[Updates, State]:
        # the transform hands ``made_by`` on itself (replace_state keeps it): restamping here
        # would differ from a step that rebuilt the transform inside a compiled graph
        check_made_by(state, stamp.value, also=nested)
        return inner_update(updates, state, params, **extra_args)

    return GradientTransformation(init, update, tx.traits, recipe)


_STEP_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("opttx_step_local",
                                                                  default=False)


def step_local_transforms() -> contextlib.AbstractContextManager:
    """Build transforms without their recipes inside the block: for a wrapper that rebuilds
    its inner transform in every ``update`` to run that one step (`opttx.inject_hyperparams`
    with this step's hyperparameter tensors, `opttx.partition` with this step's masks). Such a
    transform never leaves the step, the wrapper's own recipe describes it, and the outer
    state was checked already; skipping the recipes keeps the step's Python light. (Under
    ``torch.compile`` recipes are skipped anyway: the transform is traced, not kept, and
    Dynamo cannot enter the context variable.)"""
    if is_tracing():
        return contextlib.nullcontext()
    return _step_local_block()


@contextlib.contextmanager
def _step_local_block() -> Iterator[None]:
    token = _STEP_LOCAL.set(True)
    try:
        yield
    finally:
        _STEP_LOCAL.reset(token)


def declare(*, hyperparams: Mapping[str, "HyperRole | None"] | None = None,
            runtime: tuple[str, ...] = (), same_state_as: str | None = None,
            wraps: str | None = None) -> Callable[[Callable[..., GradientTransformation]],
                          Callable[..., GradientTransformation]]:
    """Declare a transform factory: which arguments are hyperparameters (and their roles),
    and which may change on resume; every other argument is configuration.

    The decorated factory returns its transform with a `Recipe` (the factory and every
    argument), from which:

    * `opttx.Optimizer` finds the hyperparameters and their roles (``lr``, ``betas``,
      ``momentum``, ``weight_decay``, ``eps`` in the param groups) and rebuilds the transform
      with them injected (`opttx.inject_hyperparams`), so a built transform is a full drop-in;
    * the states it makes carry their *identity* (``made_by``: the factory and its
      configuration), and ``update``, ``Optimizer.load_state_dict`` and the checkpoint loaders
      refuse a state of another transform or configuration, naming both;
    * ``opttx.distributed`` checks at ``init`` that every rank built the same transform with the
      same configuration and hyperparameters;
    * the transform pickles (it is rebuilt from the recipe).

    A state NamedTuple that has a field ``made_by: Static = Static()`` gets it stamped by the
    factory that builds the transform (not by a declared factory that returns another declared
    factory's transform: the state belongs to that one).

    So ``update`` checks the configuration of the factories that built the state. A factory
    of yours that returns opttx's transforms (a chain of them) adds its configuration to the
    recipe, which ``Optimizer.load_state_dict`` compares (the group key ``"transform"``) and
    ``opttx.distributed``'s ranks agree on, but not to the state: its stamps are those of the
    transforms it returns (and a chain's state is a tuple, with no field to stamp). An
    argument of yours that reaches one of them as configuration is checked by ``update``
    (``nesterov`` given to `opttx.trace`); one that reaches them only as a hyperparameter
    (``decay``), or that picks numbers in your own code, is not: the state fits either value.
    To have ``update`` check your whole configuration, return a transform whose state
    NamedTuple has the ``made_by`` field (it is then stamped with your factory's identity).

    Args:
      hyperparams: argument name -> `HyperRole` (or None: a hyperparameter without a torch.optim
        name). Only these are injected and shown in param groups.
      runtime: arguments that may differ on resume (refresh frequencies, warm-up lengths):
        excluded from the state's identity, not from what ranks must agree on.
      same_state_as: for a wrapper that keeps the state of the transform it is given (a
        distributed layout of it), the name of that argument: the identity is that
        transform's.
      wraps: for a wrapper that calls the transform it is given on the whole updates and
        keeps its state whole (`Declaration.wraps`), the name of that argument.

    Example:
      >>> @opttx.extend.declare(hyperparams={"learning_rate": opttx.extend.HyperRole.LEARNING_RATE,
      ...                             "decay": opttx.extend.HyperRole.MOMENTUM})
      ... def my_momentum(learning_rate: float, decay: float = 0.9, nesterov: bool = False):
      ...     return opttx.chain(opttx.trace(decay, nesterov),
      ...                        opttx.scale_by_learning_rate(learning_rate))
    """
    hyperparams = dict(hyperparams or {})
    for name, role in hyperparams.items():
        if role is not None and not isinstance(role, HyperRole):
            raise TypeError(f"declare(hyperparams={{{name!r}: ...}}) takes an opttx.HyperRole "
                            f"or None, got {role!r}.")

    def decorate(factory: Callable[..., GradientTransformation]
                 ) -> Callable[..., GradientTransformation]:
        signature = inspect.signature(factory)
        unknown = (set(hyperparams) | set(runtime) | {same_state_as, wraps} - {None}) - \
            set(signature.parameters)
        if unknown:
            raise TypeError(f"declare: {getattr(factory, '__name__', factory)} has no "
                            f"argument(s) {sorted(unknown)}.")
        declaration = Declaration(signature, dict(hyperparams), frozenset(runtime),
                                  same_state_as, wraps)

        positional = [n for n, p in signature.parameters.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        learning_rates = {n for n, role in hyperparams.items()
                          if role is HyperRole.LEARNING_RATE}

        @functools.wraps(factory)
        def declared(*args: Any, **kwargs: Any) -> GradientTransformation:
            if is_tracing():
                # built inside a compiled function: a Python-float hyperparameter would be a
                # constant of the graph (a recompile for every new value, and a symbolic float
                # that the checks cannot read once Dynamo makes it dynamic); as a 0-dim tensor
                # it is a graph input, as an injected hyperparameter is. Learning rates only:
                # they are scale factors everywhere, while a factory may decide in Python on
                # its other hyperparameters (graft's filter on beta1, Shampoo's bias correction
                # on beta2 == 1), also when another factory's body calls it
                args = tuple(_as_graph_input(a) if i < len(positional) and
                             positional[i] in learning_rates else a for i, a in enumerate(args))
                kwargs = {k: _as_graph_input(v) if k in learning_rates else v
                          for k, v in kwargs.items()}
                return factory(*args, **kwargs)   # traced, not kept: no recipe
            tx = factory(*args, **kwargs)
            if _STEP_LOCAL.get():
                return tx       # built to run inside one step (see step_local_transforms)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return _declared_transform(tx, Recipe(declared, dict(bound.arguments),
                                                  declaration))

        declared.__declaration__ = declaration     # type: ignore[attr-defined]
        return declared

    return decorate


def _as_graph_input(value: Any) -> Any:
    """A Python number as a float64 0-dim tensor (in a traced function); anything else as
    it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.scalar_tensor(value, dtype=torch.float64)
    return value


def declaration_of(factory: Any) -> "Declaration | None":
    """The `Declaration` of a factory decorated with `declare`, else None."""
    declaration = getattr(factory, "__declaration__", None)
    return declaration if isinstance(declaration, Declaration) else None
