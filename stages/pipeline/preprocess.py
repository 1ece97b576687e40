"""Stage `preprocess`: load, validate, normalise, deduplicate, filter by length, split, save.

Reads `data.source` (builtin:arithmetic, or a file whose rows may mix formats), `data.sft`, `data.preference`,
`data.prompts`, `data.eval_source` and `data.dev_source`, checks that the data serves the chosen stages and
methods (`stages.data.sources.needs`) and that conversational rows have a chat template, and writes canonical
JSONL files: `sft_train.jsonl`, `sft_validation.jsonl`, `eval.jsonl` (the reported prompts), `dev.jsonl` (model
selection), and `preference.jsonl`, `unpaired.jsonl`, `prompts.jsonl` when the data has them.

With no SFT rows, SFT trains on the chosen side of the preference rows. The dev split is disjoint by prompt
from eval and from every training file, so tuning on it leaves eval unseen: a dev row whose prompt is an eval
prompt is dropped, and so is every training row whose prompt is a dev prompt. Every row dropped is counted by
reason in the metrics (and so in the manifest).

    python -m stages preprocess --set data.source=null --set data.sft=sft.jsonl --set data.preference=pairs.jsonl
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any

from stages.builtin import BUILTIN_DATA, arithmetic
from stages.data import (
    FORMATS,
    DataError,
    LoadReport,
    check_report,
    iter_rows,
    iter_source,
    load_grouped,
    load_source,
    write_jsonl,
)
from stages.data.formats import normalise, validate
from stages.data.hub import source_identity
from stages.data.sources import HELD_OUT_KEYS, DataShape, data_files, needs
from stages.data.templates import read_chat_template, require_tool_template
from stages.data.tokenize import content_chars, longest_token_chars, tokenize_sft
from stages.harness.model_paths import resolve_model
from stages.models import load_tokenizer

EVAL_FORMATS = ("prompt_completion", "messages", "alpaca")


def run(ctx) -> dict[str, Any]:
    p = ctx.params

    def tokenizer_of_the_model():  # built or loaded once the data is known to be readable
        return with_sft_template(load_tokenizer(resolve_model(p.model, p.run.output_dir),
                                                trust_remote_code=p.model.trust_remote_code), p.sft)

    if p.preprocess.streaming and not str(p.data.source or "").startswith("builtin:"):
        return run_streaming(ctx, tokenizer_of_the_model())
    groups, held_out, sources = load_groups(p.data)
    eval_rows, dev_rows = held_out["eval"], held_out["dev"]
    tokenizer = tokenizer_of_the_model()
    for s in sources:
        if len(s.get("formats", {})) > 1:
            ctx.log.info("preprocess: %s mixes formats %s (each row goes to its kind's split)", s["source"],
                         s["formats"])
    check_shape(p, tokenizer, shape_of(groups, held_out))
    rng = random.Random(p.run.seed)
    dropped: dict[str, dict[str, int]] = {}
    derived = derive_sft(groups)
    if derived:
        ctx.log.info("preprocess: no SFT rows; SFT trains on %s (%d rows)", derived, len(groups["sft"]))

    for name in list(groups):
        rows = groups[name]
        if p.preprocess.dedup:
            rows, n = dedup(rows)
            dropped.setdefault(name, {})["duplicate"] = n
        if name == "sft":
            rows, n = filter_length(tokenizer, rows, p.preprocess.max_length)
            dropped.setdefault(name, {})["too_long"] = n
            check_not_all_too_long(describe_sources(p.data), len(rows), n, p.preprocess.max_length)
        groups[name] = rows
    n_sft = len(groups.get("sft", []))
    if eval_rows is None:  # carve a held-out eval split from the (deduplicated) SFT rows
        eval_rows, groups["sft"] = carve_eval(groups.get("sft", []), p.preprocess.eval_fraction, rng,
                                              describe_sources(p.data))
        if derived:  # the eval prompts must not be trained on through the preference data either
            for name, n in drop_prompts(groups, eval_rows).items():
                dropped.setdefault(name, {})["eval_prompt"] = n
    eval_rows, n = dedup(eval_rows)
    dropped["eval"] = {"duplicate": n}
    if dev_rows is None:  # as many as preprocess.dev_fraction of the SFT rows, from those eval left
        dev_rows, groups["sft"] = carve_dev(groups.get("sft", []), int(n_sft * p.preprocess.dev_fraction), rng,
                                            exclude=prompt_keys(eval_rows))
    dev_rows, dropped["dev"] = disjoint_dev(dev_rows, eval_rows)
    for name, n in drop_prompts(groups, dev_rows, names=TRAINING_GROUPS).items():
        if n:  # counted where it happened (own data); the built-in task is disjoint by construction
            dropped.setdefault(name, {})["dev_prompt"] = n
    if not dev_rows:
        ctx.log.info("preprocess: no dev split (set data.builtin.num_dev, preprocess.dev_fraction or "
                     "data.dev_source for evaluate.split: dev)")

    files = {}
    if groups.get("sft"):
        train, val = split(groups.pop("sft"), p.preprocess.validation_fraction, rng)
        files.update({"sft_train": train, "sft_validation": val})
    files.update({k: v for k, v in groups.items() if v})
    files["eval"], files["dev"] = eval_rows, dev_rows
    for name, rows in files.items():
        write_jsonl(ctx.out / f"{name}.jsonl", rows)
        ctx.log.info("wrote %s.jsonl: %d rows", name, len(rows))
    (ctx.out / "report.json").write_text(json.dumps({"sources": sources, "dropped": dropped,
                                                     "rows": {k: len(v) for k, v in files.items()}}, indent=2))
    return {"rows": {k: len(v) for k, v in files.items()}, "dropped": dropped,
            "invalid_rows": sum(s["invalid"] for s in sources), **({"sft_from": derived} if derived else {}),
            "table": [{"file": f"{k}.jsonl", "rows": len(v)} for k, v in files.items()]}


def describe_sources(data) -> str:
    """The data files (or built-in) a run reads, for messages."""
    names = [str(path) for key, path in data_files(data) if key not in HELD_OUT_KEYS]
    return ", ".join(names) or str(data.source)


def load_groups(data) -> tuple[dict[str, list], dict[str, list | None], list[dict]]:
    """({destination: rows} of every data file, {"eval"|"dev": held-out rows, None when to be carved},
    per-source reports)."""
    groups: dict[str, list] = {}
    sources: list[dict] = []
    held_out: dict[str, list | None] = {"eval": None, "dev": None}
    if isinstance(data.source, str) and data.source.startswith("builtin:"):
        if data.source not in BUILTIN_DATA:
            raise DataError(f"data.source = {data.source!r}: unknown built-in; built-ins: {', '.join(BUILTIN_DATA)}")
        splits = arithmetic.generate(**dataclasses.asdict(data.builtin))
        groups = {name: _checked(name, rows) for name, rows in splits.items() if name not in held_out}
        report = LoadReport(data.source, "builtin", read=sum(map(len, splits.values())),
                            kept=sum(map(len, splits.values())))
        held_out = {name: _checked(name, splits[name]) for name in held_out}
        sources.append(report.as_dict())
    for key, path in data_files(data):
        if key in HELD_OUT_KEYS:
            fmt, rows, report = load_source(path, on_bad_rows=data.on_bad_rows)
            check_held_out_format(key, path, fmt)
            held_out[key.removeprefix("data.").removesuffix("_source")] = rows
        else:
            file_groups, report = load_grouped(path, key=key.removeprefix("data."), on_bad_rows=data.on_bad_rows)
            for dest, rows in file_groups.items():
                groups.setdefault(dest, []).extend(rows)
        sources.append({"key": key, **report.as_dict(), **source_identity(key, getattr(data, key[5:]))})
    return groups, held_out, sources


def check_held_out_format(key: str, path, fmt: str | None) -> None:
    if fmt not in EVAL_FORMATS:
        raise DataError(f"{key} = {path}: format {fmt!r} has no reference answer; use one of {', '.join(EVAL_FORMATS)}")


def shape_of(groups: dict[str, list], held_out: dict[str, list | None]) -> DataShape:
    """The DataShape of every loaded row (complete: preprocess has read them all)."""
    shape = DataShape()
    canonical = {"sft": "prompt_completion", "preference": "preference", "unpaired": "unpaired",
                 "prompts": "prompt_only"}  # the format of a normalised row of each destination
    for dest, rows in groups.items():
        for row in rows:
            shape.add("text" if dest == "sft" and "prompt" not in row else canonical[dest], row)
    shape.destinations |= {name for name, rows in held_out.items() if rows}
    return shape


def with_sft_template(tokenizer, sft):
    """The tokenizer with the chat template SFT will train with (`sft.chat_template_path`, when set): rows are
    measured, and checked to render, as SFT renders them."""
    if sft.chat_template_path is not None:
        tokenizer.chat_template = read_chat_template(sft.chat_template_path, tokenizer, "sft")
    return tokenizer


def check_shape(p, tokenizer, shape: DataShape) -> None:
    """Stop before any training when the data cannot serve the chosen stages, or cannot be rendered."""
    problems = [f"{key} {why}" for key, why in needs(p, shape)]
    if shape.conversational and getattr(tokenizer, "chat_template", None) is None:
        problems.append(f"the data is conversational (chat messages), but model.name_or_path = "
                        f"{p.model.name_or_path!r} has no chat template: give the rows as plain strings "
                        "(prompt/completion, prompt/chosen/rejected, text), or use a model whose tokenizer has a "
                        "chat template (or set tokenizer.chat_template and save it into the model folder)")
    elif shape.tools:
        template = (f"sft.chat_template_path = {p.sft.chat_template_path!r}" if p.sft.chat_template_path else
                    f"model.name_or_path = {p.model.name_or_path!r}")
        try:
            require_tool_template(tokenizer, template)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        lines = "\n  - ".join(problems)
        raise DataError(f"{describe_sources(p.data)}: the data does not fit these params (nothing was trained):\n"
                        f"  - {lines}")


def derive_sft(groups: dict[str, list]) -> str:
    """Without SFT rows: SFT rows from the chosen side of preference rows and the desirable unpaired rows.
    Returns what they came from ('' when there were SFT rows, or nothing to derive them from)."""
    if groups.get("sft"):
        return ""
    rows, origin = [], []
    pairs = [r for r in groups.get("preference", []) if r.get("prompt")]
    if pairs:
        rows += [{"prompt": r["prompt"], "completion": r["chosen"], **_tools(r)} for r in pairs]
        origin.append("the chosen side of the preference rows")
    good = [r for r in groups.get("unpaired", []) if r["label"]]
    if good:
        rows += [{"prompt": r["prompt"], "completion": r["completion"], **_tools(r)} for r in good]
        origin.append("the desirable (label true) unpaired rows")
    if rows:
        groups["sft"] = rows
    return " and ".join(origin)


def _tools(row: dict) -> dict:
    return {"tools": row["tools"]} if "tools" in row else {}


def prompt_key(prompt: Any) -> str:
    """A prompt's identity for held-out checks: its content (a string or chat messages), key order aside."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def prompt_keys(rows: list[dict]) -> set[str]:
    return {prompt_key(r["prompt"]) for r in rows if "prompt" in r}


def drop_prompts(groups: dict[str, list], held_out_rows: list[dict],
                 names: tuple[str, ...] = ("preference", "unpaired")) -> dict[str, int]:
    """Remove the rows of groups `names` whose prompt is a prompt of `held_out_rows`; {group: rows removed}."""
    held_out = prompt_keys(held_out_rows)
    removed = {}
    for name in names:
        if name in groups:
            kept = [r for r in groups[name] if "prompt" not in r or prompt_key(r["prompt"]) not in held_out]
            removed[name] = len(groups[name]) - len(kept)
            groups[name] = kept
    return removed


TRAINING_GROUPS = ("sft", "preference", "unpaired", "prompts")  # every row a stage after preprocess trains on


def carve_dev(sft: list[dict], n: int, rng: random.Random, *, exclude: set[str]) -> tuple[list[dict], list[dict]]:
    """(dev rows, the other SFT rows): `n` rows of distinct prompts, none in `exclude` (the eval prompts), drawn
    after a seeded shuffle from the rows with a prompt and a reference completion. The other rows with a dev
    prompt are left in the SFT rows for `drop_prompts` to count and remove."""
    sft = list(sft)
    rng.shuffle(sft)
    dev, rest, taken = [], [], set(exclude)
    for row in sft:
        key = prompt_key(row["prompt"]) if "prompt" in row and row.get("completion") else None
        if len(dev) < n and key is not None and key not in taken:
            taken.add(key)
            dev.append(row)
        else:
            rest.append(row)
    return dev, rest


def disjoint_dev(dev: list[dict], eval_rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """(dev rows deduplicated and without any eval prompt, {reason: rows dropped})."""
    dev, duplicates = dedup(dev)
    evals = prompt_keys(eval_rows)
    kept = [r for r in dev if prompt_key(r["prompt"]) not in evals]
    return kept, {"duplicate": duplicates, "eval_prompt": len(dev) - len(kept)}


def _checked(split_name: str, rows: list[dict]) -> list[dict]:
    """Built-in rows go through the same validation as user files (a bug in the generator must not pass)."""
    fmt = {"sft": "messages", "preference": "preference", "unpaired": "unpaired", "eval": "prompt_completion",
           "dev": "prompt_completion"}.get(split_name)
    if fmt is None:
        return rows
    out = []
    for i, row in enumerate(rows):
        why = validate(fmt, row)
        if why:
            raise DataError(f"builtin:arithmetic {split_name} row {i}: {why}")
        out.append(normalise(fmt, row))
    return out


def dedup(rows: list[dict]) -> tuple[list[dict], int]:
    seen, out = set(), []
    for row in rows:
        key = json.dumps(row, sort_keys=True, ensure_ascii=False)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out, len(rows) - len(out)


def filter_length(tokenizer, rows: list[dict], max_length: int) -> tuple[list[dict], int]:
    ok = fits(tokenizer, rows, max_length)
    kept = [r for r, keep in zip(rows, ok, strict=True) if keep]
    return kept, len(rows) - len(kept)


def fits(tokenizer, rows: list[dict], max_length: int) -> list[bool]:
    """Whether each row's prompt + completion is at most max_length tokens. Rows with more characters
    than max_length tokens can hold are not tokenised at all (tokenising a 10 MB row takes a minute)."""
    bound = max_length * longest_token_chars(tokenizer)
    short = [i for i, r in enumerate(rows)
             if sum(content_chars(r.get(k)) for k in ("prompt", "completion", "text")) <= bound]
    ok = [False] * len(rows)
    for i, t in zip(short, tokenize_sft(tokenizer, [rows[i] for i in short]) if short else [], strict=True):
        ok[i] = len(t["input_ids"]) <= max_length
    return ok


def check_not_all_too_long(source: str, kept: int, too_long: int, max_length: int) -> None:
    if too_long and not kept:
        raise DataError(f"{source}: all {too_long} SFT row(s) are longer than preprocess.max_length = {max_length} "
                        "tokens; raise preprocess.max_length or shorten the rows")


def carve_eval(sft: list[dict], fraction: float, rng: random.Random, source: str) -> tuple[list[dict], list[dict]]:
    sft = list(sft)
    rng.shuffle(sft)
    n_eval = int(len(sft) * fraction)
    if n_eval == 0:
        raise DataError(f"{source}: no eval split: set data.eval_source, or preprocess.eval_fraction > 0 "
                        f"large enough for {len(sft)} rows")
    return sft[:n_eval], sft[n_eval:]


def split(rows: list[dict], fraction: float, rng: random.Random) -> tuple[list[dict], list[dict]]:
    rows = list(rows)
    rng.shuffle(rows)
    n_val = max(1, int(len(rows) * fraction)) if fraction > 0 and len(rows) > 1 else 0
    return rows[n_val:], rows[:n_val]


def run_streaming(ctx, tokenizer, buffer_rows: int = 1024) -> dict[str, Any]:
    """One pass over the data files in constant memory (bar one 20-byte digest per kept row, for dedup,
    and one per held-out prompt).

    Rows go straight to their output file; the split is decided by a seeded hash of the row's
    content (so it is deterministic and needs no shuffle), eval first when carved from the SFT rows.
    The dev split is decided before that, by a seeded hash of the row's *prompt*: every row whose
    prompt falls in the dev share is a dev row (an SFT row with a reference) or dropped (any other
    row), so no training file holds a dev prompt. The held-out files are read first, for the same
    reason: a dev row never repeats an eval prompt, and no training row a prompt of data.dev_source.
    SFT rows are not derived from preference rows here (that needs a second pass): give SFT rows.
    """
    p = ctx.params
    pre, seed = p.preprocess, p.run.seed
    files: dict[str, Any] = {}
    counts: dict[str, int] = {}
    dropped: dict[str, dict[str, int]] = {}
    seen: set[bytes] = set()
    where = describe_sources(p.data)
    prompts_of: dict[str, set[bytes]] = {"eval": set(), "dev": set()}  # digests of the held-out prompts

    def write(name: str, row: dict) -> None:
        if name not in files:
            files[name] = open(ctx.out / f"{name}.jsonl", "w", encoding="utf-8")
        files[name].write(json.dumps(row, ensure_ascii=False) + "\n")
        counts[name] = counts.get(name, 0) + 1
        if name in prompts_of and "prompt" in row:
            prompts_of[name].add(_prompt_digest(row["prompt"]))

    def count(dest: str, why: str) -> None:
        dropped.setdefault(dest, {}).setdefault(why, 0)
        dropped[dest][why] += 1

    def is_dev_prompt(row: dict) -> bool:
        if "prompt" not in row:
            return False
        digest = _prompt_digest(row["prompt"])
        if digest in prompts_of["eval"]:
            return False  # eval wins: no dev row repeats an eval prompt
        if p.data.dev_source:
            return digest in prompts_of["dev"]
        return _share(hashlib.sha1(f"{seed}:dev:".encode() + digest).digest()) < pre.dev_fraction

    def flush(buffer: list[tuple[bytes, str, dict]]) -> None:
        sft = [r for _, dest, r in buffer if dest == "sft"]
        ok = iter(fits(tokenizer, sft, pre.max_length) if sft else [])
        for digest, dest, row in buffer:
            if dest == "sft" and not next(ok):
                count(dest, "too_long")
            elif is_dev_prompt(row):
                carve = dest == "sft" and not p.data.dev_source and row.get("completion")
                if carve and _prompt_digest(row["prompt"]) not in prompts_of["dev"]:
                    write("dev", row)
                else:  # another row of a dev prompt, or a dev prompt in a file of another kind: never trained on
                    count(dest, "dev_prompt")
            else:
                write(dest if dest != "sft" else _bucket(digest, pre, carve_eval=not p.data.eval_source), row)
        buffer.clear()

    sources, held_out_sources = [], []
    try:
        for key, path in data_files(p.data):  # held-out first: the split of every other row depends on their prompts
            if key not in HELD_OUT_KEYS:
                continue
            name, report = key.removeprefix("data.").removesuffix("_source"), LoadReport(str(path))
            for row in iter_source(path, report):
                if name == "dev" and _prompt_digest(row["prompt"]) in prompts_of["eval"]:
                    count("dev", "eval_prompt")
                else:
                    write(name, row)
            check_report(report, p.data.on_bad_rows)
            check_held_out_format(key, path, report.format)
            held_out_sources.append({"key": key, **report.as_dict(), **source_identity(key, getattr(p.data, key[5:]))})
        buffer: list[tuple[bytes, str, dict]] = []
        for key, path in data_files(p.data):
            if key in HELD_OUT_KEYS:
                continue
            report = LoadReport(str(path))
            for fmt, row in iter_rows(path, report, key=key.removeprefix("data.")):
                dest = FORMATS[fmt][2]
                digest = hashlib.sha1(f"{seed}:{json.dumps(row, sort_keys=True)}".encode()).digest()
                if pre.dedup and digest in seen:
                    count(dest, "duplicate")
                    continue
                seen.add(digest)
                buffer.append((digest, dest, row))
                if len(buffer) >= buffer_rows:
                    flush(buffer)
            flush(buffer)
            check_report(report, p.data.on_bad_rows)
            sources.append({"key": key, **report.as_dict(), **source_identity(key, getattr(p.data, key[5:]))})
        sources += held_out_sources
        if "dev" not in files:  # always written, as in memory: an empty dev split is allowed
            write_jsonl(ctx.out / "dev.jsonl", [])
            counts["dev"] = 0
    finally:
        for f in files.values():
            f.close()
    carved = [k for k in ("eval", "dev") if not getattr(p.data, f"{k}_source")]
    kept_sft = counts.get("sft_train", 0) + counts.get("sft_validation", 0) + sum(counts.get(k, 0) for k in carved)
    check_not_all_too_long(where, kept_sft, dropped.get("sft", {}).get("too_long", 0), pre.max_length)
    if not counts.get("eval"):
        raise DataError(f"{where}: the streamed split left no eval rows; set data.eval_source or raise "
                        "preprocess.eval_fraction")
    (ctx.out / "report.json").write_text(json.dumps({"sources": sources, "dropped": dropped, "rows": counts},
                                                    indent=2))
    return {"rows": counts, "dropped": dropped, "invalid_rows": sum(s["invalid"] for s in sources),
            "streaming": True, "table": [{"file": f"{k}.jsonl", "rows": v} for k, v in counts.items()]}


def _prompt_digest(prompt: Any) -> bytes:
    return hashlib.sha1(prompt_key(prompt).encode()).digest()


def _share(digest: bytes) -> float:
    """A digest as a number in [0, 1)."""
    return int.from_bytes(digest[:8], "big") / 2**64


def _bucket(digest: bytes, pre, *, carve_eval: bool) -> str:
    """The split of an SFT row from its content hash: eval (if carved), validation, or train."""
    u = _share(digest)
    eval_share = pre.eval_fraction if carve_eval else 0.0
    if u < eval_share:
        return "eval"
    if u < eval_share + pre.validation_fraction:
        return "sft_validation"
    return "sft_train"
