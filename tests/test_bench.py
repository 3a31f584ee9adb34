"""The main job (`python -m opttx.bench`) runs end to end on a tiny budget and writes its
report: the table, the JSON figures, and the plots when matplotlib is present; every optimizer
is timed over the same number of steps and has its own peak of live tensor bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import opttx.bench
from opttx.bench.report import smoothed
from opttx.bench.train import WARMUP_STEPS

SMALL = ["--steps", "7", "--eval-every", "3", "--eval-batches", "1", "--corpus-bytes", "100000",
         "--d-model", "32", "--n-layers", "1", "--seq-len", "32", "--batch-size", "4",
         "--block", "2"]


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100 and len(data) > 5000, (path, width, height)


def test_bench_writes_a_report(tmp_path) -> None:
    out = tmp_path / "report"
    names = ("adamw", "sgd", "muon")
    results = opttx.bench.main([*SMALL, "--optimizers", ",".join(names), "--out", str(out)])
    assert list(results) == list(names)
    figures = json.loads((out / "results.json").read_text())
    for name in names:
        run = figures[name]
        assert run["final_train_loss"] < 6.0          # below uniform over 256 bytes (5.55) + noise
        assert len(run["loss_curve"]) == 7
        assert [s for s, _ in run["eval_curve"]] == [0, 3, 6, 7]
        # every optimizer is timed alike: the steps after the warm-up, each timed alone
        assert run["warmup_steps"] == WARMUP_STEPS
        assert run["timed_steps"] == len(run["step_times_ms"]) == 7 - WARMUP_STEPS
        assert all(t > 0 for t in run["step_times_ms"]) and run["tokens_per_s"] > 0
        q1, q3 = run["step_time_quartiles_ms"]
        assert q1 <= run["step_time_ms"] <= q3
        # its own peak holds the parameters, their gradients and the optimizer state at least
        assert run["peak_live_bytes"] > 2 * run["param_bytes"] + run["state_bytes"]
    # adamw keeps two moments, sgd with momentum one: the state sizes say so
    assert figures["adamw"]["state_bytes"] > 1.9 * figures["sgd"]["state_bytes"]
    report = (out / "report.md").read_text()
    for name in names:
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[5] == str(7 - WARMUP_STEPS)                        # timed steps
        assert all(float(c.replace(",", "").split("-")[0]) > 0 for c in cells[1:])
    assert "round-robin" in report and "LiveTensorTracker" in report
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (make test has it)")
    for png in ("loss.png", "step_time.png", "memory.png"):
        _assert_png(out / png)


def test_references_run_beside_opttx(tmp_path, capsys) -> None:
    """torch.optim.AdamW, configured like opttx.adamw, follows the same loss curve; a reference
    whose counterpart was not chosen is skipped with the reason printed."""
    results = opttx.bench.main([*SMALL, "--optimizers", "adamw", "--references",
                                "--out", str(tmp_path)])
    assert list(results) == ["adamw", "torch.AdamW"]
    ours, theirs = results["adamw"], results["torch.AdamW"]
    assert theirs["hyperparams"]["reference_for"] == "adamw"
    for (_, a), (_, b) in zip(ours["loss_curve"], theirs["loss_curve"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    for run in (ours, theirs):        # exp_avg and exp_avg_sq (plus the step counts)
        assert 2 * run["param_bytes"] <= run["state_bytes"] < 2.1 * run["param_bytes"]
    assert theirs["timed_steps"] == ours["timed_steps"]
    assert "skipping reference heavyball.SOAP: its counterpart 'soap'" in capsys.readouterr().err


def test_state_format_rows_train_beside_adamw(tmp_path) -> None:
    """The low-bit rows (adamw_4bit, and AdamW with quantize_state's e4m3 and bf16_ecc formats,
    built by the bench) run with adamw's rate and weight decay; at d_model 64 the five
    matrices (65,536 of 67,776 parameters) are compressed, so the state is a measured 0.17
    (4-bit), 0.28 (e4m3) and 0.76 (bf16 + 8-bit correction) of fp32 AdamW's."""
    small = [*SMALL]
    small[small.index("--d-model") + 1] = "64"
    names = ("adamw", "adamw_4bit", "adamw_fp8", "adamw_bf16_ecc")
    results = opttx.bench.main([*small, "--optimizers", ",".join(names), "--out",
                                str(tmp_path)])
    assert list(results) == list(names)
    fp32 = results["adamw"]["state_bytes"]
    for name, (low, high) in {"adamw_4bit": (0.15, 0.19), "adamw_fp8": (0.26, 0.30),
                              "adamw_bf16_ecc": (0.74, 0.78)}.items():
        run = results[name]
        assert run["hyperparams"] == {"learning_rate": 1e-3, "weight_decay": 1e-4}
        assert run["final_train_loss"] < 6.0
        assert low <= run["state_bytes"] / fp32 <= high, (name, run["state_bytes"] / fp32)


def test_smoothed_loss_is_a_debiased_moving_average() -> None:
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert smoothed([0.0, 1.0], beta=0.5) == pytest.approx([0.0, 0.5 / 0.75])


def test_too_few_steps_to_time_is_refused() -> None:
    with pytest.raises(SystemExit):
        opttx.bench.main(["--steps", str(WARMUP_STEPS)])


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
