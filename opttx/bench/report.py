"""Comparison table, ``report.md``, ``results.json`` and optional plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .train import FINAL_LOSS_WINDOW, WARMUP_STEPS

MB = 1024 * 1024

Results = dict[str, dict[str, Any]]


def _columns(results: Results) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of the comparison table."""
    kinds = {r["peak_memory_kind"] for r in results.values() if "error" not in r}
    header = [
        "optimizer",
        "final train loss",
        "held-out loss",
        "tokens/s",
        "step time ms",
        "optimizer state MB",
        f"peak memory MB ({', '.join(sorted(kinds)) or 'n/a'})",
    ]
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, f"failed: {r['error']}"] + [""] * (len(header) - 2))
            continue
        rows.append(
            [
                name,
                f"{r['final_train_loss']:.4f}",
                f"{r['final_eval_loss']:.4f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['step_time_ms']:.1f}",
                f"{r['state_bytes'] / MB:.2f}",
                f"{r['peak_memory_bytes'] / MB:.0f}",
            ]
        )
    return header, rows


def text_table(results: Results) -> str:
    """Fixed-width table for the terminal."""
    header, rows = _columns(results)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(results: Results) -> str:
    """GitHub-flavoured Markdown table."""
    header, rows = _columns(results)
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats (diverged runs) by ``None`` so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def write_report(results: Results, out_dir: Path, settings: dict[str, Any]) -> list[str]:
    """Write ``report.md``, ``results.json`` and, with matplotlib, the plots.

    Returns notes for the user (e.g. that plots were skipped).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    notes = write_plots(results, out_dir)
    setting_lines = [f"- `{k}`: {v}" for k, v in settings.items()]
    hyper_lines = [f"- `{name}`: {r['hyperparams']}" for name, r in results.items()]
    sections = [
        "# opttx optimizer benchmark",
        "Byte-level GPT trained on the Python standard library's source.",
        "## Results",
        markdown_table(results),
        f"Final train loss is the mean of the last {FINAL_LOSS_WINDOW} steps; held-out loss is the "
        "mean over fixed windows of the corpus's held-out tail; step time and tokens/s exclude "
        f"the first {WARMUP_STEPS} (warm-up and compilation) steps; optimizer state counts every "
        "distinct tensor in the opttx state.",
        "## Settings",
        "\n".join(setting_lines),
        "## Hyper-parameters",
        "\n".join(hyper_lines),
    ]
    if notes:
        sections += ["## Notes", "\n".join(f"- {n}" for n in notes)]
    (out_dir / "report.md").write_text("\n\n".join(sections) + "\n")
    return notes


def write_plots(results: Results, out_dir: Path) -> list[str]:
    """Draw ``loss.png`` and ``memory.png`` if matplotlib is importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["matplotlib is not installed: loss.png and memory.png were not written"]
    ok = {name: r for name, r in results.items() if "error" not in r}

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in ok.items():
        steps, losses = zip(*r["loss_curve"])
        (line,) = ax.plot(steps, losses, alpha=0.6, linewidth=1, label=f"{name} train")
        eval_steps, eval_losses = zip(*r["eval_curve"])
        ax.plot(eval_steps, eval_losses, "o--", color=line.get_color(), label=f"{name} held-out")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="Training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(ok)
    ax.bar(names, [ok[n]["state_bytes"] / MB for n in names])
    ax.set(ylabel="MB", title="Optimizer state")
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=120)
    plt.close(fig)
    return []
