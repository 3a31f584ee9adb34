"""`opttx.ema_params`: the average of the parameters in the optimizer state, against
``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn`` and against timm's
``ModelEmaV3`` decay (warm-up, ``update_after_step``, ``min_decay``) written out here; its
evaluation swap (`opttx.swap_ema`, `opttx.ema_eval_params`); checkpoints through
``torch.distributed.checkpoint``; and the average itself exact under ``sharded`` and ``zero``
on two gloo ranks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import opttx
from opttx.testing import spawn_ranks
from opttx.tree import tree_map


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 2)).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=gen, dtype=torch.float64),
             torch.randn(5, 2, generator=gen, dtype=torch.float64)) for _ in range(n)]


def _grads(model: torch.nn.Module, params: dict, batch: tuple) -> dict:
    x, y = batch
    out = torch.func.functional_call(model, params, (x,))
    loss = (out - y).square().mean()
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def _functional_run(tx: opttx.GradientTransformation, steps: int, model: torch.nn.Module,
                    on_step=None) -> tuple[dict, opttx.EmaParamsState]:
    params = {k: p.detach().clone().requires_grad_(True) for k, p in model.named_parameters()}
    state = tx.init({k: p.detach() for k, p in params.items()})
    for batch in _batches(steps):
        grads = _grads(model, params, batch)
        with torch.no_grad():
            detached = {k: p.detach() for k, p in params.items()}
            updates, state = tx.update(grads, state, detached)
            detached = opttx.apply_updates(detached, updates)
        params = {k: p.clone().requires_grad_(True) for k, p in detached.items()}
        if on_step is not None:
            on_step(detached, state)
    return {k: p.detach() for k, p in params.items()}, state


# ---------------------------------------------------------------------------------------------
# the references
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.9, 0.99])
def test_equals_averaged_model_with_ema_multi_avg_fn(decay: float) -> None:
    """float64, 8 steps of AdamW: after every step the state's average equals
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` updated after the
    step (its first update copies the parameters, as our d_1 = 0 does), bit for bit; the
    same through `opttx.Optimizer` (in place, donated)."""
    model = _model()
    reference = _model()
    averaged = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(decay))
    names = [k for k, _ in model.named_parameters()]

    def check(params: dict, state: opttx.EmaParamsState) -> None:
        with torch.no_grad():
            for p, k in zip(reference.parameters(), names):
                p.copy_(params[k])
        averaged.update_parameters(reference)
        for (k, want) in zip(names, averaged.module.parameters()):
            assert torch.equal(state.ema[k], want.detach()), (k, int(state.count))
        if int(state.count) > 1:     # an average, not a copy of the parameters
            assert not torch.equal(state.ema[names[0]], params[names[0]])

    tx = opttx.ema_params(opttx.adamw(3e-2, weight_decay=0.1), decay)
    _functional_run(tx, 8, model, check)
    assert int(averaged.n_averaged) == 8

    # the in-place path: opttx.Optimizer on a module, against the same reference; and with
    # the learning rate folded into the write (p.add_(u, alpha=-lr)), the sum it averages
    for fold in (False, True):
        trained = _model()
        opt = opttx.Optimizer(trained.parameters(), tx, fold_learning_rate=fold)
        reference2 = _model()
        averaged2 = AveragedModel(reference2, multi_avg_fn=get_ema_multi_avg_fn(decay))
        for x, y in _batches(8):
            opt.zero_grad()
            (trained(x) - y).square().mean().backward()
            opt.step()
            averaged2.update_parameters(trained)
        with opttx.swap_ema(opt):
            for p, want in zip(trained.parameters(), averaged2.module.parameters()):
                assert torch.equal(p.detach(), want.detach()), fold


def _timm_decay(step: int, decay: float, update_after_step: int, use_warmup: bool,
                warmup_gamma: float, warmup_power: float, min_decay: float) -> float:
    """timm's ModelEmaV3.get_decay(step), written out in Python floats."""
    step = max(0, step - update_after_step - 1)
    if step <= 0:
        return 0.0
    if not use_warmup:
        return decay
    d = 1 - (1 + step / warmup_gamma) ** -warmup_power
    return max(min(d, decay), min_decay)


TIMM_CASES = {
    "plain": {"decay": 0.95, "update_after_step": 0, "use_warmup": False, "warmup_gamma": 1.0,
              "warmup_power": 2 / 3, "min_decay": 0.0},
    "warmup": {"decay": 0.9, "update_after_step": 2, "use_warmup": True, "warmup_gamma": 3.0,
               "warmup_power": 0.75, "min_decay": 0.3},
    "running_mean": {"decay": 1.0, "update_after_step": 0, "use_warmup": True,
                     "warmup_gamma": 1.0, "warmup_power": 1.0, "min_decay": 0.0},
}


@pytest.mark.parametrize("name", list(TIMM_CASES))
@pytest.mark.parametrize("every", [1, 3])
def test_equals_the_timm_decay_written_out(name: str, every: int) -> None:
    """float64, 10 steps of SGD with momentum: ``ModelEmaV3.update(model, step=t)`` called
    after every ``every``-th step t, i.e. ema.lerp_(theta_t, 1 - get_decay(t)), with
    get_decay written out above; ``warmup_power=1, warmup_gamma=1, decay=1`` is the plain
    running mean of the parameters (1 - 1/(1+s) = s/(s+1))."""
    cfg = TIMM_CASES[name]
    model = _model()
    ema = {k: p.detach().clone() for k, p in model.named_parameters()}   # deepcopy(model)
    history: list[dict] = []

    def record(params: dict, state: opttx.EmaParamsState) -> None:
        t = int(state.count)
        if t % every == 0:
            w = 1.0 - _timm_decay(t, **cfg)
            for k in ema:
                ema[k] = torch.lerp(ema[k], params[k], w)
        history.append({k: p.clone() for k, p in params.items()})
        for k in ema:
            assert torch.equal(state.ema[k], ema[k]), (k, t)

    tx = opttx.ema_params(opttx.sgd(0.05, momentum=0.9), cfg["decay"],
                          update_after_step=cfg["update_after_step"], warmup=cfg["use_warmup"],
                          warmup_gamma=cfg["warmup_gamma"], warmup_power=cfg["warmup_power"],
                          min_decay=cfg["min_decay"], every=every)
    _functional_run(tx, 10, model, record)
    if name == "running_mean" and every == 1:
        mean = {k: torch.stack([h[k] for h in history]).mean(0) for k in ema}
        for k in ema:
            torch.testing.assert_close(ema[k], mean[k], rtol=1e-13, atol=1e-14)


def test_decay_is_timms_get_decay() -> None:
    """`opttx.ema_decay` at steps 1..300 equals the written-out ``get_decay`` bit for bit."""
    for cfg in TIMM_CASES.values():
        for t in (1, 2, 3, 4, 7, 50, 299):
            got = opttx.ema_decay(torch.tensor(t, dtype=torch.int32), cfg["decay"],
                                  update_after_step=cfg["update_after_step"],
                                  warmup=cfg["use_warmup"], warmup_gamma=cfg["warmup_gamma"],
                                  warmup_power=cfg["warmup_power"], min_decay=cfg["min_decay"])
            assert got.dtype == torch.float64
            assert float(got) == _timm_decay(t, **cfg), (cfg, t)


def test_a_decay_schedule_and_a_written_param_group_key() -> None:
    """``decay`` may be a schedule of the step (TensorFlow's min(d, (1+t)/(10+t))), and under
    `opttx.Optimizer` it is the group's ``"decay"`` key: writing 0 makes the next average the
    parameters."""
    schedule = lambda t: torch.clamp((1 + t.double()) / (10 + t.double()), max=0.99)
    model = _model()
    ema = {k: p.detach().clone() for k, p in model.named_parameters()}

    def record(params: dict, state: opttx.EmaParamsState) -> None:
        t = int(state.count)
        d = 0.0 if t == 1 else min(0.99, (1 + t) / (10 + t))
        for k in ema:
            ema[k] = torch.lerp(ema[k], params[k], 1 - d)
            torch.testing.assert_close(state.ema[k], ema[k], rtol=1e-15, atol=0)

    _functional_run(opttx.ema_params(opttx.sgd(0.05), schedule), 5, model, record)

    opt = opttx.Optimizer(model.parameters(), opttx.ema_params(opttx.adam(1e-2), 0.9))
    for i, (x, y) in enumerate(_batches(3)):
        if i == 2:
            opt.param_groups[0]["decay"] = 0.0
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
    found = opttx.transforms.weight_ema.find_ema_params_states(opt.tx_states[0])[0]
    for (k, p), e in zip(model.named_parameters(), opttx.tree.tree_leaves(found.ema)):
        assert torch.equal(p.detach(), e), k


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------


def test_swap_ema_puts_the_average_in_and_restores_the_training_values_bitwise() -> None:
    """Around an Optimizer and around a (state, module) pair: inside, the parameters hold the
    average (cast to their dtype); after, also after an exception, exactly what they held."""
    model = _model().float()
    opt = opttx.Optimizer(model.parameters(), opttx.ema_params(opttx.adam(0.1), 0.5,
                                                               state_dtype=torch.float64))
    for x, y in _batches(3):
        opt.zero_grad()
        (model(x.float()) - y.float()).square().mean().backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    ema = opttx.transforms.weight_ema.find_ema_params_states(opt.tx_states[0])[0].ema
    with pytest.raises(RuntimeError, match="inside"):
        with opttx.swap_ema(opt):
            for p, e, b in zip(model.parameters(), opttx.tree.tree_leaves(ema), before):
                assert torch.equal(p.detach(), e.float())
                assert not torch.equal(p.detach(), b)
            raise RuntimeError("inside")
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)

    # the functional state with the module it was built on
    model = _model()
    tx = opttx.ema_params(opttx.sgd(0.1), 0.8)
    params, state = _functional_run(tx, 3, model)
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])
    want = opttx.ema_eval_params(state, params)
    assert all(torch.equal(want[k], state.ema[k]) for k in params)
    with opttx.swap_ema(state, model):
        for k, p in model.named_parameters():
            assert torch.equal(p.detach(), want[k])
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), params[k])

    with pytest.raises(ValueError, match="no param group"):
        with opttx.swap_ema(opttx.Optimizer(model.parameters(), opttx.adam(0.1))):
            pass
    with pytest.raises(ValueError, match="shape"):
        opttx.ema_eval_params(state, {k: p[..., :1] for k, p in params.items()})


def test_bfloat16_params_keep_a_float32_average() -> None:
    """Rule 3: a bfloat16 parameter's average is float32, the lerp of the bfloat16 parameters
    written (theta_{t-1} + u_t rounded to bfloat16, as apply_updates writes it)."""
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(4, 3, generator=gen).bfloat16()}
    tx = opttx.ema_params(opttx.sgd(0.1), 0.75)
    state = tx.init(params)
    ema = params["w"].float()
    for t in range(1, 4):
        grads = {"w": torch.randn(4, 3, generator=gen).bfloat16()}
        updates, state = tx.update(grads, state, params)
        params = opttx.apply_updates(params, updates)
        ema = torch.lerp(ema, params["w"].float(), 1.0 if t == 1 else 0.25)
        assert state.ema["w"].dtype == torch.float32
        assert torch.equal(state.ema["w"], ema)


def test_arguments_are_checked() -> None:
    inner = opttx.sgd(0.1)
    for kwargs, match in [({"decay": 1.5}, "decay"), ({"every": 0}, "every"),
                          ({"update_after_step": -1}, "update_after_step"),
                          ({"warmup_gamma": 0.0}, "warmup_gamma"),
                          ({"min_decay": -0.1}, "min_decay")]:
        with pytest.raises(ValueError, match=match):
            opttx.ema_params(inner, **kwargs)
    with pytest.raises(TypeError, match="GradientTransformation"):
        opttx.ema_params(lambda: None)
    with pytest.raises(ValueError, match="params"):
        tx = opttx.ema_params(inner)
        tx.update({"w": torch.ones(2)}, tx.init({"w": torch.ones(2)}))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_offload_keeps_a_pinned_host_average_equal_to_the_device_one() -> None:
    params = {"w": torch.randn(64, 32, device="cuda"), "b": torch.randn(32, device="cuda")}
    on_device = opttx.ema_params(opttx.adamw(1e-2), 0.9)
    on_host = opttx.ema_params(opttx.adamw(1e-2), 0.9, offload=True)
    s1, s2 = on_device.init(params), on_host.init(params)
    assert all(e.device.type == "cpu" and e.is_pinned() for e in s2.ema.values())
    p1 = p2 = params
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        g = {k: torch.randn(v.shape, device="cuda", generator=gen) for k, v in params.items()}
        with opttx.donating():
            u1, s1 = on_device.update(g, s1, p1)
            u2, s2 = on_host.update(g, s2, p2)
        p1, p2 = opttx.apply_updates(p1, u1), opttx.apply_updates(p2, u2)
    assert all(e.is_pinned() for e in s2.ema.values())
    for k in params:
        torch.testing.assert_close(s2.ema[k], s1.ema[k].cpu(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# checkpoints and distribution
# ---------------------------------------------------------------------------------------------


def _tree_params() -> dict:
    gen = torch.Generator().manual_seed(5)
    return {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen),
            "t": torch.randn(2, 3, 4, generator=gen)}


def _tree_grads(params: dict, step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    return tree_map(lambda p: torch.randn(p.shape, generator=gen), params)


def _train(tx, params, state, start: int, stop: int):
    for step in range(start, stop):
        updates, state = tx.update(_tree_grads(params, step), state, params)
        params = opttx.apply_updates(params, updates)
    return params, state


def _ema_tx() -> opttx.GradientTransformation:
    return opttx.ema_params(opttx.adamw(1e-2, weight_decay=0.1), 0.9, warmup=True,
                            update_after_step=1, every=2)


def test_dcp_round_trip_resumes_the_average_bitwise(tmp_path: Path) -> None:
    """Saved with ``torch.distributed.checkpoint`` through `opttx.distributed.state_dict`
    after 3 steps, loaded with `opttx.distributed.load_checkpoint` into a fresh state, and 4
    more steps: the average (and the parameters) equal the uninterrupted run bit for bit;
    the average is under its own key, ``<param>.ema``."""
    from opttx.distributed import load_checkpoint, load_state_dict, state_dict
    tx = _ema_tx()
    start = _tree_params()
    want_params, want = _train(tx, start, tx.init(start), 0, 7)

    params, state = _train(tx, start, tx.init(start), 0, 3)
    sd = state_dict(state, params)
    assert set(sd["state"]["w"]) >= {"ema"} and "count" in sd["shared"]
    dcp.save({"params": params, "optim": sd}, checkpoint_id=str(tmp_path / "ckpt"))

    params = tree_map(torch.zeros_like, start)
    state = tx.init(params)
    live = {"params": params, "optim": state_dict(state, params)}
    load_checkpoint(live, checkpoint_id=str(tmp_path / "ckpt"))
    state = load_state_dict(state, live["optim"], params)
    got_params, got = _train(tx, params, state, 3, 7)
    for k in start:
        assert torch.equal(got.ema[k], want.ema[k]), k
        assert torch.equal(got_params[k], want_params[k]), k
    assert int(got.count) == 7


def _distributed_worker(rank: int, world: int, root: str) -> dict[str, str]:
    """On 2 ranks: the average of ``sharded`` (dim 0 and dim 1 shards, a replicated leaf) is
    this rank's piece of the single-device average (and `swap_ema` puts it into the shards),
    that of ``zero`` the owned leaves' (and `opttx.distributed.ema_eval_params` gives every
    rank all of it); a DCP checkpoint of the sharded state (DTensors) reloads into a
    ``zero`` state."""
    from opttx.distributed import (Replicated, Shard, load_checkpoint, load_state_dict,
                                   local_shard, sharded, state_dict, zero)
    errors: dict[str, str] = {}
    specs = {"w": Shard(0), "b": Replicated(), "t": Shard(1)}
    start = _tree_params()
    _, want = _train(_ema_tx(), start, _ema_tx().init(start), 0, 5)

    tx = sharded(_ema_tx(), specs)
    local = {k: local_shard(v, specs[k]) for k, v in start.items()}
    state = tx.init(local)
    for step in range(5):
        g = {k: local_shard(v, specs[k]) for k, v in _tree_grads(start, step).items()}
        # the gradient stream of the single-device run (from the full parameters' shapes)
        updates, state = tx.update(g, state, local)
        local = opttx.apply_updates(local, updates)
    ema_state = opttx.transforms.weight_ema.find_ema_params_states(state)[0]
    for k in start:
        if not torch.equal(ema_state.ema[k], local_shard(want.ema[k], specs[k])):
            errors[f"sharded/{k}"] = "the average differs from the single-device one"
    dcp.save({"optim": state_dict(state, local, specs=specs)}, checkpoint_id=root)

    ztx = zero(_ema_tx())
    params = start
    zstate = ztx.init(params)
    params, zstate = _train(ztx, params, zstate, 0, 5)
    zema = opttx.transforms.weight_ema.find_ema_params_states(zstate)[0]
    owned = [k for k, v in zema.ema.items() if isinstance(v, torch.Tensor)]
    if not owned:
        errors["zero/owned"] = "this rank owns no leaf"
    for k in owned:
        if not torch.equal(zema.ema[k], want.ema[k]):
            errors[f"zero/{k}"] = "the average differs from the single-device one"

    # every leaf's average on every rank, from its owner
    gathered = opttx.distributed.ema_eval_params(zstate, params)
    for k in start:
        if not torch.equal(gathered[k], want.ema[k]):
            errors[f"zero/gathered/{k}"] = "the average sent by its owner differs"
    # swapped into this rank's shards under sharded
    with opttx.swap_ema(state, local):
        for k in start:
            if not torch.equal(local[k], local_shard(want.ema[k], specs[k])):
                errors[f"sharded/swapped/{k}"] = "the swapped-in shard differs"

    # the sharded checkpoint (DTensors) into a fresh zero state: whole leaves per owner
    fresh = ztx.init(start)
    live = {"optim": state_dict(fresh, start)}
    load_checkpoint(live, checkpoint_id=root)
    fresh = load_state_dict(fresh, live["optim"], start)
    loaded = opttx.transforms.weight_ema.find_ema_params_states(fresh)[0]
    for k in owned:
        if not torch.equal(loaded.ema[k], want.ema[k]):
            errors[f"resharded/{k}"] = "the reloaded average differs"
    return errors


@pytest.mark.timeout(300)
def test_the_average_is_exact_under_sharded_and_zero_and_reshards(tmp_path: Path) -> None:
    results = spawn_ranks(_distributed_worker, world_size=2, args=(str(tmp_path / "dcp"),),
                          timeout=240)
    for rank, errors in enumerate(results):
        assert not errors, f"rank {rank}: {errors}"


def test_ema_params_docstring_math_matches_a_closed_form() -> None:
    """With a constant update u and d_t = d after the copy at t = 1, the average is
    theta_t - u d (1 - d^{t-1}) / (1 - d) (a geometric sum): checked in float64 at t = 6."""
    d, u, steps = 0.7, 0.125, 6
    params = {"w": torch.zeros(3, dtype=torch.float64)}
    tx = opttx.ema_params(opttx.stateless(lambda g, p: g), d)
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update({"w": torch.full((3,), u, dtype=torch.float64)}, state,
                                   params)
        params = opttx.apply_updates(params, updates)
    want = steps * u - u * d * (1 - d ** (steps - 1)) / (1 - d)
    torch.testing.assert_close(state.ema["w"], torch.full((3,), want, dtype=torch.float64),
                               rtol=1e-14, atol=0)
    assert math.isclose(float(params["w"][0]), steps * u)
