"""Helpers for tests that run the whole pipeline on data and models of a user's own (not the built-ins).

`arithmetic_files` writes the built-in task as the files a user would bring (conversational or
plain strings, one file per kind or one mixed file); `run_pipeline` runs every stage in this
process, in pipeline order, as `python -m stages <stage>` does.
"""
from __future__ import annotations

import json
from pathlib import Path

from stages.builtin import arithmetic
from tests.conftest import STAGE_ORDER


def _plain(row: dict) -> dict:
    """A conversational row of the built-in task as plain strings: "47+85=" -> "132"."""
    def text(value):
        return value if isinstance(value, str) else value[-1]["content"]

    out = {}
    if "messages" in row:
        return {"prompt": text(row["messages"][:-1]) + "=", "completion": text(row["messages"][-1:])}
    for key, value in row.items():
        out[key] = text(value) + ("=" if key == "prompt" else "") if isinstance(value, (str, list)) else value
    return out


def arithmetic_rows(*, plain: bool = False, num_train: int = 300, num_preference: int = 60,
                    num_eval: int = 20) -> dict[str, list[dict]]:
    """The built-in task's splits (sft as messages rows, preference, prompts, eval), no reasoning blocks."""
    splits = arithmetic.generate(num_train=num_train, num_preference=num_preference, num_eval=num_eval, digits=2,
                                 error_rate=0.7, reasoning=False, seed=0)
    splits.pop("unpaired")
    return {k: [_plain(r) for r in rows] for k, rows in splits.items()} if plain else splits


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arithmetic_files(folder: Path, *, plain: bool = False, **sizes) -> dict[str, Path]:
    """{sft, preference, prompts, eval, mixed}: one .jsonl per kind, and all training kinds in one mixed file."""
    rows = arithmetic_rows(plain=plain, **sizes)
    files = {name: write_jsonl(folder / f"{name}.jsonl", r) for name, r in rows.items()}
    mixed = [r for name in ("sft", "preference", "prompts") for r in rows[name]]
    files["mixed"] = write_jsonl(folder / "mixed.jsonl", mixed)
    return files


def run_pipeline(params, stages=STAGE_ORDER) -> dict[str, dict]:
    """Every stage in order, in this process; {stage: manifest}."""
    from stages.harness.runner import run_stage

    return {name: run_stage(name, params) for name in stages}


def evaluate_table(params) -> list[dict]:
    return json.loads((Path(params.run.output_dir) / "evaluate" / "metrics.json").read_text())


def hub_layout_folder(folder: Path, splits: dict[str, list[dict]], shards: dict[str, int] | None = None,
                      rename: dict[str, str] | None = None) -> Path:
    """A dataset folder as the hub lays it out: data/<split>-0000i-of-0000n.parquet per split and a README.md
    whose `configs:` name each split's files. `rename`: {column in the rows: column written}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "data").mkdir(parents=True, exist_ok=True)
    rename = rename or {}
    config = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split, rows in splits.items():
        n = (shards or {}).get(split, 1)
        size = -(-len(rows) // n)
        columns = list(dict.fromkeys(k for r in rows for k in r))  # a field some rows lack is null in the others
        for i in range(n):
            part = rows[i * size:(i + 1) * size]
            table = pa.table({rename.get(k, k): [r.get(k) for r in part] for k in columns})
            pq.write_table(table, folder / "data" / f"{split}-{i:05d}-of-{n:05d}.parquet")
        config += [f"  - split: {split}", f"    path: data/{split}-*"]
    (folder / "README.md").write_text("\n".join(config + ["---", "", "# A dataset in the hub's layout", ""]))
    return folder
