"""Data at scale: time to the first step and peak driver / object store memory
for a small and a large synthetic dataset (same tiny model, same images).

    python examples/bench/data_scale.py --out /tmp/data-scale --samples 100 100000 --steps 20

Each size trains in its own process (so peak RSS is that run's); prints one
JSON line per size: ``build_s`` (build_data_source), ``first_batch_s``,
``first_step_s`` (run start to step 1 logged), ``total_s``,
``peak_driver_rss_mib`` and ``peak_object_store_mib`` (polled every 0.2 s).
A benchmark, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from disagg.config.validate import validate

FAMILY = "qwen2_5_vl"


class Peak:
    """Polls driver RSS and Ray's object store use in a thread."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.rss = 0
        self.store = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _store_bytes(self) -> int:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        if not ray.is_initialized():
            return 0
        reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
        return int(reply.store_stats.object_store_bytes_used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rss = max(self.rss, self.proc.memory_info().rss)
            try:
                self.store = max(self.store, self._store_bytes())
            except Exception:  # noqa: BLE001 - the poller must not kill the run
                pass
            self._stop.wait(0.2)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"peak_driver_rss_mib": self.rss / 2**20, "peak_object_store_mib": self.store / 2**20}


def one(out: Path, data: Path, steps: int) -> dict:
    import ray

    import disagg
    from disagg.config.schema import Config
    from disagg.data import build_data_source
    from disagg.plugins import get_registry, register_plugin
    from disagg.runtime.plan import families_for
    from disagg.runtime.run import ensure_ray, run_training

    manifest = json.loads((out / "tiny" / "manifest.json").read_text())
    cfg = Config.model_validate(
        {
            "model": {m: {"family": FAMILY, "path": manifest["models"][FAMILY]} for m in ("vision", "llm")},
            "data": {"train": str(data), "media_root": manifest["media_root"], "batch_size": 8},
            "train": {"steps": steps, "lr": 1e-3},
            "checkpoint": {"every": 0},
            "output_dir": str(out / f"run-{data.stem}"),
        }
    )
    for _attempt in range(6):  # a loaded machine can miss Ray's 30 s node start-up window
        try:
            ensure_ray(None, None)
            break
        except Exception:  # noqa: BLE001
            ray.shutdown()
            time.sleep(5)
    peak = Peak()
    t0 = time.perf_counter()
    src = build_data_source(cfg, families_for(cfg, get_registry()))
    built = time.perf_counter()
    next(src.batches())
    first_batch = time.perf_counter()
    del src
    times: dict[int, float] = {}

    class Clock:
        @disagg.hookimpl
        def disagg_log_metrics(self, step, metrics):
            times.setdefault(step, time.perf_counter())

    register_plugin(Clock(), name="clock")
    t1 = time.perf_counter()
    run_training(validate(cfg, get_registry()), progress=False)
    end = time.perf_counter()
    result = {
        "samples": sum(1 for _ in data.open()),
        "build_s": built - t0,
        "first_batch_s": first_batch - built,
        "first_step_s": times[1] - t1,
        "total_s": end - t1,
        "steps": steps,
        **peak.stop(),
    }
    ray.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, nargs="+", default=[100, 100_000])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.out, args.one, args.steps)), flush=True)
        return
    from disagg.cli.make_tiny import make_tiny
    from disagg.data.synthetic import write_large

    if not (args.out / "tiny" / "manifest.json").exists():
        make_tiny(args.out / "tiny", [FAMILY], train_per_class=1, eval_per_class=1, image_size=56)
    manifest = json.loads((args.out / "tiny" / "manifest.json").read_text())
    for n in args.samples:
        data = write_large(manifest["data"]["train"], args.out / f"samples-{n}.jsonl", n)
        cmd = [
            sys.executable,
            __file__,
            "--out",
            str(args.out),
            "--steps",
            str(args.steps),
            "--one",
            str(data),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            sys.exit(f"run with {n} samples failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        print(lines[0][len("RESULT ") :], flush=True)


if __name__ == "__main__":
    main()
