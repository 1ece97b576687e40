"""The sampling state an online trainer's checkpoint carries beyond the Trainer's own, for exact resumes.

A `transformers.Trainer` checkpoint restores weights, optimizer, scheduler, the global RNGs
and the data position; sampling seeds follow from the run seed, the step and the prompt
(`stages.trainers.online_generation`), so they need no state. What an online trainer (GRPO) must
add: rollouts generated at one step and reused by later ones (`num_iterations` > 1, with their
log-probs at sampling time; the policy has moved since, so they cannot be sampled again) and
private `torch.Generator`s. `save_state` writes them, per process, into the checkpoint folder
as `rollout_state_<process>.safetensors` (no pickle); `load_state` reads them back. The
trainer calls both from its RNG-state hooks, which transformers runs before it writes
`trainer_state.json`, so a checkpoint the runner accepts as complete
(`stages.pipeline.training.complete_checkpoint`) holds this file (under DDP each rank writes
its own, with no barrier before rank 0's state file, as for transformers' own RNG files).

    {"buffer.0.input_ids": (B, T), ..., "buffer.1.old_logps": (B, C), "pair_rng": (N,) uint8}  (`flatten`)
"""
from __future__ import annotations

from pathlib import Path

import torch


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


def save_state(folder: str | Path, process_index: int, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `tensors` for process `process_index` into checkpoint `folder`."""
    from safetensors.torch import save_file

    path = state_file(folder, process_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))
    return path


def load_state(folder: str | Path, process_index: int) -> dict[str, torch.Tensor] | None:
    """The tensors `save_state` wrote for this process, or None when the checkpoint has none (written by an
    older version, or by a run with another number of processes)."""
    from safetensors.torch import load_file

    path = state_file(folder, process_index)
    return load_file(str(path)) if path.exists() else None
