"""Trainers built on `transformers.Trainer`, one module per method: a config, a thin trainer calling `stages.losses`."""
