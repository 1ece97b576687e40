"""lm-evaluation-harness tasks on a model folder: the figures `lm_eval --model hf` prints, as table columns.

A task is a name from lm-eval's registry (gsm8k, ifeval, mmlu, arc_easy...), the path of a task YAML,
or one of the tasks shipped here (`stages/evaluation/tasks/`):

- `align_arithmetic`: the pipeline's own held-out split (preprocess's eval.jsonl: chat prompts and
  reference completions), scored by exact match of the whole reply (reasoning tags aside);
- `align_gsm8k`: GSM8K-shaped rows of your own (`question`, `answer` ending in `#### n`), from the file
  `evaluate.lm_eval.gsm8k_data`.

The shipped tasks are written, with their data file filled in, into a folder the caller keeps (the
evaluate stage's `lm_eval_tasks/`), so `lm_eval --model hf --model_args pretrained=<folder> --tasks
<that folder>/align_arithmetic.yaml` reruns one with the CLI and prints the same figures.

Registry tasks read their dataset from the local Hugging Face datasets cache; when it is not there
and the hub cannot be reached, `check_datasets` names the task and the dataset id before any model
loads. Columns are `lm_eval.<task>.<metric>` (`<metric>` is lm-eval's metric name, followed by
`.<filter>` unless the filter is lm-eval's default `none`) and `..._stderr` beside each.

    python -m stages evaluate --set 'evaluate.lm_eval.tasks=[align_arithmetic]'
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The shipped tasks, part of the evaluate stage's code: editing one makes the stage stale (stages.harness.imports)
CODE_FILES = ("tasks/align_arithmetic.yaml", "tasks/align_gsm8k.yaml")
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SHIPPED = tuple(Path(f).stem for f in CODE_FILES)
PREFIX = "lm_eval"


class LmEvalError(RuntimeError):
    """A task that cannot be run: unknown, or its dataset is not available offline."""


@dataclass(frozen=True)
class TaskSpec:
    """What lm-eval is given for one configured task: a registry name or a YAML path."""

    configured: str  # as written in evaluate.lm_eval.tasks
    argument: str  # what `--tasks` gets


def is_yaml(task: str) -> bool:
    return task.endswith((".yaml", ".yml"))


def write_shipped(task: str, data_file: str | Path, folder: Path) -> Path:
    """The shipped task `task` with its data file set, written to `folder/<task>.yaml`."""
    config = yaml.safe_load((TASKS_DIR / f"{task}.yaml").read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(Path(data_file).resolve())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{task}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return path


def task_specs(tasks: list[str], *, folder: Path, eval_file: str | Path | None, gsm8k_data: str | None
               ) -> list[TaskSpec]:
    """The `--tasks` arguments of the configured tasks; the shipped ones are written into `folder` first."""
    data: dict[str, str | Path | None] = {"align_arithmetic": eval_file, "align_gsm8k": gsm8k_data}
    specs = []
    for task in tasks:
        if task in SHIPPED:
            source = data[task]
            if source is None:
                raise LmEvalError(f"evaluate.lm_eval.tasks includes {task}, which needs "
                                  f"{'evaluate.lm_eval.gsm8k_data' if task == 'align_gsm8k' else 'an eval split'}")
            specs.append(TaskSpec(task, str(write_shipped(task, source, folder))))
        elif is_yaml(task):
            if not Path(task).is_file():
                raise LmEvalError(f"evaluate.lm_eval.tasks includes {task!r}: no such task YAML file")
            specs.append(TaskSpec(task, str(Path(task).resolve())))
        else:
            specs.append(TaskSpec(task, task))
    return specs


def task_name(spec: TaskSpec) -> str:
    """The name a task reports its results under: a YAML's `task:` key, else the configured name."""
    if is_yaml(spec.argument):
        return str(yaml.safe_load(Path(spec.argument).read_text()).get("task") or Path(spec.argument).stem)
    return spec.configured


def reported_names(tasks: list[str]) -> set[str]:
    """The task names the configured `tasks` report results under (their `lm_eval.<task>.*` columns): a shipped
    task's or a YAML's `task:` name; a registry name, and for a group or a tag each member task too (from lm-eval's
    index, read only when a registry name is configured)."""
    names: set[str] = set()
    registry = []
    for task in tasks:
        if task in SHIPPED:
            names.add(task)
        elif is_yaml(task):
            names.add(task_name(TaskSpec(task, task)) if Path(task).is_file() else Path(task).stem)
        else:
            registry.append(task)
            names.add(task)
    if registry:
        from lm_eval.tasks import TaskManager

        index = TaskManager().task_index
        for task in registry:
            names |= _members(index, task)
    return names


def _members(index: dict[str, Any], name: str, depth: int = 0) -> set[str]:
    """`name` and, for a group or a tag, the names of its member tasks (and theirs)."""
    entry = index.get(name)
    if entry is None or depth > 8:
        return {name}
    return {name} | {found for m in _children(index, name) for found in _members(index, m, depth + 1)}


def _children(index: dict[str, Any], name: str) -> list[str]:
    """The member task names of a group or a tag in lm-eval's task index; [] for a task."""
    from lm_eval.tasks._index import Kind

    entry = index[name]
    if entry.kind == Kind.GROUP:
        members = entry.cfg.get("task", []) if entry.cfg else []
        return [m for m in (m if isinstance(m, str) else m.get("task") for m in members) if isinstance(m, str)]
    if entry.kind == Kind.TAG:
        return [other.name for other in index.values() if name in other.tags]
    return []


def check_datasets(specs: list[TaskSpec]) -> None:
    """Every registry task's dataset is loadable (the local cache when offline): else an error naming the
    task and the dataset id, raised before any model loads. YAML tasks reading local files are checked by
    lm-eval itself when it opens them."""
    import datasets
    from lm_eval.tasks import TaskManager

    registry = [s for s in specs if not is_yaml(s.argument)]
    if not registry:
        return
    manager = TaskManager()
    unknown = [s.configured for s in registry if s.argument not in manager.all_tasks]
    if unknown:
        raise LmEvalError(f"evaluate.lm_eval.tasks = {unknown}: not in lm-eval's registry (`lm_eval ls tasks` "
                          "lists them) and not a task YAML path")
    for spec in registry:
        for path, name in sorted(_datasets(manager.task_index, spec.argument)):
            try:
                datasets.load_dataset_builder(path, name)
            except Exception as e:  # noqa: BLE001 (datasets raises many kinds; each means "not available")
                dataset = path + (f" ({name})" if name else "")
                raise LmEvalError(
                    f"evaluate.lm_eval.tasks includes {spec.configured!r}, whose dataset {dataset} is not in the "
                    f"local Hugging Face cache and cannot be downloaded ({type(e).__name__}: {str(e)[:200]}); "
                    f"download it once where the hub is reachable (datasets.load_dataset({path!r}"
                    f"{', ' + repr(name) if name else ''})) or drop the task") from None


def _datasets(index: dict[str, Any], name: str, depth: int = 0) -> set[tuple[str, str | None]]:
    """{(dataset id, config name)} a registry task reads; a group's or a tag's member tasks' too. Read from the
    YAML files (building lm-eval's Task objects would download the datasets)."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = index.get(name)
    if entry is None or depth > 8:
        return set()
    if entry.kind == Kind.TASK and entry.yaml_path is not None:
        config = load_yaml(entry.yaml_path, resolve_func=False)
        path = config.get("dataset_path")
        local = not path or path in ("json", "csv", "parquet", "text", "arrow") or Path(str(path)).exists()
        return set() if local else {(str(path), config.get("dataset_name"))}
    return {found for member in _children(index, name) for found in _datasets(index, member, depth + 1)}


def evaluate_model(folder: str, specs: list[TaskSpec], *, adapter: str | None = None, dtype: str = "float32",
                   device: str = "cpu", num_fewshot: int | None = None, limit: int | float | None = None,
                   batch_size: int = 8, apply_chat_template: bool = False, seed: int = 0) -> dict[str, float]:
    """{`lm_eval.<task>.<metric>`: value} of the model in `folder` (with the PEFT adapter `adapter` on it)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args: dict[str, Any] = {"pretrained": folder, "dtype": dtype}
    if adapter is not None:
        model_args["peft"] = adapter
    results = lm_eval.simple_evaluate(
        model="hf", model_args=model_args, tasks=[s.argument for s in specs], num_fewshot=num_fewshot,
        limit=limit, batch_size=batch_size, device=device, apply_chat_template=apply_chat_template,
        task_manager=TaskManager(), log_samples=False, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed)
    if results is None:  # only on ranks > 0 of a distributed run
        return {}
    return columns(results["results"])


def columns(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's `results["results"]` ({task: {"exact_match,strict-match": v, "alias": ...}}, a group's
    subtasks included) as flat numeric columns; lm-eval's "N/A" stderrs and NaNs are left out."""
    out: dict[str, float] = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                continue
            name = metric if filter_name == "none" else f"{metric}.{filter_name}"
            out[f"{PREFIX}.{task}.{name}"] = round(float(value), 6)
    return out


def stderr_column(column: str) -> str:
    """`lm_eval.t.exact_match.strict-match` -> `lm_eval.t.exact_match_stderr.strict-match` (lm-eval's naming)."""
    _, task, rest = column.split(".", 2)
    metric, _, filter_name = rest.partition(".")
    return f"{PREFIX}.{task}.{metric}_stderr" + (f".{filter_name}" if filter_name else "")
