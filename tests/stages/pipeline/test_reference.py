"""Stage `reference`: reference log-probs of the DPO pairs, computed once, only when DPO needs them."""
from stages.data import read_jsonl
from stages.harness import runner


def test_reference_logps_cover_every_pair(built_pipeline):
    params, manifests = built_pipeline
    m = manifests["reference"]["metrics"]
    assert m["computed"] and m["source"] == "score"
    rows = read_jsonl(runner.output_dir(params, "reference") / "pairs.jsonl")
    pairs = read_jsonl(runner.output_dir(params, "score") / "pairs.jsonl")
    assert len(rows) == len(pairs) == m["pairs"] > 0
    for row, pair in zip(rows, pairs, strict=True):
        assert row["chosen"] == pair["chosen"] and row["rejected"] == pair["rejected"]
        assert row["ref_chosen_logps"] < 0 and row["ref_rejected_logps"] < 0  # summed log-probs of real tokens


def test_nothing_to_compute_for_other_methods():
    from stages.harness.config import PolicyParams
    from stages.pipeline.reference import needed

    assert needed(PolicyParams()) is None
    assert needed(PolicyParams(method="grpo")) == "policy.method = grpo"
    p = PolicyParams()
    p.dpo.precompute_ref_log_probs = False
    assert "precompute_ref_log_probs = false" in needed(p)


# bf16 noise allowed on a step-0 DPO reward (a batch mean of beta x log-prob differences): beta x 2 fp32 ulps of
# a summed log-prob in [64, 128) (ulp 7.6e-6: what the reference's batch shape alone moved one by; measured 0.0)
STEP0_TOLERANCE = 0.1 * 2 * 2 ** -17


def _first_logged_rewards(log_history: list[dict]) -> dict[str, float]:
    return {k: log_history[0][k] for k in ("rewards/margins", "rewards/chosen", "rewards/rejected")}


def test_bf16_reference_equals_the_bf16_policy_at_step_0(tmp_path, built_pipeline):
    """With policy.dpo.mixed_precision = bf16 the reference stage computes under the policy's autocast: the first
    logged DPO step (before any update: policy = reference) has rewards 0 within STEP0_TOLERANCE. The same bf16
    trainer against the fp32 reference of the built pipeline (auto = no on CPU: what this stage computed
    before it followed the policy's precision) logs rewards that are not 0."""
    import json
    import shutil

    from stages.harness.params_loader import load_params
    from stages.models import load_causal_lm, load_tokenizer
    from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer
    from tests.conftest import write_params

    params, manifests = built_pipeline
    shutil.copytree(params.run.output_dir, tmp_path / "artifacts")
    p = load_params(write_params(tmp_path, {"policy": {"dpo": {"mixed_precision": "bf16",
                                                               "gradient_checkpointing": True, "max_steps": 1}}}))
    ref = runner.run_stage("reference", p)
    assert ref["executed"] and ref["metrics"]["mixed_precision"] == "bf16"  # the precision is in its fingerprint
    m = runner.run_stage("policy", p)["metrics"]
    assert m["precision"] == {"mixed_precision": "bf16", "gradient_checkpointing": True,
                              "trained_weights_dtype": "float32"}  # fp32 master weights under autocast
    fixed = _first_logged_rewards(json.loads((tmp_path / "artifacts" / "policy" / "log_history.json").read_text()))

    sft = str(runner.output_dir(params, "sft") / "model")
    fp32_rows = read_jsonl(runner.output_dir(params, "reference") / "pairs.jsonl")
    assert manifests["reference"]["metrics"]["mixed_precision"] == "no"
    args = DPOConfig(output_dir=str(tmp_path / "unfixed"), bf16=True, use_cpu=True, max_steps=1, logging_steps=1,
                     per_device_train_batch_size=p.policy.dpo.per_device_train_batch_size, report_to="none",
                     seed=p.run.seed, data_seed=p.run.seed, save_strategy="no", disable_tqdm=True,
                     beta=p.policy.dpo.beta, max_length=p.policy.dpo.max_length)
    trainer = DPOTrainer(load_causal_lm(sft), args=args, processing_class=load_tokenizer(sft),
                         train_dataset=fp32_rows)
    trainer.train()
    unfixed = _first_logged_rewards(trainer.state.log_history)
    print(f"\nstep-0 DPO rewards, bf16 policy: bf16 reference {fixed}; fp32 reference {unfixed}")
    assert all(abs(v) <= STEP0_TOLERANCE for v in fixed.values()), fixed
    assert max(abs(v) for v in unfixed.values()) > 4 * STEP0_TOLERANCE, unfixed


def test_qlora_reference_names_its_quantization(tmp_path, monkeypatch):
    """QLoRA with precomputed reference log-probs (policy.dpo.lora.quantization = 4bit): the stage computes every
    pair and its metrics name the quantization. Only CUDA quantises, so it is faked: `quantization_config` returns a
    config (what it does on a GPU with bitsandbytes) and `load_causal_lm` loads the plain model, checking that it
    was handed that config."""
    import logging

    from stages.data import write_jsonl
    from stages.harness.params_loader import load_params
    from stages.harness.runner import StageContext
    from stages.models import load_causal_lm
    from stages.pipeline import reference
    from tests.conftest import write_params
    from tests.stages.trainers.conftest import build_tiny, builtin_rows

    params = load_params(write_params(tmp_path))
    lora = params.policy.dpo.lora
    lora.enabled, lora.quantization = True, "4bit"
    bnb_config = object()  # stands in for transformers.BitsAndBytesConfig
    asked = {}

    def quantization_config(cfg, *, device, key):
        asked["quantization"] = (cfg.quantization, key)
        return bnb_config

    def load_quantized(path, *, quantization_config=None, **kwargs):
        assert quantization_config is bnb_config
        return load_causal_lm(path, **kwargs)

    monkeypatch.setattr(reference, "quantization_config", quantization_config)
    monkeypatch.setattr(reference, "load_causal_lm", load_quantized)
    build_tiny(tmp_path / "sft" / "model")
    (tmp_path / "score").mkdir()
    pairs = builtin_rows("preference", "preference", num_preference=4)
    write_jsonl(tmp_path / "score" / "pairs.jsonl", pairs)
    (tmp_path / "out").mkdir()
    ctx = StageContext(params=params, out=tmp_path / "out",
                       inputs={"sft": tmp_path / "sft", "score": tmp_path / "score"},
                       log=logging.getLogger("stages"), work=tmp_path / "work", stage="reference")

    metrics = reference.run(ctx)
    assert asked["quantization"] == ("4bit", "policy.dpo.lora.quantization")
    assert metrics["computed"] and metrics["pairs"] == len(pairs) == 4
    assert metrics["quantization"] == "4bit"
    assert len(read_jsonl(tmp_path / "out" / "pairs.jsonl")) == 4
