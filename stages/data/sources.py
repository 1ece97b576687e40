"""Which data files a run reads, what they hold, and what the chosen methods need from them.

Four keys of the `data` params section name data sources (each optional): a local file or
`save_to_disk` folder, or what `datasets.load_dataset` reads (a hub-layout folder, a glob, a hub id,
with a config, a split and a column map: `stages.data.hub`):

| key             | takes                                                     |
|-----------------|-----------------------------------------------------------|
| data.source     | builtin:arithmetic, or one file whose rows may mix formats |
| data.sft        | SFT rows: messages, prompt_completion, alpaca, text       |
| data.preference | preference rows (prompt/chosen/rejected) or unpaired rows |
| data.prompts    | prompt-only rows (for score and the online methods)       |

`peek(data)` reads the files' rows (whole files up to `PEEK_BYTES`, the first
`PEEK_ROWS` rows of bigger ones) and returns a `DataShape`: which destinations hold rows
and whether they are conversational. `needs(params, shape)` lists what the chosen stages
and methods need that the data does not give, each as (dotted key, why and the fix).
Params validation calls both, so a run that would fail after SFT stops before anything
is built; preprocess calls `needs` again with the shape of every row it loaded.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.data.formats import FORMATS, detect_format, is_conversational
from stages.data.hub import (
    HUB_ID,
    PLAIN_SUFFIXES,
    DataSourceError,
    DataSpec,
    check,
    is_spec_value,
    shape_problems,
    spec_of,
)
from stages.data.hub import read_rows as read_spec_rows
from stages.data.tool_calls import row_uses_tools
from stages.reward_function_names import REWARD_MODEL_REWARDS

FILE_KEYS = ("source", "sft", "preference", "prompts")
HELD_OUT_KEYS = ("data.eval_source", "data.dev_source")  # held-out rows with references, never trained on
# destinations (FORMATS[fmt][2]) a key takes; None: any (a mixed file)
ACCEPTS: dict[str, frozenset | None] = {
    "source": None,
    "sft": frozenset({"sft"}),
    "preference": frozenset({"preference", "unpaired"}),
    "prompts": frozenset({"prompts"}),
}
BUILTIN_SHAPE = frozenset({"sft", "preference", "unpaired", "prompts", "eval", "dev"})
PEEK_BYTES = 16 * 2**20  # files up to this size are peeked whole: absence of a kind of row is then certain
PEEK_ROWS = 2000


@dataclass
class DataShape:
    """What the data holds: destinations with rows, and the kind of their fields."""

    destinations: set[str] = field(default_factory=set)  # sft, preference, unpaired, prompts, eval
    conversational: bool = False  # some row holds chat messages (they need a chat template)
    tools: bool = False  # some row uses tools (they need a chat template that renders them)
    prompts_derivable: bool = False  # some SFT/preference row has a prompt score could sample from
    complete: bool = True  # False when a big file was only partly read: absent kinds are not certain

    def add(self, fmt: str, row: dict[str, Any]) -> None:
        """Count one row of format `fmt` (as read, or canonical)."""
        destination = FORMATS[fmt][2]
        self.destinations.add(destination)
        if fmt == "alpaca" or is_conversational(row):  # alpaca rows become chat messages
            self.conversational = True
        self.tools |= row_uses_tools(row)
        if fmt != "text" or "prompt" in row:  # text rows alone give score nothing to sample from
            self.prompts_derivable = True

    @property
    def has_preference(self) -> bool:
        return "preference" in self.destinations

    @property
    def has_sft_material(self) -> bool:
        """SFT rows, or preference/unpaired rows whose chosen (desirable) sides SFT can train on."""
        return bool(self.destinations & {"sft", "preference", "unpaired"})


def data_files(data) -> list[tuple[str, Path | DataSpec]]:
    """(dotted key, source) of every data source the `data` section names (built-ins excluded), the held-out
    ones (HELD_OUT_KEYS: eval_source, dev_source) last. A source is a Path (a file or save_to_disk folder, read
    line by line by stages.data.io) or a DataSpec (a mapping, a glob or a hub-layout folder: stages.data.hub)."""
    out = []
    for key in (*(f"data.{k}" for k in FILE_KEYS), *HELD_OUT_KEYS):
        value = getattr(data, key.removeprefix("data."))
        if not value or (isinstance(value, str) and value.startswith("builtin:")):
            continue
        out.append((key, spec_of(key, value) if is_spec_value(value) else Path(value).expanduser()))
    return out


def source_of(data, key: str) -> Path | DataSpec | None:
    """The source of dotted data key `key` (see `data_files`), None when unset or built in."""
    return dict(data_files(data)).get(key)


def missing_files(data) -> list[tuple[str, str]]:
    """(dotted key, why) for every named data source that does not exist or cannot be loaded: a missing file, a
    mapping with unknown keys, a column, split or config that is not there, a slice that leaves no rows, a hub
    id not in the cache (stages.data.hub.check)."""
    problems: list[tuple[str, str]] = []
    for key in (*(f"data.{k}" for k in FILE_KEYS), *HELD_OUT_KEYS):
        value = getattr(data, key.removeprefix("data."))
        shape = shape_problems(key, value)
        problems += [(k, why) for k, _, why in (p.partition(" ") for p in shape)]  # each is "<key> <why>"
        if shape or not value or (isinstance(value, str) and value.startswith("builtin:")):
            continue
        if is_spec_value(value):
            problem = check(spec_of(key, value))
            if problem:
                problems.append(problem)
        elif not Path(value).expanduser().exists():
            problems.append((key, f"= {value!r}: no such file or folder (relative paths are from the working "
                                  f"directory {Path.cwd()}); fix the path, or unset the key"
                                  + (f" (a hub id is given as {{path: {value}}})"
                                     if HUB_ID.fullmatch(value) and Path(value).suffix not in PLAIN_SUFFIXES else "")))
    return problems


def peek(data) -> DataShape:
    """The shape of the data the `data` section names (see the module docstring). Unreadable rows are skipped:
    preprocess reports them with their file and line."""
    shape = DataShape()
    if str(data.source or "").startswith("builtin:"):
        shape.destinations |= BUILTIN_SHAPE
        shape.conversational = shape.prompts_derivable = True
    for key, path in data_files(data):
        if key in HELD_OUT_KEYS:
            shape.destinations.add(key.removeprefix("data.").removesuffix("_source"))
            continue
        if isinstance(path, DataSpec):
            try:
                part = _peek_rows(read_spec_rows(path), big=True, key=key.removeprefix("data."))
            except DataSourceError:  # params validation names it (missing_files)
                part = DataShape(complete=False)
        else:
            stat = path.stat() if path.is_file() else None
            part = _peek_file(str(path.resolve()), stat.st_size if stat else -1, stat.st_mtime_ns if stat else -1,
                              key.removeprefix("data."))
        shape.destinations |= part.destinations
        shape.conversational |= part.conversational
        shape.tools |= part.tools
        shape.prompts_derivable |= part.prompts_derivable
        shape.complete &= part.complete
    return shape


@functools.lru_cache(maxsize=64)
def _peek_file(path_text: str, size: int, mtime_ns: int, key: str = "source") -> DataShape:
    """The shape of one file that data params key `key` names; cached by path, size and modification time (params
    are validated at every entry).

    An unreadable row leaves the shape certain only where fixing it cannot change what `needs` decides: the key
    takes only destinations the file already has, and rows that give prompts are already there (data.source, a
    mixed file, is never certain then). The row itself is reported by `stages.data.row_checks` in the same
    message, or by preprocess."""
    from stages.data.io import DataError, read_rows

    path = Path(path_text)
    shape = DataShape()
    big = _size(path) > PEEK_BYTES
    if big and path.suffix != ".jsonl":  # tables and saved datasets are read whole: leave them to preprocess
        shape.complete = False
        return shape
    try:
        return _peek_rows(read_rows(path), big, key)
    except DataError:  # unreadable file: preprocess says why, naming the file
        shape.complete = False
        return shape


def _peek_rows(rows, big: bool, key: str = "source") -> DataShape:
    """The shape of rows (io.Row) that data params key `key` names, the first PEEK_ROWS of them when `big`."""
    from stages.data.io import DataError

    shape = DataShape()
    recognised = unknown = 0
    try:
        for n, row in enumerate(rows):
            if big and n >= PEEK_ROWS:
                shape.complete = False
                break
            fmt = detect_format(row.value) if row.value is not None else None
            if fmt is None:  # row_checks or preprocess names the row and why: its message beats a guess made here
                unknown += 1
                continue
            recognised += 1
            shape.add(fmt, row.value)
    except DataError:  # unreadable rows: preprocess says why, naming the file
        shape.complete = False
    accepts = ACCEPTS[key]
    if not recognised or unknown and not (accepts is not None and accepts <= shape.destinations
                                          and shape.prompts_derivable):
        shape.complete = False
    return shape


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def needs(params, shape: DataShape) -> list[tuple[str, str]]:
    """(dotted key, why and how to fix) for every stage or method setting the data cannot serve.

    Checks only absences the shape is sure of (a partly peeked big file defers them to preprocess).
    """
    if not shape.complete:
        return []
    problems = []
    if not shape.has_sft_material:
        problems.append(("data", f"holds {_listing(shape)}: nothing for stage sft to train on; give SFT rows "
                                 "(data.sft) or preference rows (data.preference: SFT then trains on the chosen "
                                 "responses)"))
    if "eval" not in shape.destinations and not shape.has_sft_material:
        problems.append(("data.eval_source", "= null and no SFT or preference rows to carve an eval split from: "
                                             "set data.eval_source to prompts with reference completions"))
    if not shape.has_preference:
        problems += _reward_model_without_pairs(params, shape)
        pol, method = params.policy, _method(params)
        if method is not None and method.data in ("pairs", "unpaired") and pol.data == "preprocess" and not (
                method.data == "unpaired" and "unpaired" in shape.destinations):
            fix = (f"set {_online_fix(params)} (GRPO learns from the rule reward on every sample), "
                   "or --set policy.data=score (pairs sampled from the SFT model and scored: with rule rewards "
                   "alone, only where its samples differ)" if shape.prompts_derivable else
                   "set --set policy.method=none (text rows give no prompts to sample pairs from)")
            problems.append(("policy.data", f"= preprocess, but the data has no preference rows for policy.method "
                                            f"= {pol.method}: {fix}, or give data.preference"))
        if method is not None and getattr(pol.trained, "reward_head", None) == "shared":
            key = f"{method.section}.reward_head"
            problems.append((key, f"= shared trains a reward head on preference pairs, but the data has none: set "
                                  f"--set {key}=separate or give data.preference"))
    if not shape.prompts_derivable:
        if params.score.enabled and params.score.source == "generate":
            also = (" --set policy.method=none (policy.method = "
                    f"{params.policy.method} trains on score's pairs)" if _reads_score_pairs(params) else "")
            problems.append(("score.enabled", "= true, but the data has no prompts to sample from (text rows "
                                              f"only): set --set score.enabled=false{also}, or give data.prompts"))
        if "eval" not in shape.destinations and shape.has_sft_material:
            problems.append(("data.eval_source", "= null, but the data has text rows only: they hold no prompt to "
                                                 "hold out for evaluation (the eval split is carved from prompted "
                                                 "rows); set data.eval_source to held-out prompt/completion rows"))
        if _method(params) is not None and _method(params).samples:
            problems.append(("policy.method", f"= {params.policy.method} samples from prompts, but the data has "
                                              "none (text rows only): give data.prompts, or set "
                                              "--set policy.method=none"))
    return problems


def _online_fix(params) -> str:
    """The overrides that train the policy with GRPO on the rule rewards, without score's pairs: what data
    without preference rows always supports (a sample that scores like the others only adds no gradient)."""
    grpo = params.policy.grpo
    fix = "--set policy.method=grpo --set score.enabled=false"
    if any(n in REWARD_MODEL_REWARDS for n in grpo.reward_functions):
        fix += " --set policy.grpo.reward_functions=[exact_match] --set policy.grpo.reward_weights=null"
    if grpo.reward_head == "shared":
        fix += " --set policy.grpo.reward_head=separate"
    return fix


def _method(params):
    """The stages.methods record of `policy.method` (None for none); read through params, so that the data checks
    (and preprocess's code) do not depend on the list of methods."""
    return params.policy.record


def _reads_score_pairs(params) -> bool:
    method = _method(params)
    return method is not None and method.data in ("pairs", "unpaired") and params.policy.data == "score"


def _reward_model_without_pairs(params, shape: DataShape) -> list[tuple[str, str]]:
    """The reward-function lists that name the reward model, which no preference data trains, each with a fix that
    leads to a finished run.

    For score's list when DPO or KTO train on score's pairs, the rule rewards alone are not that fix: score
    pairs two samples only where their scores differ, and a small or new SFT model whose samples are all wrong
    (or all right) gives no pair, so the run would stop after SFT. An online method with the rule reward
    (GRPO with policy.grpo.reward_functions) learns from every sample instead; the message offers it first and
    says what the rule-reward pairs need."""
    lists = []
    if params.score.enabled:
        lists.append(("score.reward_functions", params.score.reward_functions, params.score.reward_weights))
    method = params.policy.method
    if _method(params) is not None and _method(params).scores:
        s = params.policy.trained
        lists.append((f"policy.{method}.reward_functions", s.reward_functions, s.reward_weights))
    problems = []
    for key, names, weights in lists:
        named = [n for n in names if n in REWARD_MODEL_REWARDS]
        if not named:
            continue
        rest = [n for n in names if n not in REWARD_MODEL_REWARDS] or ["exact_match"]
        fix = f"--set {key}=[{','.join(rest)}]"
        if weights is not None:
            kept = [w for n, w in zip(names, weights, strict=True) if n not in REWARD_MODEL_REWARDS] or [1.0]
            fix += f" --set {key.rsplit('.', 1)[0]}.reward_weights=[{','.join(map(str, kept))}]"
        why = f"= {names} includes {named[0]}, but there is no preference data to train one: "
        if key == "score.reward_functions" and _reads_score_pairs(params) and shape.prompts_derivable:
            problems.append((key, why + f"set {_online_fix(params)} (GRPO learns from the rule reward on every "
                             "sample), or keep "
                             f"policy.method = {method} with {fix} if the SFT model's samples are right on some "
                             "prompts and wrong on others (score pairs only samples whose scores differ; with none "
                             "the run stops before policy), or give data.preference"))
        else:
            problems.append((key, why + f"set {fix}, or give data.preference"))
    return problems


def _listing(shape: DataShape) -> str:
    kinds = sorted(shape.destinations - {"eval", "dev"})
    return f"{', '.join(kinds)} rows only" if kinds else "no rows"


def destination_problem(key: str, fmt: str) -> str:
    """'' if file key `key` takes rows of format `fmt`, else why not (naming the key that does)."""
    accepts = ACCEPTS[key]
    dest = FORMATS[fmt][2]
    if accepts is None or dest in accepts:
        return ""
    right = next(k for k, a in ACCEPTS.items() if a is not None and dest in a)
    formats = ", ".join(f for f, (_, _, d) in FORMATS.items() if d in accepts)
    return (f"row looks like format {fmt!r} ({dest} data) but data.{key} takes {formats} rows; "
            f"put {dest} rows in data.{right} (or data.source, which takes a file of mixed formats)")
