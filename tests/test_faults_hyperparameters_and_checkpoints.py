"""Bad input and faults on one process, beyond tests/test_faults.py: each case gives the right
numbers or a clear error naming what is wrong, never silently wrong numbers. Hyperparameters
given as 0-dim tensors, checkpoints (checksums, flipped bits, empty files), and also: masks
inside ``flatten``, bad gradients for Shampoo and SOAP, ``schedule_free_eval_params`` with other
params, dicts in another key order and swapped ``(updates, state)``, bounded shrinking of the
distributed hypothesis strategies, rejoining the process group after a restart, and what Lion
and Muon do with a non-finite gradient element. The multi-process cases are in
tests/test_faults_overlap_and_consistency_distributed.py; the table of outcomes is
docs/guide/faults.md.
"""

from __future__ import annotations

import math

import pytest
import torch

import opttx

# ---------------------------------------------------------------------------------------------
# hyperparameters given as 0-dim tensors are checked like numbers
# ---------------------------------------------------------------------------------------------

TENSOR_LR_FACTORIES = {
    "adam": lambda lr: opttx.adam(lr),
    "sgd": lambda lr: opttx.sgd(lr, momentum=0.9),
    "lion": lambda lr: opttx.lion(lr),
    "muon": lambda lr: opttx.muon(lr),
    "injected adamw": lambda lr: opttx.inject_hyperparams(opttx.adamw)(learning_rate=lr),
}


def _copy(leaf):
    """A leaf of a state dict kept for comparison: tensors cloned, the maker's record (the
    strings of ``made_by``) as it is."""
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("name", list(TENSOR_LR_FACTORIES))
@pytest.mark.parametrize("value, text", [
    (math.nan, "learning_rate must be a number, got a tensor holding nan"),
    (-1.0, "learning_rate must be >= 0, got a tensor holding -1.0"),
    (math.inf, "learning_rate must be finite, got a tensor holding inf"),
])
def test_a_tensor_learning_rate_is_refused_where_the_float_is(name, value, text) -> None:
    """torch.tensor(nan) and torch.tensor(-1.) were accepted where nan and -1.0 are refused."""
    make = TENSOR_LR_FACTORIES[name]
    with pytest.raises(ValueError, match="learning_rate must"):
        make(value)                                   # the float: refused before, too
    with pytest.raises(ValueError, match=text):
        make(torch.tensor(value))
    with pytest.raises(ValueError, match=text):
        make(torch.tensor(value, dtype=torch.float64))


def test_tensor_betas_and_decays_are_checked_like_numbers() -> None:
    with pytest.raises(ValueError, match=r"b1 must be in \[0, 1\), got 1.5"):
        opttx.adamw(1e-3, b1=torch.tensor(1.5))
    with pytest.raises(ValueError, match="weight_decay must be a number, got a tensor holding nan"):
        opttx.adamw(1e-3, weight_decay=torch.tensor(math.nan))


def test_a_valid_tensor_learning_rate_gives_the_floats_numbers() -> None:
    params = {"w": torch.linspace(-1, 1, 5)}
    grads = {"w": torch.linspace(0.5, -0.3, 5)}
    by_float = opttx.adam(1e-2).update(grads, opttx.adam(1e-2).init(params), params)[0]
    tx = opttx.adam(torch.tensor(1e-2))
    by_tensor = tx.update(grads, tx.init(params), params)[0]
    assert torch.equal(by_float["w"], by_tensor["w"])


def test_an_injected_learning_rate_set_to_nan_is_refused_at_the_next_update() -> None:
    """`set_hyperparams_` writes the state; the factory checks the new value at the next
    update (in an eager step it reads it as the number it holds)."""
    tx = opttx.inject_hyperparams(opttx.adam)(learning_rate=1e-3)
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    _, state = tx.update({"w": torch.ones(3)}, state, params)
    opttx.set_hyperparams_(state, learning_rate=-0.5)
    with pytest.raises(ValueError, match=r"learning_rate must be >= 0, got -0\.5\."):
        tx.update({"w": torch.ones(3)}, state, params)


# ---------------------------------------------------------------------------------------------
# flatten refuses masks that would see its flat buffers
# ---------------------------------------------------------------------------------------------


def _decay_matrices(tree):
    return opttx.tree.tree_map(lambda x: x.ndim >= 2, tree)


@pytest.mark.parametrize("make", [
    lambda: opttx.flatten(opttx.adamw(0.1, weight_decay=0.5, mask=_decay_matrices)),
    lambda: opttx.flatten(opttx.masked(opttx.add_decayed_weights(0.5), _decay_matrices)),
    lambda: opttx.flatten(opttx.partition(
        {True: opttx.sgd(0.1), False: opttx.adam(0.1)}, _decay_matrices)),
])
def test_flatten_refuses_a_mask_given_as_a_function(make) -> None:
    """``flatten(adamw(mask=<function of ndim>))`` dropped the weight decay of every matrix:
    the mask saw one 1-D buffer. It is refused at init, naming the way out; a state of
    another configuration (made without the mask) is refused at update for its maker."""
    params = {"w": torch.ones(3, 4), "b": torch.ones(4)}
    tx = make()
    with pytest.raises(ValueError, match="inside flatten the tree is one flat buffer"):
        tx.init(params)
    state = opttx.flatten(opttx.adamw(0.1)).init(params)       # a state of the same layout
    with pytest.raises(TypeError, match="got a state made by flatten"):
        tx.update({"w": torch.zeros(3, 4), "b": torch.zeros(4)}, state, params)


def test_flatten_names_itself_when_a_mask_tree_does_not_fit_its_buffers() -> None:
    params = {"w": torch.ones(3, 4), "b": torch.ones(4)}
    tx = opttx.flatten(opttx.adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False}))
    with pytest.raises(ValueError, match="Inside opttx.flatten the tree is one flat buffer"):
        tx.init(params)


def test_flatten_inside_the_masking_keeps_the_decay_of_matrices() -> None:
    """The way out the error names: the same bits as ``adamw(mask=...)`` per leaf."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    def labels(tree):
        return opttx.tree.tree_map(lambda x: "decay" if x.ndim >= 2 else "no", tree)
    flat = opttx.partition({"decay": opttx.flatten(opttx.adamw(0.1, weight_decay=0.5)),
                            "no": opttx.flatten(opttx.adamw(0.1, weight_decay=0.0))}, labels)
    ref = opttx.adamw(0.1, weight_decay=0.5, mask=_decay_matrices)
    s_flat, s_ref = flat.init(params), ref.init(params)
    for _ in range(3):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        u_flat, s_flat = flat.update(g, s_flat, params)
        u_ref, s_ref = ref.update(g, s_ref, params)
        assert all(torch.equal(u_flat[k], u_ref[k]) for k in params)
    # and the decay of the matrix is there: zero gradients still move "w", not "b"
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    u, _ = flat.update(zero, flat.init(params), params)
    assert float(u["w"].abs().min()) > 0 and float(u["b"].abs().max()) == 0


# ---------------------------------------------------------------------------------------------
# Shampoo and SOAP: gradients that are None, broadcastable, of another shape or integer
# ---------------------------------------------------------------------------------------------

PRECONDITIONERS = {
    "soap": lambda: opttx.soap(1e-3),
    "shampoo": lambda: opttx.shampoo(1e-3),
    "eigenvalue_corrected": lambda: opttx.shampoo(1e-3, preconditioner="eigenvalue_corrected"),
    "eigenvalue_corrected_no_grafting": lambda: opttx.shampoo(
        1e-3, preconditioner="eigenvalue_corrected", grafting=None, betas=(0.0, 0.999)),
    "precondition_eigenvalue_corrected": lambda: opttx.precondition_eigenvalue_corrected(),
    "precondition_shampoo": lambda: opttx.precondition_shampoo(),
    "block_by_dims": lambda: opttx.block_by_dims(opttx.precondition_shampoo()),
}
BAD_GRADIENTS = {
    "None": (None, TypeError, r"gradient\['w'\] is NoneType"),
    "broadcastable": (torch.ones(1, 3), ValueError, r"gradient\['w'\]\S* has shape"),
    "transposed": (torch.ones(3, 4), ValueError, r"gradient\['w'\]\S* has shape"),
    "integer": (torch.ones(4, 3, dtype=torch.int64), TypeError,
                r"gradient\['w'\]\S* has dtype torch.int64"),
}


@pytest.mark.parametrize("with_params", [True, False])
@pytest.mark.parametrize("bad", list(BAD_GRADIENTS))
@pytest.mark.parametrize("name", list(PRECONDITIONERS))
def test_shampoo_and_soap_name_a_bad_gradient(name, bad, with_params) -> None:
    """soap and eigenvalue-corrected Shampoo gave torch's RuntimeError or AttributeError for a
    None, broadcastable or wrongly shaped gradient (and Shampoo accepted a transposed one, and
    precondition_shampoo an integer one): now a TypeError or ValueError naming the leaf,
    before anything is computed. One case cannot be told from the state alone: without
    params, a transposed matrix that block_by_dims merges into one dim has the same blocks
    (documented; given the params, it is refused)."""
    gradient, error, text = BAD_GRADIENTS[bad]
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    tx = PRECONDITIONERS[name]()
    state = tx.init(params)
    grads = {"w": gradient, "b": torch.ones(3)}
    blocked = name in ("shampoo", "eigenvalue_corrected", "eigenvalue_corrected_no_grafting",
                       "block_by_dims")
    if bad == "transposed" and blocked and not with_params:
        tx.update(grads, state)          # (12,) blocks either way: the documented gap
        return
    with pytest.raises(error, match=text):
        tx.update(grads, state, params if with_params else None)


# ---------------------------------------------------------------------------------------------
# schedule_free_eval_params with parameters the state was not built on
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [opttx.schedule_free_eval_params,
                                opttx.schedule_free_train_params])
@pytest.mark.parametrize("bad, error, text", [
    (torch.randn(3, 4), ValueError, r"params\['w'\] has shape \(3, 4\), but the schedule-free "
                                    r"state's z has \(4, 3\)"),
    (torch.randn(1, 3), ValueError, r"params\['w'\] has shape \(1, 3\)"),
    (None, TypeError, r"params\['w'\] is NoneType, expected a floating-point tensor"),
    (torch.ones(4, 3, dtype=torch.int64), TypeError, r"params\['w'\] is torch.int64"),
])
def test_schedule_free_eval_params_names_a_param_of_another_shape(fn, bad, error, text) -> None:
    """A wrongly shaped tree gave a size error deep in kernels.py, and a broadcastable one,
    (1, 3) for (4, 3), silently gave evaluation parameters of shape (4, 3)."""
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    tx = opttx.schedule_free_adamw(1e-2)
    state = tx.init(params)
    with pytest.raises(error, match=text):
        fn(state, {"w": bad, "b": params["b"]})


# ---------------------------------------------------------------------------------------------
# checkpoints: checksums, flipped bits, empty files
# ---------------------------------------------------------------------------------------------


def _saved(tmp_path, with_checksums: bool = True):
    """A small adamw state and params saved in ``tmp_path / "ckpt"``; the live dict to load
    into (modified since the save) and a copy of it."""
    import torch.distributed.checkpoint as dcp

    from opttx.distributed import save_checkpoint, state_dict
    params = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.linspace(-1, 1, 3)}
    tx = opttx.adamw(1e-2)
    state = tx.init(params)
    _, state = tx.update({k: v * 0.5 for k, v in params.items()}, state, params)
    sd = {"params": params, "optim": state_dict(state, params)}
    path = tmp_path / "ckpt"
    if with_checksums:
        save_checkpoint(sd, path)
    else:
        dcp.save(sd, checkpoint_id=str(path))
    saved = [_copy(x) for x in opttx.tree.tree_leaves(sd)]
    live_state = tx.init(params)
    live = {"params": {k: v + 1 for k, v in params.items()},
            "optim": state_dict(live_state, params)}
    return path, live, saved


def _flip_a_bit(path, value: float) -> str:
    import struct
    for f in sorted(path.glob("*.distcp")):
        data = bytearray(f.read_bytes())
        at = data.find(struct.pack("<f", value))
        if at >= 0:
            data[at] ^= 0x01
            f.write_bytes(bytes(data))
            return f.name
    raise AssertionError(f"{value} not found in the checkpoint files")


def test_a_checkpoint_of_save_checkpoint_loads_back(tmp_path) -> None:
    from opttx.distributed import load_checkpoint, verify_checkpoint
    path, live, saved = _saved(tmp_path)
    assert (path / ".opttx-checksums.json").exists() and verify_checkpoint(path)
    load_checkpoint(live, checkpoint_id=str(path))
    assert all(_same(a, b) for a, b in zip(opttx.tree.tree_leaves(live), saved))


def test_torch_formats_load_a_flipped_bit_silently(tmp_path) -> None:
    """What the checksums are for: neither torch.load nor DCP notices one flipped bit (a
    float32 500.0 comes back as 500.00003)."""
    import io
    import struct

    import torch.distributed.checkpoint as dcp
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(1000.0)}, buffer)
    data = bytearray(buffer.getvalue())
    data[data.find(struct.pack("<f", 500.0))] ^= 0x01
    loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert float(loaded["w"][500]) == 500.0000305175781
    dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(tmp_path / "d"))
    _flip_a_bit(tmp_path / "d", 500.0)
    back = {"w": torch.zeros(1000)}
    dcp.load(back, checkpoint_id=str(tmp_path / "d"))
    assert float(back["w"][500]) == 500.0000305175781


def test_load_checkpoint_refuses_a_flipped_bit_and_loads_nothing(tmp_path) -> None:
    from opttx.distributed import load_checkpoint
    path, live, _ = _saved(tmp_path)
    before = [_copy(x) for x in opttx.tree.tree_leaves(live)]
    name = _flip_a_bit(path, 7.0)                       # an element of params["w"]
    with pytest.raises(ValueError, match=f"{name} does not have the SHA-256 it was saved with"):
        load_checkpoint(live, checkpoint_id=str(path))
    assert all(_same(a, b) for a, b in zip(opttx.tree.tree_leaves(live), before))


@pytest.mark.parametrize("with_checksums", [True, False])
@pytest.mark.parametrize("which", ["distcp", ".metadata"])
def test_load_checkpoint_names_an_empty_file(tmp_path, with_checksums, which) -> None:
    """An emptied file gave DCP's CheckpointException around a traceback (torch.load of an
    empty file: EOFError with an empty message); now a ValueError naming the file, with or
    without the checksums, and nothing loaded."""
    from opttx.distributed import load_checkpoint
    path, live, _ = _saved(tmp_path, with_checksums)
    target = next(path.glob("*.distcp")) if which == "distcp" else path / ".metadata"
    target.write_bytes(b"")
    before = [_copy(x) for x in opttx.tree.tree_leaves(live)]
    text = r"has 0 bytes, [0-9]+ were saved" if with_checksums else r"is empty \(0 bytes\)"
    with pytest.raises(ValueError, match=f"{target.name}.*{text}"):
        load_checkpoint(live, checkpoint_id=str(path))
    assert all(_same(a, b) for a, b in zip(opttx.tree.tree_leaves(live), before))


def test_verify_checkpoint_requires_the_checksums_when_asked(tmp_path) -> None:
    from opttx.distributed import verify_checkpoint
    path, _, _ = _saved(tmp_path, with_checksums=False)
    assert verify_checkpoint(path, required=False) is False
    with pytest.raises(ValueError, match="has no .opttx-checksums.json"):
        verify_checkpoint(path)


# ---------------------------------------------------------------------------------------------
# structures: dict key order, a swapped (state, updates), assert_trees_close's messages
# ---------------------------------------------------------------------------------------------


def test_assert_trees_close_compares_dicts_in_another_key_order_by_key() -> None:
    """The same keys in another order counted as another structure, and the error advised
    "pass updates, state and params built from the same parameter tree"."""
    from opttx.testing import assert_trees_close
    a = {"w": torch.ones(2), "b": torch.zeros(3), "n": {"x": torch.ones(1), "y": torch.ones(1)}}
    b = {"n": {"y": torch.ones(1), "x": torch.ones(1)}, "b": torch.zeros(3), "w": torch.ones(2)}
    assert_trees_close(a, b)
    b["n"]["x"] = torch.full((1,), 2.0)
    with pytest.raises(AssertionError, match=r"trees\['n'\]\['x'\]: max abs error 1.000e\+00"):
        assert_trees_close(a, b)


def test_assert_trees_close_says_what_differs_without_advice_for_transforms() -> None:
    from opttx.testing import assert_trees_close
    with pytest.raises(AssertionError) as info:
        assert_trees_close({"w": torch.ones(2), "b": torch.zeros(3)}, {"w": torch.ones(2)})
    text = str(info.value)
    assert "first difference at <root>: dict with keys ['w', 'b'] vs dict with keys ['w']" \
        in text and "Pass updates" not in text, text


def test_an_update_of_another_key_order_says_so() -> None:
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    tx = opttx.adam(1e-2)
    with pytest.raises(ValueError, match=r"the same keys in another order, \['b', 'w'\] vs "
                                         r"\['w', 'b'\].*same key order"):
        tx.update({"b": torch.ones(2), "w": torch.ones(3)}, tx.init(params), params)


@pytest.mark.parametrize("make", [lambda: opttx.adam(1e-2), lambda: opttx.sgd(1e-2),
                                  lambda: opttx.sgd(1e-2, momentum=0.9),
                                  lambda: opttx.shampoo(1e-2)])
@pytest.mark.parametrize("apply", [opttx.apply_updates, opttx.apply_updates_])
def test_unpacking_update_the_wrong_way_round_is_named(make, apply) -> None:
    """``state, updates = tx.update(...)`` gave a structure error with no hint of the swap."""
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    tx = make()
    state, updates = tx.update({k: torch.ones_like(v) for k, v in params.items()},
                               tx.init(params), params)
    with pytest.raises(ValueError, match=r"unpacked the wrong way round\? It returns "
                                         r"\(updates, state\)"):
        apply({k: v.clone() for k, v in params.items()}, updates)


# ---------------------------------------------------------------------------------------------
# hypothesis: shrinking of the distributed strategies stays bounded
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_sharding_specs_shrink_in_a_bounded_number_of_replays(mesh) -> None:
    """A failing sharded example spent over 5 minutes shrinking (each replay a multi-process
    run). One integer now seeds the whole spec tree: a failing test is called at most 30
    times in all, generation included (measured: 13 to 24; with a choice per leaf and mesh
    dim, 80 to 170 for 12 and 24 leaves)."""
    import hypothesis
    from hypothesis import given, settings

    from opttx.testing import sharding_specs
    shapes = {f"l{i}": [(7, 4), (7,), (3, 5, 2), (6, 9)][i % 4] for i in range(24)}
    for seed in range(3):
        calls = [0]

        @settings(max_examples=50, database=None, deadline=None)
        @given(specs=sharding_specs(shapes, mesh=mesh))
        def failing(specs) -> None:
            calls[0] += 1
            text = repr(specs)
            assert not (text.count("Shard(0") >= 2 and text.count("Shard(1") >= 2)
        with pytest.raises(AssertionError):
            hypothesis.seed(seed)(failing)()
        assert 1 <= calls[0] <= 30, calls


def test_sharding_specs_shrink_to_the_simplest_specs() -> None:
    """The integer 0 (where shrinking goes first) gives every leaf its simplest spec."""
    from hypothesis import find

    from opttx.distributed import Replicated
    from opttx.testing import sharding_specs
    shapes = {"w": (7, 4), "b": (7,)}
    assert find(sharding_specs(shapes), lambda s: True) == {"w": Replicated(),
                                                             "b": Replicated()}


def test_sharded_settings_do_not_shrink() -> None:
    from hypothesis import Phase

    from opttx.testing import sharded_settings
    assert Phase.shrink not in sharded_settings().phases
    assert Phase.shrink in sharded_settings(shrink=True).phases
    assert sharded_settings(max_examples=2).max_examples == 2


# ---------------------------------------------------------------------------------------------
# joining the process group again after a torchrun restart
# ---------------------------------------------------------------------------------------------


def test_init_process_group_for_restarts_uses_a_namespace_per_attempt(monkeypatch) -> None:
    """Restarting after a killed rank needed the per-restart PrefixStore code copied from
    examples/resume_after_kill.py; opttx.distributed.init_process_group_for_restarts does it
    (the restart itself: tests/test_resume.py). Here, one process and an agent-like store:
    the group's keys land under ``attempt_<TORCHELASTIC_RESTART_COUNT>/``."""
    import datetime

    import torch.distributed as dist

    from opttx.distributed import init_process_group_for_restarts
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    for key, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port),
                       "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    init_process_group_for_restarts("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        x = torch.ones(2)
        dist.all_reduce(x)
        assert x.tolist() == [1.0, 1.0]
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store.underlying_store, dist.PrefixStore):
            store = store.underlying_store            # the innermost: the attempt's
        store.set("probe", "here")
        assert agent.get("attempt_3/probe") == b"here"
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# what Lion and Muon do with a non-finite gradient element (docs/guide/faults.md)
# ---------------------------------------------------------------------------------------------


def _one_bad_element(tx, bad: float, steps: int = 4) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    state = tx.init(params)
    out = []
    for step in range(steps):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        if step == 1:
            g["w"][0, 0] = bad
            g["b"][0] = bad
        u, state = tx.update(g, state, params)
        out.append(u)
    return out


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_lion_shows_a_non_finite_gradient_element_as_nan(bad) -> None:
    """Lion's sign of a non-finite value is NaN (torch.sign would make a NaN 0, freezing the
    weight unseen, and an inf a normal step of size lr): the element's update is NaN from
    that step on (its momentum is NaN or inf, and inf minus inf in the next interpolation is
    NaN). The other elements keep moving by lr."""
    lr = float(torch.tensor(1e-2))                    # the float32 step size
    updates = _one_bad_element(opttx.lion(1e-2, weight_decay=0.0), bad)
    for step, u in enumerate(updates):
        for k in ("w", "b"):
            first = u[k].reshape(-1)[0]
            assert (u[k].reshape(-1)[1:].abs() == lr).all()
            if step == 0:
                assert float(first.abs()) == lr
            else:
                assert torch.isnan(first)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_muon_spreads_a_non_finite_element_over_the_matrix(bad) -> None:
    """Newton-Schulz mixes every element of a matrix: one NaN or inf makes the matrix's whole
    update NaN from that step on; a vector (Muon's AdamW fallback) loses that element only."""
    updates = _one_bad_element(opttx.muon(1e-2), bad)
    assert all(torch.isfinite(updates[0][k]).all() for k in ("w", "b"))
    for u in updates[1:]:
        assert torch.isnan(u["w"]).all()
        assert torch.isnan(u["b"][0]) and torch.isfinite(u["b"][1:]).all()
