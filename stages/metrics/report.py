"""The evaluate stage's plots (PNG + DVC plot data) and markdown report.

    paths = write_plots(out / "plots", table, loss_histories={"sft": [...], ...}, rewards={"sft": [...], ...})
    (out / "report.md").write_text(markdown_report(table, paths, notes=[...]))

PNGs are drawn with matplotlib's Agg backend (no display). The DVC plot data are small
JSON files of records that `dvc plots show` renders (see the `plots:` of dvc.yaml).
"""
from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = ("model", "n", "accuracy", "bleu", "rouge1", "rouge2", "rougeL", "reward", "win_rate", "format",
           "mean_completion_tokens")
HEADLINE = ("accuracy", "reward", "win_rate")  # per model, what `dvc metrics show` prints
HEADLINE_MODELS = ("base", "sft", "policy", "merged")  # evaluate's rows (base: evaluate.baseline; policy: a method)


def headline_paths(output_dir: str | Path) -> dict[str, Path]:
    """`<run.output_dir>/metrics/models/<model>.json` of HEADLINE per model, so `dvc metrics show` prints
    one short row per model. Beside the stages' flat `metrics/<stage>.json`, outside every DVC-cached
    output and tracked by git: a commit carries them. A fixed set of files (DVC's run-cache restores
    uncached single files, not folders)."""
    return {m: Path(output_dir) / "metrics" / "models" / f"{m}.json" for m in HEADLINE_MODELS}


def write_headline(output_dir: str | Path, table: list[dict[str, Any]]) -> None:
    """One file per model of HEADLINE_MODELS from the evaluation table; nulls for a model not evaluated."""
    rows = {r["model"]: r for r in table}
    for model, path in headline_paths(output_dir).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({c: rows.get(model, {}).get(c) for c in HEADLINE}, indent=2) + "\n")
        tmp.replace(path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; never opens a window
    import matplotlib.pyplot as plt

    return plt


def losses(log_history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """{step, loss} records of a Trainer's log_history (training loss lines only)."""
    return [{"step": h["step"], "loss": h["loss"]} for h in log_history if "loss" in h and "step" in h]


def write_plots(folder: Path, table: list[dict[str, Any]], *, loss_histories: dict[str, list[dict]],
                rewards: dict[str, list[float]]) -> dict[str, Path]:
    """Write loss_curves.png, reward_distribution.png, accuracy.png and their DVC data; returns {name: path}."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    curves = {stage: losses(h) for stage, h in loss_histories.items()}
    curves = {stage: c for stage, c in curves.items() if c}
    for stage, records in curves.items():
        (folder / f"loss_{stage}.json").write_text(json.dumps(records))
    if curves:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for stage, records in curves.items():
            ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label=stage)
        ax.set(xlabel="optimizer step", ylabel="training loss", title="Training loss per stage")
        ax.legend()
        paths["loss_curves"] = _save(fig, folder / "loss_curves.png")

    rewards = {k: [v for v in vs if v is not None] for k, vs in rewards.items()}
    rewards = {k: v for k, v in rewards.items() if v}
    if rewards:
        (folder / "rewards.json").write_text(json.dumps([{"model": k, "reward": v} for k, vs in rewards.items()
                                                         for v in vs]))
        fig, ax = plt.subplots(figsize=(6, 3.5))
        lo = min(min(v) for v in rewards.values())
        hi = max(max(v) for v in rewards.values())
        bins = [lo + (hi - lo) * i / 20 for i in range(21)] if hi > lo else 10
        for label, values in rewards.items():
            ax.hist(values, bins=bins, alpha=0.45, label=f"{label} (n={len(values)})")
        ax.set(xlabel="reward-model score", ylabel="completions", title="Reward distributions")
        ax.legend()
        paths["reward_distribution"] = _save(fig, folder / "reward_distribution.png")

    rows = [r for r in table if r.get("accuracy") is not None]
    if rows:
        (folder / "accuracy.json").write_text(json.dumps([{"model": r["model"], "accuracy": r["accuracy"]}
                                                          for r in rows]))
        fig, ax = plt.subplots(figsize=(6, 3))
        bars = ax.bar([r["model"] for r in rows], [r["accuracy"] for r in rows], color="#4c72b0")
        ax.bar_label(bars, fmt="%.3f")
        ax.set(ylabel="held-out accuracy", ylim=(0, 1.05), title="Accuracy per stage")
        paths["accuracy"] = _save(fig, folder / "accuracy.png")
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def table_columns(table: list[dict[str, Any]]) -> list[str]:
    """COLUMNS that have a value, then the other columns (lm_eval.*, judge.*) in the order they appear; an
    interval's bounds (`X_low`, `X_high`) and an lm-eval stderr (`X_stderr...`) go into X's cell."""
    cols = [c for c in COLUMNS if any(c in r and r[c] is not None for r in table)]
    for r in table:
        for c in r:
            if c in cols or c == "split" or c.endswith(("_low", "_high")) or "_stderr" in c:
                continue
            if r[c] is not None:
                cols.append(c)
    return cols


def cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if value is None:
        return ""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    if row.get(f"{column}_low") is not None and row.get(f"{column}_high") is not None:
        text += f" [{row[f'{column}_low']:.3g}, {row[f'{column}_high']:.3g}]"
    if column.startswith("lm_eval."):
        _, task, rest = column.split(".", 2)
        metric, _, flt = rest.partition(".")
        stderr = row.get(f"lm_eval.{task}.{metric}_stderr" + (f".{flt}" if flt else ""))
        if isinstance(stderr, (int, float)):
            text += f" ± {stderr:.2g}"
    return text


def markdown_table(table: list[dict[str, Any]]) -> str:
    cols = table_columns(table)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table:
        lines.append("| " + " | ".join(cell(r, c) for c in cols) + " |")
    return "\n".join(lines)


def markdown_completions(rows: list[dict[str, Any]]) -> str:
    """The completions table (`stages.pipeline.evaluate.completions_table`) as markdown: one row per prompt."""
    from stages.markdown import table

    return table(rows)


def markdown_report(table: list[dict[str, Any]], plots: dict[str, Path], *, notes: Sequence[str] = (),
                    inline_images: bool = False, title: str = "Evaluation",
                    completions: Sequence[dict[str, Any]] = ()) -> str:
    """The table, the notes and the plots: linked relative to the report (`plots/x.png`), or inlined as
    data URIs (`inline_images`, for a Prefect artifact that cannot reach the files)."""
    lines = [f"# {title}", "", markdown_table(table), ""]
    lines += [f"- {n}" for n in notes]
    for name, path in plots.items():
        if inline_images:
            src = "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()
        else:
            src = f"plots/{Path(path).name}"
        lines += ["", f"## {name.replace('_', ' ')}", "", f"![{name}]({src})"]
    if completions:
        lines += ["", "## Completions", "", markdown_completions(list(completions))]
    return "\n".join(lines) + "\n"
