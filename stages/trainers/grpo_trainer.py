"""Group relative policy optimisation: `GRPOTrainer` (a `transformers.Trainer`; config: `grpo_config.py`).

Every optimizer step: sample `num_generations` completions per prompt from the policy itself
(`stages.generation`, seeded from the run seed, the step and the prompt, so ranks and resumes agree),
score them with the reward functions (`stages.reward_functions`), turn the rewards into group-relative
advantages (`stages.losses.grpo_advantages`) and train on `stages.losses.grpo_loss` over the
chunked per-token log-probs. `per_device_train_batch_size` counts completions, as in TRL.
`num_iterations` > 1 reuses one generation for that many updates (importance ratio to the sampling
policy); `steps_per_generation` > gradient_accumulation_steps makes one generation feed several optimizer
steps; `beta` > 0 adds a k3 KL to the reference; `vllm_importance_sampling_*` weight each token by π/μ
against the sampler's own log-probs. The loss variants of TRL 1.16 (`loss_type`, GSPO's sequence-level
ratio, `delta`, the off-policy and entropy masks, the entropy bonus) are arguments of the pure
`grpo_loss`. `reward_head="shared"` trains a Bradley-Terry head on the policy's trunk in the same update
(self-rewarding). `eval_dataset` is sampled and scored every `eval_steps` (`evaluate`). Checkpoints keep
the buffered rollouts and RNG states, so a resumed run samples and trains as an uninterrupted one.
The details: docs/methods.md (GRPO) and docs/trainers.md.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import math
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler
from transformers import Trainer

from stages.basics import stable_seed
from stages.losses import (
    entropy_bonus,
    grpo_advantages,
    grpo_loss,
    high_entropy_mask,
    normalized_sum_advantages,
    off_policy_sequence_mask,
    sampler_importance_weights,
)
from stages.precision import trainer_precision, use_fp32_cpu_attention
from stages.reward_functions import build_reward_functions
from stages.sampling import SamplingParams
from stages.sharding import unwrap
from stages.tools.episodes import transcript
from stages.trainers.completions_log import CompletionsLog
from stages.trainers.grpo_config import GRPOConfig  # noqa: F401 (the config of this trainer, re-exported)
from stages.trainers.inputs import (
    apply_peft,
    check_dataset,
    default_args,
    disable_dropout,
    load_model,
    load_processing_class,
    no_unknown_kwargs,
    renamed_kwarg,
)
from stages.trainers.model_options import router_aux_loss_coef
from stages.trainers.off_policy import OffPolicyWarning
from stages.trainers.online_extras import pad_to_multiple, render_prompts
from stages.trainers.online_generation import sample_online, wait_for_server
from stages.trainers.pair_batches import PairCollator, tokenize_pairs
from stages.trainers.ref_sync import sync_reference
from stages.trainers.reference_model import frozen_reference, reference_model
from stages.trainers.resume import flatten, load_state, save_state, unflatten
from stages.trainers.rollout import (
    cast_lm_head_to_fp32,
    completion_logps,
    pad_rollout,
    position_ids,
    sampler_logps,
)
from stages.trainers.tool_rollout import (
    Agent,
    Rollout,
    custom_rollout,
    from_generations,
    placeholder_rows,
    token_prompts,
    tool_metrics,
)

REWARD_HEAD_FILE = "reward_head.safetensors"
logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Data: prompt rows pass through as lists; batches repeat for num_iterations
# ---------------------------------------------------------------------------------------------

def rows_collator(features: list[dict]) -> list[dict]:
    """The rows of a batch, unchanged: prompts are rendered and tokenised by the generation backend."""
    return list(features)


class RepeatBatchSampler(Sampler):
    """Shuffled batches of row indices; each run of `group` batches is yielded `repeats` times in a row.

    GRPOTrainer makes each batch one generation's prompts (steps_per_generation micro-batches' worth), group
    the processes and repeats = steps_per_generation x num_iterations: every micro-batch a generation feeds
    receives its prompts. whole: a short last batch is completed with the epoch's first rows, so each of its
    micro-batches gets prompts. shuffle: a new order each epoch (seed + epoch), else the rows' own order.
    """

    def __init__(self, num_rows: int, batch_size: int, *, group: int, repeats: int, seed: int, whole: bool = False,
                 shuffle: bool = True):
        self.num_rows, self.batch_size, self.group, self.repeats, self.seed = num_rows, batch_size, group, repeats, seed
        self.whole, self.shuffle, self.epoch = whole, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + self.epoch)) \
            if self.shuffle else torch.arange(self.num_rows)
        batches = [order[i:i + self.batch_size].tolist() for i in range(0, self.num_rows, self.batch_size)]
        if self.whole and len(batches[-1]) < self.batch_size:
            wrapped = order.repeat(math.ceil(self.batch_size / self.num_rows)).tolist()
            batches[-1] += wrapped[:self.batch_size - len(batches[-1])]
        for start in range(0, len(batches), self.group):
            for _ in range(self.repeats):
                yield from batches[start:start + self.group]

    def __len__(self) -> int:
        return math.ceil(self.num_rows / self.batch_size) * self.repeats


def completion_tensors(prompt_ids: list[list[int]], completion_ids: list[list[int]], *, pad_token_id: int,
                       eos_token_id: int | list[int], tool_mask: list[list[int]] | None = None
                       ) -> dict[str, torch.Tensor]:
    """`stages.trainers.rollout.pad_rollout`'s batch plus "truncated": (B,) bool, no EOS generated.

    completion_mask (B, C) is 1 on real tokens up to and including the first EOS: padding and
    everything after the first EOS are 0, also when the pad id equals the EOS id.
    tool_mask: multi-turn episodes (`stages.tools.episodes`), 1 on the model's tokens, 0 on tool outputs. Their
    completions hold an EOS per turn, so completion_mask is 1 on every real token (tool outputs are context the
    model reads) and "tool_mask" (B, C) joins the batch; "truncated" means the last turn has no EOS.
    """
    batch = pad_rollout(prompt_ids, completion_ids, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                        stop_at_eos=tool_mask is None)
    mask = batch["completion_mask"]
    tokens = batch["input_ids"][:, -mask.shape[1]:]
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if tool_mask is None:
        batch["truncated"] = ~(torch.isin(tokens, eos) & mask.bool()).any(dim=1)
        return batch
    batch["tool_mask"] = sampler_logps(tool_mask, mask.shape[1]).long() * mask
    last = (mask.sum(1) - 1).clamp(min=0)
    batch["truncated"] = ~(torch.isin(tokens.gather(1, last[:, None]).squeeze(1), eos) & (mask.sum(1) > 0))
    return batch


def per_token_logps(model, batch: dict[str, torch.Tensor], *, temperature: float = 1.0, chunked: bool = True,
                    entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logps, entropy or None), each (B, C): `rollout.completion_logps` on a completion_tensors batch."""
    out = completion_logps(model, batch, temperature=temperature, chunked=chunked, with_entropy=entropy)
    return out["logps"], (out["entropy"].detach() if entropy else None)


def reward_sources(reward_funcs, weights: list[float] | None, extra: list[tuple[str, object]], *,
                   processing_classes=None):
    """The run's RewardFunctions: `reward_funcs` (weighted by `weights`; a reward model among them reads with its
    entry of `processing_classes`) and the environments' own rewards (weight 1, named after their class, as TRL
    adds them); None when there are none."""
    if not extra:
        return build_reward_functions(reward_funcs, weights, key="reward_funcs",
                                      processing_classes=processing_classes) if reward_funcs is not None else None
    given = build_reward_functions(reward_funcs, weights, key="reward_funcs",
                                   processing_classes=processing_classes).functions if reward_funcs is not None else []
    base = list(weights) if weights is not None else [1.0] * len(given)
    return build_reward_functions([*given, *extra], base + [1.0] * len(extra), key="reward_funcs")


def prompt_rows(dataset, key: str, *, needs_prompt: bool = True) -> list[dict]:
    """The rows of a GRPO dataset as a list, each with a 'prompt' (else a ValueError naming the first without;
    not needs_prompt: an environment's reset() may supply it)."""
    rows = list(check_dataset(dataset, key) or [])
    missing = [i for i, r in enumerate(rows) if "prompt" not in r] if needs_prompt else []
    if not rows or missing:
        where = f" (first: row {missing[0]})" if missing else " (the dataset is empty)"
        raise ValueError(f"{key}: GRPO needs rows with a 'prompt' column; {len(missing)} of {len(rows)} rows lack "
                         f"it{where}")
    return rows


# ---------------------------------------------------------------------------------------------
# Self-rewarding: a scalar head on the policy's trunk
# ---------------------------------------------------------------------------------------------

class RewardHead(nn.Module):
    """Linear(hidden, 1) on the final hidden state of each sequence's last real token: (N, H) -> (N,)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.score = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.score.weight, std=1 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.score.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden.to(self.score.weight.dtype)).squeeze(-1)

    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(folder) / REWARD_HEAD_FILE
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path),
                  metadata={"hidden_size": str(self.score.in_features)})
        return path

    @classmethod
    def load(cls, folder: str | Path) -> RewardHead:
        from safetensors import safe_open

        path = Path(folder) / REWARD_HEAD_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path}: no reward head here; it is written by GRPOTrainer with "
                                    "reward_head = 'shared'")
        with safe_open(str(path), framework="pt") as f:
            head = cls(int(f.metadata()["hidden_size"]))
            head.load_state_dict({k: f.get_tensor(k) for k in f.keys()})
        return head


def last_token_hidden(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Final hidden state at each row's last attended position: (B, H)."""
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(unwrap(model).forward).parameters else {}
    hidden = model(**inputs, use_cache=False, output_hidden_states=True, **kwargs).hidden_states[-1]
    mask = inputs["attention_mask"]
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------

class GRPOTrainer(OffPolicyWarning, Trainer):
    @property
    def loss_is_scaled_for_ga(self) -> bool:
        # dapo divides by the whole optimizer step's token count, so its micro-batch losses already sum to the
        # step's loss; the others are means over a micro-batch, which Trainer divides by the accumulation steps.
        return self.args.loss_type == "dapo" and getattr(self, "_loss_tokens", None) is not None

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, *, ref_model=None, preference_dataset=None,
                 reward_head: RewardHead | None = None, data_collator=None, **deprecated):
        reward_funcs = renamed_kwarg(deprecated, "reward_functions", "reward_funcs", reward_funcs,
                                     trainer="GRPOTrainer")
        no_unknown_kwargs("GRPOTrainer", deprecated)
        args = args or default_args(GRPOConfig, model, "GRPO")
        if train_dataset is None and environment_factory is not None:
            train_dataset = placeholder_rows(environment_factory, args)
        rows = prompt_rows(train_dataset, "train_dataset", needs_prompt=environment_factory is None)
        processing_class = load_processing_class(model, processing_class, args)
        if rollout_func is not None and (tools or environment_factory is not None):
            raise ValueError("rollout_func with tools or environment_factory: a custom rollout runs its own tools; "
                             "pass one of them")
        self.rollout_func = rollout_func
        self.agent = Agent(processing_class, tools=tools, environment_factory=environment_factory, args=args,
                           model_name=str(getattr(model, "name_or_path", model))) \
            if tools or environment_factory is not None else None
        if self.agent is not None:
            self.agent.check_rows(rows, "train_dataset")
        env_rewards = self.agent.reward_functions() if self.agent is not None else []
        if reward_funcs is None and not env_rewards and args.reward_head != "shared":
            raise ValueError("reward_funcs is None: GRPO needs at least one reward function (e.g. "
                             "['exact_match']), an environment with get_reward(), or reward_head = 'shared' with a "
                             "preference_dataset")
        model = apply_peft(load_model(model, args, quantization_config), peft_config)
        if ref_model is not None:
            ref_model = load_model(ref_model, args)
        eval_rows = prompt_rows(eval_dataset, "eval_dataset") if eval_dataset is not None else None
        args.remove_unused_columns = False
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        super().__init__(model=model, args=args, data_collator=data_collator or rows_collator,
                         processing_class=processing_class, train_dataset=rows, eval_dataset=eval_rows,
                         callbacks=callbacks, optimizers=optimizers)
        if args.use_vllm:
            wait_for_server(args.vllm_url, timeout=args.vllm_server_timeout)
        if reward_funcs is None and reward_processing_classes is not None:
            raise ValueError("reward_processing_classes is given but reward_funcs is None: they are the tokenizers of "
                             "the reward models in reward_funcs")
        self.reward_functions = reward_sources(reward_funcs, args.reward_weights, env_rewards,
                                               processing_classes=reward_processing_classes)
        self.ref_model = frozen_reference(self.model, ref_model, needed=args.beta > 0)
        if args.disable_dropout:
            disable_dropout(self.model, self.ref_model)
        if args.cast_lm_head_to_fp32:
            for module in (self.model, self.ref_model):
                if module is not None:
                    cast_lm_head_to_fp32(module)
        self.router_aux_loss_coef = router_aux_loss_coef(unwrap(self.model), args.router_aux_loss_coef)
        sync_reference(self)  # TR-DPO: sync_ref_model

        self.reward_head, self.preference_rows = None, None
        if args.reward_head == "shared":
            if not preference_dataset:
                raise ValueError("reward_head = 'shared' needs preference_dataset (prompt/chosen/rejected rows) to "
                                 "train the head; pass it, or use reward_head = 'separate'")
            self.reward_head = (reward_head or RewardHead(unwrap(self.model).config.hidden_size)).to(args.device)
            self.preference_rows = tokenize_pairs(processing_class, list(preference_dataset), args.max_length)
            self._pair_rng = torch.Generator().manual_seed(args.seed)

        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._buffer: dict[int, dict[str, torch.Tensor]] = {}  # the latest generation's micro-batches, by slot
        self._step_batches: list[dict[str, torch.Tensor]] = []  # this optimizer step's micro-batches
        self._micro = 0  # micro-batches trained so far (restored on resume)
        self._slot, self._slot_step = 0, None
        self.entropy_coef = args.entropy_coef  # moves with use_adaptive_entropy
        self._entropy_window = torch.zeros(2, dtype=torch.float64)  # (entropy sum, tokens) of this optimizer step
        self._last_entropy: float | None = None  # the last step's mean entropy over all processes
        self.completions_log = CompletionsLog(args)
        self._window_rows: list[list[dict]] = []  # the prompts of every micro-batch of this optimizer step
        self._loss_tokens: torch.Tensor | None = None  # their loss tokens over all processes (dapo's denominator)
        self.timing: dict[str, float] = defaultdict(float)  # cumulative seconds and tokens
        self._window: dict[str, float] = defaultdict(float)  # the same since the last log
        self._window_start_step = 0

    # ---- data ----
    def get_train_dataloader(self) -> DataLoader:
        """Each item holds one generation's prompts, repeated for every micro-batch that generation feeds."""
        a, spg = self.args, self.args.resolved_steps_per_generation
        sampler = RepeatBatchSampler(len(self.train_dataset), a.per_device_train_batch_size // a.num_generations * spg,
                                     group=a.world_size, repeats=spg * a.num_iterations, seed=a.seed, whole=spg > 1,
                                     shuffle=a.shuffle_dataset)
        return self.accelerator.prepare(DataLoader(self.train_dataset, batch_sampler=sampler,
                                                   collate_fn=self.data_collator))

    # ---- one step: generation and scoring, then the update ----
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """This optimizer step's items (each a generation's prompts), kept so its first `training_step` has the
        rollouts of all its micro-batches before any of them trains."""
        self._window_rows = list(itertools.islice(epoch_iterator, num_batches))
        return self._window_rows, None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._slot_step != self.state.global_step:  # a new optimizer step
            self._slot_step, self._slot = self.state.global_step, 0
            if self.reward_head is not None:  # Trainer zeroes the model's gradients only, not the head's
                self.reward_head.zero_grad(set_to_none=True)
            self._prepare_window(self._window_rows or [inputs])
        slot, self._slot = self._slot, self._slot + 1
        batch, start = self._step_batches[slot], time.perf_counter()
        self._micro += 1
        loss = super().training_step(model, batch, self._loss_tokens)
        self._tick("training_s", time.perf_counter() - start)
        self._tick("tokens", batch["attention_mask"].sum().item())
        return loss

    def _prepare_window(self, window: list[list[dict]]) -> None:
        """The rollouts of every micro-batch of this optimizer step, then their loss tokens summed over the
        micro-batches and processes: dapo's denominator.

        Micro-batch k (counted over the run) belongs to generation k // (steps_per_generation x num_iterations)
        and uses its slot k % steps_per_generation. A generation samples all its slots at once, from the policy
        at that moment, and is kept in `_buffer` for the later micro-batches (and optimizer steps) it feeds.
        Generation runs here, in the step's first `training_step` rather than in `get_batch_samples`, because
        on a resume the Trainer restores the checkpoint's buffered rollouts between the two.
        """
        self._window_rows = []
        spg = self.args.resolved_steps_per_generation
        cycle = spg * self.args.num_iterations
        self._step_batches = []
        for offset, rows in enumerate(window):
            k = self._micro + offset
            if k % cycle == 0 or not self._buffer:
                self._buffer = dict(enumerate(self.make_generation(rows, spg)))
            self._step_batches.append(self._buffer[k % spg])
        local = sum((b["loss_mask"].sum() for b in self._step_batches),
                    torch.zeros((), device=self.args.device)).float()
        self._loss_tokens = self.accelerator.reduce(local, reduction="sum").clamp(min=1)  # all unscored: loss 0

    def make_generation(self, rows: list[dict], parts: int) -> list[dict[str, torch.Tensor]]:
        """One generation (`make_batch` over all `rows`) split into `parts` micro-batches of whole groups."""
        batch = self.make_batch(rows)
        groups = batch["advantages"].shape[0] // self.args.num_generations
        if parts > groups:
            raise ValueError(f"a generation of {groups} prompts cannot feed steps_per_generation = {parts} "
                             "micro-batches; give at least that many prompts per generation")
        bounds = [i * groups // parts * self.args.num_generations for i in range(parts + 1)]
        return [{k: v[lo:hi] for k, v in batch.items()} for lo, hi in zip(bounds, bounds[1:], strict=False)]

    def _tick(self, key: str, value: float) -> None:
        self.timing[key] += value
        self._window[key] += value

    def make_batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Generate, score and compute advantages (and old / reference log-probs) for these prompts; logged."""
        batch, (rewards, valid, per_function, prompts, completions) = self.rollout(rows, self.args.sampling)
        self._log_generation(rewards, valid, per_function, batch, self.args.num_generations)
        self.completions_log.add(prompts, [transcript(c) if isinstance(c, list) else c for c in completions],
                                 per_function, batch["advantages"].tolist())
        return batch

    @torch.no_grad()
    def rollout(self, rows: list[dict], sampling: SamplingParams, metrics: dict[str, list[float]] | None = None
                ) -> tuple[dict[str, torch.Tensor], tuple]:
        """`make_batch`'s batch for `sampling` (`sampling.n` completions per prompt), unlogged (but for the tool
        counts, which go to `metrics`, default the training metrics), and (rewards (N,), valid (N,), each function's
        scores, the N prompts, the N completions)."""
        from stages.generation.common import eos_token_ids

        a, tok = self.args, self.processing_class
        policy = self.accelerator.unwrap_model(self.model)
        start = time.perf_counter()
        r = self.sample(policy, rows, sampling, self._metrics if metrics is None else metrics)
        self._tick("generation_s", time.perf_counter() - start)

        start = time.perf_counter()
        eos = eos_token_ids(tok, policy)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        batch = completion_tensors(r.prompt_ids, r.completion_ids, eos_token_id=eos, tool_mask=r.tool_mask,
                                   pad_token_id=pad_id)
        if r.logprobs is not None:  # what the off-policy correction divides by
            batch["sampler_logps"] = sampler_logps(r.logprobs, batch["completion_mask"].shape[1])
        batch = pad_to_multiple(batch, a.pad_to_multiple_of, pad_id)
        batch = {k: v.to(a.device) for k, v in batch.items()}
        totals, per_function = self.score(r.prompts, r.completions, r.columns, batch)
        self._tick("scoring_s", time.perf_counter() - start)

        start = time.perf_counter()
        valid = torch.tensor([t is not None for t in totals], device=a.device)
        rewards = torch.tensor([math.nan if t is None else t for t in totals], dtype=torch.float32, device=a.device)
        batch["advantages"] = self.advantages(rewards, valid, per_function, sampling.n)
        loss_mask = batch["completion_mask"] * valid[:, None]
        if "tool_mask" in batch:  # tool outputs are context: no loss, no log-probs in the ratio
            loss_mask = loss_mask * batch["tool_mask"]
        if a.mask_truncated_completions:
            loss_mask = loss_mask * ~batch["truncated"][:, None]
        batch["loss_mask"] = loss_mask
        chunked = a.use_chunked_logprobs
        # later updates reuse these samples (num_iterations > 1, or a generation that outlasts its optimizer step):
        # weight them by the ratio to the policy that sampled
        if a.num_iterations > 1 or a.resolved_steps_per_generation > a.gradient_accumulation_steps:
            batch["old_logps"], _ = per_token_logps(self.model, batch, temperature=a.sampling.temperature,
                                                    chunked=chunked)
        if a.beta > 0:
            with reference_model(self.model, self.ref_model, precision=trainer_precision(self.args)) as ref:
                batch["ref_logps"], _ = per_token_logps(ref, batch, temperature=a.sampling.temperature,
                                                        chunked=chunked)
        self._tick("training_s", time.perf_counter() - start)
        return batch, (rewards, valid, per_function, r.prompts, r.completions)

    def sample(self, policy, rows: list[dict], sampling: SamplingParams, metrics: dict[str, list[float]]) -> Rollout:
        """`sampling.n` completions per row: the user's rollout_func, multi-turn episodes with tools, or one sampled
        turn."""
        a, tok = self.args, self.processing_class
        if self.rollout_func is not None:
            return custom_rollout(self.rollout_func, self, rows, sampling.n, tok)
        if self.agent is not None:
            def generate(contexts, n, round_):
                gens = sample_online(policy, tok, token_prompts(tok, contexts), dataclasses.replace(sampling, n=n),
                                     seed=stable_seed(a.seed, self.state.global_step, round_),
                                     precision=trainer_precision(a))
                return list(zip(gens.completion_ids, gens.logprobs or [None] * len(gens), strict=True))

            rollout = self.agent.run(rows, sampling.n, generate)
            for key, value in tool_metrics(self.accelerator, self.agent.runner, len(rollout.completion_ids)).items():
                metrics[key].append(value)
            return rollout
        prompts = [r["prompt"] for r in rows]
        rendered = render_prompts(tok, prompts, a.chat_template_kwargs, [r.get("tools") for r in rows])
        gens = sample_online(policy, tok, rendered, sampling, seed=stable_seed(a.seed, self.state.global_step),
                             precision=trainer_precision(a))
        return from_generations(gens, rows, prompts)

    def advantages(self, rewards: torch.Tensor, valid: torch.Tensor, per_function: dict[str, list],
                   num_generations: int) -> torch.Tensor:
        """Group-relative advantages of the weighted total rewards (sum_then_normalize), or of each reward
        function's rewards normalised in its groups, then weighted and summed (normalize_then_sum)."""
        a = self.args
        if a.multi_objective_aggregation == "sum_then_normalize":
            return grpo_advantages(rewards, num_generations, scale_rewards=a.scale_rewards, valid=valid)
        names = list(per_function)
        weights = dict(zip((n for n, _ in self.reward_functions.functions), self.reward_functions.weights,
                           strict=True)) if self.reward_functions is not None else {}
        weights["reward_head"] = a.reward_head_weight
        table = torch.tensor([[math.nan if v is None else v for v in per_function[n]] for n in names],
                             dtype=torch.float32, device=rewards.device).T
        return normalized_sum_advantages(table, torch.tensor([weights[n] for n in names], device=rewards.device),
                                         num_generations, valid=valid)

    def score(self, prompts: list, completions: list[str], columns: dict[str, list], batch: dict[str, torch.Tensor]
              ) -> tuple[list[float | None], dict[str, list[float | None]]]:
        """Weighted total reward per completion (None: unscored) and each function's scores."""
        if self.reward_functions is not None:
            totals, per_function = self.reward_functions(prompts, completions, **columns)
        else:
            totals, per_function = [0.0] * len(completions), {}
        if self.reward_head is not None:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                      "position_ids": position_ids(batch["attention_mask"])}
            head = self.reward_head(last_token_hidden(self.model, inputs)).float().tolist()
            bad = [i for i, s in enumerate(head) if not math.isfinite(s)]
            if bad:
                raise ValueError(f"the reward head gave a non-finite score for completion {bad[0]}: training has "
                                 "diverged; lower learning_rate or reward_head_coef")
            per_function["reward_head"] = head
            w = self.args.reward_head_weight
            totals = [None if t is None else t + w * s for t, s in zip(totals, head, strict=True)]
        return totals, per_function

    def _log_generation(self, rewards, valid, per_function, batch, g: int | None = None, m=None) -> None:
        """Reward and completion statistics of a generation (g completions per prompt, default num_generations)
        into `m` (default: the training metrics)."""
        m = self._metrics if m is None else m
        g = g or self.args.num_generations
        rewards, valid = self.accelerator.gather(rewards), self.accelerator.gather(valid)  # every rank's groups
        scored = rewards[valid]
        m["reward"].append(scored.mean().item() if scored.numel() else math.nan)
        m["reward_std"].append(scored.std().item() if scored.numel() > 1 else 0.0)
        m["frac_reward_none"].append(1 - valid.float().mean().item())
        groups = [{v for v, ok in zip(r, k, strict=True) if ok}
                  for r, k in zip(rewards.view(-1, g).tolist(), valid.view(-1, g).tolist(), strict=True)]
        m["frac_reward_zero_std"].append(sum(len(s) <= 1 for s in groups) / len(groups))
        for name, values in per_function.items():
            got = torch.tensor([v for v in values if v is not None], dtype=torch.float64)
            if got.numel():
                m[f"rewards/{name}/mean"].append(got.mean().item())
                m[f"rewards/{name}/std"].append(got.std().item() if got.numel() > 1 else 0.0)
        lengths = (batch["completion_mask"] if "tool_mask" not in batch else batch["tool_mask"]).sum(1).float()
        m["completions/mean_length"].append(lengths.mean().item())
        m["completions/min_length"].append(lengths.min().item())
        m["completions/max_length"].append(lengths.max().item())
        m["completions/truncated_ratio"].append(batch["truncated"].float().mean().item())
        if m is self._metrics:
            self._tick("generated_tokens", lengths.sum().item())

    # ---- the loss ----
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        a = self.args
        bonus = a.entropy_coef > 0 or a.use_adaptive_entropy
        out = completion_logps(model, inputs, temperature=a.sampling.temperature, chunked=a.use_chunked_logprobs,
                               with_entropy=True, with_aux_loss=self.router_aux_loss_coef > 0)
        logps, entropy = out["logps"], out["entropy"] if bonus else out["entropy"].detach()
        mask = inputs["loss_mask"]
        weights, tis = None, {}
        if "sampler_logps" in inputs:  # the policy at sampling time (old_logps, else now) over the sampler
            at_sampling = inputs["old_logps"] if inputs.get("old_logps") is not None else logps.detach()
            low, high = a.importance_sampling_bounds
            weights, tis = sampler_importance_weights(at_sampling, inputs["sampler_logps"], mask,
                                                      mode=a.vllm_importance_sampling_mode, clip_min=low, clip_max=high)
        keep = None
        if a.off_policy_mask_threshold is not None:  # drift of the sampler (else the policy at sampling) from now
            drifted = inputs.get("sampler_logps", inputs.get("old_logps"))
            drifted = logps.detach() if drifted is None else drifted
            keep = off_policy_sequence_mask(inputs["advantages"], logps.detach(), drifted, mask,
                                            threshold=a.off_policy_mask_threshold)
            tis["off_policy_mask/kept"] = keep.mean()
        tokens = None
        if a.top_entropy_quantile < 1:
            tokens = high_entropy_mask(entropy.detach(), mask, quantile=a.top_entropy_quantile,
                                       gather=self._gather_ragged)
        loss, metrics = grpo_loss(logps, inputs.get("old_logps"), inputs.get("ref_logps"), inputs["advantages"], mask,
                                  beta=a.beta, epsilon_low=a.epsilon, epsilon_high=a.epsilon_high,
                                  loss_type=a.loss_type, num_items_in_batch=num_items_in_batch,
                                  max_completion_length=a.sampling.max_new_tokens,
                                  importance_weights=weights if a.importance_sampling_on else None,
                                  importance_sampling_level=a.importance_sampling_level, delta=a.delta,
                                  sapo_temperature_pos=a.sapo_temperature_pos,
                                  sapo_temperature_neg=a.sapo_temperature_neg, vespo_k_pos=a.vespo_k_pos,
                                  vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg,
                                  vespo_lambda_neg=a.vespo_lambda_neg, sequence_mask=keep, token_mask=tokens,
                                  use_bias_correction_kl=a.use_bias_correction_kl)
        metrics.update(tis)
        if self.loss_is_scaled_for_ga:  # dapo over the step's global count: DDP averages the ranks' gradients,
            loss = loss * self.accelerator.num_processes  # where that denominator wants their sum
        metrics["entropy"] = entropy_bonus(entropy.detach(), mask)
        if bonus:
            loss = loss - self._entropy_term(entropy, mask if tokens is None else mask * tokens)
        if self.router_aux_loss_coef > 0:
            aux = self.router_aux_loss_coef * out["aux_loss"]
            loss = loss + (aux / self.current_gradient_accumulation_steps if self.loss_is_scaled_for_ga else aux)
            metrics["aux_loss"] = out["aux_loss"]
        if self.reward_head is not None:
            bt, bt_metrics = self.reward_head_loss(model)
            head = a.reward_head_coef * bt
            if self.loss_is_scaled_for_ga:  # the step sums its micro-batch losses: the head's mean takes its share
                head = head / self.current_gradient_accumulation_steps
            loss = loss + head
            metrics["reward_head/loss"] = bt
            metrics.update({f"reward_head/{k}": v for k, v in bt_metrics.items()})
        for key, value in metrics.items():
            value = torch.as_tensor(value, device=loss.device).detach().float()
            self._metrics[key].append(self.accelerator.gather_for_metrics(value).mean().item())
        return (loss, {"logps": logps}) if return_outputs else loss

    def _entropy_term(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """entropy_coef x the mean entropy of this micro-batch's tokens (scaled as its share of the step when the
        policy loss is), the coefficient fixed for the whole step; with use_adaptive_entropy, the step's entropy
        moves the coefficient for the next step and the bonus applies only after a step at or below the target."""
        a = self.args
        term = entropy_bonus(entropy, mask)
        if self.loss_is_scaled_for_ga:
            term = term / self.current_gradient_accumulation_steps
        coef = self.entropy_coef
        if a.use_adaptive_entropy:
            coef = coef if self._last_entropy is not None and self._last_entropy <= a.entropy_target else 0.0
            self._entropy_window += torch.stack([(entropy.detach() * mask).sum(), mask.sum()]).double().cpu()
            if self._slot == len(self._step_batches):  # the step's last micro-batch
                total = self.accelerator.reduce(self._entropy_window.to(self.args.device), reduction="sum")
                self._last_entropy = (total[0] / total[1].clamp(min=1)).item()
                step = a.entropy_coef_delta if self._last_entropy <= a.entropy_target else -a.entropy_coef_delta
                self.entropy_coef = min(max(self.entropy_coef + step, a.entropy_coef_min), a.entropy_coef_max)
                self._entropy_window.zero_()
            self._metrics["entropy_coef"].append(coef)
        return coef * term

    def _gather_ragged(self, values: torch.Tensor) -> torch.Tensor:
        """1-D tensors of any lengths from every process, joined (entropies are >= 0, so -1 marks padding)."""
        padded = self.accelerator.pad_across_processes(values, dim=0, pad_index=-1.0)
        joined = self.accelerator.gather(padded)
        return joined[joined >= 0]

    def reward_head_loss(self, model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Bradley-Terry loss of the reward head on a random minibatch of preference pairs."""
        from stages.losses import reward_loss

        n = min(self.args.reward_head_batch_size, len(self.preference_rows))
        picks = torch.randperm(len(self.preference_rows), generator=self._pair_rng)[:n].tolist()
        pairs = PairCollator(self.processing_class.pad_token_id)([self.preference_rows[i] for i in picks])
        inputs = {k: pairs[k].to(self.args.device) for k in ("input_ids", "attention_mask")}
        scores = self.reward_head(last_token_hidden(model, inputs)).float()
        chosen, rejected = scores.chunk(2)
        return reward_loss(chosen, rejected)

    # ---- the reward head joins the optimizer, checkpoints and the saved model ----
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.reward_head is not None:
            known = {id(p) for group in optimizer.param_groups for p in group["params"]}
            params = [p for p in self.reward_head.parameters() if id(p) not in known]
            if params:
                optimizer.add_param_group({"params": params, "weight_decay": 0.0})
        return optimizer

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        super()._save(output_dir, state_dict)
        if self.reward_head is not None:
            self.reward_head.save(output_dir or self.args.output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.reward_head is not None and (Path(resume_from_checkpoint) / REWARD_HEAD_FILE).exists():
            self.reward_head.load_state_dict(RewardHead.load(resume_from_checkpoint).state_dict())

    # ---- checkpoints carry the sampling state (stages.trainers.resume), so a resume samples alike ----
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        cycle = self.args.resolved_steps_per_generation * self.args.num_iterations
        reused = self._micro % cycle != 0  # the next micro-batch reuses these rollouts
        tensors = flatten(self._buffer) if reused else {}
        tensors["micro"] = torch.tensor(self._micro)
        tensors["entropy"] = torch.tensor([self.entropy_coef, math.nan if self._last_entropy is None
                                           else self._last_entropy], dtype=torch.float64)
        if self.reward_head is not None:
            tensors["pair_rng"] = self._pair_rng.get_state()
        save_state(output_dir, self.args.process_index, tensors)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        self._window_start_step = self.state.global_step
        self._micro = self.state.global_step * self.args.gradient_accumulation_steps  # unless the state says
        tensors = load_state(checkpoint, self.args.process_index)
        if tensors is None:
            logger.warning("%s has no rollout state for process %d (saved by an older version or another number "
                           "of processes): training resumes, but may sample and train differently from an "
                           "uninterrupted run", checkpoint, self.args.process_index)
            return
        self._buffer = unflatten(tensors, device=self.args.device)
        if "micro" in tensors:
            self._micro = int(tensors["micro"])
        if "entropy" in tensors:
            coef, last = tensors["entropy"].tolist()
            self.entropy_coef, self._last_entropy = coef, None if math.isnan(last) else last
        if self.reward_head is not None and "pair_rng" in tensors:
            self._pair_rng.set_state(tensors["pair_rng"])

    # ---- evaluation: held-out prompts sampled and scored like training's, no update ----
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample num_generations_eval completions of each held-out prompt with the training sampler, score them
        and compute the GRPO loss without an update; logs `eval_reward`, `eval_rewards/<function>/mean`, ...,
        `eval_loss` (what `eval_steps` plots while training). Seeded, so every evaluation sees the same draws."""
        rows = prompt_rows(eval_dataset, "eval_dataset") if eval_dataset is not None else self.eval_dataset
        if rows is None:
            raise ValueError("evaluate() needs prompts: pass eval_dataset to GRPOTrainer or to evaluate()")
        a, start = self.args, time.perf_counter()
        sampling = dataclasses.replace(a.sampling, n=a.num_generations_eval or a.num_generations)
        g = sampling.n
        per_call = max(1, a.per_device_eval_batch_size // g)
        if a.world_size > 1:  # every process scores the same number of batches (their statistics are gathered)
            rows = list(itertools.islice(itertools.cycle(rows), -(-len(rows) // (per_call * a.world_size))
                                         * per_call * a.world_size))
        metrics: dict[str, list[float]] = defaultdict(list)
        model = self.accelerator.unwrap_model(self.model)
        was_training, step = model.training, self.state.global_step
        model.eval()
        try:
            self.state.global_step = -1  # a fixed draw: evaluations differ only by the policy
            for i in range(self.args.process_index * per_call, len(rows), per_call * self.args.world_size):
                batch, scores = self.rollout(rows[i:i + per_call], sampling, metrics)
                with torch.no_grad():
                    logps = completion_logps(model, batch, temperature=a.sampling.temperature,
                                             chunked=a.use_chunked_logprobs)["logps"]
                    loss, _ = grpo_loss(logps, None, batch.get("ref_logps"), batch["advantages"],
                                        batch["loss_mask"], beta=a.beta, loss_type=a.loss_type,
                                        max_completion_length=a.sampling.max_new_tokens, epsilon_low=a.epsilon,
                                        epsilon_high=a.epsilon_high)
                metrics["loss"].append(loss.item())
                rewards, valid, per_function, _, _ = scores
                self._log_generation(rewards, valid, per_function, batch, g, metrics)
        finally:
            self.state.global_step = step
            model.train(was_training)
        out = {f"{metric_key_prefix}_{k}": sum(v) / len(v) for k, v in metrics.items() if v}
        out[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - start, 4)
        self.log(out)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=out)
        return out

    # ---- logging ----
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if any(k.startswith("eval_") for k in logs):  # evaluation's own line: training's running metrics wait
            return super().log(logs, start_time)
        for key, values in self._metrics.items():
            logs[key] = sum(values) / len(values)
        self._metrics.clear()
        self.warn_off_policy(logs)
        steps = self.state.global_step - self._window_start_step
        if steps > 0 and self._window:
            w = self._window
            for key in ("generation_s", "scoring_s", "training_s"):
                logs[f"timing/{key}"] = w[key] / steps
            total = w["generation_s"] + w["scoring_s"] + w["training_s"]
            logs["timing/tokens_per_s"] = w["tokens"] / max(total, 1e-9)
            logs["timing/generated_tokens_per_s"] = w["generated_tokens"] / max(w["generation_s"], 1e-9)
            self._window.clear()
            self._window_start_step = self.state.global_step
        super().log(logs, start_time)
        if "loss" in logs:  # a training log line (not evaluation's)
            self.completions_log.flush(self.state.global_step, self.callback_handler.callbacks)


__all__ = ["GRPOConfig", "GRPOTrainer", "RepeatBatchSampler", "RewardHead", "completion_tensors", "last_token_hidden",
           "per_token_logps", "prompt_rows", "render_prompts", "rows_collator", "REWARD_HEAD_FILE"]
