"""The layering docs/architecture.md states, and the size of modules and functions, checked on
the source: an AST walk over every ``import X`` / ``from X import Y`` of ``autotune/``,
``fsdp_runtime/``, ``profiles/`` and ``cli.py`` (imports inside functions and under
``TYPE_CHECKING`` included).

- Stage order: a module imports only from its own stage and the stages before it in
  docs/architecture.md's ``Stages, upstream first:`` chain (nothing upstream imports downstream).
- No ``_private`` name (nor a name from a ``_private`` module) is imported from another stage.
- ``fsdp_runtime`` imports only torch, the standard library and itself.
- A name imported from another stage is in its package's ``__all__`` (``cli.py`` included).
- No import circle between modules, whatever their stages. The graph has an edge for every
  import statement, at the top of a module, inside a function (a lazy import) or under
  ``TYPE_CHECKING``: a lazy import only defers the circle to run time, and a type-checking one
  still makes each module's meaning depend on the other's; either way the two are one design
  split in two, or a part both need belongs in a third module. ``import a.b`` and
  ``from a.b import x`` are edges to ``a.b`` (to ``a.b.x`` where that is a module); the packages
  Python runs first (``a/__init__.py``) are not, or every package whose ``__init__`` re-exports its
  modules would be a circle.
- Private names stay in their module: no ``_name`` is imported from another module, in any
  stage (a module's ``_name`` is its own; what two modules share is public in one of them). A
  ``_private`` module is private to the package holding it: it is imported only by that package's
  own modules (its ``__init__``, its siblings and the modules of its subpackages), and only its
  public names are. ``__dunder__`` names are not private.
- A module is at most ``MAX_MODULE_LINES`` lines.
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
MAX_MODULE_LINES = 450
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


def check_module_length(path: str, source: str, *, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: N lines`` where the module is longer than ``limit`` lines."""
    lines = len(source.splitlines())
    return [f"{path}: {lines} lines (at most {limit})"] if lines > limit else []


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def iter_imported_modules(
    module: str, source: str, modules: set[str], *, is_package: bool = False
) -> Iterator[tuple[int, str]]:
    """(line, module of ``modules``) for every import of ``module``: ``import a.b`` -> ``a.b``;
    ``from a.b import x`` -> ``a.b.x`` where that is a module, else ``a.b``."""
    for line, target, names in iter_imports(module, ast.parse(source), is_package=is_package):
        if not names and target in modules:
            yield line, target
        for name in names:
            if f"{target}.{name}" in modules:
                yield line, f"{target}.{name}"
            elif target in modules:
                yield line, target


def check_private_imports(
    path: str, module: str, source: str, modules: set[str], *, is_package: bool = False
) -> list[str]:
    """Every ``_name`` imported from another module, and every ``_private`` module imported from
    outside the package holding it, one line each: ``path:line: what``."""
    problems, roots = [], {m.split(".")[0] for m in modules}

    def check_module(line: int, target: str) -> None:
        parts = target.split(".")
        private = next((i for i, part in enumerate(parts) if is_private(part)), None)
        holder = ".".join(parts[:private]) if private is not None else None
        if holder is not None and module != holder and not module.startswith(holder + "."):
            problems.append(f"{path}:{line}: imports {target}, a private module of {holder}, from outside it")

    for line, target, names in iter_imports(module, ast.parse(source), is_package=is_package):
        if target.split(".")[0] not in roots:
            continue
        check_module(line, target)
        for name in names:
            if f"{target}.{name}" in modules:
                check_module(line, f"{target}.{name}")
            elif is_private(name):
                problems.append(f"{path}:{line}: imports the private name {name} from the module {target}")
    return problems


def find_import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each import circle (a strongly connected component of more than one module,
    Tarjan's algorithm), each sorted; ``graph`` maps a module to the modules it imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def check_import_circles(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Each import circle among ``sources`` (module -> (source, is_package)), one line with its
    imports: ``a.b:3 -> a.c, a.c:7 -> a.b``."""
    modules = set(sources)
    edges = {
        module: {
            (line, target)
            for line, target in iter_imported_modules(module, source, modules, is_package=is_package)
            if target != module
        }
        for module, (source, is_package) in sources.items()
    }
    graph = {module: {target for _, target in imports} for module, imports in edges.items()}
    problems = []
    for circle in find_import_circles(graph):
        inside = sorted((m, line, t) for m in circle for line, t in edges[m] if t in circle)
        problems.append("import circle: " + ", ".join(f"{m}:{line} -> {t}" for m, line, t in inside))
    return problems


# --------------------------------------------------------------------------- the tree


def read_tree() -> dict[str, tuple[str, bool]]:
    """Every module of the tree: name -> (source, is_package); the empty ``autotune`` namespace left out."""
    return {
        get_module_name(path): (path.read_text(encoding="utf-8"), path.name == "__init__.py")
        for path in iter_sources()
        if get_module_name(path) != "autotune"
    }


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


def test_modules_are_short():
    long = [
        problem
        for path in iter_sources()
        for problem in check_module_length(str(path.relative_to(REPO)), path.read_text(encoding="utf-8"))
    ]
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_module_imports_itself_back():
    problems = check_import_circles(read_tree())
    assert not problems, "\n".join(problems)


def test_private_names_stay_in_their_module():
    tree = read_tree()
    problems = [
        problem
        for module, (source, is_package) in tree.items()
        for problem in check_private_imports(module, module, source, set(tree), is_package=is_package)
    ]
    assert not problems, "\n".join(problems)


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


def test_a_long_module_is_caught():
    assert check_module_length("x.py", "x = 1\n" * MAX_MODULE_LINES) == []
    assert check_module_length("x.py", "x = 1\n" * (MAX_MODULE_LINES + 1)) == ["x.py: 451 lines (at most 450)"]


@pytest.mark.parametrize(
    ("b_source", "c_source"),
    [
        ("from a.c import f\n", "from a.b import g\n"),  # both at the top
        ("from a.c import f\n", "def g():\n    from a.b import h\n"),  # one of them lazy
        ("import a.c\n", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.b import B\n"),
        ("from a import c\n", "from a import b\n"),  # submodules named through their package
    ],
)
def test_a_circle_of_two_modules_is_caught(b_source, c_source):
    sources = {"a": ("", True), "a.b": (b_source, False), "a.c": (c_source, False)}
    problems = check_import_circles(sources)
    assert len(problems) == 1 and problems[0].startswith("import circle: a.b:1 -> a.c, a.c:"), problems


def test_a_package_re_exporting_its_modules_is_no_circle():
    sources = {
        "a": ("from a.b import f\nfrom a.c import g\n", True),
        "a.b": ("from a import c\nfrom a.c import g\n", False),  # c, a module: no edge to a's __init__
        "a.c": ("import os\n", False),
    }
    assert check_import_circles(sources) == []
    sources["a.c"] = ("from a import f\n", False)  # f is a name: this runs a/__init__.py, which imports a.c
    assert check_import_circles(sources) == [
        "import circle: a:1 -> a.b, a:2 -> a.c, a.b:1 -> a.c, a.b:2 -> a.c, a.c:1 -> a"
    ]


MODULES = {"a", "a.b", "a.c", "a._m", "a.sub", "a.sub.d", "e", "e.f"}


@pytest.mark.parametrize(
    ("module", "source", "fragment"),
    [
        ("a.c", "from a.b import _x\n", "imports the private name _x from the module a.b"),
        ("a.c", "def f():\n    from a.b import _x\n", "imports the private name _x from the module a.b"),
        ("e.f", "from a._m import g\n", "imports a._m, a private module of a, from outside it"),
        ("e.f", "from a import _m\n", "imports a._m, a private module of a, from outside it"),
        ("e.f", "import a._m\n", "imports a._m, a private module of a, from outside it"),
        ("a.c", "from a._m import _y\n", "imports the private name _y from the module a._m"),
    ],
)
def test_a_private_name_imported_from_another_module_is_caught(module, source, fragment):
    problems = check_private_imports("x.py", module, source, MODULES)
    assert any(fragment in p for p in problems), problems


def test_a_package_s_own_modules_may_import_its_private_modules():
    source = "from a._m import g\nfrom a import _m\nimport a._m\nfrom a.b import __version__\n"
    for module in ("a", "a.c", "a.sub.d"):
        assert check_private_imports("x.py", module, source, MODULES, is_package=module == "a") == []
