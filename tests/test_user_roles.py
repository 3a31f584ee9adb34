"""A user's transform, written without knowing opttx's field names, works wherever opttx reads
state roles: an Adam whose state is ``MyAdamState(step, exp_avg, exp_avg_sq)`` with declared
roles gets the unsigned 8-bit map for its second moment under `quantize_state`, is rotated
like opttx's own Adam under `project_lowrank(reproject_moments=True)`, equals one device under
`zero` and `on_owners`, and its checkpoint saved under `zero` at world 2 loads on one device;
the same class without ``__roles__`` is refused with a clear error where roles are read (and
still works where they are not)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import opttx
from opttx.base import Role, declare_roles
from opttx.testing import assert_trees_close, gradient_stream, run_transform
from opttx.transforms.quantized import (QuantizedTensor, dequantize_blockwise, dynamic_map,
                                        quantization_map, quantize_blockwise)
from opttx.tree import tree_map

SIGNED, UNSIGNED = quantization_map(dynamic_map(True)), quantization_map(dynamic_map(False))


class MyAdamState(NamedTuple):
    step: torch.Tensor   # shape (), int32: steps taken
    exp_avg: object      # like params: EMA of the gradients
    exp_avg_sq: object   # like params: EMA of the squared gradients
    __roles__ = declare_roles(step=Role.COUNT, exp_avg=Role.FIRST_MOMENT,
                              exp_avg_sq=Role.SECOND_MOMENT)


class MyBareAdamState(NamedTuple):
    """The same state, declaring nothing."""
    step: torch.Tensor
    exp_avg: object
    exp_avg_sq: object


def my_adam(state_type: type = MyAdamState, b1: float = 0.9, b2: float = 0.999,
            eps: float = 1e-8) -> opttx.GradientTransformation:
    """Adam as a user writes it: plain tensor ops leaf by leaf, no opttx helpers."""
    def init(params):
        zeros = tree_map(torch.zeros_like, params)
        return state_type(torch.zeros((), dtype=torch.int32), zeros,
                          tree_map(torch.zeros_like, params))

    def update(updates, state, params=None, **extra_args):
        t = state.step + 1
        exp_avg = tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.exp_avg, updates)
        exp_avg_sq = tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.exp_avg_sq, updates)
        c1, c2 = 1 - b1 ** t.to(torch.float32), 1 - b2 ** t.to(torch.float32)
        out = tree_map(lambda m, v: (m / c1) / (torch.sqrt(v / c2) + eps), exp_avg, exp_avg_sq)
        return out, state_type(t, exp_avg, exp_avg_sq)

    return opttx.GradientTransformation(init, update, opttx.base.ELEMENTWISE)


def lr(tx: opttx.GradientTransformation) -> opttx.GradientTransformation:
    return opttx.chain(tx, opttx.scale(-1e-2))


def tree(seed: int = 0) -> dict[str, torch.Tensor]:
    """A leaf over quantize_state's min_size (4096), a ragged one under it, a vector."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(96, 64, generator=gen), "v": torch.randn(40, 30, generator=gen),
            "b": torch.randn(64, generator=gen)}


def test_my_adam_is_adam() -> None:
    """The premise of the comparisons below: fp32, my_adam is opttx's Adam (to rounding:
    opttx's folds the bias corrections into the denominator)."""
    params = tree()
    grads = gradient_stream(params, 5, seed=1)
    ours, state = run_transform(lr(my_adam()), params, grads)
    theirs, their_state = run_transform(lr(opttx.scale_by_adam()), params, grads)
    assert_trees_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert_trees_close(state[0].exp_avg, their_state[0].mu, rtol=1e-6, atol=1e-7)
    assert_trees_close(state[0].exp_avg_sq, their_state[0].nu, rtol=1e-6, atol=1e-9)
    assert torch.equal(state[0].step, their_state[0].count)


# ---------------------------------------------------------------------------------------------
# quantize_state
# ---------------------------------------------------------------------------------------------


def test_quantize_state_stores_exp_avg_sq_with_the_unsigned_map() -> None:
    """After one step from a zero state the 8-bit codes of the large leaf are exactly the
    block-wise quantization of the fp32 moments: exp_avg on the signed map, exp_avg_sq on the
    unsigned one (whose codes differ from the signed map's)."""
    params = tree()
    g = gradient_stream(params, 1, seed=2)[0]
    tx = opttx.quantize_state(my_adam())
    state = tx.update(g, tx.init(params), params)[1]
    leaf = state.quantized[0]
    assert len(state.quantized) == 1 and isinstance(leaf, MyAdamState)
    assert isinstance(leaf.exp_avg, QuantizedTensor)
    assert isinstance(leaf.exp_avg_sq, QuantizedTensor)
    fp32 = my_adam().update(g["w"], my_adam().init(params["w"]))[1]
    for got, exact, qmap in ((leaf.exp_avg, fp32.exp_avg, SIGNED),
                             (leaf.exp_avg_sq, fp32.exp_avg_sq, UNSIGNED)):
        expected = quantize_blockwise(exact, qmap)
        assert torch.equal(got.codes, expected.codes) and torch.equal(got.absmax,
                                                                      expected.absmax)
    assert not torch.equal(leaf.exp_avg_sq.codes,
                           quantize_blockwise(fp32.exp_avg_sq, SIGNED).codes)
    assert torch.equal(state.dense.step, torch.tensor(1, dtype=torch.int32))


def test_quantized_my_adam_is_close_to_fp32_and_to_quantized_opttx_adam() -> None:
    params = tree(3)
    grads = gradient_stream(params, 10, seed=4)
    ours, state = run_transform(lr(opttx.quantize_state(my_adam())), params, grads)
    fp32, _ = run_transform(lr(my_adam()), params, grads)
    theirs, their_state = run_transform(lr(opttx.quantize_state(opttx.scale_by_adam())),
                                        params, grads)
    assert_trees_close(ours, theirs, rtol=1e-6, atol=1e-6)
    mine, adam = state[0].quantized[0], their_state[0].quantized[0]
    assert torch.equal(mine.exp_avg_sq.codes, adam.nu.codes)
    assert torch.equal(mine.exp_avg.codes, adam.mu.codes)
    moved = (fp32["w"] - params["w"]).abs().max()
    assert (ours["w"] - fp32["w"]).abs().max() <= 0.05 * moved     # 8-bit moments: close
    assert not torch.equal(ours["w"], fp32["w"])                     # but quantized
    assert_trees_close({k: ours[k] for k in ("v", "b")}, {k: fp32[k] for k in ("v", "b")},
                       rtol=0.0)                                     # small leaves stay fp32
    dequantized = dequantize_blockwise(mine.exp_avg_sq, UNSIGNED)
    assert (dequantized >= 0).all()


def test_quantize_state_refuses_a_state_without_roles() -> None:
    params = tree()
    with pytest.raises(TypeError, match=r"MyBareAdamState\.exp_avg .*declares no roles.*"
                                        r"__roles__ = opttx\.extend\.declare_roles"):
        opttx.quantize_state(my_adam(MyBareAdamState)).init(params)
    # where no leaf is quantized the roles are not needed
    grads = gradient_stream(params, 3, seed=5)
    bare = opttx.quantize_state(my_adam(MyBareAdamState), min_size=2**62)
    assert_trees_close(run_transform(bare, params, grads)[0],
                       run_transform(my_adam(), params, grads)[0], rtol=0.0)


# ---------------------------------------------------------------------------------------------
# project_lowrank
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "full"])
def test_reprojected_my_adam_equals_reprojected_opttx_adam(proj_type: str) -> None:
    """Refreshes every 2 steps over 7 steps: exp_avg rotates as mu, exp_avg_sq as nu."""
    params = {"w": torch.randn(12, 7, generator=torch.Generator().manual_seed(6)),
              "b": torch.randn(7, generator=torch.Generator().manual_seed(7))}
    grads = gradient_stream(params, 7, seed=8)
    kw = dict(rank=3, update_proj_gap=2, proj_type=proj_type, reproject_moments=True)
    ours, state = run_transform(lr(opttx.project_lowrank(my_adam(), **kw)), params, grads)
    theirs, their_state = run_transform(lr(opttx.project_lowrank(opttx.scale_by_adam(), **kw)),
                                        params, grads)
    assert_trees_close(ours, theirs, rtol=1e-6, atol=1e-6)
    mine, adam = state[0].inner_state, their_state[0].inner_state
    assert_trees_close(mine.exp_avg, adam.mu, rtol=1e-6, atol=1e-7)
    assert_trees_close(mine.exp_avg_sq, adam.nu, rtol=1e-6, atol=1e-9)
    assert (mine.exp_avg_sq["w"] >= 0).all()            # rotated as squares, not linearly
    off, _ = run_transform(lr(opttx.project_lowrank(my_adam(), **{**kw, "reproject_moments":
                                                                  False})), params, grads)
    assert not torch.allclose(off["w"], ours["w"])       # the rotation did something


def test_project_lowrank_refuses_a_state_without_roles_only_when_reprojecting() -> None:
    params = {"w": torch.randn(12, 7), "b": torch.randn(7)}
    with pytest.raises(TypeError, match=r"MyBareAdamState\.exp_avg .*declares no roles"):
        opttx.project_lowrank(my_adam(MyBareAdamState), rank=3,
                              reproject_moments=True).init(params)
    grads = gradient_stream(params, 4, seed=9)
    kw = dict(rank=3, update_proj_gap=2)
    assert_trees_close(
        run_transform(opttx.project_lowrank(my_adam(MyBareAdamState), **kw), params, grads)[0],
        run_transform(opttx.project_lowrank(my_adam(), **kw), params, grads)[0], rtol=0.0)


# ---------------------------------------------------------------------------------------------
# under zero and on_owners (2 gloo ranks), and a checkpoint saved at world 2 loaded on one
# device: the checkpoint keys and the owners' masks read the declared roles
# ---------------------------------------------------------------------------------------------


def _distributed(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from opttx.distributed import Replicated, Shard, local_shard, sharded, state_dict, zero
    params = tree()
    grads = gradient_stream(params, 6, seed=3)
    expected, _ = run_transform(lr(my_adam()), params, grads[:3])
    tx = zero(lr(my_adam()))
    got, state = run_transform(tx, params, grads[:3])
    zero_error = max(float((got[k] - expected[k]).abs().max()) for k in params)
    dcp.save({"optim": state_dict(state, got)}, checkpoint_id=path)
    specs = {k: Shard(0) if v.shape[0] > 1 else Replicated() for k, v in params.items()}
    local = {k: local_shard(v, specs[k]) for k, v in params.items()}
    local_grads = [{k: local_shard(v, specs[k]) for k, v in g.items()} for g in grads[:3]]
    owned, _ = run_transform(sharded(lr(my_adam()), specs, on_owners=True), local, local_grads)
    owners_error = max(float((owned[k] - local_shard(expected[k], specs[k])).abs().max())
                       for k in params)
    return {"zero": zero_error, "owners": owners_error}


@pytest.mark.timeout(300)
def test_my_adam_under_zero_and_on_owners_and_a_resharded_checkpoint(tmp_path) -> None:
    """Equal to one device under zero and on_owners at world 2; the state zero saved at
    world 2 loads into the one-device state (by the declared roles of exp_avg/exp_avg_sq)
    and training goes on bit-identically."""
    import torch.distributed.checkpoint as dcp

    from opttx.distributed import load_state_dict, state_dict
    from opttx.testing import spawn_ranks
    path = str(tmp_path / "ck")
    results = spawn_ranks(_distributed, world_size=2, args=(path,), timeout=240)
    for res in results:
        assert res["zero"] <= 1e-6 and res["owners"] <= 1e-6, res
    params = tree()
    grads = gradient_stream(params, 6, seed=3)
    tx = lr(my_adam())
    mid, mid_state = run_transform(tx, params, grads[:3])
    resumed = tx.init(params)
    sd = {"optim": state_dict(resumed, mid)}
    dcp.load(sd, checkpoint_id=path)
    resumed = load_state_dict(resumed, sd["optim"], mid)
    assert_trees_close(resumed, mid_state, rtol=1e-6, what="state loaded at world 1")
    params_b, state_b = mid, resumed
    for g in grads[3:]:
        u, state_b = tx.update(g, state_b, params_b)
        params_b = opttx.apply_updates(params_b, u)
    params_a, state_a = mid, mid_state
    for g in grads[3:]:
        u, state_a = tx.update(g, state_a, params_a)
        params_a = opttx.apply_updates(params_a, u)
    assert_trees_close(params_b, params_a, rtol=1e-6, what="resumed training")
