"""Sessions: ``tests`` (everything installed), ``isolation`` (core + one plugin),
``lint``, ``demo`` (the main job: a tiny multimodal run on local Ray, CPU),
``bench``, ``gpu`` (the CUDA check suite, on a machine with an NVIDIA GPU) and ``kernels``.

``kernels`` (not run by CI, nor by default) reruns the equivalence subset (every test file that
uses ``disagg.testing.tolerance`` or a harness built on it) under the other CPU kernel set:
``ATEN_CPU_CAPABILITY=avx2`` and ``OMP_NUM_THREADS=1`` (override with ``KERNELS_CPU`` and
``KERNELS_THREADS``), logs every check's margin (largest error / bound) to
``runs/margins/kernels.jsonl`` and fails if one exceeds 0.5 (``python -m
disagg.testing.margins``). The verdict of an equivalence test must not depend on the CPU.

torch is pinned here, never in the packages (users bring the build that
matches their hardware); it is installed first so that no package pulls
another build. Set ``TORCH_INDEX_URL`` (e.g. https://download.pytorch.org/whl/cpu)
to install it from a specific index.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]

PYTHON = "3.11"
TORCH = "torch==2.13.0"
ROOT = Path(__file__).parent
PLUGINS = ["vision-sp", "llm-tp", "zero-backend", "audio"]
EXAMPLE = "examples/disagg-example-plugin"
# DeepSpeed must not look for CUDA on CPU-only machines.
ENV = {"DS_ACCELERATOR": "cpu"}


def install_torch(session: nox.Session) -> None:
    index = os.environ.get("TORCH_INDEX_URL")
    session.install(TORCH, *(["--index-url", index] if index else []))


def install(session: nox.Session, *paths: str) -> None:
    for path in paths:
        if not (ROOT / path / "pyproject.toml").is_file():
            session.error(f"{path}/pyproject.toml is missing")
    install_torch(session)
    args = [a for p in paths for a in ("-e", p)]
    session.install(*args, "pytest")


def pytest(session: nox.Session, *tests_dirs: str, marker: str = "not gpu") -> None:
    """One pytest process per tests dir: packages' test helpers have plain
    module names (conftest, fakes) that must not collide across packages.
    Every dir runs even when an earlier one fails, so one run shows every failure; each prints its
    15 slowest tests, so a CI log shows where the budget goes.
    ``marker``: the CUDA suite (pytest marker ``gpu``) runs only in ``nox -s gpu``."""
    failed = []
    for tests_dir in tests_dirs:
        if not any((ROOT / tests_dir).glob("**/test_*.py")):
            session.log(f"{tests_dir}: no tests yet")
            continue
        try:
            session.run("pytest", "-q", "--durations=15", "-m", marker, tests_dir, *session.posargs, env=ENV)
        except nox.command.CommandFailed:
            failed.append(tests_dir)
    if failed:
        session.error(f"tests failed in: {', '.join(failed)}")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Every package and the example plugin installed together; all tests."""
    packages = ["packages/core", *(f"packages/{p}" for p in PLUGINS)]
    install(session, *packages, EXAMPLE)
    session.install("scikit-learn")  # its sample photographs feed the real-image pipeline test
    session.install("datasets")  # writes the parquet / save_to_disk dirs the HF-dataset tests read
    # matplotlib: the bench and plot tests check their plots; the trackers' test reads their files back;
    # peft: the LoRA tests (train.modules.<m>.lora)
    session.install("-e", "packages/core[bench,trackers,lora]")
    pytest(session, *(f"{p}/tests" for p in packages), f"{EXAMPLE}/tests", "tests")


#: a test file in the equivalence subset mentions one of these (the policy or a harness built on it)
EQUIVALENCE_MARKERS = (
    "disagg.testing.tolerance",
    "disagg.testing.reference",
    "disagg_vision_sp.testing import",
    "import tp_cases",
    "from tp_cases",
    "zero_harness",
    "hf_reference",
)


def equivalence_tests(tests_dir: str) -> list[str]:
    return sorted(
        str(f.relative_to(ROOT))
        for f in (ROOT / tests_dir).glob("**/test_*.py")
        if any(m in f.read_text() for m in EQUIVALENCE_MARKERS)
    )


@nox.session(python=PYTHON)
def kernels(session: nox.Session) -> None:
    """The equivalence subset under the other kernel set (module docstring); margins logged."""
    packages = ["packages/core", *(f"packages/{p}" for p in PLUGINS)]
    install(session, *packages, EXAMPLE)
    session.install("scikit-learn")
    session.install("-e", "packages/core[lora]")  # the LoRA equivalence tests
    log = ROOT / "runs" / "margins" / "kernels.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    env = {
        **ENV,
        "ATEN_CPU_CAPABILITY": os.environ.get("KERNELS_CPU", "avx2"),
        "OMP_NUM_THREADS": os.environ.get("KERNELS_THREADS", "1"),
        "DISAGG_MARGIN_LOG": str(log),
    }
    failed = []
    for tests_dir in (*(f"{p}/tests" for p in packages), "tests"):
        files = equivalence_tests(tests_dir)
        if not files:
            continue
        try:  # one pytest per dir, as in ``tests``; every dir runs
            args = ["-q", "-m", "not gpu", "-p", "no:cacheprovider", *files, *session.posargs]
            session.run("pytest", *args, env=env)
        except nox.command.CommandFailed:
            failed.append(tests_dir)
    session.run("python", "-m", "disagg.testing.margins", str(log), "--top", "10", "--max", "0.5", env=env)
    if failed:
        session.error(f"equivalence tests failed under {env['ATEN_CPU_CAPABILITY']}: {', '.join(failed)}")


@nox.session(python=PYTHON)
@nox.parametrize("plugin", PLUGINS)
def isolation(session: nox.Session, plugin: str) -> None:
    """Core plus one plugin only: the plugin must not need its siblings."""
    install(session, "packages/core", f"packages/{plugin}")
    pytest(session, f"packages/{plugin}/tests")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: a tiny multimodal training run on local Ray, on CPU
    (``-- --omni``: vision + audio + LLM from three dirs; ``-- --lora``: PEFT LoRA adapters;
    ``-- --help``: the options)."""
    install(session, "packages/core", *(f"packages/{p}" for p in PLUGINS))
    if "--lora" in session.posargs:
        session.install("-e", "packages/core[lora]")
    session.run("python", "examples/demo/run.py", *session.posargs, env=ENV)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """DHP vs uniform TP vs uniform ZeRO-3 on the tiny VLM, swept over vision
    lengths in one run: runs/bench/bench/{bench.json, bench.md, *.png}.
    Arguments after ``--`` replace the default sweep (see ``disagg bench --help``)."""
    install(session, "packages/core", *(f"packages/{p}" for p in PLUGINS))
    session.install("-e", "packages/core[bench]")
    session.run("disagg", "make-tiny", "runs/bench/tiny", "--families", "qwen2_5_vl", env=ENV)
    args = session.posargs or BENCH_ARGS
    session.run("disagg", "bench", "examples/bench/bench.yaml", *args, env=ENV)


#: the default sweep: d = 2, three vision lengths, a budget whose limits lie inside the sweep
BENCH_ARGS = ["--degree", "2", "--vision-tokens", "256,1k,4k", "--steps", "3", "--mem-budget", "24MiB"]


def nvidia_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without the driver): asked before anything is installed."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """The CUDA check suite (``tests/gpu``, pytest marker ``gpu``), sized for one
    H200 in under 8 minutes: every strategy at degree 1 in bf16 against the CPU
    fp32 run, two groups collocated on one GPU, the object-store and CUDA IPC
    transports, a checkpoint round trip, bf16 throughput and MFU figures
    (``runs/gpu/report.json``). Where no NVIDIA GPU is visible it prints
    "no GPU: skipped" and succeeds, before installing anything. torch comes from
    PyPI (its Linux wheels are CUDA builds) or ``TORCH_INDEX_URL``."""
    if nvidia_gpus() == 0:
        session.log("no GPU: skipped")
        return
    packages = ["packages/core", *(f"packages/{p}" for p in PLUGINS)]
    install(session, *packages)
    # no DS_ACCELERATOR=cpu here: DeepSpeed runs on the GPU
    session.run(
        "pytest", "-q", "-rs", "-m", "gpu", "tests/gpu", *session.posargs, env={"DS_ACCELERATOR": "cuda"}
    )
