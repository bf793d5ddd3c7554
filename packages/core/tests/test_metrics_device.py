"""Memory per process and per GPU: ranks of collocated groups on one GPU add
their reserved peaks; CPU records keep max RSS and report no GPU."""

from __future__ import annotations

import torch

from disagg.metrics.record import RankRecord, per_gpu, reduce_group
from disagg.runtime.actor.device_stats import DeviceTimer, record_memory


def test_reserved_peaks_add_up_per_gpu_and_used_memory_is_the_gpus():
    vision = RankRecord("vision", 0, peak_reserved_bytes=10, device_used_bytes=50, device="n:0")
    llm0 = RankRecord("llm", 0, peak_reserved_bytes=20, device_used_bytes=55, device="n:0")
    llm1 = RankRecord("llm", 1, peak_reserved_bytes=7, device_used_bytes=9, device="n:1")
    assert per_gpu({"vision": [vision], "llm": [llm0, llm1]}) == {
        "n:0": {"peak_reserved_bytes": 30, "used_bytes": 55},
        "n:1": {"peak_reserved_bytes": 7, "used_bytes": 9},
    }
    llm0.device_s, llm1.device_s = 0.5, 0.25
    g = reduce_group([llm0, llm1])
    assert g["peak_reserved_bytes"] == 20 and g["device_s"] == 0.5


def test_cpu_records_max_rss_and_no_gpu():
    rec = RankRecord("llm", 0)
    record_memory(rec, torch.device("cpu"))
    assert rec.peak_mem_bytes == rec.peak_reserved_bytes > 0
    assert rec.device == "" and rec.device_used_bytes == 0
    assert per_gpu({"llm": [rec]}) == {}
    timer = DeviceTimer(enabled=False)
    timer.stop(timer.start())
    assert timer.read() == 0.0
