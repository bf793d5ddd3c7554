"""Every package declares what it imports (``tests/declared_deps.py`` says how a need is
classified): a plain ``pip install`` of one package must bring every module its code uses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import declared_deps as D
import pytest
from packaging.requirements import Requirement


@pytest.mark.parametrize("dist", sorted(D.first_party()))
def test_package_declares_what_it_imports(dist: str) -> None:
    findings = D.check(D.first_party()[dist])
    assert not findings, "undeclared imports:\n" + "\n".join(map(str, findings))


def _without(dist: str, extra: str | None, drop: str) -> dict[str, D.Package]:
    """The first-party packages with ``drop`` removed from ``dist``'s requirements (or one extra)."""
    packages = dict(D.first_party())
    pkg = packages[dist]
    if extra is None:
        reqs = [r for r in pkg.required if D.norm(r.name) != drop]
        assert len(reqs) == len(pkg.required) - 1, f"{dist} does not require {drop}"
        packages[dist] = dataclasses.replace(pkg, required=reqs)
    else:
        reqs = [r for r in pkg.extras[extra] if D.norm(r.name) != drop]
        assert len(reqs) == len(pkg.extras[extra]) - 1, f"{dist}[{extra}] does not list {drop}"
        packages[dist] = dataclasses.replace(pkg, extras={**pkg.extras, extra: reqs})
    return packages


@pytest.mark.parametrize(
    ("dist", "extra", "drop", "module", "at"),
    [
        # a direct import, at module level
        ("disagg-audio", None, "soxr", "soxr", "packages/audio/src/disagg_audio/decode.py"),
        # a need that is no import: transformers' HfDeepSpeedConfig wants accelerate (the plain-install bug)
        ("disagg-zero", None, "accelerate", "accelerate", "packages/zero-backend/src/disagg_zero/build.py"),
        # a sibling plugin the tests need, and a first-party dependency followed to its own deps
        ("disagg-audio", "test", "disagg-llm-tp", "disagg_llm_tp", "packages/audio/tests/"),
        ("disagg-llm-tp", None, "disagg-core", "torch", "packages/llm-tp/src/"),
        # an optional feature's lazy import, carried by an extra
        ("disagg-llm-tp", "lora", "peft", "peft", "packages/llm-tp/src/disagg_llm_tp/lora.py"),
    ],
)
def test_a_removed_dependency_is_named(dist: str, extra: str | None, drop: str, module: str, at: str) -> None:
    packages = _without(dist, extra, drop)
    findings = D.check(packages[dist], packages)
    named = [f for f in findings if f.module == module]
    assert named, f"removing {drop} from {dist} went unnoticed: {findings}"
    assert any(w.startswith(at) for w in named[0].where), named[0]


def _package(root: Path, body: str) -> D.Package:
    src = root / "src" / "toy_pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "mod.py").write_text(body)
    reqs = [Requirement("disagg-core")]
    return D.Package("toy", root, {"toy_pkg"}, reqs, {"lora": [Requirement("peft")]})


def test_an_extra_covers_a_lazy_import_only(tmp_path: Path) -> None:
    lazy = _package(tmp_path / "lazy", "def f():\n    import peft\n")
    hard = _package(tmp_path / "hard", "import peft\n")
    guarded = _package(tmp_path / "guarded", "try:\n    import peft\nexcept ImportError:\n    peft = None\n")
    typing_only = _package(
        tmp_path / "typing", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import accelerate\n"
    )
    assert D.check(lazy) == [] and D.check(guarded) == [] and D.check(typing_only) == []
    (finding,) = D.check(hard)
    assert finding.module == "peft" and "required dependencies" in finding.why
