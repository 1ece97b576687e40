"""Prefect task for stage `evaluate` (see stages/pipeline/evaluate.py); publishes its report.md."""
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from stages.config import Params
from stages.runner import output_dir
from tasks.common import run_stage_task


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(params: Params, upstream: list[dict] | None = None):
    """Run stage `evaluate`; the `upstream` manifests only draw the DAG edges in the UI."""
    result = run_stage_task("evaluate", params)
    publish_report(params)
    return result


def publish_report(params: Params, extra: str = "") -> str:
    """The evaluation table, notes and plots (inlined: the UI cannot reach the files) as a markdown artifact."""
    import json

    from stages.metrics.report import markdown_report

    folder = output_dir(params, "evaluate")
    table = json.loads((folder / "metrics.json").read_text())
    plots = {p.stem: p for p in sorted((folder / "plots").glob("*.png"))} if (folder / "plots").is_dir() else {}
    notes = [line[2:] for line in (folder / "report.md").read_text().splitlines() if line.startswith("- ")] \
        if (folder / "report.md").is_file() else []
    text = markdown_report(table, plots, notes=notes, inline_images=True) + extra
    create_markdown_artifact(key="evaluation-report", markdown=text, description="evaluate: table and plots")
    return text
