"""The main job (`python -m opttx.bench`) runs end to end on a tiny budget and writes its
report: the table, the JSON figures, and the plots when matplotlib is present."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import opttx.bench


def test_bench_writes_a_report(tmp_path) -> None:
    out = tmp_path / "report"
    results = opttx.bench.main(["--steps", "6", "--optimizers", "adamw,sgd",
                                "--eval-every", "3", "--out", str(out)])
    assert set(results) == {"adamw", "sgd"}
    figures = json.loads((out / "results.json").read_text())
    for name in ("adamw", "sgd"):
        run = figures[name]
        assert run["final_train_loss"] < 6.0          # below uniform over 256 bytes (5.55) + noise
        assert run["state_bytes"] > 0 and run["tokens_per_s"] > 0
        assert len(run["loss_curve"]) == 6
    # adamw keeps two moments, sgd with momentum one: the state sizes say so
    assert figures["adamw"]["state_bytes"] > 1.9 * figures["sgd"]["state_bytes"]
    assert "adamw" in (out / "report.md").read_text()
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (make test has it)")
    for png in ("loss.png", "memory.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", png
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width > 100 and height > 100 and len(data) > 5000, (png, width, height)


TINY = ["--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--corpus-bytes", "100000",
        "--d-model", "64", "--n-layers", "1", "--seq-len", "64", "--batch-size", "8",
        "--optimizers", "adamw,shampoo"]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return opttx.bench.main([*TINY, "--out", str(tmp_path_factory.mktemp("single"))])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["zero", "dp"])
def test_bench_under_torchrun_matches_the_single_process_run(tmp_path, mode, single) -> None:
    """Two ranks, each on half of every global batch, report the single-process loss curve;
    under zero each rank holds about half of the optimizer state, under dp all of it."""
    out = tmp_path / mode
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "-m", "opttx.bench", *TINY, "--parallel", mode, "--out", str(out)],
        capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads((out / "results.json").read_text())
    for name in ("adamw", "shampoo"):
        got, want = figures[name], single[name]
        for (_, a), (_, b) in zip(got["loss_curve"], want["loss_curve"], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        per_rank = got["state_bytes_per_rank"]
        assert len(per_rank) == 2
        if mode == "zero":
            assert sum(per_rank) == pytest.approx(want["state_bytes"], rel=0.01)
            assert max(per_rank) < 0.6 * want["state_bytes"]
        else:
            assert per_rank == [want["state_bytes"]] * 2
