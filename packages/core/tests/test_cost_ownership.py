"""Core's planner and cost package name no strategy: each strategy states its own
cost (``Strategy.estimate``) and its searchable options (``Strategy.option_variants``)
in its own package, so nothing in ``disagg/cost/`` or ``disagg/plan/`` may branch on
a first-party strategy's name or hold a backend's (DeepSpeed's) constants. The
presets and the published setting (``disagg/bench/``) and the docs may name them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CORE = ROOT / "packages" / "core" / "src" / "disagg"
SCANNED = [CORE / "cost", CORE / "plan"]
#: the first-party strategies (also read from the installed packages' registrations below)
FIRST_PARTY = {"ddp", "ulysses", "megatron_tp", "zero"}
#: words that belong to one backend: its library, its config keys, its default constants
BACKEND = [
    r"deep_?speed",
    r"megatron",
    r"ds_config",
    r"stage3",
    r"persistence",
    r"sequence_parallel",
    r"[\"']stage[\"']|\bstage\s*=",  # zero's option key (not "a two-stage pipeline")
    r"\bzero-?[123]\b",
    r"100_?000\b",
    r"500_?000_?000\b",
    r"\b5e8\b",
]


def first_party_names() -> set[str]:
    """The fixed list, plus every installed strategy whose class lives in one of this
    repository's packages (so a new first-party strategy is covered without editing this)."""
    tops = {p.name for pkg in (ROOT / "packages").iterdir() for p in (pkg / "src").glob("*") if p.is_dir()}
    names = set(FIRST_PARTY)
    try:
        from disagg.plugins import get_registry

        strategies = get_registry().strategies
    except Exception:  # the registry could not load: the fixed list still holds
        return names
    return names | {n for n, cls in strategies.items() if cls.__module__.split(".")[0] in tops}


def offences(files: list[Path], names: set[str]) -> list[str]:
    words = [rf"\b{re.escape(n)}\b" for n in sorted(names)] + BACKEND
    pattern = re.compile("|".join(words), re.IGNORECASE)
    out = []
    for f in files:
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        for i, line in enumerate(f.read_text().splitlines(), 1):
            out += [f"{where}:{i}: {m.group(0)!r} in {line.strip()!r}" for m in pattern.finditer(line)]
    return out


def test_core_cost_and_plan_name_no_strategy_and_no_backend_constant():
    files = sorted(p for d in SCANNED for p in d.rglob("*.py"))
    assert len(files) >= 10, files  # the scan reads the real packages
    assert offences(files, first_party_names()) == []


def test_the_scan_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('if strategy == "zero":\n    keep = 100_000\nVARIANTS = {"megatron_tp": [], "stage": 3}\n')
    assert len(offences([bad], FIRST_PARTY)) == 4
