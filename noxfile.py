"""Sessions: ``tests`` (core, the example plugin and the cross-package ``tests/`` with everything
installed together; it queues ``isolation`` and ``plain``), ``isolation`` (core + one plugin, as a
user installs it: that plugin's tests run there, once), ``plain`` (a plain install trains the tiny
VLM from the CLI under every strategy), ``lint``, ``demo`` (the main job: a tiny multimodal run on
local Ray, CPU), ``bench``, ``gpu`` (the CUDA check suite, on a machine with an NVIDIA GPU) and
``kernels``.

``nox -s tests`` (the README's test command, and CI's) runs ``tests``, then the four
``isolation(plugin=...)`` sessions and ``plain`` (``session.notify``): each plugin's tests run once,
in a venv holding only ``disagg-core``, that plugin's declared dependencies and its ``test`` extra
(which names the sibling plugins its tests' models need). Each session logs how long its venv and
its steps took (``timing:`` lines).

``kernels`` (not run by CI, nor by default) reruns the equivalence subset (every test file that
uses ``disagg.testing.tolerance`` or a harness built on it) under the other CPU kernel set:
``ATEN_CPU_CAPABILITY=avx2`` and ``OMP_NUM_THREADS=1`` (override with ``KERNELS_CPU`` and
``KERNELS_THREADS``), logs every check's margin (largest error / bound) to
``runs/margins/kernels.jsonl`` and fails if one exceeds 0.5 (``python -m
disagg.testing.margins``). The verdict of an equivalence test must not depend on the CPU.

torch is pinned here, never in the packages (users bring the build that
matches their hardware); it is installed first so that no package pulls
another build. Set ``TORCH_INDEX_URL`` (e.g. https://download.pytorch.org/whl/cpu)
to install it from a specific index. It is unpacked once, into ``.nox/_torch-<key>``, and
each session's venv sees it through a ``.pth`` file (:func:`install_torch`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import nox
import tomllib

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]
# A missing interpreter is a failure, never a silently skipped session (a CI or GPU host
# without Python 3.11 would otherwise report success).
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
TORCH = "torch==2.13.0"
ROOT = Path(__file__).parent
PLUGINS = ["vision-sp", "llm-tp", "zero-backend", "audio"]
EXAMPLE = "examples/disagg-example-plugin"
# DeepSpeed must not look for CUDA on CPU-only machines.
ENV = {"DS_ACCELERATOR": "cpu"}
#: Python writes the ``.pyc`` of the modules it compiles: with ``PYTHONDONTWRITEBYTECODE=1`` (set in
#: the development machine's image, likely CI's too) every process compiled this repository's
#: editable sources again — each test's Ray workers, ~0.25 s a process on 2 cores (the worker's
#: and strategies' imports: 3.53 s against 3.28 s cached). Installed packages are compiled by pip
#: either way. Only nox's commands see this.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def install_torch(session: nox.Session) -> None:
    # Python 3.11's bundled pip (23.2) cannot resolve an editable package installed with extras
    # (packages/core[test]) beside packages that require it plainly: it looks disagg-core up on
    # the index and fails. A current pip resolves it to the checkout.
    session.install("--upgrade", "pip>=24")
    index = os.environ.get("TORCH_INDEX_URL")
    where = ["--index-url", index] if index else []
    # The pinned build is unpacked once per checkout and every session's venv sees it through a
    # ``.pth`` file: the same torch each venv would install (users bring their own), without
    # unpacking and byte-compiling ~900 MB again in each of the six venvs (~20 s each on 2 cores).
    key = hashlib.sha256(f"{TORCH} {index} {PYTHON}".encode()).hexdigest()[:12]
    shared = ROOT / ".nox" / f"_torch-{key}"
    if not (shared / ".complete").is_file():
        shutil.rmtree(shared, ignore_errors=True)
        session.install("--target", str(shared), TORCH, *where)
        (shared / ".complete").write_text(TORCH)
    purelib = session.run("python", "-c", PURELIB, silent=True)
    Path(str(purelib).strip(), "disagg-shared-torch.pth").write_text(f"{shared}\n")
    # already satisfied through the .pth (a no-op), else installed into the venv as before
    session.install(TORCH, *where)


PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def first_party() -> dict[str, str]:
    """Distribution name -> its directory, for every package of this repository."""
    out = {}
    for pyproject in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]:
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        out[name] = str(pyproject.parent.relative_to(ROOT))
    return out


def with_siblings(paths: list[str], extra: str | None = None) -> list[str]:
    """``pip install`` arguments for ``paths`` (each with ``extra``) and every first-party package
    their requirements name (followed through their own), all editable: the plugins are on no
    index, so pip must be handed the sibling directories alongside."""
    dirs = first_party()
    todo: list[tuple[str, str | None]] = [(p, extra) for p in paths]
    seen: dict[str, set[str]] = {}
    while todo:
        here, ext = todo.pop()
        if here in seen and (ext is None or ext in seen[here]):
            continue
        seen.setdefault(here, set()).update({ext} - {None})
        project = tomllib.loads((ROOT / here / "pyproject.toml").read_text())["project"]
        reqs = [*project.get("dependencies", []), *project.get("optional-dependencies", {}).get(ext, [])]
        for req in reqs:
            m = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", req)
            name, extras = m.group(1), (m.group(2) or "")
            if name in dirs:
                todo += [(dirs[name], e.strip()) for e in extras.split(",") if e.strip()] or [
                    (dirs[name], None)
                ]
    args = []
    for here, extras in seen.items():
        args += ["-e", f"{here}[{','.join(sorted(extras))}]" if extras else here]
    return args


def install(
    session: nox.Session, *paths: str, extra: str | None = "test", more: tuple[str, ...] = ()
) -> None:
    """torch first (the pinned build), then ``paths`` with ``extra`` and their first-party siblings
    (and ``more`` requirements)."""
    for path in paths:
        if not (ROOT / path / "pyproject.toml").is_file():
            session.error(f"{path}/pyproject.toml is missing")
    install_torch(session)
    # one pip call: the resolver sees every local package at once (a later call could replace one)
    session.install(*with_siblings(list(paths), extra), *more)


@contextmanager
def timed(session: nox.Session, what: str):
    """Logs ``timing: <session> <what> N s``: CI's budget is read from these lines."""
    start = time.monotonic()
    try:
        yield
    finally:
        session.log(f"timing: {session.name} {what} {time.monotonic() - start:.0f} s")


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
    """Core's tests, the example plugin's and the cross-package ``tests/``, with every package
    installed together (each with its ``test`` extra). Each plugin's own tests run once, in
    ``isolation(<plugin>)``, and ``plain`` trains from a plain install: both queued here."""
    for plugin in PLUGINS:
        session.notify(f"isolation(plugin='{plugin}')")
    session.notify("plain")
    packages = ["packages/core", *(f"packages/{p}" for p in PLUGINS)]
    with timed(session, "venv+install"):
        # scikit-learn: its sample photographs feed the real-image pipeline test (in the one pip call)
        install(session, *packages, EXAMPLE, more=("scikit-learn",))
    with timed(session, "pytest"):
        pytest(session, "packages/core/tests", f"{EXAMPLE}/tests", "tests")


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
    """Core plus one plugin, as a user installs it: only ``disagg-core``, the plugin's declared
    dependencies and its ``test`` extra (peft, and the sibling plugins whose families its tests'
    models use). The plugin's tests run here, and only here (``tests`` queues this session)."""
    with timed(session, "venv+install"):
        install(session, f"packages/{plugin}")
        session.run("python", "-m", "pip", "check")  # every installed requirement satisfied
    with timed(session, "pytest"):
        pytest(session, f"packages/{plugin}/tests")


#: ``plain``'s runs: every strategy once, two modules per run, collocated on local Ray (CPU)
PLAIN_RUNS = {
    # ZeRO-3 with the persistence threshold at 0: the tiny model's tensors are all under
    # DeepSpeed's default (1e5 elements), which would keep them whole on every rank
    "ulysses_zero3": {
        "vision": {"strategy": "ulysses", "degree": 2},
        "llm": {
            "strategy": "zero",
            "stage": 3,
            "replicas": 2,
            "ds_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        },
    },
    "ddp_megatron_tp": {
        "vision": {"strategy": "ddp", "replicas": 2},
        "llm": {"strategy": "megatron_tp", "degree": 2},
    },
}
PLAIN_STEPS = 2

#: reads a run dir: the steps ran, each loss finite (exit 1 with the reason otherwise)
PLAIN_VERIFY = """
import json, math, sys
run, steps = sys.argv[1], int(sys.argv[2])
summary = json.load(open(f"{run}/summary.json"))
losses = [json.loads(line)["loss"] for line in open(f"{run}/metrics.jsonl") if '"loss"' in line]
ok = summary["status"] == "ok" and summary["steps"] == steps and len(losses) == steps
ok = ok and all(math.isfinite(x) for x in losses)
print(f"{run}: status {summary['status']}, steps {summary['steps']}, losses {losses}")
sys.exit(0 if ok else f"{run}: expected {steps} finished steps with finite losses")
"""


#: the runs train one model on the same data from the same seed, so every layout's losses agree
#: (equal to 1e-15 on CPU in practice); a layout that trained something else shows here
PLAIN_SAME = """
import json, sys
runs = sys.argv[1:]
losses = {r: [json.loads(x)["loss"] for x in open(f"{r}/metrics.jsonl") if '"loss"' in x] for r in runs}
first = losses[runs[0]]
bad = [r for r in runs if any(abs(a - b) > 1e-4 * abs(b) for a, b in zip(losses[r], first))]
sys.exit(f"losses differ between layouts: {losses}" if bad else 0)
"""


@nox.session(python=PYTHON)
def plain(session: nox.Session) -> None:
    """A user's plain install, no extras: torch, then ``disagg-core`` and the plugins the tiny
    Qwen2.5-VL's runs name (vision-sp, llm-tp, zero-backend). ``disagg make-tiny`` writes the
    model and data, and ``disagg train`` (the CLI, as a user runs it) trains it 2 steps under
    ulysses 2 + ZeRO-3 x2, then ddp x2 + megatron_tp 2: every strategy from a plain install."""
    with timed(session, "venv+install"):
        install_torch(session)
        plugins = ("vision-sp", "llm-tp", "zero-backend")
        session.install("-e", "packages/core", *(a for p in plugins for a in ("-e", f"packages/{p}")))
        session.run("python", "-m", "pip", "check")
    # not session.create_tmp(): it points TMPDIR into the venv, where Ray refuses its temp dir
    # ("temp_dir must not be child directory of virtualenv root") and every worker dies at start
    tmp = ROOT / "runs" / "plain"
    shutil.rmtree(tmp, ignore_errors=True)  # a run dir left from before would be resumed into
    with timed(session, "make-tiny"):
        session.run("disagg", "make-tiny", str(tmp / "tiny"), "--families", "qwen2_5_vl", env=ENV)
    model = str(tmp / "tiny" / "qwen2_5_vl")
    data = tmp / "tiny" / "data"
    for name, parallel in PLAIN_RUNS.items():
        config = {
            "model": {
                "vision": {"family": "qwen2_5_vl", "path": model},
                "llm": {"family": "qwen2_5_vl", "path": model},
            },
            "parallel": {"placement": "collocated", **parallel},
            "data": {"train": str(data / "train.jsonl"), "media_root": str(data), "batch_size": 4},
            "train": {"steps": PLAIN_STEPS, "lr": 1.0e-3, "seed": 0},
            "checkpoint": {"every": 0},
            "output_dir": str(tmp / name),
        }
        path = tmp / f"{name}.yaml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        with timed(session, f"train {name}"):
            session.run("disagg", "train", str(path), env=ENV)
        session.run("python", "-c", PLAIN_VERIFY, str(tmp / name), str(PLAIN_STEPS))
    session.run("python", "-c", PLAIN_SAME, *(str(tmp / name) for name in PLAIN_RUNS))


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
    install(session, "packages/core", *(f"packages/{p}" for p in PLUGINS), extra=None)
    if "--lora" in session.posargs:
        session.install("-e", "packages/core[lora]")
    session.run("python", "examples/demo/run.py", *session.posargs, env=ENV)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """DHP vs uniform TP vs uniform ZeRO-3 on the tiny VLM, swept over vision
    lengths in one run: runs/bench/bench/{bench.json, bench.md, *.png}.
    Arguments after ``--`` replace the default sweep (see ``disagg bench --help``)."""
    install(session, "packages/core", *(f"packages/{p}" for p in PLUGINS), extra=None)
    session.install("-e", "packages/core[bench]")
    session.run("disagg", "make-tiny", "runs/bench/tiny", "--families", "qwen2_5_vl", env=ENV)
    args = session.posargs or BENCH_ARGS
    session.run("disagg", "bench", "examples/bench/bench.yaml", *args, env=ENV)


#: the default sweep: d = 2, three vision lengths, a budget whose limits lie inside the sweep
BENCH_ARGS = ["--degree", "2", "--vision-tokens", "256,1k,4k", "--steps", "3", "--mem-budget", "24MiB"]


def nvidia_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without the driver): asked before anything is installed."""
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


#: asks the venv's torch whether it can use a GPU; prints why not
TORCH_CUDA = """
import sys, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}): {n} usable GPU(s)")
sys.exit(0 if n > 0 else 1)
"""


def junit_counts(path: Path) -> dict[str, int]:
    """``tests``, ``skipped``, ``failures``, ``errors`` summed over a JUnit XML report's suites."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "skipped", "failures", "errors")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


# python=None: the interpreter nox runs under (a GPU host's own Python >= 3.10, often not 3.11)
@nox.session(python=None)
def gpu(session: nox.Session) -> None:
    """The CUDA check suite (``tests/gpu``, pytest marker ``gpu``), sized for one
    H200 in under 8 minutes: every strategy at degree 1 in bf16 against the CPU
    fp32 run, two groups collocated on one GPU, the object-store and CUDA IPC
    transports, a checkpoint round trip, bf16 throughput and MFU figures
    (``runs/gpu/report.json``). Where ``nvidia-smi`` lists no GPU it prints
    "no GPU: skipped" and succeeds, before installing anything. Where it lists one, the
    session fails (never skips) when torch cannot use it, when any test is skipped, or when
    no test ran; it prints how many ran. torch comes from PyPI (its Linux wheels are CUDA
    builds) or ``TORCH_INDEX_URL``."""
    listed = nvidia_gpus()
    if listed == 0:
        session.log("no GPU: skipped")
        return
    install_torch(session)
    try:
        session.run("python", "-c", TORCH_CUDA)
    except nox.command.CommandFailed:
        session.error(
            f"nvidia-smi lists {listed} GPU(s) but torch ({TORCH}) cannot use them: a CPU-only "
            "build (set TORCH_INDEX_URL to a CUDA index) or a driver older than the build's CUDA"
        )
    packages = ["packages/core", *(f"packages/{p}" for p in PLUGINS)]
    install(session, *packages)
    report = ROOT / "runs" / "gpu" / "junit.xml"  # not session.create_tmp(): TMPDIR in the venv breaks Ray
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)
    failed = False
    try:  # no DS_ACCELERATOR=cpu here: DeepSpeed runs on the GPU
        session.run(
            "pytest",
            "-q",
            "-rs",
            "-m",
            "gpu",
            f"--junitxml={report}",
            "tests/gpu",
            *session.posargs,
            env={"DS_ACCELERATOR": "cuda"},
        )
    except nox.command.CommandFailed:
        failed = True
    if not report.is_file():
        session.error("pytest wrote no report: no GPU test ran")
    n = junit_counts(report)
    ran = n["tests"] - n["skipped"]
    session.log(f"GPU tests: {ran} ran, {n['skipped']} skipped, {n['failures'] + n['errors']} failed")
    if failed or n["failures"] or n["errors"]:
        session.error("GPU tests failed")
    if ran == 0:
        session.error("no GPU test ran: a GPU host must run the suite, not skip it")
    if n["skipped"]:
        session.error(f"{n['skipped']} GPU test(s) skipped on a GPU host (see the -rs lines above)")
