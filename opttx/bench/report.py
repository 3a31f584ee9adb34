"""Comparison table, learning-rate sweep table, ``report.md``, ``results.json`` and, with
matplotlib, the plots
``loss.png`` (smoothed training loss; held-out loss in its own panel), ``step_time.png`` (the
per-step times of every optimizer) and ``memory.png`` (parameters, optimizer state and peak
live tensor bytes)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .sweep import multiplier_label
from .train import FINAL_LOSS_WINDOW, PROCESS_WARMUP_STEPS, TRACKED_STEPS, WARMUP_STEPS

MB = 1024 * 1024
# The training-loss plot shows an exponential moving average of the per-step losses, with
# this coefficient (debiased, so its first points are not pulled towards zero).
SMOOTHING = 0.9

Results = dict[str, dict[str, Any]]


def _columns(results: Results) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of the comparison table."""
    header = [
        "optimizer",
        "learning rate",
        "final train loss",
        "held-out loss",
        "step time ms (median)",
        "step time ms (quartiles)",
        "timed steps",
        "tokens/s",
        "optimizer state MB",
        "peak live tensors MB",
    ]
    rows = []
    for name, r in results.items():
        rate = _rate(r.get("learning_rate"))
        if "error" in r:
            rows.append([name, rate, f"failed: {r['error']}"] + [""] * (len(header) - 3))
            continue
        q1, q3 = r["step_time_quartiles_ms"]
        rows.append(
            [
                name,
                rate,
                f"{r['final_train_loss']:.4f}",
                f"{r['final_eval_loss']:.4f}",
                f"{r['step_time_ms']:.1f}",
                f"{q1:.1f}-{q3:.1f}",
                str(r["timed_steps"]),
                f"{r['tokens_per_s']:,.0f}",
                f"{r['state_bytes'] / MB:.2f}",
                f"{r['peak_live_bytes'] / MB:.1f}",
            ]
        )
    return header, rows


def _rate(rate: float | None) -> str:
    """A learning rate as the tables print it (three significant digits)."""
    return "" if rate is None else f"{rate:.3g}"


def _sweep_columns(results: Results, mark: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the sweep table: per swept optimizer, each rate tried with its
    validation loss (the chosen one between ``mark`` s), and the rate chosen."""
    swept = {name: r["sweep"] for name, r in results.items() if "sweep" in r}
    if not swept:
        return [], []
    labels = [multiplier_label(k) for k in next(iter(swept.values()))["powers"]]
    header = ["optimizer", *(f"lr {label}: validation loss" for label in labels), "chosen lr"]
    rows = []
    for name, s in swept.items():
        k = s["learning_rates"].index(s["chosen_learning_rate"])
        cells = []
        for i, (rate, loss) in enumerate(zip(s["learning_rates"], s["validation_losses"])):
            cell = f"{_rate(rate)}: {loss:.4f}"        # inf or nan: failed or diverged
            cells.append(f"{mark}{cell}{mark}" if i == k and len(labels) > 1 else cell)
        edge = ", edge of the grid" if s["at_edge"] else ""
        chosen = f"{_rate(s['chosen_learning_rate'])} ({labels[k]}{edge})"
        rows.append([name, *cells, chosen])
    return header, rows


def _text(header: list[str], rows: list[list[str]]) -> str:
    """Fixed-width table for the terminal."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    """GitHub-flavoured Markdown table."""
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(results: Results) -> str:
    """The comparison table, fixed-width for the terminal."""
    return _text(*_columns(results))


def markdown_table(results: Results) -> str:
    """The comparison table in GitHub-flavoured Markdown."""
    return _markdown(*_columns(results))


def sweep_text_table(results: Results) -> str:
    """The learning-rate sweep's table for the terminal (the chosen rate between ``*``);
    empty when nothing was swept."""
    header, rows = _sweep_columns(results, "*")
    return _text(header, rows) if rows else ""


def sweep_markdown_table(results: Results) -> str:
    """The learning-rate sweep's table in Markdown (the chosen rate in bold); empty when
    nothing was swept."""
    header, rows = _sweep_columns(results, "**")
    return _markdown(header, rows) if rows else ""


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats (diverged runs) by ``None`` so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def method(settings: dict[str, Any]) -> str:
    """How the table's figures were measured, for ``report.md``."""
    compiled = settings.get("compile") == "True"
    return (
        sweep_method(settings)
        + f"\n\n**Loss.** Final train loss is the mean of the last {FINAL_LOSS_WINDOW} steps; "
        "held-out loss is the mean over fixed windows of the corpus's held-out tail.\n\n"
        f"**Timing.** Before the first optimizer, {PROCESS_WARMUP_STEPS} untimed steps of a "
        "throw-away model warm the process up. Each optimizer then runs its first "
        f"{WARMUP_STEPS} steps untimed (state creation"
        + (", compilation" if compiled else "")
        + "), and the timed steps run round-robin: in each round every optimizer runs its "
        f"next {settings.get('block', '?')} steps, starting from a different optimizer each "
        "round, so that the machine's load falls on all of them alike. Each step (forward, "
        "backward, optimizer step, reading the loss) is timed alone; the table gives the "
        "median and the quartiles, tokens/s follows from the median."
        + (" Under --compile the opttx rows time a torch.compile'd functional step; the "
           "references always run eagerly." if compiled else "")
        + "\n\n**Memory.** Optimizer state counts every distinct tensor in the optimizer's "
        "state. Peak live tensors is this optimizer's own peak of live tensor bytes "
        "(parameters, gradients, optimizer state, activations and the batch) over its first "
        f"{TRACKED_STEPS} steps, run eagerly under `opttx.bench.memory.LiveTensorTracker`: "
        "exact at the granularity of ATen ops, blind to a kernel's own scratch memory and the "
        "allocator's caching, and independent of the other optimizers and of the process."
    )


def sweep_method(settings: dict[str, Any]) -> str:
    """How each row's learning rate was chosen, for ``report.md``."""
    if settings.get("sweep", "1") == "1":
        return ("**Learning rate.** Each optimizer trains at its default rate "
                "(`opttx.bench.optimizers.HYPERPARAMS`): no sweep was run.")
    return (
        f"**Learning rate.** Each optimizer first trained {settings.get('sweep_steps', '?')} "
        f"steps at each of {settings['sweep']} rates, its default times powers of 3, from the "
        "same initialisation, on the training stream less its tail, and the rate with the "
        "lowest loss on that tail (the validation split, as long as the held-out split) was "
        "kept for the row's run. The held-out split of the table never took part in the "
        "choice. A reference runs at its own default rate times its counterpart's chosen "
        "multiple."
    )


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
        ("Plots: `loss.png` (training loss smoothed, held-out loss), `step_time.png`, "
         "`memory.png`."),
        *_sweep_section(results),
        "## How it was measured",
        method(settings),
        "## Settings",
        "\n".join(setting_lines),
        "## Hyper-parameters",
        "\n".join(hyper_lines),
    ]
    if notes:
        sections += ["## Notes", "\n".join(f"- {n}" for n in notes)]
    (out_dir / "report.md").write_text("\n\n".join(sections) + "\n")
    return notes


def _sweep_section(results: Results) -> list[str]:
    """The sweep's heading, explanation and table in ``report.md``; none without a sweep."""
    table = sweep_markdown_table(results)
    if not table:
        return []
    return [
        "## Learning-rate sweep",
        ("Validation loss after each sweep run (the training stream's tail, not the "
         "held-out split above), per learning rate tried: the default rate times the column's "
         "factor. The lowest, in bold, is the rate of the row above. \"edge of the grid\": "
         "the chosen rate is the smallest or largest tried, so a better one may lie beyond "
         "it. inf or nan: that run failed or diverged."),
        table,
    ]


def smoothed(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average of ``values``."""
    out, avg = [], 0.0
    for t, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**t))
    return out


def write_plots(results: Results, out_dir: Path) -> list[str]:
    """Draw ``loss.png``, ``step_time.png`` and ``memory.png`` if matplotlib is importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [("matplotlib is not installed: loss.png, step_time.png and memory.png were "
                 "not written")]
    ok = {name: r for name, r in results.items() if "error" not in r}
    names = list(ok)
    colors = dict(zip(names, plt.get_cmap("tab20").colors * 2))

    def style(name: str) -> str:
        return "--" if "." in name else "-"       # references ("torch.AdamW") dashed

    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(13, 5))
    for name, r in ok.items():
        steps, losses = zip(*r["loss_curve"])
        train_ax.plot(steps, smoothed(list(losses)), style(name), color=colors[name],
                      linewidth=1.2, label=name)
        eval_steps, eval_losses = zip(*r["eval_curve"])
        eval_ax.plot(eval_steps, eval_losses, style(name), color=colors[name], marker="o",
                     markersize=3, label=name)
    train_ax.set(xlabel="step", ylabel="loss (nats/byte)",
                 title=f"Training loss (EMA, beta {SMOOTHING})")
    eval_ax.set(xlabel="step", ylabel="loss (nats/byte)", title="Held-out loss")
    for ax in (train_ax, eval_ax):
        ax.grid(alpha=0.3)
    eval_ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    version = tuple(int(v) for v in matplotlib.__version__.split(".")[:2])
    horizontal = {"orientation": "horizontal"} if version >= (3, 10) else {"vert": False}
    ax.boxplot([ok[n]["step_times_ms"] for n in names], **horizontal, showfliers=True,
               flierprops={"markersize": 3})
    ax.set_yticks(range(1, len(names) + 1), names)
    ax.invert_yaxis()
    ax.set(xlabel="ms per training step",
           title="Step time (timed steps, round-robin; box: quartiles, line: median)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out_dir / "step_time.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    rows = range(len(names))
    for k, (key, label) in enumerate([("param_bytes", "parameters"),
                                      ("state_bytes", "optimizer state"),
                                      ("peak_live_bytes", "peak live tensors")]):
        ax.barh([i + 0.27 * (k - 1) for i in rows], [ok[n][key] / MB for n in names],
                height=0.27, label=label)
    ax.set_yticks(list(rows), names)
    ax.invert_yaxis()
    ax.set(xlabel="MB", title="Memory per optimizer")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=120)
    plt.close(fig)
    return []
