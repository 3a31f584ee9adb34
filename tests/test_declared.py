"""Declared, not guessed (docs/design.md, section 3): every transform declares its
hyperparameters with their roles, the configuration that makes its state, and through that
the identity its states carry.

* `opttx.Optimizer` reads the declarations: the built form ``Optimizer(params, alias(...))``
  shows the learning rate the user gave and follows torch's LR schedulers (``StepLR``,
  ``OneCycleLR``, ``CyclicLR`` with their momentum cycling) exactly as the factory form; a
  user's nested chain shows its ``lr`` too; every form pickles; ``torch.compile(opt.step)``
  without ``fullgraph`` is one graph and does not recompile as a scheduler moves.
* A state knows what made it: ``update``, ``Optimizer.load_state_dict``, and the checkpoint
  loaders refuse another transform's or configuration's state before writing anything,
  naming both.
"""

from __future__ import annotations

import copy
import io
import pickle
import tempfile

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import opttx
from opttx.testing import assert_trees_close, gradient_stream

from registry import CASES, declared_momentum

ALIASES = [c for c in CASES if c.factory is not None
           and c.factory.__module__ == "opttx.aliases" and "learning_rate" in c.kwargs]


def model_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """A matrix, a tall matrix, a vector: every alias of the registry takes them."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((6, 5), (7, 3), (5,))]


def run(opt: opttx.Optimizer, params: list, grads: list, scheduler=None) -> list[torch.Tensor]:
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return [p.detach().clone() for p in params]


def grads_for(params: list, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=2 * opt.param_groups[0]["lr"], total_steps=8,
        cycle_momentum="betas" in opt.defaults or "momentum" in opt.defaults),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(
        opt, base_lr=opt.param_groups[0]["lr"] / 4, max_lr=opt.param_groups[0]["lr"],
        step_size_up=2, cycle_momentum="betas" in opt.defaults or "momentum" in opt.defaults,
        base_momentum=0.8, max_momentum=0.9),
}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("case", ALIASES, ids=[c.name for c in ALIASES])
def test_built_alias_shows_its_lr_and_follows_schedulers_as_the_factory_form(case, scheduler
                                                                            ) -> None:
    """``Optimizer(params, alias(**kw))`` against ``Optimizer(params, alias, **kw)``: the same
    ``lr`` (the value given) and param-group keys, and bitwise the same parameters after 8
    steps under the scheduler (OneCycleLR and CyclicLR cycle ``betas`` or ``momentum`` when
    the alias declares them)."""
    built_params, factory_params = model_params(), model_params()
    names = ["w", "tall", "b"]        # a dict tree: masks of the registry read the names
    built = opttx.Optimizer(list(zip(names, built_params)), case.make())
    factory = opttx.Optimizer(list(zip(names, factory_params)), case.factory, **case.kwargs)
    assert built.param_groups[0]["lr"] == case.kwargs["learning_rate"]
    keys = lambda opt: {k: v for k, v in opt.param_groups[0].items()  # noqa: E731
                        if k not in ("params", "tx", "param_names")}
    assert keys(built) == keys(factory)
    grads = grads_for(built_params, 8)
    got = run(built, built_params, grads, SCHEDULERS[scheduler](built))
    want = run(factory, factory_params, grads, SCHEDULERS[scheduler](factory))
    for a, b in zip(got, want):
        assert torch.equal(a, b), case.name


def test_adafactor_shows_the_learning_rate_it_was_given() -> None:
    """``adafactor(1e-2)`` showed ``lr`` 1.0 (the final constant scale of its chain was taken
    for the learning rate): a scheduler or a user setting it to the 1e-2 they asked for
    shrank every step 100x. Now ``lr`` is 1e-2, and writing 1e-2 changes nothing."""
    params, ref = model_params(), model_params()
    opt = opttx.Optimizer(params, opttx.adafactor(1e-2, min_dim_size_to_factor=2))
    assert opt.param_groups[0]["lr"] == 1e-2
    opt.param_groups[0]["lr"] = 1e-2
    grads = grads_for(params, 3)
    got = run(opt, params, grads)
    tx = opttx.adafactor(1e-2, min_dim_size_to_factor=2)
    want, _ = opttx.testing.run_transform(tx, [p.detach() for p in ref], grads)
    assert_trees_close(got, want, rtol=1e-6)


def test_a_users_nested_chain_shows_its_lr_and_follows_a_scheduler() -> None:
    """``chain(clip_by_global_norm(1.0), chain(adamw(lr)))``: ``lr`` is adamw's, StepLR moves
    it, and the numbers are the functional run of the same chain with the learning rate set
    to the scheduled value before each step."""
    make = lambda: opttx.chain(opttx.clip_by_global_norm(1.0),  # noqa: E731
                               opttx.chain(opttx.adamw(1e-2, weight_decay=0.1)))
    params = model_params()
    opt = opttx.Optimizer(params, make())
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["max_norm"] == 1.0
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    grads = grads_for(params, 4)
    got = run(opt, params, grads, sched)
    tx = opttx.inject_all_hyperparams(make())      # float64: the numbers given, as the Optimizer
    ref = [p.detach().clone() for p in model_params()]
    state = tx.init(ref)
    for i, g in enumerate(grads):
        opttx.set_hyperparams_(state, learning_rate=1e-2 * 0.5 ** i)
        updates, state = tx.update(g, state, ref)
        ref = opttx.apply_updates(ref, updates)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_several_learning_rates_follow_lr_at_their_ratios() -> None:
    """muon's ``adam_learning_rate`` (1/4 of ``learning_rate`` here) follows ``lr`` at its
    ratio, and has a key of its own; a tensor ``lr`` is refused for such a group."""
    params = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))]
    opt = opttx.Optimizer(params, opttx.muon(4e-3, adam_learning_rate=1e-3))
    group = opt.param_groups[0]
    assert group["lr"] == 4e-3 and group["adam_learning_rate"] == 1e-3
    group["lr"] = 2e-3
    hyper = opt.tx_states[0].hyperparams
    assert float(hyper["learning_rate"]) == pytest.approx(2e-3)
    assert float(hyper["adam_learning_rate"]) == pytest.approx(5e-4)
    group["adam_learning_rate"] = 1e-4
    assert float(hyper["learning_rate"]) == pytest.approx(2e-3)
    assert float(hyper["adam_learning_rate"]) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="several learning rates"):
        group["lr"] = torch.tensor(1e-3)


def test_group_keys_the_transform_honours_or_refuses() -> None:
    """Per-group ``nesterov`` and ``maximize`` were kept in the group and ignored (SGD,
    momentum 0.9, 3 steps: torch -1.4559 / +0.9510, opttx -0.9510 for both). Now a group's
    ``nesterov`` rebuilds its transform and ``maximize`` ascends, as torch.optim.SGD; a key
    of torch.optim the transform cannot honour raises."""
    torch.manual_seed(0)
    start = torch.randn(4)
    grads = [torch.randn(4) for _ in range(3)]
    for keys in ({"nesterov": True}, {"maximize": True}, {"nesterov": True, "maximize": True}):
        ours = torch.nn.Parameter(start.clone())
        theirs = torch.nn.Parameter(start.clone())
        opt = opttx.Optimizer([{"params": [ours], **keys}], opttx.sgd(0.1, momentum=0.9))
        ref = torch.optim.SGD([{"params": [theirs], **keys}], lr=0.1, momentum=0.9)
        for g in grads:
            ours.grad, theirs.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), keys
    with pytest.raises(ValueError, match="'amsgrad'"):
        opttx.Optimizer([{"params": [torch.nn.Parameter(start)], "amsgrad": True}],
                        opttx.sgd(0.1))
    opt = opttx.Optimizer([{"params": [torch.nn.Parameter(start)], "nesterov": False}],
                          opttx.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match="configuration argument"):
        opt.param_groups[0]["nesterov"] = True
    opt.param_groups[0]["foreach"] = True              # an implementation flag: accepted


FORMS = {
    "built": lambda p: opttx.Optimizer(p, opttx.adamw(1e-2, weight_decay=0.1)),
    "factory": lambda p: opttx.Optimizer(p, opttx.adamw, lr=1e-2, weight_decay=0.1),
    "injected": lambda p: opttx.Optimizer(p, opttx.inject_hyperparams(opttx.adamw)(
        learning_rate=1e-2)),
    "chain": lambda p: opttx.Optimizer(p, opttx.chain(opttx.clip_by_global_norm(1.0),
                                                      opttx.adamw(1e-2))),
    "muon": lambda p: opttx.Optimizer(p, opttx.muon(1e-2)),
    "MultiSteps": lambda p: opttx.Optimizer(p, opttx.MultiSteps(opttx.adam(1e-2), 2)),
    "declared_by_user": lambda p: opttx.Optimizer(p, declared_momentum(1e-2, nesterov=True)),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_pickles_and_deep_copies(form) -> None:
    """An optimizer pickled (or deep-copied) after two steps steps on exactly as the
    original; a built transform pickles by its recipe (``chain`` did not: "Can't pickle local
    object 'chain.<locals>.init'")."""
    params = model_params()
    opt = FORMS[form](params)
    grads = grads_for(params, 4)
    run(opt, params, grads[:2])
    for copy_of in (lambda o: pickle.loads(pickle.dumps(o)), copy.deepcopy):
        twin = copy_of(opt)
        twin_params = [p for g in twin.param_groups for p in g["params"]]
        want = run(opt, params, grads[2:])
        got = run(twin, twin_params, grads[2:])
        for a, b in zip(got, want):
            assert torch.equal(a, b), form
        params = model_params()
        opt = FORMS[form](params)
        run(opt, params, grads[:2])
    tx = opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adamw(1e-2))
    assert opttx.extend.describe_transform(pickle.loads(pickle.dumps(tx))) == \
        opttx.extend.describe_transform(tx)


@pytest.mark.parametrize("form", ["built", "chain"])
@torch._dynamo.config.patch(error_on_recompile=True)
def test_compiled_step_without_fullgraph_is_one_graph(form) -> None:
    """``torch.compile(opt.step)`` without ``fullgraph``, a StepLR halving ``lr`` each step:
    one graph, no recompile (it was 5-22 graphs, recompiled on ``alpha == -lr``), and the
    eager numbers."""
    torch._dynamo.reset()
    params, eager_params = model_params(), model_params()
    opt, eager = FORMS[form](params), FORMS[form](eager_params)
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    eager_sched = torch.optim.lr_scheduler.StepLR(eager, step_size=1, gamma=0.5)
    for g in grads_for(params, 4):
        for p, q, gi in zip(params, eager_params, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        step()
        eager.step()
        sched.step()
        eager_sched.step()
    torch._dynamo.reset()
    assert counter.frame_count == 1
    assert_trees_close([p.detach() for p in params], [p.detach() for p in eager_params],
                       rtol=1e-6)


def test_a_float_hyperparameter_inside_a_compiled_step_is_a_graph_input() -> None:
    """A transform built inside a compiled function with a Python float that changes every
    step: the float becomes a 0-dim tensor (it failed with "torch.* op returned non-Tensor
    ... isnan" once Dynamo made it symbolic); one recompile when it first changes, none
    after, and the eager numbers."""
    torch._dynamo.reset()
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}

    def step(p, state, g, lr):
        updates, state = opttx.adamw(lr, weight_decay=0.1).update(g, state, p)
        return opttx.apply_updates(p, updates), state

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    state = opttx.adamw(1e-3, weight_decay=0.1).init(params)
    eager_p, eager_state = dict(params), opttx.adamw(1e-3, weight_decay=0.1).init(params)
    for i, g in enumerate(gradient_stream(params, 6, seed=2)):
        lr = 1e-3 * (i + 1)
        params, state = compiled(params, state, g, lr)
        eager_p, eager_state = step(eager_p, eager_state, g, lr)
    torch._dynamo.reset()
    assert counter.frame_count == 2
    assert_trees_close(params, eager_p, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# a state knows what made it
# ---------------------------------------------------------------------------------------------

SAME_LAYOUT = [  # (saved by, loaded into): the same state entries, another meaning
    ("adam", lambda: opttx.adam(1e-2), "adamax", lambda: opttx.adamax(1e-2)),
    ("adam", lambda: opttx.adam(1e-2), "adabelief", lambda: opttx.adabelief(1e-2)),
    ("adam", lambda: opttx.adam(1e-2), "adopt", lambda: opttx.adopt(1e-2)),
    ("soap", lambda: opttx.soap(1e-2, precondition_frequency=2), "soap/eigenbasis",
     lambda: opttx.soap(1e-2, precondition_frequency=2, first_moment_in_eigenbasis=True)),
    ("adamw", lambda: opttx.adamw(1e-2), "cautious(adamw)",
     lambda: opttx.cautious(opttx.adamw(1e-2))),
]


def _snapshot(opt: opttx.Optimizer) -> tuple:
    return (copy.deepcopy([t for t in opttx.tree.tree_leaves(opt.tx_states)]),
            [{k: v for k, v in g.items() if k not in ("params", "tx")}
             for g in opt.param_groups])


@pytest.mark.parametrize("saved,make_saved,loaded,make_loaded", SAME_LAYOUT,
                         ids=[f"{a}->{b}" for a, _, b, _ in SAME_LAYOUT])
def test_optimizer_refuses_another_transforms_state_dict_and_writes_nothing(
        saved, make_saved, loaded, make_loaded) -> None:
    """Adam's state dict loaded into adamax, adabelief or adopt (the next step was off by
    0.040 where a step is 0.008), soap's into soap(first_moment_in_eigenbasis=True), adamw's
    into cautious(adamw) (count, mu and nu were overwritten, then an error about 'lr'): each
    is refused, naming both transforms, and the optimizer is left as it was."""
    params = model_params()
    source = opttx.Optimizer(params, make_saved())
    run(source, params, grads_for(params, 2))
    target_params = model_params(seed=3)
    target = opttx.Optimizer(target_params, make_loaded())
    run(target, target_params, grads_for(target_params, 1, seed=4))
    before = _snapshot(target)
    with pytest.raises(ValueError, match="made by .* but this group's transform is"):
        target.load_state_dict(source.state_dict())
    after = _snapshot(target)
    assert after[1] == before[1]
    for a, b in zip(after[0], before[0]):
        assert torch.equal(a, b)


def test_update_refuses_a_state_of_another_configuration_naming_both() -> None:
    """``soap(max_precond_dim=2).update(g, soap().init(p), p)`` returned soap()'s numbers; an
    adam state given to muon or mars raised an AttributeError. Both now raise naming the
    transform that made the state and the one given it."""
    p = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    g = gradient_stream(p, 1)[0]
    with pytest.raises(TypeError, match="made by precondition_eigenvalue_corrected.*but "
                                        "this transform is .*max_basis_dim: 10000 vs 2"):
        opttx.soap(1e-2, max_precond_dim=2).update(g, opttx.soap(1e-2).init(p), p)
    adam_state = opttx.adam(1e-2).init(p)
    for tx in (opttx.muon(1e-2), opttx.mars(1e-2)):
        with pytest.raises(TypeError, match="scale_by_adam"):
            tx.update(g, adam_state, p)
    # the same configuration with other hyperparameters is the same state
    state = opttx.adam(1e-2).init(p)
    opttx.adam(3e-4, b1=0.8).update(g, state, p)


def test_functional_checkpoints_name_their_maker_and_are_refused_elsewhere() -> None:
    """`opttx.distributed.state_dict` records what made the state (``made_by``);
    `load_state_dict`, `check_checkpoint` and `load_checkpoint` refuse a state of another
    transform before writing anything (the DCP path accepted adam -> adopt)."""
    import torch.distributed.checkpoint as dcp
    from opttx.distributed import (check_checkpoint, load_checkpoint, load_state_dict,
                                   state_dict)
    p = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    adam = opttx.adam(1e-2)
    state = opttx.testing.run_transform(adam, p, gradient_stream(p, 2))[1]
    saved = state_dict(state, p)
    assert any("scale_by_adam" in v for v in saved["made_by"].values())
    adopt_state = opttx.adopt(1e-2).init(p)
    before = copy.deepcopy(opttx.tree.tree_leaves(adopt_state))
    with pytest.raises(ValueError, match="this run's state is made by scale_by_adopt.*the "
                                         "checkpoint's by scale_by_adam"):
        load_state_dict(adopt_state, saved, p)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["made_by"] == saved["made_by"]
    with tempfile.TemporaryDirectory() as path:
        dcp.save({"optim": saved}, checkpoint_id=path)
        template = {"optim": state_dict(adopt_state, p)}
        metadata = dcp.FileSystemReader(path).read_metadata()
        with pytest.raises(ValueError, match="another transform"):
            check_checkpoint(template["optim"], metadata, prefix="optim")
        with pytest.raises(ValueError, match="the checkpoint's by scale_by_adam"):
            load_checkpoint(template, checkpoint_id=path)
        check_checkpoint(state_dict(adam.init(p), p), metadata, prefix="optim")
    for a, b in zip(opttx.tree.tree_leaves(adopt_state), before):
        assert torch.equal(a, b)


def test_declarations_are_checked_when_the_factory_is_decorated() -> None:
    """`opttx.extend.declare` refuses names that are not arguments and roles that are not
    `opttx.extend.HyperRole`; an undeclared transform has no recipe and does not pickle, saying
    how to fix it."""
    with pytest.raises(TypeError, match="no argument"):
        opttx.extend.declare(hyperparams={"lr": opttx.extend.HyperRole.LEARNING_RATE})(
            lambda learning_rate: opttx.sgd(learning_rate))
    with pytest.raises(TypeError, match="HyperRole"):
        opttx.extend.declare(hyperparams={"learning_rate": "lr"})
    bare = opttx.GradientTransformation(lambda p: (), lambda u, s, p=None, **k: (u, s))
    assert opttx.extend.recipe_of(bare) is None
    with pytest.raises(TypeError, match="opttx.extend.declare"):
        pickle.dumps(bare)
