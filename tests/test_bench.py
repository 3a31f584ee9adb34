"""The main job (`python -m opttx.bench`) runs end to end on a tiny budget and writes its
report: the table, the JSON figures, and the plots when matplotlib is present."""

from __future__ import annotations

import json

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
