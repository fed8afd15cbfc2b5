"""The layering docs/architecture.md states, and the length of functions, checked on
the source: an AST walk over every ``import X`` / ``from X import Y`` of ``autotune/``,
``fsdp_runtime/``, ``profiles/`` and ``cli.py`` (imports inside functions and under
``TYPE_CHECKING`` included).

- Stage order: a module imports only from its own stage and the stages before it in
  docs/architecture.md's ``Stages, upstream first:`` chain (nothing upstream imports downstream).
- No ``_private`` name (nor a name from a ``_private`` module) is imported from another stage.
- ``fsdp_runtime`` imports only torch, the standard library and itself.
- A name imported from another stage is in its package's ``__all__`` (``cli.py`` included).
- A function's body (its statements after the docstring) is at most ``MAX_FUNCTION_LINES`` lines.

Each check is also run on a small made-up source below, so that each can be seen to fail.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("autotune", "fsdp_runtime", "profiles")
PROJECT = {*SOURCE_ROOTS, "cli"}
RUNTIME_ALLOWED = {"torch", "fsdp_runtime", "__future__", *sys.stdlib_module_names}
MAX_FUNCTION_LINES = 60
# --------------------------------------------------------------------------- reading the tree


def get_stage_order(readme: str) -> list[str]:
    """docs/architecture.md's ``Stages, upstream first: `a` -> `b` -> ...`` chain (``cli.py`` as ``cli``)."""
    match = re.search(r"Stages, upstream first: ((?:`[\w.]+`\s*->\s*)+`[\w.]+`)", readme)
    assert match, "docs/architecture.md: no 'Stages, upstream first: `a` -> `b` ...' chain"
    return [name.removesuffix(".py") for name in re.findall(r"`([\w.]+)`", match.group(1))]


def get_module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def get_stage(module: str) -> str:
    """``autotune.search.presearch`` -> ``autotune.search``; ``fsdp_runtime.files`` -> ``fsdp_runtime``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "autotune" else parts[0]


def iter_sources() -> Iterator[Path]:
    for root in SOURCE_ROOTS:
        yield from sorted((REPO / root).rglob("*.py"))
    yield REPO / "cli.py"


def iter_imports(module: str, tree: ast.AST, *, is_package: bool) -> Iterator[tuple[int, str, list[str]]]:
    """(line, imported module, names) for every import; ``import X`` has no names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolved against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([target] if target else [])])
            if target == "autotune":  # `from autotune import search`: the names are stages
                for alias in node.names:
                    yield node.lineno, f"autotune.{alias.name}", []
            else:
                yield node.lineno, target, [alias.name for alias in node.names]


def get_all(module: str) -> set[str] | None:
    """The public surface a name imported from ``module`` must be in: the ``__all__`` of ``module`` if
    it is a package or a stage of its own (``autotune.artifacts``), else of the package holding it."""
    path = REPO.joinpath(*module.split("."))
    if path.is_dir():
        init = path / "__init__.py"
    elif module == get_stage(module):
        init = path.with_suffix(".py")
    else:
        return get_all(module.rpartition(".")[0])
    if not init.exists():
        return None
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


# --------------------------------------------------------------------------- the checks


def check_imports(path: str, module: str, source: str, order: list[str], *, is_package: bool = False) -> list[str]:
    """Every layering rule broken by one module, one line each: ``path:line: what``."""
    problems = []
    stage = get_stage(module)
    if stage not in order:
        return [f"{path}: stage {stage} is not in the architecture's stage order {order}"]
    for line, target, names in iter_imports(module, ast.parse(source), is_package=is_package):
        top = target.split(".")[0]
        if stage == "fsdp_runtime" and top not in RUNTIME_ALLOWED:
            problems.append(f"{path}:{line}: fsdp_runtime imports {target} (torch and the standard library only)")
        if top not in PROJECT or get_stage(target) == stage:
            continue
        other = get_stage(target)
        if other not in order:
            problems.append(f"{path}:{line}: imports {target}, whose stage {other} is not in the architecture's order")
        elif order.index(other) > order.index(stage):
            problems.append(f"{path}:{line}: {stage} imports {target}, a later stage (imports run upstream only)")
        private = [p for p in target.split(".") if p.startswith("_")] + [n for n in names if n.startswith("_")]
        if private:
            problems.append(f"{path}:{line}: imports the private {private[0]} of {other} from another stage")
        public = get_all(target) if names else None
        for name in names if public is not None else []:
            if name not in public and not name.startswith("_"):
                problems.append(f"{path}:{line}: imports {name} from {target}, which is not in its package's __all__")
        if names and public is None:
            problems.append(f"{path}:{line}: imports from {target}, whose package has no __all__")
    return problems


def check_function_lengths(path: str, source: str, *, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:name`` of every function whose body (after its docstring) spans more than ``limit`` lines."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1:
            body = body[1:]
        if body[-1].end_lineno - body[0].lineno + 1 > limit:
            long.append(f"{path}:{node.name}")
    return long


# --------------------------------------------------------------------------- the tree


def test_imports_follow_the_readme_s_layering():
    order = get_stage_order((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    stages = {get_stage(get_module_name(p)) for p in iter_sources()} - {"autotune"}
    assert stages <= set(order), f"stages missing from the architecture's order: {sorted(stages - set(order))}"
    problems = [
        problem
        for path in iter_sources()
        if get_module_name(path) != "autotune"  # the empty namespace package
        for problem in check_imports(
            str(path.relative_to(REPO)),
            get_module_name(path),
            path.read_text(encoding="utf-8"),
            order,
            is_package=path.name == "__init__.py",
        )
    ]
    assert not problems, "\n".join(problems)


def test_every_stage_names_its_public_surface():
    order = get_stage_order((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert [s for s in order if s != "cli" and get_all(s) is None] == []


def test_functions_are_short():
    long = {
        problem
        for path in iter_sources()
        for problem in check_function_lengths(str(path.relative_to(REPO)), path.read_text(encoding="utf-8"))
    }
    assert not long, f"function bodies over {MAX_FUNCTION_LINES} lines: {sorted(long)}"


# --------------------------------------------------------------------------- each check can fail

ORDER = ["fsdp_runtime", "profiles", "autotune.artifacts", "autotune.search", "autotune.plan", "cli"]


@pytest.mark.parametrize(
    ("module", "source", "fragment"),
    [
        (
            "autotune.search.space",
            "from autotune.plan import PlanSettings\n",
            "autotune.search imports autotune.plan, a later stage",
        ),
        (
            "autotune.search.space",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import autotune.plan.run\n",
            "a later stage",
        ),
        ("autotune.plan.run", "from autotune.search.presearch import _walk\n", "imports the private _walk"),
        ("autotune.plan.run", "from fsdp_runtime.consolidate._state import METHODS\n", "the private _state"),
        ("cli", "from autotune.plan.run import StagedEvaluator\n", "StagedEvaluator from autotune.plan.run"),
        ("autotune.plan.run", "from autotune.search.ranking import simulate_points\n", "not in its package's __all__"),
        ("fsdp_runtime.apply", "import numpy\n", "fsdp_runtime imports numpy"),
        ("fsdp_runtime.apply", "from profiles import load_model_profile\n", "a later stage"),
        ("autotune.nowhere.x", "import os\n", "stage autotune.nowhere is not in the architecture's stage order"),
    ],
)
def test_each_layering_rule_catches_its_breach(module, source, fragment):
    problems = check_imports("x.py", module, source, ORDER)
    assert any(fragment in p for p in problems), problems


def test_the_layering_rules_pass_a_clean_module():
    source = (
        "import os\nimport torch\nfrom autotune.search import SearchSpace, rank_staged\n"
        "from autotune.plan.run import PlanSettings\nfrom fsdp_runtime.files import write_atomic\n"
    )
    assert check_imports("x.py", "autotune.plan.tables", source, ORDER) == []


def test_a_long_function_is_caught_and_its_docstring_and_signature_do_not_count():
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert check_function_lengths("x.py", f'def f(\n    a,\n    b,\n):\n    """Doc.\n\n    More."""\n{body}') == []
    assert check_function_lengths("x.py", f"def f():\n{body}    return x0\n") == ["x.py:f"]
    method = "class C:\n    async def m(self):\n" + "".join(f"        x{i} = {i}\n" for i in range(61))
    assert check_function_lengths("x.py", method) == ["x.py:m"]


def test_the_readme_states_the_stage_order():
    assert get_stage_order("Stages, upstream first: `fsdp_runtime` -> `profiles` ->\n`cli.py`.") == [
        "fsdp_runtime",
        "profiles",
        "cli",
    ]


def test_test_folders_mirror_the_stages():
    """``tests/autotune/<stage>/`` for each stage package of ``autotune`` that has tests, and no other folder."""
    folders = {p.name for p in (REPO / "tests" / "autotune").iterdir() if p.is_dir() and p.name != "__pycache__"}
    packages = {p.name for p in (REPO / "autotune").iterdir() if (p / "__init__.py").exists()}
    assert folders <= packages, f"test folders that are no stage of autotune: {sorted(folders - packages)}"
    flat = sorted(p.name for p in (REPO / "tests" / "autotune").glob("test_*.py"))
    assert flat == ["test_artifacts.py", "test_artifacts_refused.py"], flat  # autotune/artifacts.py is a module
