"""bf16 throughput and MFU on one GPU (``nox -s gpu``; "no GPU: skipped" elsewhere).

- a Qwen2-7B-width decoder stack (hidden 3584, 28 heads, 4 KV heads, MLP
  18944; 4 layers, vocabulary 32768 to keep it small) under ``megatron_tp``
  degree 1, forward + backward of 4096 tokens;
- the Qwen2.5-VL-7B vision tower (32 blocks, hidden 1280) on one 9,216-patch
  image (1344 x 1344), HF's path vs the ulysses path
  (``examples/bench/vision_attention.py``).

Figures go to ``$DISAGG_GPU_REPORT`` (default ``runs/gpu/report.json``); the
tests assert what does not depend on the machine (outputs equal within bf16,
finite figures), never a speed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
#: dense bf16 peak of an H200 SXM (and H100 SXM), TFLOP/s, for MFU
PEAK_TFLOPS = float(os.environ.get("DISAGG_PEAK_TFLOPS", "989"))
REPORT = Path(os.environ.get("DISAGG_GPU_REPORT", ROOT / "runs" / "gpu" / "report.json"))


def _report(key: str, value: dict) -> None:
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(REPORT.read_text()) if REPORT.exists() else {}
    data[key] = value
    REPORT.write_text(json.dumps(data, indent=2))


def test_qwen2_7b_width_decoder_under_megatron_tp_degree_1(tmp_path):
    pytest.importorskip("disagg_llm_tp")
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from disagg.interfaces import GroupContext, compute_dtype
    from disagg.testing.dist import free_port
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    cfg = Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        num_hidden_layers=4,
        vocab_size=32768,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    cfg.save_pretrained(tmp_path)  # the family reads its layer map from the config
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        device = torch.device("cuda", 0)
        ctx = GroupContext("llm", 0, 1, 1, 1, device, torch.bfloat16, collective_timeout=timedelta(minutes=5))
        strategy = MegatronTPStrategy(ctx, Qwen2Family(str(tmp_path), {}), MegatronTPOptions())
        torch.manual_seed(0)
        model = strategy.parallelize(Qwen2ForCausalLM(cfg))  # fp32 master weights, bf16 autocast
        tokens = 4096
        ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=device)

        def step() -> float:
            with compute_dtype(device, torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return float(loss)

        step()  # warm-up: kernels chosen, memory reserved
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            loss = step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        weights = sum(
            p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n
        )
        flops = 6 * weights * tokens + 6 * cfg.num_hidden_layers * tokens * tokens * cfg.hidden_size  # causal
        best = min(times)
        fig = {
            "tokens": tokens,
            "layers": cfg.num_hidden_layers,
            "step_s": best,
            "loss": loss,
            "tokens_per_s": tokens / best,
            "tflops_per_s": flops / best / 1e12,
            "mfu": flops / best / 1e12 / PEAK_TFLOPS,
            "peak_tflops": PEAK_TFLOPS,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
        _report("qwen2_7b_width_megatron_tp_d1", fig)
        assert math.isfinite(loss) and 0 < fig["mfu"] < 1, fig
    finally:
        dist.destroy_process_group()


def test_qwen2_5_vl_7b_vision_tower_hf_vs_ulysses_path():
    pytest.importorskip("disagg_vision_sp")
    sys.path.insert(0, str(ROOT / "examples" / "bench"))
    import vision_attention

    from disagg.testing.tolerance import BF16

    res = vision_attention.measure("7b", 9216, "cuda", "bfloat16", repeat=3)
    res["mfu"] = {n: {k: v / PEAK_TFLOPS for k, v in t.items()} for n, t in res["tflops_per_s"].items()}
    _report("qwen2_5_vl_7b_vision_9216_patches", res)
    for path, diff in res["max_rel_diff_vs_hf"].items():
        assert diff <= BF16.rtol, (path, diff)  # the same math: within bf16 of HF's own path
    assert all(math.isfinite(v) and v > 0 for t in res["median_s"].values() for v in t.values())
