"""Host memory of a ``megatron_tp`` rank's set-up, sharded load vs today's whole load.

A Qwen2 LLM of about 291M parameters (hidden 1024, 20 layers, GQA 16/4 heads,
vocabulary 32000, untied: 1.16 GB in fp32) is written once with random
weights; then, for each way of loading, two ranks run core's own
:class:`~disagg.runtime.actor.worker.ModuleWorker` set-up (as Ray actors do,
without Ray) under ``megatron_tp`` degree 2, and each reports what the worker
sampled (:mod:`disagg.runtime.actor.host_memory`): the resident high-water mark
reset at the start of the set-up, and its rise over the resident size then.

- ``sliced``: the strategy's ``build_module`` (meta device), its slices read;
- ``whole``: today's until this change: ``family.build(fp32)`` (``from_pretrained``
  of the whole module) on every rank, then parallelized.

    python examples/bench/setup_memory.py [--dir /tmp/qwen2-300m] [--modes sliced whole]

prints one JSON object: the module's fp32 bytes and, per mode and rank, the
worker's figures and ``ratio`` = setup_peak / module bytes (issue 26 asks
``sliced`` <= 0.65).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
from pathlib import Path

import torch


def make_model(out: Path) -> Path:
    """The ~300M Qwen2 dir, written like ``Qwen2Family.make_tiny`` writes its tiny one."""
    if (out / "config.json").exists():
        return out
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from disagg_llm_tp.families.tiny import decoder_sizes, qwen_tokenizer, save_random

    tok = qwen_tokenizer(out)
    config = Qwen2Config(
        **decoder_sizes(
            32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=20,
            num_attention_heads=16,
            num_key_value_heads=4,
        ),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return save_random(Qwen2ForCausalLM, config, out, seed=0)


def _rank(rank: int, path: str, mode: str, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    from disagg.interfaces import OptimSpec
    from disagg.runtime.actor.worker import ModuleWorker
    from disagg_llm_tp.families.qwen2 import Qwen2Family
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    if mode == "whole":  # what every rank did before the sharded load
        MegatronTPStrategy.build_module = lambda self: self.family.build(torch.float32)  # type: ignore[method-assign]
    worker = ModuleWorker(
        "llm", rank, 2, 2, 1, Qwen2Family(path), MegatronTPStrategy, MegatronTPOptions(),
        OptimSpec(lr=1e-4), "cpu", "float32", 0,
    )  # fmt: skip
    worker.setup("127.0.0.1", port)
    local = sum(p.numel() * p.element_size() for p in worker.strategy.module.parameters())
    queue.put((rank, {**worker.host_memory(), "local_param_bytes": local}))
    worker.shutdown()


def measure(path: Path, mode: str) -> list[dict[str, int]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, str(path), mode, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    return [out[r] for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/disagg-qwen2-300m"))
    ap.add_argument("--modes", nargs="+", default=["sliced", "whole"], choices=["sliced", "whole"])
    args = ap.parse_args()
    path = make_model(args.dir)
    from disagg.interfaces.hf import StoredTensors

    stored = StoredTensors(path)
    full = sum(4 * torch.Size(stored.shape(k)).numel() for k in stored.files)
    report: dict = {"module_fp32_bytes": full}
    for mode in args.modes:
        ranks = measure(path, mode)
        for r in ranks:
            r["ratio"] = round(r["setup_peak"] / full, 3)
        report[mode] = ranks
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
