"""bco_pair's δ in DPOTrainer: the running mean of the implicit rewards over training (not the current batch's
mean), carried by checkpoints so a resumed run goes on with the same δ."""
import json

import pytest
import torch

from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer
from stages.trainers.reward_mean import STATE_FILE, RewardMean
from tests.stages.trainers.conftest import build_tiny, builtin_rows


def test_running_mean_rule():
    """Batches [1, 2] then [6]: δ = 1.5, then (1 + 2 + 6) / 3 = 3 (the last batch's mean would be 6)."""
    mean = RewardMean()
    assert mean.value == 0.0  # before any reward: the policy is the reference
    assert mean.update(torch.tensor([1.0, 2.0])) == 1.5
    assert mean.update(torch.tensor([6.0])) == 3.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"))
    return path, AutoTokenizer.from_pretrained(path), builtin_rows("preference", "preference", num_preference=64)


def _train(setup, folder, resume=None):
    """4 steps of bco_pair (4 pairs each), checkpoints every 2: (trainer, δ after each step {step: δ})."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    path, tok, rows = setup
    deltas = {}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            deltas[state.global_step] = trainer.reward_mean.value

    args = DPOConfig(output_dir=str(folder), max_steps=4, per_device_train_batch_size=4, learning_rate=5e-2,
                     loss_type="bco_pair", logging_steps=1, report_to="none", use_cpu=True, save_strategy="steps",
                     save_steps=2, disable_tqdm=True, seed=0, precompute_ref_log_probs=False)
    trainer = DPOTrainer(AutoModelForCausalLM.from_pretrained(path), args=args, processing_class=tok,
                         train_dataset=rows, callbacks=[Record()])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, deltas


def test_delta_is_the_running_mean_and_survives_a_resume(setup, tmp_path):
    """δ after step k = the mean of the rewards β·r_c, β·r_r of steps 1..k (logged per step as rewards/chosen and
    rewards/rejected, equal batches, so their plain average); not step k's own mean. A run resumed from
    checkpoint-2 restores δ_2 and ends with the uninterrupted run's δ_3, δ_4; restarting the mean at the resume
    would give step 3's mean alone."""
    trainer, deltas = _train(setup, tmp_path / "clean")
    logs = {h["step"]: (h["rewards/chosen"] + h["rewards/rejected"]) / 2 for h in trainer.state.log_history
            if "rewards/chosen" in h}
    assert sorted(deltas) == sorted(logs) == [1, 2, 3, 4]
    for k in logs:
        assert deltas[k] == pytest.approx(sum(logs[j] for j in range(1, k + 1)) / k, abs=1e-6), (k, deltas, logs)
    assert all(abs(deltas[k] - logs[k]) > 1e-3 for k in (3, 4)), (deltas, logs)  # a batch mean would not do
    saved = json.loads((tmp_path / "clean" / "checkpoint-2" / STATE_FILE).read_text())
    assert saved["count"] == 2 * 2 * 4 and saved["delta"] == pytest.approx(deltas[2], abs=1e-9)

    _, resumed = _train(setup, tmp_path / "resumed", resume=str(tmp_path / "clean" / "checkpoint-2"))
    assert sorted(resumed) == [3, 4]
    assert all(resumed[k] == pytest.approx(deltas[k], rel=1e-5, abs=1e-7) for k in (3, 4)), (deltas, resumed)


def test_online_dpo_keeps_the_same_running_mean(setup, tmp_path):
    """Online DPO: δ after 3 steps = the mean of every kept pair's two rewards over the 3 steps, i.e. the step
    means of rewards/chosen and rewards/rejected weighted by each step's kept pairs (8 prompts - dropped ties)."""
    from transformers import AutoModelForCausalLM

    from stages.trainers.online_dpo_trainer import OnlineDPOConfig, OnlineDPOTrainer

    path, tok, _ = setup
    args = OnlineDPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=5e-2,
                           loss_type="bco_pair", max_new_tokens=6, logging_steps=1,
                           report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    def lengths(prompts, completions, completion_ids, **_):  # varied scores, few ties
        return [float(len(ids)) + ids[0] % 7 for ids in completion_ids]

    trainer = OnlineDPOTrainer(AutoModelForCausalLM.from_pretrained(path), reward_funcs=lengths, args=args,
                               processing_class=tok, train_dataset=builtin_rows("prompts", "prompt_only"))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    kept = [8 - h["pairs/dropped"] for h in logs]
    assert len(logs) == 3 and trainer.reward_mean.count == 2 * sum(kept)
    want = sum(n * (h["rewards/chosen"] + h["rewards/rejected"])
               for n, h in zip(kept, logs, strict=True)) / (2 * sum(kept))
    assert trainer.reward_mean.value == pytest.approx(want, abs=1e-6)
    assert abs(trainer.reward_mean.value - (logs[-1]["rewards/chosen"] + logs[-1]["rewards/rejected"]) / 2) > 1e-4
