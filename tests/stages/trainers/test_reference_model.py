"""The reference model, one helper for every method: frozen copy, adapter disabled (through DDP), columns, none."""
import socket

import pytest
import torch

from stages.trainers.pair_batches import REF_COLUMNS, PairCollator, sequence_logps, tokenize_pairs
from stages.trainers.reference_model import frozen_reference, precomputed, reference_model
from tests.stages.trainers.conftest import build_tiny, builtin_rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny") / "model")
    tok = AutoTokenizer.from_pretrained(path)
    batch = PairCollator(tok.pad_token_id)(tokenize_pairs(tok, builtin_rows("preference", "preference")[:4], 256))
    return path, batch


def _lora(path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model  # random (non-zero) adapters: the adapted model differs from its base


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lora_under_ddp_runs_the_adapter_disabled_base(setup):
    """DistributedDataParallel forwards no attribute of the model inside it: the helper unwraps it before
    `disable_adapter`, and the reference's log-probs are the base model's (not the adapted policy's)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    path, batch = setup
    policy = _lora(path)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(policy)
        assert not hasattr(wrapped, "disable_adapter")  # the crash this helper avoids
        with torch.no_grad(), reference_model(wrapped, frozen_reference(wrapped)) as ref:
            got = sequence_logps(ref, batch)
        with torch.no_grad():
            adapted = sequence_logps(wrapped, batch)
    finally:
        dist.destroy_process_group()
    base = sequence_logps(AutoModelForCausalLM.from_pretrained(path), batch).detach()
    assert torch.allclose(got, base, atol=1e-5)
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapter is back on after the block


def test_frozen_copy_none_and_columns(setup):
    from transformers import AutoModelForCausalLM

    path, batch = setup
    model = AutoModelForCausalLM.from_pretrained(path)
    ref = frozen_reference(model)
    assert ref is not model and not any(p.requires_grad for p in ref.parameters()) and not ref.training
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # training moves the policy; the copy stays where it started
    assert not torch.equal(ref.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert frozen_reference(model, needed=False) is None  # reference_free DPO, GRPO with beta 0
    with pytest.raises(ValueError, match="no reference model: pass ref_model, use a PEFT model"):
        with reference_model(model, None):
            pass
    assert precomputed(batch) is None
    columns = {**batch, REF_COLUMNS[0]: torch.zeros(4), REF_COLUMNS[1]: torch.ones(4)}
    chosen, rejected = precomputed(columns)
    assert chosen.tolist() == [0.0] * 4 and rejected.tolist() == [1.0] * 4


@pytest.mark.parametrize("reference", ["frozen copy", "adapter disabled", "precomputed by the trainer"])
def test_reference_runs_under_the_policys_bf16_autocast(setup, tmp_path, reference):
    """Under bf16 every reference the trainer builds itself runs as the policy's forward does (autocast, fp32
    outputs: `reference_model(..., precision=)`): the first logged step, before any update, has rewards 0.
    Before, the frozen copy and the precompute (run before `train()` prepares the model) ran in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer

    path, _ = setup
    model = _lora(path) if reference == "adapter disabled" else AutoModelForCausalLM.from_pretrained(path)
    if reference == "adapter disabled":  # B = 0, as a fresh adapter: the policy at step 0 is its base
        for name, w in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.zeros_(w)
    args = DPOConfig(output_dir=str(tmp_path), bf16=True, use_cpu=True, max_steps=1, logging_steps=1,
                     per_device_train_batch_size=4, report_to="none", save_strategy="no", disable_tqdm=True,
                     precompute_ref_log_probs=reference == "precomputed by the trainer", max_length=256)
    trainer = DPOTrainer(model, args=args, processing_class=AutoTokenizer.from_pretrained(path),
                         train_dataset=builtin_rows("preference", "preference")[:4])
    trainer.train()
    first = trainer.state.log_history[0]
    assert [first[k] for k in ("rewards/margins", "rewards/chosen", "rewards/rejected")] == [0.0] * 3, first
