"""Shampoo: Meta's blocking, grafting equivalences with torch.optim while preconditioning has
not started, a float64 dense re-derivation of full-matrix Shampoo, roots, failures, compile."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import opttx
from opttx.bench.memory import tensor_bytes
from opttx.testing import assert_trees_close, gradient_stream, param_trees, run_transform
from opttx.tree import tree_leaves

NEVER = 10**6   # a start step the tests never reach


# ---------------------------------------------------------------------------------------------
# blocking
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,max_dim,merged", [
    ((10, 20), 1024, (200,)),
    ((32, 3, 64, 64), 1024, (32, 192, 64)),
    ((32, 3, 64, 64), 8192, (96, 4096)),
    ((1, 5, 1), 1024, (5,)),
    ((1, 1), 1024, (1,)),
    ((), 1024, (1,)),
])
def test_merge_small_dims_as_meta(shape, max_dim, merged) -> None:
    assert opttx.merge_small_dims(shape, max_dim) == merged


def test_block_shapes_split_at_the_max_dim() -> None:
    assert opttx.block_shapes((2500, 600), 1024) == [(1024, 600), (1024, 600), (452, 600)]
    assert opttx.block_shapes((3000,), 1024) == [(1024,), (1024,), (952,)]
    assert opttx.block_shapes((1500, 1500), 1024) == [(1024, 1024), (1024, 476), (476, 1024),
                                                      (476, 476)]


@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=4).map(tuple),
       max_dim=st.integers(1, 12))
def test_blocks_tile_the_tensor_and_round_trip(shape, max_dim) -> None:
    from opttx.transforms.blocking import merge_blocks, split_blocks
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    blocks = split_blocks(x, max_dim)
    assert [tuple(b.shape) for b in blocks] == opttx.block_shapes(shape, max_dim)
    assert sum(b.numel() for b in blocks) == x.numel()
    assert all(max(b.shape) <= max(max_dim, 1) or b.numel() == 1 for b in blocks)
    assert torch.equal(merge_blocks(blocks, shape, max_dim), x)
    identity = opttx.block_by_dims(opttx.identity(), max_dim)
    out, _ = identity.update({"x": x}, identity.init({"x": x}))
    assert torch.equal(out["x"], x)


# ---------------------------------------------------------------------------------------------
# grafting equivalences (preconditioning never started)
# ---------------------------------------------------------------------------------------------

GRAFT_CASES = {
    "adagrad": (dict(betas=(0.0, 1.0), grafting="adagrad", grafting_epsilon=1e-10),
                lambda ps, lr: torch.optim.Adagrad(ps, lr=lr, eps=1e-10)),
    "adam": (dict(betas=(0.9, 0.999), grafting="adam", grafting_beta2=0.999,
                  grafting_epsilon=1e-8, weight_decay=0.01, use_decoupled_weight_decay=False),
             lambda ps, lr: torch.optim.Adam(ps, lr=lr, weight_decay=0.01)),
    "adamw": (dict(betas=(0.9, 0.999), grafting="adam", grafting_beta2=0.999,
                   grafting_epsilon=1e-8, weight_decay=0.01),
              lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)),
    "rmsprop": (dict(betas=(0.0, 1.0), grafting="rmsprop", grafting_beta2=0.99,
                     grafting_epsilon=1e-8),
                lambda ps, lr: torch.optim.RMSprop(ps, lr=lr, alpha=0.99, eps=1e-8)),
    "sgd_nesterov": (dict(betas=(0.0, 1.0), grafting="sgd", momentum=0.9, nesterov=True),
                     lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True)),
    "sgd_momentum": (dict(betas=(0.0, 1.0), grafting="sgd", momentum=0.9),
                     lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)),
}


@pytest.mark.parametrize("name", list(GRAFT_CASES))
@given(drawn=param_trees(shape_strategy=st.lists(st.integers(1, 6), min_size=0,
                                                 max_size=3).map(tuple)))
def test_grafted_method_alone_equals_torch_optim(name, drawn) -> None:
    kwargs, make_ref = GRAFT_CASES[name]
    lr, tree = 1e-2, drawn.tree
    grads = gradient_stream(tree, 20, seed=drawn.seed + 1)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in tree.items()}
    ref = make_ref(list(params.values()), lr)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        ref.step()
    tx = opttx.shampoo(lr, start_preconditioning_step=NEVER, max_preconditioner_dim=4,
                       **kwargs)
    actual, _ = run_transform(tx, tree, grads)
    expected = {k: p.detach() for k, p in params.items()}
    # relative to the largest parameter: a scalar leaf that ends near zero would turn
    # last-bit float32 differences (torch applies decay as p·(1 − lr·wd)) into large ratios
    scale = max(float(v.abs().max()) for v in expected.values() if v.numel())
    # and Meta's (so opttx's) grafted Adam/RMSprop divides by a float32 bias correction
    # 1 - fl32(beta2)^t where torch uses float64: up to 6.5e-6 of each step's size
    moved = max(float((expected[k] - tree[k]).abs().max()) for k in tree if tree[k].numel())
    assert_trees_close(actual, expected, rtol=1e-6, atol=1e-6 * scale + 1e-5 * moved)


# ---------------------------------------------------------------------------------------------
# full-matrix Shampoo against a dense float64 re-derivation
# ---------------------------------------------------------------------------------------------


def sym_power(a: torch.Tensor, p: float) -> torch.Tensor:
    w, v = torch.linalg.eigh(a)
    return v @ torch.diag(w.pow(p)) @ v.T


def dense_shampoo(x0: torch.Tensor, grads: list[torch.Tensor], lr: float, eps: float,
                  freq: int) -> torch.Tensor:
    """Full-matrix Shampoo written with Kronecker products: vec(P) = (R_1 ⊗ ... ⊗ R_k) vec(G),
    factors L_i = sum_t G_(i) G_(i)^T of the mode-i unfoldings, roots every ``freq`` steps
    from step ``freq`` on (identity before), exponent -1/(2k)."""
    x = x0.clone()
    shape = tuple(d for d in x0.shape if d != 1) or (1,)
    k = len(shape)
    factors = [torch.zeros(d, d, dtype=torch.float64) for d in shape]
    roots = [torch.eye(d, dtype=torch.float64) for d in shape]
    for t, g in enumerate(grads, start=1):
        g = g.reshape(shape)
        for i in range(k):
            unfold = torch.movedim(g, i, 0).reshape(shape[i], -1)
            factors[i] = factors[i] + unfold @ unfold.T
        if t % freq == 0:
            roots = [sym_power(f + eps * torch.eye(f.shape[0], dtype=torch.float64), -1 / (2 * k))
                     for f in factors]
        kron = roots[0]
        for r in roots[1:]:
            kron = torch.kron(kron, r)
        x = x - lr * (kron @ g.reshape(-1)).reshape(x0.shape)
    return x


@pytest.mark.parametrize("freq", [1, 3])
@pytest.mark.parametrize("shape", [(5,), (4, 3), (3, 2, 4), (6, 1)])
def test_full_matrix_shampoo_equals_dense_derivation(shape, freq) -> None:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(9)]
    lr, eps = 0.1, 1e-3
    expected = dense_shampoo(x0, grads, lr, eps, freq)
    # max_preconditioner_dim = the largest dim: no dims merge, so a matrix keeps two factors
    tx = opttx.shampoo(lr, betas=(0.0, 1.0), epsilon=eps, precondition_frequency=freq,
                       preconditioner_dtype=torch.float64, inv_factor_matrix_dtype=torch.float64,
                       max_preconditioner_dim=max(shape))
    actual, _ = run_transform(tx, {"x": x0}, [{"x": g} for g in grads])
    assert_trees_close(actual, {"x": expected}, rtol=1e-5)


def test_beta2_and_bias_correction_of_the_factors() -> None:
    """With beta2 < 1 the factors are EMAs and the roots use L / (1 - beta2^t)."""
    gen = torch.Generator().manual_seed(1)
    g = [torch.randn(3, 2, generator=gen, dtype=torch.float64) for _ in range(4)]
    tx = opttx.precondition_shampoo(beta2=0.9, epsilon=1e-6, precondition_frequency=1,
                                    preconditioner_dtype=torch.float64,
                                    inv_factor_matrix_dtype=torch.float64)
    state = tx.init({"w": g[0]})
    left = torch.zeros(3, 3, dtype=torch.float64)
    for t, gi in enumerate(g, start=1):
        out, state = tx.update({"w": gi}, state)
        left = 0.9 * left + 0.1 * gi @ gi.T
    # factors hold their upper triangle (Meta's packed entries), zeros below the diagonal
    assert_trees_close(state.factors["w"][0], torch.triu(left), rtol=1e-12)
    # the bias correction is Meta's float32 scalar 1 - fl32(0.9)^4, within float32 of 1 - 0.9^4
    correction = float(opttx.meta_bias_correction(0.9, torch.tensor(4)))
    assert correction != 1 - 0.9**4 and abs(correction / (1 - 0.9**4) - 1) < 1e-6
    expected_root = sym_power(left / correction + 1e-6 * torch.eye(3, dtype=torch.float64),
                              -0.25)
    assert_trees_close(state.roots["w"][0], expected_root, rtol=1e-8)


# ---------------------------------------------------------------------------------------------
# roots and failures
# ---------------------------------------------------------------------------------------------


def test_eigh_and_newton_roots_agree() -> None:
    gen = torch.Generator().manual_seed(2)
    for n, p in [(4, 4), (6, 2), (8, 6)]:
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        a = q @ torch.diag(torch.linspace(0.5, 4.0, n, dtype=torch.float64)) @ q.T
        eigh = opttx.matrix_inverse_root(a, p, 1e-6, "eigh")
        newton = opttx.matrix_inverse_root(a, p, 1e-6, "newton", tolerance=1e-12)
        assert_trees_close(newton, eigh, rtol=1e-9)
        higher = opttx.matrix_inverse_root(a, p, 1e-6, "higher_order", tolerance=1e-20)
        assert_trees_close(higher, eigh, rtol=1e-9)


def test_iterative_roots_refuse_what_they_cannot_compute() -> None:
    a = torch.eye(3)
    with pytest.raises(ValueError, match="integer root"):
        opttx.matrix_inverse_root(a, 2.5, 1e-6, "newton")
    with pytest.raises(ValueError, match="order"):
        opttx.matrix_inverse_root(a, 2, 1e-6, "higher_order", order=1)
    with pytest.raises(ValueError, match="'eigh', 'newton' or 'higher_order'"):
        opttx.matrix_inverse_root(a, 2, 1e-6, "qr")
    with pytest.raises(ValueError, match="setting of the 'eigh' root"):
        opttx.shampoo(root_method="newton", rank_deficient="pseudo_inverse", epsilon=0.0)
    # when the optimizer is built, not at its first root computation
    for override in (2.5, {2: 0.4}, {2: {1: 0.4}}):
        with pytest.raises(ValueError, match="not an integer"):
            opttx.shampoo(root_method="newton", inverse_exponent_override=override)
    opttx.shampoo(root_method="newton", inverse_exponent_override={2: {0: 0.25, 1: 0}})
    # KL-SOAP takes its roots from Meta's schedule's eigendecompositions: the power refresh
    # of the other schedule is refused (tests/test_kl_soap.py has its numbers)
    opttx.shampoo(kl_shampoo=True, preconditioner="eigenvalue_corrected")
    with pytest.raises(ValueError, match="kl_shampoo"):
        opttx.precondition_eigenvalue_corrected(kl_shampoo=True, schedule="soap")
    with pytest.raises(ValueError, match="eigenvalue-corrected"):
        opttx.shampoo(preconditioner="eigenvalue_corrected", root_method="newton")
    # a singular matrix without epsilon: the higher-order method's accuracy check rejects it
    assert torch.isnan(opttx.matrix_inverse_root(torch.zeros(3, 3), 2, 0.0, "higher_order")).all()


def test_rank_deficient_factor_keeps_the_old_root_without_nan() -> None:
    tx = opttx.precondition_shampoo(epsilon=0.0, precondition_frequency=1)
    params = {"w": torch.zeros(3, 3)}
    state = tx.init(params)
    g = torch.zeros(3, 3)
    g[0, 0] = 1.0                                   # rank one: L and R are singular
    out, state = tx.update({"w": g}, state)
    assert torch.isfinite(out["w"]).all()
    assert torch.equal(state.roots["w"][0], torch.eye(3))  # old (identity) root kept
    assert int(state.failures) == 1


def test_only_the_failing_factor_keeps_its_old_root() -> None:
    tx = opttx.precondition_shampoo(epsilon=0.0, precondition_frequency=1)
    state = tx.init({"w": torch.zeros(3, 2)})
    g = torch.zeros(3, 2)
    g[0, 0], g[0, 1] = 1.0, 2.0                     # L (3x3) singular, R (2x2) singular too
    g2 = g.clone()
    g2[1, 1] = 1.0                                  # now R is regular, L still singular
    _, state = tx.update({"w": g2}, state)
    left, right = state.roots["w"]
    assert torch.equal(left, torch.eye(3))          # kept
    assert not torch.equal(right, torch.eye(2)) and torch.isfinite(right).all()
    expected = opttx.matrix_inverse_root(g2.double().T @ g2.double(), 4).float()
    assert_trees_close(right, expected, rtol=1e-5)
    assert int(state.failures) == 1


def test_float32_rank_deficient_factors_get_roots() -> None:
    # four (96, 8) gradients: L = sum G G^T (96 x 96) has rank <= 32, and rounding gives it
    # eigenvalues just below zero (about -1e-5 even when the float32 L is read in float64),
    # so adding epsilon without the eigenvalue shift yields NaN roots in both precisions
    gen = torch.Generator().manual_seed(0)
    tx = opttx.precondition_shampoo(precondition_frequency=2)
    state = tx.init({"w": torch.zeros(96, 8)})
    right = torch.zeros(8, 8, dtype=torch.float64)
    for _ in range(4):
        g = torch.randn(96, 8, generator=gen)
        right += g.double().T @ g.double()
        out, state = tx.update({"w": g}, state)
        assert torch.isfinite(out["w"]).all()
    upper = state.factors["w"][0].double()
    assert torch.linalg.eigvalsh(upper + upper.triu(1).mT).min() < 0
    assert int(state.failures) == 0
    left_root, right_root = state.roots["w"]
    assert torch.isfinite(left_root).all() and not torch.equal(left_root, torch.eye(96))
    expected = opttx.matrix_inverse_root(right, 4, 1e-12).float()
    assert_trees_close(right_root, expected, rtol=1e-4)


def test_consecutive_failures_beyond_the_limit_raise() -> None:
    tx = opttx.precondition_shampoo(epsilon=0.0, precondition_frequency=1,
                                    max_consecutive_failures=2)
    state = tx.init({"w": torch.zeros(2, 2)})
    g = {"w": torch.tensor([[1.0, 0.0], [0.0, 0.0]])}
    for _ in range(2):
        _, state = tx.update(g, state)
    with pytest.raises(RuntimeError, match="failed 3 times in a row"):
        tx.update(g, state)


# ---------------------------------------------------------------------------------------------
# compile: the root recomputation lives inside one graph
# ---------------------------------------------------------------------------------------------


def test_shampoo_step_compiles_to_at_most_two_graphs_over_three_periods() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    freq = 3
    params = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    tx = opttx.shampoo(1e-2, grafting="adam", precondition_frequency=freq,
                       max_preconditioner_dim=4, momentum=0.9)
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return opttx.apply_updates(params, updates), state

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_params, eager_state = params, state
    with torch._dynamo.config.patch(error_on_recompile=True):
        for g in gradient_stream(params, 3 * freq, seed=3):
            params, state = compiled(params, state, g)
            eager_params, eager_state = step(eager_params, eager_state, g)
    cached = torch._dynamo.eval_frame._debug_get_cache_entry_list(step.__code__)
    assert len(cached) == 1 and counter.frame_count <= 2
    assert_trees_close(params, eager_params, rtol=1e-5)
    torch._dynamo.reset()


def test_compiled_root_retry_and_keep_equal_eager() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    tx = opttx.precondition_shampoo(epsilon=0.0, precondition_frequency=1)
    params = {"w": torch.zeros(3, 2), "v": torch.zeros(4)}
    grads = [{"w": torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]) * (i + 1),
              "v": torch.arange(4.0) + i} for i in range(3)]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(tx.update, backend=counter, fullgraph=True)
    state_c = state_e = tx.init(params)
    for g in grads:
        out_c, state_c = compiled(g, state_c)
        out_e, state_e = tx.update(g, state_e)
        assert_trees_close(out_c, out_e, rtol=1e-6)
        assert_trees_close(state_c.roots, state_e.roots, rtol=1e-6)
        assert int(state_c.failures) == int(state_e.failures)
    assert int(state_e.failures) == 3 and counter.frame_count == 1
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# 16-bit parameters: statistics in float32
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grafting", ["adam", "adagrad", None])
def test_bf16_parameters_keep_float32_statistics_and_follow_float32(grafting) -> None:
    gen = torch.Generator().manual_seed(5)
    tree32 = {"w": torch.randn(12, 10, generator=gen), "b": torch.randn(10, generator=gen)}
    tree32 = {k: v.bfloat16().float() for k, v in tree32.items()}
    tree16 = {k: v.bfloat16() for k, v in tree32.items()}
    grads = gradient_stream(tree32, 8, seed=6)
    grads = [{k: v.bfloat16().float() for k, v in g.items()} for g in grads]

    def make():
        return opttx.shampoo(1e-2, betas=(0.9, 0.999), grafting=grafting, epsilon=1e-6,
                             max_preconditioner_dim=10, precondition_frequency=2)

    tx16, tx32 = make(), make()
    s16, s32 = tx16.init(tree16), tx32.init(tree32)
    graft_state = s16[0]                     # the chain's first link: graft
    assert isinstance(graft_state, opttx.GraftState)
    assert all(v.dtype == torch.float32 for v in opttx.tree.tree_leaves(graft_state.filtered))
    for g in grads:
        u16, s16 = tx16.update({k: v.bfloat16() for k, v in g.items()}, s16, tree16)
        u32, s32 = tx32.update(g, s32, tree32)
        for k in u16:
            assert u16[k].dtype == torch.bfloat16
            # bf16 rounding of the update only (0.4 % relative), not a divergence
            assert_trees_close(u16[k].float(), u32[k], rtol=2e-2,
                               atol=2e-2 * float(u32[k].abs().max()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preconditioner", ["root_inverse", "eigenvalue_corrected"])
@pytest.mark.parametrize("grafting", ["adam", None])
def test_16bit_parameters_follow_float32_within_two_roundings(dtype, preconditioner,
                                                               grafting) -> None:
    """float16 parameters with eigenvalue-corrected Shampoo and Adam grafting gave NaN from
    the first step (the direction, whose entries reach 1e5 where the rotated squared
    gradient is a rounding error, was cast to float16: inf, then inf times graft's 0). graft
    now runs both methods and the rescale in float32: every update is the float32 run's on
    the same gradients rounded twice (the grafted update, then the learning rate's product),
    |u16 - u32| <= 2 u |u32| + the smallest subnormal (measured: at most 1.57 u |u32|; before
    the fix the eigenvalue-corrected float16 updates were 35 relative away, bfloat16 0.44)."""
    unit = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    tiny = 2.0 ** -24 if dtype == torch.float16 else 2.0 ** -133
    gen = torch.Generator().manual_seed(0)
    p16 = {"w": torch.randn(8, 6, generator=gen).to(dtype),
           "b": torch.randn(6, generator=gen).to(dtype),
           "c": torch.randn(3, 4, 5, generator=gen).to(dtype)}
    p32 = {k: v.float() for k, v in p16.items()}
    tx = opttx.shampoo(1e-2, betas=(0.9, 0.999), grafting=grafting,
                       preconditioner=preconditioner, max_preconditioner_dim=6)
    s16, s32 = tx.init(p16), tx.init(p32)
    for _ in range(6):
        g16 = {k: torch.randn(v.shape, generator=gen).to(dtype) for k, v in p16.items()}
        u16, s16 = tx.update(g16, s16, p16)
        u32, s32 = tx.update({k: v.float() for k, v in g16.items()}, s32, p32)
        for k in p16:
            assert u16[k].dtype == dtype
            err = (u16[k].float() - u32[k]).abs()
            assert (err <= 2 * unit * u32[k].abs() + tiny).all(), (k, float(err.max()))


def test_meta_options_compile_to_one_graph_and_equal_eager() -> None:
    """beta3, trace scaling, a per-dim inverse exponent override (one dim not
    preconditioned) and float32 roots of float64 factors under torch.compile(fullgraph)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    tx = opttx.shampoo(1e-2, betas=(0.9, 0.999), grafting="adam", max_preconditioner_dim=6,
                       precondition_frequency=2, inverse_exponent_override={2: {1: 0.0},
                                                                            3: 0.25},
                       beta3=0.5, use_trace_scaling=True, preconditioner_dtype=torch.float64,
                       inv_factor_matrix_dtype=torch.float32)
    params = {"m": torch.randn(6, 4), "t": torch.randn(3, 5, 6), "v": torch.randn(5)}
    state = tx.init(params)
    assert state[0].direction.factors["m"][0][1].shape == (0, 0)   # dim 1 of (6, 4): none

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return opttx.apply_updates(params, updates), state

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_params, eager_state = params, state
    for g in gradient_stream(params, 4, seed=9):
        params, state = compiled(params, state, g)
        eager_params, eager_state = step(eager_params, eager_state, g)
    assert counter.frame_count == 1
    assert_trees_close(params, eager_params, rtol=1e-6)
    torch._dynamo.reset()


def test_graft_refuses_a_transform_that_ignores_the_filtered_gradient() -> None:
    """With beta1 > 0 graft preconditions the filtered gradient, passed as
    PRECONDITION_INPUT: a transform without Traits(takes_precondition_input=True) would
    precondition the raw gradient silently, so it is refused; with beta1 = 0 the two are the
    same tensor and any transform is accepted."""
    with pytest.raises(ValueError, match="takes_precondition_input"):
        opttx.graft(opttx.scale_by_adam(), opttx.precondition_shampoo(), beta1=0.9)
    with pytest.raises(ValueError, match="direction"):
        opttx.graft(None, opttx.scale_by_adam(), beta1=0.9)
    opttx.graft(opttx.scale_by_adam(), opttx.precondition_shampoo(), beta1=0.0)
    blocked = opttx.block_by_dims(opttx.precondition_shampoo(), 4)
    opttx.graft(opttx.scale_by_rms(), blocked, beta1=0.9)      # blocking keeps the trait


@given(n=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_pack_symmetric_round_trip(n, seed) -> None:
    m = torch.randn(n, n, generator=torch.Generator().manual_seed(seed))
    m = m + m.T
    packed = opttx.pack_symmetric(m)
    assert packed.shape == (n * (n + 1) // 2,)
    assert torch.equal(opttx.unpack_symmetric(packed), m)


@pytest.mark.parametrize("kw", [{}, {"root_method": "newton"},
                                {"inverse_exponent_override": {2: {0: 0.0}}},
                                {"momentum": 0.5, "grafting": None}])
def test_symmetric_packing_is_lossless_and_halves_the_matrices(kw) -> None:
    """Packed factors and roots give the same parameters bit for bit; each (d, d) matrix
    of the state keeps d (d + 1) / 2 entries."""
    tree = {"m": torch.randn(6, 5), "v": torch.randn(9), "t": torch.randn(2, 3, 4)}
    grads = gradient_stream(tree, 6, seed=1)
    args = dict(betas=(0.9, 0.999), grafting="adam", max_preconditioner_dim=8,
                precondition_frequency=2, epsilon=1e-6)
    runs = {}
    for packed in (False, True):
        tx = opttx.shampoo(1e-2, **{**args, **kw}, use_symmetric_packing=packed)
        runs[packed] = run_transform(tx, tree, grads)
    (p_full, s_full), (p_packed, s_packed) = runs[False], runs[True]
    assert all(torch.equal(p_full[k], p_packed[k]) for k in tree)
    # the square leaves of the unpacked state are the factors and roots (no other state
    # leaf of these blocks is square); packing keeps d (d + 1) / 2 of their d^2 entries
    squares = [x for x in tree_leaves(s_full) if x.dim() == 2 and x.shape[0] == x.shape[1]]
    saved = sum((x.shape[0] ** 2 - x.shape[0] * (x.shape[0] + 1) // 2) * x.element_size()
                for x in squares)
    assert saved > 0
    assert tensor_bytes(s_full) - tensor_bytes(s_packed) == saved
