"""Trainers built on `transformers.Trainer`, one method per module, split the same way every time:
`<method>_params.py` (the method's settings, defaults and checks, shared with params.yaml; no torch),
`<method>.py` (its config = those params + TrainingArguments, and a thin trainer calling `stages.losses`).
Shared mechanics: `preference.py` (pair tokenisation, collation, sequence log-probs), `reference.py`
(the reference model), `online_sampling.py` (sampling settings and seeds), `rollout.py`, `logprobs.py`."""
