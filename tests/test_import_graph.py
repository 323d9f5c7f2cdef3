"""The layers import in one direction (docs: README's layout, DESIGN's layers): read with ``ast``,
every import counted, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "specdraft"

#: what each part may not import (above it, or beside it where it must not know the other)
FORBIDDEN = {
    "cache": {"runner", "engine", "verifier", "drafters", "models", "decoder", "server", "training", "bench"},
    "runner": {"engine", "verifier", "drafters", "decoder", "server", "training", "bench"},
    "verifier": {"engine", "runner", "cache", "drafters", "models", "decoder", "server", "training", "bench"},
    "engine": {"runner", "cache", "drafters", "models", "decoder", "server", "training", "bench"},
}


def _part(module: str) -> str:
    """``specdraft.engine.waves`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def import_graph() -> dict[str, set[str]]:
    """Which top-level parts of specdraft (``engine``, ``verifier``, ``types``...) each part imports."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        me = _part(module.removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                targets = [".".join(base + [node.module] if node.module else base + [alias.name])
                           for alias in (node.names if not node.module else node.names[:1])]
            else:
                continue
            for target in targets:
                if target.startswith("specdraft.") and _part(target) not in (me, "__version__"):
                    graph.setdefault(me, set()).add(_part(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(nxt, path + [nxt])
        done.add(node)

    for node in sorted(graph):
        walk(node, [node])
    return found


def test_the_parts_of_specdraft_import_each_other_without_a_circle():
    graph = import_graph()
    assert "verifier" in graph["engine"] and "cache" in graph["runner"]  # the walk sees relative imports
    assert cycles(graph) == []


def test_each_layer_imports_only_below_it():
    graph = import_graph()
    wrong = {part: sorted(graph.get(part, set()) & banned) for part, banned in FORBIDDEN.items()}
    assert {part: names for part, names in wrong.items() if names} == {}


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
