"""Machinery the built-in drafters share: the drafter base class and its helpers, trees, the copy
gate, compact drafts, shipped weights and n-gram lookup.

What a drafter may use of it is re-exported by :mod:`specdraft.drafters.api`; built-in drafters
import the rest (copy gate, compact drafts, shipped weights) from here. Like the API, these
modules import only ``specdraft.types``, ``sampling``, ``errors``, ``files`` and ``hookspecs``
(never the runner, the models, the engine, the verifier or the cache: a drafter borrows a runner
or a model loader through ``TargetInfo.services``), and never a drafter's module
(``tests/drafters/test_imports.py`` checks both). Importing this package imports nothing.
"""
