"""bco_pair's reward shift δ: the running mean of the implicit rewards, kept by the preference trainers.

BCO (Jung et al. 2024, "Binary classifier optimization") classifies β·r_c as good and β·r_r as
bad around δ, a moving average of the rewards, not the current batch's mean. The rule kept here:
δ is the mean of every implicit reward β·r_c and β·r_r seen in training so far, over all
processes, the current micro-batch's included (TRL's RunningMoments keeps the same mean):

    after n rewards with mean δ_n, a batch of m rewards summing to S gives δ = (n·δ_n + S) / (n + m)

δ is 0 before the first reward (the policy starts at the reference, where every reward is 0).
Evaluation reads δ and does not move it. `stages.losses.dpo_loss` takes δ as an input; this
module holds the state. A checkpoint carries it as `bco_delta.json` (written by process 0: every
process holds the same sums), so a resumed run goes on with the same δ.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

STATE_FILE = "bco_delta.json"
logger = logging.getLogger(__name__)


def implicit_rewards(logps: torch.Tensor, ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None,
                     beta: float) -> torch.Tensor:
    """β·r_c and β·r_r of a pair batch, detached: (2B,), chosen first.

    logps: (2B,) summed policy log-probs, chosen rows first; ref_chosen, ref_rejected: (B,), or None
    (reference-free: the reference log-probs are 0).
    """
    chosen, rejected = logps.detach().float().chunk(2)
    if ref_chosen is not None:
        chosen, rejected = chosen - ref_chosen.float(), rejected - ref_rejected.float()
    return beta * torch.cat((chosen, rejected))


class RewardMean:
    """The running mean δ of the implicit rewards (see the module docstring): sums in float64, JSON on disk."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    @property
    def value(self) -> float:
        return self.total / self.count if self.count else 0.0

    def update(self, rewards: torch.Tensor, gather=None) -> float:
        """Add `rewards` (any shape) of this process; `gather` (e.g. `accelerator.gather`) joins every process's
        (sum, count) so all hold the same δ. Returns the new δ."""
        stats = torch.stack([rewards.detach().double().sum(),
                             torch.tensor(float(rewards.numel()), dtype=torch.float64, device=rewards.device)])
        if gather is not None:
            stats = gather(stats[None]).sum(0)
        self.total += stats[0].item()
        self.count += int(stats[1].item())
        return self.value

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / STATE_FILE
        path.write_text(json.dumps({"total": self.total, "count": self.count, "delta": self.value}))
        return path

    def load(self, folder: str | Path) -> bool:
        """Restore the sums from checkpoint `folder`; False (a warning, δ unchanged) when it has none."""
        path = Path(folder) / STATE_FILE
        if not path.exists():
            logger.warning("%s has no %s (saved by an older version): bco_pair's running reward mean restarts "
                           "from this point", folder, STATE_FILE)
            return False
        state = json.loads(path.read_text())
        self.total, self.count = float(state["total"]), int(state["count"])
        return True


def reward_mean_for(objective_names: list[str]) -> RewardMean | None:
    """A RewardMean when an objective needs it (bco_pair), else None."""
    return RewardMean() if "bco_pair" in objective_names else None


class CheckpointsRewardMean:
    """Trainer mixin (before `Trainer` in the bases): checkpoints carry `self.reward_mean`, bco_pair's
    running reward mean, so a resume goes on with the same δ. Written beside the RNG state, which
    transformers saves before `trainer_state.json` marks the checkpoint complete."""

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        if self.reward_mean is not None and self.args.should_save:
            self.reward_mean.save(output_dir)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is not None and self.reward_mean is not None:
            self.reward_mean.load(checkpoint)
