"""MaskedAdamW's multi-tensor kernel (what CUDA runs) against its single-tensor kernel (what the CPU
reference runs), on flat partitions holding several parameters' fragments, one of them absent."""

from __future__ import annotations

import torch
from torch import nn

from disagg.interfaces import OptimSpec
from disagg.testing.tolerance import assert_exact, assert_params_close
from disagg_zero.optim import MaskedAdamW, make_masked_adamw

LR = 1e-2


def _flat_partitions(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in (37, 64)]


def _fragments(flats: list[nn.Parameter]) -> list[tuple[int, int, int, int]]:
    # partition 0 holds parameters 0 and 1, partition 1 holds parameters 2 and 3
    out = []
    for k, flat in enumerate(flats):
        ptr, base, n = flat.untyped_storage().data_ptr(), flat.storage_offset(), flat.numel()
        cut = n // 3
        out += [(ptr, base, cut, 2 * k), (ptr, base + cut, n - cut, 2 * k + 1)]
    return out


def _train(foreach: bool | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    flats = _flat_partitions(0)
    opt = MaskedAdamW(flats, lr=LR, weight_decay=0.1, foreach=foreach)
    opt.set_fragments(_fragments(flats))
    g = torch.Generator().manual_seed(1)
    grads = []
    for step in range(3):
        for flat in flats:
            flat.grad = torch.randn(flat.shape, generator=g)
        grads.append([f.grad.clone() for f in flats])
        # parameter 1 gets no gradient anywhere in step 1: untouched by that step
        opt.present = [True, step != 1, True, True]
        opt.step()
    return [f.detach().clone() for f in flats], grads[0]


def test_multi_tensor_kernel_equals_single_tensor_kernel() -> None:
    want, g0 = _train(foreach=False)
    got, _ = _train(foreach=True)
    names = [f"partition{k}" for k in range(len(want))]
    assert_params_close(
        dict(zip(names, got)),
        dict(zip(names, want)),
        lr=LR,
        steps=3,
        grads=dict(zip(names, g0)),
        what="foreach vs single-tensor: ",
    )


def test_absent_fragment_is_untouched_by_multi_tensor_kernel() -> None:
    flats = _flat_partitions(2)
    before = [f.detach().clone() for f in flats]
    opt = MaskedAdamW(flats, lr=LR, weight_decay=0.1, foreach=True)
    opt.set_fragments(_fragments(flats))
    for flat in flats:
        flat.grad = torch.ones_like(flat)
    opt.present = [True, False, True, True]
    opt.step()
    cut = flats[0].numel() // 3
    assert_exact(flats[0].detach()[cut:], before[0][cut:], "absent parameter 1")
    assert not torch.equal(flats[0].detach()[:cut], before[0][:cut])


def test_default_kernel_on_cpu_is_the_reference_kernel() -> None:
    # unset (make_masked_adamw's default): the single-tensor kernel on CPU, bit-identical to the
    # reference's AdamW(foreach=False)
    assert all(
        group["foreach"] is None
        for group in make_masked_adamw(_flat_partitions(3), OptimSpec(lr=LR)).param_groups
    )
    got, _ = _train(foreach=None)
    want, _ = _train(foreach=False)
    for k, (a, b) in enumerate(zip(got, want)):
        assert_exact(a, b, f"partition{k}")
