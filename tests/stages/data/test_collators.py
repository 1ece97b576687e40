"""CompletionCollator: labels from masks (never from ids != pad), padding-free rows, truncation."""
import pytest
import torch

from stages.builtin import tiny
from stages.data.collators import CompletionCollator
from stages.losses import IGNORE_INDEX

X = IGNORE_INDEX
PAD = 0


def t(rows):
    return torch.tensor(rows, dtype=torch.long)


def test_padded_batch_exact():
    features = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]},
                {"input_ids": [9, 10], "completion_mask": [0, 1]}]
    out = CompletionCollator(PAD)(features)
    assert set(out) == {"input_ids", "attention_mask", "labels", "position_ids"}
    assert torch.equal(out["input_ids"], t([[5, 6, 7, 8], [9, 10, PAD, PAD]]))
    assert torch.equal(out["attention_mask"], t([[1, 1, 1, 1], [1, 1, 0, 0]]))
    assert torch.equal(out["labels"], t([[X, X, 7, 8], [X, 10, X, X]]))
    assert torch.equal(out["position_ids"], t([[0, 1, 2, 3], [0, 1, 0, 1]]))


def test_full_sequence_loss_without_completion_only():
    features = [{"input_ids": [5, 6, 7], "completion_mask": [0, 0, 1]}, {"input_ids": [9]}]
    out = CompletionCollator(PAD, completion_only_loss=False)(features)
    assert torch.equal(out["labels"], t([[5, 6, 7], [9, X, X]]))


def test_pad_equal_to_eos_keeps_the_real_eos_as_a_target():
    eos = 1  # the tokenizer pads with EOS
    features = [{"input_ids": [5, 6, eos], "completion_mask": [0, 1, 1]},
                {"input_ids": [7, 8, 9, eos, 4], "completion_mask": [0, 0, 1, 1, 1]}]
    out = CompletionCollator(pad_token_id=eos)(features)
    assert torch.equal(out["input_ids"], t([[5, 6, eos, eos, eos], [7, 8, 9, eos, 4]]))
    # the first row's real EOS (position 2) is learnt; the two padding EOS after it are not
    assert torch.equal(out["labels"], t([[X, 6, eos, X, X], [X, X, 9, eos, 4]]))
    assert torch.equal(out["attention_mask"], t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))


def test_assistant_only_loss_with_the_tokenizers_generation_markers():
    tok = tiny.build_tokenizer(384)
    conv = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    enc = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    feature = {"input_ids": enc["input_ids"], "assistant_masks": enc["assistant_masks"]}
    out = CompletionCollator(tok.pad_token_id, completion_only_loss=False, assistant_only_loss=True)([feature])
    labelled = [i for i in out["labels"][0].tolist() if i != X]
    assert tok.convert_ids_to_tokens(labelled) == ["4", "<|end|>", "6", "<|end|>"]


def test_assistant_and_completion_masks_combine():
    feature = {"input_ids": [1, 2, 3, 4, 5], "completion_mask": [0, 0, 1, 1, 1], "assistant_masks": [0, 1, 1, 0, 1]}
    out = CompletionCollator(PAD, assistant_only_loss=True)([feature])
    assert torch.equal(out["labels"], t([[X, X, 3, X, 5]]))


def test_assistant_only_loss_without_assistant_masks_is_explained():
    with pytest.raises(ValueError, match=r"feature 1 has no 'assistant_masks'.*return_assistant_tokens_mask=True"):
        CompletionCollator(PAD, assistant_only_loss=True)([{"input_ids": [1], "assistant_masks": [1]},
                                                           {"input_ids": [2]}])


def test_mask_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match=r"feature 0: 'completion_mask' has \(2,\) entries but 'input_ids' has 3"):
        CompletionCollator(PAD)([{"input_ids": [1, 2, 3], "completion_mask": [0, 1]}])


def test_padding_free_concatenates_and_resets_positions():
    features = [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
                {"input_ids": [8, 9], "completion_mask": [1, 1]},
                {"input_ids": [10, 11, 12, 13], "completion_mask": [0, 0, 1, 1]}]
    out = CompletionCollator(PAD, padding_free=True)(features)
    assert "attention_mask" not in out
    assert torch.equal(out["input_ids"], t([[5, 6, 7, 8, 9, 10, 11, 12, 13]]))
    assert torch.equal(out["position_ids"], t([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    # the first token of every sequence is never a target (8 would be predicted from 7 across the boundary)
    assert torch.equal(out["labels"], t([[X, 6, 7, X, 9, X, X, 12, 13]]))


def test_padding_free_with_packed_features_and_multiple_of():
    features = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]},
                {"input_ids": [6, 7, 8], "position_ids": [0, 0, 1]}]
    out = CompletionCollator(PAD, completion_only_loss=False, padding_free=True, pad_to_multiple_of=4)(features)
    assert torch.equal(out["input_ids"], t([[1, 2, 3, 4, 5, 6, 7, 8]]))
    assert torch.equal(out["position_ids"], t([[0, 1, 0, 1, 2, 0, 0, 1]]))
    assert torch.equal(out["labels"], t([[X, 2, X, 4, 5, X, X, 8]]))
    out = CompletionCollator(PAD, completion_only_loss=False, padding_free=True, pad_to_multiple_of=5)(features)
    # padding is a sequence of its own: positions restart, no label
    assert torch.equal(out["input_ids"], t([[1, 2, 3, 4, 5, 6, 7, 8, PAD, PAD]]))
    assert torch.equal(out["position_ids"], t([[0, 1, 0, 1, 2, 0, 0, 1, 0, 1]]))
    assert torch.equal(out["labels"], t([[X, 2, X, 4, 5, X, X, 8, X, X]]))


def test_packed_rows_in_a_padded_batch_drop_the_attention_mask():
    features = [{"input_ids": [1, 2, 3, 4], "completion_mask": [1, 1, 1, 1], "seq_lengths": [1, 3]},
                {"input_ids": [5, 6], "completion_mask": [0, 1], "seq_lengths": [2]}]
    out = CompletionCollator(PAD)(features)
    # with a 2D mask transformers would not look for sequence starts in position_ids
    assert "attention_mask" not in out
    assert torch.equal(out["input_ids"], t([[1, 2, 3, 4], [5, 6, PAD, PAD]]))
    assert torch.equal(out["position_ids"], t([[0, 0, 1, 2], [0, 1, 0, 1]]))
    assert torch.equal(out["labels"], t([[X, X, 3, 4], [X, 6, X, X]]))


def test_bad_seq_lengths_are_refused():
    with pytest.raises(ValueError, match=r"feature 0: seq_lengths \[2, 2\] must be positive and sum to the 3 tokens"):
        CompletionCollator(PAD)([{"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}])


def test_truncation_to_max_length():
    features = [{"input_ids": [1, 2, 3, 4, 5, 6], "completion_mask": [0, 0, 0, 1, 1, 1]},
                {"input_ids": [7, 8], "completion_mask": [0, 1]}]
    out = CompletionCollator(PAD, max_length=4)(features)
    assert torch.equal(out["input_ids"], t([[1, 2, 3, 4], [7, 8, PAD, PAD]]))
    assert torch.equal(out["labels"], t([[X, X, X, 4], [X, 8, X, X]]))
    assert torch.equal(out["attention_mask"], t([[1, 1, 1, 1], [1, 1, 0, 0]]))


def test_truncation_of_packed_features_cuts_their_sequences():
    features = [{"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [2, 2, 2]}, {"input_ids": [7, 8, 9]}]
    out = CompletionCollator(PAD, padding_free=True, max_length=3)(features)
    assert torch.equal(out["input_ids"], t([[1, 2, 3, 7, 8, 9]]))
    assert torch.equal(out["position_ids"], t([[0, 1, 0, 0, 1, 2]]))
    assert torch.equal(out["labels"], t([[X, 2, X, X, 8, 9]]))


def test_a_labels_column_marks_the_loss_tokens_with_the_masks():
    """TRL's prepared rows carry `labels` (-100 where no loss): they restrict the loss like a mask, combined with
    completion_mask; labels that are not the input ids there, or of another length, are refused by row."""
    features = [{"input_ids": [5, 6, 7, 8], "labels": [X, 6, 7, 8], "completion_mask": [0, 0, 1, 1]},
                {"input_ids": [9, 10, 11], "labels": [X, 10, X]}]
    out = CompletionCollator(PAD)(features)
    assert torch.equal(out["labels"], t([[X, X, 7, 8], [X, 10, X, X]]))
    out = CompletionCollator(PAD, completion_only_loss=False)(features)
    assert torch.equal(out["labels"], t([[X, 6, 7, 8], [X, 10, X, X]]))
    with pytest.raises(ValueError, match=r"feature 1: 'labels' differ from 'input_ids' at positions \[1\]"):
        CompletionCollator(PAD)([features[0], {"input_ids": [9, 10], "labels": [X, 12]}])
    with pytest.raises(ValueError, match=r"feature 0: 'labels' has \(2,\) entries but 'input_ids' has 3"):
        CompletionCollator(PAD)([{"input_ids": [9, 10, 11], "labels": [X, 10]}])
