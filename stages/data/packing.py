"""Packing tokenised rows into rows of a fixed length, so batches hold no padding.

`pack_dataset(dataset, seq_length, strategy)` takes rows with `input_ids` (and any other per-token list
columns, such as `completion_mask`) and returns packed rows with the same columns plus `seq_lengths` (the
lengths of the sequences packed into the row) and `position_ids` (restarting at each sequence), which keep
packed sequences apart (see `stages.data.collators.CompletionCollator`). Strategies:

- `bfd`: best-fit decreasing, whole sequences into bins of `seq_length` tokens; a longer sequence is
  truncated to it;
- `wrapped`: everything concatenated and cut into rows of exactly `seq_length`; a sequence cut at a row's
  edge continues, from position 0, in the next row.

All the work is on flat numpy arrays.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heappop, heappush
from typing import Any

import numpy as np

__all__ = ["PACKING_STRATEGIES", "pack_dataset"]

# generated here; an input's own are ignored and recomputed
_GENERATED = ("position_ids", "seq_lengths")


def pack_dataset(dataset, seq_length: int, strategy: str = "bfd"):
    """Pack `dataset` (a `datasets.Dataset` or a list of dicts) into rows of at most `seq_length` tokens.

    Per-token columns are `input_ids` and every other list column whose length equals the
    row's `input_ids` in every row; they are packed alongside. Other columns (strings,
    per-row values) cannot be split across packed rows and are dropped. Empty rows are
    dropped. Returns the same type as given.

    Output per row: every per-token column, `position_ids` (T,), `seq_lengths` (k,) with
    sum(seq_lengths) == T <= seq_length.
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"packing strategy {strategy!r} is not supported; use one of: "
                         f"{', '.join(PACKING_STRATEGIES)}")
    if not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length = {seq_length!r}: must be a positive integer (tokens per packed row)")
    is_list = isinstance(dataset, list)
    lengths, columns = _read_list(dataset) if is_list else _read_dataset(dataset)
    keep = lengths > 0
    if not keep.all():
        lengths, columns = _drop_empty(lengths, columns, keep)
    take, seq_lengths, seqs_per_row = PACKING_STRATEGIES[strategy](lengths, seq_length)
    seq_offsets = np.concatenate([[0], np.cumsum(seqs_per_row)]).astype(np.int64)
    row_offsets = np.concatenate([[0], np.cumsum(seq_lengths)]).astype(np.int64)[seq_offsets]
    packed = {name: values[take] for name, values in columns.items()}
    packed["position_ids"] = _positions(seq_lengths)
    if is_list:
        return _write_list(packed, row_offsets, seq_lengths, seq_offsets)
    return _write_dataset(packed, row_offsets, seq_lengths, seq_offsets)


def _bfd(lengths: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best-fit decreasing. lengths: (N,) -> (token indices (M,), seq lengths (K,), seqs per row (R,)).

    Each sequence, longest first, goes into the open bin with the least room that still
    fits it (of equally tight bins, the first opened), else a new bin. Bins are kept by
    remaining room: a sorted list of the room values that have open bins, and a heap of
    bin numbers for each value, so one placement is a bisect over at most seq_length + 1
    values.
    """
    clipped = np.minimum(lengths, seq_length)
    order = np.argsort(-clipped, kind="stable")
    rooms: list[int] = []  # sorted room values that have at least one open bin
    bins_with_room: dict[int, list[int]] = {}
    bin_of = np.empty(len(order), dtype=np.int64)
    n_bins = 0
    for i, n in zip(order.tolist(), clipped[order].tolist(), strict=True):
        j = bisect_left(rooms, n)
        if j == len(rooms):
            b, room = n_bins, seq_length
            n_bins += 1
        else:
            room = rooms[j]
            b = heappop(bins_with_room[room])
            if not bins_with_room[room]:
                del rooms[j]
        bin_of[i] = b
        room -= n
        if room > 0:
            if room not in bins_with_room or not bins_with_room[room]:
                bins_with_room[room] = []
                insort(rooms, room)
            heappush(bins_with_room[room], b)
    # sequences in bin order, and within a bin in the order they were placed
    placed = order[np.argsort(bin_of[order], kind="stable")]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    take = _ranges(starts[placed], clipped[placed])
    return take, clipped[placed], np.bincount(bin_of, minlength=n_bins)


def _wrapped(lengths: np.ndarray, seq_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenate and cut every seq_length tokens. lengths: (N,) -> (token indices, seq lengths, seqs per row).

    A sequence piece starts at every original sequence start and every row start.
    """
    total = int(lengths.sum())
    seq_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    starts = np.union1d(seq_starts, np.arange(0, total, seq_length))
    pieces = np.diff(np.append(starts, total))
    rows = starts // seq_length
    return np.arange(total, dtype=np.int64), pieces.astype(np.int64), np.bincount(rows).astype(np.int64)


PACKING_STRATEGIES = {"bfd": _bfd, "wrapped": _wrapped}


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated arange(s, s + n) for each (s, n): (K,), (K,) -> (sum(lengths),)."""
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _positions(seq_lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each sequence length n, concatenated: (K,) -> (sum(seq_lengths),)."""
    return _ranges(np.zeros_like(seq_lengths), seq_lengths)


def _drop_empty(lengths, columns, keep):
    flat_keep = np.repeat(keep, lengths)
    return lengths[keep], {name: values[flat_keep] for name, values in columns.items()}


def _read_list(rows: list[dict[str, Any]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(lengths (N,), per-token column -> flat values (sum(lengths),)) of a list of dicts."""
    if not rows or "input_ids" not in rows[0]:
        raise ValueError("pack_dataset needs tokenised rows with an 'input_ids' column"
                         + ("" if not rows else f"; found columns {sorted(rows[0])}"))
    lengths = np.fromiter((len(r["input_ids"]) for r in rows), dtype=np.int64, count=len(rows))
    columns = {}
    for name, value in rows[0].items():
        if name in _GENERATED or not isinstance(value, (list, tuple)):
            continue
        if all(len(r.get(name, ())) == n for r, n in zip(rows, lengths.tolist(), strict=True)):
            columns[name] = np.fromiter((x for r in rows for x in r[name]), dtype=np.int64,
                                        count=int(lengths.sum()))
    return lengths, columns


def _read_dataset(dataset) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    if "input_ids" not in dataset.column_names:
        raise ValueError(f"pack_dataset needs tokenised rows with an 'input_ids' column; found {dataset.column_names}")
    table = dataset.with_format("arrow")[:]  # applies any indices mapping (shuffle, select)
    ids = table.column("input_ids").combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64)
    columns = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if name in _GENERATED or not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            continue
        if np.array_equal(pc.list_value_length(column).to_numpy(zero_copy_only=False), lengths):
            columns[name] = column.flatten().to_numpy(zero_copy_only=False)
    return lengths, columns


def _write_list(packed, row_offsets, seq_lengths, seq_offsets) -> list[dict[str, list[int]]]:
    lists = {name: values.tolist() for name, values in packed.items()}
    seqs = seq_lengths.tolist()
    r, s = row_offsets.tolist(), seq_offsets.tolist()
    return [{**{name: v[r[i]:r[i + 1]] for name, v in lists.items()}, "seq_lengths": seqs[s[i]:s[i + 1]]}
            for i in range(len(r) - 1)]


def _write_dataset(packed, row_offsets, seq_lengths, seq_offsets):
    import datasets
    import pyarrow as pa

    def as_lists(offsets, values):
        if offsets[-1] < 2**31:
            return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values))
        return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))

    table = pa.table({**{name: as_lists(row_offsets, values) for name, values in packed.items()},
                      "seq_lengths": as_lists(seq_offsets, seq_lengths)})
    return datasets.Dataset(table)
