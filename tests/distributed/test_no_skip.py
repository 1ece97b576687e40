"""No rank skips the backward pass, and a prompt samples alike on every rank: 2 real processes (gloo, CPU).

One launch of tests/distributed/no_skip_worker.py trains online DPO, GRPO and PPO for 2 SGD steps with real
sampling and a reward that ties everything on rank 1 only (online DPO: every pair drops; GRPO: every
advantage is 0; PPO: every completion unscored). Rank 1 still runs the step (a zero-weighted placeholder
pair, zero advantages, an empty mask) so DDP's all-reduce and the metric gathers pair up: both ranks finish
with the same weights, which rank 0's pairs moved. The same launch samples a target prompt on each rank
inside a batch of 8 at another position; rank 1's completions equal those of this process sampling the
prompt alone.
"""
import json
import math
import sys

import pytest
import torch

from stages.builtin import tiny
from stages.harness.config import LaunchConfig
from stages.harness.launch import launch_command
from stages.harness.processes import run_command
from tests.distributed import no_skip_worker as worker
from tests.distributed.conftest import free_port


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    model = str(tiny.build(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=1, num_heads=2,
                           intermediate_size=64, vocab_size=384, seed=0))
    out = tmp_path_factory.mktemp("no-skip")
    cmd = launch_command([worker.__file__, "--model", model, "--out", str(out)],
                         LaunchConfig(num_processes=2, main_process_port=free_port()), log_dir=str(out / "logs"),
                         python=sys.executable)
    lines = []
    run_command(cmd, on_line=lines.append, timeout_s=180)  # a rank waiting on a skipped collective would hang here
    assert "[default1]:" in "\n".join(lines)  # really two ranks
    return model, out


@pytest.mark.slow
@pytest.mark.parametrize("method", worker.METHODS)
def test_a_rank_whose_rewards_all_tie_still_steps_and_the_weights_agree(launched, method):
    from transformers import AutoModelForCausalLM

    model, out = launched
    ranks = [torch.load(out / f"{method}-rank{r}.pt", weights_only=True) for r in (0, 1)]
    start = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    for name, w0 in ranks[0]["weights"].items():
        assert torch.equal(w0, ranks[1]["weights"][name]), f"{method}: {name} differs between the ranks"
    moved = sum((w0 - start[name]).norm() ** 2 for name, w0 in ranks[0]["weights"].items()) ** 0.5
    assert moved > 1e-3  # rank 0's preferences did train the (shared) weights
    steps = [[h for h in r["log_history"] if "loss" in h] for r in ranks]
    assert len(steps[0]) == len(steps[1]) == worker.STEPS
    if method == "online_dpo":
        assert [h["pairs/dropped"] for h in steps[1]] == [4.0] * worker.STEPS  # rank 1: all 4 pairs tied
        assert all(h["pairs/dropped"] < 4 for h in steps[0])
        for key in ("win_rate", "rewards/margins", "logps/chosen"):  # gathered on both ranks, rank 0's pairs only
            assert [h[key] for h in steps[0]] == [h[key] for h in steps[1]]
    elif method == "grpo":
        assert all(h["frac_reward_zero_std"] >= 0.5 for h in steps[0])  # rank 1's groups (half of all) are flat
        assert [h["reward"] for h in steps[0]] == [h["reward"] for h in steps[1]]
    else:  # ppo: rank 1 scored nothing; the reward mean is rank 0's alone, on both ranks
        key = "rewards/low_ids_none_on_rank_1"
        for k in (key, "score", "explained_variance"):
            assert [h[k] for h in steps[0]] == [h[k] for h in steps[1]], k
        assert all(0 < h[key] <= 1 and h["score"] == pytest.approx(h[key]) for h in steps[0])  # no 0s for rank 1
        assert all(math.isfinite(h["explained_variance"]) for h in steps[0])  # rank 1's NaN (no tokens) left out


@pytest.mark.slow
def test_rank_1_samples_a_prompt_as_one_process_does_alone(launched):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.basics import stable_seed
    from stages.sampling import SamplingParams
    from stages.trainers.online_generation import sample_online

    model, out = launched
    tok, lm = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model)
    target = worker.prompts(1)[0]["prompt"]
    alone = sample_online(lm, tok, [target], SamplingParams(max_new_tokens=worker.MAX_NEW_TOKENS, n=2, do_sample=True),
                          seed=stable_seed(0, 0)).completion_ids
    got = [json.loads((out / f"sample-rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0]["position"] != got[1]["position"]
    assert got[1]["completion_ids"] == got[0]["completion_ids"] == alone
