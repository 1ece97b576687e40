"""Reward functions: the built-ins, loading by name or import path, and RewardFunctions' checks and sums."""
import math
import sys
import textwrap

import pytest

from stages.reward_functions import (
    BUILTIN_REWARDS,
    RewardFunctions,
    build_reward_functions,
    exact_match,
    final_integer,
    length_penalty,
    load_reward_function,
    reasoning_format,
)

P = ["1+2"] * 4


def test_final_integer():
    assert [final_integer(t) for t in ["132", "so 132 \n", "-7", "12 apples", "", "x-3"]] == [132, 132, -7, None,
                                                                                              None, -3]


def test_exact_match_against_the_answer_column():
    """answer "3": "3" and "1+2 = 03" (07 == 7 as numbers) match, "4" does not, no integer -> 0.0;
    a row whose answer is None and has no reference completion is unscored."""
    out = exact_match(P, ["3", "1+2 = 03", "4", "three"], answer=["3", "3", "3", "3"])
    assert out == [1.0, 1.0, 0.0, 0.0]
    assert exact_match(P[:2], ["3", "3"], answer=["3", None]) == [1.0, None]
    assert exact_match(P[:2], ["5", "6"], answer=[5, 5]) == [1.0, 0.0]  # non-string answers are read as text


def test_exact_match_against_a_reference_completion():
    """No `answer` column: the reference completion's answer after its reasoning block ("<think>1+2=3</think>3"
    -> 3, not the 3s inside the block: "<think>..=4</think>3" proves it), from a string or the last chat message."""
    refs = ["<think>1+2=4</think>3", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "7"}],
            "no number", None]
    assert exact_match(P, ["3", "7", "3", "3"], completion=refs) == [1.0, 1.0, None, None]
    assert exact_match(P[:1], ["3"], answer=[None], completion=["<think>x</think>3"]) == [1.0]  # falls back
    assert exact_match(P[:1], ["3"]) == [None]  # no reference column at all


def test_reasoning_format():
    """Closed block (reasoning not None) with non-empty reasoning and answer -> 1; no block (None), empty
    reasoning, or an unclosed block (parse_completions leaves the answer "") -> 0."""
    out = reasoning_format(P, ["3", "3", "3", ""], reasoning=["1+2=3", None, "  ", "1+2="])
    assert out == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="needs the `reasoning` column"):
        reasoning_format(P, ["3"] * 4)


def test_length_penalty():
    """Tokens over 64 when completion_ids are given (32 tokens -> -0.5, 100 -> capped at -1), else
    characters over 256 (64 chars -> -0.25, "" -> 0)."""
    assert length_penalty(P[:2], ["a", "b"], completion_ids=[[1] * 32, [1] * 100]) == [-0.5, -1.0]
    assert length_penalty(P[:2], ["x" * 64, ""]) == [-0.25, 0.0]
    assert length_penalty(P[:1], ["x"], completion_ids=[[1] * 8], max_tokens=16) == [-0.5]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(textwrap.dedent("""
        import math
        NOT_CALLABLE = 3
        def ones(prompts, completions, **_):
            return [1.0] * len(completions)
        def short(prompts, completions, **_):
            return [1.0]
        def text(prompts, completions, **_):
            return ["1"] * len(completions)
        def nan(prompts, completions, **_):
            return [0.0, math.nan][: len(completions)]
        def half_none(prompts, completions, **_):
            return [None if i % 2 else 2.0 for i in range(len(completions))]
        def flags(prompts, completions, **_):
            return [True, False][: len(completions)]
        def boom(prompts, completions, **_):
            raise RuntimeError("boom")
        class Scorer:
            def __call__(self, prompts, completions, **_):
                return [0.5] * len(completions)
        scorer = Scorer()
    """))
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myrewards"
    for name in ("myrewards", "broken"):
        sys.modules.pop(name, None)


def test_load_by_name_and_import_path(user_module):
    assert load_reward_function("exact_match") is BUILTIN_REWARDS["exact_match"]
    assert load_reward_function("myrewards:ones")(["p"], ["c"]) == [1.0]
    assert load_reward_function("myrewards:scorer")(["p"], ["c"]) == [0.5]
    assert load_reward_function("myrewards:Scorer.__call__") is not None  # attribute paths are followed


@pytest.mark.parametrize("name, message", [
    ("nope", r"score.reward_functions\[1\] = 'nope': not a built-in reward \(exact_match, .*\) nor an import path"),
    ("mypkg.x:f", r"score.reward_functions\[1\] = 'mypkg.x:f': module mypkg.x not found"),
    ("broken:f", r"'broken:f': importing broken failed: No module named 'not_a_module_anywhere_xyz'"),
    ("myrewards:missing", r"myrewards has no attribute 'missing' \(its callables: Scorer, boom, flags, half_none"),
    ("myrewards:NOT_CALLABLE", r"'myrewards:NOT_CALLABLE' is a int, not callable"),
    ("myrewards:Scorer", r"is a class; .* point at a function or at an instance"),
    ("myrewards:", r"expected exactly one module:function"),
    ("reward_model", r"'reward_model' needs reward_model_path"),
])
def test_load_errors_name_the_key(user_module, name, message):
    with pytest.raises(ValueError, match=message):
        load_reward_function(name, key="score.reward_functions[1]")


def _funcs(*names, weights=None):
    return RewardFunctions([(n, load_reward_function(n)) for n in names], weights)


def test_weighted_total_and_unscored_rows(user_module):
    """Rows: exact_match vs answer "3" gives [1, 0]; myrewards:half_none gives [2, None].
    Weights (0.5, 2): row 0 = 0.5·1 + 2·2 = 4.5; row 1 is unscored by half_none -> total None, not 0."""
    funcs = _funcs("exact_match", "myrewards:half_none", weights=[0.5, 2])
    totals, scores = funcs(["1+2", "1+2"], ["3", "4"], answer=["3", "3"])
    assert totals == [4.5, None]
    assert scores == {"exact_match": [1.0, 0.0], "myrewards:half_none": [2.0, None]}
    assert _funcs("myrewards:flags")(["p", "p"], ["a", "b"])[0] == [1.0, 0.0]  # bools count as 1 / 0


@pytest.mark.parametrize("name, message", [
    ("myrewards:short", r"reward function 'myrewards:short' returned 1 values for 2 completions"),
    ("myrewards:text", r"reward function 'myrewards:text', row 0: '1' \(str\) is not a number"),
    ("myrewards:nan", r"reward function 'myrewards:nan', row 1: nan is not finite"),
])
def test_bad_outputs_name_the_function_and_row(user_module, name, message):
    with pytest.raises(ValueError, match=message):
        _funcs(name)(["p", "p"], ["a", "b"])


def test_errors_inside_a_function_say_which(user_module):
    with pytest.raises(ValueError, match="reward function 'myrewards:boom' raised RuntimeError: boom") as info:
        _funcs("myrewards:boom")(["p"], ["a"])
    assert isinstance(info.value.__cause__, RuntimeError)  # the user's traceback stays chained


def test_bad_setup(user_module):
    with pytest.raises(ValueError, match=r"1 reward weights for 2 reward functions"):
        _funcs("exact_match", "length_penalty", weights=[1.0])
    with pytest.raises(ValueError, match=r"\[nan\] not finite numbers"):
        _funcs("exact_match", weights=[math.nan])
    with pytest.raises(ValueError, match=r"\['exact_match'\] are listed more than once"):
        _funcs("exact_match", "exact_match")
    with pytest.raises(ValueError, match="at least one"):
        RewardFunctions([])
    with pytest.raises(ValueError, match=r"column 'answer' has 1 values for 2 completions"):
        _funcs("exact_match")(["p", "p"], ["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match=r"1 prompts but 2 completions"):
        _funcs("exact_match")(["p"], ["1", "2"])


# ------------------------------------------------------------------ reward_processing_classes (TRL's)

@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A reward model folder (the built-in model with a seeded score head) and another tokenizer (another BPE
    over the same corpus: other ids for the same text)."""
    import torch

    from stages.reward_model import load_reward_model
    from tests import architectures
    from tests.stages.trainers.conftest import build_tiny

    folder = build_tiny(tmp_path_factory.mktemp("rm"))
    torch.manual_seed(0)
    model = load_reward_model(str(folder))
    model.save_pretrained(folder)
    other = architectures.train_tokenizer(eos="<|end|>", pad="<|pad|>", chat_template=architectures.CHATML,
                                          vocab_size=300)
    return str(folder), other


def test_a_reward_model_reads_with_its_processing_class(reward_folder):
    from stages.reward_model import score_texts

    folder, other = reward_folder
    prompts, completions = ["1 + 2 =", "3 + 4 ="], ["3", "8"]
    own = build_reward_functions([folder, "exact_match"])
    given = build_reward_functions([folder, "exact_match"], processing_classes=[other, None])
    fn = given.functions[0][1]
    assert fn.tokenizer is other and own.functions[0][1].tokenizer is not other
    scores = fn(prompts, completions)
    assert scores == score_texts(fn.model, other, prompts, completions)
    assert scores != own.functions[0][1](prompts, completions)  # other ids, other scores
    [only] = build_reward_functions(folder, processing_classes=other).functions  # one class for one function
    assert only[1].tokenizer is other


def test_a_processing_class_without_a_pad_token_pads_with_eos(reward_folder):
    import copy

    folder, other = reward_folder
    bare = copy.deepcopy(other)
    bare.pad_token = None
    fn = build_reward_functions([folder], processing_classes=[bare]).functions[0][1]
    assert bare.pad_token == "<|end|>" and fn.model.config.pad_token_id == bare.eos_token_id


def test_reward_processing_classes_are_checked(reward_folder):
    folder, other = reward_folder
    with pytest.raises(ValueError, match=r"reward_processing_classes: 1 processing class\(es\) for 2 reward "
                                         r"function\(s\) in reward_funcs"):
        build_reward_functions([folder, "exact_match"], key="reward_funcs", processing_classes=[other])
    with pytest.raises(ValueError, match=r"gives a tokenizer for reward_funcs\[1\] = 'exact_match', which is not a "
                                         r"reward model"):
        build_reward_functions([folder, "exact_match"], key="reward_funcs", processing_classes=[None, other])
    with pytest.raises(ValueError, match=r"reward_processing_classes\[0\] is given for reward_funcs\[0\], a "
                                         r"builtin_function_or_method rather than a reward model's folder"):
        build_reward_functions([len], key="reward_funcs", processing_classes=other)


@pytest.mark.parametrize("trainer", ["GRPO", "RLOO", "OnlineDPO"])
def test_the_online_trainers_take_reward_processing_classes(reward_folder, tmp_path, trainer):
    import stages.trainers as trainers

    folder, other = reward_folder
    group = {} if trainer == "OnlineDPO" else {"num_generations": 2}
    args = getattr(trainers, f"{trainer}Config")(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                                 per_device_train_batch_size=2, **group)
    t = getattr(trainers, f"{trainer}Trainer")(folder, reward_funcs=[folder, "exact_match"], args=args,
                                               train_dataset=[{"prompt": "1 + 1 ="}],
                                               reward_processing_classes=[other, None])
    assert t.reward_functions.functions[0][1].tokenizer is other
