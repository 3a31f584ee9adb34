"""Eager per-step pytree overhead at many small leaves: torch.utils._pytree vs optree.

opttx's tree module is built on torch's pytree (docs/design.md, section 4). This measures the
pytree work one eager update does, per library, side by side in one run, on a dict of N small
leaves: the operations an `adam` update performs on its trees (flatten the updates and each
tree-shaped state field, check the structures match, unflatten the outputs), and a whole
eager `opttx.adam` update for scale.

    python benchmarks/pytree_overhead.py [--leaves 1000] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils._pytree as torch_pytree

import opttx


def best_of(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after a warm-up)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tree = {f"layer{i}.weight": torch.randn(4) for i in range(args.leaves)}
    mu = {k: torch.zeros_like(v) for k, v in tree.items()}
    nu = {k: torch.zeros_like(v) for k, v in tree.items()}

    def torch_step():
        leaves, spec = torch_pytree.tree_flatten(tree)                 # the updates
        for state_tree in (mu, nu):                                    # matched state fields
            other, other_spec = torch_pytree.tree_flatten(state_tree)
            assert other_spec == spec
        torch_pytree.tree_unflatten(leaves, spec)                      # updates out
        torch_pytree.tree_unflatten(leaves, spec)                      # mu out
        torch_pytree.tree_unflatten(leaves, spec)                      # nu out

    rows = [("torch.utils._pytree", best_of(torch_step, args.repeats))]
    try:
        import optree
    except ImportError:
        optree = None
    if optree is not None:
        def optree_step():
            leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
            for state_tree in (mu, nu):
                other, other_spec = optree.tree_flatten(state_tree, none_is_leaf=True)
                assert other_spec == spec
            optree.tree_unflatten(spec, leaves)
            optree.tree_unflatten(spec, leaves)
            optree.tree_unflatten(spec, leaves)
        rows.append((f"optree {optree.__version__}", best_of(optree_step, args.repeats)))

        # optree sorts dict keys; opttx's trees keep the user's order (ZeRO packs leaves in
        # init order, reductions sum in tree order): the insertion-ordered mode is the fair row
        def optree_ordered_step():
            with optree.dict_insertion_ordered(True, namespace="opttx"):
                leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace="opttx")
                for state_tree in (mu, nu):
                    other, other_spec = optree.tree_flatten(state_tree, none_is_leaf=True,
                                                            namespace="opttx")
                    assert other_spec == spec
                optree.tree_unflatten(spec, leaves)
                optree.tree_unflatten(spec, leaves)
                optree.tree_unflatten(spec, leaves)
        rows.append(("optree, insertion order", best_of(optree_ordered_step, args.repeats)))

    tx = opttx.adam(1e-3)
    state = tx.init(tree)
    grads = {k: torch.randn_like(v) for k, v in tree.items()}
    step = best_of(lambda: tx.update(grads, state, tree), max(20, args.repeats // 10))

    print(f"{args.leaves} leaves of 4 floats, one thread, median of {args.repeats} runs")
    print(f"{'library':24s} {'tree work of one adam update':>30s} {'vs torch':>9s} "
          f"{'share of the update':>20s}")
    base = rows[0][1]
    for name, seconds in rows:
        print(f"{name:24s} {seconds * 1e3:27.3f} ms {seconds / base:8.2f}x "
              f"{seconds / step:19.1%}")
    print(f"{'opttx.adam eager update':24s} {step * 1e3:27.3f} ms")


if __name__ == "__main__":
    main()
