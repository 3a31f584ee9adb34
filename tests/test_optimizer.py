"""opttx.Optimizer is a drop-in torch.optim.Optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

import opttx
from opttx.testing import assert_trees_close


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def data(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(12, 6, generator=gen), torch.randn(12, 2, generator=gen))
            for _ in range(n)]


def train(model, opt, batches, scheduler=None) -> list[float]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def test_is_a_torch_optimizer_and_trains_like_torch_adamw() -> None:
    ours_model, ref_model = make_model(), make_model()
    ours = opttx.Optimizer(ours_model.parameters(), opttx.adamw(1e-2, weight_decay=0.01))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    assert isinstance(ours, torch.optim.Optimizer)
    batches = data(15)
    l_ours, l_ref = train(ours_model, ours, batches), train(ref_model, ref, batches)
    assert l_ours == pytest.approx(l_ref, rel=1e-5)
    assert l_ours[-1] < l_ours[0]
    for p in ours_model.parameters():
        assert p.grad is None                    # zero_grad (set_to_none) from torch.optim


def test_step_with_closure_returns_the_loss() -> None:
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.sgd(0.1))
    x, y = data(1)[0]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    second = opt.step(closure)
    assert second.item() < first.item()


def test_state_dict_round_trip_resumes_bit_identically() -> None:
    batches = data(10)
    tx = lambda: opttx.chain(opttx.clip_by_global_norm(1.0),
                             opttx.inject_hyperparams(opttx.adamw)(learning_rate=1e-2))
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), tx())
    train(model, opt, batches[:5])
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, batches[5:])

    resumed = make_model(seed=123)
    resumed.load_state_dict(saved_model)
    resumed_opt = opttx.Optimizer(resumed.parameters(), tx())
    resumed_opt.load_state_dict(saved_opt)
    train(resumed, resumed_opt, batches[5:])
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert_trees_close(opt.tx_states, resumed_opt.tx_states, rtol=0.0)


def test_load_state_dict_refuses_another_transform() -> None:
    model = make_model()
    adam = opttx.Optimizer(model.parameters(), opttx.adam(1e-3))
    sgd = opttx.Optimizer(model.parameters(), opttx.sgd(1e-3, momentum=0.9))
    with pytest.raises(ValueError, match="made by inject_hyperparams\\(inner=adam.*"
                                         "this group's transform is .*inner=sgd"):
        sgd.load_state_dict(adam.state_dict())


def test_lr_scheduler_drives_injected_learning_rate() -> None:
    model, ref_model = make_model(), make_model()
    opt = opttx.Optimizer(model.parameters(),
                          opttx.inject_hyperparams(opttx.adam)(learning_rate=1e-2))
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    batches = data(8)
    l_ours = train(model, opt, batches, sched)
    l_ref = train(ref_model, ref, batches, ref_sched)
    assert l_ours == pytest.approx(l_ref, rel=1e-5)
    state = opt.tx_states[0]
    # the group's lr is written into the state as the scheduler sets it (not at the next step)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-2 * 0.5**4)


def test_named_parameters_and_groups_with_their_own_transform() -> None:
    model = make_model()
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim == 1]
    opt = opttx.Optimizer([{"params": decay},
                           {"params": no_decay, "tx": opttx.sgd(0.0)}],
                          opttx.adamw(1e-2, weight_decay=0.1))
    assert set(opt.tx_states[0].inner_state[0].mu) == {n for n, _ in decay}   # keyed by name
    biases = [p.detach().clone() for _, p in no_decay]
    train(model, opt, data(3))
    for before, (_, p) in zip(biases, no_decay):
        assert torch.equal(before, p)                                # lr 0: never moved


def test_parameters_without_gradient_do_not_move() -> None:
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = opttx.Optimizer([used, unused], opttx.adamw(0.1, weight_decay=0.5))
    used.grad = torch.ones(3)
    opt.step()
    assert torch.equal(unused, torch.ones(3))
    assert not torch.equal(used, torch.ones(3))


def test_state_is_updated_in_place() -> None:
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adam(1e-2))
    pointers = [t.data_ptr() for t in opttx.tree.tree_leaves(opt.tx_states[0].inner_state[0].mu)]
    train(model, opt, data(2))
    assert pointers == [t.data_ptr() for t in
                        opttx.tree.tree_leaves(opt.tx_states[0].inner_state[0].mu)]


def test_bf16_parameters_keep_fp32_statistics() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))
    opt = opttx.Optimizer([p], opttx.adamw(1e-2))
    p.grad = torch.randn(4, 4).to(torch.bfloat16)
    opt.step()
    adam_state = opt.tx_states[0].inner_state[0]
    assert adam_state.mu[0].dtype == torch.float32 and adam_state.nu[0].dtype == torch.float32
    assert p.dtype == torch.bfloat16


def test_step_leaves_gradients_untouched() -> None:
    for tx in (opttx.sgd(0.1), opttx.sgd(0.1, momentum=0.9), opttx.adamw(1e-2),
               opttx.chain(opttx.clip_by_global_norm(1e-3), opttx.lion(1e-3))):
        p = torch.nn.Parameter(torch.ones(4, 3))
        opt = opttx.Optimizer([p], tx)
        grad = torch.randn(4, 3)
        p.grad = grad.clone()
        opt.step()
        opt.step()
        assert torch.equal(p.grad, grad)


def test_deepcopy_keeps_the_transform_and_its_state() -> None:
    """A deep copy (torch's Optimizer.__getstate__ alone would drop tx and its states) steps
    exactly as the original from the same point."""
    import copy
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = opttx.Optimizer([w], opttx.adamw(1e-2, weight_decay=0.1))
    for _ in range(2):
        w.grad = torch.randn(4, 3)
        opt.step()
    twin = copy.deepcopy(opt)
    w2 = twin.param_groups[0]["params"][0]
    assert w2 is not w and torch.equal(w2, w)
    g = torch.randn(4, 3)
    w.grad, w2.grad = g.clone(), g.clone()
    opt.step()
    twin.step()
    assert torch.equal(w, w2)
    mine, theirs = opt.state[w], twin.state[w2]
    assert set(mine) == set(theirs) and mine
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


# -- hyperparameters always in param_groups; the rest of torch's contract -----------------------


def params_of(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_factory_with_torch_keywords_and_per_group_values_matches_torch() -> None:
    """``Optimizer(params, opttx.adamw, lr=..., betas=..., weight_decay=...)`` as torch's
    AdamW: groups and ``defaults`` show torch's keys with the exact values given, per-group
    ``lr``/``weight_decay`` take effect, and a scheduler drives every group."""
    model, ref_model = make_model(), make_model()

    def groups(m):
        return [{"params": [m[0].weight, m[2].weight]},
                {"params": [m[0].bias, m[2].bias], "lr": 3e-2, "weight_decay": 0.0}]

    opt = opttx.Optimizer(groups(model), opttx.adamw, lr=1e-2, betas=(0.8, 0.99),
                          weight_decay=0.1, eps=1e-7)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1,
                            eps=1e-7)
    assert opt.defaults["lr"] == 1e-2 and opt.defaults["betas"] == (0.8, 0.99)
    assert opt.defaults["weight_decay"] == 0.1 and opt.defaults["eps"] == 1e-7
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    batches = data(8)
    assert train(model, opt, batches, sched) == pytest.approx(
        train(ref_model, ref, batches, ref_sched), rel=1e-5)
    torch.testing.assert_close(params_of(model), params_of(ref_model), rtol=1e-5, atol=1e-6)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]


def test_manual_warmup_and_tensor_lr_take_effect() -> None:
    """``group["lr"] = x`` (a hand-written warm-up) and a tensor ``lr`` that a scheduler fills
    in place both reach the state before the next step."""
    for lr in (1e-2, torch.tensor(1e-2)):
        model, ref_model = make_model(), make_model()
        opt = opttx.Optimizer(model.parameters(), opttx.adam, lr=lr)
        ref = torch.optim.Adam(ref_model.parameters(), lr=lr.clone() if
                               isinstance(lr, torch.Tensor) else lr)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
        ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref, gamma=0.7)
        for i, (x, y) in enumerate(data(6)):
            for o, m, s in ((opt, model, sched), (ref, ref_model, ref_sched)):
                if i < 2 and not isinstance(lr, torch.Tensor):
                    o.param_groups[0]["lr"] = 1e-3 * (i + 1)       # warm-up by hand
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
                s.step()
        torch.testing.assert_close(params_of(model), params_of(ref_model), rtol=1e-5,
                                   atol=1e-6)
        assert float(opt.tx_states[0].hyperparams["learning_rate"]) == pytest.approx(
            float(ref.param_groups[0]["lr"]), rel=1e-6)


@pytest.mark.parametrize("kind", ["onecycle", "cyclic"])
def test_cycle_momentum_drives_betas_and_momentum(kind: str) -> None:
    """OneCycleLR/CyclicLR with their default ``cycle_momentum=True`` cycle AdamW's
    ``betas[0]`` and SGD's ``momentum``, as in torch."""
    cases = [(lambda p: opttx.Optimizer(p, opttx.adamw, lr=1e-2, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
             (lambda p: opttx.Optimizer(p, opttx.sgd, lr=1e-2, momentum=0.9),
              lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9))]
    for ours_fn, ref_fn in cases:
        model, ref_model = make_model(), make_model()
        opt, ref = ours_fn(model.parameters()), ref_fn(ref_model.parameters())

        def sched(o):
            if kind == "onecycle":
                return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10)
            return torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=0.05,
                                                     step_size_up=3)

        s, ref_s = sched(opt), sched(ref)
        batches = data(10)
        assert train(model, opt, batches, s) == pytest.approx(
            train(ref_model, ref, batches, ref_s), rel=1e-5)
        key = "betas" if "betas" in ref.defaults and ref.defaults.get("momentum") is None \
            else "momentum"
        assert opt.param_groups[0][key] == ref.param_groups[0][key]
        hyper = opt.tx_states[0].hyperparams
        live = float(hyper["b1"] if key == "betas" else hyper["momentum"])
        first = ref.param_groups[0][key]
        assert live == pytest.approx(first[0] if key == "betas" else first, rel=1e-6)


def test_built_alias_is_a_full_drop_in() -> None:
    """A built alias (not the factory form) shows its declared hyperparameters under torch's
    keys, in the groups and ``defaults``; a scheduler and a group edit apply to it exactly as
    to torch's AdamW; what the transform cannot honour raises instead of being ignored."""
    model, ref_model = make_model(), make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adamw(1e-2, weight_decay=0.1))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    assert opt.defaults == {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "eps_root": 0.0,
                            "weight_decay": 0.1}
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=6)
    batches = data(6)
    assert train(model, opt, batches[:3], sched) == pytest.approx(
        train(ref_model, ref, batches[:3], ref_sched), rel=1e-5)
    opt.param_groups[0]["weight_decay"] = ref.param_groups[0]["weight_decay"] = 0.3
    assert train(model, opt, batches[3:], sched) == pytest.approx(
        train(ref_model, ref, batches[3:], ref_sched), rel=1e-5)
    with pytest.raises(ValueError, match="'centered'"):     # not an argument of adamw
        opttx.Optimizer([{"params": list(model.parameters()), "centered": True}],
                        opttx.adamw(1e-2))
    with pytest.raises(ValueError, match="'lr'.*schedule"):
        opttx.Optimizer(model.parameters(), opttx.adamw(opttx.linear_schedule(
            1e-2, 0.0, 10))).param_groups[0]["lr"] = 1e-3
    # rmsprop with momentum ends in the momentum trace: its lr is declared all the same
    rms = opttx.Optimizer(model.parameters(), opttx.rmsprop(1e-2, momentum=0.9))
    step_lr = torch.optim.lr_scheduler.StepLR(rms, step_size=1, gamma=0.5)
    rms.step()
    step_lr.step()
    assert float(rms.tx_states[0].hyperparams["learning_rate"]) == pytest.approx(5e-3)
    with pytest.raises(TypeError, match="already built"):
        opttx.Optimizer(model.parameters(), opttx.adamw(1e-2), lr=1e-3)
    with pytest.raises(TypeError, match="no argument 'momentum'"):
        opttx.Optimizer(model.parameters(), opttx.adamw, lr=1e-3, momentum=0.9)


@pytest.mark.parametrize("name", ["linear", "cosine", "cosine_with_restarts", "polynomial",
                                  "constant", "constant_with_warmup", "inverse_sqrt",
                                  "reduce_lr_on_plateau", "cosine_with_min_lr",
                                  "cosine_warmup_with_min_lr", "warmup_stable_decay",
                                  "greedy"])
def test_hf_get_scheduler_drives_a_built_alias(name: str) -> None:
    """HF transformers' ``get_scheduler`` (every type that takes an optimizer's lr; the
    ``polynomial`` and ``*_min_lr`` ones read ``defaults["lr"]``) drives a plain, non-injected
    ``opttx.adamw(...)`` exactly as it drives ``torch.optim.AdamW``."""
    transformers = pytest.importorskip("transformers")
    specific = {"cosine_with_min_lr": {"min_lr": 1e-4},
                "cosine_warmup_with_min_lr": {"min_lr": 1e-4},
                "warmup_stable_decay": {"num_decay_steps": 3}}.get(name, {})
    model, ref_model = make_model(), make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adamw(1e-2, weight_decay=0.1))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    scheds = [transformers.get_scheduler(name, o, num_warmup_steps=2, num_training_steps=8,
                                         scheduler_specific_kwargs=specific)
              for o in (opt, ref)]
    for x, y in data(8):
        for o, m, s in ((opt, model, scheds[0]), (ref, ref_model, scheds[1])):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            if name in ("reduce_lr_on_plateau", "greedy"):
                s.step(loss.item())
            else:
                s.step()
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    torch.testing.assert_close(params_of(model), params_of(ref_model), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("built", [False, True])
def test_compiled_step_is_one_graph_with_a_scheduler(built: bool) -> None:
    """``torch.compile(opt.step)`` with a scheduler changing lr (and betas) over 10 steps: one
    graph, no recompile, no graph break (fullgraph), parameters equal the eager twin's; for
    an optimizer built from the alias (OneCycleLR) and for a built alias (cosine)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    model, eager_model = make_model(), make_model()

    def build(m):
        if built:
            o = opttx.Optimizer(m.parameters(), opttx.adamw(1e-2, weight_decay=0.1))
            return o, torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)
        o = opttx.Optimizer(m.parameters(), opttx.adamw, lr=1e-2, weight_decay=0.1)
        return o, torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=12)

    (opt, sched), (eager, eager_sched) = build(model), build(eager_model)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(opt.step, backend=counter, fullgraph=True)
    lrs = set()
    for x, y in data(10):
        for m, s, do in ((model, sched, step), (eager_model, eager_sched, eager.step)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            do()
            m.zero_grad()
            s.step()
        lrs.add(opt.param_groups[0]["lr"])
    assert len(lrs) == 10
    # one graph, never recompiled: one cache entry (through AOT autograd Dynamo restarts its
    # first analysis once for the float64 0-dim hyperparameters, calling the backend twice)
    cached = torch._dynamo.eval_frame._debug_get_cache_entry_list(opt.step.__func__.__code__)
    assert len(cached) == 1 and counter.frame_count <= 2
    torch.testing.assert_close(params_of(model), params_of(eager_model), rtol=1e-6,
                               atol=1e-7)
    if not built:
        assert float(opt.tx_states[0].hyperparams["learning_rate"]) == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-6)


def test_state_dict_hooks_are_called() -> None:
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adam, lr=1e-2)
    train(model, opt, data(1))
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: (calls.append("post"),
                                                     {**sd, "extra": 1})[1])
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: (calls.append("load_pre"), {k: v for k, v in sd.items()
                                                  if k != "extra"})[1])
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    saved = opt.state_dict()
    assert saved["extra"] == 1
    opt.load_state_dict(saved)
    assert calls == ["pre", "post", "load_pre", "load_post"]


@pytest.mark.parametrize("named_first", [True, False])
def test_state_dict_from_named_parameters_loads_into_parameters(named_first: bool) -> None:
    batches = data(8)

    def build(m, named):
        return opttx.Optimizer(m.named_parameters() if named else m.parameters(),
                               opttx.adamw, lr=1e-2, weight_decay=0.1)

    model = make_model()
    opt = build(model, named_first)
    train(model, opt, batches[:4])
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, batches[4:])
    other = make_model(seed=5)
    other.load_state_dict(saved_model)
    other_opt = build(other, not named_first)
    other_opt.load_state_dict(saved_opt)
    assert "param_names" in other_opt.param_groups[0]    # kept from either side, as torch
    train(other, other_opt, batches[4:])
    assert torch.equal(params_of(model), params_of(other))


def test_pickles_and_resumes_identically() -> None:
    import pickle
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adamw, lr=1e-2, weight_decay=0.1)
    train(model, opt, data(3))
    twin = pickle.loads(pickle.dumps(opt))
    assert twin.param_groups[0]["lr"] == 1e-2 and twin.defaults == opt.defaults
    twin.param_groups[0]["lr"] = 5e-3            # still writes through to its own state
    opt.param_groups[0]["lr"] = 5e-3
    ps = twin.param_groups[0]["params"]
    for p, q in zip(model.parameters(), ps):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    twin.step()
    assert torch.equal(params_of(model), torch.cat([q.detach().flatten() for q in ps]))


def test_repeated_param_groups_and_bad_params() -> None:
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.sgd, lr=0.1, momentum=0.9)
    train(model, opt, data(1))
    before = opt.state_dict()
    opt.param_groups.extend(opt.param_groups)
    after = opt.state_dict()
    assert after["param_groups"][-1] == before["param_groups"][-1]
    assert after["state"].keys() == before["state"].keys()
    opt.load_state_dict(after)
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        opttx.Optimizer(torch.ones(3, requires_grad=True), opttx.sgd, lr=0.1)



def test_state_keeps_field_paths_for_dcp() -> None:
    """``opt.state[p]`` names entries by field path only (DCP reads ``optimizer.state``: a
    second, torch-style name would save every moment twice)."""
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adamw, lr=1e-2)
    train(model, opt, data(1))
    entries = opt.state[next(iter(model.parameters()))]
    assert {"inner_state.0.mu", "inner_state.0.nu"} <= set(entries)
    assert not {"exp_avg", "exp_avg_sq", "step"} & set(entries)
    with pytest.raises(TypeError, match="factory.*learning_rate"):
        opttx.Optimizer(model.parameters(), opttx.adamw)


def test_grad_scaler_and_scheduler_drive_a_built_alias() -> None:
    """``torch.amp.GradScaler("cpu")`` with an LR scheduler around a built, non-injected
    alias: the same parameters as torch's AdamW under the same scaler, an overflowing step
    skipped by both."""
    model, ref_model = make_model(), make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adamw(1e-2, weight_decay=0.1))
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    pairs = []
    for o in (opt, ref):
        pairs.append((torch.amp.GradScaler("cpu", init_scale=2.0**10),
                      torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4)))
    for i, (x, y) in enumerate(data(6)):
        for m, o, (scaler, sched) in zip((model, ref_model), (opt, ref), pairs):
            loss = torch.nn.functional.mse_loss(m(x), y)
            if i == 2:
                loss = loss * float("inf")              # this step overflows: skipped
            scaler.scale(loss).backward()
            scaler.step(o)
            scaler.update()
            o.zero_grad()
            sched.step()
    assert pairs[0][0].get_scale() == pairs[1][0].get_scale() < 2.0**10
    torch.testing.assert_close(params_of(model), params_of(ref_model), rtol=1e-5, atol=1e-6)


def test_older_state_dict_with_opttx_group_names_loads() -> None:
    """A state dict whose groups name the injected values as opttx does (``b1``, ``b2``,
    ``learning_rate``; saved before groups used torch's keys) loads: the groups then show the
    loaded values under torch's keys."""
    model = make_model()
    opt = opttx.Optimizer(model.parameters(), opttx.adamw, lr=1e-2, betas=(0.8, 0.9))
    train(model, opt, data(2))
    saved = copy.deepcopy(opt.state_dict())
    group = saved["param_groups"][0]
    group["b1"], group["b2"] = group.pop("betas")
    group["learning_rate"] = group.pop("lr")
    other = opttx.Optimizer(model.parameters(), opttx.adamw, lr=1e-3)
    other.load_state_dict(saved)
    assert other.param_groups[0]["betas"] == pytest.approx((0.8, 0.9))
    assert other.param_groups[0]["lr"] == pytest.approx(1e-2)
    assert "b1" not in other.param_groups[0] and "learning_rate" not in other.param_groups[0]
    assert float(other.tx_states[0].hyperparams["b1"]) == pytest.approx(0.8)


def test_hyperparameters_are_float64_whatever_the_model() -> None:
    """Injected by the Optimizer as float64 0-dim CPU tensors, the exact numbers given, for a
    float32 model as for a float64 one (tests/test_optimizer_precision.py: what is computed
    with them); the groups show the Python values."""
    for dtype in (torch.float32, torch.float64):
        p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
        opt = opttx.Optimizer([{"params": [p]}], opttx.adam, lr=1e-3)
        assert opt.tx_states[0].hyperparams["learning_rate"].dtype == torch.float64
        assert opt.param_groups[0]["lr"] == 1e-3 and opt.defaults["lr"] == 1e-3
