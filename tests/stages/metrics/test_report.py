"""The headline per model that `dvc metrics show` prints."""
import json

from stages.metrics.report import HEADLINE_MODELS, headline_paths, write_headline


def test_headline_has_one_file_per_model_with_nulls_for_a_model_not_evaluated(tmp_path):
    table = [{"model": "sft", "n": 20, "accuracy": 0.5, "bleu": 3.0, "reward": -0.1, "win_rate": 0.5},
             {"model": "merged", "n": 20, "accuracy": 0.75, "reward": 0.2, "win_rate": 0.6}]
    write_headline(tmp_path, table)
    paths = headline_paths(tmp_path)
    assert list(paths) == list(HEADLINE_MODELS) \
        and sorted(p.name for p in (tmp_path / "metrics" / "models").iterdir()) \
        == ["base.json", "merged.json", "policy.json", "sft.json"]  # no temporary files left
    read = {m: json.loads(p.read_text()) for m, p in paths.items()}
    assert read == {"base": {"accuracy": None, "reward": None, "win_rate": None},
                    "sft": {"accuracy": 0.5, "reward": -0.1, "win_rate": 0.5},
                    "policy": {"accuracy": None, "reward": None, "win_rate": None},
                    "merged": {"accuracy": 0.75, "reward": 0.2, "win_rate": 0.6}}
