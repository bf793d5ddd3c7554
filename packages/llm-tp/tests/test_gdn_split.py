"""A gated-delta-net layer split by heads (:mod:`disagg_llm_tp.gdn`) at tensor-parallel degree 2
equals Hugging Face's ``Qwen3_5GatedDeltaNet`` forward and backward: output, input gradient
and every parameter's gradient merged from the ranks, without and with sequence parallelism,
on a right-padded batch; key and value heads of different widths (fused q/k/v blocks of
unequal sizes) and two value heads per key head. A conv1d cut by plain equal rows instead of
the q/k/v blocks (channels not split as ``in_proj_qkv``'s) is caught by the same comparison.
The block spec's slicing, merging and sliced-load pieces agree and round-trip between
degrees (the whole decoder built empty and loaded by slices is in ``tests/test_e2e_qwen3_5.py``,
equal to the HF model at every step)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from disagg.testing.dist import run_ranks
from disagg.testing.tolerance import assert_exact, assert_tensors_close
from disagg_llm_tp.load import local_pieces
from disagg_llm_tp.shard_spec import ShardSpec, local_slice, merge

#: 2 key heads of width 8 serving 4 value heads of width 6: q/k/v blocks 16, 16, 24
CONFIG = dict(
    hidden_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
)


def _layer():  # noqa: ANN202
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**CONFIG), layer_idx=0)
    with torch.no_grad():  # away from their init values, so a misplaced piece shows
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.uniform_(-1.0, 1.0)
    return layer


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, CONFIG["hidden_size"], generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding: the layer zeroes those tokens' inputs
    return x, mask, torch.randn(2, 9, CONFIG["hidden_size"], generator=g)


def _full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        spec: ShardSpec = p.tp_spec
        g = p.grad.detach().contiguous()
        if spec.kind == "replicated":
            if spec.sp_partial:  # used on this rank's heads (or tokens) only
                dist.all_reduce(g)
            out[name] = g
        else:
            pieces = [torch.empty_like(g) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, g)
            out[name] = merge(pieces, spec)
    return out


def gdn_rank(rank: int) -> dict:
    """HF's layer whole beside this rank's split of it, each fed the same batch."""
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig

    from disagg.interfaces.comm import CommCounter
    from disagg_llm_tp.gdn import GatedDeltaNetSplit
    from disagg_llm_tp.module_split import SplitContext
    from disagg_llm_tp.sequence_parallel import SequenceParallelRegion

    degree = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=degree, create_gloo_process_groups=False)
    group = ps.get_tensor_model_parallel_group()
    config = ModelParallelConfig(
        tensor_model_parallel_size=degree, use_cpu_initialization=True, perform_initialization=False
    )
    ref = _layer()
    x, mask, w = _inputs()
    xr = x.clone().requires_grad_()
    want_out = ref(xr, attention_mask=mask)
    (want_out * w).sum().backward()
    want = {"out": want_out.detach(), "x": xr.grad, **{n: p.grad for n, p in ref.named_parameters()}}
    split = GatedDeltaNetSplit(
        CONFIG["linear_num_key_heads"],
        CONFIG["linear_num_value_heads"],
        CONFIG["linear_key_head_dim"],
        CONFIG["linear_value_head_dim"],
    )
    results = {}
    for case in ("tp", "sp", "conv_fault"):
        comm = CommCounter()
        sp = SequenceParallelRegion(group, degree, rank, comm) if case == "sp" else None
        layer = copy.deepcopy(_layer())
        rows = {"gdn.out_proj"} if sp is not None else set()
        split.split("gdn", layer, SplitContext(rank, degree, config, comm, sp, rows))
        if case == "conv_fault":
            with torch.no_grad():  # conv channels cut as equal rows, not as in_proj_qkv's blocks
                layer.conv1d.weight.copy_(local_slice(ref.conv1d.weight, ShardSpec("column"), rank, degree))
        xs = x.clone().requires_grad_()
        if sp is None:
            out = layer(xs, attention_mask=mask)
            (out * w).sum().backward()
        else:
            local = layer(sp.gather(sp.split(xs)), attention_mask=mask)  # this rank's tokens
            rows_per = local.shape[0]
            mine = slice(rank * rows_per, (rank + 1) * rows_per)
            (local * w.reshape(-1, w.shape[-1])[mine]).sum().backward()
            # every rank's tokens, back in the batch's shape
            pieces = [torch.empty_like(local) for _ in range(degree)]
            dist.all_gather(pieces, local.detach().contiguous())
            out = torch.cat(pieces)[: x.shape[0] * x.shape[1]].reshape(x.shape)
        results[case] = {"out": out.detach(), "x": xs.grad, **_full_grads(layer)}
    return {"want": want, **results}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(gdn_rank, 2)


@pytest.mark.parametrize("case", ["tp", "sp"])
def test_split_layer_equals_the_hf_layer(ranks, case):
    for rank, got in enumerate(ranks):
        assert_tensors_close(got[case], got["want"], f"rank {rank} {case}: ")


def test_conv_channels_cut_unlike_the_projection_are_caught(ranks):
    with pytest.raises(AssertionError):
        assert_tensors_close(ranks[0]["conv_fault"], ranks[0]["want"], "conv fault: ")


def test_block_spec_slices_merges_and_reads_alike():
    spec = ShardSpec("column", blocks=(16, 16, 24))
    full = torch.arange(56 * 3, dtype=torch.float32).reshape(56, 1, 3)  # a conv1d weight's shape
    for degree in (1, 2, 4, 8):
        pieces = [local_slice(full, spec, r, degree) for r in range(degree)]
        assert_exact(merge(pieces, spec), full, f"degree {degree}: ")
        for r, piece in enumerate(pieces):
            # rank r's rows of each block, in q, k, v order
            want = torch.cat(
                [
                    b[r * (b.shape[0] // degree) : (r + 1) * (b.shape[0] // degree)]
                    for b in full.split([16, 16, 24])
                ]
            )
            assert_exact(piece, want, f"degree {degree} rank {r}: ")
            read = torch.cat(
                [full[src : src + n] for _, src, n, _ in local_pieces(spec, list(full.shape), r, degree)]
            )
            assert_exact(read, piece, f"degree {degree} rank {r} sliced read: ")
    # resharding: degree 2's pieces merged, cut again for degree 4 (and back)
    two = [local_slice(full, spec, r, 2) for r in range(2)]
    four = [local_slice(merge(two, spec), spec, r, 4) for r in range(4)]
    assert_exact(merge([local_slice(merge(four, spec), spec, r, 2) for r in range(2)], spec), full)


@pytest.mark.parametrize("target", ["in_proj_qkv", "out_proj"])
def test_lora_on_a_family_split_linear_is_refused(target):
    """LoRA on a linear a family splits by its own rule (``in_proj_qkv``'s q, k and v blocks cut
    by heads separately) would be cut as a plain column / row linear, which it is not: the
    strategy refuses it by name at set-up instead of training wrong adapters."""
    from torch import nn

    from disagg.interfaces import LayerMap
    from disagg.interfaces.lora import LoraSpec
    from disagg_llm_tp.gdn import GatedDeltaNetSplit
    from disagg_llm_tp.lora import draw_sites
    from disagg_llm_tp.module_split import SPLITS
    from disagg_llm_tp.parallelize import TPPlan

    lin = "layers.*.linear_attn"
    block = nn.Module()
    block.linear_attn = _layer()
    root = nn.Module()
    root.layers = nn.ModuleList([block])
    gdn = GatedDeltaNetSplit(
        key_heads=CONFIG["linear_num_key_heads"],
        value_heads=CONFIG["linear_num_value_heads"],
        key_head_dim=CONFIG["linear_key_head_dim"],
        value_head_dim=CONFIG["linear_value_head_dim"],
    )
    lmap = LayerMap(
        column=tuple(f"{lin}.in_proj_{x}" for x in ("qkv", "z", "b", "a")),
        row=(f"{lin}.out_proj",),
        extra={SPLITS: {lin: gdn}},
    )
    spec = LoraSpec(r=2, alpha=4.0, dropout=0.0, targets=(target,))
    with pytest.raises(ValueError, match=rf"LoRA on 'layers\.0\.linear_attn\.{target}' is not supported"):
        draw_sites(root, spec, "llm", TPPlan(), lmap)
