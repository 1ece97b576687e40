"""Completions packed on their shared prompt give the padded rollout rows' log-probs and gradients; the layout is
checked by hand; rows that share no prompt, or a model that cannot take the packed layout, keep the padded rows."""
import pytest
import torch

from stages import group_packing
from stages.group_packing import group_layout, pack_groups
from stages.trainers import rollout
from stages.trainers.rollout import completion_logps, pad_rollout
from tests.stages.trainers.conftest import build_tiny


def test_layout_puts_each_completion_after_the_prompt_and_hides_the_others():
    # prompt [5, 6] with completions [7, 8] and [9]; prompt [4] with [1, 2, 3] and [2] (EOS id 3)
    batch = pad_rollout([[5, 6], [5, 6], [4], [4]], [[7, 8], [9], [1, 2, 3], [2]], pad_token_id=0, eos_token_id=3)
    p = group_layout(batch["input_ids"], batch["attention_mask"], width=batch["completion_mask"].shape[1])
    by_prompt = {tuple(p.input_ids[g].tolist()): g for g in range(2)}
    a, b = by_prompt[(5, 6, 7, 8, 9)], by_prompt[(4, 1, 2, 3, 2)]
    assert p.position_ids[a].tolist()[:5] == [0, 1, 2, 3, 2]     # the second completion restarts after the prompt
    assert p.position_ids[b].tolist()[:5] == [0, 1, 2, 3, 1]
    m = p.mask[a, 0]
    assert m[4].tolist()[:5] == [True, True, False, False, True]  # 9 sees the prompt and itself, not [7, 8]
    assert m[3].tolist()[:5] == [True, True, True, True, False]   # 8: causal within its completion
    assert p.rows.tolist() == [a, a, b, b]
    assert torch.equal(p.unpack(p.input_ids) * batch["attention_mask"], batch["input_ids"])
    assert p.tokens < batch["input_ids"].numel()


def test_rows_that_share_no_prompt_are_not_packed():
    batch = pad_rollout([[5, 6], [4]], [[7], [1]], pad_token_id=0, eos_token_id=3)
    assert group_layout(batch["input_ids"], batch["attention_mask"], width=1) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny(tmp_path_factory.mktemp("tiny"), num_layers=2)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")


def _rollout(num_generations: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 300, (n,), generator=g).tolist() for n in (12, 7)]
    completions = [torch.randint(4, 300, (int(n),), generator=g).tolist()
                   for n in torch.randint(1, 9, (2 * num_generations,), generator=g)]
    return pad_rollout([p for p in prompts for _ in range(num_generations)], completions, pad_token_id=0,
                       eos_token_id=2)


def test_packed_log_probs_and_gradients_equal_the_padded_rows(tiny, monkeypatch):
    batch = _rollout()
    assert pack_groups(tiny, batch, batch["completion_mask"].shape[1]) is not None

    def logps_and_grads():
        tiny.zero_grad()
        logps = completion_logps(tiny, batch)["logps"]
        (logps * torch.linspace(0.5, 2, logps.numel()).view_as(logps)).sum().backward()
        return logps.detach(), [p.grad.clone() for p in tiny.parameters()]

    packed, packed_grads = logps_and_grads()
    monkeypatch.setattr(rollout, "pack_groups", lambda *a, **k: None)
    padded, padded_grads = logps_and_grads()
    assert torch.allclose(packed, padded, atol=1e-5)
    assert (packed != 0).sum() == batch["completion_mask"].sum()
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(packed_grads, padded_grads, strict=True))


def test_a_model_that_ignores_the_packed_mask_keeps_the_padded_rows(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny(tmp_path), attn_implementation="sdpa")
    batch = _rollout()
    monkeypatch.setattr(group_packing, "same_as_padded", lambda *a, **k: False)
    assert pack_groups(model, batch, batch["completion_mask"].shape[1]) is None
