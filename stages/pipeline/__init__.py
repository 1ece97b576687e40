"""One module per pipeline stage; each exposes `run(ctx: StageContext) -> metrics`. See stages.harness.registry."""
