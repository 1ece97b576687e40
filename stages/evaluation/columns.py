"""Which columns of the evaluate table a configuration produces, so that `promote.metric` naming one it never
will is refused when params are loaded (`stages.harness.params_loader`), before any stage runs.

Kept out of `stages.harness.config`: that module is part of a stage's code (its fingerprint), and the lm-eval
task files read here are the evaluate stage's, not the policy stage's.
"""
from __future__ import annotations

import importlib.util

from stages.evaluation import lm_eval


def promote_metric_problems(metric: str, e) -> list[tuple[str, str]]:
    """(key, message) problems of promote.metric against `e` (the evaluate section): a judge.* column needs
    evaluate.judge, an lm_eval.<task>.* column a task of evaluate.lm_eval.tasks."""
    if metric.startswith("judge.") and not e.judge.enabled:
        return [("promote.metric", f"= {metric!r}, but evaluate.judge is off (no base_url, no model_path): nothing "
                 "would produce that column; set evaluate.judge.base_url and evaluate.judge.model (an "
                 "OpenAI-compatible endpoint) or evaluate.judge.model_path (a local model folder), or promote on "
                 "another metric (accuracy, or lm_eval.<task>.<metric>)")]
    if not metric.startswith("lm_eval."):
        return []
    task = metric.split(".")[1]
    if not e.lm_eval.tasks:
        return [("promote.metric", f"= {metric!r}, but evaluate.lm_eval.tasks is empty: lm-eval runs no task; add "
                 f"{task} to evaluate.lm_eval.tasks, or promote on another metric (accuracy, judge.lc_win_rate)")]
    registry = [t for t in e.lm_eval.tasks if t not in lm_eval.SHIPPED and not lm_eval.is_yaml(t)]
    if registry and importlib.util.find_spec("lm_eval") is None:
        return []  # evaluate.lm_eval.tasks reports lm-eval missing; its groups cannot be expanded without it
    names = lm_eval.reported_names(e.lm_eval.tasks)
    if task in names:
        return []
    shown = sorted(names)[:12]
    return [("promote.metric", f"= {metric!r}: task {task!r} is not among evaluate.lm_eval.tasks = "
             f"{e.lm_eval.tasks}, so the evaluate table has no such column; add {task} to evaluate.lm_eval.tasks, "
             f"or name a column of one of them (lm_eval.<task>.<metric>, task one of {', '.join(shown)}"
             f"{', ...' if len(names) > len(shown) else ''})")]
