"""A training driver for ``test_checkpoint.py`` to SIGKILL in the middle of a save.

Run as its own process: ``python checkpoint_driver.py CONFIG STEP READY``. It is
``disagg train CONFIG`` (the normal entry point) with the toy families and
toy data, whose checkpoint writer, once ``step-STEP.tmp`` holds every shard,
the meta and the data position but not yet the manifest, touches ``READY``
and waits there for the kill: a real crash mid-save, which no ``finally`` or
``atexit`` of the driver survives.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main() -> int:
    config, pause_step, ready = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    import ray

    from disagg import data, plugins
    from disagg.cli.main import main as disagg
    from disagg.runtime import checkpoint as ckpt
    from disagg.testing import toy

    # the toy families only, as the in-process runs of the test register them
    pm, _ = plugins.make_plugin_manager(load_entry_points=False)
    pm.register(toy, name="disagg.testing.toy")
    plugins.set_registry(plugins.build_registry(pm))
    # the toy families have no tokenizer: the same stream the in-process runs read
    data.build_data_source = lambda cfg, families: toy.ToyDataSource(4)
    real_write = ckpt._write

    def write(path: Path, text: str) -> None:
        if path.name == ckpt.MANIFEST and path.parent.name == f"step-{pause_step}.tmp":
            partial = ready.with_suffix(".partial")  # renamed: the test never reads half a pid
            partial.write_text(str(os.getpid()))
            partial.rename(ready)
            time.sleep(3600)
        real_write(path, text)

    ckpt._write = write
    # A Ray of its own (address="local" never joins another instance, such as
    # the test process's): its raylet, GCS and workers share this driver's fate.
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    return disagg(["train", config])


if __name__ == "__main__":
    sys.exit(main())
