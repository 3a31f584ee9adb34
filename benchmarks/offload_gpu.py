"""A ~1 B GPT training step on one GPU with the optimizer state offloaded to the host.

Rows, all AdamW (lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1) on the same
bfloat16 model (hidden 2048, 18 layers, 16 heads, vocabulary 32000, untied head: 1.04 B
parameters), batch 4 x 512 tokens, bf16 compute:

  none            torch.optim.AdamW(fused=True) on the GPU: no offload
  torchao         torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True):
                  every tensor of 4096 elements or more offloaded (state, a bf16 copy of the
                  parameter and its gradient in pinned memory), its CPU step in step()
  opttx f=0       offload(adamw, 0.0): opttx's chunks, all on the GPU (the machinery's cost)
  opttx f=0.5     offload(adamw, 0.5, layout="flat", compile=True, overlap=True): half of
                  the state (the last chunks) on the host, their steps started from backward
  opttx f=1       the same with all of the state on the host
  opttx f=1 DPU   offload(adamw, 1.0, layout="flat", compile=True, delayed=True): the host
                  steps run behind the next forward and backward (a different optimizer:
                  one step late; see the guide)
  opttx f=1 master offload(adamw, 1.0, layout="flat", compile=True, overlap=True,
                  master_params=True): a float32 master copy of the bf16 parameters on the
                  host, stepped there from backward; the bf16 values go up instead of the
                  updates (ZeRO-Offload's arrangement)
  opttx f=1 master grouped  the same without overlap, the host steps run by update in
                  groups of 256 MiB of parameters (host_group_mb=256: one compiled call per
                  group, each group once all its copies have landed)

opttx runs the functional loop over the model's own parameters (``init(dict(model.
named_parameters()))``, as ``overlap`` needs), donating its state, with float32 state for the
bf16 parameters (opttx's rule 3; torchao's CPU AdamW keeps bf16 state for bf16 parameters).
Per row: a fresh model (same seed), 3 untimed steps (compiles, pinned buffers), then
``--steps`` timed steps (CUDA synchronised around each; the median is reported) after
``torch.cuda.reset_peak_memory_stats``: peak device memory is ``max_memory_allocated`` over
the timed steps. Targets: opttx's peak memory <= torchao's at f=1, step time <=
1.1x torchao's. The loss after the last step is printed as a sanity check (all rows but the
DPU one and the master one, whose float32 master keeps the small updates, follow the same
trajectory up to rounding).

Example:
  python benchmarks/offload_gpu.py --steps 10            # about 3 to 5 minutes on an H100
  python benchmarks/offload_gpu.py --layers 2 --steps 3  # a quick look
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import git_state  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import opttx  # noqa: E402
from opttx.distributed import offload  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, d: int = 2048, heads: int = 16, vocab: int = 32000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return GPT(layers).to("cuda", torch.bfloat16)


def torch_row(model: nn.Module, opt: torch.optim.Optimizer):
    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def opttx_row(model: nn.Module, tx: opttx.GradientTransformation):
    params = dict(model.named_parameters())
    state = [tx.init(params)]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = model(tokens)
        loss.backward()
        with torch.no_grad(), opttx.donating():
            updates, state[0] = tx.update({k: p.grad for k, p in params.items()}, state[0],
                                          params)
            opttx.apply_updates_(params, updates)
        for p in params.values():
            p.grad = None
        return loss
    return step


def adamw() -> opttx.GradientTransformation:
    return opttx.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)


def rows(only: set[str] | None):
    def torchao(model):
        from torchao.optim import CPUOffloadOptimizer
        return torch_row(model, CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW,
                                                    lr=LR, betas=BETAS, eps=EPS,
                                                    weight_decay=WD, fused=True))
    table = {
        "none": lambda m: torch_row(m, torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS,
                                                         eps=EPS, weight_decay=WD, fused=True)),
        "torchao": torchao,
        "opttx f=0": lambda m: opttx_row(m, offload(adamw(), 0.0)),
        "opttx f=0.5": lambda m: opttx_row(m, offload(adamw(), 0.5, layout="flat",
                                                      compile=True, overlap=True)),
        "opttx f=1": lambda m: opttx_row(m, offload(adamw(), 1.0, layout="flat",
                                                    compile=True, overlap=True)),
        "opttx f=1 DPU": lambda m: opttx_row(m, offload(adamw(), 1.0, layout="flat",
                                                        compile=True, delayed=True)),
        "opttx f=1 master": lambda m: opttx_row(m, offload(adamw(), 1.0, layout="flat",
                                                           compile=True, overlap=True,
                                                           master_params=True)),
        "opttx f=1 master grouped": lambda m: opttx_row(m, offload(
            adamw(), 1.0, layout="flat", compile=True, master_params=True,
            host_group_mb=256)),
    }
    return {k: v for k, v in table.items() if only is None or k in only}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma-separated row names")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, opttx {git_state()}",
          flush=True)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32000, (args.batch, args.seq), generator=gen).cuda()
               for _ in range(args.steps + 3)]
    only = None if args.only is None else set(args.only.split(","))
    results = {}
    for name, build in rows(only).items():
        model = make_model(args.layers)
        n = sum(p.numel() for p in model.parameters())
        t = time.perf_counter()
        step = build(model)
        for tokens in batches[:3]:
            step(tokens)
        torch.cuda.synchronize()
        warm = time.perf_counter() - t
        torch.cuda.reset_peak_memory_stats()
        times = []
        for tokens in batches[3:]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step(tokens)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() / 2**30
        results[name] = (statistics.median(times), peak)
        print(f"{name:<26} {n / 1e9:.2f} B params: step {statistics.median(times):.3f} s "
              f"(min {min(times):.3f}), peak {peak:.2f} GiB, loss {float(loss):.4f}, "
              f"warm-up {warm:.0f} s", flush=True)
        del model, step
        gc.collect()
        torch.cuda.empty_cache()
    if "torchao" in results:
        ref_t, ref_m = results["torchao"]
        print(f"\n{'row':<26}{'step s':>9}{'peak GiB':>10}{'t / torchao':>13}{'mem / torchao':>15}")
        for name, (t, m) in results.items():
            print(f"{name:<26}{t:>9.3f}{m:>10.2f}{t / ref_t:>13.2f}{m / ref_m:>15.2f}")


if __name__ == "__main__":
    main()
