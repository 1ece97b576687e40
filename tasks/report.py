"""Stage evaluate's report as a Prefect artifact, after the stage (tasks/stage.py); after stage promote, with its
decision."""
from __future__ import annotations

import json

from prefect.artifacts import create_markdown_artifact

from stages.harness.config import Params
from stages.harness.runner import output_dir


def publish_report(params: Params, extra: str = "") -> str:
    """The evaluation table, notes and plots (inlined: the UI cannot reach the files) as a markdown artifact."""
    from stages.metrics.report import markdown_report

    folder = output_dir(params, "evaluate")
    table = json.loads((folder / "metrics.json").read_text())
    plots = {p.stem: p for p in sorted((folder / "plots").glob("*.png"))} if (folder / "plots").is_dir() else {}
    notes = [line[2:] for line in (folder / "report.md").read_text().splitlines() if line.startswith("- ")] \
        if (folder / "report.md").is_file() else []
    text = markdown_report(table, plots, notes=notes, inline_images=True) + extra
    create_markdown_artifact(key="evaluation-report", markdown=text, description="evaluate: table and plots")
    return text


def publish_promotion(params: Params) -> str:
    """The evaluation report with a Promotion section: what stage promote decided and why."""
    from stages.pipeline.promote import markdown

    decision = json.loads((output_dir(params, "promote") / "decision.json").read_text())
    return publish_report(params, extra="\n" + markdown(decision))
