"""The sampling state an online trainer's checkpoint carries beyond the Trainer's own, for exact resumes.

A `transformers.Trainer` checkpoint restores weights, optimizer, scheduler, the global RNGs
and the data position. An online trainer (GRPO) also holds state that decides its future
samples and updates: rollouts generated at one step and reused by later ones
(`num_iterations` > 1, with their log-probs at sampling time), draw counters, and private
`torch.Generator`s. `save_state` writes them, per process, into the checkpoint folder as
`rollout_state_<process>.safetensors` (tensors, plus integer counters as JSON metadata; no
pickle); `load_state` reads them back. The trainer calls both from its RNG-state hooks, which
transformers runs before it writes `trainer_state.json`, so a checkpoint the runner accepts as
complete (`stages.pipeline.training.complete_checkpoint`) always holds this file.

    tensors:  {"buffer.0.input_ids": (B, T) ..., "pair_rng": (N,) uint8}  (see `flatten`)
    counters: {"generations": 12}
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

COUNTERS_KEY = "counters"


def state_file(folder: str | Path, process_index: int) -> Path:
    return Path(folder) / f"rollout_state_{process_index}.safetensors"


def flatten(buffer: dict[int, dict[str, torch.Tensor]], prefix: str = "buffer") -> dict[str, torch.Tensor]:
    """{slot: {name: tensor}} -> {"<prefix>.<slot>.<name>": tensor}; `unflatten` inverts it."""
    return {f"{prefix}.{slot}.{name}": t for slot, batch in buffer.items() for name, t in batch.items()}


def unflatten(tensors: dict[str, torch.Tensor], prefix: str = "buffer",
              device: torch.device | str = "cpu") -> dict[int, dict[str, torch.Tensor]]:
    buffer: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        head, _, rest = key.partition(".")
        if head == prefix:
            slot, _, name = rest.partition(".")
            buffer.setdefault(int(slot), {})[name] = t.to(device)
    return buffer


def save_state(folder: str | Path, process_index: int, tensors: dict[str, torch.Tensor],
               counters: dict[str, int]) -> Path:
    """Write `tensors` and integer `counters` for process `process_index` into checkpoint `folder`."""
    from safetensors.torch import save_file

    path = state_file(folder, process_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path),
              metadata={COUNTERS_KEY: json.dumps(counters)})
    return path


def load_state(folder: str | Path, process_index: int) -> tuple[dict[str, torch.Tensor], dict[str, int]] | None:
    """(tensors, counters) saved by `save_state` for this process, or None when the checkpoint has none
    (written by an older version, or by a run with another number of processes)."""
    from safetensors import safe_open

    path = state_file(folder, process_index)
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        counters = json.loads((f.metadata() or {}).get(COUNTERS_KEY, "{}"))
        return {k: f.get_tensor(k) for k in f.keys()}, counters
