"""A causal LM with a scalar value head on its trunk, for PPO's shared policy/critic model.

`PreTrainedModelWrapper` is a thin `nn.Module` around a Hugging Face causal LM (or a PEFT
model on one): it exposes the wrapped model's `generate`, `config` and `device`, and saves
the LM exactly as `save_pretrained` would, plus its own extra weights as
`value_head.safetensors` in the same folder (safetensors only, never pickles). The folder
therefore still loads as a plain causal LM anywhere (`AutoModelForCausalLM.from_pretrained`
ignores the extra file).

`AutoModelForCausalLMWithValueHead` adds `v_head`: dropout + Linear(hidden, 1) on the final
hidden state (after the final norm) of every position. The head's weights stay in float32
whatever the LM's dtype; the hidden states are upcast before it (a (B, T, H) -> (B, T) map, cheap).

    model = AutoModelForCausalLMWithValueHead.from_pretrained("path/to/sft/model")
    logits, hidden, values = model(input_ids, attention_mask=mask)   # (B, T, V), (B, T, H), (B, T)
    model.save_pretrained("out/")  # out/model.safetensors + out/config.json + out/value_head.safetensors
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"


class PreTrainedModelWrapper(nn.Module):
    """Holds `pretrained_model` (a causal LM or a PEFT model); subclasses add modules of their own.

    Subclasses list the state-dict prefixes of their own modules in `extra_modules`; those
    weights are what `save_pretrained` writes to `value_head.safetensors`.
    """

    extra_modules: tuple[str, ...] = ()
    main_input_name = "input_ids"

    def __init__(self, pretrained_model: nn.Module):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.config = pretrained_model.config

    @property
    def device(self) -> torch.device:
        return self.pretrained_model.device

    @property
    def is_peft_model(self) -> bool:
        return hasattr(self.pretrained_model, "peft_config")

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    def get_output_embeddings(self):
        """The LM head of the underlying transformer (below any PEFT wrapper)."""
        lm = self.pretrained_model.get_base_model() if self.is_peft_model else self.pretrained_model
        return lm.get_output_embeddings()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        self.pretrained_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.pretrained_model.gradient_checkpointing_disable()

    def extra_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapper's own weights (not the LM's), keyed as in `state_dict()`."""
        return {k: v for k, v in self.state_dict().items() if k.split(".", 1)[0] in self.extra_modules}

    def save_pretrained(self, save_directory: str | Path, *, is_main_process: bool = True, **kwargs) -> None:
        """The LM as `save_pretrained` writes it (an adapter folder for PEFT) + value_head.safetensors."""
        from safetensors.torch import save_file

        self.pretrained_model.save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            tensors = {k: v.detach().contiguous().cpu() for k, v in self.extra_state_dict().items()}
            save_file(tensors, str(Path(save_directory) / VALUE_HEAD_FILE), metadata={"format": "pt"})

    def load_extra_weights(self, folder: str | Path) -> bool:
        """Load value_head.safetensors from `folder` if it is there; True if it was."""
        from safetensors.torch import load_file

        path = Path(folder) / VALUE_HEAD_FILE
        if not path.exists():
            return False
        state = load_file(str(path), device="cpu")
        expected = set(self.extra_state_dict())
        if set(state) != expected:
            raise ValueError(f"{path}: holds {sorted(state)}, expected {sorted(expected)}; it was written by a "
                             "different head (delete it to start from a fresh head)")
        self.load_state_dict(state, strict=False)
        return True

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "float32", device: str = "cpu",
                        trust_remote_code: bool = False, quantization_config=None, **head_kwargs):
        """The LM via `stages.models.load_causal_lm` (a PEFT adapter folder is merged onto its base),
        plus the wrapper's weights from value_head.safetensors if present, else freshly initialised."""
        from stages.models import load_causal_lm

        lm = load_causal_lm(str(path), dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                            quantization_config=quantization_config)
        model = cls(lm, **head_kwargs)
        model.load_extra_weights(path)
        return model


class AutoModelForCausalLMWithValueHead(PreTrainedModelWrapper):
    """A causal LM plus v_head: dropout + Linear(hidden_size, 1), one scalar per position.

    The fresh head starts near zero (weight ~ N(0, 1e-3²), bias 0): values start near 0 and
    the first value-loss gradients reach the trunk only weakly, so the pretrained trunk is
    not pulled around by a random critic at the start of training.
    """

    extra_modules = ("v_head",)

    def __init__(self, pretrained_model: nn.Module, *, dropout: float = 0.0):
        super().__init__(pretrained_model)
        hidden = _hidden_size(pretrained_model.config)
        self.dropout = nn.Dropout(dropout)
        self.v_head = nn.Linear(hidden, 1).to(device=pretrained_model.device, dtype=torch.float32)
        nn.init.normal_(self.v_head.weight, std=1e-3)
        nn.init.zeros_(self.v_head.bias)
        self._takes_logits_to_keep = _accepts(self._lm_forward_owner(), "logits_to_keep")

    def _lm_forward_owner(self) -> nn.Module:
        return self.pretrained_model.get_base_model() if self.is_peft_model else self.pretrained_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                return_logits: bool = True, **kwargs) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask: (B, T); kwargs go to the LM (position_ids, ...).

        Returns (logits (B, T, V) or None, hidden (B, T, H) final hidden states, values (B, T) float32).
        With return_logits=False the LM computes the logits of one position only (where its
        forward takes `logits_to_keep`), for callers that take log-probs from `hidden` in chunks.
        """
        if not return_logits and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        kwargs.setdefault("use_cache", False)
        out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                    **kwargs)
        hidden = out.hidden_states[-1]
        values = self.v_head(self.dropout(hidden.to(self.v_head.weight.dtype))).squeeze(-1)
        return (out.logits if return_logits else None), hidden, values


def _hidden_size(config) -> int:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, attr, None):
            return int(getattr(config, attr))
    raise ValueError(f"{type(config).__name__} has no hidden_size / n_embd / d_model: cannot size the value head")


def _accepts(module: nn.Module, name: str) -> bool:
    return name in inspect.signature(module.forward).parameters
