"""The `align` flow end to end on the embedded default (small settings), on a real Prefect server."""
import pytest

from stages.harness.params_loader import ParamsError
from tests.conftest import STAGE_ORDER, write_params

pytestmark = pytest.mark.slow


def run(params_file, overrides=None, promote=False):
    from flows.align import align

    state = align(params_file=str(params_file), overrides=overrides, promote=promote, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    return {s["stage"]: s["status"] for s in summary["stages"]}, summary


def test_second_run_is_all_cached_and_changes_rerun_downstream(tmp_path, prefect_server):
    params = write_params(tmp_path, {"promote": {"models_dir": str(tmp_path / "models")}})
    first, summary = run(params, promote=True)  # as the nightly deployment runs it
    everything = dict.fromkeys(STAGE_ORDER, "executed")
    assert first == {**everything, "promote": "executed"}  # stage promote, after the pipeline
    assert [r["model"] for r in summary["evaluation"]] == ["base", "sft", "policy", "merged"]
    assert summary["promotion"]["event"] == "promoted" and (tmp_path / "models" / "production").is_dir()
    history = (tmp_path / "models" / "history.jsonl").read_text()

    def only(*executed):
        return {s: "executed" if s in executed else "cached" for s in STAGE_ORDER}

    columns = [list(row) for row in summary["evaluation"]]
    again, summary = run(params, promote=True)  # an unchanged nightly run: all cached, nothing judged again
    assert again == {**only(), "promote": "cached"} and summary["promotion"]["event"] == "promoted"
    assert summary["promotion"]["cached"]  # the first run's decision, not a new one
    assert (tmp_path / "models" / "history.jsonl").read_text() == history
    assert [s["stage"] for s in summary["stages"]] == [*STAGE_ORDER, "promote"]  # the pipeline's order, as built
    assert {s["wall_time_s"] for s in summary["stages"]} == {0.0}  # cached: nothing built in this run
    assert [list(row) for row in summary["evaluation"]] == columns  # the same columns in the same order
    assert run(params, ["evaluate.max_new_tokens=5"])[0] == only("evaluate")
    # beta is not an input of the reference log-probs: stage `reference` stays cached
    assert run(params, ["evaluate.max_new_tokens=5", "policy.dpo.beta=0.2"])[0] == only("policy", "merge",
                                                                                          "evaluate")
    assert run(params, ["evaluate.max_new_tokens=5", "policy.dpo.beta=0.2", "score.n=2"])[0] == only(
        "score", "reference", "policy", "merge", "evaluate")
    assert run(params, ["evaluate.max_new_tokens=5", "policy.dpo.beta=0.2", "sft.learning_rate=0.004"])[0] == only(
        *STAGE_ORDER[1:])
    assert run(params, ["evaluate.max_new_tokens=5", "policy.dpo.beta=0.2", "data.builtin.seed=3"])[0] == everything


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_output_is_rebuilt_not_cached(tmp_path, prefect_server, damage, caplog):
    params = write_params(tmp_path)
    run(params)
    weights = tmp_path / "artifacts" / "sft" / "model" / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        weights.unlink()
    statuses, _ = run(params)
    assert statuses["preprocess"] == "cached" and statuses["sft"] == "executed"
    assert weights.stat().st_size > 1000
    assert "rebuilding" in caplog.text and "model/model.safetensors" in caplog.text


def test_bad_params_fail_before_any_stage(tmp_path, prefect_server):
    from flows.align import align

    params = write_params(tmp_path, {"sft": {"learning_rate": -1}})
    state = align(params_file=str(params), return_state=True)
    assert state.is_failed()
    with pytest.raises(ParamsError, match="sft.learning_rate = -1: must be > 0"):
        state.result()
    assert not (tmp_path / "artifacts").exists()
