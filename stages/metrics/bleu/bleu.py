"""BLEU (sacrebleu's corpus BLEU) as an `evaluate` metric module, loaded from this folder.

    import evaluate
    bleu = evaluate.load("stages/metrics/bleu")       # a local path: no hub access
    bleu.compute(predictions=["the cat sat"], references=[["the cat sat down"]])
    -> {"bleu": 0-100 corpus BLEU, "precisions": [p1..p4], "brevity_penalty", "length_ratio", ...}

One or more references per prediction (a string is taken as one reference). The score is
sacrebleu's default (13a tokenisation, exponential smoothing off), comparable with papers.
"""
import datasets
import evaluate
import sacrebleu

_DESCRIPTION = "Corpus BLEU of predictions against one or more references each (sacrebleu)."
_KWARGS = """
Args:
    predictions: list of str.
    references: list of str or list of list of str (several references per prediction).
    tokenize: sacrebleu tokenizer name ("13a" by default; "char" for languages without spaces).
    lowercase: compare lowercased texts.
Returns:
    bleu (0-100), precisions (n-gram precisions, %), brevity_penalty, length_ratio,
    translation_length, reference_length.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Bleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="Post, 2018 (sacrebleu)", inputs_description=_KWARGS,
            features=[
                datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))}),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, tokenize="13a", lowercase=False):
        refs = [[r] if isinstance(r, str) else list(r) for r in references]
        width = max((len(r) for r in refs), default=0)
        if any(len(r) != width for r in refs):
            raise ValueError("bleu: every prediction needs the same number of references")
        streams = [[r[i] for r in refs] for i in range(width)]  # sacrebleu: one stream per reference position
        score = sacrebleu.corpus_bleu(predictions, streams, tokenize=tokenize, lowercase=lowercase)
        return {"bleu": score.score, "precisions": list(score.precisions), "brevity_penalty": score.bp,
                "length_ratio": score.ratio, "translation_length": score.sys_len,
                "reference_length": score.ref_len}
