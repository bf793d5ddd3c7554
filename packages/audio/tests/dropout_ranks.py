"""Rank function of the tensor-parallel dropout test (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path

from disagg.testing import ranks
from disagg.testing.dropout import dropout_spy

SEED = 3


def tp_dropout_rank(rank: int, path: str, degree: int, options: dict, inputs: list, grads: list) -> bytes:
    """``megatron_tp`` in train mode, forward and backward, without and with ``recompute: full``
    from the same seeds: the masks of the activation dropout (the first drawn after each
    ``fc1``), every other mask, and the merged gradients."""
    return ranks.dumps({r: _run(rank, path, degree, options, inputs, grads, r) for r in ("none", "full")})


def _run(rank: int, path: str, degree: int, options: dict, inputs: list, grads: list, recompute: str) -> dict:
    from disagg_audio.families.whisper import WhisperAudioFamily
    from disagg_llm_tp.strategy import MegatronTPStrategy

    family = WhisperAudioFamily(Path(path), options)
    ctx = ranks.rank_context("audio", rank, degree, 1, seed=SEED)
    strat = ranks.strategy_rank(MegatronTPStrategy, family, ctx, options={"recompute": recompute}, train=True)
    with dropout_spy() as masks:
        after_fc1: list[int] = []
        for name, mod in strat.module.named_modules():
            if name.endswith(".fc1"):
                mod.register_forward_hook(lambda *_: after_fc1.append(len(masks)))
        shards = ranks.encode(strat, 0, inputs)
        act, drawn = set(after_fc1), len(masks)  # a replay in backward draws again: the forward's only
        ranks.backward(strat, 0, shards, grads)
    ranks.reduce_gradients(strat)
    return {
        "activation": [masks[i] for i in sorted(act)],
        "shared": [m for i, m in enumerate(masks[:drawn]) if i not in act],
        "grads": ranks.full_grads(strat),
        "replayed": len(masks) - drawn,
    }
