"""The plugin manager: built-ins through the hook, broken plugins isolated, duplicates named."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

import specdraft
from specdraft import plugins
from specdraft.errors import ConfigError, PluginError, UnknownDrafterError
from specdraft.plugins import get_registry


class _Dummy(specdraft.Drafter):
    def propose(self, ctx, k):
        return specdraft.Draft.empty(ctx.batch_size)


def _plugin(body):
    module = types.ModuleType("fake_plugin")
    module.register_drafters = specdraft.hookimpl(body)
    return module


def test_builtins_come_through_the_hook():
    registry = get_registry()
    assert {"ngram", "prompt-lookup", "none"} <= set(registry.names())
    assert registry.get("ngram").plugin == plugins.BUILTIN_PLUGIN
    assert registry.get("pld").name == "prompt-lookup"  # alias


def test_unknown_drafter_lists_known_ones():
    with pytest.raises(UnknownDrafterError, match="unknown drafter 'nope'; known drafters: .*ngram.*prompt-lookup"):
        get_registry().get("nope")


def test_third_party_registration(register_plugin):
    register_plugin(_plugin(lambda register: register("mine", _Dummy, aliases=("m",))), "my-plugin")
    spec = get_registry().get("m")
    assert spec.name == "mine" and spec.plugin == "my-plugin"


def test_duplicate_name_is_an_error_naming_both_plugins(register_plugin):
    register_plugin(_plugin(lambda register: register("ngram", _Dummy)), "copycat")
    registry = get_registry()
    with pytest.raises(PluginError, match="'specdraft' and 'copycat'|'copycat' and 'specdraft'"):
        registry.get("ngram")
    assert registry.get("prompt-lookup").plugin == "specdraft"  # everything else still works


def test_exception_in_a_hook_is_reported_not_fatal(register_plugin):
    def broken(register):
        register("half-done", _Dummy)
        raise RuntimeError("boom")

    register_plugin(_plugin(broken), "broken-plugin")
    registry = get_registry()
    assert ("broken-plugin", "register_drafters raised RuntimeError: boom") in registry.errors
    assert "half-done" not in registry.names()  # all of a plugin's drafters, or none
    assert "ngram" in registry.names()


def test_registering_a_non_drafter_is_reported(register_plugin):
    register_plugin(_plugin(lambda register: register("bad", object)), "wrong-type")
    errors = dict(get_registry().errors)
    assert "not a subclass of specdraft.Drafter" in errors["wrong-type"]


def test_hook_name_typo_fails_validation():
    module = types.ModuleType("typo_plugin")
    module.register_drafter = specdraft.hookimpl(lambda register: None)  # missing "s"
    with pytest.raises(Exception, match="register_drafter"):
        plugins._register_checked(module, "typo-plugin")
    assert plugins.pm.get_plugin("typo-plugin") is None


def test_invalid_options_name_the_drafter_and_the_valid_options():
    with pytest.raises(ConfigError, match="drafter 'ngram': bogus: Extra inputs.*Valid options: min_order"):
        get_registry().validate_options("ngram", {"bogus": 1})
    with pytest.raises(ConfigError, match="min_order"):
        get_registry().validate_options("ngram", {"min_order": 4, "max_order": 3})
    assert get_registry().validate_options("ngram", {"history": "64"}).history == 64  # CLI strings coerce


@pytest.fixture
def broken_distribution(tmp_path):
    """An installed-looking distribution whose entry point fails to import."""
    dist = tmp_path / "specdraft_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specdraft-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[specdraft]\nbroken = specdraft_broken_mod\n")
    (tmp_path / "specdraft_broken_mod.py").write_text("raise ImportError('needs a package that is not installed')\n")
    return tmp_path


def test_import_error_in_an_entry_point_is_reported_by_name(broken_distribution, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_distribution))
    monkeypatch.setattr(plugins, "load_errors", [])
    registry = get_registry()
    assert any(name == "specdraft-broken" and "needs a package" in msg for name, msg in registry.errors)
    assert "ngram" in registry.names()


def _cli(*args, env_extra=None, pythonpath=None):
    import os

    env = {**os.environ, **(env_extra or {})}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "specdraft.cli", *args], capture_output=True, text=True, env=env)


def test_cli_lists_drafters_and_survives_a_broken_plugin(broken_distribution):
    out = _cli("drafters", pythonpath=str(broken_distribution))
    assert out.returncode == 0
    assert "ngram" in out.stdout and "prompt-lookup" in out.stdout
    assert "specdraft-broken" in out.stderr and "Traceback" not in out.stderr


def test_allow_list_env_var(broken_distribution):
    out = _cli("drafters", "--json", pythonpath=str(broken_distribution), env_extra={plugins.LOAD_PLUGINS_ENV: ""})
    assert out.returncode == 0 and "specdraft-broken" not in out.stderr
    import json

    names = {d["name"] for d in json.loads(out.stdout)["drafters"]}
    assert {"ngram", "prompt-lookup", "none"} <= names  # built-ins always load
    assert "adaptive-lookup" not in names


def test_listing_and_checking_drafters_imports_no_torch():
    """`specdraft drafters` and option checks must not pay for torch (4 s): the heads are registered
    by import path, with their options."""
    code = textwrap.dedent("""
        import sys
        import specdraft.cli
        from specdraft.plugins import get_registry

        specdraft.cli.main(['drafters'])
        get_registry().validate_options('eagle', {'heads': 'x'})
        heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)
        assert not heavy, heavy
    """)
    import os

    env = {**os.environ, plugins.LOAD_PLUGINS_ENV: ""}  # built-ins only: a third-party plugin may import torch
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "eagle" in out.stdout and "heads" in out.stdout


def test_drafters_registered_by_import_path_load_when_used():
    from specdraft.drafters.heads import EagleDrafter

    spec = get_registry().get("eagle")
    assert spec.drafter == "specdraft.drafters.heads:EagleDrafter"
    assert spec.cls is EagleDrafter and spec.options is EagleDrafter.Options


def test_import_path_that_fails_is_named_when_the_drafter_is_used(register_plugin, tiny_model):
    register_plugin(_plugin(lambda register: register(
        "lazy", "no_such_module_here:Drafter", options=specdraft.drafters.NoOptions)), "lazy-plugin")
    registry = get_registry()
    assert "lazy" in registry.names()  # listing does not import it
    with pytest.raises(PluginError, match="drafter 'lazy' .plugin 'lazy-plugin'. failed to import "
                                          "'no_such_module_here:Drafter': ModuleNotFoundError"):
        specdraft.SpeculativeDecoder(tiny_model, None, drafter="lazy")


def test_import_path_whose_class_has_other_options(register_plugin):
    register_plugin(_plugin(lambda register: register(
        "mismatch", "specdraft.drafters.ngram:NGramDrafter", options=specdraft.drafters.NoOptions)), "mm-plugin")
    with pytest.raises(PluginError, match="other Options than the ones registered"):
        get_registry().get("mismatch").cls


@pytest.mark.parametrize("args, kwargs, message", [
    (("no-colon-here",), {"options": specdraft.drafters.NoOptions}, "needs the form 'module:Class'"),
    (("mod:Cls",), {}, "options=its Options class"),
    ((_Dummy,), {"options": specdraft.drafters.NoOptions.__base__}, "differs from _Dummy.Options"),
])
def test_bad_lazy_registrations_are_reported(register_plugin, args, kwargs, message):
    register_plugin(_plugin(lambda register: register("odd", *args, **kwargs)), "odd-plugin")
    registry = get_registry()
    assert message in dict(registry.errors)["odd-plugin"]
    assert "odd" not in registry.names()


def test_unknown_drafter_names_the_plugin_that_failed_to_import(broken_distribution, monkeypatch, tiny_model):
    monkeypatch.syspath_prepend(str(broken_distribution))
    monkeypatch.setattr(plugins, "load_errors", [])
    monkeypatch.setattr(plugins, "entry_point_names", {})
    import_error = ("failed to import 'specdraft_broken_mod': ImportError: needs a package that is not installed")
    # its entry point is named "broken": most likely the drafter the user wants
    with pytest.raises(UnknownDrafterError) as info:
        specdraft.SpeculativeDecoder(tiny_model, None, drafter="broken")
    assert str(info.value) == (f"unknown drafter 'broken': plugin 'specdraft-broken', which would provide it, "
                               f"{import_error}; fix or uninstall that plugin")
    # a name nothing points at: the known names, and a note on each plugin that failed
    with pytest.raises(UnknownDrafterError, match="unknown drafter 'nope'; known drafters: .*ngram") as info:
        get_registry().get("nope")
    assert str(info.value).endswith(f"; note plugin 'specdraft-broken' {import_error}")


def test_unknown_drafter_without_broken_plugins_has_no_note(monkeypatch):
    monkeypatch.setattr(plugins, "load_errors", [])
    monkeypatch.setenv(plugins.LOAD_PLUGINS_ENV, "")
    assert "note" not in str(pytest.raises(UnknownDrafterError, get_registry().get, "nope").value)


def test_version_comes_from_the_installed_metadata(capsys):
    import importlib.metadata

    from specdraft.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"specdraft {importlib.metadata.version('specdraft')}\n"
    assert specdraft.__version__ == importlib.metadata.version("specdraft")
