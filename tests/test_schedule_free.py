"""Schedule-Free: the wrapper `schedule_free`, the aliases `schedule_free_adamw` and
`schedule_free_sgd`, the evaluation point, and `opttx.Optimizer.train`/``eval``.

* the aliases equal ``schedulefree.AdamWScheduleFree`` / ``SGDScheduleFree`` over 20 steps on
  drawn trees and drawn hyperparameters (warmup, weight decay, r, weight_lr_power), the
  training parameters y and the evaluation parameters x alike (float32 1e-5, float64 1e-10
  of each leaf's magnitude);
* they equal ``optax.contrib.schedule_free_adamw`` / ``schedule_free_sgd`` without warmup,
  and the wrapper around optax's own recipe equals them with a warm-up schedule;
* `schedule_free_train_params` inverts `schedule_free_eval_params`;
* `opttx.Optimizer` with a Schedule-Free alias follows ``schedulefree``'s optimizers through
  interleaved ``train()``/``eval()`` calls (idempotent), refuses to step in eval mode, and a
  state dict saved in eval mode resumes exactly;
* a train step compiles with ``fullgraph=True`` to one graph, equal to eager.
"""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch.func import functional_call, grad_and_value

import opttx
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform
import optax_reference
from optax_reference import to_torch

schedulefree = pytest.importorskip("schedulefree")

STEPS = 20
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def check_close(actual: dict, expected: dict, tree: dict, what: str) -> None:
    tol = TOLERANCE[next(iter(tree.values())).dtype]
    for k in tree:    # relative to the leaf's magnitude over the run
        scale = max(float(tree[k].abs().max()), float(expected[k].abs().max()))
        assert_trees_close(actual[k], expected[k], rtol=tol, atol=tol * scale,
                           what=f"{what} params[{k}]")


# ---------------------------------------------------------------------------------------------
# schedulefree
# ---------------------------------------------------------------------------------------------

common = {"lr": st.floats(1e-3, 0.1), "b1": st.floats(0.5, 0.98),
          "weight_decay": st.sampled_from([0.0, 0.05]), "warmup_steps": st.integers(0, 8),
          "r": st.sampled_from([0.0, 0.5]), "weight_lr_power": st.sampled_from([0.0, 2.0])}
adamw_hparams = st.fixed_dictionaries({**common, "b2": st.floats(0.9, 0.999),
                                       "eps": st.sampled_from([1e-8, 1e-3])})
sgd_hparams = st.fixed_dictionaries(common)


def run_schedulefree(kind: str, h: dict, tree: dict, grads: list[dict]) -> tuple[dict, dict]:
    """(y, x): schedulefree's parameters after the steps, in train mode and in eval mode."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    shared = dict(lr=h["lr"], weight_decay=h["weight_decay"], warmup_steps=h["warmup_steps"],
                  r=h["r"], weight_lr_power=h["weight_lr_power"])
    if kind == "adamw":
        opt = schedulefree.AdamWScheduleFree(list(params.values()), betas=(h["b1"], h["b2"]),
                                             eps=h["eps"], **shared)
    else:
        opt = schedulefree.SGDScheduleFree(list(params.values()), momentum=h["b1"], **shared)
    opt.train()
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    y = {k: p.detach().clone() for k, p in params.items()}
    opt.eval()
    return y, {k: p.detach().clone() for k, p in params.items()}


def ours(kind: str, h: dict) -> opttx.GradientTransformation:
    shared = dict(warmup_steps=h["warmup_steps"], b1=h["b1"], weight_decay=h["weight_decay"],
                  weight_lr_power=h["weight_lr_power"], r=h["r"])
    if kind == "adamw":
        return opttx.schedule_free_adamw(h["lr"], b2=h["b2"], eps=h["eps"], **shared)
    return opttx.schedule_free_sgd(h["lr"], **shared)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_aliases_equal_schedulefree(kind: str, dtype: torch.dtype) -> None:
    @settings(max_examples=8, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,)),
           h=adamw_hparams if kind == "adamw" else sgd_hparams)
    def prop(drawn, h):
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        y_ref, x_ref = run_schedulefree(kind, h, drawn.tree, grads)
        y, state = run_transform(ours(kind, h), drawn.tree, grads)
        check_close(y, y_ref, drawn.tree, f"schedule_free_{kind} vs schedulefree (y)")
        x = opttx.schedule_free_eval_params(state, y)
        check_close(x, x_ref, drawn.tree, f"schedule_free_{kind} vs schedulefree (x)")
    prop()


# ---------------------------------------------------------------------------------------------
# optax.contrib
# ---------------------------------------------------------------------------------------------


def run_optax(tx, tree: dict, grads: list[dict]) -> tuple[dict, dict]:
    """optax's y (the parameters it trains) and x (its evaluation parameters)."""
    import optax
    params, state, jax_params = optax_reference.run_optax(tx, tree, grads)
    return params, to_torch(optax.contrib.schedule_free_eval_params(state, jax_params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_equal_optax_contrib_schedule_free(dtype: torch.dtype) -> None:
    """The aliases without warmup; and with a warm-up schedule, `schedule_free` around
    optax's own recipe (its z step takes the schedule at the 0-based step, the averaging
    weight at the 1-based one)."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    @settings(max_examples=4, deadline=None)
    @given(drawn=param_trees(dtypes=(dtype,)), lr=st.floats(1e-3, 0.1),
           b1=st.floats(0.5, 0.98), b2=st.floats(0.9, 0.999),
           wd=st.sampled_from([0.0, 0.05]), warmup=st.integers(1, 8))
    def prop(drawn, lr, b1, b2, wd, warmup):
        grads = gradient_stream(drawn.tree, STEPS, seed=drawn.seed + 1)
        cases = {
            "adamw": (optax.contrib.schedule_free_adamw(lr, None, b1, b2, weight_decay=wd),
                      opttx.schedule_free_adamw(lr, 0, b1, b2, weight_decay=wd)),
            "sgd": (optax.contrib.schedule_free_sgd(lr, None, b1, weight_decay=wd),
                    opttx.schedule_free_sgd(lr, 0, b1, weight_decay=wd))}
        # a linear warm-up in float64 on both sides (opttx's schedules compute in float32)
        def theirs_sched(c):
            return lr * jnp.minimum(jnp.asarray(c, jnp.float64) / warmup, 1.0)

        def ours_sched(c):
            return lr * torch.clamp(c.to(torch.float64) / warmup, max=1.0)

        theirs = optax.contrib.schedule_free(optax.chain(
            optax.scale_by_rms(b2, 1e-8, eps_in_sqrt=False, bias_correction=True),
            optax.add_decayed_weights(wd), optax.scale_by_learning_rate(theirs_sched)),
            theirs_sched, b1)
        mine = opttx.schedule_free(opttx.chain(
            opttx.scale_by_rms(b2, 1e-8, eps_in_sqrt=False, bias_correction=True),
            opttx.add_decayed_weights(wd), opttx.scale_by_learning_rate(ours_sched)),
            ours_sched, b1)
        cases["warmup_recipe"] = (theirs, mine)
        for name, (theirs, mine) in cases.items():
            y_ref, x_ref = run_optax(theirs, drawn.tree, grads)
            y, state = run_transform(mine, drawn.tree, grads)
            check_close(y, y_ref, drawn.tree, f"{name} vs optax (y)")
            check_close(opttx.schedule_free_eval_params(state, y), x_ref, drawn.tree,
                        f"{name} vs optax (x)")
    prop()


# ---------------------------------------------------------------------------------------------
# the evaluation point, dtypes, traits, errors
# ---------------------------------------------------------------------------------------------


def test_train_params_invert_eval_params() -> None:
    tree = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    y, state = run_transform(opttx.schedule_free_sgd(0.1, b1=0.8), tree,
                             gradient_stream(tree, 5, seed=1))
    x = opttx.schedule_free_eval_params(state, y)
    assert not torch.allclose(x["w"], y["w"])      # x and y differ after some steps
    z = state.z
    for k in tree:   # y = (1 - b1) z + b1 x
        assert torch.allclose(y[k], 0.2 * z[k] + 0.8 * x[k], rtol=0, atol=1e-12)
    assert_trees_close(opttx.schedule_free_train_params(state, x), y, rtol=1e-12)
    # before any step x = y = z
    fresh = opttx.schedule_free_adamw().init(tree)
    assert_trees_close(opttx.schedule_free_eval_params(fresh, tree), tree, rtol=0.0)


def test_low_precision_params_keep_z_in_float32() -> None:
    tree = {"w": torch.randn(4, 3).to(torch.bfloat16)}
    tx = opttx.schedule_free_adamw(1e-2)
    state = tx.init(tree)
    assert state.z["w"].dtype == torch.float32
    u, state = tx.update({"w": torch.randn(4, 3).to(torch.bfloat16)}, state, tree)
    assert u["w"].dtype == torch.bfloat16 and state.z["w"].dtype == torch.float32
    assert opttx.schedule_free_adamw(state_dtype=torch.float64).init(tree).z["w"].dtype == \
        torch.float64


def test_traits_and_roles() -> None:
    for tx in (opttx.schedule_free_adamw(), opttx.schedule_free_sgd()):
        assert opttx.extend.traits_of(tx).elementwise and opttx.extend.traits_of(tx).per_leaf
    roles = opttx.extend.state_roles(opttx.ScheduleFreeState)
    assert roles["z"] is opttx.extend.Role.PARAMS_LIKE and roles["count"] is opttx.extend.Role.COUNT
    clipped = opttx.schedule_free(opttx.chain(opttx.clip_by_global_norm(1.0), opttx.sgd(0.1)),
                                  0.1)
    assert opttx.extend.traits_of(clipped).across_leaves and not opttx.extend.traits_of(clipped).per_leaf


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="b1"):
        opttx.schedule_free_sgd(b1=0.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        opttx.schedule_free_adamw(warmup_steps=-1)
    with pytest.raises(ValueError, match="learning_rate"):
        opttx.schedule_free_adamw(-1.0)
    with pytest.raises(TypeError, match="inner"):
        opttx.schedule_free(opttx.sgd, 0.1)
    for c in (0.0, 1.5, "0.1"):
        with pytest.raises(ValueError, match="averaging_weight"):
            opttx.schedule_free(opttx.sgd(0.1), 0.1, averaging_weight=c)
    tx = opttx.schedule_free_sgd()
    state = tx.init({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="params"):
        tx.update({"w": torch.ones(2)}, state)
    with pytest.raises(ValueError, match="ScheduleFreeState"):
        opttx.schedule_free_eval_params(opttx.adam(0.1).init({"w": torch.zeros(2)}),
                                        {"w": torch.zeros(2)})


# ---------------------------------------------------------------------------------------------
# opttx.Optimizer: train() and eval()
# ---------------------------------------------------------------------------------------------


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen))
            for _ in range(n)]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x, y) -> None:
    model.train()
    opt.train()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("kind", ["adamw", "sgd", "sgd_named"])
def test_optimizer_train_eval_follows_schedulefree(kind: str) -> None:
    """Interleaved, repeated train()/eval() calls: parameters equal schedulefree's in both
    modes at every step (also with the group built from ``named_parameters()``)."""
    ref_model, model = make_model(), make_model()
    given = model.named_parameters() if kind.endswith("named") else model.parameters()
    if kind == "adamw":
        ref = schedulefree.AdamWScheduleFree(ref_model.parameters(), lr=1e-2, warmup_steps=3,
                                             weight_decay=0.01, betas=(0.8, 0.99))
        opt = opttx.Optimizer(given, opttx.schedule_free_adamw, lr=1e-2,
                              warmup_steps=3, weight_decay=0.01, betas=(0.8, 0.99))
    else:
        ref = schedulefree.SGDScheduleFree(ref_model.parameters(), lr=0.1, momentum=0.8,
                                           warmup_steps=3)
        opt = opttx.Optimizer(given, opttx.schedule_free_sgd, lr=0.1, b1=0.8,
                              warmup_steps=3)
    assert opt.param_groups[0]["train_mode"] is True
    for i, (x, y) in enumerate(batches(12)):
        train_step(ref_model, ref, x, y)
        train_step(model, opt, x, y)
        assert max_diff(model, ref_model) <= 1e-6, (i, "train")
        if i % 3 == 0:
            ref.eval()
            opt.eval()
            opt.eval()             # idempotent
            assert opt.param_groups[0]["train_mode"] is False
            assert max_diff(model, ref_model) <= 1e-6, (i, "eval")
        if i % 4 == 1:
            ref.train()
            opt.train()
            opt.train()            # idempotent
            assert max_diff(model, ref_model) <= 1e-6, (i, "train again")
    # eval moved the parameters to x: what schedule_free_eval_params computes
    opt.train()
    y_params = [p.detach().clone() for p in model.parameters()]
    if kind.endswith("named"):
        y_params = dict(zip([n for n, _ in model.named_parameters()], y_params))
    expected = opttx.tree.tree_leaves(
        opttx.schedule_free_eval_params(opt.tx_states[0], y_params))
    opt.eval()
    assert_trees_close([p.detach() for p in model.parameters()], expected, rtol=1e-6)


def test_optimizer_refuses_to_step_in_eval_mode() -> None:
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.schedule_free_sgd, lr=0.1)
    opt.eval()
    model(torch.randn(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"optimizer.train\(\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_other_transforms_are_unaffected() -> None:
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adamw, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    assert "train_mode" not in opt.param_groups[0]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    x, y = batches(1)[0]
    train_step(model, opt, x, y)        # steps after eval(): nothing to swap, nothing refused


def test_state_dict_saved_in_eval_mode_resumes_exactly() -> None:
    data = batches(10)
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.schedule_free_adamw, lr=1e-2,
                          warmup_steps=2)
    for x, y in data[:5]:
        train_step(model, opt, x, y)
    opt.eval()                                # checkpoint in eval mode, as schedulefree asks
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    assert opt.state_dict()["param_groups"][0]["train_mode"] is False
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = make_model()
    opt2 = opttx.Optimizer(resumed.parameters(), opttx.schedule_free_adamw, lr=1e-2,
                           warmup_steps=2)
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[0]["train_mode"] is False
    with pytest.raises(RuntimeError):
        opt2.step()
    for x, y in data[5:]:
        train_step(model, opt, x, y)
        train_step(resumed, opt2, x, y)
        assert max_diff(model, resumed) == 0.0
    opt.eval()
    opt2.eval()
    assert max_diff(model, resumed) == 0.0


# ---------------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["adamw_warmup", "sgd_injected"])
def test_train_step_compiles_to_one_graph(variant: str) -> None:
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = {"adamw_warmup": lambda: opttx.schedule_free_adamw(1e-2, warmup_steps=3,
                                                            weight_decay=0.01, r=0.5),
          "sgd_injected": lambda: opttx.inject_hyperparams(opttx.schedule_free_sgd)(
              learning_rate=0.1, b1=0.9)}[variant]()
    x, y = torch.randn(5, 8), torch.randn(5, 4)

    def step(p, s):
        g, _ = grad_and_value(
            lambda q: ((functional_call(model, q, (x,)) - y) ** 2).mean())(p)
        u, s = tx.update(g, s, p)
        return opttx.apply_updates(p, u), s

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    pe, se = params, tx.init(params)
    pc, sc = params, tx.init(params)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(6):
            pe, se = step(pe, se)
            pc, sc = compiled(pc, sc)
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(step.__code__)) == 1
    assert counter.frame_count >= 1
    assert_trees_close(pc, pe, rtol=1e-5)
    assert_trees_close(opttx.schedule_free_eval_params(sc, pc),
                       opttx.schedule_free_eval_params(se, pe), rtol=1e-5)
    torch._dynamo.reset()
