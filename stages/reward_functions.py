"""Reward functions for RL stages and scoring: built-ins, user functions by import path, weighted sums.

A reward function is any callable `f(prompts, completions, **columns) -> list[float | None]`, one value per
completion (called by keyword, as TRL calls it, when it names a `completions` parameter); None means "not
scored" (e.g. no reference answer), never zero. `completions` are the strings of
`stages.completion_text.decode_and_strip_padding` (the reasoning block removed); `columns` are the dataset's extra
columns (`answer`, ...) repeated per completion, plus `completion_ids`, `reasoning` and `finished` from
generation. Functions must accept (and may ignore) any column: end the signature with `**_`.

Built-ins (`BUILTIN_REWARDS`): `exact_match` (the completion's last integer equals the answer),
`reasoning_format` (a closed, non-empty reasoning block and an answer), `length_penalty` (-min(length / max,
1)), `reward_model` (a trained reward model scoring prompt + completion) and `reward_model_prob` (σ(r), in
(0, 1): a bounded tie-breaker beside a verifiable reward). Anything else is a dotted path
`package.module:function` (imported, never eval'd). `RewardFunctions` runs several, checks every output and
sums them with weights.
"""
from __future__ import annotations

import inspect
import math
import numbers
import os
import re
from collections.abc import Callable
from typing import Any

from stages.basics import import_user_module
from stages.completion_text import THINK_TAGS, answer_after_reasoning
from stages.reward_function_names import BUILTIN_REWARD_CALLABLES, REWARD_MODEL_REWARDS

RewardFn = Callable[..., list]
ANSWER_RE = re.compile(r"(-?\d+)\s*$")


# ------------------------------------------------------------------------------- built-ins

def final_integer(text: str) -> int | None:
    """The integer a text ends with (trailing whitespace allowed), or None: "so 132" -> 132."""
    match = ANSWER_RE.search(text)
    return int(match.group(1)) if match else None


def _reference_answer(answer: Any, completion: Any) -> int | None:
    """The reference integer from an `answer` value, else from a reference `completion` (string or messages)."""
    if answer is not None:
        return final_integer(str(answer).strip())
    if completion is None:
        return None
    if isinstance(completion, list):  # chat messages: the last message is the reference answer
        completion = completion[-1]["content"] if completion else ""
    return final_integer(answer_after_reasoning(str(completion), THINK_TAGS))


def exact_match(prompts: list, completions: list[str], *, answer: list | None = None,
                completion: list | None = None, **_) -> list[float | None]:
    """1.0 where the completion's last integer equals the reference answer, 0.0 where not.

    Reference: the `answer` column (e.g. "132") where present and not None, else the last
    integer of the reference `completion` column (a string or chat messages, the last
    message's content, after its reasoning block). A completion given as messages (a tool-using episode)
    is judged by its last message. Integers are compared as numbers ("07" ==
    "7"). None (unscored) for rows without a reference or whose reference has no integer.
    """
    out: list[float | None] = []
    for i, text in enumerate(completions):
        if isinstance(text, list):  # a multi-turn episode's messages: its last turn is the answer
            text = (text[-1].get("content") or "") if text else ""
        ref = _reference_answer(answer[i] if answer is not None else None,
                                completion[i] if completion is not None else None)
        out.append(None if ref is None else float(final_integer(text) == ref))
    return out


def reasoning_format(prompts: list, completions: list[str], *, reasoning: list | None = None, **_
                     ) -> list[float]:
    """1.0 where the completion had a closed reasoning block with non-empty reasoning and a non-empty answer.

    Uses the `reasoning` column of generation (`stages.completion_text.parse_completions`: None
    without a block). A block that was never closed leaves the answer empty, so it scores 0.0.
    """
    if reasoning is None:
        raise ValueError("reasoning_format needs the `reasoning` column (the parsed <think> block of each "
                         "completion, from stages.generation); pass reasoning=... or drop this reward function")
    return [float(bool(r and r.strip()) and bool(text.strip())) for text, r in zip(completions, reasoning, strict=True)]


def length_penalty(prompts: list, completions: list[str], *, completion_ids: list | None = None,
                   max_tokens: int = 64, max_chars: int = 256, **_) -> list[float | None]:
    """-min(length / max, 1) per completion, in [-1, 0]: shorter is better.

    Length: generated tokens (`completion_ids`, EOS included) over `max_tokens` (64, the
    default generation budget) when the column is given, else characters of the completion
    over `max_chars` (256). Completions at or beyond the cap all get -1. For other caps wrap
    it: `functools.partial(length_penalty, max_tokens=128)` in your module, then name that.
    """
    if completion_ids is not None:
        return [-min(len(ids) / max_tokens, 1.0) for ids in completion_ids]
    return [-min(len(text) / max_chars, 1.0) for text in completions]


class RewardModelReward:
    """A trained reward model as a reward function: r(prompt, completion) from `score_texts`; with
    `squash`, σ(r) in (0, 1) (`reward_model_prob`).

    The model saw whole completions in training, reasoning included, so where the
    `reasoning` column is given the text is put back together as
    `<think>{reasoning}</think>{answer}` before scoring.

    Bradley-Terry fixes only differences of r, and its scale grows with training (held-out margins of 10
    and more on the built-in task): beside exact_match, a raw r at weight 0.05 outscored a wrong answer past
    a right one on 24% of one seed's pairs; σ(r) at any weight below 1 cannot.
    """

    def __init__(self, path: str, *, device: str = "cpu", batch_size: int = 64, max_length: int = 1024,
                 squash: bool = False, tokenizer=None):
        """tokenizer: the one that renders and tokenises the scored texts (TRL's reward_processing_classes entry);
        None: the folder's own. One without a pad token pads with its EOS token, as in TRL."""
        from stages.models import load_tokenizer
        from stages.reward_model import load_reward_model

        self.path, self.batch_size, self.max_length, self.squash = path, batch_size, max_length, squash
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"the tokenizer given for the reward model {path} has neither a pad nor an EOS "
                                 "token: set tokenizer.pad_token before passing it")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = load_reward_model(path, self.tokenizer, device=device, require_head=True).eval()

    def __call__(self, prompts: list, completions: list[str], *, reasoning: list | None = None, **_) -> list[float]:
        from stages.reward_model import score_texts

        if reasoning is not None:
            completions = [c if r is None else f"{THINK_TAGS[0]}{r}{THINK_TAGS[1]}{c}"
                           for c, r in zip(completions, reasoning, strict=True)]
        scores = score_texts(self.model, self.tokenizer, prompts, completions, batch_size=self.batch_size,
                             max_length=self.max_length)
        return [sigmoid(r) for r in scores] if self.squash else scores


def sigmoid(x: float) -> float:
    """σ(x) = 1 / (1 + e^-x), without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


# name -> its function (or, for the reward-model built-ins, the class load_reward_function builds), from the one list
BUILTIN_REWARDS: dict[str, Any] = {name: globals()[impl] for name, impl in BUILTIN_REWARD_CALLABLES.items()}


# ---------------------------------------------------------------------------------- loading

def load_reward_function(name: str, *, reward_model_path: str | None = None, device: str = "cpu",
                         key: str = "reward_functions", tokenizer=None) -> RewardFn:
    """A BUILTIN_REWARDS name, or a dotted path "package.module:function" (an attribute path after the
    colon, e.g. "mod:obj.method", is followed). `key` is the params key being read, for errors.
    tokenizer: for a reward model (its folder, or the reward_model built-ins), the tokenizer it reads with
    (None: the folder's); given for anything else, an error."""
    if name in REWARD_MODEL_REWARDS:
        if not reward_model_path:
            raise ValueError(f"{key} = {name!r} needs reward_model_path: the folder of a trained reward model")
        return RewardModelReward(reward_model_path, device=device, squash=name == "reward_model_prob",
                                 tokenizer=tokenizer)
    if os.path.isdir(name) and name not in BUILTIN_REWARDS:  # a reward model's folder, as TRL's reward_funcs takes
        return RewardModelReward(name, device=device, tokenizer=tokenizer)
    if tokenizer is not None:
        raise ValueError(f"reward_processing_classes gives a tokenizer for {key} = {name!r}, which is not a reward "
                         "model (a function reads text, not tokens); put None at its position")
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ValueError(f"{key} = {name!r}: not a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor an import "
                         "path module:function (e.g. mypkg.rewards:score) nor a reward model's folder")
    module_name, _, attr = name.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"{key} = {name!r}: expected exactly one module:function, e.g. mypkg.rewards:score")
    try:
        module = import_user_module(module_name)
    except ValueError as e:
        raise ValueError(f"{key} = {name!r}: {e}") from e.__cause__
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ValueError(f"{key} = {name!r}: {module_name} has no attribute {attr!r} (its callables: "
                             f"{', '.join(defined) or 'none'})")
        obj = getattr(obj, part)
    if inspect.isclass(obj):
        raise ValueError(f"{key} = {name!r} is a class; a reward function is called as f(prompts, completions, "
                         "**columns): point at a function or at an instance of the class")
    if not callable(obj):
        raise ValueError(f"{key} = {name!r} is a {type(obj).__name__}, not callable; a reward function is "
                         "f(prompts, completions, **columns) -> list[float | None]")
    return obj


# --------------------------------------------------------------------------------- combining

class RewardFunctions:
    """Several reward functions with weights: a weighted total per row and every function's scores.

    Outputs are checked: a list (or tuple / 1-d array) with one entry per completion, each a
    finite real number or None. bools are accepted as 1.0 / 0.0 (pass/fail checks are
    natural reward functions). Anything else raises ValueError naming the function and row.
    A row's total is None when any function left it unscored (None), never a silent zero.
    """

    def __init__(self, functions: list[tuple[str, RewardFn]], weights: list[float] | None = None):
        if not functions:
            raise ValueError("RewardFunctions needs at least one (name, function) pair")
        names = [n for n, _ in functions]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward functions {dupes} are listed more than once; give each a distinct name")
        weights = [1.0] * len(functions) if weights is None else list(weights)
        if len(weights) != len(functions):
            raise ValueError(f"{len(weights)} reward weights for {len(functions)} reward functions ({names}): give "
                             "one weight per function (or none: all 1.0)")
        bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w)]
        if bad:
            raise ValueError(f"reward weights {weights}: {bad} not finite numbers")
        self.functions, self.weights = list(functions), [float(w) for w in weights]

    def __call__(self, prompts: list, completions: list[str], **columns
                 ) -> tuple[list[float | None], dict[str, list[float | None]]]:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts but {n} completions: repeat each prompt per completion")
        for col, values in columns.items():
            if values is not None and len(values) != n:
                raise ValueError(f"column {col!r} has {len(values)} values for {n} completions: repeat it per "
                                 "completion")
        scores: dict[str, list[float | None]] = {}
        for name, fn in self.functions:
            try:
                out = _call(fn, prompts, completions, columns)
            except Exception as e:  # a user's function: say which one, keep the original traceback chained
                raise ValueError(f"reward function {name!r} raised {type(e).__name__}: {e}; it is called as "
                                 "f(prompts, completions, **columns) -> list[float | None]") from e
            scores[name] = _check_output(name, out, n)
        totals: list[float | None] = []
        for i in range(n):
            row = [scores[name][i] for name, _ in self.functions]
            present = [v for v in row if v is not None]
            totals.append(None if len(present) < len(row)
                          else sum(w * v for w, v in zip(self.weights, present, strict=True)))
        return totals, scores


def _call(fn, prompts: list, completions: list, columns: dict):
    """fn(prompts=..., completions=..., **columns) when fn names a `completions` parameter (TRL's convention:
    `def reward(completions, **kwargs)`), else fn(prompts, completions, **columns)."""
    try:
        keywords = "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        keywords = False
    if keywords:
        return fn(prompts=prompts, completions=completions, **columns)
    return fn(prompts, completions, **columns)


def _check_output(name: str, out: Any, n: int) -> list[float | None]:
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # torch / numpy 1-d outputs
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise ValueError(f"reward function {name!r} returned a {type(out).__name__}; it must return a list with "
                         f"one float (or None) per completion ({n})")
    if len(out) != n:
        raise ValueError(f"reward function {name!r} returned {len(out)} values for {n} completions")
    checked: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            checked.append(None)
            continue
        if not isinstance(v, numbers.Real):
            raise ValueError(f"reward function {name!r}, row {i}: {v!r} ({type(v).__name__}) is not a number; "
                             "return a float, or None for an unscored row")
        if not math.isfinite(v):
            raise ValueError(f"reward function {name!r}, row {i}: {v} is not finite; return None for a row you "
                             "cannot score")
        checked.append(float(v))
    return checked


def build_reward_functions(spec, weights: list[float] | None = None, *, key: str = "reward_functions",
                           reward_model_path: str | None = None, device: str = "cpu",
                           processing_classes=None) -> RewardFunctions:
    """One RewardFunctions from what trainers and stages accept, every function loaded and checked now.

    spec: a RewardFunctions (returned as is), or one / a list of: a built-in name or dotted path
    (`load_reward_function`), a callable, or a (name, callable) pair. `key` names the params key
    in errors (e.g. "score.reward_functions").
    processing_classes: TRL's reward_processing_classes: one tokenizer (a single reward function) or one entry per
    function, in order; a reward model (a folder) reads with its entry (None: the folder's own tokenizer), every
    other function must have None there.
    """
    if isinstance(spec, RewardFunctions):
        if weights is not None or processing_classes is not None:
            raise ValueError(f"{key}: weights or reward_processing_classes given for a RewardFunctions that has its "
                             "own functions; pass a list of functions instead")
        return spec
    items = list(spec) if isinstance(spec, list) or (isinstance(spec, tuple) and not _is_pair(spec)) else [spec]
    if processing_classes is None:
        tokenizers = [None] * len(items)
    else:  # TRL: a single processing class stands for a list of one
        tokenizers = list(processing_classes) if isinstance(processing_classes, list) else [processing_classes]
    if len(tokenizers) != len(items):
        raise ValueError(f"reward_processing_classes: {len(tokenizers)} processing class(es) for {len(items)} reward "
                         f"function(s) in {key}; give one per function, in order (None for those that are not "
                         "reward models)")
    named = []
    for i, item in enumerate(items):
        if tokenizers[i] is not None and not isinstance(item, str):
            raise ValueError(f"reward_processing_classes[{i}] is given for {key}[{i}], a "
                             f"{type(item).__name__} rather than a reward model's folder; put None at its position")
        if isinstance(item, str):
            named.append((item, load_reward_function(item, reward_model_path=reward_model_path, device=device,
                                                     key=f"{key}[{i}]", tokenizer=tokenizers[i])))
        elif _is_pair(item):
            named.append((item[0], item[1]))
        elif hasattr(item, "config") and hasattr(item, "forward"):  # a model object (TRL takes those too)
            raise ValueError(f"{key}[{i}] is a {type(item).__name__} object; give a reward model as its folder "
                             "(a string), which holds its tokenizer too")
        elif callable(item):
            named.append((getattr(item, "__name__", type(item).__name__), item))
        else:
            raise ValueError(f"{key}[{i}] = {item!r}: expected a built-in reward name ({', '.join(BUILTIN_REWARDS)}),"
                             " a module:function path, a callable f(prompts, completions, **columns) or a "
                             "(name, callable) pair")
    if weights is not None and len(weights) != len(named):
        raise ValueError(f"{key}: {len(weights)} weight(s) for {len(named)} reward function(s) "
                         f"({', '.join(n for n, _ in named)}); give one weight per function")
    return RewardFunctions(named, weights)


def _is_pair(item) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and callable(item[1])
