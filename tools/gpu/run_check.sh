#!/usr/bin/env bash
# The GPU check on a bare GPU host (docs/gpu.md): no network, no Ray, no nox; a Python with
# its own CUDA torch, and the wheelhouse that tools/gpu/wheelhouse.py built elsewhere.
#
#   tools/gpu/run_check.sh                       # = --device cuda --out runs/gpu/gpucheck.json
#   tools/gpu/run_check.sh --device cpu --out /tmp/cpu.json
#
# Arguments go to `python -m disagg.gpucheck`. Environment: WHEELHOUSE (default wheelhouse/),
# PYTHON (the host's interpreter, default python3), VENV (default /tmp/disagg-gpucheck-venv).
set -euo pipefail

WH=${WHEELHOUSE:-wheelhouse}
PY=${PYTHON:-python3}
VENV=${VENV:-/tmp/disagg-gpucheck-venv}
[ $# -gt 0 ] || set -- --device cuda --out runs/gpu/gpucheck.json
[ -f "$WH/requirements.txt" ] || { echo "run_check: no $WH/requirements.txt: build it with tools/gpu/wheelhouse.py" >&2; exit 2; }

# A venv over the host's Python: the host's site folders join sys.path after the venv's own
# (site.addsitedir, so their .pth files count as they do for the host), so its torch,
# transformers and pip stay visible and pip counts them installed. --system-site-packages would
# not do: where the host's Python is itself a venv (/opt/torch/.venv on our GPU machines) it
# exposes the base interpreter's folder instead.
"$PY" -m venv --clear --without-pip "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -c 'import site
for d in site.getsitepackages() + [site.getusersitepackages()]:
    print(f"import site; site.addsitedir({d!r})")' >"$SITE/host-site.pth"

# What the four packages declare, resolved against what the host has: a host package in range
# is kept, a missing one comes from the wheelhouse, and one in neither stops here, named. Then
# disagg itself without its declared dependencies (core's ray and pyarrow are never imported).
"$VENV/bin/python" -m pip install -q --no-index --find-links "$WH" -r "$WH/requirements.txt"
"$VENV/bin/python" -m pip install -q --no-index --no-deps "$WH"/disagg_*.whl
"$VENV/bin/python" -c 'import importlib.metadata as m, disagg
print("disagg", m.version("disagg-core"), "from", disagg.__file__)
for d in ("torch", "transformers", "megatron-core", "deepspeed", "accelerate", "pydantic", "numpy"):
    print(d, m.version(d))'

exec "$VENV/bin/python" -m disagg.gpucheck "$@"
