"""examples/resume_after_kill.py: a ZeRO run checkpointed with DCP, one rank SIGKILLed, torchrun
restarting the group, ends with parameters ``torch.equal`` to an uninterrupted run.

Launched as a user would (``python -m torch.distributed.run`` of this interpreter, 2 CPU
processes, gloo). Three launches of about 15-20 s each on 2 cores: the reference run, the run
that is killed and restarted (``--max-restarts 1``, ``--check`` against the reference), and a
4-rank run resuming from the 2-rank checkpoint (another world size: other owners).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "resume_after_kill.py"


def _torchrun(nproc: int, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", f"--max-restarts={restarts}", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(200)
def test_killed_run_resumes_bit_identically(tmp_path: Path) -> None:
    ref = _torchrun(2, "--dir", str(tmp_path / "ref"), "--steps", "12", "--every", "4")
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-4000:]
    assert (tmp_path / "ref" / "final.pt").exists()

    run = _torchrun(2, "--dir", str(tmp_path / "run"), "--steps", "12", "--every", "4",
                    "--kill-at", "7", "--check", str(tmp_path / "ref" / "final.pt"),
                    restarts=1)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "rank 1: SIGKILL at step 7" in run.stdout, output[-4000:]
    assert "exitcode: -9" in run.stderr, output[-4000:]            # torchrun saw the kill
    assert re.search(r"^resumed from \S+step_4 at step 4 on 2 ranks$", run.stdout,
                     re.MULTILINE), output[-4000:]
    assert re.search(r"^MATCH: final parameters", run.stdout, re.MULTILINE), output[-4000:]
    # the steps after the restart repeat the reference's losses exactly
    losses = dict(re.findall(r"^step (\d+): loss (\S+)$", ref.stdout, re.MULTILINE))
    resumed = run.stdout.split("resumed from")[1]
    again = dict(re.findall(r"^step (\d+): loss (\S+)$", resumed, re.MULTILINE))
    assert sorted(map(int, again)) == list(range(5, 13))
    assert all(losses[k] == v for k, v in again.items())

    wider = _torchrun(4, "--dir", str(tmp_path / "w4"), "--steps", "12", "--resume-from",
                      str(tmp_path / "run" / "step_8"))
    assert wider.returncode == 0, (wider.stdout + wider.stderr)[-4000:]
    assert "resumed from" in wider.stdout and "at step 8 on 4 ranks" in wider.stdout
    assert re.search(r"^step 12: loss \S+$", wider.stdout, re.MULTILINE)
