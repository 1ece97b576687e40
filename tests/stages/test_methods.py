"""The method registry (`stages.methods`): every list of methods derives from its records.

The toy-method tests add a method the way docs/architecture.md says to ("How to add a method"): a config, a
trainer, a loss and one record, in a temporary copy of the project, and check that params.yaml, dvc.yaml,
params validation and the flow pick it up with no other edit.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from stages.harness.config import POLICY_METHODS, TRAINING_SECTIONS, Params, PolicyParams
from stages.harness.registry import STAGES, TRAINING_STAGES
from stages.methods import KIND_DATA, METHODS
from tests.conftest import ROOT, SMALL, deep_update


def load(ref: str):
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def test_every_record_names_a_config_and_a_trainer_that_exist():
    import stages.trainers

    for m in METHODS.values():
        config, trainer = load(m.config), load(m.trainer)
        assert config.__name__.removesuffix("Config") == trainer.__name__.removesuffix("Trainer"), m.name
        assert getattr(stages.trainers, config.__name__) is config  # `from stages.trainers import ...` gives both
        assert getattr(stages.trainers, trainer.__name__) is trainer
        assert m.kind in KIND_DATA


def test_sections_and_choices_come_from_the_records():
    policy = [m.name for m in METHODS.values() if m.policy]
    assert list(TRAINING_SECTIONS) == [m.section for m in METHODS.values()]
    assert POLICY_METHODS == (*policy, "none")
    assert typing.get_args(typing.get_type_hints(PolicyParams)["method"]) == POLICY_METHODS
    assert [f.name for f in dataclasses.fields(PolicyParams)] == ["method", "data", "num_prompts", *policy]
    for m in METHODS.values():  # each section is the one its config module declares beside the config
        section = TRAINING_SECTIONS[m.section]
        assert section.CONFIG == m.config
        assert section.__name__ == m.config.partition(":")[2].replace("Config", "Section")
        assert section.__module__ == m.config.partition(":")[0] + "_light"  # read torch-free
    params = Params()
    assert set(params.training_sections()) == set(TRAINING_STAGES) == {"sft", "reward", "policy"}
    assert all(STAGES[s].trains for s in TRAINING_STAGES)


def test_the_policy_stage_hashes_every_policy_trainer():
    code = STAGES["policy"].code()
    for m in METHODS.values():
        if m.policy:
            assert m.trainer.partition(":")[0].replace(".", "/") + ".py" in code, m.name
    assert "stages/trainers/sft_trainer.py" not in code  # only what it runs


# ------------------------------------------------------------------------------ a toy method, added as documented

TOY_LOSS = '''"""The toy method's loss: a hinge on the chosen-minus-rejected log-prob margin (SLiC's)."""
import torch


def hinge_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float, margin: float
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """chosen_logps, rejected_logps: (B,) summed completion log-probs -> (loss, metrics)."""
    gap = beta * (chosen_logps - rejected_logps)
    return torch.relu(margin - gap).mean(), {"gap": gap.detach().mean()}
'''

TOY_CONFIG = '''"""ToyConfig: the toy method's settings."""
from __future__ import annotations

from dataclasses import dataclass

from stages.fields import check_fields, positive
from stages.trainers.arguments import MethodConfig, refuses_trl_fields, training_arguments
from stages.trainers.pipeline_section import TrainingStage, section, stage_default

TrainingArguments = training_arguments()


@refuses_trl_fields
@dataclass
class ToyConfig(MethodConfig, TrainingArguments):
    beta: float = positive(1.0, "scale of the chosen-minus-rejected log-prob gap")
    margin: float = positive(2.0, "pairs whose scaled gap exceeds this add no loss")
    max_length: int = positive(512, "truncate prompt + completion to this many tokens")

    def validate(self) -> list[tuple[str, str]]:
        return check_fields(self, ToyConfig)


@section
class ToySection(TrainingStage, ToyConfig):
    """Section `policy.toy`: ToyConfig plus the pipeline's keys and defaults."""

    learning_rate: float = stage_default(1e-3, "the toy's hinge needs a larger step than TrainingArguments' 5e-5")
'''

TOY_TRAINER = '''"""ToyTrainer: pairs through the model, the hinge loss on their log-prob gap (no reference)."""
from __future__ import annotations

from functools import partial

from transformers import Trainer

from stages.losses.toy import hinge_loss
from stages.trainers.pair_batches import PairCollator, sequence_logps, tokenize_pairs, tokenized_dataset
from stages.trainers.toy_config import ToyConfig


class ToyTrainer(Trainer):
    def __init__(self, model, args: ToyConfig, processing_class, train_dataset, callbacks=None):
        rows = tokenized_dataset(list(train_dataset), "chosen_input_ids",
                                 partial(tokenize_pairs, processing_class, max_length=args.max_length),
                                 tokenizer=processing_class)
        args.remove_unused_columns = False
        super().__init__(model=model, args=args, data_collator=PairCollator(processing_class.pad_token_id),
                         processing_class=processing_class, train_dataset=rows, callbacks=callbacks)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chosen, rejected = sequence_logps(model, inputs, pairs=True).chunk(2)
        loss, _ = hinge_loss(chosen, rejected, beta=self.args.beta, margin=self.args.margin)
        return loss
'''

TOY_RECORD = '''    Method("toy", "offline", _T + "toy_config:ToyConfig", _T + "toy_trainer:ToyTrainer",
           reference=False),
'''


def test_the_toy_loss_is_the_hinge():
    """gap = beta * (chosen - rejected) = 1.0 * ([-1, -4] - [-3, -2]) = [2, -2]; with margin 1:
    relu(1 - [2, -2]) = [0, 3], mean 1.5."""
    namespace: dict = {}
    exec(TOY_LOSS, namespace)  # the loss the toy method's files hold
    import torch

    loss, metrics = namespace["hinge_loss"](torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -2.0]), beta=1.0,
                                            margin=1.0)
    assert loss.item() == 1.5 and metrics["gap"].item() == 0.0


@pytest.fixture(scope="module")
def toy_project(tmp_path_factory) -> Path:
    """A copy of the project with the toy method added: its three files and one record, nothing else."""
    root = tmp_path_factory.mktemp("toy") / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("stages", "flows", "tasks"):
        shutil.copytree(ROOT / folder, root / folder, ignore=ignore)
    (root / "stages" / "losses" / "toy.py").write_text(TOY_LOSS)
    (root / "stages" / "trainers" / "toy_config.py").write_text(TOY_CONFIG)
    (root / "stages" / "trainers" / "toy_trainer.py").write_text(TOY_TRAINER)
    registry = root / "stages" / "methods.py"
    text = registry.read_text()
    assert text.count("\n]}\n") == 1
    registry.write_text(text.replace("\n]}\n", "\n" + TOY_RECORD + "]}\n"))
    return root


def run_in(root: Path, *args: str, timeout: int = 300, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)


def toy_params(root: Path, **extra) -> Path:
    """The toy copy's rendered params.yaml with small settings, policy.method toy, outputs in the copy."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    deep_update(params, SMALL)
    deep_update(params, {"run": {"output_dir": str(root / "artifacts")}, "policy": {
        "method": "toy", "toy": {"max_steps": 3, "per_device_train_batch_size": 4, "logging_steps": 1}}})
    deep_update(params, extra)
    path = root / "toy.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def test_a_toy_method_reaches_params_dvc_yaml_and_validation(toy_project):
    root = toy_project
    rendered = run_in(root, "-m", "stages", "params", "--params", "params.yaml", "--write")
    assert rendered.returncode == 0, rendered.stderr
    text = (root / "params.yaml").read_text()
    params = yaml.safe_load(text)
    toy = params["policy"]["toy"]  # the section is the config plus the pipeline's keys, ToySection's defaults
    assert (toy["beta"], toy["margin"], toy["learning_rate"]) == (1.0, 2.0, 1e-3)
    assert "lora" in toy and "mixed_precision" in toy
    method_line = next(line for line in text.splitlines() if line.strip().startswith("method:"))
    assert "| toy |" in method_line  # among the choices the comment lists (cut with "..." past its width)

    dvc = run_in(root, "-m", "stages", "dvc-yaml")
    assert dvc.returncode == 0, dvc.stderr
    deps = yaml.safe_load(dvc.stdout)["stages"]["policy"]["deps"]
    assert {"stages/trainers/toy_trainer.py", "stages/trainers/toy_config.py", "stages/losses/toy.py"} <= set(deps)
    sft_deps = yaml.safe_load(dvc.stdout)["stages"]["sft"]["deps"]
    assert "stages/trainers/toy_trainer.py" not in sft_deps and "stages/methods.py" not in sft_deps

    bad = run_in(root, "-m", "stages", "status", "--params", str(toy_params(root)),
                 "--set", "policy.toy.margin=-1", "--set", "policy.toy.bogus=1")
    assert bad.returncode == 2
    assert "policy.toy.margin = -1: must be > 0" in bad.stderr and "policy.toy.bogus" in bad.stderr, bad.stderr
    # kind offline: the data checks ask it for pairs, as they ask DPO
    no_pairs = run_in(root, "-m", "stages", "status", "--params", str(toy_params(root)), "--set", "policy.data=score",
                      "--set", "score.enabled=false")
    assert no_pairs.returncode == 2 and "policy.method = toy has no pairs" in no_pairs.stderr, no_pairs.stderr


@pytest.mark.slow
def test_a_toy_method_trains_in_the_flow(toy_project, tmp_path):
    """The flow runs the toy method's trainer in stage policy: the manifest names it, the loss is the hinge's."""
    root = toy_project
    if not (root / "params.yaml").exists():
        assert run_in(root, "-m", "stages", "params", "--params", "params.yaml", "--write").returncode == 0
    params = toy_params(root, evaluate={"max_samples": 4, "baseline": False})
    code = ("import json, sys; from flows.align import align; "
            "s = align(params_file=sys.argv[1]); print(json.dumps([r['stage'] for r in s['stages']]))")
    flow = run_in(root, "-c", code, str(params), timeout=900,
                  PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(tmp_path / "results"),
                  PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")  # 20 s is short on a loaded machine
    assert flow.returncode == 0, flow.stderr[-3000:]
    assert json.loads(flow.stdout.strip().splitlines()[-1])[-1] == "evaluate"
    metrics = json.loads((root / "artifacts" / "policy" / "manifest.json").read_text())["metrics"]
    assert metrics["method"] == "toy" and metrics["steps"] == 3
    losses = [h["loss"] for h in json.loads((root / "artifacts" / "policy" / "log_history.json").read_text())
              if "loss" in h]
    assert len(losses) == 3 and all(0.0 <= v < 100 for v in losses)  # a hinge: never negative
