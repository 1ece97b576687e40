"""Which project code a module runs, read from its import statements (nothing is imported).

A stage's code is `closure(entry_module)`: the entry module, every project module it imports,
transitively, and the package `__init__.py` files that importing them runs. All of these count:

    import stages.data.io                    # stages/data/io.py (and stages/data/__init__.py)
    from stages.generation import hf         # a submodule: stages/generation/hf.py
    from stages.data import read_jsonl       # a name: stages/data/__init__.py
    from .common import Generations          # relative to the importing module's package
    def f(): from stages.metrics import report   # lazy: runs when the stage calls f

Imports under `if TYPE_CHECKING:` never run and are skipped. A module that loads project files
by path rather than by import (`evaluate.load` of stages/metrics/bleu/bleu.py) names them in a
module-level `CODE_FILES = ("bleu/bleu.py", ...)` (relative to its folder), read here as a literal.
Imports of user code named in params ("mypkg.rewards:score") are the user's, not the project's,
and the standard library and third-party packages are versioned by the manifest, not hashed.

`tests/stages/test_imports.py` checks the analysis against what importing each stage really loads,
and walks `import_graph` of stages/, tasks/ and flows/ for cycles.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

from stages.artifacts import CODE_ROOT

LIBRARY = ("stages",)  # the packages a stage's code can come from (tasks/ and flows/ are never imported by them)


@dataclass(frozen=True)
class Import:
    module: str  # the project module imported ("stages.data.io")
    line: int
    lazy: bool  # inside a function body: runs when the function is called


def module_file(name: str, root: Path = CODE_ROOT) -> Path | None:
    """The file of module `name` under `root` (a package's `__init__.py`), or None if there is none."""
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imports(name: str, root: Path = CODE_ROOT, packages: tuple[str, ...] = LIBRARY) -> list[Import]:
    """The imports of module `name` that name a module of `packages` (top-level names), in source order."""
    path = module_file(name, root)
    if path is None:
        raise ModuleNotFoundError(f"{name}: no {name.replace('.', '/')}.py or {name.replace('.', '/')}/__init__.py "
                                  f"under {root}")
    found = _imports(path.read_bytes(), name, path.name == "__init__.py", str(path))
    exists = functools.partial(_exists, root=root)
    out = []
    for base, names, line, lazy in found:
        if base.split(".")[0] not in packages:
            continue
        # `from pkg import x` imports pkg and, when x is a submodule, pkg.x; `import a.b` imports a.b
        targets = [f"{base}.{n}" for n in names if exists(f"{base}.{n}")]
        if not targets or len(targets) < len(names):
            targets.insert(0, base)
        out += [Import(t, line, lazy) for t in targets if exists(t)]
    return out


def _exists(name: str, root: Path) -> bool:
    return module_file(name, root) is not None


@functools.lru_cache(maxsize=4096)
def _imports(source: bytes, name: str, is_package: bool, filename: str) -> list[tuple[str, tuple[str, ...], int, bool]]:
    """(imported module, names imported from it, line, lazy) for each import statement that runs."""
    tree = ast.parse(source, filename=filename)
    package = name if is_package else name.rpartition(".")[0]
    out: list[tuple[str, tuple[str, ...], int, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:  # only the else branch runs
                    visit_one(sub, lazy)
                continue
            visit_one(child, lazy)

    def visit_one(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((alias.name, (), node.lineno, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{node.module}" if node.module else anchor
            else:
                base = node.module or ""
            out.append((base, tuple(a.name for a in node.names if a.name != "*"), node.lineno, lazy))
        else:
            visit(node, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def code_files(name: str, root: Path = CODE_ROOT) -> list[Path]:
    """The files module `name` loads by path: its module-level `CODE_FILES` literal, resolved."""
    path = module_file(name, root)
    for node in ast.parse(path.read_bytes(), filename=str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CODE_FILES" for t in node.targets):
            files = [path.parent / rel for rel in ast.literal_eval(node.value)]
            missing = [str(f.relative_to(root)) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{path.relative_to(root)}: CODE_FILES names {', '.join(missing)}, which "
                                        "does not exist; fix the path or remove it from CODE_FILES")
            return files
    return []


def parents(name: str) -> list[str]:
    """The packages importing `name` runs first: "a.b.c" -> ["a", "a.b"]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def closure_modules(entry: str, root: Path = CODE_ROOT) -> list[str]:
    """Every project module importing `entry` can run (lazy imports included), sorted."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += parents(name)
        todo += [i.module for i in imports(name, root)]
    return sorted(seen)


def closure(entry: str, root: Path = CODE_ROOT) -> tuple[str, ...]:
    """The files (relative posix paths under `root`, sorted) of `closure_modules(entry)` and their CODE_FILES."""
    files: set[Path] = set()
    for name in closure_modules(entry, root):
        files.add(module_file(name, root))
        files.update(code_files(name, root))
    return tuple(sorted(f.relative_to(root).as_posix() for f in files))


def project_modules(packages: tuple[str, ...], root: Path = CODE_ROOT) -> list[str]:
    """Every importable module of `packages` (folders with `__init__.py` all the way down), sorted."""
    out = []
    for top in packages:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if all((root.joinpath(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
                out.append(".".join(parts))
    return sorted(out)


def import_graph(packages: tuple[str, ...], root: Path = CODE_ROOT) -> dict[str, list[Import]]:
    """module -> its imports of modules of `packages`, for every module of `packages` (TYPE_CHECKING excluded)."""
    return {name: imports(name, root, packages) for name in project_modules(packages, root)}


def find_cycle(graph: dict[str, list[Import]]) -> list[Import | str] | None:
    """One import cycle as [module, Import, module, Import, ..., module] (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[tuple[str, Import | None]] = []

    def walk(name: str, via: Import | None) -> list | None:
        state[name] = 1
        path.append((name, via))
        for edge in graph.get(name, []):
            if state.get(edge.module) == 1:
                start = next(i for i, (n, _) in enumerate(path) if n == edge.module)
                cycle: list = [path[start][0]]
                for n, v in path[start + 1:]:
                    cycle += [v, n]
                return cycle + [edge, edge.module]
            if edge.module not in state and (found := walk(edge.module, edge)):
                return found
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state and (found := walk(name, None)):
            return found
    return None
