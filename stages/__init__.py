"""align's library: the stages of the alignment pipeline, with no Prefect or DVC inside.

    stages.pipeline   one module per stage: run(ctx) -> metrics (preprocess ... evaluate, promote)
    stages.harness    the run machinery: params schema, stage table, runner, artifacts, launchers, logs
    stages.trainers   TRL-shaped configs and transformers.Trainer subclasses, one pair per method
    stages.methods    the method registry: one record per training method; every list of methods derives from it
    stages.losses     pure losses; stages.kernels, logprobs, pair_packing, precision: the model-forward blocks
    stages.data       loading, formats, validation    stages.generation  one generate() over HF, decoder, vLLM
    stages.basics     stable seeds, hashes, progress lines: the bottom, importing nothing of ours

docs/architecture.md draws the layers; each imports only the ones below it.
"""
