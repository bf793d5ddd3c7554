"""Strategy-level equivalence harness for the audio families: ``ulysses`` or
``megatron_tp`` ranks (gloo, in processes) vs Hugging Face's own encoder
forward in one process (:func:`disagg_audio.testing.hf_reference`: what HF
computes and what the families define on top of it).

The reference and the ranks see the same samples and the same upstream
gradient (a fixed random tensor over each sample's full output). Reference
parameters that get no gradient stay absent (``None``), never zero-filled.
"""

from __future__ import annotations

import numpy as np
import torch

from disagg.testing.encoder import EncoderCase, assert_encoder_matches, run_encoder, upstream_grads

__all__ = ["assert_matches", "ragged_clips", "rel", "run_strategy", "upstream_grads"]


def ragged_clips(seconds: list[list[float]], rate: int = 16000, seed: int = 0) -> list[list[dict]]:
    """Per sample, decoded clips of the given lengths: chirps with noise, so that
    no two windows are alike."""
    rng = np.random.default_rng(seed)
    out = []
    for sample in seconds:
        items = []
        for s in sample:
            t = np.arange(int(s * rate)) / rate
            f0 = rng.uniform(200, 800)
            wave = 0.3 * np.sin(2 * np.pi * (f0 + 300 * t) * t) + 0.02 * rng.standard_normal(t.size)
            items.append({"array": wave.astype(np.float32), "sampling_rate": rate})
        out.append(items)
    return out


def _strategy(name: str) -> type:
    if name == "ulysses":
        from disagg_vision_sp.ulysses.strategy import UlyssesStrategy

        return UlyssesStrategy
    from disagg_llm_tp.strategy import MegatronTPStrategy

    return MegatronTPStrategy


def run_strategy(strategy: str, degree: int, replicas: int, cases: list[tuple]) -> list[list[dict]]:
    """Per case ``(family, inputs, grads)``, the results of every rank (by rank): the
    encoder harness of core's test kit, in train mode as core's worker runs it."""
    kit_cases = [EncoderCase(f, inputs, grads, train=True) for f, inputs, grads in cases]
    return run_encoder(_strategy(strategy), degree, replicas, kit_cases)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against ``b`` over the whole tensor."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


#: outputs, gradients and every rank's squared norm vs the reference (core's test kit)
assert_matches = assert_encoder_matches
