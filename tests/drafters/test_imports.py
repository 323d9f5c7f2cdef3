"""The drafter API is closed: drafters import ``specdraft.drafters.api`` and nothing else of specdraft.

Every module under ``src/specdraft/drafters/`` and ``plugins/*/src/`` is read with ``ast`` (imports
inside functions included, relative ones resolved) and sorted into one of four kinds:

* **the API's boundary**: ``drafters/api.py``, ``drafters/common/**`` and ``drafters/__init__.py``.
  They may import ``specdraft.types``, ``sampling``, ``errors``, ``files`` and ``hookspecs``, and
  each other; never the runner, the models, the engine, the verifier, the cache (what a drafter
  needs of those comes through ``TargetInfo.services``), ``specdraft.services`` itself, or a drafter.
* **the built-ins' hook**, ``drafters/builtin.py``: the API and the drafters it registers.
* **a built-in drafter**, every other module under ``drafters/``: ``specdraft.drafters.api``,
  ``specdraft.drafters.common.*`` and, in a package of its own (``heads/``), that package's modules.
* **a plugin** under ``plugins/``: ``specdraft.drafters.api`` only, and its own package.

Outside specdraft, drafters may import the standard library and the libraries of ``LIBRARIES``
(plugins: ``PLUGIN_LIBRARIES``). The other direction is checked too: nothing under ``engine/``,
``verifier/``, ``runner/`` or ``cache/`` imports a drafter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DRAFTERS = SRC / "specdraft" / "drafters"
PLUGINS = ROOT / "plugins"
API = "specdraft.drafters.api"
COMMON = "specdraft.drafters.common"

#: what the API's boundary may import of specdraft besides itself
BOUNDARY_MAY_IMPORT = ("specdraft.types", "specdraft.sampling", "specdraft.errors", "specdraft.files",
                       "specdraft.hookspecs", API, COMMON)
#: why each part of specdraft is out of a drafter's reach (the message of a failure)
WHY = {
    "specdraft.engine": "the engine is not part of the drafter API",
    "specdraft.verifier": "the verifier is not part of the drafter API",
    "specdraft.cache": "the KV cache is not part of the drafter API",
    "specdraft.runner": "the runner is not part of the drafter API: use target.services.model_runner / layer_runner",
    "specdraft.models": "model loading is not part of the drafter API: use target.services.load_model",
    "specdraft.services": "services come through TargetInfo: use target.services (or the API's default_services)",
}
#: libraries outside specdraft a built-in drafter may import (besides the standard library)
LIBRARIES = {"torch", "pydantic", "numpy", "safetensors", "transformers", "huggingface_hub"}
PLUGIN_LIBRARIES = {"torch", "pydantic", "numpy"}
#: folders that must not import drafters (skipped while they do not exist)
BELOW_DRAFTERS = ("engine", "verifier", "runner", "cache")


def module_name(path: Path, root: Path) -> str:
    """``specdraft.drafters.heads.tree`` for ``root/specdraft/drafters/heads/tree.py`` (a package's
    ``__init__.py`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every import in ``source`` (functions' bodies included), relative
    imports resolved against ``module``; ``from X import y`` gives ``X.y`` (y may be a module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, base if alias.name == "*" else f"{base}.{alias.name}") for alias in node.names]
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def kind_of(module: str) -> str:
    if module in ("specdraft.drafters", API) or _under(module, COMMON):
        return "boundary"
    if module == "specdraft.drafters.builtin":
        return "hook"
    if _under(module, "specdraft.drafters"):
        return "drafter"
    return "plugin"


def problem(name: str, module: str, kind: str, package: str) -> str | None:
    """Why ``module`` (of ``kind``, in ``package``) may not import ``name``; None if it may."""
    top = name.split(".")[0]
    if top == "__future__" or (top != "specdraft" and top in sys.stdlib_module_names):
        return None
    if top != "specdraft":
        if kind == "plugin":
            return None if top in PLUGIN_LIBRARIES | {module.split(".")[0]} else \
                f"a library plugins/ does not use ({', '.join(sorted(PLUGIN_LIBRARIES))} and the standard library)"
        return None if top in LIBRARIES else f"a library the drafters do not use ({', '.join(sorted(LIBRARIES))})"
    reason = next((why for part, why in WHY.items() if _under(name, part)), None)
    if kind == "boundary":
        if any(_under(name, ok) for ok in BOUNDARY_MAY_IMPORT):
            return None
        return reason or "the API's boundary imports only specdraft.types, sampling, errors, files and hookspecs"
    if _under(name, API):
        return None
    if kind == "hook" and _under(name, "specdraft.drafters"):
        return None
    if kind == "drafter":
        own = package if package.count(".") >= 2 else None  # a drafter's own package (heads/), not drafters/
        if _under(name, COMMON) or (own and _under(name, own)):
            return None
    return reason or (f"not the drafter API: import it from {API}" if kind == "plugin" else
                      f"another drafter's module or specdraft's internals: import it from {API} (or {COMMON})")


def violations(source: str, module: str, is_package: bool = False, where: str = "") -> list[str]:
    kind, package = kind_of(module), module if is_package else module.rpartition(".")[0]
    return [f"{where or module}:{line}: imports {name}: {why}" for line, name in imported(source, module, is_package)
            if (why := problem(name, module, kind, package)) is not None]


def drafter_modules() -> list[tuple[Path, Path]]:
    """``(file, the folder its module names start from)`` for the drafters and the plugins."""
    files = [(p, SRC) for p in sorted(DRAFTERS.rglob("*.py"))]
    for src in sorted(PLUGINS.glob("*/src")):
        files += [(p, src) for p in sorted(src.rglob("*.py"))]
    return files


def test_the_walk_finds_the_drafters_and_the_plugins():
    names = {module_name(p, root) for p, root in drafter_modules()}
    assert {API, "specdraft.drafters.ngram", "specdraft.drafters.heads.drafters", "specdraft.drafters.common.tree",
            "specdraft_adaptive_lookup"} <= names


def test_drafters_and_plugins_import_only_the_drafter_api():
    found = []
    for path, root in drafter_modules():
        found += violations(path.read_text(), module_name(path, root), path.name == "__init__.py",
                            str(path.relative_to(ROOT)))
    assert not found, "drafter modules reach past the drafter API:\n" + "\n".join(found)


def test_the_layers_below_import_no_drafter():
    found = []
    for folder in BELOW_DRAFTERS:
        for path in sorted((SRC / "specdraft" / folder).rglob("*.py")):  # nothing while the folder does not exist
            module = module_name(path, SRC)
            found += [f"{path.relative_to(ROOT)}:{line}: imports {name}"
                      for line, name in imported(path.read_text(), module, path.name == "__init__.py")
                      if _under(name, "specdraft.drafters")]
    assert not found, "the engine's layers must not depend on drafters:\n" + "\n".join(found)


@pytest.mark.parametrize("module,source,bad", [
    # a built-in drafter reaching into the runner from inside a function, relatively
    ("specdraft.drafters.ngram", "def f():\n    from ..runner import load_runner\n", "specdraft.runner.load_runner"),
    ("specdraft.drafters.heads.drafters", "from ...models import load_target\n", "specdraft.models.load_target"),
    ("specdraft.drafters.draft_model", "import specdraft.engine.engine\n", "specdraft.engine.engine"),
    ("specdraft.drafters.ngram", "from .prompt_lookup import lookup\n", "specdraft.drafters.prompt_lookup.lookup"),
    ("specdraft.drafters.heads.tree", "from ..draft_model import check_tokenizers\n",
     "specdraft.drafters.draft_model.check_tokenizers"),
    ("specdraft.drafters.ngram", "from ..types import Draft\n", "specdraft.types.Draft"),  # through the API
    ("specdraft.drafters.ngram", "from specdraft.drafters import ngram\n", "specdraft.drafters.ngram"),
    ("specdraft.drafters.ngram", "import requests\n", "requests"),
    # the boundary hands services over through TargetInfo, never by import
    ("specdraft.drafters.common.base", "from ...runner import default_compile\n", "specdraft.runner.default_compile"),
    (API, "from ..services import DrafterServices\n", "specdraft.services.DrafterServices"),
    ("specdraft.drafters.common.copy_gate", "from ..prompt_lookup import lookup\n",
     "specdraft.drafters.prompt_lookup.lookup"),
    ("specdraft.drafters", "from .ngram import NGramDrafter\n", "specdraft.drafters.ngram.NGramDrafter"),
    # plugins: the API only
    ("my_plugin", "from specdraft.drafters.common.lookup import lookup\n", "specdraft.drafters.common.lookup.lookup"),
    ("my_plugin.drafter", "import specdraft\n", "specdraft"),
    ("my_plugin", "from specdraft.sampling import draw\n", "specdraft.sampling.draw"),
])
def test_the_check_names_a_forbidden_import(module, source, bad):
    found = violations(source, module, is_package=module == "specdraft.drafters", where="x.py")
    assert len(found) == 1 and f"x.py:{source.count(chr(10))}: imports {bad}:" in found[0], found


@pytest.mark.parametrize("module,source", [
    ("specdraft.drafters.ngram", "from .api import Draft, trie\nimport torch\nfrom pydantic import Field\n"),
    ("specdraft.drafters.heads.drafters",
     "from ..common.copy_gate import CopyDrafting\nfrom .formats import load_heads\n"),
    ("specdraft.drafters.heads.tree", "from . import modules\nfrom ..api import grow_tree\n"),
    ("specdraft.drafters.heads", "from .drafters import EagleDrafter\n"),
    ("specdraft.drafters.common.dynamic_tree",
     "from ...sampling import penalize\nfrom .copy_gate import copy_mixture\n"),
    ("specdraft.drafters.builtin", "from .ngram import NGramDrafter\nfrom .api import hookimpl\n"),
    ("my_plugin", "from specdraft.drafters.api import Drafter\nfrom my_plugin import Options\nimport json\n"),
])
def test_the_check_lets_the_api_through(module, source):
    assert violations(source, module, is_package=module == "specdraft.drafters.heads") == []


def test_the_layers_check_resolves_relative_imports():
    assert imported("from ..drafters.api import Drafter\n", "specdraft.engine.engine") == \
        [(1, "specdraft.drafters.api.Drafter")]


def test_the_api_exports_what_it_lists_without_importing_torch():
    code = ("import sys\nimport specdraft.drafters.api as api\n"
            "missing = [n for n in api.__all__ if not hasattr(api, n)]\n"
            "assert not missing, missing\nassert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tutorial_describes_every_name_of_the_api():
    from specdraft.drafters import api

    tutorial = (ROOT / "docs" / "writing-a-drafter.md").read_text()
    section = tutorial[tutorial.index("## 7. The drafter API"):]
    assert not [n for n in api.__all__ if f"`{n}" not in section]


def test_new_drafters_are_version_2_and_old_ones_say_1():
    from specdraft.drafters.api import Draft, Drafter

    class New(Drafter):
        def propose(self, ctx, k):
            return Draft.empty(ctx.batch_size)

    class Old(New):
        api_version = 1

    assert New.api_version == 2 and Old.api_version == 1
