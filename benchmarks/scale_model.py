"""The optimizer step at scale, modeled: bytes, collectives, flops per rank and an α–β time.

For a named model's parameters (`opttx.distributed.cost_model.MODELS`: Llama-3 8B and 70B from
Meta's published configs, GPT-3 XL 1.3 B from Brown et al.'s table 2.1) and each way of
running the optimizer (AdamW under ZeRO-2 and on FSDP shards; Muon/NorMuon on owners, plain and
overlapped in buckets; Muon by Gram all-reduces per iteration or once; MuonBP; Dion; Shampoo and
SOAP on owners), per rank per step: the bytes the busiest rank sends and receives, the
collectives issued, the busiest rank's flops, and the estimated time (communication +
computation, the overlap for the bucketed path) at each world size. Every figure comes from
`opttx.distributed.cost_model`, whose module docstring states the layouts and formulas; the
byte and call counts of the modes opttx runs are checked against gloo runs by
tests/test_scale_model.py. Defaults: float32 on the wire, an H100 node of 8 GPUs on NVLink
(450 GB/s, 3 us per hop), nodes on 400 Gb/s InfiniBand per GPU (50 GB/s, 10 us), 400 TFLOP/s
sustained for the optimizer's matmuls; all are options.

Examples:
  python benchmarks/scale_model.py                              # llama3-8b at 64 and 1024
  python benchmarks/scale_model.py --model llama3-70b --worlds 8,64,256,1024
  python benchmarks/scale_model.py --ib-gbps 25 --tflops 200 --itemsize 2
"""

from __future__ import annotations

import argparse

from opttx.distributed.cost_model import Interconnect, model_shapes, step_costs


def _fmt_bytes(b: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def table(model: str, world: int, net: Interconnect, **kw) -> str:
    leaves = model_shapes(model)
    n = sum(__import__("math").prod(lf.shape) for lf in leaves)
    lines = [f"{model} ({n / 1e9:.2f} B parameters), {world} ranks",
             f"{'mode':<20} {'sent/rank':>11} {'recv/rank':>11} {'colls':>6} "
             f"{'GFLOP/rank':>11} {'comm ms':>8} {'comp ms':>8} {'step ms':>8}  note"]
    for r in step_costs(leaves, world, net, **kw):
        calls = f"{r.calls:g}" if r.calls == int(r.calls) else f"{r.calls:.2f}"
        lines.append(f"{r.mode:<20} {_fmt_bytes(r.sent):>11} {_fmt_bytes(r.received):>11} "
                     f"{calls:>6} {r.flops / 1e9:>11.1f} {r.comm_s * 1e3:>8.2f} "
                     f"{r.compute_s * 1e3:>8.2f} {r.time_s * 1e3:>8.2f}  {r.note}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--worlds", default="64,1024")
    d = Interconnect()
    ap.add_argument("--nvlink-gbps", type=float, default=d.nvlink_gbps)
    ap.add_argument("--nvlink-latency-us", type=float, default=d.nvlink_latency_us)
    ap.add_argument("--ib-gbps", type=float, default=d.ib_gbps)
    ap.add_argument("--ib-latency-us", type=float, default=d.ib_latency_us)
    ap.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    ap.add_argument("--tflops", type=float, default=d.tflops)
    ap.add_argument("--itemsize", type=int, default=4, help="bytes per element on the wire")
    ap.add_argument("--buckets", type=int, default=4, help="on_owners buckets (overlap)")
    ap.add_argument("--muonbp-every", type=int, default=5)
    ap.add_argument("--dion-rank-fraction", type=float, default=0.25)
    ap.add_argument("--block", type=int, default=1024, help="Shampoo/SOAP block size")
    ap.add_argument("--frequency", type=int, default=10, help="Shampoo/SOAP refresh period")
    args = ap.parse_args()
    net = Interconnect(args.nvlink_gbps, args.nvlink_latency_us, args.ib_gbps,
                       args.ib_latency_us, args.gpus_per_node, args.tflops)
    print(f"# {net}")
    for w in (int(x) for x in args.worlds.split(",")):
        print(table(args.model, w, net, itemsize=args.itemsize, buckets=args.buckets,
                    muonbp_every=args.muonbp_every,
                    dion_rank_fraction=args.dion_rank_fraction, block=args.block,
                    frequency=args.frequency))
        print()


if __name__ == "__main__":
    main()
