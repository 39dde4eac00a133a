"""Fail on an import cycle between the project's modules, its folders or its packages.

Every import counts, at the top of a module, inside a function or under
TYPE_CHECKING: an import moved into a function still ties the two modules
together, so it cannot hide a cycle. Three levels are checked:

- modules (broker.zmq.learner -> broker.transport ...);
- units: each folder inside a package is one unit (broker.zmq, broker.wire),
  each module at a package's top is one (broker.transport, broker.connect);
- packages: broker, learner, syncer, compose, benchmarks.

``--graph`` prints the unit and package graphs instead.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("broker", "learner", "syncer", "compose", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules that the module ``name`` at ``path`` imports."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in known:  # broker.wire.messages.Enroll -> the module
                target = target.rpartition(".")[0]
            if target and target != name and not _is_package(target, known):
                out.add(target)
    return out


def _is_package(name: str, known: set[str]) -> bool:
    return any(k.startswith(name + ".") for k in known)


def unit_of(module: str, known: set[str]) -> str:
    parts = module.split(".")
    if len(parts) <= 2:
        return module  # a package's top module is a unit of its own
    return ".".join(parts[:2])  # a folder inside a package


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def main(argv: list[str]) -> int:
    files = {module_name(p): p for pkg in PACKAGES for p in Path(pkg).rglob("*.py")}
    known = set(files)
    modules = {name: imports_of(path, name, known) for name, path in files.items()}
    levels = {
        "module": modules,
        "unit": _collapse(modules, lambda m: unit_of(m, known)),
        "package": _collapse(modules, lambda m: m.split(".")[0]),
    }
    if "--graph" in argv:
        for level in ("package", "unit"):
            print(f"# {level}s")
            for node, deps in sorted(levels[level].items()):
                if node.split(".")[0] == "broker" or level == "package":
                    print(f"{node} -> {', '.join(sorted(deps)) or '-'}")
        return 0
    failed = False
    for level, graph in levels.items():
        if cycle := find_cycle(graph):
            print(f"import cycle between {level}s: {' -> '.join(cycle)}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def _collapse(modules: dict[str, set[str]], key) -> dict[str, set[str]]:  # type: ignore[no-untyped-def]
    graph: dict[str, set[str]] = {}
    for name, deps in modules.items():
        node = key(name)
        graph.setdefault(node, set()).update(key(d) for d in deps if key(d) != node)
    return graph


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
