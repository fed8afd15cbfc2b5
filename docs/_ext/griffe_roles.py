"""A griffe extension that makes the code's reST-ish docstrings render on the API pages (docs/api/).

The docstrings are written for readers of the code: Sphinx roles (``:func:`~fsdp_runtime.apply_fsdp```),
``double backticks`` and ``[Note: ...]`` references to long comments. Double backticks are already
Markdown code; this extension, run by mkdocstrings (mkdocs.yml: ``extensions``), rewrites the rest
in every docstring of the package before it is rendered:

- a role whose target is on the API pages becomes a cross-reference (``[`apply_fsdp`][fsdp_runtime.apply_fsdp]``,
  checked by the strict build); any other target (a private module, ``autotune``) becomes code. ``~``
  keeps the last component only, as in Sphinx.
- ``[Note: name]`` stays as it is, followed by the file that holds the note where the docstring does
  not already say where it is (``[Note: unit names] (fsdp_runtime/blocks.py)``).

It reads the docstrings only; the source is never changed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`(~?)([\w.]+?)(?:\(\))?`")
NOTE = re.compile(r"\[Note: ([^\]]+)\]( in\b)?")
NOTE_DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$", re.MULTILINE)
SOURCE_ROOTS = ("fsdp_runtime", "autotune", "profiles")
"""The packages whose ``[Note: ...]`` definitions are looked up (a docstring may cite any of them)."""


class RestRoles(griffe.Extension):
    """Rewrites the roles and notes of every docstring in a package once it is loaded."""

    def __init__(self, *, repo: str | Path = ".", roots: tuple[str, ...] = SOURCE_ROOTS) -> None:
        super().__init__()
        self.roots = roots
        self.notes = get_note_files(Path(repo), roots)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        public = get_public_paths(pkg)
        for obj in iter_objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self.rewrite(obj.docstring.value, obj, public)

    def rewrite(self, text: str, obj: griffe.Object, public: dict[str, str]) -> str:
        def role(match: re.Match[str]) -> str:
            short, target = match.group(1) == "~", match.group(2)
            shown = f"`{target.rsplit('.', 1)[-1] if short else target}`"
            identifier = find_identifier(target, obj, public, self.roots)
            return f"[{shown}][{identifier}]" if identifier else shown

        def note(match: re.Match[str]) -> str:
            name, says_where = " ".join(match.group(1).split()), match.group(2)  # a note's name may wrap
            where = self.notes.get(name)
            text = rf"\[Note: {name}\]"
            if says_where:
                return text + says_where
            return f"{text} (`{where}`)" if where else text

        return NOTE.sub(note, ROLE.sub(role, text))


def get_note_files(repo: Path, roots: tuple[str, ...]) -> dict[str, str]:
    """Each ``[Note: name]`` of the source, by the file (relative to the repository) that defines it."""
    notes = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            for name in NOTE_DEFINITION.findall(path.read_text(encoding="utf-8")):
                notes.setdefault(name, path.relative_to(repo).as_posix())
    return notes


def get_public_paths(pkg: griffe.Module) -> dict[str, str]:
    """``{canonical path: path on the API pages}`` for every name in the package's ``__all__``."""
    public = {}
    for name in pkg.exports or ():
        member = pkg.members.get(str(name))
        if member is None:
            continue
        path = f"{pkg.path}.{name}"
        public[path] = path
        try:
            public[member.final_target.path if member.is_alias else member.path] = path
        except griffe.AliasResolutionError:
            continue
    return public


def iter_objects(obj: griffe.Object) -> Any:
    """``obj`` and every object defined under it (aliases left out: their targets are visited)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from iter_objects(member)


def find_identifier(target: str, obj: griffe.Object, public: dict[str, str], roots: tuple[str, ...]) -> str | None:
    """The API pages' identifier for a role's ``target`` written in ``obj``'s docstring, or None where
    the target is not rendered there (not public, private, or a member without a docstring)."""
    if target.split(".")[0] in (*roots, obj.package.name):
        candidates = [target]
    else:  # relative to the docstring's object, its parent, its module, then its package
        module = obj.module.path
        scopes = (obj.path, obj.parent.path if obj.parent else module, module, module.split(".")[0])
        candidates = [f"{scope}.{target}" for scope in scopes]
    for candidate in candidates:
        found = lookup(obj, candidate)
        if found is not None:
            return to_public(found, public)
    return None


def lookup(obj: griffe.Object, path: str) -> griffe.Object | None:
    try:
        found = obj.modules_collection[path]
        return found.final_target if found.is_alias else found
    except (KeyError, ValueError, griffe.AliasResolutionError):
        return None


def to_public(found: griffe.Object, public: dict[str, str]) -> str | None:
    """The public path of ``found`` or of the public class holding it (a documented member), or None."""
    path = found.path
    if path in public:
        return public[path]
    owner, _, member = path.rpartition(".")
    if owner in public and found.docstring is not None and not member.startswith("_"):
        return f"{public[owner]}.{member}"
    return None
