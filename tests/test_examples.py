"""The examples run and show what their docstrings say.

`examples/tp_dp_train.py` is launched as a user would (``torchrun``, here through ``python -m
torch.distributed.run`` of this interpreter) on 4 CPU processes, a 2 x 2 (dp, tp) mesh, with
``--check``: it exits non-zero unless the tensor-parallel x data-parallel loss curve equals
the single-process one to 1e-4 at every step (also with ``--zero 1|2``) and the replicated
gradients agree across the tensor-parallel ranks. Each run takes about 15 s on 2 cores.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5


def _torchrun(script: str, nproc: int, *args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(ROOT / script), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("optimizer,zero", [("adafactor", 0), ("lamb", 0), ("came", 2),
                                            ("galore_adamw", 1)])
def test_tp_dp_train_matches_single_process(optimizer: str, zero: int) -> None:
    """TP 2 x DP 2 with ``sharded(chain(all_reduce_gradients(dp), alias))``, or with ZeRO
    ``sharded(zero(alias, dp, stage))`` (GaLore on owner ranks of the TP group), gives the loss
    curve of the plain alias on one process with the whole global batch."""
    run = _torchrun("examples/tp_dp_train.py", 4, "--tp", "2", "--dp", "2", "--steps",
                    str(STEPS), "--optimizer", optimizer, "--zero", str(zero), "--check",
                    timeout=140)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    match = re.search(r"^MATCH: loss curves agree to max relative difference (\S+) "
                      r"\(tolerance 1e-04\) over (\d+) steps$", run.stdout, re.MULTILINE)
    assert match, output[-4000:]
    assert float(match.group(1)) <= 1e-4 and int(match.group(2)) == STEPS
    rows = re.findall(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$", run.stdout, re.MULTILINE)
    assert [int(r[0]) for r in rows] == list(range(STEPS)), run.stdout
    for _, ours, theirs, _ in rows:
        assert abs(float(ours) - float(theirs)) <= 1e-4 * abs(float(theirs))
    assert "plain gradients across TP ranks: max relative difference" in run.stdout
    assert f"{optimizer}: tp=2 dp=2 zero={zero}," in run.stdout
