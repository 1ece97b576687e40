"""Preflight: the checks that open the user's files and model folder, run before the first stage.

The schema (`stages.harness.config`) checks values; these check what they name: that the model folder
loads (and needs no custom code unless allowed), that the data files exist and hold what the
chosen stages and methods need, that `score.dataset` exists, and that LoRA's target modules are
in the model. `stages.harness.params_loader.load_params` runs them after the schema and reports every
problem of both in one message.
"""
from __future__ import annotations

from collections.abc import Collection
from pathlib import Path


def preflight_problems(p) -> list[str]:
    """Every problem of the files `p` (a valid Params) names, as "dotted.key message" lines."""
    from stages.data.sources import missing_files, needs, peek

    problems: list[tuple[str, str]] = []
    if p.model.name_or_path != "builtin:tiny":
        from stages.harness.model_paths import source_problem  # lazy: it imports huggingface_hub on demand only

        if problem := source_problem(p.model, p.run.output_dir):
            problems.append(("model.name_or_path", f"= {p.model.name_or_path!r}: {problem}"))
    missing = missing_files(p.data)
    problems += missing
    if not missing:
        problems += needs(p, peek(p.data))
    s = p.score
    if s.enabled and s.source == "dataset" and s.dataset and not Path(s.dataset).expanduser().exists():
        problems.append(("score.dataset", f"= {s.dataset!r}: no such file (relative paths are from the working "
                         f"directory {Path.cwd()})"))
    if not problems:
        from stages.trainers.adapters import lora_target_problems  # it loads the model's config

        problems += lora_target_problems(p)
    return [f"{key} {why}" for key, why in problems]


def trainer_config_problems(p, stages: Collection[str] | None = None) -> list[str]:
    """What transformers (and each config's own checks) refuse in the training sections the run will use, each
    by its dotted key: the trainer configs built as the stages will build them, before any model or stage runs.
    `stages`: only the sections of these training stages (None: all); a current stage was built with its config,
    so `align run` checks the stale ones only (`stale_training_stages`). Imports torch (seconds) when there is a
    section to check: `align run` and a training stage call it, `align status` does not."""
    import importlib
    import tempfile

    sections = [(dotted, s) for stage, (dotted, s) in p.training_sections().items()
                if stages is None or stage in stages]
    if not sections:
        return []
    from stages.trainers.arguments import real_kwargs

    problems = []
    with tempfile.TemporaryDirectory() as scratch:
        for dotted, s in sections:
            module, _, name = s.CONFIG.partition(":")
            config_cls = getattr(importlib.import_module(module), name)
            kwargs = {**real_kwargs(s, config_cls), "output_dir": scratch, "use_cpu": True, "report_to": "none",
                      "gradient_checkpointing": None, "activation_checkpointing": None}
            try:
                config_cls(**kwargs)
            except (ValueError, TypeError) as e:
                from stages.pipeline.training import refused

                problems.append(refused(dotted, e, kwargs))
    return problems


def stale_training_stages(p) -> set[str]:
    """The training stages whose output folder is not current for params `p` (what a run will train)."""
    from stages.harness import runner

    return {row["stage"] for row in runner.status(p) if not row["current"]} & set(p.training_sections())
