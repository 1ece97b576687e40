"""Data keys given the way the Hugging Face ecosystem ships datasets, read through `datasets.load_dataset`.

A data key (`data.source`, `data.sft`, `data.preference`, `data.prompts`, `data.eval_source`,
`data.dev_source`) takes a path string, as before, or a mapping:

    data:
      sft: {path: org/name | ./folder | "shards/*.parquet", name: default, split: "train[:90%]",
            columns: {question: prompt, answer: completion}, data_files: null, revision: null}

A path string naming a file (.jsonl, .json, .parquet, .csv) or a `save_to_disk` folder is read
line by line by `stages.data.io` (errors name the line). Everything else is a `DataSpec`:

- a folder in the hub's layout (`data/train-00000-of-00002.parquet`, `data/test-*.parquet`, a
  README.md whose `configs:` name the files of each split), or a glob of files;
- a hub id (`org/name`, mapping form only): read from the local Hugging Face cache (what
  `hf download --repo-type dataset org/name` fills); with the hub unreachable an id
  that is not there fails within seconds, naming the command that downloads it.

A folder is read only if it holds data files (`data_files_in`): a folder with nothing but a readme (which
`load_dataset` would read as rows of text) is an error naming the key and the folder. What a key loaded (rows,
builder, files) goes to the log.

`split` takes the `datasets` slicing syntax (`train[:90%]`, `test[10:200]`); `columns` renames
columns before the row format is detected. `check(key, value)` finds a missing column, an unknown
split or config and a slice that leaves no rows at params validation, before any model is built.

`rows_hash(value)` is what a data key contributes to the preprocess fingerprint: a hash of the
rows as preprocess reads them (after renaming), so the same rows as a .jsonl file, a hub-layout
folder or a cached hub id fingerprint alike, and editing any file they come from makes
preprocess stale.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.data.io import DataError, Row
from stages.data.io import read_rows as read_file_rows

SPEC_KEYS = ("path", "name", "split", "columns", "data_files", "revision")
PLAIN_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
REACH_TIMEOUT_S = 3.0  # how long a hub that does not answer may delay the error
# What load_dataset reads from a folder (the extensions of its json, csv, parquet, arrow and text builders, each
# also compressed); the files it skips; and files that describe a dataset, never hold its rows (by stem, any case).
DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".parquet", ".arrow", ".txt")
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
SKIPPED_BY_DATASETS = ("config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json")
NOT_DATA = ("readme", "license", "licence")
SHOWN_FILES = 5  # files named in the log line and in errors

log = logging.getLogger(__name__)


class DataSourceError(DataError):
    """A data key that cannot be loaded: `key` is the dotted key at fault ("data.sft.columns"), `why` says why
    and how to fix it."""

    def __init__(self, key: str, why: str):
        self.key, self.why = key, why
        super().__init__(f"{key} {why}")


@dataclass(frozen=True)
class DataSpec:
    """One data key read through `datasets`: where (`path`), which config (`name`) and split, renamed columns."""

    key: str  # the dotted params key, for messages: "data.sft"
    path: str
    name: str | None = None
    split: str = "train"
    columns: tuple[tuple[str, str], ...] = ()  # (column in the files, name preprocess reads)
    data_files: str | tuple[str, ...] | None = None
    revision: str | None = None

    def __str__(self) -> str:
        config = f" ({self.name})" if self.name else ""
        return f"{self.path}{config} [{self.split}]"


def is_spec_value(value: Any) -> bool:
    """Whether a data key's value is read through `datasets` (a mapping, a glob, a hub-layout folder)."""
    if isinstance(value, dict):
        return True
    if not isinstance(value, str) or value.startswith("builtin:"):
        return False
    path = Path(value).expanduser()
    if _has_glob(value):
        return True
    return path.is_dir() and not _is_saved(path)


def spec_of(key: str, value: Any) -> DataSpec:
    """The DataSpec of data key `key` = `value` (a string or a mapping checked by `shape_problems`)."""
    if isinstance(value, str):
        return DataSpec(key, value)
    columns = tuple((str(k), str(v)) for k, v in (value.get("columns") or {}).items())
    files = value.get("data_files")
    return DataSpec(key, str(value["path"]), value.get("name"), value.get("split") or "train", columns,
                    tuple(files) if isinstance(files, list) else files, value.get("revision"))


def shape_problems(key: str, value: Any) -> list[str]:
    """Why a mapping value of data key `key` is malformed (unknown keys, wrong types); [] when well-formed."""
    if not isinstance(value, dict):
        return []
    problems = [f"{key}.{k}: unknown key; a data mapping takes {', '.join(SPEC_KEYS)}" for k in value
                if k not in SPEC_KEYS]
    if not isinstance(value.get("path"), str) or not value["path"]:
        problems.append(f"{key}.path = {value.get('path')!r}: expected a hub id (org/name), a folder, a file or a "
                        "glob such as shards/*.parquet")
    for name in ("name", "split", "revision"):
        if value.get(name) is not None and not isinstance(value[name], str):
            problems.append(f"{key}.{name} = {value[name]!r}: expected a string")
    columns = value.get("columns")
    if columns is not None and not (isinstance(columns, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in columns.items())):
        problems.append(f"{key}.columns = {columns!r}: expected a mapping of column in the data to column name, "
                        "e.g. {question: prompt, answer: completion}")
    files = value.get("data_files")
    if files is not None and not (isinstance(files, str) or (
            isinstance(files, list) and all(isinstance(f, str) for f in files))):
        problems.append(f"{key}.data_files = {files!r}: expected a file pattern or a list of them")
    return problems


def check(spec: DataSpec) -> tuple[str, str] | None:
    """None when `spec` loads with rows left, else (dotted key, why): a missing column, split or config, an empty
    slice, an id not in the cache. For params validation, before any model is built."""
    try:
        ds = load(spec)
    except DataSourceError as e:
        return e.key, e.why
    if len(ds) == 0:
        return f"{spec.key}.split", f"= {spec.split!r}: {spec.path} has no rows left in it; widen the split or slice"
    return None


def read_rows(spec: DataSpec) -> Iterator[Row]:
    """Every row of `spec` as `stages.data.io.Row` (where: "path [split] row N"); nulls that Arrow filled in for
    fields a row does not have are dropped, so rows come back with the fields they were written with."""
    ds = load(spec)
    for start in range(0, len(ds), 1000):
        batch = ds[start:start + 1000]
        names = list(batch)
        for i, values in enumerate(zip(*(batch[n] for n in names), strict=True)):
            yield Row(f"{spec} row {start + i}", drop_nulls(dict(zip(names, values, strict=True))))


def drop_nulls(value: Any) -> Any:
    """Dicts without their None-valued fields, recursively (Arrow fills absent struct fields with null)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def load(spec: DataSpec):
    """The `datasets.Dataset` of `spec`, columns renamed; memoised per spec and the files' sizes and times."""
    where = resolve(spec)
    return _load(spec, where, _stats(where))


def resolve(spec: DataSpec) -> str:
    """The local folder, file or glob `spec` reads (a hub id: its snapshot in the Hugging Face cache)."""
    path = Path(spec.path).expanduser()
    if _has_glob(spec.path):
        if not glob.glob(str(path), recursive=True):
            raise DataSourceError(spec.key, f"= {spec.path!r}: the pattern matches no file (relative paths are "
                                  f"from the working directory {Path.cwd()})")
        return str(path)
    if path.exists():
        return str(path)
    if HUB_ID.fullmatch(spec.path) and not spec.path.startswith((".", "/", "~")):
        return hub_snapshot(spec)
    raise DataSourceError(spec.key, f"= {spec.path!r}: no such file or folder (relative paths are from the working "
                          f"directory {Path.cwd()}), and not a hub id (org/name); fix the path")


def download_command(spec: DataSpec) -> str:
    revision = f" --revision {spec.revision}" if spec.revision else ""
    return f"hf download --repo-type dataset {spec.path}{revision}"


def hub_snapshot(spec: DataSpec) -> str:
    """The cached snapshot folder of hub id `spec.path`. Not cached: downloaded if the hub answers within
    REACH_TIMEOUT_S, else DataSourceError naming the download command (HF_HUB_OFFLINE=1: at once)."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(spec.path, repo_type="dataset", revision=spec.revision, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    why = "the hub is turned off here (HF_HUB_OFFLINE=1)"
    if not constants.HF_HUB_OFFLINE:
        try:
            HfApi().dataset_info(spec.path, revision=spec.revision, timeout=REACH_TIMEOUT_S)
            return snapshot_download(spec.path, repo_type="dataset", revision=spec.revision)
        except Exception as e:  # unreachable, unknown repo, gated: every case ends in the same advice
            why = f"the hub did not answer ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    raise DataSourceError(spec.key, f"= {spec.path!r}: dataset id not in the local Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}) and {why}; download it on a machine with access: "
                          f"`{download_command(spec)}` (or python -c \"import huggingface_hub; "
                          f"huggingface_hub.snapshot_download('{spec.path}', repo_type='dataset')\"), with HF_HOME "
                          "pointing at the cache this run reads")


@functools.lru_cache(maxsize=32)
def _load(spec: DataSpec, where: str, stats: tuple):
    ds = _load_split(spec, where, _cache_dir(stats))
    have = ds.column_names
    missing = [src for src, _ in spec.columns if src not in have]
    if missing:
        raise DataSourceError(f"{spec.key}.columns", f"names column {missing[0]!r}, which {spec} does not have; its "
                              f"columns: {', '.join(have)}")
    renamed = dict(spec.columns)
    clash = [dst for src, dst in spec.columns if dst in have and dst not in renamed]
    if clash:
        raise DataSourceError(f"{spec.key}.columns", f"renames a column to {clash[0]!r}, which {spec} already has; "
                              f"map that column too, or drop it from the data")
    ds = ds.rename_columns(renamed) if renamed else ds
    reader = "load_from_disk" if _is_saved(Path(where)) else f"the {ds.info.builder_name} builder"
    log.info("%s: %d rows of %s, read by %s from %s", spec.key, len(ds), spec, reader,
             _listing(loaded_files(spec, where)))
    return ds


def _cache_dir(stats: tuple) -> str:
    """Where `datasets` keeps the Arrow copy of these exact files: its own cache key for a local folder is its
    path, which would hand back the old rows after a shard is edited in place."""
    import datasets

    digest = hashlib.sha256(repr(stats).encode()).hexdigest()[:20]
    return str(Path(datasets.config.HF_DATASETS_CACHE) / "align-sources" / digest)


def _load_split(spec: DataSpec, where: str, cache_dir: str):
    import datasets

    path = Path(where)
    try:
        if path.is_dir() and _is_saved(path):
            return _saved_split(spec, datasets.load_from_disk(where))
        if path.is_dir():
            if spec.data_files is None and not data_files_in(path):
                raise DataSourceError(spec.key, _no_data_files(spec, path))
            return datasets.load_dataset(where, name=spec.name, split=spec.split, data_files=_files(spec),
                                         cache_dir=cache_dir)
        builder = BUILDERS.get(Path(glob.glob(where, recursive=True)[0] if _has_glob(where) else where).suffix)
        if builder is None:
            raise DataSourceError(spec.key, f"= {spec.path!r}: unsupported file type; use one of "
                                  f"{', '.join(BUILDERS)}")
        return datasets.load_dataset(builder, data_files=where, split=spec.split, cache_dir=cache_dir)
    except DataSourceError:
        raise
    except ValueError as e:
        raise DataSourceError(*_split_message(spec, where, e)) from None
    except Exception as e:  # malformed files: datasets and pyarrow raise many types
        raise DataSourceError(spec.key, f"= {spec}: cannot load it: {type(e).__name__}: {e}") from None


def _split_message(spec: DataSpec, where: str, e: ValueError) -> tuple[str, str]:
    """(key, why) of a ValueError `datasets` raised for a split, a slice or a config name."""
    text = str(e)
    if "corresponds to no data" in text:
        return f"{spec.key}.split", f"= {spec.split!r}: no rows are left after the slice; widen it"
    if "Unknown split" in text or "Bad split" in text:
        return f"{spec.key}.split", (f"= {spec.split!r}: {spec.path} has no such split; its splits: "
                                     f"{', '.join(splits(spec, where)) or '(none found)'}")
    if "BuilderConfig" in text:
        return f"{spec.key}.name", f"= {spec.name!r}: {text}"
    return spec.key, f"= {spec}: {text}"


def splits(spec: DataSpec, where: str) -> list[str]:
    """The split names of the folder or files `spec` reads."""
    import datasets

    path = Path(where)
    if path.is_dir() and _is_saved(path):
        ds = datasets.load_from_disk(where)
        return list(ds) if isinstance(ds, datasets.DatasetDict) else ["train"]
    try:
        if path.is_dir():
            return list(datasets.load_dataset_builder(where, name=spec.name, data_files=_files(spec))
                        .config.data_files or [])
    except Exception:
        return []
    return ["train"]


def _saved_split(spec: DataSpec, saved):
    """The split (slices included) of a `save_to_disk` dataset or DatasetDict."""
    import datasets

    parts = saved if isinstance(saved, datasets.DatasetDict) else datasets.DatasetDict({"train": saved})
    instruction = datasets.ReadInstruction.from_spec(spec.split)
    lengths = {name: len(ds) for name, ds in parts.items()}
    out = []
    for absolute in instruction.to_absolute(lengths):  # raises ValueError for an unknown split or an empty slice
        out.append(parts[absolute.splitname].select(range(absolute.from_, absolute.to)))
    return out[0] if len(out) == 1 else datasets.concatenate_datasets(out)


def data_files_in(folder: Path) -> list[Path]:
    """The files under `folder` that hold rows for `load_dataset` (DATA_SUFFIXES), hidden ones, readmes and licences
    left out."""
    out = []
    for path in _visible_files(folder):
        name = path.name.lower()
        name = next((name.removesuffix(c) for c in COMPRESSED if name.endswith(c)), name)
        stem, suffix = os.path.splitext(name)
        if suffix in DATA_SUFFIXES and stem not in NOT_DATA and name not in SKIPPED_BY_DATASETS:
            out.append(path)
    return out


def _visible_files(folder: Path) -> list[Path]:
    """Files under `folder`, those in hidden folders (.git, __pycache__) and hidden files left out, as load_dataset
    leaves them out."""
    return [p for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith((".", "__")) for part in p.relative_to(folder).parts)]


def _no_data_files(spec: DataSpec, folder: Path) -> str:
    """Why a folder without data files is refused, and how to fix it."""
    present = [p.relative_to(folder).as_posix() for p in _visible_files(folder)]
    held = f"holds no data file, only {_names(present)}" if present else "holds no file"
    texts = [f for f in present if f.lower().endswith(".txt")]
    read_as = (f" (load_dataset would read {', '.join(texts[:SHOWN_FILES])} as rows of text)" if texts else "")
    return (f"= {spec.path!r}: the folder {folder} {held}{read_as}. Put the rows in it as .jsonl, .json, .csv, "
            f".parquet or .arrow files (or .txt, one text row per line), or set {spec.key} to a data file")


def loaded_files(spec: DataSpec, where: str) -> list[str]:
    """The files `spec` read (a folder's relative to it; the patterns of `data_files` as given)."""
    path = Path(where)
    if _has_glob(where):
        return sorted(glob.glob(where, recursive=True))
    if spec.data_files is not None:
        return list(spec.data_files) if isinstance(spec.data_files, tuple) else [spec.data_files]
    if path.is_dir() and not _is_saved(path):
        return [p.relative_to(path).as_posix() for p in data_files_in(path)]
    return [where]


def _names(files: list[str]) -> str:
    more = f" (+{len(files) - SHOWN_FILES} more)" if len(files) > SHOWN_FILES else ""
    return ", ".join(files[:SHOWN_FILES]) + more


def _listing(files: list[str]) -> str:
    return f"{len(files)} file{'s' if len(files) != 1 else ''}: {_names(files)}"


def _files(spec: DataSpec):
    return list(spec.data_files) if isinstance(spec.data_files, tuple) else spec.data_files


def _is_saved(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _stats(where: str) -> tuple:
    """(path, size, mtime) of every file `where` covers: the memo key of what was loaded."""
    path = Path(where)
    files = (sorted(Path(p) for p in glob.glob(where, recursive=True)) if _has_glob(where) else
             sorted(q for q in path.rglob("*") if q.is_file()) if path.is_dir() else [path])
    return tuple((p.as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file())


def rows_hash(key: str, value: Any) -> str | None:
    """A hash of the rows data key `key` = `value` gives preprocess, in order (None for a builtin or no value):
    the same rows hash alike whether they come from a .jsonl file, a hub-layout folder or the hub cache."""
    if value is None or (isinstance(value, str) and value.startswith("builtin:")):
        return None
    if is_spec_value(value):
        spec = spec_of(key, value)
        where = resolve(spec)
        return _spec_rows_hash(spec, where, _stats(where))
    path = Path(value).expanduser()
    if not path.exists():
        return None
    return _file_rows_hash(str(path.resolve()), _stats(str(path)))


@functools.lru_cache(maxsize=32)
def _spec_rows_hash(spec: DataSpec, where: str, stats: tuple) -> str:
    return _hash_rows(read_rows(spec))


@functools.lru_cache(maxsize=32)
def _file_rows_hash(path: str, stats: tuple) -> str:
    try:
        return _hash_rows(read_file_rows(path))
    except DataError:  # unreadable as a whole: its bytes identify it (preprocess reports why)
        h = hashlib.sha256()
        for file, _, _ in stats:
            h.update(file.encode() + Path(file).read_bytes())
        return "bytes:" + h.hexdigest()


def _hash_rows(rows) -> str:
    h = hashlib.sha256()
    for row in rows:
        text = (json.dumps(row.value, sort_keys=True, ensure_ascii=False, default=str) if row.value is not None
                else f"!{row.where.rsplit(':', 1)[-1]}:{row.error}")  # a bad row: its position and why
        h.update(text.encode())
        h.update(b"\n")
    return h.hexdigest()


def local_paths(value: Any) -> list[str]:
    """The local files or folders a data key's value reads (for `dvc.yaml` deps); a hub id has none."""
    if isinstance(value, dict):
        value = value.get("path")
    if not isinstance(value, str) or value.startswith("builtin:"):
        return []
    if _has_glob(value):
        return sorted(glob.glob(os.path.expanduser(value), recursive=True))
    return [value] if Path(value).expanduser().exists() else []


def source_identity(key: str, value: Any) -> dict[str, Any]:
    """What preprocess records about a data key read through `datasets` (its report and manifest): the spec, the
    local folder or files it resolved to, the hub revision (the cached snapshot's commit) and the rows' hash.
    {} for a plain file or a builtin."""
    if not is_spec_value(value):
        return {}
    spec = spec_of(key, value)
    where = resolve(spec)
    hub = not Path(spec.path).expanduser().exists() and not _has_glob(spec.path)
    return {"dataset": {"path": spec.path, "name": spec.name, "split": spec.split, "columns": dict(spec.columns),
                        "resolved": where, **({"revision": Path(where).name} if hub else {}),
                        "rows_sha256": rows_hash(key, value)}}
