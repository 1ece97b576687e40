"""SFTTrainer on the built-in model and task: the loss falls, every weight moves, prompts are masked."""
import pytest
import torch

from stages.trainers.sft_trainer import SFTConfig, SFTTrainer
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=2, num_heads=4,
                      intermediate_size=128)
    rows = builtin_rows("sft", "messages", num_train=512, num_preference=10)
    return path, rows


def _trainer(setup, tmp_path, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, rows = setup
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    kw = {"max_steps": 40, "per_device_train_batch_size": 32, "logging_steps": 5, **kw}
    args = SFTConfig(output_dir=str(tmp_path), learning_rate=3e-3, report_to="none", use_cpu=True,
                     save_strategy="no", disable_tqdm=True, seed=0, **kw)
    return SFTTrainer(model, args, processing_class=tok, train_dataset=rows), tok


def test_loss_falls_and_every_parameter_changes(setup, tmp_path):
    trainer, _ = _trainer(setup, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.5 * losses[0], losses
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged
    logged = trainer.state.log_history[0]
    assert 0 <= logged["mean_token_accuracy"] <= 1 and logged["num_tokens"] > 0


def test_completion_tokens_are_the_assistant_answer(setup, tmp_path):
    trainer, tok = _trainer(setup, tmp_path)
    row = trainer.train_dataset[0]
    completion = [i for i, m in zip(row["input_ids"], row["completion_mask"], strict=True) if m]
    answer = setup[1][0]["completion"][0]["content"]
    assert tok.decode(completion) == answer + "<|end|>"


@pytest.mark.parametrize("completion_only, expected", [(True, "4<|end|>"), (False, "2<|end|>4<|end|>")])
def test_assistant_only_loss_trains_the_assistant_turns(setup, tmp_path, completion_only, expected):
    """As in TRL: assistant_masks mark every assistant turn; with completion_only_loss (the default) the collator
    also masks the prompt, so a prompt/completion row trains its completion's assistant turns only."""
    turns = [{"prompt": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
                         {"role": "user", "content": "2+2"}], "completion": [{"role": "assistant", "content": "4"}]}]
    trainer, tok = _trainer(setup, tmp_path, assistant_only_loss=True, completion_only_loss=completion_only)
    row = trainer._prepare(turns, tok, trainer.args, False)[0]
    assert tok.decode([i for i, m in zip(row["input_ids"], row["assistant_masks"], strict=True) if m]) \
        == "2<|end|>4<|end|>"
    labels = trainer.data_collator([row])["labels"][0]
    assert tok.decode(labels[labels != -100]) == expected


def test_packing_trains_and_uses_fewer_rows(setup, tmp_path):
    trainer, _ = _trainer(setup, tmp_path, packing=True, max_length=128)
    assert len(trainer.train_dataset) < len(setup[1]) / 3  # ~30-token rows, 128-token packs
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[0] == 2 and "attention_mask" not in batch  # packed rows, no 2D mask
    assert (batch["position_ids"] == 0).sum() > 2  # positions restart per packed sequence
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


def test_streaming_rows_are_tokenised_lazily(setup, tmp_path):
    import datasets

    path, rows = setup
    streamed = datasets.IterableDataset.from_generator(lambda: iter(rows))
    trainer, _ = _trainer((path, streamed), tmp_path)
    first = next(iter(trainer.train_dataset))
    assert set(first) == {"input_ids", "completion_mask"} and sum(first["completion_mask"]) > 0
    trainer.train()
    assert trainer.state.global_step == 40


def test_config_warms_up_like_the_pipeline(tmp_path):
    """SFTConfig warms up over the pipeline's share of the steps (sft.warmup_steps), not TrainingArguments' 0:
    without it, AdamW at lr 2e-3 leaves the tiny model on the loss plateau (docs/decisions.md). An explicit
    warmup_steps=0 is still honoured."""
    from stages.harness.config import Params

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.warmup_steps == Params().sft.warmup_steps > 0
    assert args.get_warmup_steps(752) == 38  # ceil(0.05 * 752): the schedule ramps over the first 38 steps
    off = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", warmup_steps=0)
    assert off.get_warmup_steps(752) == 0


def _messages_rows(rows):
    """The built-in rows as TRL's conversational language-modelling rows (trl-lib/Capybara's shape)."""
    import datasets

    return datasets.Dataset.from_dict({"messages": [r["prompt"] + r["completion"] for r in rows]})


def test_messages_rows_train_on_the_whole_conversation(setup, tmp_path):
    """A Dataset with one `messages` column (TRL's SFT quickstart): each row is the whole conversation rendered
    with the chat template, every token a target, as in TRL; the loss falls."""
    path, rows = setup
    data = _messages_rows(rows)
    trainer, tok = _trainer((path, data), tmp_path)
    row = trainer.train_dataset[0]
    text = tok.apply_chat_template(data[0]["messages"], tokenize=False)
    assert row["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert all(row["completion_mask"])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.5 * losses[0], losses


def test_messages_rows_with_assistant_only_loss_target_the_assistant_turns(setup, tmp_path):
    path, rows = setup
    trainer, tok = _trainer((path, _messages_rows(rows[:4])), tmp_path, assistant_only_loss=True)
    row = trainer.train_dataset[0]
    targets = [i for i, m in zip(row["input_ids"], row["assistant_masks"], strict=True) if m]
    assert tok.decode(targets) == rows[0]["completion"][0]["content"] + "<|end|>"
    labels = trainer.data_collator([row])["labels"][0]
    assert (labels != -100).sum() == len(targets)


def test_assistant_only_loss_refuses_rows_that_are_not_conversations(setup, tmp_path):
    path, _ = setup
    with pytest.raises(ValueError, match=r"assistant_only_loss = true, but row 0 .* is not a conversation"):
        _trainer((path, [{"text": "plain text"}]), tmp_path, assistant_only_loss=True)


def test_rows_of_no_known_shape_are_explained(setup, tmp_path):
    path, _ = setup
    with pytest.raises(ValueError, match=r"an SFT row has columns \['question'\]; expected 'messages'"):
        _trainer((path, [{"question": "2+2"}]), tmp_path)


def test_shuffle_dataset_eval_packing_and_truncation_mode(setup, tmp_path):
    """shuffle_dataset reorders the prepared training rows by the seed (the same rows); eval rows are packed as the
    training rows are unless eval_packing says otherwise; truncation_mode takes TRL's keep_start only."""
    path, rows = setup
    plain, _ = _trainer(setup, tmp_path)
    shuffled, _ = _trainer(setup, tmp_path, shuffle_dataset=True)
    ids = [tuple(r["input_ids"]) for r in plain.train_dataset]
    moved = [tuple(r["input_ids"]) for r in shuffled.train_dataset]
    assert moved != ids and sorted(moved) == sorted(ids)
    for eval_packing, packed in ((None, True), (False, False), (True, True)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=128, eval_packing=eval_packing,
                         report_to="none", use_cpu=True, save_strategy="no")
        trainer = SFTTrainer(AutoModelForCausalLM.from_pretrained(path), args, train_dataset=rows[:64],
                             eval_dataset=rows[:64], processing_class=AutoTokenizer.from_pretrained(path))
        assert (len(trainer.eval_dataset) < 64) == packed, eval_packing
    with pytest.raises(ValueError, match=r"truncation_mode = 'keep_end': expected one of 'keep_start'"):
        SFTConfig(output_dir=str(tmp_path), truncation_mode="keep_end")


def test_completion_only_loss_none_is_trls_auto(setup, tmp_path):
    """TRL's default None: prompt/completion rows train their completion only (rows without a prompt are all
    completion anyway), as True does; False trains the prompt too."""
    row_labels = {}
    for value in (None, True, False):
        trainer, _ = _trainer(setup, tmp_path, completion_only_loss=value)
        labels = trainer.data_collator([trainer.train_dataset[0]])["labels"][0]
        row_labels[value] = (labels != -100).sum().item()
    assert row_labels[None] == row_labels[True] < row_labels[False]


# ------------------------------------------------------------------ TRL's compute_loss_func and dataset_kwargs

def _shifted_ce(outputs, labels, num_items_in_batch=None):
    """transformers' contract: the summed next-token cross-entropy over labelled positions / num_items_in_batch."""
    logits, targets = outputs.logits[:, :-1].float(), labels[:, 1:]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                              ignore_index=-100, reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum())


def test_compute_loss_func_replaces_the_loss_and_its_value_is_logged(setup, tmp_path):
    """The function gets the model's outputs (logits), the unshifted labels and the step's labelled-token count;
    what it returns is the loss that trains and is logged. The same cross-entropy through it equals our fast
    (chunked) path on the same batch, and 3x it is 3x the loss."""
    seen = []

    def tripled(outputs, labels, num_items_in_batch=None):
        seen.append((outputs.logits.shape, labels.clone(), num_items_in_batch))
        loss = 3 * _shifted_ce(outputs, labels, num_items_in_batch)
        seen.append(loss.item())
        return loss

    trainer, _ = _trainer(setup, tmp_path, max_steps=1, logging_steps=1, per_device_train_batch_size=8)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(8)]))
    with torch.no_grad():
        fast = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=None).item()
        trainer.compute_loss_func = _shifted_ce
        via_function = trainer.compute_loss(trainer.model, dict(batch)).item()
    assert via_function == pytest.approx(fast, rel=1e-5)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, rows = setup
    torch.manual_seed(0)
    trainer = SFTTrainer(AutoModelForCausalLM.from_pretrained(path), trainer.args, train_dataset=rows,
                         processing_class=AutoTokenizer.from_pretrained(path), compute_loss_func=tripled)
    trainer.train()
    (shape, labels, num_items), value = seen[0], seen[1]
    assert shape[:2] == labels.shape and shape[2] == trainer.model.config.vocab_size
    assert (labels == -100).any() and num_items == (labels[:, 1:] != -100).sum()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    assert logged["loss"] == pytest.approx(value, rel=1e-4)
    assert 0 <= logged["mean_token_accuracy"] <= 1 and logged["num_tokens"] == num_items


def test_compute_loss_func_matches_trls_on_the_same_batch(setup, tmp_path):
    trl = pytest.importorskip("trl")
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, rows = setup
    out = []
    for config_cls, trainer_cls in ((trl.SFTConfig, trl.SFTTrainer), (SFTConfig, SFTTrainer)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(AutoModelForCausalLM.from_pretrained(path), train_dataset=Dataset.from_list(rows[:4]),
                                  args=config_cls(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                                  bf16=False, gradient_checkpointing=False, max_length=64),
                                  processing_class=AutoTokenizer.from_pretrained(path), compute_loss_func=_shifted_ce)
        batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
        with torch.no_grad():
            out.append(trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(7)).item())
    assert out[1] == pytest.approx(out[0], rel=1e-5)


def test_compute_loss_func_with_dft_is_refused(setup, tmp_path):
    with pytest.raises(ValueError, match=r"compute_loss_func given with SFTConfig.loss_type = 'dft'"):
        SFTTrainer(str(setup[0]), SFTConfig(output_dir=str(tmp_path), loss_type="dft", report_to="none",
                                            use_cpu=True), train_dataset=setup[1][:2], compute_loss_func=_shifted_ce)


def test_skip_prepare_dataset_uses_the_rows_as_given(setup, tmp_path):
    """TRL's dataset_kwargs={"skip_prepare_dataset": True}: tokenised rows pass untouched (no re-tokenising,
    shuffling or packing); a `labels` column (-100 where no loss, TRL's prepared rows) decides the loss tokens."""
    from datasets import Dataset

    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}, {"input_ids": [10, 11, 12],
                                                                             "labels": [-100, 11, 12]}]
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, packing=True, shuffle_dataset=True,
                     dataset_kwargs={"skip_prepare_dataset": True})
    trainer = SFTTrainer(str(setup[0]), args, train_dataset=Dataset.from_list(rows), eval_dataset=rows)
    assert trainer.train_dataset.to_list() == rows and trainer.eval_dataset.to_list() == rows
    batch = trainer.data_collator(rows)
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, 9], [-100, 11, 12, -100, -100]]
    bad = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 99]}]
    with pytest.raises(ValueError, match=r"'labels' differ from 'input_ids' at positions \[2\]"):
        trainer.data_collator(bad)


def test_skip_prepare_dataset_needs_tokenised_rows_and_unknown_keys_are_named(setup, tmp_path):
    with pytest.raises(ValueError, match=r"skip_prepare_dataset.*row 0 has no 'input_ids' \(columns \['comp"):
        _trainer(setup, tmp_path, dataset_kwargs={"skip_prepare_dataset": True})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['add_special_tokens'\] in SFTConfig.dataset_kwargs"):
        SFTConfig(output_dir=str(tmp_path), dataset_kwargs={"add_special_tokens": False})
    assert not SFTConfig(output_dir=str(tmp_path), dataset_kwargs={"skip_prepare_dataset": False}).skip_prepare_dataset
