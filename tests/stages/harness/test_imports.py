"""stages.harness.imports: the static import analysis that a stage's code (fingerprint, dvc.yaml deps) comes from,
checked on a hand-made package, against what importing each stage really loads, and for import cycles."""
import subprocess
import sys
import textwrap

import pytest

from stages.harness import imports
from stages.harness.registry import STAGES
from tests.conftest import ROOT

LAYERS = ("stages", "tasks", "flows")


def write_tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_closure_of_a_hand_made_package(tmp_path):
    write_tree(tmp_path, {
        "stages/__init__.py": "",
        "stages/a.py": """
            from typing import TYPE_CHECKING
            import json
            from . import b                  # relative, a submodule
            from .sub import thing           # relative, a name of the package: sub/__init__.py
            if TYPE_CHECKING:
                from stages import never  # never runs
            else:
                from stages import c
            def f():
                import stages.sub.lazy       # runs when f is called
            """,
        "stages/b.py": "from stages.sub.deep import x\n",
        "stages/c.py": "",
        "stages/never.py": "import stages.unused\n",
        "stages/unused.py": "",
        "stages/sub/__init__.py": "thing = 1\n",
        "stages/sub/deep.py": "x = 1\n",
        "stages/sub/lazy.py": "CODE_FILES = ('scripts/metric.py',)  # loaded by path\n",
        "stages/sub/scripts/metric.py": "",
    })
    assert imports.closure("stages.a", tmp_path) == (
        "stages/__init__.py", "stages/a.py", "stages/b.py", "stages/c.py", "stages/sub/__init__.py",
        "stages/sub/deep.py", "stages/sub/lazy.py", "stages/sub/scripts/metric.py")
    found = {(i.module, i.lazy) for i in imports.imports("stages.a", imports.module_index(("stages",), tmp_path))}
    assert found == {("stages.b", False), ("stages.sub", False), ("stages.c", False), ("stages.sub.lazy", True)}


def test_a_code_file_that_does_not_exist_is_an_error(tmp_path):
    write_tree(tmp_path, {"stages/__init__.py": "", "stages/m.py": "CODE_FILES = ('gone.py',)\n"})
    with pytest.raises(FileNotFoundError, match=r"stages/m.py: CODE_FILES names gone.py, which does not exist"):
        imports.closure("stages.m", tmp_path)


def test_cycle_finder_reports_a_lazy_cycle(tmp_path):
    write_tree(tmp_path, {"stages/__init__.py": "", "stages/a.py": "from stages import b\n",
                          "stages/b.py": "def f():\n    from stages.a import g\n"})
    cycle = imports.find_cycle(imports.import_graph(("stages",), tmp_path))
    assert describe(cycle) == "stages.a\n  -> stages.b (stages.a:1)\n  -> stages.a (stages.b:2, lazy)"


def test_cycle_finder_counts_type_checking_imports(tmp_path):
    write_tree(tmp_path, {"stages/__init__.py": "", "stages/a.py": "from stages import b\n",
                          "stages/b.py": "from typing import TYPE_CHECKING\n"
                                         "if TYPE_CHECKING:\n    from stages.a import g\n"})
    assert imports.find_cycle(imports.import_graph(("stages",), tmp_path)) is None  # nothing runs it
    cycle = imports.find_cycle(imports.import_graph(("stages",), tmp_path, type_checking=True))
    assert describe(cycle) == "stages.a\n  -> stages.b (stages.a:1)\n  -> stages.a (stages.b:3, lazy)"


def describe(cycle: list) -> str:
    """stages.a\n  -> stages.b (stages.a:3)\n  -> stages.a (stages.b:2, lazy)"""
    lines = [cycle[0]]
    for k in range(1, len(cycle), 2):
        edge = cycle[k]
        lines.append(f"  -> {cycle[k + 1]} ({cycle[k - 1]}:{edge.line}{', lazy' if edge.lazy else ''})")
    return "\n".join(lines)


def test_no_import_cycles_in_stages_tasks_flows():
    """Module-level, lazy and `if TYPE_CHECKING:` imports alike: a cycle a type checker follows is a cycle."""
    cycle = imports.find_cycle(imports.import_graph(LAYERS, type_checking=True))
    assert cycle is None, "import cycle:\n" + describe(cycle)


def layer(module: str) -> str:
    """stages/ in layers, bottom up: basics (imports nothing of ours), the building blocks (losses, kernels, data,
    generation, reward functions and models, merging, ...), trainers, then the harness and the pipeline's stages."""
    part = module.split(".")[1] if "." in module else ""
    if part == "basics":
        return "basics"
    if part in ("trainers", "harness", "pipeline"):
        return part
    return "top" if part in ("", "__main__") else "blocks"


# What each layer may import of ours (module-level, lazy and TYPE_CHECKING imports alike).
MAY_IMPORT = {"basics": set(), "blocks": {"basics", "blocks"}, "trainers": {"basics", "blocks", "trainers"},
              "harness": {"basics", "blocks", "trainers", "harness", "pipeline"},
              "pipeline": {"basics", "blocks", "trainers", "harness", "pipeline"},
              "top": {"basics", "blocks", "trainers", "harness", "pipeline", "top"}}


def test_imports_point_down_the_layers():
    """The harness may import building blocks and trainers, never the reverse; trainers never import the pipeline;
    the bottom module imports nothing of ours."""
    graph = imports.import_graph(("stages",), type_checking=True)
    wrong = [f"{m} ({layer(m)}) imports {e.module} ({layer(e.module)}) at line {e.line}"
             for m, edges in graph.items() for e in edges if layer(e.module) not in MAY_IMPORT[layer(m)]]
    assert wrong == []
    assert {layer(m) for m in graph} == set(MAY_IMPORT)  # every layer exists: the test can fail


def test_the_layer_rule_catches_a_block_that_imports_the_harness(tmp_path):
    write_tree(tmp_path, {"stages/__init__.py": "", "stages/harness/__init__.py": "", "stages/harness/runner.py": "",
                          "stages/kernels.py": "from stages.harness import runner\n"})
    graph = imports.import_graph(("stages",), tmp_path)
    assert [(m, e.module) for m, edges in graph.items() for e in edges
            if layer(e.module) not in MAY_IMPORT[layer(m)]] == [("stages.kernels", "stages.harness.runner")]


def test_the_library_imports_neither_prefect_nor_dvc():
    found = [f"{path}:{s.line} imports {s.module}" for name, path in imports.module_index(("stages",)).items()
             for s in imports.statements(path, name) if s.module.split(".")[0] in ("prefect", "dvc")]
    assert found == []


def test_every_file_under_stages_is_a_module_or_a_declared_code_file():
    """A .py file that is not importable by name runs only if something loads it by path: it must be in a
    module's CODE_FILES, or no stage's fingerprint would see it change."""
    index = imports.module_index(("stages",))
    modules = {path.relative_to(ROOT).as_posix() for path in index.values()}
    declared = {f.relative_to(ROOT).as_posix() for m in index for f in imports.code_files(m, index)}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "stages").rglob("*.py") if "__pycache__" not in p.parts}
    assert files - modules - declared == set()
    assert declared == {"stages/metrics/bleu/bleu.py", "stages/metrics/rouge/rouge.py",  # loaded by path
                        # read as data: the judge's prompt, the shipped lm-eval tasks
                        "stages/evaluation/prompts/pairwise.txt", "stages/evaluation/tasks/align_arithmetic.yaml",
                        "stages/evaluation/tasks/align_gsm8k.yaml"}


# Loads the heavy third-party packages once, then imports each stage's module in a forked child (a fresh
# sys.modules as far as the project is concerned) and prints the project modules it loaded.
IMPORT_EACH = """
import importlib, os, sys
import accelerate, datasets, peft, torch, transformers
assert not [m for m in sys.modules if m.split(".")[0] == "stages"]
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        importlib.import_module(module)
        print(module, *(m for m in sys.modules if m.split(".")[0] == "stages"), flush=True)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0, module
"""


def test_importing_a_stage_loads_only_modules_of_its_static_closure():
    """Each stage's module imported in a fresh interpreter: every `stages.*` module it loads is in the closure
    that its fingerprint and dvc.yaml hash (a dynamic import the analysis misses would show up here)."""
    modules = [spec.module for spec in STAGES.values()]
    res = subprocess.run([sys.executable, "-c", IMPORT_EACH, *modules], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded = {line.split()[0]: set(line.split()[1:]) for line in res.stdout.splitlines()}
    assert list(loaded) == modules
    for module, found in loaded.items():
        assert module in found and "stages.pipeline" in found
        missed = found - set(imports.closure_modules(module))
        assert not missed, f"{module}: loaded {sorted(missed)}, which stages.harness.imports does not see"
