"""Disaggregated placement on a simulated two-node cluster stays equivalent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_disaggregated_groups_on_different_nodes_are_equivalent():
    script = Path(__file__).with_name("two_node_cluster.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "OK" in proc.stdout
