"""A lean KV-cache decoder for Llama-family causal LMs on CPU: backend "decoder", and "auto"'s first choice.

HF's `generate` runs every decode step through the whole module stack, and for a small model on a CPU that
framework overhead is most of the step. `Decoder` computes the same forward from the model's own weights in a
few ops per layer, reading the weights where they are (cast once per call under autocast) and, from the first
decode step on, fp32 weights reordered once per call for oneDNN, q/k/v and gate/up each as one matrix (a real
model's decode step is bound by reading its weights; `_Linear`), one cache for all layers written in place (the
first tokens that all of a call's prompts share, a chat template's system prompt, computed once), the model's own
rotary tables, and HF's greedy loop with a pluggable token picker (`pick(step, logits)`: the argmax or
`row_sampling.PerRowSampler.sample`). Left padding, autocast (matmuls in the autocast dtype, residual stream, norms
and rotary in fp32) and `precision.CPU_FP32_SDPA` are handled as in the HF modules, so the tokens equal HF's up to
float rounding (tests compare both).

`why_not(model, capacity)` names what it would not reproduce exactly, and `Decoder.for_model` then returns None:
other architectures, quantised or hooked modules, a wrapped forward outside an autocast region, PEFT adapters
other than plain LoRA, sliding windows shorter than the call, generation configs that add logits processors,
models on an accelerator or over `MAX_WEIGHT_BYTES` of weights (the copy it may make per call: LoRA layers,
autocast). docs/architecture.md ("The generation backends") says more.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from stages.sharding import unwrap  # PEFT's wrapper off; its LoRA layers stay in place

# model_type -> whether its attention has per-head q/k norms (Qwen3)
ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}
MAX_WEIGHT_BYTES = 2 * 2**30  # the per-call (in, out) copy of the weights stays below this
FIRST_CACHE_TOKENS = 64  # the cache starts with room for this many new tokens and doubles as rows run on
SHARED_PREFIX_MIN = 16  # first tokens all of a call's prompts share that run once (`Decoder._prefill`)
# a layer's projections, grouped by their input: one oneDNN call per group at decode (`_Linear`)
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
PROJECTIONS = tuple(name for names in GROUPS.values() for name in names)
ATTENTION = ("sdpa", "eager", "sdpa_cpu_fp32")  # computed by torch's SDPA here; see precision.CPU_FP32_SDPA
# generation-config fields that make HF's greedy `generate` add a logits processor or change the mode, with
# the values that leave it out (None leaves every one out)
NEUTRAL = {"repetition_penalty": (1.0,), "encoder_repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,),
           "encoder_no_repeat_ngram_size": (0,), "bad_words_ids": (), "min_length": (0,), "min_new_tokens": (0,),
           "forced_bos_token_id": (), "forced_eos_token_id": (), "suppress_tokens": (), "begin_suppress_tokens": (),
           "sequence_bias": (), "exponential_decay_length_penalty": (), "renormalize_logits": (False,),
           "remove_invalid_values": (False,), "guidance_scale": (1.0,), "watermarking_config": (),
           "penalty_alpha": (), "dola_layers": (), "stop_strings": (), "max_time": (), "token_healing": (False,),
           "prompt_lookup_num_tokens": (), "constraints": (), "force_words_ids": ()}


def why_not(model, capacity: int) -> str | None:
    """Why `Decoder` cannot stand in for `model.generate` on `model` for calls of `capacity` positions
    (prompt width + new tokens); None when it can."""
    if "forward" in vars(model) or "forward" in vars(unwrap(model)):  # accelerate's / `precision.wrap_forward`'s
        device = next(model.parameters()).device.type
        if not torch.is_autocast_enabled(device):
            return "a wrapped forward (an autocast wrapper?) outside an autocast region: it would be skipped"
    model = unwrap(model)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES or not type(model).__name__.endswith("ForCausalLM"):
        return f"{type(model).__name__} ({kind}): only {', '.join(ARCHITECTURES)} causal LMs"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ATTENTION:
        return f"attention implementation {attention!r}"
    inner, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if inner is None or type(head) is not torch.nn.Linear or head.bias is not None:
        return "no plain lm_head over model.model"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1 \
            or getattr(config, "mlp_bias", False):
        return "an MLP other than SiLU-gated without bias"
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return f"hooks on {name or 'the model'}"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global forward hooks"
    params = list(model.parameters())
    dtypes, devices = {p.dtype for p in params}, {p.device.type for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        return f"parameters of dtypes {sorted(map(str, dtypes))}"
    if devices != {"cpu"}:  # on accelerators HF's kernels are not overhead-bound the same way; vLLM is the fast path
        return f"parameters on {sorted(devices)}: the decoder is for CPU"
    size = sum(p.numel() * p.element_size() for p in params)
    if size > MAX_WEIGHT_BYTES:
        return (f"{size / 2**30:.1f} GiB of weights: more than the decoder copies per call "
                f"({MAX_WEIGHT_BYTES / 2**30:.0f} GiB)")
    window = getattr(config, "sliding_window", None)
    sliding = any(t != "full_attention" for t in getattr(config, "layer_types", None) or [])
    if (sliding or kind == "mistral") and window is not None and window < capacity:
        return f"a sliding window of {window} < {capacity} positions"
    for i, layer in enumerate(inner.layers):
        a, mlp = layer.self_attn, layer.mlp
        for name in PROJECTIONS:
            problem = _projection_problem(getattr(a, name, None) or getattr(mlp, name, None))
            if problem:
                return f"model.layers.{i}.{name} is {problem}"
        if len({getattr(m, "base_layer", m).bias is None for m in (a.q_proj, a.k_proj, a.v_proj)}) != 1:
            return "biases on some of q/k/v_proj only"
    gen = getattr(model, "generation_config", None)
    for key, neutral in NEUTRAL.items():
        value = getattr(gen, key, None)
        if value is not None and value not in neutral:
            return f"generation_config.{key} = {value!r} (a logits processor of HF's generate)"
    return None


class Decoder:
    """`model`'s forward with a preallocated KV cache, from its current weights (see the module docstring).
    Build one per generate call (`for_model`): it snapshots the weights it fuses."""

    @classmethod
    def for_model(cls, model, capacity: int) -> Decoder | None:
        return cls(model) if why_not(model, capacity) is None else None

    def __init__(self, model):
        model = unwrap(model)
        config, inner = model.config, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.qk_norm = ARCHITECTURES[config.model_type]
        device = inner.embed_tokens.weight.device
        self.autocast = torch.is_autocast_enabled(device.type)
        self.fp32_attention = self.autocast and config._attn_implementation == "sdpa_cpu_fp32" and device.type == "cpu"
        mm_dtype = torch.get_autocast_dtype(device.type) if self.autocast else None
        self.embed, self.rotary = inner.embed_tokens.weight, inner.rotary_emb
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.head = _Linear([_cast(model.lm_head.weight, mm_dtype)], [None])
        self.layers: list[dict[str, Any]] = []  # per layer: norms, and its projections as four _Linear groups (GROUPS)
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            w = {name: _linear(getattr(a, name, None) or getattr(mlp, name)) for name in PROJECTIONS}
            self.layers.append(dict(
                norm1=(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                **{group: _Linear([_cast(w[name][0], mm_dtype) for name in names],
                                  [None if w[name][1] is None else _cast(w[name][1], mm_dtype) for name in names])
                   for group, names in GROUPS.items()},
                q_norm=(a.q_norm.weight, a.q_norm.variance_epsilon) if self.qk_norm else None,
                k_norm=(a.k_norm.weight, a.k_norm.variance_epsilon) if self.qk_norm else None,
                norm2=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos: list[int], pad_id: int,
                 pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None, n: int = 1) -> torch.Tensor:
        """The new tokens of left-padded prompts `input_ids` (P, T), each decoded as `n` consecutive rows
        (SamplingParams.n): (P·n, steps), steps <= max_new_tokens, rows that finished early padded with `pad_id`
        after their EOS. A prompt's rows share one prefill (its cache and last logits are copied to each), so `n`
        samples of a prompt cost one prompt forward. `pick(step, logits)` returns each row's (B, 1) token from
        its (B, V) float32 logits; default: the argmax."""
        prompts, width = input_ids.shape
        rows, device, capacity = prompts * n, input_ids.device, width + max_new_tokens
        valid = torch.zeros(prompts, capacity, dtype=torch.bool, device=device)
        valid[:, :width] = attention_mask.bool()
        valid[:, width:] = True
        # HF's positions: real tokens count from 0; positions of left padding do not matter (masked)
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        probe = self.embed[:1, None]
        cos, sin = self.rotary(probe, positions)
        cos, sin = cos[:, None], sin[:, None]  # (P, 1, capacity, D)
        cache = torch.empty(len(self.layers), 2, prompts, self.kv_heads,
                            width + min(max_new_tokens, FIRST_CACHE_TOKENS), self.head_dim, dtype=probe.dtype,
                            device=device)
        logits = self._prefill(input_ids, attention_mask, cache, cos, sin, valid)
        if n > 1:  # each prompt's rows from here on
            cache, logits, valid, cos, sin = (t.repeat_interleave(n, dim) for t, dim in
                                              ((cache, 2), (logits, 0), (valid, 0), (cos, 0), (sin, 0)))
        eos_ids = torch.tensor(eos, device=device)
        unfinished = torch.ones(rows, 1, dtype=torch.bool, device=device)
        pick = pick or (lambda _step, logits: logits.argmax(-1, keepdim=True))
        out = []
        for step in range(max_new_tokens):
            token = pick(step, logits.float())
            token = torch.where(unfinished, token, torch.full_like(token, pad_id))
            out.append(token)
            unfinished &= ~torch.isin(token, eos_ids)
            if step + 1 == max_new_tokens or not bool(unfinished.any()):
                break
            at = width + step
            if at == cache.shape[-2]:  # as long as rows run on, not max_new_tokens up front
                cache = _grown(cache, min(capacity, width + 2 * (at - width)))
            if step == 0:  # only when a row goes on past its first token: packing reads every weight once
                self._pack(rows)
            logits = self._forward(token, cache, at, cos[:, :, at:at + 1], sin[:, :, at:at + 1],
                                   valid[:, None, None, :at + 1])
        return torch.cat(out, 1)

    def _prefill(self, input_ids, attention_mask, cache, cos, sin, valid) -> torch.Tensor:
        """Logits at the last token of each left-padded prompt (P, T), its keys and values in `cache`. The tokens
        that every prompt starts with (a system prompt, a chat template's header) run once when there are
        SHARED_PREFIX_MIN of them, their keys and values copied to each prompt's columns; the prompts then run from
        the first column that holds no shared token in some prompt (`_shared_prefix`)."""
        prompts, width = input_ids.shape
        causal = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=input_ids.device)
        mask = ((causal & valid[:, None, :width]) | eye)[:, None]
        pads, shared = _shared_prefix(input_ids, attention_mask)
        start = 0
        if prompts > 1 and shared >= SHARED_PREFIX_MIN:
            first = int(pads[0])
            prefix = input_ids[:1, first:first + shared]
            own = cache.new_empty((*cache.shape[:2], 1, *cache.shape[3:-2], shared, cache.shape[-1]))
            self._layers(prefix, own, 0, cos[:1, :, first:first + shared], sin[:1, :, first:first + shared],
                         causal[None, None, :shared, :shared])
            start = int(pads.min()) + shared
            for p, pad in enumerate(pads.tolist()):
                cache[:, :, p, :, pad:pad + shared] = own[:, :, 0]
                cache[:, :, p, :, :min(pad, start)] = 0  # padding never computed: masked, and finite
        return self._forward(input_ids[:, start:], cache, start, cos[:, :, start:width], sin[:, :, start:width],
                             mask[:, :, start:])

    def _forward(self, tokens, cache, start: int, cos, sin, mask) -> torch.Tensor:
        """Logits at the last of `tokens` (B, T), which sit at positions start .. start+T-1 of the cache."""
        return self.head(_rms_norm(self._layers(tokens, cache, start, cos, sin, mask)[:, -1], self.norm))

    def _layers(self, tokens, cache, start: int, cos, sin, mask) -> torch.Tensor:
        """The residual stream after the last layer (B, T, H), the keys and values of `tokens` written to the cache."""
        rows, length = tokens.shape
        h, d = self.heads, self.head_dim
        x = F.embedding(tokens, self.embed)
        for i, w in enumerate(self.layers):
            normed = _rms_norm(x, w["norm1"])
            q, k, v = (part.view(rows, length, -1, d) for part in w["qkv"].parts(normed))
            if self.qk_norm:
                q, k = _rms_norm_as_hf(q, w["q_norm"]), _rms_norm_as_hf(k, w["k_norm"])
            qk = torch.cat([q, k], 2).transpose(1, 2)
            qk = qk * cos + torch.cat((-qk[..., d // 2:], qk[..., :d // 2]), -1) * sin
            cache[i, 0, :, :, start:start + length] = qk[:, h:]
            cache[i, 1, :, :, start:start + length] = v.transpose(1, 2)
            q, keys, values = qk[:, :h], cache[i, 0, :, :, :start + length], cache[i, 1, :, :, :start + length]
            attn = self._attention(q, keys, values, mask)
            x = x + w["o"](attn.transpose(1, 2).reshape(rows, length, h * d))
            normed = _rms_norm(x, w["norm2"])
            gate, up = w["gate_up"].parts(normed)
            x = x + w["down"](F.silu(gate) * up)
        return x

    def _pack(self, rows: int) -> None:
        """Reorder the weights for decode steps of `rows` rows, when they are too large to stay in the caches (below
        that, a step is not bound by reading them, and oneDNN's per-call cost outweighs what the layout saves)."""
        linears = [self.head, *(w[group] for w in self.layers for group in GROUPS)]
        if sum(lin.nbytes for lin in linears) >= PACK_MIN_BYTES:
            for linear in linears:
                linear.pack(rows)

    def _attention(self, q, keys, values, mask):
        gqa = self.heads != self.kv_heads
        if self.fp32_attention:
            with torch.autocast(q.device.type, enabled=False):
                return F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                                      enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


def _lora_linear():
    try:
        from peft.tuners.lora import Linear
    except ImportError:
        return None
    return Linear


def _projection_problem(module) -> str | None:
    """Why the decoder cannot read one weight (and bias) off this projection; None: a plain nn.Linear, or
    a PEFT LoRA layer over one (its active adapters are added to the weight, `_linear`)."""
    if type(module) is torch.nn.Linear:
        return None
    lora = _lora_linear()
    if lora is None or type(module) is not lora:
        return f"a {type(module).__name__} (a quantised or custom layer)"
    if type(module.base_layer) is not torch.nn.Linear:
        return f"LoRA over a {type(module.base_layer).__name__}"
    if module.merged and module.disable_adapters:
        return "a merged LoRA layer with adapters disabled"
    for name in module.active_adapters:
        variants = getattr(module, "lora_variant", {}) or {}
        if module.use_dora.get(name) or name in variants or (getattr(module, "lora_bias", {}) or {}).get(name):
            return f"LoRA adapter {name!r} with DoRA, a variant or a bias"
    return None


def _linear(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (out, in) weight and bias that `module`'s forward applies: a LoRA layer's base weight plus
    its active, unmerged adapters' scaled B·A (in the weights' dtype, outside any autocast)."""
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias
    base = module.base_layer
    weight = base.weight
    if not module.merged and not module.disable_adapters:
        with torch.autocast(weight.device.type, enabled=False):
            for name in module.active_adapters:
                if name in module.lora_A:
                    weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


def _shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(each prompt's left padding (P,), how many first tokens all prompts share), at most the shortest prompt's
    length less one (its last token runs with the rest); 0 shared where the mask is not plain left padding."""
    width = input_ids.shape[1]
    lengths = attention_mask.sum(1)
    pads = width - lengths
    columns = torch.arange(width, device=input_ids.device)
    if not bool((attention_mask.bool() == (columns >= pads[:, None])).all()):
        return pads, 0
    shortest = int(lengths.min())
    real = input_ids.gather(1, pads[:, None] + columns[:shortest])  # (P, shortest) each prompt's first tokens
    same = (real == real[:1]).all(0)
    return pads, min(int(same.long().cumprod(0).sum()), shortest - 1)


def _grown(cache: torch.Tensor, capacity: int) -> torch.Tensor:
    bigger = cache.new_empty((*cache.shape[:-2], capacity, cache.shape[-1]))
    bigger[..., :cache.shape[-2], :] = cache
    return bigger


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    """`t` detached, in `dtype` (None: as it is, no copy)."""
    return t.detach() if dtype is None else t.detach().to(dtype)


# oneDNN's linear on a weight reordered once (what torch's inductor uses for frozen linears on CPU): at the few rows
# of a decode step it streams the weights faster than `F.linear` (1.3x to 2x its rate at 8 to 16 rows: `python -m
# benchmarks decode_matmul`). MKL's packed GEMM is as fast, but its buffers, several times a small weight's size,
# grew the heap by a weight copy per call.
PACKED_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
PACK_MIN_BYTES = 64 * 2**20  # weights beyond the last-level cache of most CPUs


class _Linear:
    """Projections of one input (q/k/v, gate/up, or one alone): x @ weight.T (+ bias) over x's last dimension for
    each `weights[i]`, in its (out, in) layout, read where it is: a decode step is bound by reading the weights, and
    at a few rows `F.linear` streams that layout faster than an (in, out) copy (which would cost a pass over every
    weight per call besides). `pack(rows)` reorders fp32 weights for oneDNN at that many rows, the group's
    concatenated (a copy, for this call): one call per group then streams them faster still. Inputs of other row
    counts use `F.linear` per projection."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        self.weights, self.biases = weights, biases
        self.sizes = [w.shape[0] for w in weights]
        self.nbytes = sum(w.numel() * w.element_size() for w in weights)
        self.packed: tuple[int, torch.Tensor, torch.Tensor | None] | None = None

    def pack(self, rows: int) -> None:
        first = self.weights[0]
        if PACKED_LINEAR and first.dtype == torch.float32 and first.device.type == "cpu":
            weight = first if len(self.weights) == 1 else torch.cat(self.weights)
            bias = None if all(b is None for b in self.biases) else torch.cat(
                [first.new_zeros(size) if b is None else b for b, size in zip(self.biases, self.sizes, strict=True)])
            self.packed = (rows, torch.ops.mkldnn._reorder_linear_weight(weight, rows), bias)

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each projection of `x`."""
        rows = x.numel() // x.shape[-1]
        if self.packed is not None and self.packed[0] == rows:
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), self.packed[1], self.packed[2], "none", [],
                                                     "")
            return list(out.view(*x.shape[:-1], -1).split(self.sizes, -1))
        return [F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The projection of `x`, for a group of one."""
        (out,) = self.parts(x)
        return out


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """The decoder norms, on the fp32 (or model-dtype) residual stream."""
    weight, eps = norm
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rms_norm_as_hf(x: torch.Tensor, norm) -> torch.Tensor:
    """HF's RMSNorm on a possibly lower-precision input: normalised in fp32, rounded back, then scaled."""
    weight, eps = norm
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
