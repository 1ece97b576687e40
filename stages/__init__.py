"""align's library: the stages of the alignment pipeline, with no Prefect or DVC inside.

    stages.harness.config     typed params.yaml            stages.harness.registry  the stage table (DAG)
    stages.harness.runner     the stage contract            stages.harness.artifacts fingerprints, manifests
    stages.pipeline   one module per stage          stages.trainers  transformers.Trainer subclasses
    stages.data       loading, formats, validation  stages.builtin   the built-in tiny model and task
    stages.models     model/tokenizer loading
"""
