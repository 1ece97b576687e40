"""Which project code a module runs, read from its import statements (nothing is imported).

A stage's code is `closure(entry_module)`: the entry module, every project module it imports, transitively
(module-level and lazy imports inside functions, absolute and relative, submodules and names), and the package
`__init__.py` files that importing them runs. Imports under `if TYPE_CHECKING:` never run and are skipped. A
module that loads project files by path rather than by import (`evaluate.load` of stages/metrics/bleu/bleu.py)
names them in a module-level `CODE_FILES = ("bleu/bleu.py", ...)` (relative to its folder), read here as a
literal. User code named in params ("mypkg.rewards:score") is the user's, and the standard library and
third-party packages are versioned by the manifest, not hashed.

`tests/stages/harness/test_imports.py` checks the analysis against what importing each stage really loads, and walks
`import_graph` of stages/, tasks/ and flows/ for cycles.
"""
from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from stages.harness.artifacts import CODE_ROOT

LIBRARY = ("stages",)  # the packages a stage's code can come from (tasks/ and flows/ are never imported by them)


@dataclass(frozen=True)
class Import:
    module: str  # the project module imported ("stages.data.io")
    line: int
    lazy: bool  # inside a function body: runs when the function is called


@dataclass(frozen=True)
class Statement:
    module: str  # the module named (relative imports made absolute), any package
    names: tuple[str, ...]  # `from module import names`; () for `import module`
    line: int
    lazy: bool


def module_index(packages: tuple[str, ...] = LIBRARY, root: Path = CODE_ROOT) -> dict[str, Path]:
    """{module name: its file} of every importable module of `packages` under `root` (a package is its
    `__init__.py`; a folder without one is not a package, and the files under it are not modules)."""
    out = {}
    for top in packages:
        for folder, dirs, files in os.walk(root / top):
            if "__init__.py" not in files:
                dirs.clear()
                continue
            dirs.sort()
            package = Path(folder).relative_to(root).parts
            for file in sorted(f for f in files if f.endswith(".py")):
                name = package if file == "__init__.py" else (*package, file[:-3])
                out[".".join(name)] = Path(folder) / file
    return out


def statements(path: Path, name: str, type_checking: bool = False) -> list[Statement]:
    """Every import statement of module `name` (file `path`) that can run, in source order (`type_checking`: those
    under `if TYPE_CHECKING:` too, which a type checker follows)."""
    return _parse(path.read_bytes(), name, path.name == "__init__.py", str(path), type_checking)[0]


def imports(name: str, index: dict[str, Path], type_checking: bool = False) -> list[Import]:
    """The imports of module `name` that name a module of `index` (from `module_index`), in source order."""
    out = []
    for s in statements(index[name], name, type_checking):
        # `from pkg import x` imports pkg and, when x is a submodule, pkg.x; `import a.b` imports a.b
        targets = [f"{s.module}.{n}" for n in s.names if f"{s.module}.{n}" in index]
        if len(targets) < len(s.names) or not s.names:
            targets.insert(0, s.module)
        out += [Import(t, s.line, s.lazy) for t in targets if t in index]
    return out


def code_files(name: str, index: dict[str, Path]) -> list[Path]:
    """The files module `name` loads by path: its module-level `CODE_FILES` literal, resolved."""
    path = index[name]
    files = [path.parent / rel for rel in _parse(path.read_bytes(), name, path.name == "__init__.py", str(path))[1]]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: CODE_FILES names {', '.join(missing)}, which does not exist; fix the "
                                "path or remove it from CODE_FILES")
    return files


@functools.lru_cache(maxsize=4096)
def _parse(source: bytes, name: str, is_package: bool, filename: str,
           type_checking: bool = False) -> tuple[list[Statement], tuple[str, ...]]:
    """(the import statements that can run, the CODE_FILES literal) of one module's source."""
    tree = ast.parse(source, filename=filename)
    package = name if is_package else name.rpartition(".")[0]
    found: list[Statement] = []

    def visit(body: list[ast.stmt], lazy: bool) -> None:
        # statements only: an import is a statement, so expressions (most of a module's nodes) are never walked
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(Statement(alias.name, (), node.lineno, lazy) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[:len(parts) - node.level + 1])
                    base = f"{anchor}.{node.module}" if node.module else anchor
                found.append(Statement(base, tuple(a.name for a in node.names if a.name != "*"), node.lineno, lazy))
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                if type_checking:
                    visit(node.body, True)
                visit(node.orelse, lazy)  # only the else branch runs
            else:
                inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                for name in node._fields:  # body, handlers, orelse, finalbody, cases: in source order
                    value = getattr(node, name, None)
                    if not isinstance(value, list):
                        continue
                    for item in value:
                        if isinstance(item, ast.stmt):
                            visit([item], inner)
                        elif isinstance(item, (ast.ExceptHandler, ast.match_case)):
                            visit(item.body, inner)

    visit(tree.body, False)
    files: tuple[str, ...] = ()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CODE_FILES" for t in node.targets):
            files = tuple(ast.literal_eval(node.value))
    return found, files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def parents(name: str) -> list[str]:
    """The packages importing `name` runs first: "a.b.c" -> ["a", "a.b"]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def closure_modules(entry: str, root: Path = CODE_ROOT, index: dict[str, Path] | None = None) -> list[str]:
    """Every project module importing `entry` can run (lazy imports included), sorted."""
    index = module_index(LIBRARY, root) if index is None else index
    if entry not in index:
        raise ModuleNotFoundError(f"{entry}: no such module under {root / entry.split('.')[0]}")
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += parents(name) + [i.module for i in imports(name, index)]
    return sorted(seen)


def closure(entry: str, root: Path = CODE_ROOT) -> tuple[str, ...]:
    """The files (relative posix paths under `root`, sorted) of `closure_modules(entry)` and their CODE_FILES."""
    return closures((entry,), root)


def closures(entries: tuple[str, ...], root: Path = CODE_ROOT) -> tuple[str, ...]:
    """The union of `closure(entry)` over `entries`, the module index read once."""
    index = module_index(LIBRARY, root)
    stats = tuple((name, st.st_mtime_ns, st.st_size) for name, st in ((n, p.stat()) for n, p in index.items()))
    return tuple(sorted({f for entry in entries for f in _closure(entry, root, stats)}))  # again on any change


@functools.lru_cache(maxsize=256)
def _closure(entry: str, root: Path, stats: tuple) -> tuple[str, ...]:
    index = module_index(LIBRARY, root)
    files: set[Path] = set()
    for name in closure_modules(entry, root, index):
        files.add(index[name])
        files.update(code_files(name, index))
    return tuple(sorted(f.relative_to(root).as_posix() for f in files))


def import_graph(packages: tuple[str, ...], root: Path = CODE_ROOT,
                 type_checking: bool = False) -> dict[str, list[Import]]:
    """module -> its imports of modules of `packages`, for every module of `packages` (`if TYPE_CHECKING:` imports
    only with `type_checking`)."""
    index = module_index(packages, root)
    return {name: imports(name, index, type_checking) for name in index}


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
