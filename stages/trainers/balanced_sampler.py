"""Batches balanced over a column (source, task, prompt, ...).

`BalancedBatchSampler` yields batches of indices in which every group of the column is
represented equally: with K groups and batch size b, each batch takes b // K rows of every
group plus one more from b % K groups (a different random choice of groups each batch). The
groups are shuffled once per pass and cycled, so small groups are oversampled and large ones
undersampled; one pass is len(groups) // b batches, as many as an ordinary epoch.

`transformers.Trainer` takes an index sampler and chunks it by the batch size itself, so
`FlatSampler` lays the balanced batches end to end for it (each chunk is then one balanced
batch, also when accelerate shards whole batches across processes).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

import torch
from torch.utils.data import Sampler


class BalancedBatchSampler(Sampler[list[int]]):
    """groups: (N,) the column's value per row; batch_size: rows per batch; seed: shuffling seed.

    Every call to `__iter__` starts a new pass with a new shuffle (seeded by seed and the pass
    number, so runs are reproducible).
    """

    def __init__(self, groups: Sequence[Hashable], batch_size: int, *, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size}: must be >= 1")
        if len(groups) < batch_size:
            raise ValueError(f"{len(groups)} rows < batch_size = {batch_size}: not one full batch")
        self.batch_size, self.seed, self.epoch = batch_size, seed, 0
        self.members: dict[Hashable, list[int]] = {}
        for i, g in enumerate(groups):
            self.members.setdefault(g, []).append(i)
        self.keys = list(self.members)
        self.num_batches = len(groups) // batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        pools = {k: _cycle_shuffled(self.members[k], gen) for k in self.keys}
        for _ in range(self.num_batches):
            order = [self.keys[i] for i in torch.randperm(len(self.keys), generator=gen)]
            yield [next(pools[order[j % len(order)]]) for j in range(self.batch_size)]


class FlatSampler(Sampler[int]):
    """The indices of a batch sampler, batch after batch: for APIs that chunk an index sampler themselves."""

    def __init__(self, batch_sampler: BalancedBatchSampler):
        self.batch_sampler = batch_sampler

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler) * self.batch_sampler.batch_size

    def __iter__(self) -> Iterator[int]:
        for batch in self.batch_sampler:
            yield from batch


def _cycle_shuffled(indices: list[int], gen: torch.Generator) -> Iterator[int]:
    while True:
        for i in torch.randperm(len(indices), generator=gen).tolist():
            yield indices[i]
