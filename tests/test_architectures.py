"""The architecture matrix: the whole pipeline, preprocess to evaluate, on tiny random-weight models of
real architectures built locally (tests/architectures.py), on small settings.

| model   | data                                    |
|---------|-----------------------------------------|
| llama   | builtin:tiny + builtin:arithmetic (chat) |
| qwen2   | builtin:arithmetic (chat, ChatML)        |
| gpt2    | plain-string files, no chat template     |
| gemma2  | builtin:arithmetic (chat)                |
| mistral | builtin:arithmetic (chat, [INST])        |

Budget: about 1-2 minutes for the five on 2 cores (`pytest -m slow tests/test_architectures.py`).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stages.data import read_jsonl
from stages.harness.params_loader import load_params
from tests import architectures
from tests.conftest import write_params
from tests.pipelines import arithmetic_files, evaluate_table, run_pipeline

pytestmark = pytest.mark.slow

MATRIX = ["llama", *architectures.BUILDERS]


@pytest.mark.parametrize("arch", MATRIX)
def test_whole_pipeline_reaches_evaluate(tmp_path, arch):
    extra: dict = {}
    if arch != "llama":
        model = architectures.BUILDERS[arch](tmp_path / arch)
        extra["model"] = {"name_or_path": str(model)}
    if arch == "gpt2":  # a base model: plain strings end to end
        files = arithmetic_files(tmp_path, plain=True)
        extra["data"] = {"source": None, **{k: str(files[k]) for k in ("sft", "preference", "prompts")}}
    params = load_params(write_params(tmp_path, extra))
    manifests = run_pipeline(params)
    table = evaluate_table(params)
    assert [r["model"] for r in table] == ["base", "sft", "policy", "merged"]
    assert manifests["policy"]["metrics"]["steps"] == 3
    assert all(torch.isfinite(torch.tensor(m["metrics"]["train_loss"])) for m in
               (manifests["sft"], manifests["reward"], manifests["policy"]))
    if arch == "gpt2":
        pairs = read_jsonl(Path(params.run.output_dir) / "score" / "pairs.jsonl")
        assert all(isinstance(r["chosen"], str) for r in pairs)
    if arch == "gemma2":
        check_softcapped_reference(params)


def check_softcapped_reference(params) -> None:
    """Gemma 2's logits are soft-capped, so log-probs must come from the logits, not hidden states x head: the
    reference stage's numbers equal a plain logits computation, and differ once the capping is removed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.logprobs import lm_head_for_chunking
    from stages.trainers.pair_batches import REF_COLUMNS
    from stages.trainers.reference_model import compute_reference_logps

    out = Path(params.run.output_dir)
    rows = read_jsonl(out / "reference" / "pairs.jsonl")[:4]
    sft = out / "sft" / "model"
    model, tok = AutoModelForCausalLM.from_pretrained(sft).eval(), AutoTokenizer.from_pretrained(sft)
    assert lm_head_for_chunking(model) is None  # the logits path
    plain = [{k: v for k, v in r.items() if k not in REF_COLUMNS} for r in rows]
    max_length = params.policy.dpo.max_length
    again = compute_reference_logps(model, tok, plain, max_length=max_length, chunked=False)
    stage = torch.tensor([[r[c] for c in REF_COLUMNS] for r in rows])
    assert torch.allclose(stage, torch.tensor([[r[c] for c in REF_COLUMNS] for r in again]), atol=1e-4)
    model.config.final_logit_softcapping = None
    uncapped = compute_reference_logps(model, tok, plain, max_length=max_length, chunked=False)
    assert not torch.allclose(stage, torch.tensor([[r[c] for c in REF_COLUMNS] for r in uncapped]), atol=1e-4)
