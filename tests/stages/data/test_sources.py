"""What the data holds (peek) against what the chosen stages and methods need (needs), before any training."""
from __future__ import annotations

import json

import pytest

from stages.data import sources
from stages.data.sources import DataShape, destination_problem, missing_files, needs, peek
from stages.harness.config import Params


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


SFT = [{"messages": [{"role": "user", "content": f"{i}+1"}, {"role": "assistant", "content": str(i + 1)}]}
       for i in range(5)]
PAIRS = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(5)]
PROMPTS = [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(5)]
TEXT = [{"text": f"line {i}"} for i in range(5)]


def params(**data) -> Params:
    p = Params()
    p.data.source = None
    for k, v in data.items():
        setattr(p.data, k, v)
    return p


def test_builtin_holds_every_kind():
    shape = peek(Params().data)
    assert shape.destinations == {"sft", "preference", "unpaired", "prompts", "eval", "dev"} and shape.complete
    assert needs(Params(), shape) == []


def test_mixed_file_kinds_and_forms(tmp_path):
    p = params(source=write(tmp_path / "m.jsonl", SFT + PAIRS + PROMPTS))
    shape = peek(p.data)
    assert shape.destinations == {"sft", "preference", "prompts"}
    assert shape.conversational and shape.complete and shape.prompts_derivable


def test_sft_only_with_default_params_names_every_list_that_needs_the_reward_model(tmp_path):
    p = params(sft=write(tmp_path / "s.jsonl", SFT))
    p.policy.method = "ppo"  # its default reward is the reward model too
    problems = dict(needs(p, peek(p.data)))
    # policy.method ppo does not train on score's pairs: the rule reward alone is enough for score to finish
    assert problems["score.reward_functions"] == (
        "= ['exact_match', 'reward_model_prob'] includes reward_model_prob, but there is no preference data to "
        "train one: "
        "set --set score.reward_functions=[exact_match] --set score.reward_weights=[1.0], or give data.preference")
    p.policy.method = "dpo"  # DPO does: an online method with the rule reward first, the rule-reward pairs with caveat
    assert dict(needs(p, peek(p.data)))["score.reward_functions"] == (
        "= ['exact_match', 'reward_model_prob'] includes reward_model_prob, but there is no preference data to "
        "train one: "
        "set --set policy.method=grpo --set score.enabled=false (GRPO learns from the rule reward on every sample), "
        "or keep policy.method = dpo with --set score.reward_functions=[exact_match] --set score.reward_weights=[1.0] "
        "if the SFT model's samples are right on some prompts and wrong on others (score pairs only samples whose "
        "scores differ; with none the run stops before policy), or give data.preference")
    p.policy.method = "ppo"
    assert problems["policy.ppo.reward_functions"].startswith("= ['exact_match', 'reward_model_prob'] includes "
                                                                "reward_model_prob")
    assert "--set policy.ppo.reward_functions=[exact_match]" in problems["policy.ppo.reward_functions"]
    p.score.reward_functions, p.score.reward_weights, p.policy.method = ["exact_match"], None, "grpo"
    assert needs(p, peek(p.data)) == []  # GRPO's default reward is a rule: nothing missing


def test_text_rows_only_have_no_prompts_to_sample(tmp_path):
    p = params(sft=write(tmp_path / "t.jsonl", TEXT))
    p.score.reward_functions, p.score.reward_weights, p.policy.method = ["exact_match"], None, "grpo"
    problems = dict(needs(p, peek(p.data)))
    assert set(problems) == {"score.enabled", "policy.method", "data.eval_source"}
    assert "set --set score.enabled=false, or give data.prompts" in problems["score.enabled"]
    assert problems["data.eval_source"].endswith("set data.eval_source to held-out prompt/completion rows")
    p.policy.method = "dpo"  # DPO on score's pairs: no prompts to sample them from either
    assert ("set --set score.enabled=false --set policy.method=none (policy.method = dpo trains on score's pairs), "
            "or give data.prompts") in dict(needs(p, peek(p.data)))["score.enabled"]


def test_prompts_only_has_nothing_to_train_sft_on(tmp_path):
    p = params(prompts=write(tmp_path / "p.jsonl", PROMPTS))
    problems = dict(needs(p, peek(p.data)))
    assert problems["data"].startswith("holds prompts rows only: nothing for stage sft to train on")
    assert "data.eval_source" in problems


def test_preference_rows_serve_everything_by_default(tmp_path):
    p = params(preference=write(tmp_path / "p.jsonl", PAIRS))
    assert needs(p, peek(p.data)) == []


def test_shared_reward_head_needs_pairs(tmp_path):
    p = params(sft=write(tmp_path / "s.jsonl", SFT))
    p.score.enabled, p.policy.method, p.policy.grpo.reward_head = False, "grpo", "shared"
    assert [k for k, _ in needs(p, peek(p.data))] == ["policy.grpo.reward_head"]


def test_partly_read_or_unreadable_files_defer_absences_to_preprocess(tmp_path, monkeypatch):
    p = params(sft=write(tmp_path / "s.jsonl", SFT))
    assert needs(p, peek(p.data))  # whole file read: the missing pairs are certain
    monkeypatch.setattr(sources, "PEEK_BYTES", 10)
    monkeypatch.setattr(sources, "PEEK_ROWS", 2)
    sources._peek_file.cache_clear()  # peeks are cached by path, size and modification time
    assert not peek(p.data).complete and needs(p, peek(p.data)) == []
    monkeypatch.undo()
    (tmp_path / "bad.jsonl").write_text(json.dumps(SFT[0]) + "\n{broken\n")
    p = params(source=str(tmp_path / "bad.jsonl"))
    assert not peek(p.data).complete  # a mixed file: the bad line, fixed, could be a pair; no guess past it
    p = params(sft=str(tmp_path / "bad.jsonl"))
    # data.sft takes SFT rows only: fixed, the line adds nothing needs() decides on, so the absence of pairs is
    # certain and is reported with the bad line (stages.data.row_checks) in one message
    assert peek(p.data).complete and "score.reward_functions" in dict(needs(p, peek(p.data)))


def test_missing_files_name_their_key(tmp_path):
    p = params(sft=str(tmp_path / "nope.jsonl"), eval_source=str(tmp_path / "gone.jsonl"))
    assert [k for k, _ in missing_files(p.data)] == ["data.sft", "data.eval_source"]
    assert "no such file or folder" in missing_files(p.data)[0][1]


@pytest.mark.parametrize("key, fmt, expected", [
    ("source", "prompt_only", ""),
    ("sft", "alpaca", ""),
    ("preference", "unpaired", ""),
    ("sft", "preference", "row looks like format 'preference' (preference data) but data.sft takes prompt_completion, "
                          "messages, alpaca, text rows; put preference rows in data.preference"),
    ("prompts", "messages", "row looks like format 'messages' (sft data) but data.prompts takes prompt_only rows; "
                            "put sft rows in data.sft"),
])
def test_destination_problem(key, fmt, expected):
    assert destination_problem(key, fmt).split(" (or data.source")[0] == expected


def test_shape_add_by_format():
    shape = DataShape()
    shape.add("alpaca", {"instruction": "add", "output": "4"})
    assert shape.conversational and shape.prompts_derivable and shape.destinations == {"sft"}
    shape = DataShape()
    shape.add("text", {"text": "x"})
    assert not shape.conversational and not shape.prompts_derivable
