"""What each package imports (by AST) against what its ``pyproject.toml`` declares.

A plugin that imports a module no declared distribution provides works in the
all-together test venv (a sibling, or an extra, brought it) and fails in a user's
plain ``pip install``: that is how ``accelerate`` went missing from ``disagg-zero``.
Imports are classified by how hard a need they are:

- *hard*: at module level, outside ``try`` and ``if TYPE_CHECKING`` -- must come
  from the package's required dependencies (first-party ones followed: a plugin gets
  ``disagg-core``'s);
- *lazy*: inside a function, or under ``try`` -- may also come from one of its extras
  (an optional feature, e.g. ``peft`` for LoRA);
- test code (the package's ``tests/`` and its ``testing`` subpackage) may also use
  the ``test`` extra; ``pytest.importorskip("x")`` and ``find_spec("x")`` count as imports.

Some needs are not imports: :data:`INDIRECT` lists modules that import a further
distribution only when called.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted((ROOT / "packages").glob("*/pyproject.toml")) + sorted(
    (ROOT / "examples").glob("*/pyproject.toml")
)

#: module (prefix) -> distributions it needs at run time without importing them at its top:
#: transformers' ``HfDeepSpeedConfig`` calls ``dep_version_check("accelerate")`` and
#: subclasses accelerate's class (transformers/integrations/deepspeed.py).
INDIRECT: dict[str, tuple[str, ...]] = {
    "transformers.integrations.deepspeed": ("accelerate",),
}


def norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Package:
    dist: str
    root: Path
    imports: set[str]  # its own top-level import names
    required: list[Requirement]
    extras: dict[str, list[Requirement]]


@dataclass(frozen=True)
class Use:
    module: str  # dotted, as written
    file: str
    line: int
    kind: str  # hard | lazy | test


@dataclass
class Finding:
    package: str
    module: str
    where: list[str] = field(default_factory=list)
    why: str = ""

    def __str__(self) -> str:
        return f"{self.package}: {self.module!r} ({self.why}) at {', '.join(self.where[:3])}"


def load(pyproject: Path) -> Package:
    proj = tomllib.loads(pyproject.read_text())["project"]
    src = pyproject.parent / "src"
    imports = {p.name for p in src.iterdir() if (p / "__init__.py").is_file()}
    extras = {k: [Requirement(r) for r in v] for k, v in proj.get("optional-dependencies", {}).items()}
    return Package(
        proj["name"], pyproject.parent, imports, [Requirement(r) for r in proj["dependencies"]], extras
    )


@cache
def first_party() -> dict[str, Package]:
    return {norm(p.dist): p for p in map(load, PACKAGES)}


@cache
def installed() -> dict[str, set[str]]:
    """Import name -> normalised names of the installed distributions that provide it."""
    return {m: {norm(d) for d in ds} for m, ds in md.packages_distributions().items()}


def closure(reqs: list[Requirement], packages: dict[str, Package]) -> set[str]:
    """Normalised distribution names ``reqs`` bring: first-party ones followed (with
    their named extras), third-party ones taken as they are (what they pull is theirs
    to change, so nothing may lean on it)."""
    out: set[str] = set()
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = norm(req.name)
        if name in out and not req.extras:
            continue
        out.add(name)
        pkg = packages.get(name)
        if pkg is not None:
            todo += pkg.required + [r for e in req.extras for r in pkg.extras.get(e, [])]
    return out


def _type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(test)


def uses(path: Path, rel: str, test_code: bool) -> list[Use]:
    """The absolute imports of one file, each with how hard a need it is."""
    found: list[Use] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for c in child.orelse:
                    visit_one(c, lazy)
                continue
            visit_one(child, lazy)

    def visit_one(node: ast.AST, lazy: bool) -> None:
        kind = "test" if test_code else ("lazy" if lazy else "hard")
        if isinstance(node, ast.Import):
            found.extend(Use(a.name, rel, node.lineno, kind) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(Use(node.module, rel, node.lineno, kind))
            # ``from transformers.integrations import deepspeed``: the submodule is the use
            found.extend(Use(f"{node.module}.{a.name}", rel, node.lineno, kind) for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith(("importorskip", "find_spec", "import_module"))
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Use(node.args[0].value, rel, node.lineno, kind))
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.Try)
        visit(node, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def package_uses(pkg: Package) -> list[Use]:
    out = []
    for sub, test_dir in (("src", False), ("tests", True)):
        base = pkg.root / sub
        for f in sorted(base.rglob("*.py")) if base.is_dir() else []:
            rel = str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)
            out += uses(f, rel, test_dir or "testing" in f.relative_to(base).parts)
    return out


def check(pkg: Package, packages: dict[str, Package] | None = None) -> list[Finding]:
    """Every module ``pkg`` uses that its declared dependencies do not bring."""
    packages = first_party() if packages is None else packages
    dists_of = installed()
    own_mods = {m for p in packages.values() for m in p.imports}
    required = closure(pkg.required, packages)
    optional = closure(pkg.required + [r for k, v in pkg.extras.items() if k != "test" for r in v], packages)
    testing = closure(pkg.required + [r for v in pkg.extras.values() for r in v], packages)
    allowed = {"hard": required, "lazy": optional, "test": testing}
    local = {f.stem for f in (pkg.root / "tests").rglob("*.py")} if (pkg.root / "tests").is_dir() else set()
    findings: dict[tuple[str, str], Finding] = {}
    for use in package_uses(pkg):
        top = use.module.split(".")[0]
        if top in sys.stdlib_module_names or top in pkg.imports or top in local or top == "__future__":
            continue
        needs: list[tuple[str, set[str]]] = []
        if top in own_mods:  # a sibling's import name: its distribution, from the repo
            needs.append((top, {norm(p.dist) for p in packages.values() if top in p.imports}))
        elif top in dists_of:
            needs.append((top, dists_of[top]))
        else:  # not installed here (e.g. cupy-cuda12x on a CPU host): a declared name that starts with it
            needs.append(
                (top, {d for d in allowed[use.kind] if d == norm(top) or d.startswith(norm(top) + "-")})
            )
        needs += [
            (dist, {dist})
            for prefix, dists in INDIRECT.items()
            if use.module == prefix or use.module.startswith(prefix + ".")
            for dist in dists
        ]
        for name, dists in needs:
            if dists & allowed[use.kind]:
                continue
            if not dists:
                why = "no installed distribution provides it"
            else:
                where = (
                    "required dependencies" if use.kind == "hard" else f"dependencies or extras ({use.kind})"
                )
                why = f"provided by {', '.join(sorted(dists))}, which is not in its {where}"
            f = findings.setdefault((name, why), Finding(pkg.dist, name, why=why))
            if f"{use.file}:{use.line}" not in f.where:
                f.where.append(f"{use.file}:{use.line}")
    return list(findings.values())
