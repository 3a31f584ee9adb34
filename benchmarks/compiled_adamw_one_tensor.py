"""Compiled opttx AdamW (fullgraph, donated state) against torch.optim.AdamW(fused=True) on one
32 M-element float32 tensor, 10 steps after 3: the bisection test of benchmarks/RESULTS.md
("compiled AdamW regressed to 1.9x"). Run: .venv/bin/python benchmarks/compiled_adamw_one_tensor.py
(with PYTHONPATH=<a worktree> to time another commit)."""
import torch, time, opttx
n=32_000_000
p={"x": torch.randn(n)}; g={"x": torch.randn(n)*1e-3}
tx=opttx.adamw(1e-3, weight_decay=0.01)
s=tx.init(p)
def step(g, s, p, out):
    u, new = tx.update(g, s, p)
    opttx.tree.tree_copy_(s, new); opttx.tree.tree_copy_(out, u)
c=torch.compile(step, fullgraph=True)
out={"x": torch.empty(n)}
with opttx.donating():
    for _ in range(3): c(g, s, p, out)
    t=time.perf_counter()
    for _ in range(10): c(g, s, p, out)
    print("opttx compiled", (time.perf_counter()-t)/10)
P=torch.nn.Parameter(p["x"].clone()); P.grad=g["x"].clone()
o=torch.optim.AdamW([P], lr=1e-3, weight_decay=0.01, fused=True)
for _ in range(3): o.step()
t=time.perf_counter()
for _ in range(10): o.step()
print("torch fused", (time.perf_counter()-t)/10)
