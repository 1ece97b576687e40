"""GRPOTrainer's TRL 1.16 fields beyond the basic loss, on the built-in model: steps_per_generation /
generation_batch_size, GSPO's sequence-level ratio, the entropy bonus (static and adaptive), evaluation on
eval_dataset, log_completions, normalize_then_sum, and use_vllm's server fields."""
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from stages.losses import normalized_sum_advantages
from stages.trainers.grpo_trainer import GRPOConfig, GRPOTrainer
from stages.trainers.online_generation import wait_for_server
from tests.stages.trainers.conftest import build_tiny, builtin_rows
from tests.stages.trainers.test_grpo_trainer import _args, _changed, _model, low_ids

G = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"), num_heads=4)
    prompts = builtin_rows("prompts", "prompt_only", num_train=4, num_eval=4)
    return path, AutoTokenizer.from_pretrained(path), prompts


def _train(setup, tmp_path, reward=low_ids, **kw):
    path, tok, prompts = setup
    model = _model(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, reward, processing_class=tok, train_dataset=prompts, args=_args(tmp_path, **kw))
    return trainer, model, before


def test_steps_per_generation_feeds_several_optimizer_steps(setup, tmp_path):
    """steps_per_generation = 2 with no accumulation (TRL's names): one generation of 2 micro-batches (4 prompts)
    feeds 2 optimizer steps, so 4 steps generate twice. The second step trains on samples of the policy before
    the first update: they carry old_logps, and with a large learning rate the ratio leaves 1 (clipped tokens)."""
    trainer, model, before = _train(setup, tmp_path, steps_per_generation=2, epsilon=0.05)
    seen = []
    make = trainer.make_batch
    trainer.make_batch = lambda rows: seen.append([r["prompt"] for r in rows]) or make(rows)
    trainer.train()
    assert [len(s) for s in seen] == [4, 4] and len({str(p) for p in seen[0]}) == 4
    assert sorted(trainer._buffer) == [0, 1] and all("old_logps" in b for b in trainer._buffer.values())
    assert trainer._buffer[0]["advantages"].shape == (2 * G,)  # each slot: per_device_train_batch_size completions
    logs = [h for h in trainer.state.log_history if "clip_ratio/region_mean" in h]
    assert len(logs) == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert logs[0]["clip_ratio/region_mean"] == 0.0 and logs[1]["clip_ratio/region_mean"] > 0.0
    assert "reward" in logs[0] and "reward" not in logs[1] and "reward" in logs[2]  # generating steps only
    assert _changed(model, before) == set(before)


def test_generation_batch_size_is_the_same_setting(tmp_path):
    """generation_batch_size counts completions of one generation over all processes: 4G over batches of 2G is
    steps_per_generation 2; by default one generation per optimizer step (gradient_accumulation_steps)."""
    assert _args(tmp_path, generation_batch_size=4 * G).resolved_steps_per_generation == 2
    assert _args(tmp_path, gradient_accumulation_steps=3).resolved_steps_per_generation == 3
    with pytest.raises(ValueError, match="generation_batch_size = 16 and steps_per_generation = 2: set one"):
        _args(tmp_path, generation_batch_size=16, steps_per_generation=2)
    with pytest.raises(ValueError, match="generation_batch_size = 12: must be a multiple of "
                                         "per_device_train_batch_size x processes = 8"):
        _args(tmp_path, generation_batch_size=12)


@pytest.mark.parametrize("extra", [{"importance_sampling_level": "sequence"},
                                   {"importance_sampling_level": "sequence", "loss_type": "sapo",
                                    "top_entropy_quantile": 0.5},
                                   {"loss_type": "vespo", "off_policy_mask_threshold": 1e-3}])
def test_variants_train(setup, tmp_path, extra):
    """GSPO (and two other variants) through the Python API with TRL's names, reusing each generation twice
    (num_iterations 2) so the ratios leave 1: finite losses, every weight moves."""
    trainer, model, before = _train(setup, tmp_path, num_iterations=2, **extra)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert _changed(model, before) == set(before)
    if "off_policy_mask_threshold" in extra:  # a tiny threshold: any drift drops the negative-advantage completions
        kept = [h["off_policy_mask/kept"] for h in trainer.state.log_history if "off_policy_mask/kept" in h]
        assert kept[0] == 1.0 and min(kept) < 1.0


def test_entropy_bonus_changes_the_gradient(setup, tmp_path):
    """entropy_coef adds -coef·mean entropy: the same first step (same samples) with coef 0.5 differs from 0."""
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    grads = []
    for coef in (0.0, 0.5):
        trainer, model, _ = _train(setup, tmp_path / str(coef), max_steps=1, entropy_coef=coef, learning_rate=0.0)
        grab = Grab()
        trainer.add_callback(grab)
        trainer.train()
        grads.append(grab.grads)
    diff = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    assert diff > 1e-6


def test_adaptive_entropy_moves_the_coefficient(setup, tmp_path):
    """Target far above any entropy: every step's entropy is below it, so entropy_coef rises by delta per step
    (0.1 -> 0.15 -> 0.2 -> ...). The bonus applied at a step uses the coefficient after the previous step and
    only once a previous step was at or below the target: 0 at step 1, then 0.15, 0.2, 0.25."""
    trainer, _, _ = _train(setup, tmp_path, use_adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.05,
                           entropy_target=1e6)
    trainer.train()
    applied = [h["entropy_coef"] for h in trainer.state.log_history if "entropy_coef" in h]
    assert applied == pytest.approx([0.0, 0.15, 0.2, 0.25])
    assert trainer.entropy_coef == pytest.approx(0.3)


def test_eval_dataset_logs_held_out_reward_curves(setup, tmp_path):
    """eval_dataset with eval_steps 2 and num_generations_eval 2: eval_reward (and each function's mean) is
    logged at steps 2 and 4 on its own lines; evaluation samples a fixed draw, so two evaluations of the same
    weights agree exactly, and it leaves the training RNG and metrics alone."""
    path, tok, prompts = setup
    held_out = builtin_rows("prompts", "prompt_only", num_train=4, num_eval=4)[:3]
    trainer = GRPOTrainer(_model(path), [("low_ids", low_ids), "exact_match"], processing_class=tok,
                          train_dataset=prompts, eval_dataset=held_out,
                          args=_args(tmp_path, eval_strategy="steps", eval_steps=2, num_generations_eval=2,
                                     per_device_eval_batch_size=4))
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [2, 4]
    for key in ("eval_rewards/low_ids/mean", "eval_rewards/exact_match/mean", "eval_loss",
                "eval_completions/mean_length"):
        assert all(key in h for h in evals), key
    assert all("loss" not in h for h in evals) and all("eval_reward" not in h for h in trainer.state.log_history
                                                        if "loss" in h)
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first["eval_reward"] == second["eval_reward"] and 0 <= first["eval_reward"] <= 1


def test_log_completions_prints_and_writes_the_table_to_tensorboard(setup, tmp_path, caplog):
    """log_completions with num_completions_to_print 3: the log shows a header and 3 rows; the TensorBoard run
    holds a "completions" text summary per logged step; the table has one row per completion of the generation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    trainer, _, _ = _train(setup, tmp_path, max_steps=2, log_completions=True, num_completions_to_print=3)
    trainer.add_callback(TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(tmp_path / "tb"))))
    with caplog.at_level(logging.INFO, logger="stages.trainers.completions_log"):
        trainer.train()
    tables = [r.getMessage() for r in caplog.records if r.getMessage().startswith("completions at step")]
    assert len(tables) == 2
    lines = tables[0].splitlines()
    assert lines[1].split(" | ")[:3] == ["| step", "prompt", "completion"] and len(lines) == 1 + 2 + 3  # title, header
    assert "advantage |" in lines[1] and "low_ids" in lines[1]
    last = trainer.completions_log.last
    assert len(last) == 2 * G and {"prompt", "completion", "low_ids", "advantage"} <= set(last[0])
    assert sum(r["advantage"] for r in last) == pytest.approx(0.0, abs=1e-4)  # group-centred
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in events.Tensors("completions/text_summary")] == [1, 2]


def test_normalize_then_sum_hand_computed():
    """Two prompts, G = 2, functions f0 (weight 1) and f1 (weight 2). Within groups: f0 [0, 1] -> ±0.5/(√0.5 + ε),
    [5, 5] -> 0; f1 [10, 30] -> ±10/(√200 + ε), [0, 2] -> ±1/(√2 + ε) (ε = 1e-4, unbiased std). Sums
    s = [-a - 2b, a + 2b, -2c, 2c] have mean 0; advantages s / (std(s) + ε). A row with f1 unscored (NaN) counts
    0 for f1 and f1's group statistics skip it."""
    eps = 1e-4
    a, b, c = 0.5 / (0.5 ** 0.5 + eps), 10 / (200 ** 0.5 + eps), 1 / (2 ** 0.5 + eps)
    s = torch.tensor([-a - 2 * b, a + 2 * b, -2 * c, 2 * c], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 10.0], [1.0, 30.0], [5.0, 0.0], [5.0, 2.0]], dtype=torch.float64)
    got = normalized_sum_advantages(rewards, torch.tensor([1.0, 2.0], dtype=torch.float64), 2)
    assert torch.allclose(got, s / (s.std() + eps), atol=1e-12)
    rewards[3, 1] = float("nan")  # group 1's f1 has one score left: z = 0 for both rows
    s = torch.tensor([-a - 2 * b, a + 2 * b, 0.0, 0.0], dtype=torch.float64)
    got = normalized_sum_advantages(rewards, torch.tensor([1.0, 2.0], dtype=torch.float64), 2)
    assert torch.allclose(got, (s - s.mean()) / (s.std() + eps), atol=1e-12)


def test_normalize_then_sum_in_the_trainer(setup, tmp_path):
    path, tok, prompts = setup

    def long_ids(prompts, completions, completion_ids, **_):
        return [100.0 * len(ids) for ids in completion_ids]

    trainer = GRPOTrainer(_model(path), [("low_ids", low_ids), ("long_ids", long_ids)], processing_class=tok,
                          train_dataset=prompts, args=_args(tmp_path, multi_objective_aggregation="normalize_then_sum",
                                                            reward_weights=[1.0, 0.5]))
    batch = trainer.make_batch(prompts[:2])
    lengths = batch["completion_mask"].sum(1).double()
    completion_ids = [batch["input_ids"][i, -batch["completion_mask"].shape[1]:][:int(n)].tolist()
                      for i, n in enumerate(lengths)]
    table = torch.tensor([low_ids(None, None, completion_ids), [100.0 * n for n in lengths.tolist()]]).T
    expected = normalized_sum_advantages(table, torch.tensor([1.0, 0.5]), G)
    assert torch.allclose(batch["advantages"], expected.float(), atol=1e-5)


def test_use_vllm_maps_trl_server_fields_onto_the_vllm_backend(tmp_path):
    args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.5", vllm_server_port=8123)
    assert args.sampling.backend == "vllm" and args.sampling.vllm_url == "http://10.0.0.5:8123/v1"
    args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://h:9/v1")
    assert args.sampling.vllm_url == "http://h:9/v1"
    assert _args(tmp_path).sampling.backend == "auto"
    with pytest.raises(ValueError, match="vllm_mode = 'colocate': TRL's colocated vLLM engine .* is not built; set "
                                         "vllm_mode: server"):
        _args(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match="use_vllm = True but generation_backend = 'hf'"):
        _args(tmp_path, use_vllm=True, vllm_mode="server", generation_backend="hf")
    with pytest.raises(TypeError, match="GRPOConfig.vllm_gpu_memory_utilization: TRL 1.16's"):
        GRPOConfig(output_dir=str(tmp_path), vllm_gpu_memory_utilization=0.5)


def test_wait_for_server_waits_for_a_real_server_then_fails_by_name():
    """A real HTTP server answering /v1/models passes at once; a closed port fails after the timeout, naming the
    URL and vllm_server_timeout."""
    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_for_server(f"http://127.0.0.1:{server.server_port}/v1", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ConnectionError, match=r"no vLLM server answered at http://127.0.0.1:\d+/v1 within "
                                              r"vllm_server_timeout = 0.2 s"):
        wait_for_server(f"http://127.0.0.1:{server.server_port}/v1", timeout=0.2, poll=0.1)


@pytest.mark.parametrize("mode, correction, moves", [("sequence_mask", True, False), ("sequence_mask", False, True),
                                                     ("token_truncate", True, True)])
def test_importance_sampling_mode_drops_sequences_outside_the_bounds(setup, tmp_path, mode, correction, moves):
    """The hf sampler reports its own log-probs, so π/μ = 1 (to float rounding). clip_max 0.5 below every ratio:
    sequence_mask drops every sequence (zero loss, no update, beta 0); with the correction off, or truncating
    instead (weights 0.5), the weights still move."""
    trainer, model, before = _train(setup, tmp_path, max_steps=1, vllm_importance_sampling_mode=mode,
                                    vllm_importance_sampling_correction=correction,
                                    vllm_importance_sampling_clip_max=0.5)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "tis/frac_capped" in h)
    assert log["tis/frac_capped"] == 1.0  # every ratio lies above 0.5, corrected or not
    assert bool(_changed(model, before)) == moves
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min = 3.0: must be below the upper bound 2.0"):
        _args(tmp_path, vllm_importance_sampling_clip_min=3.0)


def test_disable_dropout_turns_off_attention_dropout(setup, tmp_path):
    """The built-in Llama with attention dropout 0.5: two train-mode forwards differ; disable_dropout makes them
    equal (HF's Llama reads its attention modules' `attention_dropout`, not an nn.Dropout)."""
    path, tok, prompts = setup
    model = _model(path)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)
    GRPOTrainer(model, low_ids, processing_class=tok, train_dataset=prompts,
                args=_args(tmp_path, disable_dropout=True))
    model.train()
    assert torch.equal(model(ids).logits, model(ids).logits)


def test_shuffle_dataset_false_keeps_the_rows_order(setup, tmp_path):
    trainer, _, _ = _train(setup, tmp_path, max_steps=2, shuffle_dataset=False)
    seen = []
    make = trainer.make_batch
    trainer.make_batch = lambda rows: seen.append([r["prompt"] for r in rows]) or make(rows)
    trainer.train()
    assert seen == [[r["prompt"] for r in setup[2][i:i + 2]] for i in (0, 2)]


def test_sync_ref_model_mixes_the_policy_into_the_reference(setup, tmp_path):
    """TR-DPO with alpha 0.5 every 2 steps, 2 steps: the reference ends as 0.5 x final policy + 0.5 x start."""
    trainer, model, before = _train(setup, tmp_path, max_steps=2, beta=0.1, sync_ref_model=True,
                                    ref_model_mixup_alpha=0.5, ref_model_sync_steps=2)
    trainer.train()
    assert _changed(model, before) == set(before)
    for name, ref in trainer.ref_model.named_parameters():
        expected = 0.5 * dict(model.named_parameters())[name].detach() + 0.5 * before[name]
        assert torch.allclose(ref, expected, atol=1e-6), name
    with pytest.raises(ValueError, match="sync_ref_model = True but beta = 0: there is no reference to move"):
        _args(tmp_path, sync_ref_model=True)


def _tiny_mixtral(tok, coef):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                           router_aux_loss_coef=coef, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id, bos_token_id=None)
    return MixtralForCausalLM(config)


@pytest.mark.parametrize("coef, expected", [(None, 0.02), (0.5, 0.5), (0.0, 0.0)])
def test_router_aux_loss_of_a_mixture_of_experts(setup, tmp_path, coef, expected):
    """A tiny Mixtral (4 experts, top 2, its config's coefficient 0.02): router_aux_loss_coef null takes the
    config's, a number overrides it; the load-balancing loss is logged and reaches the router's gradient."""
    from transformers import TrainerCallback

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            self.grad = next(p.grad.clone() for n, p in model.named_parameters() if n.endswith("gate.weight"))

    path, tok, prompts = setup
    runs = {}
    for c in (coef, 0.0):
        grab = Grab()
        trainer = GRPOTrainer(_tiny_mixtral(tok, 0.02), low_ids, processing_class=tok, train_dataset=prompts,
                              callbacks=[grab], args=_args(tmp_path / str(c), max_steps=1, router_aux_loss_coef=c))
        trainer.train()
        runs[c] = (trainer, grab.grad)
    trainer = runs[coef][0]
    assert trainer.router_aux_loss_coef == expected
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    assert ("aux_loss" in logged) == (expected > 0) and logged.get("aux_loss", 1.0) > 0
    assert torch.equal(runs[coef][1], runs[0.0][1]) == (expected == 0)  # same samples: only the aux term differs


def test_router_aux_loss_coef_on_a_dense_model_is_refused(setup, tmp_path):
    path, tok, prompts = setup
    with pytest.raises(ValueError, match="router_aux_loss_coef = 0.1, but LlamaForCausalLM is not a "
                                         "Mixture-of-Experts model"):
        GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=prompts,
                    args=_args(tmp_path, router_aux_loss_coef=0.1))


def test_cast_lm_head_to_fp32_computes_the_head_in_float32(setup, tmp_path):
    """A bfloat16 policy: with cast_lm_head_to_fp32 its head weight is float32 and both log-prob paths (chunked
    kernel and full logits) equal log_softmax(float32(hidden) @ float32(W)) to 1e-5; the bfloat16 head differs
    from that by bfloat16 rounding (> 1e-4 on this tiny model)."""
    from stages.trainers.rollout import completion_logps, pad_rollout

    path, tok, prompts = setup
    batch = pad_rollout([[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15]], pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id)

    def reference(model):
        with torch.no_grad():
            ids = batch["input_ids"]
            pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            hidden = model.model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=pos)[0]
            logits = hidden.float() @ model.lm_head.weight.float().T
            logps = logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            return logps[:, -4:] * batch["completion_mask"]

    plain = _model(path).to(torch.bfloat16)
    with torch.no_grad():
        assert (completion_logps(plain, batch, chunked=True)["logps"] - reference(plain)).abs().max() > 1e-4
    model = _model(path).to(torch.bfloat16)
    GRPOTrainer(model, low_ids, processing_class=tok, train_dataset=prompts,
                args=_args(tmp_path, cast_lm_head_to_fp32=True))
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        for chunked in (True, False):
            got = completion_logps(model, batch, chunked=chunked)["logps"]
            assert torch.allclose(got, reference(model), atol=1e-5), chunked


def test_resume_inside_a_generation_reuses_its_rollouts(setup, tmp_path):
    """steps_per_generation 2, checkpoint after step 1: step 2 trains on the second half of step 1's generation
    (restored from the checkpoint, not sampled again), so the resumed run ends exactly as the uninterrupted one."""
    path, tok, prompts = setup

    def trainer(folder):
        return GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=prompts,
                           args=_args(folder, steps_per_generation=2, save_strategy="steps", save_steps=1,
                                      learning_rate=5e-3))

    clean = trainer(tmp_path / "clean")
    clean.train()
    resumed = trainer(tmp_path / "resumed")
    seen = []
    make = resumed.make_batch
    resumed.make_batch = lambda rows: seen.append(rows) or make(rows)
    resumed.train(resume_from_checkpoint=str(tmp_path / "clean" / "checkpoint-1"))
    assert len(seen) == 1  # step 2 reused the checkpoint's rollouts; step 3 generated
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h and h["step"] > 1] for t in (clean, resumed)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-9)
    for (name, p), q in zip(clean.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name


def test_chat_template_kwargs_reach_the_rendered_prompts(setup, tmp_path):
    """A template that reads `enable_thinking`: with chat_template_kwargs {enable_thinking: false} the prompts the
    policy samples from carry its marker; without them they do not. Plain-text prompts pass unchanged."""
    from transformers import AutoTokenizer

    from stages.trainers.grpo_trainer import render_prompts

    path, _, prompts = setup
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = tok.chat_template + "{% if enable_thinking is defined and not enable_thinking %}nothink" \
                                            "{% endif %}"
    assert render_prompts(tok, ["2+2="], {"enable_thinking": False}) == ["2+2="]
    for kwargs, marked in ((None, False), ({"enable_thinking": False}, True)):
        trainer = GRPOTrainer(_model(path), low_ids, processing_class=tok, train_dataset=prompts,
                              args=_args(tmp_path, chat_template_kwargs=kwargs))
        batch = trainer.make_batch(prompts[:2])
        width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
        rendered = tok.decode(batch["input_ids"][0, :width][batch["attention_mask"][0, :width].bool()])
        assert rendered.endswith("nothink") == marked, rendered


@pytest.mark.slow  # MLflow's sqlite store takes about 12 s to set up
def test_log_completions_writes_an_mlflow_table(setup, tmp_path, monkeypatch):
    """With MLflow's callback active, each training log line stores the table as the run artifact
    completions/step_<N>.json (mlflow.log_table): one row per completion, the reward function as a column."""
    from transformers.integrations import MLflowCallback

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    trainer, _, _ = _train(setup, tmp_path / "out", max_steps=2, log_completions=True)
    trainer.add_callback(MLflowCallback())
    trainer.train()
    files = sorted(tmp_path.glob("mlruns/*/*/artifacts/completions/step_*.json"))
    assert [f.name for f in files] == ["step_1.json", "step_2.json"]
    table = json.loads(files[0].read_text())
    assert {"prompt", "completion", "low_ids", "advantage"} <= set(table["columns"]) and len(table["data"]) == 2 * G


def test_use_transformers_continuous_batching_samples_with_the_engine(setup, tmp_path):
    """TRL's switch (and its deprecated name use_transformers_paged) selects the generation backend
    continuous_batching with the engine's settings; a step samples there, and greedy decoding gives plain
    generate's completions. Contradicting settings are refused."""
    path, tok, prompts = setup
    engine = {"page_size": 16}
    args = _args(tmp_path, use_transformers_continuous_batching=True, transformers_continuous_batching_config=engine)
    assert (args.sampling.backend, args.sampling.continuous_batching_config) == ("continuous_batching", engine)
    with pytest.warns(FutureWarning, match="use_transformers_continuous_batching"):
        assert _args(tmp_path, use_transformers_paged=True).sampling.backend == "continuous_batching"
    backends = []
    import stages.trainers.grpo_trainer as grpo

    sample = grpo.sample_online
    trainer, _, _ = _train(setup, tmp_path, max_steps=1, use_transformers_continuous_batching=True,
                           transformers_continuous_batching_config=engine, top_k=1)
    try:
        grpo.sample_online = lambda *a, **kw: backends.append(sample(*a, **kw)) or backends[-1]
        trainer.train()
    finally:
        grpo.sample_online = sample
    assert [g.backend for g in backends] == ["continuous_batching"]
    [log] = [h for h in trainer.state.log_history if "reward" in h]
    assert log["frac_reward_zero_std"] == 1.0  # top_k 1: each group's completions are one greedy completion
    from stages.generation import SamplingParams, generate

    # top_k 1 is greedy: the step's samples (of the untrained model) are plain generate's tokens, G per prompt
    got = backends[0]
    greedy = generate(_model(path), tok, got.prompts, SamplingParams(max_new_tokens=12), backend="hf")
    assert got.completion_ids == [greedy.completion_ids[p] for p in got.prompt_index] and len(got) == 2 * G
    with pytest.raises(ValueError, match="use_transformers_continuous_batching = True but generation_backend = 'hf'"):
        _args(tmp_path, use_transformers_continuous_batching=True, generation_backend="hf")
    with pytest.raises(ValueError, match="transformers_continuous_batching_config is set but nothing samples"):
        _args(tmp_path, transformers_continuous_batching_config=engine)
