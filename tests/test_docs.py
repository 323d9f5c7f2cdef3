"""Docs that quote the program must match it, and their Python snippets must run as written.

Every ```python block of README.md and docs/*.md runs, a page's blocks in order in one fresh
namespace (like a notebook: a later block may use what an earlier one defined), so a block
that forgets an import fails. Two first-line markers change that:

* ``# file: PATH`` -- the block is the file PATH of an example package: it is written to a
  temporary folder on ``sys.path`` (where later blocks import it) instead of running;
* ``# not run: REASON`` -- a fragment that cannot run here (e.g. ``# not run: needs a GPU``);
  the reason is required.

Shell blocks (```bash) are not run.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import pytest

from specdraft.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
FILE_MARK = re.compile(r"#\s*file:\s*(\S+)")
NOT_RUN_MARK = re.compile(r"#\s*not run\b:?\s*(.*)")
#: the real default model's generations are capped to this many tokens: the snippets must run,
#: and 128 tokens of a 135M model take seconds each on a small CPU
E2E_MAX_NEW_TOKENS = 8


@pytest.mark.parametrize("command", ["generate", "serve", "bench-serve", "bench", "distill", "train-heads", "drafters"])
def test_cli_reference_quotes_the_real_help(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = capsys.readouterr().out.replace("python -m pytest", "specdraft")
    help_text = help_text.replace(f"usage: {build_parser().prog}", "usage: specdraft")
    assert help_text.strip() in (DOCS / "cli.md").read_text(), f"docs/cli.md is out of date for `{command}`: run scripts/cli-docs.sh"


def test_docs_exist_and_link_the_example_plugin():
    tutorial = (DOCS / "writing-a-drafter.md").read_text()
    assert "plugins/specdraft-adaptive-lookup" in tutorial
    plugin_source = Path(__file__).resolve().parents[1] / "plugins/specdraft-adaptive-lookup/src/specdraft_adaptive_lookup/__init__.py"
    # every line of the tutorial's class skeleton up to `on_verified` is the real code
    for line in ['register("adaptive-lookup", AdaptiveLookupDrafter, aliases=("alookup",))',
                 "want = min(k, self.lengths.setdefault(seq_id, o.start))",
                 'start: int = Field(3, ge=1, description="draft length of a new sequence")']:
        assert line in tutorial and line in plugin_source.read_text()
    for page in ["getting-started.md", "algorithm.md", "cli.md"]:
        assert (DOCS / page).stat().st_size > 500


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line number of the block's first line, code)`` for every ```python block of ``page``."""
    blocks, fence, info, start, body = [], None, "", 0, []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence, info, start, body = line[: len(line) - len(line.lstrip())], stripped[3:].strip(), n + 1, []
        elif stripped == "```":
            if info.split()[:1] in (["python"], ["py"]):
                blocks.append((start, "\n".join(b[len(fence):] if b.startswith(fence) else b for b in body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page.name}: a ``` block opened on line {start - 1} is never closed"
    return blocks


def runnable_blocks(page: Path) -> list[str]:
    """The code of ``page``'s ```python blocks that run (neither ``# file:`` nor ``# not run:``)."""
    firsts = [(code.splitlines()[0].strip(), code) for _, code in python_blocks(page)]
    return [code for first, code in firsts if not FILE_MARK.fullmatch(first) and not NOT_RUN_MARK.match(first)]


def _loads_default_model(page: Path) -> bool:
    return any("from_pretrained(" in code for code in runnable_blocks(page))


@contextlib.contextmanager
def run_page(page: Path, tmp_path: Path):
    """Run ``page``'s snippets; yields their namespace, then undoes what they registered or imported."""
    from specdraft.plugins import pm

    blocks = python_blocks(page)
    package = tmp_path / "snippet-files"
    for _, code in blocks:
        mark = FILE_MARK.fullmatch(code.splitlines()[0].strip())
        if mark:
            (package / mark.group(1)).parent.mkdir(parents=True, exist_ok=True)
            (package / mark.group(1)).write_text(code)
    modules, plugins = set(sys.modules), set(pm.get_plugins())
    sys.path.insert(0, str(package))
    namespace: dict = {"__name__": f"snippets_of_{page.stem.replace('-', '_')}"}
    try:
        for line, code in blocks:
            first = code.splitlines()[0].strip()
            if FILE_MARK.fullmatch(first):
                continue
            not_run = NOT_RUN_MARK.match(first)
            if not_run:
                assert not_run.group(1).strip(), f"{page.name}:{line}: '# not run:' needs a reason"
                continue
            # blank lines first, so a traceback's line numbers are the page's
            exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
        yield namespace
    finally:
        sys.path.remove(str(package))
        for plugin in set(pm.get_plugins()) - plugins:
            pm.unregister(plugin)
        for name in set(sys.modules) - modules:
            if str(package) in str(getattr(sys.modules[name], "__file__", "") or ""):
                del sys.modules[name]


def test_snippets_are_found():
    """The block parser sees the snippets these pages are known to have (a parser that found
    none would make the test below pass for nothing)."""
    found = {page.name: python_blocks(page) for page in PAGES}
    assert len(found["README.md"]) >= 1 and len(found["getting-started.md"]) >= 1
    tutorial = [code.splitlines()[0] for _, code in found["writing-a-drafter.md"]]
    assert "# file: target_bigram/drafter.py" in tutorial and "# file: target_bigram/__init__.py" in tutorial
    assert len(tutorial) >= 5
    assert not any(code.lstrip().startswith("$ ") for blocks in found.values() for _, code in blocks)


def _defined_names(code: str) -> set[str]:
    """The names a block binds at its top level (assignments, imports, functions, classes)."""
    import ast

    names = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


@pytest.mark.parametrize("page", [
    pytest.param(page, id=page.name, marks=[pytest.mark.e2e] if _loads_default_model(page) else [])
    for page in PAGES if runnable_blocks(page)
])
def test_python_snippets_run_as_written(page, tmp_path, monkeypatch, capsys, request):
    """Every ```python block of the page runs to its end: everything each block defines is defined
    afterwards, and what the blocks print is printed (pages that load the default model are e2e:
    they get the session's loaded copy, and their generations are capped at E2E_MAX_NEW_TOKENS
    tokens to keep the test short)."""
    if _loads_default_model(page):
        from specdraft.decoder import SpeculativeDecoder

        request.getfixturevalue("cached_default_model")
        generate_ids = SpeculativeDecoder.generate_ids

        def capped(self, prompts, settings=None, **options):
            def cap(s):
                return s.replace(max_new_tokens=min(s.max_new_tokens, E2E_MAX_NEW_TOKENS))

            if settings is not None:
                settings = [cap(s) for s in settings] if isinstance(settings, (list, tuple)) else cap(settings)
            if settings is None or "max_new_tokens" in options:
                options["max_new_tokens"] = min(options.get("max_new_tokens", 128), E2E_MAX_NEW_TOKENS)
            return generate_ids(self, prompts, settings, **options)

        monkeypatch.setattr(SpeculativeDecoder, "generate_ids", capped)
    run = runnable_blocks(page)
    capsys.readouterr()
    with run_page(page, tmp_path) as namespace:
        missing = set().union(*map(_defined_names, run)) - set(namespace)
    assert not missing, f"{page.name}: the blocks ran, but did not define {sorted(missing)}"
    printed = capsys.readouterr().out
    assert bool(printed.strip()) == any("print(" in code for code in run), printed


def test_snippet_runner_catches_a_missing_import(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Intro.\n\n```python\nx = 1\n```\n\n```bash\nnot python\n```\n\n```python\n"
                    "print(torch.zeros(1))\n```\n")
    with pytest.raises(NameError, match="torch"), run_page(page, tmp_path):
        pass
    page.write_text("```python\n# not run: needs a GPU\nimport nothing_here\n```\n")
    with run_page(page, tmp_path) as namespace:
        assert "nothing_here" not in namespace
    page.write_text("```python\n# not run\nimport nothing_here\n```\n")
    with pytest.raises(AssertionError, match="needs a reason"), run_page(page, tmp_path):
        pass


def test_tutorial_snippets_are_the_example_plugin():
    """The tutorial's drafter and hook are the example plugin's code, line for line."""
    source = (ROOT / "plugins/specdraft-adaptive-lookup/src/specdraft_adaptive_lookup/__init__.py").read_text()
    blocks = [code for _, code in python_blocks(DOCS / "writing-a-drafter.md") if "AdaptiveLookupDrafter" in code]
    assert len(blocks) == 2  # the drafter (section 2) and its hook (section 3)
    lines = source.splitlines()
    for code in blocks:
        snippet = code.rstrip("\n").splitlines()
        assert any(lines[i:i + len(snippet)] == snippet for i in range(len(lines))), \
            f"the tutorial's snippet is not in the example plugin:\n{code}"


def test_tutorial_sampling_drafter_is_exact_and_gains_from_the_counts(tmp_path, monkeypatch, capsys):
    """What the tutorial says of its `target-bigram` drafter: it passes the conformance suite,
    and with a penalty on it gets more of its greedy drafts accepted with the penalties' context
    (``ctx.counts_after``) than without it, for the same output."""
    from specdraft import SpeculativeDecoder
    from specdraft.testing import check_drafter, tiny_llama
    from specdraft.types import DraftContext

    with run_page(DOCS / "writing-a-drafter.md", tmp_path):
        model = tiny_llama()
        check_drafter("target-bigram", model, spec_lengths=(1, 4))
        dec = SpeculativeDecoder(model, None, drafter="target-bigram", spec_length=4, adaptive=False)
        prompts = [[5, 6, 7, 5, 6, 7, 5]] * 2
        settings = {"max_new_tokens": 40, "repetition_penalty": 1.3, "presence_penalty": 0.2, "frequency_penalty": 0.1}
        with_counts = dec.generate_ids(prompts, **settings)
        monkeypatch.setattr(DraftContext, "counts_after", lambda self, drafted=(): None)
        without = dec.generate_ids(prompts, **settings)
    assert [r.token_ids for r in with_counts] == [r.token_ids for r in without]
    rate, rate_without = with_counts[0].stats.acceptance_rate, without[0].stats.acceptance_rate
    assert rate > 1.5 * rate_without, (rate, rate_without)  # the tutorial says "about twice"
    capsys.readouterr()
