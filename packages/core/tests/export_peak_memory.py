"""Peak resident memory of one ``disagg export``, in a fresh process.

``python export_peak_memory.py CHECKPOINT OUT_DIR MAX_SHARD_SIZE`` prints one
JSON object: ``base`` (VmRSS once everything is imported, before the export),
``peak`` (VmHWM after it) and ``ru_maxrss`` (``resource.getrusage``, bytes).
Run apart from pytest so the high-water mark is the export's alone, not that
of whatever the test process built before.
"""

from __future__ import annotations

import json
import resource
import sys


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(checkpoint: str, out_dir: str, max_shard_size: str) -> None:
    from disagg.plugins import get_registry, register_plugin
    from disagg.runtime.export import export_checkpoint
    from disagg.testing import toy

    get_registry()
    registry = register_plugin(toy, name="disagg.testing.toy")
    base = status_bytes("VmRSS")
    export_checkpoint(checkpoint, out_dir, registry, max_shard_size=max_shard_size)
    peak = status_bytes("VmHWM")
    rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "ru_maxrss": rusage}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
