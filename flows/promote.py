"""The promotion step of the `align` flow (on in the nightly deployment): see stages/promotion.py.

After stage evaluate, the merged model replaces `models/production` only if it beats it on
`promote.metric` by more than `promote.min_improvement`; the decision and its reason are
appended to the evaluation report artifact and to `models/history.jsonl`.
"""
from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stages import promotion
from stages.harness.config import Params
from tasks.report import publish_report


@task(name="promote", cache_policy=NO_CACHE)
def promote(params: Params, upstream: list[dict] | None = None) -> dict[str, Any]:
    """Run the gate; the report artifact gains a Promotion section saying what happened and why."""
    result = promotion.run_gate(params, log=get_run_logger())
    publish_report(params, extra="\n" + promotion.markdown(result))
    return result
