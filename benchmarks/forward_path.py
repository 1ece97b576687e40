"""The path of one DPO forward through our own modules, traced: modules visited, stops, steps back up the layers
and where the model is unwrapped. Reproduces the counts in docs/architecture.md ("The DPO forward").

    python -m benchmarks forward_path [--first] [--show]

One `DPOTrainer.compute_loss` on a tiny built-in model (2 layers, batch of 4 pairs, live frozen reference, chunked
log-probs, pairs packed on their prefix), after a warm-up step so the once-per-model packing check is not counted
(--first counts that step instead). `sys.setprofile` records every Python function called in a `stages.` module
below `compute_loss` (generator expressions, comprehensions, lambdas and a generator's resumption left out, and
the pure loss `stages.losses`, which runs after the log-probs, not on the way to them).

- a stop: one such call;
- modules: the distinct modules of the stops;
- a step back up: a stop whose module lies in a higher layer than the previous stop's module. A module's layer is
  its height in the import graph of the visited modules (a module is above every module it imports, at its top or
  inside a function): kernels and sharding at the bottom, the trainer at the top;
- unwraps: calls of `stages.sharding.unwrap_wrappers` (which `unwrap` calls too).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import itertools
import sys
import tempfile
from functools import cache
from pathlib import Path

SKIP_MODULES = ("stages.losses",)
SKIP_FUNCS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>")


def trace(fn) -> list[tuple[str, str, str]]:
    """(module, function, its caller as module.function) of every call in a `stages.` module while `fn()` runs."""
    calls: list[tuple[str, str, str]] = []
    resumable: list = []  # generator frames seen: a generator resumed (a context manager's exit) is no new stop

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        name = frame.f_code.co_name
        if not module.startswith("stages.") or module.startswith(SKIP_MODULES) or name in SKIP_FUNCS:
            return
        if "__create_fn__" in frame.f_code.co_qualname:  # a dataclass's generated __init__
            return
        if frame.f_code.co_flags & inspect.CO_GENERATOR:
            if any(f is frame for f in resumable):
                return
            resumable.append(frame)
        caller = frame.f_back
        where = f"{caller.f_globals.get('__name__', '')}.{caller.f_code.co_qualname}" if caller else ""
        calls.append((module, frame.f_code.co_qualname, where))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def imports(module: str) -> set[str]:
    """The `stages.` modules `module` imports anywhere in its source."""
    path = importlib.import_module(module).__file__
    assert path is not None
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stages"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("stages"))
    return out


def heights(modules: set[str]) -> dict[str, int]:
    """Each module's height in the import graph restricted to `modules` (0: imports none of them)."""
    @cache
    def height(m: str, seen: frozenset = frozenset()) -> int:
        below = [d for d in imports(m) & modules if d != m and d not in seen]
        return 1 + max((height(d, seen | {m}) for d in below), default=-1)
    return {m: height(m) for m in modules}


def counts(calls: list[tuple[str, str, str]], h: dict[str, int]) -> dict:
    mods = [m for m, _, _ in calls]
    ups = [i for i, (a, b) in enumerate(itertools.pairwise(mods), 1) if h[b] > h[a]]
    unwraps = [where for m, f, where in calls if (m, f) == ("stages.sharding", "unwrap_wrappers")]
    return {"stops": len(calls), "modules": sorted(set(mods), key=lambda m: (-h[m], m)), "ups": ups,
            "unwraps": unwraps}


def dpo_trainer():
    """A DPOTrainer on a tiny built-in Llama (2 layers) and 8 built-in preference pairs, and one batch of 4."""
    import dataclasses

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.builtin import arithmetic, tiny
    from stages.data.formats import normalise
    from stages.harness.config import ArithmeticConfig
    from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer

    folder = Path(tempfile.mkdtemp())
    path = tiny.build(folder / "tiny", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                      vocab_size=384, seed=0)
    task = ArithmeticConfig(num_train=10, num_preference=8, num_eval=10, num_dev=0)
    rows = [normalise("preference", r) for r in arithmetic.generate(**dataclasses.asdict(task))["preference"]]
    args = DPOConfig(output_dir=str(folder / "out"), per_device_train_batch_size=4, report_to="none", use_cpu=True,
                     save_strategy="no", disable_tqdm=True, seed=0, precompute_ref_log_probs=False)
    trainer = DPOTrainer(AutoModelForCausalLM.from_pretrained(path), args=args,
                         processing_class=AutoTokenizer.from_pretrained(path), train_dataset=rows)
    return trainer, trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def dpo_step(first: bool = False) -> list[tuple[str, str, str]]:
    """The calls of one `DPOTrainer.compute_loss` (`trace`); after a warm-up step unless `first`."""
    trainer, batch = dpo_trainer()
    step = lambda: trainer.compute_loss(trainer.model, batch)  # noqa: E731
    if not first:
        step()
    return trace(step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks forward_path", description=__doc__.splitlines()[0])
    p.add_argument("--first", action="store_true", help="trace the first step (with the packing check)")
    p.add_argument("--show", action="store_true", help="print every stop, indented by layer, ^ at a step back up")
    p.add_argument("--tiny", action="store_true", help="accepted for the suite: the run is always this small")
    a = p.parse_args(argv)
    calls = dpo_step(a.first)
    h = heights({m for m, _, _ in calls})
    top = max(h.values())
    whole = counts(calls, h)
    if a.show:  # indented by layer, top layer first; a step back up is marked ^
        for i, (m, f, _) in enumerate(calls):
            print(f"{'^' if i in whole['ups'] else ' '} {'  ' * (top - h[m])}{m}.{f}")
    end = next(i for i, (_, f, _) in enumerate(calls) if f.endswith(".reference_logps"))
    parts = (("compute_loss, policy and reference", calls), ("compute_loss up to the reference", calls[:end]))
    for name, part in parts:
        c = counts(part, h)
        print(f"{name}: {c['stops']} stops in {len(c['modules'])} modules, {len(c['ups'])} steps back up, "
              f"{len(c['unwraps'])} unwrap_wrappers calls")
        print("  modules (layer):", ", ".join(f"{m.removeprefix('stages.')}[{h[m]}]" for m in c["modules"]))
        print("  unwrapped in:", ", ".join(sorted(set(c["unwraps"]))) or "-")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
