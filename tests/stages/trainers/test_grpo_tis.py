"""Off-policy correction in GRPO: the sampler's log-probs come back with its samples, and truncated importance
sampling (`stages.losses.truncated_importance_weights`) turns a gradient estimated from a stale sampler's
samples into the policy's own, in expectation.

The expectation test samples one-token completions of 8 prompts from a deliberately older copy of the policy
(the policy before 5 Adam steps on the exact objective), where the exact on-policy gradient is a sum over the
384-token vocabulary. One token per completion makes the per-token weight the whole sequence's importance
ratio, so the corrected estimator is unbiased while no ratio reaches the cap (none does here). The statistic
is the projection of the estimate on the exact gradient, <g, g*> / <g*, g*> (1 when unbiased). Over 20
sampling seeds of 512 samples (`python -m tests.stages.trainers.test_grpo_tis 20`): on policy 1.005 ± 0.068,
corrected 0.999 ± 0.049, uncorrected 1.688 ± 0.066 (mean ± sd of one seed). The test averages 4 seeds.
"""
import copy
import logging

import pytest
import torch

from stages.generation import SamplingParams, generate
from stages.losses import grpo_loss, truncated_importance_weights
from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer, completion_tensors, per_token_logps
from stages.trainers.rollout import sampler_logps
from tests.stages.trainers.conftest import build_tiny, builtin_rows

LOW = 192  # reward 1 for a token id below half the vocabulary
SEEDS = range(4)  # 4 x 512 samples per estimator
TOLERANCE = 0.15  # on the mean projection over SEEDS: 4.4 standard errors (one seed's sd 0.068, over 4: 0.034)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"))
    prompts = [r["prompt"] for r in builtin_rows("prompts", "prompt_only", num_train=8, num_eval=4)][:8]
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), prompts


def _batch(gens, tok):
    index = gens.prompt_index
    return completion_tensors([gens.prompt_ids[i] for i in index], gens.completion_ids,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def test_hf_sampler_logprobs_are_the_sampling_policys(setup):
    """On policy the ratio is 1: the hf sampler's log-probs equal the trainer's recomputed ones (temperature
    included); with top-k the sampler draws from a renormalised, narrower distribution, so its log-probs are
    higher: the mismatch `tis/mean_ratio` < 1 reveals."""
    model, tok, prompts = setup
    for temperature, top_k in ((1.0, 0), (0.7, 0), (1.0, 5)):
        gens = generate(model, tok, prompts[:4], SamplingParams(n=4, do_sample=True, max_new_tokens=6, seed=1,
                                                                temperature=temperature, top_k=top_k))
        assert [len(lp) for lp in gens.logprobs] == [len(c) for c in gens.completion_ids]
        batch = _batch(gens, tok)
        mask = batch["completion_mask"]
        with torch.no_grad():
            logps, _ = per_token_logps(model, batch, temperature=temperature)
        sampled = sampler_logps(gens.logprobs, mask.shape[1])
        _, metrics = truncated_importance_weights(logps, sampled, mask, cap=2.0)
        if top_k == 0:
            assert torch.allclose(logps * mask, sampled * mask, atol=1e-5), (temperature, (logps - sampled).abs().max())
            assert abs(metrics["tis/mean_ratio"].item() - 1) < 1e-5
        else:
            assert ((sampled - logps)[mask.bool()] > 0).all() and metrics["tis/mean_ratio"].item() < 0.9
    greedy = generate(model, tok, prompts[:2], SamplingParams(max_new_tokens=3))
    assert greedy.logprobs is None  # not sampled: no sampling distribution to divide by


def _exact_objective(model, prompt_ids):
    """E_π[R] averaged over the prompts, summed over the whole vocabulary: the exact one-token objective."""
    total = 0
    for ids in prompt_ids:
        total = total + model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1)[:LOW].sum()
    return total / len(prompt_ids)


def _flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def measure(old, tok, prompts, seeds) -> tuple[dict[str, list[tuple[float, float, float]]], float, float]:
    """The stale copy `old`, the policy 5 Adam steps (lr 0.005) further on the exact objective, and per seed
    three estimates of the policy gradient from 512 one-token samples (64 per prompt), GRPO's loss with
    advantage R - 0.5: on policy, from the stale copy corrected (tis cap 2.0), and uncorrected.
    Returns ({name: [(projection on the exact gradient, tis/mean_ratio, tis/frac_capped) per seed]},
    E_stale[R], E_policy[R])."""
    prompt_ids = generate(old, tok, prompts, SamplingParams(max_new_tokens=1)).prompt_ids
    policy = copy.deepcopy(old)  # the policy moves on; `old` is the stale copy a server or buffer still samples
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.005)
    for _ in range(5):
        optimizer.zero_grad()
        (-_exact_objective(policy, prompt_ids)).backward()
        optimizer.step()
    policy.zero_grad()
    objective = _exact_objective(policy, prompt_ids)
    objective.backward()
    exact = _flat_grad(policy).clone()

    def estimate(sampler, seed, cap):
        gens = generate(sampler, tok, prompts, SamplingParams(n=64, do_sample=True, max_new_tokens=1, seed=seed))
        batch = _batch(gens, tok)
        mask = batch["completion_mask"]
        policy.zero_grad()
        logps, _ = per_token_logps(policy, batch)
        weights, metrics = truncated_importance_weights(logps.detach(), sampler_logps(gens.logprobs, mask.shape[1]),
                                                        mask, cap=cap or 2.0)
        advantages = torch.tensor([float(c[0] < LOW) - 0.5 for c in gens.completion_ids])
        loss, _ = grpo_loss(logps, None, None, advantages, mask, beta=0.0, loss_type="bnpo",
                            importance_weights=weights if cap else None)
        loss.backward()
        projection = (-_flat_grad(policy) @ exact / (exact @ exact)).item()
        return projection, metrics["tis/mean_ratio"].item(), metrics["tis/frac_capped"].item()

    runs = {"on_policy": (policy, 2.0), "corrected": (old, 2.0), "uncorrected": (old, None)}
    got = {name: [estimate(sampler, seed, cap) for seed in seeds] for name, (sampler, cap) in runs.items()}
    with torch.no_grad():
        return got, _exact_objective(old, prompt_ids).item(), objective.item()


def test_corrected_gradient_matches_the_on_policy_one_in_expectation(setup):
    old, tok, prompts = setup
    got, stale, now = measure(old, tok, prompts, SEEDS)
    mean = {name: sum(p for p, _, _ in runs) / len(runs) for name, runs in got.items()}
    assert now > stale + 0.2, (stale, now)  # the stale copy is far behind the policy
    assert abs(mean["on_policy"] - 1) < TOLERANCE and abs(mean["corrected"] - 1) < TOLERANCE, mean
    assert abs(mean["uncorrected"] - 1) > 0.4, mean
    assert all(abs(r - 1) < 1e-5 for _, r, _ in got["on_policy"])
    assert all(c == 0.0 for _, _, c in got["corrected"])  # no ratio reached the cap: the correction is exact here


def test_trainer_logs_the_ratio_and_warns_by_name_when_it_departs(setup, tmp_path, caplog):
    model, tok, prompts = setup
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=4, learning_rate=1e-3, logging_steps=1,
                      report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(copy.deepcopy(model), [("low", lambda prompts, completions, completion_ids, **_:
                                                  [float(c[0] < LOW) for c in completion_ids])],
                          processing_class=tok, train_dataset=[{"prompt": p} for p in prompts[:2]], args=args)
    with caplog.at_level(logging.WARNING, logger="stages.trainers.off_policy"):
        trainer.train()
    log = next(h for h in trainer.state.log_history if "tis/mean_ratio" in h)
    assert abs(log["tis/mean_ratio"] - 1) < 1e-4 and log["tis/frac_capped"] == 0  # hf samples the policy itself
    assert "off-policy" not in caplog.text
    trainer.warn_off_policy({"tis/mean_ratio": 0.8, "tis/frac_capped": 0.05})
    trainer.warn_off_policy({"tis/mean_ratio": 0.7, "tis/frac_capped": 0.05})  # once per run
    warnings = [r.getMessage() for r in caplog.records if "off-policy" in r.getMessage()]
    assert len(warnings) == 1 and "tis/mean_ratio = 0.800" in warnings[0] and "tis_warn = 0.1" in warnings[0]
    assert "vllm_importance_sampling_cap = 2.0 correction is applied" in warnings[0]


def test_tis_cap_is_checked_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_cap = 0.5: must be >= 1"):
        GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, vllm_importance_sampling_cap=0.5,
                   use_cpu=True)


if __name__ == "__main__":  # the figures of the module docstring: python -m tests.stages.trainers.test_grpo_tis 20
    import statistics
    import sys
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = build_tiny(Path(folder))
        model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    rows = [r["prompt"] for r in builtin_rows("prompts", "prompt_only", num_train=8, num_eval=4)][:8]
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
    got, stale, now = measure(model, tok, rows, seeds)
    print(f"E[R] stale copy {stale:.3f}, policy {now:.3f}; {len(seeds)} seeds x 512 one-token samples")
    for name, runs in got.items():
        p, r, c = zip(*runs, strict=True)
        print(f"{name:12s} projection on the exact gradient {statistics.mean(p):.3f} ± {statistics.stdev(p):.3f}  "
              f"tis/mean_ratio {statistics.mean(r):.3f}  tis/frac_capped {statistics.mean(c):.3f}")


def stale_server_responder(model, *, raw: bool):
    """A vLLM-like answer sampled from `model` (the stale copy the server holds) with the body's temperature,
    each token's log-prob reported under that temperature, or under none when `raw` (vLLM's default
    `--logprobs-mode raw_logprobs`)."""
    import threading

    lock = threading.Lock()

    def respond(body):
        generator = torch.Generator().manual_seed(body["seed"])
        choices = []
        for k in range(body["n"]):
            ids, logps = list(body["prompt"]), []
            with lock, torch.no_grad():
                for _ in range(body["max_tokens"]):
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
                    token = torch.multinomial((logits / body["temperature"]).softmax(-1), 1, generator=generator).item()
                    logps.append((logits if raw else logits / body["temperature"]).log_softmax(-1)[token].item())
                    ids.append(token)
                    if token in body["stop_token_ids"]:
                        break
            new = ids[len(body["prompt"]):]
            choices.append({"index": k, "text": "", "token_ids": new, "stop_reason": None,
                            "finish_reason": "stop" if new[-1] in body["stop_token_ids"] else "length",
                            "logprobs": {"tokens": [""] * len(new), "token_logprobs": logps}})
        return choices

    return respond


@pytest.mark.parametrize("tis_cap", [2.0, None])
def test_vllm_samples_with_raw_logprobs_warn_and_are_weighted(setup, tmp_path, caplog, tis_cap):
    """The trainer on backend vllm against a real HTTP server sampling a stale copy at temperature 0.5 but
    reporting raw (temperature 1) log-probs: every ratio is off, the mean ratio departs from 1, the run warns
    once and says whether the gradient is corrected."""
    from tests.stages.generation.test_vllm import FakeVLLM

    model, tok, prompts = setup
    model = copy.deepcopy(model)
    with torch.no_grad():  # peaked logits (a fresh init is near-uniform, where temperature hardly matters)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)
    with FakeVLLM("stale", stale_server_responder(copy.deepcopy(model), raw=True)) as server:
        args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                          generation_backend="vllm", vllm_server_base_url=server.url, vllm_model="stale",
                          max_completion_length=4, temperature=0.5,
                          learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                          disable_tqdm=True, seed=0, vllm_importance_sampling_cap=tis_cap)
        trainer = GRPOTrainer(copy.deepcopy(model), [("low", lambda prompts, completions, completion_ids, **_:
                                                      [float(c[0] < LOW) for c in completion_ids])],
                              processing_class=tok, train_dataset=[{"prompt": p} for p in prompts[:2]], args=args)
        with caplog.at_level(logging.WARNING, logger="stages.trainers.off_policy"):
            trainer.train()
    logs = [h for h in trainer.state.log_history if "tis/mean_ratio" in h]
    # measured: mean ratio 1.36 and 1.26 (2.0: 22% and 16% of the tokens capped; null: measured uncapped, 0%)
    assert len(logs) == 2 and all(abs(h["tis/mean_ratio"] - 1) > 0.1 for h in logs), logs
    assert all((h["tis/frac_capped"] > 0.05) == (tis_cap is not None) for h in logs), logs
    warnings = [r.getMessage() for r in caplog.records if "off-policy" in r.getMessage()]
    assert len(warnings) == 1 and "backend vllm, whose weights are not synced" in warnings[0]
    assert ("correction is applied" if tis_cap else "NOT corrected") in warnings[0]
