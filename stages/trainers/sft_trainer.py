"""Supervised fine-tuning: `SFTConfig` + `SFTTrainer` (a `transformers.Trainer`).

Rows are conversations (a `messages` column, TRL's conversational language-modelling shape),
prompt/completion (strings or chat messages), plain text, or anything a `formatting_func`
turns into text; they are tokenised with the chat template and a completion mask built
from positions. With `completion_only_loss` the loss covers completion tokens only (a
`messages` row is all completion, as in TRL); with `assistant_only_loss`, every assistant
turn of a conversation and nothing else. The loss itself is
`stages.losses.sft_loss` (from logits) or `sft_loss_from_logps`, per token as `loss_type` names it
(`stages.losses.SFT_LOSSES`); this module only feeds it.

Memory: with `use_chunked_logprobs` (default) and a model whose output layer allows it
(see `stages.logprobs`), the loss is computed from the final hidden states of
the labelled positions only, through `stages.kernels.chunked_logprobs`: the (batch,
tokens, vocab) logits are never built. Otherwise it falls back to the full logits.
"""
from __future__ import annotations

import time
from collections import defaultdict
from functools import partial

from transformers import Trainer

from stages.data.collators import CompletionCollator
from stages.data.packing import pack_dataset
from stages.data.tokenize import tokenize_sft, tokenized_dataset
from stages.logprobs import head_argmax, head_logprobs, lm_head_for_chunking, selected_hidden
from stages.losses import IGNORE_INDEX, sft_loss, sft_loss_from_logps, token_counts
from stages.precision import use_fp32_cpu_attention
from stages.sharding import unwrap
from stages.trainers.inputs import apply_eos_to_model, apply_peft, load_model, map_eval, offline_inputs
from stages.trainers.method_fields import pad_multiple
from stages.trainers.model_options import router_aux_loss_coef, router_losses, with_router_loss
from stages.trainers.offloading import OffloadsActivations
from stages.trainers.sft_config import SFTConfig  # noqa: F401 (the config of this trainer, re-exported)


class SFTTrainer(OffloadsActivations, Trainer):
    # compute_loss divides by the token count of the whole accumulated batch itself
    loss_is_scaled_for_ga = True

    def __init__(self, model, args: SFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, quantization_config=None, peft_config=None, formatting_func=None):
        args, train_dataset, eval_dataset, processing_class = offline_inputs(
            SFTConfig, "SFT", model, args, train_dataset, eval_dataset, processing_class)
        if compute_loss_func is not None and args.loss_type != "nll":
            raise ValueError(f"SFTTrainer: compute_loss_func given with SFTConfig.loss_type = {args.loss_type!r}: the "
                             "function replaces the loss, so loss_type would do nothing; drop one of them")
        model = apply_peft(load_model(model, args, quantization_config), peft_config)
        apply_eos_to_model(model, processing_class, args)
        self.formatting_func = formatting_func
        args.remove_unused_columns = False  # the collator needs completion_mask / assistant_masks
        # Packed rows are kept apart by position_ids either way. Joining the whole batch into one row
        # only pays with flash-attention's varlen kernels; sdpa/eager would attend densely over B x L.
        attn = getattr(unwrap(model).config, "_attn_implementation", "") or ""
        data_collator = data_collator or CompletionCollator(
            pad_token_id=processing_class.pad_token_id, completion_only_loss=args.completion_only_loss is not False,
            assistant_only_loss=args.assistant_only_loss,
            padding_free=args.padding_free or (args.packing and attn.startswith("flash_attention")),
            max_length=args.max_length, pad_to_multiple_of=pad_multiple(args.pad_to_multiple_of))
        use_fp32_cpu_attention(model)  # attention in fp32 under CPU autocast (stages.precision)
        super().__init__(
            model=model, args=args, data_collator=data_collator, processing_class=processing_class,
            train_dataset=self._prepare(train_dataset, processing_class, args, args.packing),
            eval_dataset=map_eval(eval_dataset, lambda rows: self._prepare(
                rows, processing_class, args, args.packing if args.eval_packing is None else args.eval_packing,
                shuffle=False)),
            compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self.router_aux_loss_coef = router_aux_loss_coef(unwrap(self.model), args.router_aux_loss_coef)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._last_log_time = time.perf_counter()

    def _prepare(self, rows, tokenizer, args: SFTConfig, pack: bool, *, shuffle: bool | None = None):
        """Rows -> tokenised Dataset (`Dataset.map` over args.dataset_num_proc processes, cached as Arrow files by
        content: stages.data.tokenize.tokenized_dataset), shuffled with the seed (`shuffle`, default
        args.shuffle_dataset) and packed if asked; IterableDatasets are tokenised lazily."""
        import datasets

        if rows is None:
            return None
        if args.skip_prepare_dataset:
            return _as_prepared(rows)
        tokenize = partial(tokenize_sft, tokenizer, max_length=args.max_length, text_field=args.dataset_text_field,
                           formatting_func=self.formatting_func, assistant_only=args.assistant_only_loss)
        dataset = tokenized_dataset(rows, partial(_tokenize_checked, tokenize, args.max_length), marker="input_ids",
                                    tokenizer=tokenizer, num_proc=getattr(args, "dataset_num_proc", None))
        if (args.shuffle_dataset if shuffle is None else shuffle) and isinstance(dataset, datasets.Dataset):
            dataset = dataset.shuffle(seed=args.seed)
        if pack and not isinstance(dataset, datasets.IterableDataset):
            dataset = pack_dataset(dataset, args.max_length, args.packing_strategy)
        return dataset

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """SFT's loss (`stages.losses`), or with `compute_loss_func` (transformers' argument) that function's
        value on the model's outputs (logits included), the (B, T) unshifted labels and num_items_in_batch."""
        labels = inputs.pop("labels")
        head = lm_head_for_chunking(model) if self.args.use_chunked_logprobs else None
        with router_losses(model, self.router_aux_loss_coef > 0) as aux:
            if self.compute_loss_func is not None:
                outputs = model(**inputs, use_cache=False)
                loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
                stats = token_counts(outputs.logits.detach(), labels)
            elif head is not None:
                targets = labels[:, 1:]
                select = targets != IGNORE_INDEX
                hidden, outputs = selected_hidden(model, inputs, select)
                logps = head_logprobs(hidden, head, targets[select])
                loss = sft_loss_from_logps(logps, num_items_in_batch=num_items_in_batch,
                                           loss_type=self.args.loss_type)
                stats = {"num_tokens": select.sum(), "correct_tokens": (head_argmax(hidden.detach(), head)
                                                                        == targets[select]).sum()}
            else:
                outputs = model(**inputs, use_cache=False)
                loss, stats = sft_loss(outputs.logits, labels, num_items_in_batch=num_items_in_batch,
                                       loss_type=self.args.loss_type)
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # DDP averages grads; the denominator is already global
        # the router loss is a mean per micro-batch; a loss already scaled for accumulation takes its share
        loss = with_router_loss(loss, aux, self.router_aux_loss_coef, stats,
                                steps=getattr(self, "current_gradient_accumulation_steps", 1)
                                if num_items_in_batch is not None
                                else 1)
        mode = "train" if model.training else "eval"
        if "aux_loss" in stats:
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(stats["aux_loss"]).mean()
                                                   .item())
        tokens = self.accelerator.gather_for_metrics(stats["num_tokens"].reshape(1)).sum()
        correct = self.accelerator.gather_for_metrics(stats["correct_tokens"].reshape(1)).sum()
        self._metrics[mode]["num_tokens"].append(tokens.item())
        self._metrics[mode]["mean_token_accuracy"].append((correct / tokens.clamp(min=1)).item())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        m = self._metrics[mode]
        if m:
            logs[f"{prefix}mean_token_accuracy"] = sum(m["mean_token_accuracy"]) / len(m["mean_token_accuracy"])
            logs[f"{prefix}num_tokens"] = float(sum(m["num_tokens"]))
            if m.get("aux_loss"):
                logs[f"{prefix}aux_loss"] = sum(m["aux_loss"]) / len(m["aux_loss"])
            if mode == "train":  # loss tokens per second since the last log line
                now = time.perf_counter()
                logs["loss_tokens_per_second"] = round(sum(m["num_tokens"]) / max(now - self._last_log_time, 1e-9), 1)
                self._last_log_time = now
        self._metrics[mode].clear()
        super().log(logs, start_time)


def _as_prepared(rows):
    """Rows used as given (SFTConfig.dataset_kwargs skip_prepare_dataset): each must hold input_ids already."""
    import datasets

    if isinstance(rows, datasets.IterableDataset):
        return rows  # streamed: checked by the collator as batches come
    columns = rows.column_names if isinstance(rows, datasets.Dataset) else None
    for i, row in enumerate(rows if columns is None else [dict.fromkeys(columns)]):
        if "input_ids" not in row:
            where = "the dataset" if columns is not None else f"row {i}"
            raise ValueError(f"SFTConfig.dataset_kwargs = {{'skip_prepare_dataset': True}}, but {where} has no "
                             f"'input_ids' (columns {sorted(row)}): rows are used as given, so they must be "
                             "tokenised already (input_ids, optionally completion_mask / assistant_masks / labels); "
                             "drop skip_prepare_dataset to have the trainer prepare them")
    return rows if columns is not None else datasets.Dataset.from_list(list(rows))


def _tokenize_checked(tokenize, max_length: int, rows: list[dict], *, start: int = 0) -> list[dict]:
    out = tokenize(rows)
    check_targets(out, max_length, start=start)
    return out


def check_targets(rows: list[dict[str, list[int]]], max_length: int, *, start: int = 0) -> None:
    """Every row must keep at least one loss token after truncation (else the prompt fills max_length).
    `start`: the index of the first of `rows` in the whole dataset, for the message."""
    keys = [k for k in ("assistant_masks", "completion_mask") if rows and k in rows[0]]
    empty = [i for i, r in enumerate(rows) if keys and not any(all(m) for m in zip(*(r[k] for k in keys),
                                                                                   strict=True))]
    if empty:
        raise ValueError(f"sft.max_length = {max_length} is shorter than the prompt of {len(empty)} row(s) "
                         f"(first: row {start + empty[0]}), which would leave nothing to learn; raise "
                         "sft.max_length or filter long prompts in preprocess (preprocess.max_length)")
