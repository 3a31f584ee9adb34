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
    with pytest.raises(ValueError, match="does not match"):
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
    assert set(opt.tx_states[0][0].mu) == {n for n, _ in decay}     # a dict keyed by name
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
    pointers = [t.data_ptr() for t in opttx.tree.tree_leaves(opt.tx_states[0][0].mu)]
    train(model, opt, data(2))
    assert pointers == [t.data_ptr() for t in opttx.tree.tree_leaves(opt.tx_states[0][0].mu)]


def test_bf16_parameters_keep_fp32_statistics() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))
    opt = opttx.Optimizer([p], opttx.adamw(1e-2))
    p.grad = torch.randn(4, 4).to(torch.bfloat16)
    opt.step()
    adam_state = opt.tx_states[0][0]
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
