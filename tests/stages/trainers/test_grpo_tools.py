"""GRPOTrainer with tools=, environment_factory= and rollout_func= (TRL 1.16's contract), on a tiny model taught
to call tools (tests/tool_model.py): faults are answered and counted, tool outputs carry no loss and no
importance ratio, rewards see the whole episode."""
import dataclasses
import math

import pytest
import torch

from stages.losses import grpo_loss
from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer, per_token_logps
from tests import tool_model as tm
from tests.tool_model import tool_model  # noqa: F401 (the session fixture)

ROWS = [{"prompt": [{"role": "user", "content": p}], "answer": reply} for p, _, _, reply in tm.SCRIPTS]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=2,
                max_completion_length=40, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=0, temperature=0.5, tool_timeout=1.0,
                shuffle_dataset=False)
    return GRPOConfig(**{**base, **kw})


def right_answer(completions, answer, **_):
    return [float(c[-1]["content"] == a) for c, a in zip(completions, answer, strict=True)]


def test_tools_run_faults_are_answered_and_counted(tool_model, tmp_path):  # noqa: F811
    seen = []

    def reward(completions, **kw):
        seen.extend(completions)
        return right_answer(completions, **kw)

    trainer = GRPOTrainer(str(tool_model), reward_funcs=reward, args=_args(tmp_path), train_dataset=ROWS,
                          tools=tm.TOOLS)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    # 4 prompts x 2 samples, each one call: add (ok), boom (raises), hang (stopped at 1 s), a malformed call
    assert {k: log[f"tools/{k}"] for k in ("calls", "errors", "timeouts", "parse_errors")} == \
        {"calls": 8, "errors": 2, "timeouts": 2, "parse_errors": 2}
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.75
    assert log["reward"] == 1.0 and math.isfinite(log["loss"])  # every episode reached its scripted answer
    # rewards saw whole episodes: the call, the tool's answer, the reply
    assert [[m["role"] for m in c] for c in seen] == [["assistant", "tool", "assistant"]] * 8
    assert seen[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert '"RuntimeError: boom"' in seen[2][1]["content"] and "timed out" in seen[4][1]["content"]
    assert "could not parse the tool call" in seen[6][1]["content"]
    # completion lengths count the model's own tokens only
    assert log["completions/max_length"] < 20


@pytest.fixture(scope="module")
def rollout(tool_model, tmp_path_factory):  # noqa: F811
    trainer = GRPOTrainer(str(tool_model), reward_funcs=right_answer, train_dataset=ROWS, tools=tm.TOOLS,
                          args=_args(tmp_path_factory.mktemp("out")))
    batch, _ = trainer.rollout(ROWS[:1], dataclasses.replace(trainer.args.sampling, n=2))  # "Add 2 and 3." twice
    return trainer, batch


def test_the_loss_mask_is_the_tool_mask(rollout):
    trainer, batch = rollout
    tok = trainer.processing_class
    suffix = tok("\n<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    for row in range(2):
        real = batch["completion_mask"][row].bool()
        tokens, mask = batch["input_ids"][row, -real.shape[0]:][real].tolist(), batch["loss_mask"][row][real].tolist()
        start = next(i for i in range(len(tokens)) if tokens[i:i + len(suffix)] == suffix)
        expected = [1] * start + [0] * len(suffix) + [1] * (len(tokens) - start - len(suffix))
        assert mask == expected  # token by token: the call and the answer train, the tool turn does not
        assert tok.decode([t for t, m in zip(tokens, mask, strict=True) if m]) == \
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>5<|im_end|>'
    assert torch.equal(batch["loss_mask"], batch["completion_mask"] * batch["tool_mask"])


def test_the_importance_ratio_and_the_loss_use_model_tokens_only(rollout):
    """The GRPO loss by hand over the model's tokens: per token -min(ρA, clip(ρ, 0.8, 1.2)A), ρ = exp(logp - old),
    averaged over each sequence's model tokens, then over the sequences. Tool tokens' log-probs can move freely
    without changing the loss, and get no gradient."""
    trainer, batch = rollout
    mask, tools = batch["loss_mask"], batch["completion_mask"] * (1 - batch["tool_mask"])
    assert tools.sum() > 0
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        logps, _ = per_token_logps(model, batch)
    gen = torch.Generator().manual_seed(0)
    old = logps + 0.3 * torch.randn(logps.shape, generator=gen)
    adv = torch.tensor([1.0, -0.5])
    logps = logps.clone().requires_grad_(True)
    loss, _ = grpo_loss(logps, old, None, adv, mask, beta=0.0)
    hand = []
    for i in range(2):
        terms = []
        for t in mask[i].nonzero().flatten().tolist():
            ratio = math.exp(logps[i, t].item() - old[i, t].item())
            terms.append(-min(ratio * adv[i].item(), min(max(ratio, 0.8), 1.2) * adv[i].item()))
        hand.append(sum(terms) / len(terms))
    assert loss.item() == pytest.approx(sum(hand) / 2, rel=1e-5)
    with_tools = grpo_loss(logps, old, None, adv, batch["completion_mask"], beta=0.0)[0]
    assert with_tools.item() != pytest.approx(loss.item(), rel=1e-3)  # the hand sum could tell them apart
    loss.backward()
    assert logps.grad[tools.bool()].abs().max() == 0 and logps.grad[mask.bool()].abs().max() > 0
    for level in ("token", "sequence"):
        base = grpo_loss(logps.detach(), old, None, adv, mask, beta=0.0, importance_sampling_level=level)[0]
        moved = grpo_loss(logps.detach() + 5.0 * tools, old, None, adv, mask, beta=0.0,
                          importance_sampling_level=level)[0]
        assert moved.item() == pytest.approx(base.item(), abs=1e-7)


def test_rollout_func_is_called_as_trl_calls_it(tool_model, tmp_path):  # noqa: F811
    """A deterministic rollout_func: answers every prompt with a fixed turn, a fake tool turn masked by env_mask,
    and a fixed answer; extra keys become reward columns."""
    calls, scored = [], []

    def rollout_func(prompts, trainer):
        tok = trainer.processing_class
        calls.append(len(prompts))
        prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                      for p in prompts]
        turn = tok("5<|im_end|>", add_special_tokens=False)["input_ids"]
        env = tok("\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        completion = turn + env + turn
        return {"prompt_ids": prompt_ids, "completion_ids": [completion] * len(prompts),
                "logprobs": [[-0.5] * len(completion)] * len(prompts),
                "env_mask": [[1] * len(turn) + [0] * len(env) + [1] * len(turn)] * len(prompts),
                "source": ["mine"] * len(prompts)}

    def reward(completions, source, **_):
        scored.append((completions, source))
        return [float(c.startswith("5")) for c in completions]

    trainer = GRPOTrainer(str(tool_model), reward_funcs=reward, args=_args(tmp_path), train_dataset=ROWS,
                          rollout_func=rollout_func)
    trainer.train()
    assert calls == [8]  # 4 prompts, each repeated num_generations = 2 times
    completions, source = scored[0]
    assert source == ["mine"] * 8 and completions[0] == "5\ntool\nok\nassistant\n5"
    batch, _ = trainer.rollout(ROWS[:1], dataclasses.replace(trainer.args.sampling, n=2))
    assert batch["loss_mask"][0].tolist()[:sum(batch["completion_mask"][0].tolist())].count(0) == \
        len(trainer.processing_class("\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)["input_ids"])
    assert "sampler_logps" in batch  # the function's log-probs are the sampler's
    with pytest.raises(ValueError, match=r"missing \['logprobs'\]"):
        GRPOTrainer(str(tool_model), reward_funcs=reward, args=_args(tmp_path), train_dataset=ROWS,
                    rollout_func=lambda p, t: {"prompt_ids": [], "completion_ids": []}).train()


class Counter:
    """An environment: counts its add calls; the reward is whether it was called."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.calls, self.resets = 0, 0

    def reset(self, prompt=None, answer=None, **_) -> str:
        self.calls, self.resets = 0, self.resets + 1
        return ""

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls > 0)


def test_environment_factory_one_instance_per_episode_reused_and_rewarding(tool_model, tmp_path):  # noqa: F811
    Counter.made = 0
    seen = []

    def envs_seen(completions, environments, **_):
        seen.append(list(environments))
        return [0.0] * len(completions)

    trainer = GRPOTrainer(str(tool_model), reward_funcs=envs_seen, args=_args(tmp_path, max_steps=2),
                          train_dataset=ROWS[:2] * 2, tools=[tm.boom, tm.hang], environment_factory=Counter)
    trainer.train()
    assert Counter.made == 8  # one per episode of a generation (4 rows x 2; the first is the probe), reused
    assert [len(s) for s in seen] == [8, 8] and seen[0] == seen[1] and len({id(e) for e in seen[0]}) == 8
    assert all(e.resets == 2 for e in seen[0])
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("rewards/Counter/mean" in h for h in logs)  # get_reward is a reward source named after the class
    adds = sum(e.calls for e in seen[0])  # the environment's own method ran as the tool "add"
    assert logs[-1]["rewards/Counter/mean"] == pytest.approx(sum(e.calls > 0 for e in seen[0]) / 8)
    assert adds == logs[-1]["tools/calls"] - logs[-1]["tools/errors"] - logs[-1]["tools/timeouts"] \
        - logs[-1]["tools/parse_errors"]


def test_templates_that_cannot_show_tools_are_refused(tmp_path):
    from tests.stages.trainers.conftest import build_tiny

    path = build_tiny(tmp_path / "tiny")
    with pytest.raises(ValueError, match=r"model '.*tiny'.*cannot render a tool call.*CHATML_TOOLS"):
        GRPOTrainer(str(path), reward_funcs=right_answer, args=_args(tmp_path), train_dataset=ROWS, tools=tm.TOOLS)


def test_distillation_with_tools_teaches_the_model_tokens_only(tool_model, tmp_path):  # noqa: F811
    """DistillationTrainer(tools=...) runs the same episodes (one per prompt); the student is pulled towards the
    teacher at its own tokens only: the tool turns are context."""
    from stages.trainers.distillation_trainer import DistillationConfig, DistillationTrainer

    args = DistillationConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                              max_completion_length=40, learning_rate=1e-3, logging_steps=1, report_to="none",
                              use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, temperature=0.5,
                              tool_timeout=1.0, shuffle_dataset=False)
    trainer = DistillationTrainer(str(tool_model), teacher_model=str(tool_model), args=args, train_dataset=ROWS,
                                  tools=tm.TOOLS)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["tools/calls"] == 4 and log["tools/errors"] == 1 and log["tools/timeouts"] == 1 \
        and log["tools/parse_errors"] == 1 and math.isfinite(log["loss"])
    batch = trainer.make_batch(ROWS[:1])
    tok = trainer.processing_class
    width = batch["completion_mask"].shape[1]
    taught = batch["input_ids"][0, -width:][batch["completion_mask"][0].bool()].tolist()
    assert tok.decode(taught) == \
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>5<|im_end|>'
    assert batch["attention_mask"][0, -width:].sum() > batch["completion_mask"][0].sum()  # the tool turn is read


class Quiet:
    """A second environment, without tools or reward of its own."""

    def reset(self, **_) -> None:
        return None


def test_a_dict_of_environments_is_chosen_per_row(tool_model, tmp_path):  # noqa: F811
    rows = [{**ROWS[0], "environment": "count"}, {**ROWS[1], "environment": "quiet"}]
    seen = []

    def envs_seen(completions, environments, environment, **_):
        seen.append([(type(e).__name__, name) for e, name in zip(environments, environment, strict=True)])
        return [0.0] * len(completions)

    trainer = GRPOTrainer(str(tool_model), reward_funcs=envs_seen, args=_args(tmp_path, per_device_train_batch_size=4),
                          train_dataset=rows, environment_factory={"count": Counter, "quiet": Quiet})
    trainer.train()
    assert seen[0] == [("Counter", "count")] * 2 + [("Quiet", "quiet")] * 2
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert "rewards/Counter/mean" in log  # scored on its own episodes only; Quiet's rows are None for it
    with pytest.raises(ValueError, match=r"environment = 'other', not one of environment_factory's \['count'"):
        GRPOTrainer(str(tool_model), reward_funcs=envs_seen, args=_args(tmp_path, per_device_train_batch_size=4),
                    train_dataset=[{**ROWS[0], "environment": "other"}] * 2,
                    environment_factory={"count": Counter, "quiet": Quiet}).train()


def test_plain_text_prompts_with_tools_are_refused_before_training(tool_model, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match=r"train_dataset\[1\]\['prompt'\] is a str: with tools"):
        GRPOTrainer(str(tool_model), reward_funcs=right_answer, args=_args(tmp_path), tools=tm.TOOLS,
                    train_dataset=[ROWS[0], {"prompt": "Add 2 and 3.", "answer": "5"}])


class Asker:
    """An environment that owns the data: reset() returns the question."""

    def reset(self, **_) -> str:
        return "Add 2 and 3."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


def test_without_a_dataset_the_environment_supplies_the_prompts(tool_model, tmp_path):  # noqa: F811
    seen = []

    def record(prompts, completions, **_):
        seen.extend(prompts)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(str(tool_model), reward_funcs=record, args=_args(tmp_path, per_device_train_batch_size=4),
                          environment_factory=Asker)
    trainer.train()
    assert seen == [[{"role": "user", "content": "Add 2 and 3."}]] * 4  # 2 placeholder rows x 2 samples
    with pytest.raises(ValueError, match="max_steps = -1: set max_steps > 0"):
        GRPOTrainer(str(tool_model), reward_funcs=record, environment_factory=Asker,
                    args=_args(tmp_path, max_steps=-1, num_train_epochs=1))
