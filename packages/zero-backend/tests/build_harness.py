"""Per-rank host memory of ``zero``'s set-up, measured in the rank process itself.

Peak resident memory (``VmHWM`` of ``/proc/self/status``, file-backed pages of the
mapped checkpoint included) is reset just before the build (``/proc/self/clear_refs``
``5``), so each figure is the set-up's own peak above what the process held before it
(Python, torch, DeepSpeed, the process group)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from disagg.testing import ranks
from disagg.testing.tolerance import assert_exact
from disagg.testing.toy import ToyLMFamily


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Resident bytes now, with the high-water mark reset to them (Linux >= 4.0)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def rank_build_memory(rank: int, warm_dir: Path, lm_dir: Path, world: int) -> dict[str, Any]:
    """Peak bytes above the pre-build resident set, per phase (``build``: the module
    exists; ``setup``: then ``deepspeed.initialize``, frozen, so parameters only), for
    ZeRO-3 set up the old way (the family's whole module, partitioned by
    ``deepspeed.initialize``) and the new (``build_module``: partitioned at
    construction, own slices read); and whether the new build's full weights are
    exactly the family's."""
    from disagg_zero import ZeroStrategy
    from disagg_zero.build import LAST_LOAD

    def strategy(fam: ToyLMFamily) -> Any:
        ctx = ranks.rank_context("llm", rank, 1, world)
        options = ZeroStrategy.options_model(stage=3, ds_config={"zero_optimization": dict(GATHER)})
        return ZeroStrategy(ctx, fam, options)

    # imports and JIT builds of everything both measured set-ups use, on a tiny module
    warm = strategy(ToyLMFamily(warm_dir))
    warm.setup(warm.build_module(), None)
    del warm
    fam = ToyLMFamily(lm_dir)
    out: dict[str, Any] = {}
    for label in ("whole", "partitioned"):
        LAST_LOAD.clear()
        base = _reset_peak()
        strat = strategy(fam)
        module = fam.build(torch.float32) if label == "whole" else strat.build_module()
        built = _status("VmHWM") - base
        strat.setup(module, None)
        out[label] = {"build": built, "setup": _status("VmHWM") - base, "load": LAST_LOAD.get("path")}
        if label == "partitioned":
            # exactly the family's weights (compared here: the module is too big to send back)
            try:
                assert_exact(strat.full_state_dict(), fam.build(torch.float32).state_dict(), "partitioned ")
                out["weights"] = "exact"
            except AssertionError as exc:
                out["weights"] = str(exc)
            out.update(gathered_in_forward(strat, rank, world))
        del strat, module
    out["module_bytes"] = sum(p.numel() * p.element_size() for p in fam.build(torch.float32).parameters())
    return out


#: the per-layer gathering the build measurement runs with: a 2.5M-element prefetch bucket
#: (about one MLP matrix of the 19M-parameter LM) and 5M live parameters, nothing kept for reuse
GATHER = {
    "stage3_prefetch_bucket_size": 2_500_000,
    "stage3_max_live_parameters": 5_000_000,
    "stage3_max_reuse_distance": 0,
}


def gathered_in_forward(strat: Any, rank: int, world: int) -> dict[str, Any]:
    """The most bytes of partitioned parameters DeepSpeed held whole at once over three
    forward-only evaluations of text samples (the first records DeepSpeed's trace, the
    others prefetch from it), with every tensor's name and shape for the cost model."""
    from disagg.testing.toy import toy_samples
    from disagg_zero.runtime import GatherProbe

    probe = GatherProbe(strat.engine, strat.module)
    samples = [x["llm"] for x in toy_samples(2 * world, seed=9, text_only_every=1)][rank::world]
    with torch.no_grad():
        for _ in range(3):
            ranks.evaluate(strat, samples, [{} for _ in samples])
    return {
        "gathered": probe.peak,
        "fetches": probe.fetches,
        "tensors": [(n, tuple(p.ds_shape)) for n, p in strat.module.named_parameters()],
    }


class Qwen2Family(ToyLMFamily):
    """A Qwen2 causal LM dir through ``from_pretrained``: only what the memory
    measurement needs of a family (build), for a real Hugging Face model of the
    LLM family the published setting trains."""

    def build(self, dtype: torch.dtype = torch.float32) -> Any:
        from transformers import Qwen2ForCausalLM

        return Qwen2ForCausalLM.from_pretrained(self.path, dtype=dtype)


def make_qwen2(out_dir: Path, hidden: int, layers: int, vocab: int = 32_000) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out_dir)
    return Path(out_dir)


def rank_qwen2_memory(rank: int, warm_dir: Path, qwen_dir: Path, world: int) -> dict[str, Any]:
    """:func:`rank_build_memory`'s figures for a Qwen2 dir (no weights returned)."""
    import disagg_zero.build as build

    out = {}
    fam = Qwen2Family(qwen_dir)
    from disagg_zero import ZeroStrategy

    warm = ZeroStrategy(
        ranks.rank_context("llm", rank, 1, world), ToyLMFamily(warm_dir), ZeroStrategy.options_model(stage=3)
    )
    warm.setup(warm.build_module(), None)
    del warm
    for label in ("whole", "partitioned"):
        build.LAST_LOAD.clear()
        base = _reset_peak()
        strat = ZeroStrategy(
            ranks.rank_context("llm", rank, 1, world), fam, ZeroStrategy.options_model(stage=3)
        )
        module = fam.build(torch.float32) if label == "whole" else strat.build_module()
        built = _status("VmHWM") - base
        strat.setup(module, None)
        out[label] = {"build": built, "setup": _status("VmHWM") - base, "load": build.LAST_LOAD.get("path")}
        del strat, module
    out["module_bytes"] = sum(p.numel() * 4 for p in fam.build(torch.float32).parameters())
    return out


if __name__ == "__main__":
    # python packages/zero-backend/tests/build_harness.py DIR [HIDDEN LAYERS]: a Qwen2 LM
    # (default 1024 wide, 12 layers: 0.19B parameters, 0.75 GB in fp32) set up under ZeRO-3
    # over 2 ranks, the whole-module way and partitioned; peaks as fractions of the module.
    import sys

    from disagg.testing.dist import run_ranks
    from disagg.testing.toy import make_toy_dirs

    root = Path(sys.argv[1])
    hidden, layers = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (1024, 12)
    qwen = root / f"qwen2_{hidden}x{layers}"
    if not qwen.exists():
        make_qwen2(qwen, hidden, layers)
    _, warm = make_toy_dirs(root / "toy")
    for rank, r in enumerate(run_ranks(rank_qwen2_memory, 2, warm, qwen, 2, timeout=3000)):
        m = r.pop("module_bytes")
        print(
            f"rank {rank}: module {m / 2**20:.0f} MiB",
            {
                k: {kk: (round(vv / m, 3) if isinstance(vv, int) else vv) for kk, vv in v.items()}
                for k, v in r.items()
            },
        )
