"""The benchmark suite's one entry point, run from the repository root:

    python -m benchmarks                 # list the benchmarks
    python -m benchmarks <name> [args]   # run one (`--help` for its options, `--tiny` for a smoke run)

Every module `benchmarks/<name>.py` (or package) with a `main(argv=None) -> int` is a benchmark: it is found
here, not listed, so a new module needs no registration. Exit status: the benchmark's (77: skipped here).
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType

import benchmarks

NOT_BENCHMARKS = {"common", "faults_lib"}  # helper modules of the benchmarks


def names() -> list[str]:
    """The benchmark modules under benchmarks/, sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                  if not m.name.startswith("_") and m.name not in NOT_BENCHMARKS)


def load(name: str) -> ModuleType:
    module = importlib.import_module(f"benchmarks.{name}")
    if not callable(getattr(module, "main", None)):
        raise SystemExit(f"benchmarks/{name}: no main(argv) function")
    return module


def summary(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().split("\n", 1)[0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    available = names()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.strip().split("\n\n")[0] + "\n")
        width = max(map(len, available))
        for name in available:
            print(f"  {name:<{width}}  {summary(load(name))}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in available:
        print(f"unknown benchmark {name!r}; choose from: {', '.join(available)}", file=sys.stderr)
        return 2
    status = load(name).main(rest)
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
