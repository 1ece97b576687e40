"""The path of one DPO forward through our own modules, traced: modules visited, stops, steps back up the layers
and where the model is unwrapped. Reproduces the counts in docs/architecture.md ("The DPO forward").

    PYTHONPATH=. python -m benchmarks.forward_path [--first] [--show]

One `DPOTrainer.compute_loss` on a tiny built-in model (2 layers, batch of 4 pairs, live frozen reference, chunked
log-probs, pairs packed on their prefix), after a warm-up step so the once-per-model packing check is not counted
(--first counts that step instead). `sys.setprofile` records every Python function called in a `stages.` module
below `compute_loss` (generator expressions and comprehensions left out; the pure loss `stages.losses` and the
trainer's own metrics are left out: they run after the log-probs, not on the way to them).

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


def trace(fn) -> list[tuple[str, str]]:
    """(module, function) of every call in a `stages.` module while `fn()` runs."""
    calls: list[tuple[str, str]] = []
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
        calls.append((module, frame.f_code.co_qualname))

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


def counts(calls: list[tuple[str, str]]) -> dict:
    mods = [m for m, _ in calls]
    h = heights(set(mods))
    ups = [(a, b) for (a, _), (b, _) in itertools.pairwise(calls) if h[b] > h[a]]
    unwraps = [i for i, (m, f) in enumerate(calls) if (m, f) == ("stages.sharding", "unwrap_wrappers")]
    callers = sorted({calls[i - 1][0] + "." + calls[i - 1][1] for i in unwraps if i})
    return {"stops": len(calls), "modules": sorted(set(mods), key=lambda m: -h[m]), "heights": h,
            "steps_up": len(ups), "unwraps": len(unwraps), "unwrapped_after": callers}


def dpo_step(first: bool):
    import torch
    from transformers import AutoModelForCausalLM

    from stages.trainers.dpo_trainer import DPOConfig, DPOTrainer
    from tests.stages.trainers.conftest import build_tiny, builtin_rows

    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp())
    path = build_tiny(folder, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rows = builtin_rows("preference", "preference", num_preference=8)
    args = DPOConfig(output_dir=str(folder), per_device_train_batch_size=4, report_to="none", use_cpu=True,
                     save_strategy="no", disable_tqdm=True, precompute_ref_log_probs=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = DPOTrainer(model, args=args, processing_class=tok, train_dataset=rows)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    step = lambda: trainer.compute_loss(trainer.model, batch)  # noqa: E731
    if not first:
        step()
    return trace(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--first", action="store_true", help="trace the first step (with the packing check)")
    p.add_argument("--show", action="store_true", help="print every stop")
    a = p.parse_args()
    calls = dpo_step(a.first)
    c = counts(calls)
    if a.show:
        for m, f in calls:
            print(f"  {'  ' * (max(c['heights'].values()) - c['heights'][m])}{m}.{f}")
    print(f"stops {c['stops']}, modules {len(c['modules'])}, steps back up {c['steps_up']}, "
          f"unwrap_wrappers calls {c['unwraps']}")
    print("modules (top layer first):", ", ".join(f"{m}[{c['heights'][m]}]" for m in c["modules"]))
    print("unwrapped right after:", ", ".join(c["unwrapped_after"]))


if __name__ == "__main__":
    main()
