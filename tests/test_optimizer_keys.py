"""`opttx.Optimizer`'s param-group keys: each key names a fixed set of hyperparameters (torch's
role keys, and each hyperparameter's own key), a write reaches only those, the group shows
the live values, and ``load_state_dict(state_dict())`` is the identity (a resumed run equals
the uninterrupted one bit for bit), for every registry entry and for user chains."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import opttx
from opttx import conformance
from opttx.wrappers import find_injected_states

from registry import CASES, Case


def live(opt: opttx.Optimizer, slot: int = 0) -> list[dict[str, float]]:
    """The injected hyperparameters of a group's state, per injected transform."""
    return [{k: float(v) for k, v in s.hyperparams.items()}
            for s in find_injected_states(opt.tx_states[slot])]


def hyper_keys(opt: opttx.Optimizer, slot: int = 0) -> dict:
    return {k: v for k, v in opt.param_groups[slot].items()
            if k not in ("params", "param_names", "tx", "transform")}


def matrix_and_vector(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=gen)),
            torch.nn.Parameter(torch.randn(5, generator=gen))]


def grads_for(params: list, n: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(n)]


def train(opt, params, grads, sched=None) -> None:
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()


def saved_and_loaded(obj: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_two_links_with_one_name_keep_their_own_values_through_a_round_trip() -> None:
    """``chain(scale_by_rms(0.99), trace(decay=0.0), ...)``: both links call their
    hyperparameter ``decay``; the group shows them as ``alpha`` and ``momentum`` and no
    ``decay`` key names both. One step and ``load_state_dict(state_dict())``: trace's decay
    stayed 0.0 (it became 0.99 when a ``decay`` key wrote both)."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = opttx.Optimizer([p], opttx.chain(opttx.scale_by_rms(0.99), opttx.trace(decay=0.0),
                                           opttx.scale_by_learning_rate(1e-2)))
    group = opt.param_groups[0]
    assert group["alpha"] == 0.99 and group["momentum"] == 0.0 and "decay" not in group
    train(opt, [p], grads_for([p], 1))
    before = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(opt.state_dict())
    assert [h["decay"] for h in live(opt)[:2]] == [pytest.approx(0.99), 0.0]
    conformance._same_state_dict(opt.state_dict(), before, "round trip")
    group["momentum"] = 0.5                   # writes trace's decay, and only it
    assert [h["decay"] for h in live(opt)[:2]] == [pytest.approx(0.99), 0.5]
    with pytest.raises(ValueError, match=r"'decay': several .* \['alpha', 'momentum'\]"):
        group["decay"] = 0.9
    assert [h["decay"] for h in live(opt)[:2]] == [pytest.approx(0.99), 0.5]
    with pytest.raises(ValueError, match=r"'decay': several .* \['alpha', 'momentum'\]"):
        opttx.Optimizer([{"params": [p], "decay": 0.9}], opttx.chain(
            opttx.scale_by_rms(0.99), opttx.trace(decay=0.0), opttx.scale_by_learning_rate(1.)))
    older = copy.deepcopy(before)           # saved when "decay" named both: it loads
    older["param_groups"][0]["decay"] = 0.99
    opt.load_state_dict(older)
    assert [h["decay"] for h in live(opt)[:2]] == [pytest.approx(0.99), 0.0]
    assert "decay" not in opt.param_groups[0]


def test_repeated_names_get_their_field_paths_as_keys() -> None:
    """Two ``clip_by_global_norm`` links: each ``max_norm`` has its own key, its field path
    in the state (as the state dict names it less ``shared.``); no bare ``max_norm`` key,
    and a write moves one link only."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = opttx.Optimizer([p], opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adam(1e-2),
                                           opttx.clip_by_global_norm(2.0)))
    group = opt.param_groups[0]
    assert "max_norm" not in group
    assert group["0.hyperparams.max_norm"] == 1.0 and group["2.hyperparams.max_norm"] == 2.0
    shared = {k for k in opt.state_dict()["state"][0] if k.endswith("max_norm")}
    assert shared == {"shared.0.hyperparams.max_norm", "shared.2.hyperparams.max_norm"}
    group["2.hyperparams.max_norm"] = 3.0
    assert live(opt)[0]["max_norm"] == 1.0 and live(opt)[2]["max_norm"] == 3.0
    assert group["0.hyperparams.max_norm"] == 1.0


def resume_and_compare(build, saved: dict, grads: list, params: list, opt, *,
                       optimizer_first: bool) -> None:
    """A fresh optimizer and scheduler from ``build``, given the saved state dicts (the
    optimizer's first, as HF's Trainer, or the scheduler's), trained on ``grads``: its
    parameters equal ``params`` (the uninterrupted run) bitwise and its state dict equals
    ``opt``'s."""
    again = [torch.nn.Parameter(p) for p in saved["params"]]
    resumed, resumed_sched = build(again)
    if optimizer_first:
        resumed.load_state_dict(saved["opt"])
        resumed_sched.load_state_dict(saved["sched"])
    else:
        resumed_sched.load_state_dict(saved["sched"])
        resumed.load_state_dict(saved["opt"])
    train(resumed, again, grads, resumed_sched)
    for a, b in zip(params, again):
        assert torch.equal(a, b)
    conformance._same_state_dict(resumed.state_dict(), opt.state_dict(), "resumed")


def test_several_learning_rates_show_live_values_and_resume_bitwise() -> None:
    """muon with ``adam_learning_rate``: a scheduler scales both learning rates; the group
    shows the live ``adam_learning_rate`` (it showed its construction value, and the state
    dict saved and restored that stale number: a resumed run 1.08e-4 off). Resumed from a
    state dict mid-run (torch.save, weights_only), the run equals the uninterrupted one."""
    def build(params):
        opt = opttx.Optimizer(params, opttx.muon(1e-2, adam_learning_rate=3e-4))
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    params = matrix_and_vector()
    opt, sched = build(params)
    grads = grads_for(params, 6)
    train(opt, params, grads[:3], sched)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(1e-2 / 8)
    assert group["adam_learning_rate"] == pytest.approx(3e-4 / 8)
    assert live(opt)[0]["adam_learning_rate"] == pytest.approx(3e-4 / 8)
    saved = saved_and_loaded({"opt": opt.state_dict(), "sched": sched.state_dict(),
                              "params": [p.detach().clone() for p in params]})
    assert saved["opt"]["param_groups"][0]["adam_learning_rate"] == pytest.approx(3e-4 / 8)
    train(opt, params, grads[3:], sched)

    resume_and_compare(build, saved, grads[3:], params, opt, optimizer_first=False)


def test_own_learning_rate_sets_its_ratio_and_ratios_survive_a_zero_lr() -> None:
    """Writing ``adam_learning_rate`` by hand sets it alone and makes its ratio to ``lr``
    the one it now has; a warm-up from lr 0 (HF's linear schedule starts there) keeps the
    ratios, and a state dict saved at lr 0 restores them (``lr_ratios``)."""
    params = matrix_and_vector()
    opt = opttx.Optimizer(params, opttx.muon(1e-2, adam_learning_rate=1e-3))
    group = opt.param_groups[0]
    assert group["lr_ratios"] == {"adam_learning_rate": pytest.approx(0.1)}
    group["adam_learning_rate"] = 5e-3
    assert live(opt)[0]["learning_rate"] == pytest.approx(1e-2)
    assert group["lr_ratios"] == {"adam_learning_rate": pytest.approx(0.5)}
    group["lr"] = 0.0
    assert group["adam_learning_rate"] == 0.0 and live(opt)[0]["adam_learning_rate"] == 0.0
    saved = saved_and_loaded(opt.state_dict())
    other = opttx.Optimizer(matrix_and_vector(), opttx.muon(1e-2, adam_learning_rate=1e-3))
    other.load_state_dict(saved)
    other.param_groups[0]["lr"] = 2e-2
    assert live(other)[0]["adam_learning_rate"] == pytest.approx(1e-2)
    assert other.param_groups[0]["adam_learning_rate"] == pytest.approx(1e-2)
    with pytest.raises(ValueError, match="lr_ratios"):
        group["lr_ratios"] = {"learning_rate": 1.0}


def test_betas_of_several_links_show_in_each_links_own_keys() -> None:
    """adamuon: ``betas`` names both links' betas (OneCycleLR cycles them together); after it
    is written, ``adam_b1``/``adam_b2`` show the new numbers (they kept the old ones). An
    own key moves its link only."""
    params = matrix_and_vector()
    opt = opttx.Optimizer(params, opttx.adamuon(1e-2))
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and (group["adam_b1"], group["adam_b2"]) == (0.9, 0.999)
    group["betas"] = (0.8, 0.9)
    assert (group["b1"], group["b2"], group["adam_b1"], group["adam_b2"]) == (0.8, 0.9, 0.8, 0.9)
    h = live(opt)[0]
    assert (h["b1"], h["adam_b1"], h["b2"], h["adam_b2"]) == pytest.approx((0.8, 0.8, 0.9, 0.9))
    group["adam_b1"] = 0.7
    assert group["b1"] == 0.8 and group["betas"] == (0.8, 0.9)
    assert live(opt)[0]["b1"] == pytest.approx(0.8) and live(opt)[0]["adam_b1"] == pytest.approx(0.7)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
    train(opt, params, grads_for(params, 3), sched)
    assert group["b1"] == group["adam_b1"] == group["betas"][0]
    assert live(opt)[0]["adam_b1"] == pytest.approx(group["betas"][0])


def test_a_schedule_as_learning_rate_reloads_and_shows_its_value() -> None:
    """``adam(linear_schedule(...))``: the group shows the value its state holds (the last
    step's), ``load_state_dict(state_dict())`` loads (it raised "follows the schedule"), a
    resumed run equals the uninterrupted one, and writing ``lr`` by hand is still refused."""
    def build(params):
        return opttx.Optimizer(params, opttx.adam(opttx.linear_schedule(1e-3, 0.0, 10)))

    params = matrix_and_vector()
    opt = build(params)
    grads = grads_for(params, 6)
    train(opt, params, grads[:3])
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.8)   # step 3 used count 2
    opt.load_state_dict(opt.state_dict())
    saved = saved_and_loaded({"opt": opt.state_dict(),
                              "params": [p.detach().clone() for p in params]})
    train(opt, params, grads[3:])
    again = [torch.nn.Parameter(p) for p in saved["params"]]
    resumed = build(again)
    resumed.load_state_dict(saved["opt"])
    train(resumed, again, grads[3:])
    for a, b in zip(params, again):
        assert torch.equal(a, b)
    assert resumed.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    with pytest.raises(ValueError, match="follows the schedule"):
        resumed.param_groups[0]["lr"] = 1e-4


def test_partition_learning_rates_each_have_a_key() -> None:
    """A partition of adamw and sgd: ``lr`` is adamw's and moves sgd's at its ratio; sgd's
    learning rate, named like adamw's, has its field path as its key."""
    model = {"w": torch.nn.Parameter(torch.randn(3, 3)), "b": torch.nn.Parameter(torch.randn(3))}
    tx = opttx.partition({"a": opttx.adamw(1e-3), "s": opttx.sgd(1e-2, momentum=0.9)},
                         lambda t: {"w": "a", "b": "s"})
    opt = opttx.Optimizer(list(model.items()), tx)
    group = opt.param_groups[0]
    key = "inner_states.s.inner_state.hyperparams.learning_rate"
    assert group["lr"] == 1e-3 and group[key] == 1e-2
    assert group["lr_ratios"] == {key: pytest.approx(10.0)}
    group["lr"] = 2e-3
    assert group[key] == pytest.approx(2e-2)
    assert [h.get("learning_rate") for h in live(opt)] == pytest.approx([2e-3, 2e-2])
    group[key] = 1e-2
    assert live(opt)[0]["learning_rate"] == pytest.approx(2e-3) and group["lr"] == 2e-3


def test_opttx_names_in_groups_write_through_their_key() -> None:
    """``decay`` (rmsprop's name for torch's ``alpha``) given in a param group: applied, and
    shown as ``alpha`` only; a state dict with ``decay`` loads the same way."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = opttx.Optimizer([{"params": [p], "decay": 0.5}], opttx.rmsprop, lr=1e-2)
    assert opt.param_groups[0]["alpha"] == 0.5 and "decay" not in opt.param_groups[0]
    assert live(opt)[0]["decay"] == 0.5
    saved = opt.state_dict()
    saved["param_groups"][0]["decay"] = saved["param_groups"][0].pop("alpha") * 1.5
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["alpha"] == 0.75 and live(opt)[0]["decay"] == 0.75


def test_user_chain_resumes_after_scheduler_history() -> None:
    """A user's chain with two learning rates (a scaled link and adamw) and a repeated name,
    a LambdaLR history, every other key written by hand: the conformance property holds."""
    conformance.check_optimizer_resume(
        lambda: opttx.chain(opttx.clip_by_global_norm(1.0), opttx.adamw(1e-2),
                            opttx.clip_by_global_norm(0.5), opttx.scale_by_learning_rate(0.1)),
        name="user chain")



@pytest.mark.parametrize("factory", ["adamuon", "normuon"])
def test_hf_style_resume_of_several_learning_rates_is_bitwise(factory: str) -> None:
    """As HF's Trainer resumes: the optimizer and its ``get_scheduler("linear")`` (a warm-up
    from lr 0, so the fresh optimizer starts at lr 0) are built, then the optimizer's and
    the scheduler's state dicts (``torch.save``, ``weights_only``) are loaded. Both learning
    rates and the betas of both links follow as in the uninterrupted run, bit for bit
    (adamuon was 1.99e-4 off)."""
    transformers = pytest.importorskip("transformers")

    def build(params):
        opt = opttx.Optimizer(params, getattr(opttx, factory)(1e-2, adam_learning_rate=3e-3))
        return opt, transformers.get_scheduler("linear", opt, num_warmup_steps=2,
                                               num_training_steps=8)

    params = matrix_and_vector()
    opt, sched = build(params)
    grads = grads_for(params, 7)
    train(opt, params, grads[:4], sched)
    saved = saved_and_loaded({"opt": opt.state_dict(), "sched": sched.state_dict(),
                              "params": [p.detach().clone() for p in params]})
    train(opt, params, grads[4:], sched)
    assert build(matrix_and_vector())[0].param_groups[0]["lr"] == 0.0   # warm-up's start
    resume_and_compare(build, saved, grads[4:], params, opt, optimizer_first=True)
    assert opt.param_groups[0]["adam_learning_rate"] == pytest.approx(
        live(opt)[0]["adam_learning_rate"])


def cases_for(prop: str) -> list:
    out = []
    for c in CASES:
        reasons = [why for p, why in c.known_bugs if p == prop]
        marks = [pytest.mark.xfail(strict=True, reason=reasons[0])] if reasons else []
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


@pytest.mark.parametrize("case", cases_for("optimizer_resume"))
def test_every_entry_resumes_through_the_optimizer_bitwise(case: Case) -> None:
    """`opttx.conformance.check_optimizer_resume` over the registry: a state dict saved after
    a scheduler history and hand-written keys loads into a fresh Optimizer as the identity,
    and the resumed run equals the uninterrupted one bit for bit."""
    params = conformance.standard_params(matrices_only=case.matrices_only)
    if case.name == "stacked":      # its leaves are stacks: two matrices and two vectors
        params = opttx.StackedParams({"w": params["w"], "v": params["v"]}).buffers
    conformance.check_optimizer_resume(case.make, params, steps=2, after=1,
                                       name=case.name)


def test_a_copied_optimizer_keeps_its_keys_and_schedules() -> None:
    """A deep copy shows a scheduled learning rate from its own state and moves its other
    learning rates at the ratios it had."""
    params = matrix_and_vector()
    opt = opttx.Optimizer(params, opttx.chain(opttx.adam(opttx.linear_schedule(1e-3, 0.0, 4)),
                                              opttx.clip_by_global_norm(1.0)))
    train(opt, params, grads_for(params, 2))
    twin = copy.deepcopy(opt)
    twin_params = twin.param_groups[0]["params"]
    train(twin, twin_params, grads_for(params, 1, seed=3))
    assert twin.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.75)
    muon = opttx.Optimizer(matrix_and_vector(), opttx.muon(1e-2, adam_learning_rate=1e-3))
    muon.param_groups[0]["adam_learning_rate"] = 4e-3
    copied = copy.deepcopy(muon)
    copied.param_groups[0]["lr"] = 2e-2
    assert copied.param_groups[0]["adam_learning_rate"] == pytest.approx(8e-3)
    assert live(copied)[0]["adam_learning_rate"] == pytest.approx(8e-3)
    assert live(muon)[0]["adam_learning_rate"] == pytest.approx(4e-3)


KEYED = {
    "muon": lambda: opttx.muon(1e-2, adam_learning_rate=3e-3, weight_decay=0.1),
    "adamuon": lambda: opttx.adamuon(1e-2, weight_decay=0.01),
    "normuon": lambda: opttx.normuon(1e-2),
    "partition": lambda: opttx.partition(
        {"m": opttx.adamw(1e-3, weight_decay=0.1), "v": opttx.sgd(1e-2, momentum=0.9)},
        lambda t: ["m", "v"]),
    "rms_trace": lambda: opttx.chain(opttx.scale_by_rms(0.99), opttx.trace(decay=0.5),
                                     opttx.clip_by_global_norm(1.0), opttx.adamw(1e-2),
                                     opttx.clip_by_global_norm(2.0)),
}


def rescaled(key: str, value, factor: float):
    """``value * factor`` per component; to 0 and from 0 (to 0.25) for ``lr`` only: some
    transforms take another hyperparameter's 0 for another state (trace's ``dampening``)."""
    if isinstance(value, tuple):
        return tuple(rescaled(key, v, factor) for v in value)
    if key == "lr":
        return value * factor if value else 0.25
    return value * (factor or 0.5)


@settings(max_examples=12)
@given(name=st.sampled_from(sorted(KEYED)), save_at=st.integers(0, 3),
       writes=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30),
                                 st.sampled_from([0.0, 0.5, 0.9375])),
                       max_size=6))
def test_any_write_history_resumes_bitwise(name: str, save_at: int, writes: list) -> None:
    """Any history of key writes (``lr`` to 0 and back included, own keys, role keys), a
    state dict saved after any step: the resumed run equals the uninterrupted one bit for
    bit, and after every write each key shows what its first hyperparameter holds."""
    def build(params):
        return opttx.Optimizer(params, KEYED[name]())

    params = matrix_and_vector()
    opt = build(params)
    keys = sorted(opt._keys[0].places)
    grads = grads_for(params, 5)
    saved = None
    for step, g in enumerate(grads):
        for at, which, factor in writes:
            if at == step:
                key = keys[which % len(keys)]
                opt.param_groups[0][key] = rescaled(key, opt.param_groups[0][key], factor)
        for key, comps in opt._keys[0].places.items():
            places = opttx.optim.optimizer._places(opt.tx_states[0])
            shown = opt.param_groups[0][key]
            shown = shown if isinstance(shown, tuple) else (shown,)
            for c, value in zip(comps, shown):       # exactly, in the state's dtype
                held = places[c[0]].hyperparams[places[c[0]].name]
                assert torch.equal(held, torch.tensor(value, dtype=held.dtype)), key
        train(opt, params, [g])
        if step == save_at:
            saved = saved_and_loaded({"opt": opt.state_dict(),
                                      "params": [p.detach().clone() for p in params],
                                      "step": step})
    again = [torch.nn.Parameter(p) for p in saved["params"]]
    resumed = build(again)
    resumed.load_state_dict(saved["opt"])
    conformance._same_state_dict(resumed.state_dict(), saved["opt"], "loaded")
    for step in range(saved["step"] + 1, len(grads)):
        for at, which, factor in writes:
            if at == step:
                key = keys[which % len(keys)]
                resumed.param_groups[0][key] = rescaled(key, resumed.param_groups[0][key],
                                                        factor)
        train(resumed, again, [grads[step]])
    for a, b in zip(params, again):
        assert torch.equal(a, b)
    conformance._same_state_dict(resumed.state_dict(), opt.state_dict(), "resumed")
