"""Build the wheels a bare GPU host needs for ``python -m disagg.gpucheck`` (docs/gpu.md).

Run on a machine with a network, from an environment where disagg-core, -vision-sp,
-llm-tp and -zero are installed (the dev venv or ``nox -s tests``'s): the third-party
wheels are the versions installed *here*, the ones the check was developed with, fetched
for the host's Python and platform (``--python 3.12`` by default: megatron-core,
pydantic-core and numpy ship one wheel per Python version, so wheels of this machine's
Python would not install there). Written to ``--out``:

* ``disagg_*.whl`` built from this checkout, and the closure of their run-time
  dependencies, minus ``--skip`` (the host's own torch and what comes with it; Ray and
  pyarrow, which the check never imports);
* ``requirements.txt``: the four packages' own declared ranges (minus the same skips),
  which ``tools/gpu/run_check.sh`` resolves against the host's installed packages, so a
  host that already has a satisfying transformers keeps it and takes only what it lacks;
* ``MANIFEST.txt``: each wheel, its size and sha256.

``--omit NAME,...`` leaves out packages the host is known to have (its ``pip list``), to
fit a transfer limit; the install on the host fails naming any that turn out missing.
The wheelhouse must stay under ``--max-mib`` (60 by default), or the build fails.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

#: distribution -> source folder in this checkout
PACKAGES = {
    "disagg-core": "packages/core",
    "disagg-vision-sp": "packages/vision-sp",
    "disagg-llm-tp": "packages/llm-tp",
    "disagg-zero": "packages/zero-backend",
}

#: never carried: the host brings its own CUDA torch (and torch's CUDA libraries and
#: triton come with it); the check never imports ray (a test blocks it) nor pyarrow
#: (core declares it for Ray Data's readers)
SKIP = ("torch", "ray", "pyarrow", "triton", "nvidia-*", "cuda-*")

#: manylinux tags a host with glibc >= 2.28 takes (pip matches each tag exactly)
PLATFORMS = ["manylinux_2_%d_x86_64" % n for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def skipped(name: str, skip: tuple[str, ...]) -> bool:
    n = canon(name)
    return any(n == s or (s.endswith("*") and n.startswith(s[:-1])) for s in skip)


def applies(req: Requirement, python: str) -> bool:
    """Whether ``req`` is a run-time requirement on the host's Python (no extras)."""
    if req.marker is None:
        return True
    env = {"python_version": python, "python_full_version": python + ".0", "extra": ""}
    return req.marker.evaluate(env)


def closure(skip: tuple[str, ...], python: str) -> dict[str, str]:
    """Third-party distributions (name -> installed version) the four packages need."""
    found: dict[str, str] = {}
    stack = list(PACKAGES)
    while stack:
        name = stack.pop()
        key = canon(name)
        if key in found or skipped(key, skip):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            sys.exit(
                f"wheelhouse: {name} is not installed in this environment ({sys.executable}); "
                "run from the dev venv (README) or `pip install -e packages/...` first"
            )
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if applies(req, python):
                stack.append(req.name)
    return {k: v for k, v in found.items() if k not in PACKAGES}


def host_requirements(skip: tuple[str, ...], python: str) -> list[str]:
    """The four packages' own declared ranges, for the host's resolver."""
    lines = []
    for name in PACKAGES:
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            if applies(req, python) and not skipped(req.name, skip) and canon(req.name) not in PACKAGES:
                req.marker = None
                lines.append(str(req))
    return sorted(set(lines), key=str.lower)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build_disagg(out: Path, names: tuple[str, ...] = tuple(PACKAGES)) -> None:
    """The packages' wheels (``names``: the four by default), built from this checkout into ``out``."""
    # setuptools copies sources into build/lib and packs that folder: a module deleted from src
    # but left there by an earlier build would ship, so each build starts and ends without it
    stale = [ROOT / PACKAGES[n] / "build" for n in names]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    try:
        pip("wheel", "-q", "--no-deps", "-w", str(out), *(str(ROOT / PACKAGES[n]) for n in names))
    finally:
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)


def fetch(pins: dict[str, str], out: Path, python: str) -> None:
    """Binary wheels for the host's Python; a package with none (deepspeed ships only an
    sdist) is built here, and must come out pure Python (``py3-none-any``)."""
    target = ["--python-version", python, "--implementation", "cp", "--only-binary=:all:"]
    for plat in PLATFORMS:
        target += ["--platform", plat]
    for name, version in sorted(pins.items()):
        spec = f"{name}=={version}"
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out), *target, spec],
            capture_output=True,
            text=True,
        )
        if got.returncode == 0:
            continue
        print(f"wheelhouse: no {python} wheel of {spec}; building one", flush=True)
        before = set(out.glob("*.whl"))
        pip("wheel", "-q", "--no-deps", "-w", str(out), spec)
        for whl in set(out.glob("*.whl")) - before:
            if not whl.name.endswith("-py3-none-any.whl"):
                whl.unlink()
                sys.exit(
                    f"wheelhouse: {spec} has no wheel for Python {python} and builds only a binary one here"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    ap.add_argument("--python", default="3.12", help="the host's Python, major.minor")
    ap.add_argument(
        "--omit",
        default="numpy",
        help="comma-separated packages the host already has (default numpy: 16 MiB, and every "
        "CUDA torch environment we know has one; --omit '' carries it too)",
    )
    ap.add_argument("--max-mib", type=float, default=60.0)
    args = ap.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python):
        sys.exit(f"wheelhouse: --python {args.python!r}: expected major.minor, e.g. 3.12")
    omit = tuple(canon(n) for n in args.omit.split(",") if n.strip())

    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.whl"):
        old.unlink()
    pins = closure(SKIP, args.python)
    unknown = [n for n in omit if n not in pins]
    if unknown:
        sys.exit(f"wheelhouse: --omit {','.join(unknown)}: not among the dependencies {sorted(pins)}")
    build_disagg(args.out)
    fetch({n: v for n, v in pins.items() if n not in omit}, args.out, args.python)
    (args.out / "requirements.txt").write_text("\n".join(host_requirements(SKIP, args.python)) + "\n")

    wheels = sorted(args.out.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    rows = [f"{w.stat().st_size:>10}  {hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}" for w in wheels]
    rows.append(f"{total:>10}  total ({total / 2**20:.1f} MiB, {len(wheels)} wheels; Python {args.python})")
    (args.out / "MANIFEST.txt").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    if total > args.max_mib * 2**20:
        sys.exit(f"wheelhouse: {total / 2**20:.1f} MiB > --max-mib {args.max_mib}: --omit what the host has")


if __name__ == "__main__":
    main()
