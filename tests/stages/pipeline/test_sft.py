"""Stage `sft` for real: LoRA adapters, crash-resume from the last checkpoint, TensorBoard logs, bad input."""
import json

import pytest

from stages.harness import runner
from stages.harness.params_loader import load_params
from tests.conftest import write_params


def _params(tmp_path, **sft):
    params = load_params(write_params(tmp_path, {"sft": sft}))
    runner.run_stage("preprocess", params)
    return params


def test_lora_adapter_loads_with_peft_and_evaluates(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    params = _params(tmp_path, lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    m = runner.run_stage("sft", params)
    model_dir = runner.output_dir(params, "sft") / "model"
    assert (model_dir / "adapter_config.json").exists() and not (model_dir / "model.safetensors").exists()
    assert m["metrics"]["adapter"] and m["metrics"]["trainable_parameters"] < 0.1 * m["metrics"]["total_parameters"]
    base = AutoModelForCausalLM.from_pretrained(json.loads((model_dir / "adapter_config.json").read_text())[
        "base_model_name_or_path"])
    assert isinstance(PeftModel.from_pretrained(base, model_dir), PeftModel)
    for stage in ("reward", "score", "reference", "policy", "merge"):  # each starts from the SFT adapter merged in
        runner.run_stage(stage, params)
    assert runner.run_stage("evaluate", params)["metrics"]["n"] == 20  # evaluate loads the adapter onto its base


def test_unknown_lora_target_is_a_clear_error(tmp_path):
    """The stage's own check, behind the params check (tests/bad_inputs/test_sharded_inputs.py)."""
    params = _params(tmp_path, lora={"enabled": True})
    params.sft.lora.target_modules = ["query"]
    with pytest.raises(ValueError, match=r"\['query'\] not in the model; the layers LoRA can adapt are .*q_proj"):
        runner.run_stage("sft", params)
    assert not runner.output_dir(params, "sft").exists()


def test_qlora_on_cpu_is_a_clear_error(tmp_path):
    params = _params(tmp_path, lora={"enabled": True, "quantization": "4bit"})
    with pytest.raises(ValueError, match="QLoRA needs a CUDA GPU"):
        runner.run_stage("sft", params)


def test_max_length_shorter_than_prompt(tmp_path):
    params = _params(tmp_path, max_length=5)
    with pytest.raises(ValueError, match=r"sft.max_length = 5 is shorter than the prompt of \d+ row"):
        runner.run_stage("sft", params)


def test_crash_resumes_from_last_checkpoint(tmp_path, monkeypatch):
    import stages.pipeline.training as training

    params = _params(tmp_path, max_steps=6, save_steps=2)

    class Crash(training.LogToLogger):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                raise KeyboardInterrupt("simulated kill at step 5")

    monkeypatch.setattr(training, "LogToLogger", Crash)
    with pytest.raises(KeyboardInterrupt):
        runner.run_stage("sft", params)
    assert not runner.output_dir(params, "sft").exists()  # nothing that looks complete
    work = list((tmp_path / "artifacts" / ".work").glob("sft-*"))
    assert [p.name for p in sorted((work[0] / "checkpoints").iterdir())] == ["checkpoint-2", "checkpoint-4"]
    saved = {p.name for p in (work[0] / "checkpoints" / "checkpoint-4").iterdir()}
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "tokenizer.json", "chat_template.jinja"} <= saved

    monkeypatch.undo()
    m = runner.run_stage("sft", params)["metrics"]
    assert m["resumed_from"].endswith("checkpoint-4") and m["steps"] == 6
    assert not work[0].exists()  # the work folder goes once the output is sealed
    assert list((runner.output_dir(params, "sft") / "tensorboard").glob("events.out.tfevents.*"))
