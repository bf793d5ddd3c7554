"""Host memory of a ``megatron_tp`` rank's set-up, sharded load vs today's whole load.

``--module llm`` (default): a Qwen2 LLM of about 291M parameters (hidden 1024, 20 layers,
GQA 16/4 heads, vocabulary 32000, untied: 1.16 GB in fp32); ``--module vision``: the vision
tower of a Qwen2.5-VL dir, about 223M parameters (hidden 1024, 16 blocks, 16 heads, MLP 2816,
the merger to a 48-wide tiny LLM: 0.89 GB in fp32). Either is written once with random
weights; then, for each way of loading, two ranks run core's own
:class:`~disagg.runtime.actor.worker.ModuleWorker` set-up (as Ray actors do,
without Ray) under ``megatron_tp`` degree 2, and each reports what the worker
sampled (:mod:`disagg.runtime.actor.host_memory`): the resident high-water mark
reset at the start of the set-up, and its rise over the resident size then.

- ``sliced``: the strategy's ``build_module`` (meta device), its slices read;
- ``whole``: today's until this change: ``family.build(fp32)`` (``from_pretrained``
  of the whole module) on every rank, then parallelized.

    python examples/bench/setup_memory.py [--module llm|vision] [--dir DIR] [--modes sliced whole]

prints one JSON object: the module's fp32 bytes (the tower's alone for ``vision``; the
dir's LLM is never read) and, per mode and rank, the
worker's figures and ``ratio`` = setup_peak / module bytes (issue 26 asks
``sliced`` <= 0.65).

Recorded for ``--module vision`` (2026-12-02, the shared 2-core machine; memory does not
depend on its load): the tower is 895.6 MB in fp32 and each rank holds 450.4 MB of it
(its halves of the linears, the replicated patch embedding and norms); the set-up's peak
rose by 546 MB per rank sliced (ratio 0.61) against 1404 MB whole (1.57: the whole tower,
then its pieces copied out of it).
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


#: the vision tower of ``--module vision`` (Qwen2.5-VL's layout: window and full-attention blocks)
TOWER = dict(
    depth=16,
    hidden_size=1024,
    intermediate_size=2816,
    num_heads=16,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15],
    hidden_act="silu",
)


def make_vlm(out: Path) -> Path:
    """A Qwen2.5-VL dir with the :data:`TOWER` vision tower and the tiny LLM of ``make-tiny``."""
    if (out / "config.json").exists():
        return out
    from disagg_vision_sp.families.tiny_qwen2_5_vl import make_tiny_qwen2_5_vl

    return make_tiny_qwen2_5_vl(out, vision=TOWER)


def _family(module: str, path: str):  # type: ignore[no-untyped-def]
    if module == "vision":
        from disagg_vision_sp.families.qwen2_5_vl import Qwen2_5_VLVision

        return Qwen2_5_VLVision(path)
    from disagg_llm_tp.families.qwen2 import Qwen2Family

    return Qwen2Family(path)


def _rank(rank: int, path: str, mode: str, module: str, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    from disagg.interfaces import OptimSpec
    from disagg.runtime.actor.spec import WorkerSpec
    from disagg.runtime.actor.worker import ModuleWorker
    from disagg_llm_tp.strategy import MegatronTPOptions, MegatronTPStrategy

    if mode == "whole":  # what every rank did before the sharded load
        MegatronTPStrategy.build_module = lambda self: self.family.build(torch.float32)  # type: ignore[method-assign]
    worker = ModuleWorker(
        WorkerSpec(
            module, rank, 2, 2, 1, _family(module, path), MegatronTPStrategy, MegatronTPOptions(),
            OptimSpec(lr=1e-4), "cpu", "fp32", 0,
        )
    )  # fmt: skip
    worker.setup("127.0.0.1", port)
    local = sum(p.numel() * p.element_size() for p in worker.strategy.module.parameters())
    queue.put((rank, {**worker.host_memory(), "local_param_bytes": local}))
    worker.shutdown()


def measure(path: Path, mode: str, module: str = "llm") -> list[dict[str, int]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, str(path), mode, module, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join()
    return [out[r] for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", default="llm", choices=["llm", "vision"])
    ap.add_argument(
        "--dir", type=Path, default=None, help="default: /tmp/disagg-qwen2-300m or /tmp/disagg-vit-220m"
    )
    ap.add_argument("--modes", nargs="+", default=["sliced", "whole"], choices=["sliced", "whole"])
    args = ap.parse_args()
    if args.module == "vision":
        path = make_vlm(args.dir or Path("/tmp/disagg-vit-220m"))
    else:
        path = make_model(args.dir or Path("/tmp/disagg-qwen2-300m"))
    from disagg.interfaces.stored import StoredTensors

    stored = StoredTensors(path)
    family = _family(args.module, str(path))
    # the module's own tensors (a VLM dir's tower only), fp32
    names = [family.checkpoint_name(n) for n, _ in family.build_empty().state_dict().items()]
    keys = set(stored.files) if args.module == "llm" else {k for k in names if k in stored}
    full = sum(4 * torch.Size(stored.shape(k)).numel() for k in keys)
    report: dict = {"module": args.module, "module_fp32_bytes": full}
    for mode in args.modes:
        ranks = measure(path, mode, args.module)
        for r in ranks:
            r["ratio"] = round(r["setup_peak"] / full, 3)
        report[mode] = ranks
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
