"""The main job (`python -m opttx.bench`) runs end to end on a tiny budget and writes its
report: the table, the JSON figures, and the plots when matplotlib is present; every optimizer
is timed over the same number of steps and has its own peak of live tensor bytes, and trains at
the learning rate of its sweep with the lowest validation loss, which the report shows."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import opttx.bench
from opttx.bench.data import Corpus
from opttx.bench.optimizers import HYPERPARAMS
from opttx.bench.report import smoothed
from opttx.bench.sweep import best_index, multiplier_label, multipliers, powers
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
        assert cells[6] == str(7 - WARMUP_STEPS)                        # timed steps
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
    # not swept itself: at its own rate times its counterpart's chosen multiple (the same rate)
    assert "sweep" not in theirs and theirs["learning_rate"] == ours["learning_rate"]
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
    small = [*SMALL, "--no-sweep"]      # every row at adamw's rate: only the format differs
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


def test_sweep_keeps_the_best_validation_loss_and_the_report_shows_it(tmp_path) -> None:
    """Each optimizer's final run trains at the rate of its sweep with the lowest validation
    loss; the table names that rate and the sweep's table shows every rate tried with its
    loss, the chosen one in bold."""
    out = tmp_path / "report"
    names = ("adamw", "sgd")
    results = opttx.bench.main([*SMALL, "--optimizers", ",".join(names), "--out", str(out)])
    figures = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    sweep_part = report[report.index("## Learning-rate sweep"):report.index("## How it")]
    for name in names:
        sweep = results[name]["sweep"]
        assert sweep == figures[name]["sweep"]
        assert sweep["steps"] == 7 // 3
        base = HYPERPARAMS[name]["learning_rate"]
        assert sweep["learning_rates"] == [base / 3, base, base * 3]
        losses = sweep["validation_losses"]
        best = min(range(3), key=losses.__getitem__)
        assert all(math.isfinite(v) for v in losses) and len(set(losses)) == 3
        assert sweep["chosen_learning_rate"] == sweep["learning_rates"][best]
        assert sweep["at_edge"] == (best != 1)
        chosen = sweep["chosen_learning_rate"]
        assert results[name]["learning_rate"] == results[name]["hyperparams"]["learning_rate"]
        assert results[name]["learning_rate"] == chosen
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        assert row.split("|")[2].strip() == f"{chosen:.3g}"
        sweep_row = next(line for line in sweep_part.splitlines()
                         if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in sweep_row.strip("|").split("|")]
        assert cells[1:4] == [(f"**{rate:.3g}: {loss:.4f}**" if i == best
                               else f"{rate:.3g}: {loss:.4f}")
                              for i, (rate, loss) in enumerate(zip(sweep["learning_rates"],
                                                                   losses))]
        label = ("x1/3", "x1", "x3")[best]
        assert cells[4] == f"{chosen:.3g} ({label}" + (", edge of the grid)" if best != 1
                                                      else ")")
    assert "lr x1/3: validation loss" in sweep_part


def test_no_sweep_trains_at_the_default_rates(tmp_path) -> None:
    results = opttx.bench.main([*SMALL, "--optimizers", "adamw", "--no-sweep",
                                "--out", str(tmp_path)])
    assert "sweep" not in results["adamw"]
    assert results["adamw"]["learning_rate"] == HYPERPARAMS["adamw"]["learning_rate"]
    report = (tmp_path / "report.md").read_text()
    assert "## Learning-rate sweep" not in report and "no sweep was run" in report


def test_sweep_grid_and_choice() -> None:
    assert multipliers(1) == [1.0]
    assert powers(3) == [-1, 0, 1] and multipliers(3) == [1 / 3, 1.0, 3.0]
    assert multipliers(5) == [1 / 9, 1 / 3, 1.0, 3.0, 9.0]
    assert [multiplier_label(k) for k in powers(5)] == ["x1/9", "x1/3", "x1", "x3", "x9"]
    with pytest.raises(ValueError):
        multipliers(2)
    # the lowest finite loss, the first of equal ones; a failed (inf) or diverged (nan) run is
    # never chosen; with none finite, the default
    assert best_index([2.5, 2.4, 2.6], default=1) == 1
    assert best_index([2.4, 2.4, 2.6], default=1) == 0
    assert best_index([2.5, math.nan, math.inf], default=1) == 0
    assert best_index([math.nan, math.inf, math.nan], default=1) == 1
    with pytest.raises(SystemExit):
        opttx.bench.main(["--sweep", "2"])


def test_validation_split_is_cut_from_the_training_stream() -> None:
    """The sweep scores on the training stream's tail, as long as the held-out split: the
    held-out bytes of the final table never take part in the choice."""
    data = torch.arange(100, dtype=torch.uint8)
    corpus = Corpus(train=data[:90], heldout=data[90:])
    sweep = corpus.validation_split()
    assert torch.equal(sweep.train, data[:80]) and torch.equal(sweep.heldout, data[80:90])
    with pytest.raises(ValueError):
        Corpus(train=data[:50], heldout=data[50:]).validation_split()


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
        assert got["learning_rate"] == want["learning_rate"]     # the sweep chose alike
        for (_, a), (_, b) in zip(got["loss_curve"], want["loss_curve"], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        per_rank = got["state_bytes_per_rank"]
        assert len(per_rank) == 2
        if mode == "zero":
            assert sum(per_rank) == pytest.approx(want["state_bytes"], rel=0.01)
            assert max(per_rank) < 0.6 * want["state_bytes"]
        else:
            assert per_rank == [want["state_bytes"]] * 2
