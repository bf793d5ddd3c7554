"""A gated-delta-net (linear-attention) layer split by heads under tensor parallelism.

Hugging Face's ``Qwen3_5GatedDeltaNet`` (and Qwen3-Next's, the same layout): ``in_proj_qkv``
fuses queries, keys and values of widths ``K·dk``, ``K·dk``, ``V·dv`` (``K`` key heads, ``V``
value heads, each key head serving ``V/K`` consecutive value heads); a depthwise causal
``conv1d`` runs over those channels; ``in_proj_z`` (the output gate, ``V·dv``),
``in_proj_b``/``in_proj_a`` (one per value head), ``dt_bias``/``A_log`` (per value head),
a gated RMSNorm over each value head's ``dv`` features and ``out_proj`` back to hidden.

Rank ``r`` of ``T`` keeps key heads ``r·K/T ..`` and the value heads they serve
(``r·V/T ..``: contiguous, because HF's grouping repeats each key head over consecutive
value heads), so the recurrence of every head runs whole on one rank and no collective is
needed inside the layer:

- ``in_proj_qkv``: one column-parallel linear whose local weight is ``[q_r; k_r; v_r]``,
  each block cut by heads separately (``ShardSpec("column", blocks=(K·dk, K·dk, V·dv))``).
  One linear rather than three keeps HF's parameter (name, checkpoint key, LoRA site) and
  its forward, which splits the conv output at ``key_dim, key_dim, value_dim`` (set to the
  local widths here). Megatron-core's own ``GatedDeltaNet`` keeps the same per-rank layout
  (its ``sharded_state_dict`` cuts ``in_proj`` into query/key/value/z/beta/alpha blocks);
- ``conv1d``: the same channels as ``in_proj_qkv``'s local output (the same block spec on
  its ``[channels, 1, kernel]`` weight), so each rank convolves exactly its own q/k/v;
- ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``dt_bias``, ``A_log``: column-parallel by
  value heads (contiguous rows);
- ``norm``: a full copy applied to this rank's heads only (each rank holds part of its
  gradient, summed over the TP ranks, as for Qwen3's per-head q/k norms);
- ``out_proj``: row-parallel (all-reduce, or reduce-scatter inside a sequence-parallel
  region).

Why not megatron-core 0.16.1's ``megatron.core.ssm.gated_delta_net.GatedDeltaNet``: it
imports the ``fla`` kernels at construction (not installable on our CPUs), allocates on
``torch.cuda.current_device()``, fuses q/k/v/z/b/a into one ``in_proj`` (another parameter
layout than HF's four projections: checkpoints, export and LoRA would need a remap), and
does not apply the attention mask to padding (``# TODO: Deal with attention_mask``), so it
could not equal the HF layer on a right-padded batch. Here the math is HF's own forward;
only the parameters and head counts are this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from disagg_llm_tp.module_split import SplitContext
from disagg_llm_tp.shard_spec import ShardSpec, copy_into, local_slice, mark


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class GatedDeltaNetSplit:
    """The :class:`~disagg_llm_tp.module_split.ModuleSplit` of one kind of GDN layer."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def qkv_blocks(self) -> tuple[int, int, int]:
        keys = self.key_heads * self.key_head_dim
        return keys, keys, self.value_heads * self.value_head_dim

    def problems(self, degree: int, where: str) -> list[str]:
        # every rank needs whole key heads and the value heads they serve
        if self.key_heads % degree == 0 and self.value_heads % degree == 0:
            return []
        return [
            f"the gated-delta-net layers of {where} have {self.key_heads} key heads and "
            f"{self.value_heads} value heads, which tensor-parallel degree {degree} cannot split "
            f"by heads; use a divisor of {self.key_heads}: {_divisors(self.key_heads)}"
        ]

    def split(self, name: str, module: nn.Module, tp: SplitContext) -> None:
        # megatron-core's layers, imported here: the family registers this split at registry time
        from disagg_llm_tp.layers import TPColumnLinear, TPRowLinear

        degree = tp.degree
        blocks = ShardSpec("column", blocks=self.qkv_blocks)
        for child, spec in (
            ("in_proj_qkv", blocks),
            ("in_proj_z", ShardSpec("column")),
            ("in_proj_b", ShardSpec("column")),
            ("in_proj_a", ShardSpec("column")),
        ):
            old = getattr(module, child)
            new = TPColumnLinear(
                old.in_features, old.out_features, old.bias is not None, tp.config, tp.comm, tp.sp
            )
            _take(new, old, spec, tp)
            setattr(module, child, new)

        old = module.out_proj
        region = tp.sp if f"{name}.out_proj" in tp.sp_rows else None
        new = TPRowLinear(old.in_features, old.out_features, old.bias is not None, tp.config, tp.comm, region)
        _take(new, old, ShardSpec("row"), tp, bias=ShardSpec("replicated", sp_partial=region is not None))
        module.out_proj = new

        conv = module.conv1d
        channels = conv.out_channels // degree
        new_conv = nn.Conv1d(
            channels,
            channels,
            kernel_size=conv.kernel_size[0],
            groups=channels,
            padding=conv.padding[0],
            bias=conv.bias is not None,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
        )
        _take(new_conv, conv, blocks, tp)
        module.conv1d = new_conv

        for leaf in ("dt_bias", "A_log"):  # per value head
            setattr(module, leaf, _cut(getattr(module, leaf), ShardSpec("column"), tp))
        for p in module.norm.parameters():
            mark(p, ShardSpec("replicated", sp_partial=True))  # applied to this rank's heads only

        # HF's forward reads these to split and reshape: this rank's heads and widths
        for attr in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):
            setattr(module, attr, getattr(module, attr) // degree)


def _take(
    new: nn.Module, old: nn.Module, spec: ShardSpec, tp: SplitContext, bias: ShardSpec | None = None
) -> None:
    """``new``'s parameters: this rank's pieces of ``old``'s (left as they are when ``old`` is
    on the meta device: the sliced load fills them), training as ``old``'s do."""
    for leaf in ("weight", "bias"):
        src: nn.Parameter | None = getattr(old, leaf, None)
        if src is None:
            continue
        dst: nn.Parameter = getattr(new, leaf)
        mark(dst, bias if leaf == "bias" and bias is not None else spec)
        copy_into(dst, src, tp.shard, tp.degree)
        dst.requires_grad_(src.requires_grad)


def _cut(full: nn.Parameter, spec: ShardSpec, tp: SplitContext) -> nn.Parameter:
    piece = local_slice(full.detach(), spec, tp.shard, tp.degree)
    new = nn.Parameter(piece.clone(), requires_grad=full.requires_grad)
    mark(new, spec)
    return new
