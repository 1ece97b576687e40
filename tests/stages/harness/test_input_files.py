"""The user's files a stage reads are part of its fingerprint: editing one in place makes the stage stale."""
from __future__ import annotations

import json

from stages.harness import runner
from stages.harness.params_loader import load_params
from tests.conftest import write_params


def _rows(n: int) -> str:
    return "".join(json.dumps({"prompt": f"What is {i}+1?", "completion": f"{i + 1}"}) + "\n" for i in range(n))


def test_editing_a_data_file_in_place_makes_preprocess_stale(tmp_path):
    data = tmp_path / "s.jsonl"
    data.write_text(_rows(40))
    path = write_params(tmp_path, {"data": {"source": None, "sft": str(data)},
                                   "score": {"reward_functions": ["exact_match"], "reward_weights": None}})
    params = load_params(path)
    built = runner.run_stage("preprocess", params)
    assert built["executed"] and built["files"]["file:data.sft"]
    assert not runner.run_stage("preprocess", params)["executed"]  # unchanged: current

    data.write_text(_rows(20))  # same path, other rows
    state = runner.inspect("preprocess", params)
    assert not state.current and state.fingerprint != built["fingerprint"]
    rebuilt = runner.run_stage("preprocess", params)
    assert rebuilt["executed"] and rebuilt["files"]["file:data.sft"] != built["files"]["file:data.sft"]


def test_builtin_and_hub_names_hash_as_their_value_only(tmp_path):
    params = load_params(write_params(tmp_path))
    assert runner.input_hashes(runner.get_stage("preprocess"), params) == {}  # builtin:tiny, builtin:arithmetic


def test_a_chat_template_file_is_hashed_by_content_for_the_stages_that_read_it(tmp_path):
    """sft.chat_template_path is read by preprocess (its tool-rendering probe) and sft: editing the file in place
    changes both stages' fingerprints; a stage that does not read it keeps its own."""
    from stages.builtin.chat_templates import TINY_TOOLS

    template = tmp_path / "chat.jinja"
    template.write_text(TINY_TOOLS.read_text())
    params = load_params(write_params(tmp_path, {"sft": {"chat_template_path": str(template)}}))
    before = {name: runner.input_hashes(runner.get_stage(name), params) for name in ("preprocess", "sft", "reward")}
    assert before["preprocess"]["file:sft.chat_template_path"] == before["sft"]["file:sft.chat_template_path"]
    assert "file:sft.chat_template_path" not in before["reward"]
    template.write_text(TINY_TOOLS.read_text().replace("tools:", "functions:"))
    after = {name: runner.input_hashes(runner.get_stage(name), params) for name in ("preprocess", "sft", "reward")}
    assert after["sft"] != before["sft"] and after["preprocess"] != before["preprocess"]
    assert after["reward"] == before["reward"]
