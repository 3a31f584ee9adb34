"""`opttx.bench.memory.LiveTensorTracker`: exact live-tensor bytes and their peak."""

import gc

import pytest
import torch

import opttx
from opttx.bench.memory import LiveTensorTracker, storage_bytes, tensor_bytes

MiB = 1 << 20


def test_two_allocations_then_one_freed():
    tr = LiveTensorTracker()
    with tr:
        a = torch.empty(MiB // 4)           # 1 MiB of float32
        b = torch.ones(MiB // 4)
        assert tr.live == 2 * MiB
        del a
        assert tr.live == MiB
        c = torch.zeros(MiB // 8)           # 0.5 MiB: below the earlier peak
        assert tr.live == MiB + MiB // 2
    assert tr.peak == 2 * MiB
    assert tr.n_allocations == 3
    del b, c
    assert tr.live == 0                     # frees after the mode exits still count


def test_views_inplace_and_out_allocate_nothing():
    tr = LiveTensorTracker()
    with tr:
        a = torch.randn(256, 1024)          # 1 MiB
        v = a.t()
        a.mul_(2)
        torch.add(a, 1, out=a)
        a.view(-1).add_(v.reshape(-1)[:1])  # reshape of a non-contiguous view copies 1 MiB
        assert tr.peak == 2 * MiB
        assert tr.live == MiB
        del a
        assert tr.live == MiB               # the view keeps the storage alive
        del v
        assert tr.live == 0


def test_torch_tensor_from_data_is_counted():
    tr = LiveTensorTracker()
    with tr:
        t = torch.tensor([1.0] * 1000)      # built outside dispatch, then lift_fresh
        assert tr.live == 4000
    del t
    assert tr.live == 0


def test_baseline_counts_and_its_free_is_seen():
    base = [torch.zeros(MiB // 4), torch.zeros(MiB // 8)]
    alias = base[0][:10]                     # same storage: counted once
    tr = LiveTensorTracker(baseline=[base, alias])
    assert tr.start == tr.live == MiB + MiB // 2
    with tr:
        new = torch.empty_like(base[1])
        del base[1]                          # an optimizer replacing its state
        assert tr.live == MiB + MiB // 2
        assert tr.peak == 2 * MiB
    del new


def test_backward_gradients_and_sections():
    lin = torch.nn.Linear(512, 512, bias=False)   # 1 MiB weight
    x = torch.randn(128, 512)                      # 0.25 MiB input
    tr = LiveTensorTracker(baseline=[lin.weight, x])
    with tr:
        with tr.section("forward"):
            h = lin(x)                             # 0.25 MiB, saved for backward of square
            loss = (h * h).sum()                   # h*h: 0.25 MiB, freed after the sum
        with tr.section("backward"):
            loss.backward()
        del h, loss
        gc.collect()
    weight, inp = 512 * 512 * 4, 128 * 512 * 4
    assert tr.start == weight + inp
    assert tr.live == weight + inp + weight        # + the gradient
    assert tr.sections["forward"] == weight + inp + 2 * inp + 4
    # backward: grad_h (0.25 MiB) and the 1 MiB weight grad are live with the saved h
    assert tr.sections["backward"] >= weight + inp + weight + inp
    assert tr.peak == max(tr.sections.values())


def test_post_accumulate_hook_frees_gradient_inside_backward():
    lin = torch.nn.Linear(256, 256, bias=False)    # 0.25 MiB weight
    lin.weight.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    x = torch.randn(64, 256)
    tr = LiveTensorTracker(baseline=[lin.weight, x])
    with tr:
        lin(x).sum().backward()
        gc.collect()
    assert lin.weight.grad is None
    assert tr.live == tr.start                     # nothing left behind
    assert tr.peak >= tr.start + 256 * 256 * 4     # the gradient existed, for a moment


def test_optimizer_state_counts():
    params = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
    state = opttx.adamw(1e-3).init(params)
    n = 64 * 64 + 64
    assert storage_bytes(state) == tensor_bytes(state)
    # mu and nu (fp32) plus a few scalar counters
    assert 8 * n <= storage_bytes(state) <= 8 * n + 64
    assert storage_bytes([params, params["w"][:3]]) == 4 * n
    assert storage_bytes(params, exclude=[params["b"]]) == 4 * 64 * 64


def test_device_filter():
    tr = LiveTensorTracker(device="meta")
    with tr:
        torch.empty(MiB)
    assert tr.peak == 0
    tr = LiveTensorTracker(device="cpu")
    with tr:
        torch.empty(MiB // 4)
    assert tr.peak == MiB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_cuda_max_memory_allocated():
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    tr = LiveTensorTracker(device="cuda")
    with tr:
        a = torch.empty(MiB // 4, device="cuda")
        b = a + 1
        del a
        c = b * 2
        del b, c
    torch.cuda.synchronize()
    assert tr.peak == torch.cuda.max_memory_allocated() - before == 2 * MiB
