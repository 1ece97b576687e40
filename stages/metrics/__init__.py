"""Text metrics shipped with the repository as `evaluate` metric modules (the hub's cannot be fetched here).

    from stages.metrics import load_metric
    load_metric("bleu").compute(predictions=[...], references=[...])

`bleu/bleu.py` wraps sacrebleu, `rouge/rouge.py` wraps rouge-score; `evaluate.load` reads
them from their folder. `report` draws the evaluate stage's plots and writes its report.
"""
from __future__ import annotations

from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent
# Loaded by path, not imported: listed so that they are part of the code of every stage importing this module
# (stages.harness.imports reads this literal).
CODE_FILES = ("bleu/bleu.py", "rouge/rouge.py")
LOCAL_METRICS = tuple(Path(f).parent.name for f in CODE_FILES)


def load_metric(name: str):
    """`evaluate.load` of a metric module shipped in this folder."""
    import evaluate

    if name not in LOCAL_METRICS:
        raise ValueError(f"metric {name!r}: not shipped; local metrics: {', '.join(LOCAL_METRICS)}")
    return evaluate.load(str(METRICS_DIR / name))
