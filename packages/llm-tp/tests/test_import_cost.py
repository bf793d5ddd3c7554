"""Loading the plugin does not import megatron-core (:mod:`disagg_llm_tp.shard_spec`): building
the registry (every ``disagg`` command and driver), the families (``qwen3_5``'s gated-delta-net
split included) and what a checkpoint's full form and the sliced load need leave it out; it is
imported where a module is tensor-parallelized. megatron-core's import costs about 2.5 s of CPU
(its ``__init__`` pulls torch's DTensor, dynamo and, where installed, wandb), so the other
strategies' processes and the CLI no longer pay it."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from disagg.plugins import get_registry
reg = get_registry()
assert "megatron_tp" in reg.strategies and ("llm", "qwen3_5") in reg.families
import disagg_llm_tp.fullstate, disagg_llm_tp.load, disagg_llm_tp.cost
loaded = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
print("megatron modules:", loaded[:5])
sys.exit(1 if loaded else 0)
"""


def test_registry_and_families_load_without_megatron():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_parallelizing_imports_megatron():
    """The control: the layers themselves are megatron-core's (the probe above can fail)."""
    probe = PROBE.replace(
        "import disagg_llm_tp.fullstate", "import disagg_llm_tp.parallelize\nimport disagg_llm_tp.fullstate"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "megatron.core" in done.stdout, done.stdout + done.stderr[-3000:]
