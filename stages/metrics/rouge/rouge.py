"""ROUGE (Google's rouge-score) as an `evaluate` metric module, loaded from this folder.

    import evaluate
    rouge = evaluate.load("stages/metrics/rouge")     # a local path: no hub access
    rouge.compute(predictions=["the cat sat"], references=["the cat sat down"])
    -> {"rouge1": mean F1, "rouge2": ..., "rougeL": ..., "rougeLsum": ...}

Scores are F-measures in [0, 1], averaged over the predictions (use_aggregator=False: one
list per rouge type). With several references per prediction the best-matching one counts.
"""
import datasets
import evaluate
from rouge_score import rouge_scorer, scoring

_DESCRIPTION = "ROUGE-N / ROUGE-L F-measures of predictions against references (rouge-score)."
_KWARGS = """
Args:
    predictions: list of str.
    references: list of str or list of list of str.
    rouge_types: default ["rouge1", "rouge2", "rougeL", "rougeLsum"].
    use_stemmer: Porter-stem words before matching.
    use_aggregator: mean over predictions (True) or per-prediction lists (False).
Returns:
    {rouge_type: F-measure (mean, or a list)}.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="Lin, 2004", inputs_description=_KWARGS,
            features=[
                datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))}),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, rouge_types=None, use_stemmer=False, use_aggregator=True):
        rouge_types = rouge_types or ["rouge1", "rouge2", "rougeL", "rougeLsum"]
        scorer = rouge_scorer.RougeScorer(rouge_types=rouge_types, use_stemmer=use_stemmer)
        scores = []
        for pred, ref in zip(predictions, references, strict=True):
            refs = [ref] if isinstance(ref, str) else list(ref)
            scores.append(scorer.score_multi(refs, pred) if len(refs) > 1 else scorer.score(refs[0], pred))
        if use_aggregator:
            agg = scoring.BootstrapAggregator()
            for s in scores:
                agg.add_scores(s)
            result = agg.aggregate()
            return {k: float(v.mid.fmeasure) for k, v in result.items()}
        return {k: [float(s[k].fmeasure) for s in scores] for k in rouge_types}
