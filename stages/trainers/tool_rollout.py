"""Rollouts beyond one sampled turn, TRL 1.16's contract: `tools=`, `environment_factory=` and `rollout_func=`.

`Rollout` is what GRPO trains on and scores, whichever way it was made: per completion its prompt, prompt and
completion ids, the sampler's log-probs, the tool mask (1 on the model's own tokens; None for one-turn
completions) and what the reward functions read (`completions` and extra `columns`).

- One sampled turn: `from_generations` (`stages.generation`).
- `Agent` (`tools=` and/or `environment_factory=`): multi-turn episodes (`stages.tools.episodes`). Prompts are
  rendered with the tools' schemas (`tools=` of the chat template); each completion is the episode's messages
  (assistant turns with their `tool_calls`, and the `tool` turns), as TRL passes them to reward functions.
  An environment factory (or a dict of them, chosen per row by its `environment` column) builds one instance per
  episode, reused across steps: `reset(**row)` starts it (a returned string is appended to the last user
  message), its public methods are the episode's tools, and a `get_reward()` method makes it a reward source
  (named after its class, weight 1); reward functions get the instances as the `environments` column.
- `custom_rollout` (`rollout_func=`): the user's function, called as TRL calls it, `rollout_func(prompts,
  trainer)`, with each prompt repeated num_generations times (the batch TRL's sampler hands it); it returns
  {"prompt_ids", "completion_ids", "logprobs"} per completion, optionally "env_mask" (1 on the model's tokens, the
  tool mask), and any other key is a column for the reward functions.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stages.generation.common import TokenPrompt
from stages.tools import ToolRunner, format_for_template
from stages.tools.episodes import Generate, run_episodes, tool_suffix_ids

logger = logging.getLogger(__name__)
REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")


@dataclass
class Rollout:
    prompts: list  # N: the prompt of each completion
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    tool_mask: list[list[int]] | None  # 1: the model's token (loss, log-probs); 0: tool output, context only
    completions: list  # N: text, or an episode's messages
    columns: dict[str, list] = field(default_factory=dict)


def from_generations(gens, rows: list[dict], prompts: list) -> Rollout:
    """One sampled turn per completion (`stages.generation.Generations`)."""
    index = gens.prompt_index
    return Rollout([prompts[i] for i in index], [gens.prompt_ids[i] for i in index], gens.completion_ids,
                   gens.logprobs, None, gens.completions, gens.reward_columns(rows))


def _row_columns(rows: list[dict], g: int, skip=("prompt",)) -> dict[str, list]:
    names = dict.fromkeys(k for r in rows for k in r if k not in skip)
    return {k: [r.get(k) for r in rows for _ in range(g)] for k in names}


# ---------------------------------------------------------------------------------------------------------------
# rollout_func
# ---------------------------------------------------------------------------------------------------------------

def custom_rollout(rollout_func: Callable, trainer, rows: list[dict], g: int, tokenizer) -> Rollout:
    """Call the user's `rollout_func(prompts, trainer)` and check what it returns (see the module doc)."""
    prompts = [r["prompt"] for r in rows for _ in range(g)]
    out = rollout_func(prompts, trainer)
    if not isinstance(out, dict):
        raise ValueError(f"rollout_func returned a {type(out).__name__}; it must return a dict with keys "
                         f"{list(REQUIRED_KEYS)} (one entry per completion), optionally 'env_mask' and extra columns")
    missing = [k for k in REQUIRED_KEYS if k not in out]
    if missing:
        raise ValueError(f"rollout_func must return keys {list(REQUIRED_KEYS)}; missing {missing}")
    if "logprob_token_ids" in out:
        raise ValueError("rollout_func returned 'logprob_token_ids': top-k sampler log-probs are not used here; "
                         "return the sampled tokens' 'logprobs' only")
    n = len(prompts)
    problems = [f"{k}: {len(out[k])} entries" for k in ("prompt_ids", "completion_ids", "env_mask")
                if out.get(k) is not None and len(out[k]) != n]
    logprobs, mask = out["logprobs"], out.get("env_mask")
    if logprobs is not None and len(logprobs) != n:
        problems.append(f"logprobs: {len(logprobs)} entries")
    for name, rows_ in (("logprobs", logprobs), ("env_mask", mask)):
        if rows_ is not None and len(rows_) == n:
            bad = [i for i, (a, c) in enumerate(zip(rows_, out["completion_ids"], strict=True)) if len(a) != len(c)]
            if bad:
                problems.append(f"{name}[{bad[0]}] has {len(rows_[bad[0]])} values for "
                                f"{len(out['completion_ids'][bad[0]])} completion tokens")
    if problems:
        raise ValueError(f"rollout_func got {len(rows)} prompts x num_generations {g} = {n} prompts and must return "
                         f"one entry per prompt, as long as its completion: {'; '.join(problems)}")
    completion_ids = [list(c) for c in out["completion_ids"]]
    columns = _row_columns(rows, g)
    for key, values in out.items():
        if key in (*REQUIRED_KEYS, "env_mask"):
            continue
        columns[key] = list(values) if isinstance(values, (list, tuple)) and len(values) == n else [values] * n
    columns.update(completion_ids=completion_ids, finished=[None] * n, reasoning=[None] * n)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(prompts, [list(p) for p in out["prompt_ids"]], completion_ids,
                   None if logprobs is None else [list(map(float, lp)) for lp in logprobs],
                   None if mask is None else [[int(bool(v)) for v in m] for m in mask], texts, columns)


# ---------------------------------------------------------------------------------------------------------------
# tools and environments
# ---------------------------------------------------------------------------------------------------------------

def placeholder_rows(environment_factory, args) -> list[dict]:
    """TRL's rows when an environment owns the data (no train_dataset): one generation's worth of empty prompts,
    which each episode's reset() fills; max_steps sets the length."""
    if isinstance(environment_factory, dict):
        raise ValueError("train_dataset is None with a dict of environments: each row's 'environment' column picks "
                         "its environment, so pass a train_dataset with that column (or a single factory)")
    if args.max_steps <= 0:
        raise ValueError(f"train_dataset is None (the environment's reset() supplies the prompts) and max_steps = "
                         f"{args.max_steps}: set max_steps > 0, the length of training")
    n = args.per_device_train_batch_size * args.resolved_steps_per_generation // args.num_generations
    return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(max(n, 1))]


def _methods(instance) -> list[Callable]:
    """An environment's tools: its public methods other than reset and get_reward (listed on the class, so
    properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def check_template(tokenizer, chat_template: str | None, model_name: str) -> str:
    """The tool-call format of the template (`stages.tools.FORMATS`); a ValueError naming the model when the
    template drops tool calls or tool turns, or renders earlier turns differently once tool turns follow."""
    template = chat_template or tokenizer.chat_template
    owner = f"model {model_name!r}"
    fix = ("set a template that renders tools (GRPOConfig.chat_template_path, or processing_class.chat_template; "
           "for a ChatML tokenizer stages.builtin.chat_templates.CHATML_TOOLS)")
    if not template:
        raise ValueError(f"{owner}: the tokenizer has no chat template, so tools cannot be shown or called; {fix}")
    messages: list[dict] = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "name_7f3a", "arguments": {"k": "v_9c2e"}}}]},
                {"role": "tool", "name": "name_7f3a", "content": "out_5d1b"}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
    except Exception as e:  # noqa: BLE001 - a template error is the user's to fix
        raise ValueError(f"{owner}: its chat template cannot render a tool call and a tool turn ({e}); {fix}") from e
    lost = [s for s in ("name_7f3a", "v_9c2e", "out_5d1b") if s not in text]
    if lost:
        raise ValueError(f"{owner}: its chat template drops tool calls or tool results (rendered without {lost}); "
                         f"{fix}")
    fmt = format_for_template(template, owner=owner)
    tool_suffix_ids(tokenizer, messages[2:], chat_template=template)  # raises unless prefix-preserving
    return fmt


class Agent:
    """The tools and environments of a run, and its multi-turn rollouts (see the module doc)."""

    def __init__(self, tokenizer, *, tools: list[Callable] | None, environment_factory, args, model_name: str):
        self.tokenizer, self.args = tokenizer, args
        self.tools = list(tools or [])
        bad = [t for t in self.tools if not callable(t) or not hasattr(t, "__name__")]
        if bad:
            raise ValueError(f"tools: {bad[0]!r} is not a named function; pass Python functions with type hints and "
                             "a Google-style docstring (their schema is what the model sees)")
        names = [t.__name__ for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: names {sorted({n for n in names if names.count(n) > 1})} repeat; a call names "
                             "its tool, so each needs a distinct __name__")
        self.multi = isinstance(environment_factory, dict)
        self.factories = (environment_factory if self.multi else {None: environment_factory}) \
            if environment_factory is not None else {}
        self.pools: dict[Any, list] = {}
        self.reward_types: list[type] = []
        for name, factory in self.factories.items():
            instance = factory()
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(f"environment_factory{'' if name is None else f'[{name!r}]'} built a "
                                 f"{type(instance).__name__} without a reset method; an environment defines "
                                 "reset(**row) -> str | None and its tools as public methods")
            self.pools[name] = [instance]
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_types:
                self.reward_types.append(type(instance))
        self.format = check_template(tokenizer, None, model_name)
        self.runner = ToolRunner(timeout=args.tool_timeout, mode=args.tool_mode)
        self.environments: list | None = None  # the latest rollout's, per completion

    def check_rows(self, rows: list[dict], key: str) -> None:
        """Tools are shown through the chat template: every prompt must be a message list (found before training)."""
        bad = next((i for i, r in enumerate(rows) if "prompt" in r and not isinstance(r["prompt"], list)), None)
        if bad is not None:
            raise ValueError(f"{key}[{bad}]['prompt'] is a {type(rows[bad]['prompt']).__name__}: with tools or an "
                             "environment, prompts must be chat messages ([{'role': 'user', 'content': ...}]), which "
                             "the chat template renders with the tools' schemas")

    def reward_functions(self) -> list[tuple[str, Callable]]:
        """(name, reward function) for each environment class with get_reward: scores its own episodes only."""
        def make(kind):
            def env_reward(prompts, completions, environments=None, **_):
                return [e.get_reward() if type(e) is kind else None for e in environments]
            return kind.__name__, env_reward
        return [make(kind) for kind in self.reward_types]

    def _environments(self, rows: list[dict], g: int) -> list | None:
        if not self.factories:
            return None
        envs: list = []
        cursor: dict[Any, int] = {}
        for row in rows:
            name = row.get("environment") if self.multi else None
            if name not in self.factories:
                raise ValueError(f"a row has environment = {name!r}, not one of environment_factory's "
                                 f"{list(self.factories)}; set each row's 'environment' column to one of them")
            for _ in range(g):
                pool, k = self.pools[name], cursor.get(name, 0)
                if k == len(pool):
                    pool.append(self.factories[name]())
                cursor[name] = k + 1
                envs.append(pool[k])
        return envs

    def run(self, rows: list[dict], g: int, generate: Generate) -> Rollout:
        """g episodes per row; `generate(contexts, n, round)` samples from the policy (`run_episodes`)."""
        a, tok = self.args, self.tokenizer
        envs = self._environments(rows, g)
        self.environments = envs
        prompts, tool_sets = [], []
        for k, row in enumerate(r for r in rows for _ in range(g)):
            prompt = row.get("prompt", [{"role": "user", "content": ""}] if envs is not None else None)
            if not isinstance(prompt, list):
                raise ValueError("tools and environments need conversational prompts (a list of messages); got "
                                 f"{type(prompt).__name__} {str(prompt)[:80]!r}")
            functions = list(self.tools)
            if envs is not None:
                env = envs[k]
                kwargs = {key: v for key, v in row.items() if key != "environment"} if self.multi else dict(row)
                observation = env.reset(**kwargs)
                if observation is not None:
                    last = prompt[-1]
                    prompt = [*prompt[:-1], {**last, "content": (last.get("content") or "") + str(observation)}]
                functions += _methods(env)
            prompts.append(prompt)
            tool_sets.append({f.__name__: f for f in functions})
        kwargs = a.chat_template_kwargs or {}
        prompt_ids = []
        for prompt, tools in zip(prompts, tool_sets, strict=True):
            text = tok.apply_chat_template(prompt, tools=list(tools.values()) or None, tokenize=False,
                                           add_generation_prompt=True, **kwargs)
            prompt_ids.append(list(tok(text, add_special_tokens=False)["input_ids"]))
        episodes = run_episodes(prompt_ids, generate, tokenizer=tok, tools=tool_sets, runner=self.runner,
                                fmt=self.format, max_iterations=a.max_tool_calling_iterations,
                                max_completion_length=a.max_completion_length, template_kwargs=kwargs)
        from stages.generation.common import eos_token_ids

        eos = eos_token_ids(tok)
        columns = _row_columns(rows, g)
        columns.update(completion_ids=[e.completion_ids for e in episodes],
                       finished=[bool(e.completion_ids) and e.completion_ids[-1] in eos for e in episodes],
                       reasoning=[None] * len(episodes))
        if envs is not None:
            columns["environments"] = envs
        logprobs = None if any(e.logprobs is None for e in episodes) else [e.logprobs or [] for e in episodes]
        return Rollout(prompts, prompt_ids, [e.completion_ids for e in episodes], logprobs,
                       [e.tool_mask for e in episodes], [e.messages for e in episodes], columns)


def tool_metrics(accelerator, runner: ToolRunner, episodes: int) -> dict[str, float]:
    """The runner's counts since the last call, summed over processes: tools/calls, tools/errors, tools/timeouts,
    tools/parse_errors, and TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (faults
    per call). A generation with faults also logs a warning."""
    import torch

    counts = runner.take_counts()
    keys = ("calls", "errors", "timeouts", "parse_errors")
    local = torch.tensor([counts[k] for k in keys] + [episodes], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(local, reduction="sum").tolist()
    out = {f"tools/{key}": value for key, value in zip(keys, total, strict=False)}
    calls, faults = total[0], total[1] + total[2] + total[3]
    out["tools/call_frequency"] = calls / max(total[4], 1)
    out["tools/failure_frequency"] = faults / calls if calls else 0.0
    if faults:
        logger.warning("tools: %d of %d calls failed this generation (%d raised or unknown, %d timed out, %d "
                       "malformed); the model read each error as the tool's output", faults, calls, total[1],
                       total[2], total[3])
    return out


def token_prompts(tokenizer, contexts: list[list[int]]) -> list[TokenPrompt]:
    """Episode contexts as prompts the generation backends take as they are."""
    return [TokenPrompt(tuple(c), tokenizer.decode(c)) for c in contexts]
