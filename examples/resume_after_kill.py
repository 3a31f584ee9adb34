"""Checkpoint an opttx ZeRO (or on-owners) run with torch.distributed.checkpoint, kill a rank,
resume, and end bit-identical to a run that was never interrupted.

Run (CPU, gloo):

    RUNS=$(mktemp -d)     # a directory of your own (a fixed /tmp path is shared by all users)
    # an uninterrupted run: its final parameters go to $RUNS/ref/final.pt
    torchrun --standalone --nproc_per_node 2 examples/resume_after_kill.py --dir $RUNS/ref
    # rank 1 SIGKILLs itself at step 7; torchrun tears the group down and (--max-restarts 1)
    # starts it again; every rank resumes from the last complete checkpoint (step 4)
    torchrun --standalone --nproc_per_node 2 --max-restarts 1 examples/resume_after_kill.py \\
        --dir $RUNS/run --kill-at 7 --check $RUNS/ref/final.pt
    # resume the same checkpoints at another world size (a new run directory seeded with them)
    torchrun --standalone --nproc_per_node 4 examples/resume_after_kill.py --dir $RUNS/run4 \\
        --resume-from $RUNS/run/step_8

What it shows:

* the optimizer is ``opttx.distributed.zero(opttx.adamw(...))`` (``--mode owners``:
  ``sharded(on_owners(adamw))``): each rank holds the Adam moments of the parameters it owns;
* every ``--every`` steps each rank saves its share with
  ``opttx.distributed.save_checkpoint({"params": params, "optim":
  opttx.distributed.state_dict(state, params)}, dir)`` (``dcp.save`` plus the SHA-256 of every
  file, which ``load_checkpoint`` verifies before reading): the moments are keyed by
  parameter name and field (``optim.state.2.weight.0.mu``), so every rank writes exactly the
  leaves it owns and the step count once; rank 0 then records the step in ``latest`` (a
  checkpoint half-written when a rank dies is never read). ``latest`` is read back only if it
  names a ``step_N`` directory of the run directory itself that holds DCP's ``.metadata``:
  a corrupted or planted marker stops the run with a clear error instead of loading
  something else (DCP unpickles ``.metadata``: load checkpoints from trusted places only);
* on start, a run finding ``latest`` rebuilds its optimizer state with ``tx.init`` (at the
  current world size, so the owners may differ from the saved run's), checks the checkpoint
  against it (`opttx.distributed.check_checkpoint`: a checkpoint of another model or chain is
  refused, naming the mismatch), loads it with ``opttx.distributed.load_checkpoint`` (checksums
  verified first; nothing written unless every rank read its part) and goes on;
* after a restart the group is joined with
  ``opttx.distributed.init_process_group_for_restarts``, which gives each torchrun attempt a
  namespace of its own in the agent's store (the dead workers' addresses stay there);
* ``--check REF`` compares the final parameters with ``torch.equal`` against a reference run's
  ``final.pt`` and exits non-zero unless every tensor is identical. The data of a step depends
  only on the step and the rank, and gradients are averaged over the ranks, so a resumed run
  at the same world size repeats the uninterrupted one exactly.

The kill happens once: rank 1 leaves a ``killed`` marker in ``--dir`` before killing itself, so
the restarted run trains through step ``--kill-at``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad

import opttx
from opttx.distributed import (check_checkpoint, init_process_group_for_restarts,
                               load_checkpoint, load_state_dict, on_owners, save_checkpoint,
                               sharded, state_dict, zero)
from opttx.testing import exit_rank


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batch(step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch of a step: a function of (step, rank) only."""
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(size, 16, generator=gen)
    return x, torch.sin(x[:, :4]) + 0.1 * torch.randn(size, 4, generator=gen)


def make_tx(mode: str) -> opttx.GradientTransformation:
    adamw = opttx.adamw(3e-3, weight_decay=0.01)
    if mode == "zero":
        return zero(adamw, chunk_size_mb=0.01)
    # replicated parameters: average the gradients, then every leaf at one owner rank
    return sharded(opttx.chain(opttx.distributed.all_reduce_gradients(), on_owners(adamw)))


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_N`` checkpoint directory; refuses any other path (a corrupted or
    planted name) and a directory without DCP's ``.metadata`` (an incomplete checkpoint)."""
    if re.fullmatch(r"step_[0-9]+", path.name) is None:
        raise SystemExit(f"{path}: not a checkpoint of this script (expected a step_N "
                         "directory).")
    if not (path / ".metadata").is_file():
        raise SystemExit(f"{path}: no .metadata in it, so not a complete DCP checkpoint.")
    return int(path.name[len("step_"):])


def latest(directory: Path) -> Path | None:
    """The checkpoint the ``latest`` marker of ``directory`` names, validated: the marker
    must hold one ``step_N`` name of a complete checkpoint directly inside ``directory``."""
    marker = directory / "latest"
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    if re.fullmatch(r"step_[0-9]+", name) is None:
        raise SystemExit(f"{marker} holds {name[:60]!r}, not a step_N name: the marker is "
                         "corrupt; remove it (or the run directory) to start afresh.")
    path = directory / name
    checkpoint_step(path)
    return path


def save(directory: Path, step: int, params: dict, state: object) -> None:
    target = directory / f"step_{step}"
    # dcp.save plus the SHA-256 of every file, checked by load_checkpoint
    save_checkpoint({"params": params, "optim": state_dict(state, params)}, target)
    dist.barrier()
    if dist.get_rank() == 0:                 # only a complete checkpoint is ever "latest"
        tmp = directory / "latest.tmp"
        tmp.write_text(target.name)
        os.replace(tmp, directory / "latest")
    dist.barrier()


def restore(path: Path, tx: opttx.GradientTransformation, params: dict
            ) -> tuple[dict, object, int]:
    """Load ``path`` into a fresh ``tx.init`` state at this world size."""
    params = {k: v.clone() for k, v in params.items()}
    state = tx.init(params)
    sd = {"params": params, "optim": state_dict(state, params)}
    check_checkpoint(sd["optim"], str(path), "optim")      # metadata read through an allowlist
    # verifies the checksums (a flipped bit or an emptied file is refused on every rank),
    # then loads, writing nothing unless every rank read its part
    load_checkpoint(sd, checkpoint_id=str(path))
    state = load_state_dict(state, sd["optim"], params)
    return params, state, checkpoint_step(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="run directory (checkpoints)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="rank 1 SIGKILLs itself after this step (once per --dir)")
    parser.add_argument("--mode", choices=("zero", "owners"), default="zero")
    parser.add_argument("--resume-from", type=Path, default=None,
                        help="start from this checkpoint (another run's step_N directory)")
    parser.add_argument("--check", type=Path, default=None,
                        help="a reference final.pt: fail unless the final parameters equal it")
    args = parser.parse_args()

    # a store namespace of its own per torchrun restart (the agent's store keeps the dead
    # workers' addresses): opttx.distributed.init_process_group_for_restarts
    init_process_group_for_restarts("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    args.dir.mkdir(parents=True, exist_ok=True)

    model = build_model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = make_tx(args.mode)

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(functional_call(model, p, (x,)), y)

    source = latest(args.dir) or args.resume_from
    if source is not None:
        params, state, start = restore(source, tx, params)
        if rank == 0:
            print(f"resumed from {source} at step {start} on {world} ranks", flush=True)
    else:
        state, start = tx.init(params), 0

    for step in range(start, args.steps):
        x, y = batch(step, rank)
        grads = grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        params = opttx.apply_updates(params, updates)
        if rank == 0:
            print(f"step {step + 1}: loss {loss_fn(params, x, y).item():.6f}", flush=True)
        if (step + 1) % args.every == 0:
            save(args.dir, step + 1, params, state)
        killed = args.dir / "killed"
        if args.kill_at == step + 1 and rank == 1 and not killed.exists():
            killed.write_text("rank 1 killed itself\n")
            print(f"rank 1: SIGKILL at step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    status = 0
    if rank == 0:
        torch.save(params, args.dir / "final.pt")
        if args.check is not None:
            ref = torch.load(args.check, weights_only=True)
            same = all(torch.equal(params[k], ref[k]) for k in ref) and set(ref) == set(params)
            print(("MATCH" if same else "MISMATCH") + f": final parameters vs {args.check}",
                  flush=True)
            status = 0 if same else 1
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    # Exit without the interpreter's shutdown, where a gloo thread of a freed process group
    # can abort a rank that finished (see opttx.testing.exit_rank).
    exit_rank(main())
