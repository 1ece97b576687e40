"""Bad params.yaml / --set values: exit 2 before anything runs, every problem named by its dotted key."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.bad_inputs.conftest import assert_rejected, escape
from tests.conftest import ROOT

# (case id, --set overrides, stage, patterns the message must contain)
OVERRIDES = [
    ("unknown_section", ["sftt.learning_rate=1e-4"], "preprocess", [r"sftt: unknown key"]),
    ("unknown_nested_key", ["sft.learnin_rate=1e-4"], "sft", [r"sft\.learnin_rate: unknown key.*learning_rate"]),
    ("wrong_type_int", ["sft.max_steps=ten"], "sft", [r"sft\.max_steps = 'ten': expected an integer"]),
    ("wrong_type_bool", ["sft.packing=maybe"], "sft", [r"sft\.packing = 'maybe': expected true or false"]),
    ("wrong_type_list", ["sft.lora.target_modules=q_proj"], "sft",
     [r"sft\.lora\.target_modules = 'q_proj': expected a list"]),
    ("wrong_type_string", ["data.source=[a, b]"], "preprocess", [r"data\.source = \['a', 'b'\]: expected a string"]),
    ("out_of_range", ["sft.learning_rate=-1"], "sft", [r"sft\.learning_rate = -1: must be > 0"]),
    ("unknown_choice", ["run.device=tpu"], "preprocess", [r"run\.device = 'tpu': expected one of 'auto'"]),
    ("streaming_without_max_steps", ["sft.streaming=true", "sft.max_steps=-1"], "sft",
     [r"sft\.max_steps = -1: streaming has no length"]),
    ("dpo_on_disabled_score", ["score.enabled=false"], "policy", [r"policy\.data = score, but score\.enabled = false"]),
    ("heads_do_not_divide_width", ["model.builtin.num_heads=3"], "preprocess",
     [r"model\.builtin\.num_heads = 3: must divide hidden_size"]),
    ("reward_weights_mismatch", ["score.reward_weights=[1.0, 2.0]"], "score",
     [r"score\.reward_weights = \[1\.0, 2\.0\]: 2 weight\(s\) for 1 reward function"]),
    ("reward_function_not_a_path", ["score.reward_functions=[exact_mtch]"], "score",
     [r"score\.reward_functions\[0\] = 'exact_mtch': neither a built-in"]),
    ("reward_function_empty_attr", ["policy.grpo.reward_functions=['mymod:']"], "policy",
     [r"policy\.grpo\.reward_functions\[0\] = 'mymod:'"]),
    ("invalid_regex", ["evaluate.answer_regex=(unclosed"], "evaluate", [r"evaluate\.answer_regex = '\(unclosed'"]),
    ("cron_fields", ["run.schedule.cron=* *"], "preprocess", [r"run\.schedule\.cron = '\* \*': needs 5 fields"]),
    ("epsilon_high_below_epsilon", ["policy.grpo.epsilon_high=0.1"], "policy",
     [r"policy\.grpo\.epsilon_high = 0\.1: must be >= epsilon"]),
    ("dask_address_not_host_port", ["run.parallel_shards=2", "run.dask_address=scheduler"], "preprocess",
     [r"run\.dask_address = 'scheduler': expected \[tcp:// or tls://\]host:port"]),
    ("dask_address_without_shards", ["run.dask_address=tcp://10.0.0.5:8786"], "preprocess",
     [r"run\.dask_address = 'tcp://10\.0\.0\.5:8786' but run\.parallel_shards = 1"]),
    # promote.metric naming a column this evaluate configuration never produces: refused before any training
    ("promote_on_judge_without_judge", ["promote.metric=judge.lc_win_rate"], "preprocess",
     [r"promote\.metric = 'judge\.lc_win_rate', but evaluate\.judge is off",
      r"set evaluate\.judge\.base_url and evaluate\.judge\.model .* or evaluate\.judge\.model_path"]),
    ("promote_on_lm_eval_without_tasks", ["promote.metric=lm_eval.align_arithmetic.exact_match"], "preprocess",
     [r"promote\.metric = 'lm_eval\.align_arithmetic\.exact_match', but evaluate\.lm_eval\.tasks is empty",
      r"add align_arithmetic to evaluate\.lm_eval\.tasks"]),
    ("promote_on_lm_eval_task_not_run", ["evaluate.lm_eval.tasks=[align_arithmetic]",
                                         "promote.metric=lm_eval.gsm8k.exact_match"], "preprocess",
     [r"promote\.metric = 'lm_eval\.gsm8k\.exact_match': task 'gsm8k' is not among evaluate\.lm_eval\.tasks = "
      r"\['align_arithmetic'\]", r"add gsm8k to evaluate\.lm_eval\.tasks", r"task one of align_arithmetic\)"]),
    ("set_without_equals", ["sft.learning_rate"], "sft", [r"--set 'sft\.learning_rate': expected KEY=VALUE"]),
    ("set_into_a_value", ["sft.learning_rate.x=1"], "sft",
     [r"--set sft\.learning_rate\.x: 'learning_rate' is a value"]),
]


@pytest.mark.parametrize("case, sets, stage, patterns", OVERRIDES, ids=[c[0] for c in OVERRIDES])
def test_bad_override(capsys, params_for, case, sets, stage, patterns):
    params = params_for()
    assert_rejected(capsys, params, stage, escape(params), *patterns, sets=tuple(sets), code=2)


def test_several_problems_reported_together(capsys, params_for):
    params = params_for()
    err = assert_rejected(capsys, params, "sft", r"problem\(s\) in params", r"sft\.max_steps", r"sft\.learning_rate",
                          r"bogus: unknown key", sets=("sft.max_steps=x", "sft.learning_rate=0", "bogus=1"), code=2)
    assert "nothing was run or written" in err


# (case id, params.yaml text, patterns)
FILES = [
    ("yaml_syntax", "sft:\n  learning_rate: [1e-4\n", [r"(?s)not valid YAML.*line 2, column 18"]),
    ("top_level_list", "- sft\n- dpo\n", [r"top level must be a mapping of sections, got list"]),
    ("section_is_a_value", "sft: 3\n", [r"sft = 3: must be a mapping of keys"]),
    ("non_utf8_params", b"sft:\n  learning_rate: 1e-4 # \xff\xfe\n", [r"not valid YAML"]),
]


@pytest.mark.parametrize("case, text, patterns", FILES, ids=[c[0] for c in FILES])
def test_bad_params_file(capsys, tmp_path, case, text, patterns):
    params = tmp_path / "params.yaml"
    params.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_rejected(capsys, params, "preprocess", escape(params), *patterns, code=2)


def test_missing_params_file(capsys, tmp_path):
    assert_rejected(capsys, tmp_path / "params.yaml", "preprocess", escape(tmp_path / "params.yaml"),
                    r"file not found", code=2)


def test_bad_params_exit_code_from_a_real_process(tmp_path, params_for):
    """The same through `python -m stages` as a process: exit 2, the key on stderr, nothing written."""
    params = params_for()
    res = subprocess.run([sys.executable, "-m", "stages", "sft", "--params", str(params), "--set", "sft.max_steps=x"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "sft.max_steps = 'x': expected an integer" in res.stderr, res.stderr
    assert not (tmp_path / "artifacts").exists()


def test_promote_metric_on_a_task_yaml_is_checked_by_status(capsys, params_for, tmp_path):
    """A task YAML reports under its `task:` name, not its file name: `status` (no stage run) accepts that column
    and refuses the file name's, listing the names it knows."""
    from stages.__main__ import main

    task = tmp_path / "sums_v2.yaml"
    task.write_text("task: my_sums\ndataset_path: json\n")
    params = params_for({"evaluate": {"lm_eval": {"tasks": [str(task)]}}})
    capsys.readouterr()
    assert main(["status", "--params", str(params), "--set", "promote.metric=lm_eval.my_sums.exact_match"]) == 0
    assert_rejected(capsys, params, "status", r"promote\.metric = 'lm_eval\.sums_v2\.exact_match': task 'sums_v2'",
                    r"task one of my_sums\)", sets=("promote.metric=lm_eval.sums_v2.exact_match",), code=2)
