"""Bad input: a tracker that is not installed, or not a tracker, stops params validation with the dotted key
and the pip command, before any stage reads data or builds a model."""
from __future__ import annotations

import importlib.util

import pytest

from tests.bad_inputs.conftest import escape
from tests.bad_inputs.test_params import assert_rejected

MISSING = next((n for n in ("wandb", "trackio", "comet_ml", "clearml") if importlib.util.find_spec(n) is None), None)
PIP = {"comet_ml": "comet-ml"}


@pytest.mark.skipif(MISSING is None, reason="every tracker package is installed here")
@pytest.mark.parametrize("sets, key", [
    ((f"sft.report_to=[tensorboard, {MISSING}]",), r"sft\.report_to"),
    ((f"run.report_to={MISSING}",), r"run\.report_to"),  # inherited by every training stage
], ids=["section", "run_default"])
def test_tracker_not_installed(capsys, params_for, sets, key):
    params = params_for()
    err = assert_rejected(capsys, params, "preprocess", escape(params), key, rf"includes '{MISSING}' but its package "
                          rf"is not installed: pip install {PIP.get(MISSING, MISSING)}", sets=sets, code=2)
    assert "nothing was run or written" in err


def test_unknown_tracker_lists_the_supported_ones(capsys, params_for):
    params = params_for()
    assert_rejected(capsys, params, "sft", r"policy\.dpo\.report_to = \['tensorbord'\]: unknown tracker 'tensorbord'; "
                    r"supported: tensorboard, wandb, mlflow, trackio, dvclive, comet_ml, clearml, none",
                    sets=("policy.dpo.report_to=[tensorbord]",), code=2)
