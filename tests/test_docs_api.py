"""The API pages (``docs/api/*.md``) against ``fsdp_runtime.__all__``: every public name has its
``::: fsdp_runtime.NAME`` entry, once, and no entry names something that is not public; and the
griffe extension the pages are built with (``docs/_ext/griffe_roles.py``) rewrites the docstrings'
roles and notes as it says. The build itself (``./dev mkdocs build --strict``) runs in CI."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest

import fsdp_runtime

REPO = Path(__file__).resolve().parents[1]
API_DIR = REPO / "docs" / "api"
ENTRY = re.compile(r"^::: fsdp_runtime\.(\w+)\s*$", re.MULTILINE)


def get_entries() -> Counter[str]:
    """How many times each name has a ``::: fsdp_runtime.NAME`` line on the API pages."""
    pages = sorted(API_DIR.glob("*.md"))
    assert pages, f"no API pages under {API_DIR}"
    return Counter(name for page in pages for name in ENTRY.findall(page.read_text(encoding="utf-8")))


def test_every_public_name_is_on_the_api_pages():
    missing = sorted(set(fsdp_runtime.__all__) - set(get_entries()))
    assert not missing, (
        f"fsdp_runtime.__all__ names {missing} but docs/api/*.md has no '::: fsdp_runtime.NAME' line for them: "
        "add each under its group (docs/api/index.md says which page holds which)"
    )


def test_the_api_pages_name_only_public_names_once():
    entries = get_entries()
    assert not sorted(set(entries) - set(fsdp_runtime.__all__)), "an API page documents a name not in __all__"
    assert not [name for name, count in entries.items() if count > 1], "a name is documented twice"


def load_extension():
    pytest.importorskip("griffe", reason="griffe comes with the dev extra's mkdocstrings[python]")
    spec = importlib.util.spec_from_file_location("griffe_roles", REPO / "docs" / "_ext" / "griffe_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_roles_become_cross_references_or_code_and_notes_name_their_file(tmp_path):
    griffe_roles = load_extension()
    import griffe

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('from pkg.mod import Thing, make\n__all__ = ["Thing", "make"]\n')
    (package / "mod.py").write_text(
        '"""Things.\n\n[Note: the thing]\nWhy a thing is made this way.\n"""\n\n'
        "class Thing:\n"
        '    """Made by :func:`~pkg.make`, not :func:`helper` ([Note: the thing]).\n\n'
        '    See [Note: elsewhere] in :mod:`pkg.mod`, and :meth:`Thing.run`."""\n\n'
        "    def run(self):\n"
        '        """Runs."""\n\n'
        "def make():\n"
        '    """A :class:`Thing`."""\n\n'
        "def helper():\n"
        "    pass\n"
    )
    extensions = griffe.load_extensions(griffe_roles.RestRoles(repo=tmp_path, roots=("pkg",)))
    pkg = griffe.load("pkg", search_paths=[tmp_path], extensions=extensions)

    assert pkg["mod.Thing"].docstring.value == (
        "Made by [`make`][pkg.make], not `helper` (\\[Note: the thing\\] (`pkg/mod.py`)).\n\n"
        "See \\[Note: elsewhere\\] in `pkg.mod`, and [`Thing.run`][pkg.Thing.run]."
    )
    assert pkg["mod.make"].docstring.value == "A [`Thing`][pkg.Thing]."
