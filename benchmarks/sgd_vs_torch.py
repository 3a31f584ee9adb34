"""opttx.Optimizer(sgd(0.03, 0.9)) against torch.optim.SGD(lr=0.03, momentum=0.9) on the bench
GPT, step by step: the largest parameter difference after each of 12 steps (benchmarks/RESULTS.md,
"The demo again after the declared core"). Run: .venv/bin/python benchmarks/sgd_vs_torch.py"""
import torch, opttx, copy
from opttx.bench.data import VOCAB_SIZE, Corpus, train_batches
from opttx.bench.model import GPTConfig, GPT
torch.manual_seed(0)
cfg=GPTConfig(vocab_size=VOCAB_SIZE, seq_len=128, d_model=128, n_layers=2, n_heads=4)
m1=GPT(cfg); m2=copy.deepcopy(m1)
o1=opttx.Optimizer(m1.named_parameters(), opttx.sgd(0.03,0.9))
o2=torch.optim.SGD(m2.parameters(), lr=0.03, momentum=0.9)
corpus = Corpus.from_stdlib(3_000_000, 0.05)
b=train_batches(corpus.train, 16, 128, 0, torch.device("cpu"))
print(o1.param_groups[0].keys(), {k:v for k,v in o1.param_groups[0].items() if k not in ("params","tx","transform")})
import torch.nn.functional as F
for step in range(12):
    x,y=next(b)
    for m,o in ((m1,o1),(m2,o2)):
        o.zero_grad(); loss=F.cross_entropy(m(x).flatten(0,1), y.flatten()); loss.backward(); o.step()
    d=max((p1-p2).abs().max().item() for p1,p2 in zip(m1.parameters(), m2.parameters()))
    print(step, d)
