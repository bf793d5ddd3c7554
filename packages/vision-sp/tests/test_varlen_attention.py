"""The ulysses attention is registered under a "flash" name, so HF's
Qwen2.5-VL vision blocks make one varlen call per block; for sdpa and eager it
runs one batched call per distinct window length. Outputs and gradients equal
the per-window loop HF ran before (the previous code path), and the name
makes HF take the varlen branch."""

from __future__ import annotations

import pytest
import torch

from disagg_vision_sp.ulysses import attention
from disagg_vision_sp.ulysses.attention import UlyssesRuntime, base_attention, ulysses_attention_forward


def _loop(base, module, q, k, v, lengths):
    """The previous path: one attention call per window (HF's non-flash branch)."""
    fn = base_attention(base)
    parts = [
        fn(module, qs, ks, vs, None, is_causal=False, scaling=0.125, dropout=0.0)[0]
        for qs, ks, vs in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))
    ]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("base", ["sdpa", "eager"])
@pytest.mark.parametrize("lengths", [[64, 64, 64, 64], [64, 48, 64, 16, 48, 64, 12]])
def test_varlen_call_equals_the_per_window_loop(base, lengths):
    torch.manual_seed(0)
    n = sum(lengths)
    q, k, v = (torch.randn(1, 4, n, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    rt = UlyssesRuntime(base=base, group=None, degree=1, shard=0, sizes=[n], comm=None)
    module = torch.nn.Module()  # what HF passes: the attention module (eager reads .training)
    with rt.active():
        got, _ = ulysses_attention_forward(
            module,
            q,
            k,
            v,
            None,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
            scaling=0.125,
            dropout=0.0,
        )
        # lengths from host memory give the same call without reading cu
        host, _ = ulysses_attention_forward(
            module,
            q,
            k,
            v,
            None,
            cu_seq_lens_q=cu,
            scaling=0.125,
            dropout=0.0,
            **{attention.LENGTHS_KWARG: lengths},
        )
    want = _loop(base, module, q, k, v, lengths)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(host, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(want)
    grads = torch.autograd.grad(got, (q, k, v), g)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_name_makes_hf_take_the_varlen_branch():
    from transformers.utils.generic import is_flash_attention_requested

    assert is_flash_attention_requested(requested_attention_implementation=attention.ATTN_NAME)
