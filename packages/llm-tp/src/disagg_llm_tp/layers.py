"""megatron-core tensor-parallel layers that drop in for Hugging Face ``nn.Linear`` /
``nn.Embedding`` and keep their parameter names (``weight``, ``bias``).

Hugging Face code calls ``q_proj(x)`` on ``[batch, seq, hidden]`` (decoders) or
``[seq, hidden]`` (vision encoders) and expects one tensor back; Megatron's
layers take ``[seq, batch, hidden]`` and return ``(output, bias)``. The thin
subclasses below adapt the calling convention only; the math, the autograd
functions and the collectives are megatron-core's.

Each parameter carries a :class:`~disagg_llm_tp.shard_spec.ShardSpec` (``param.tp_spec``) that says how
its full tensor is cut, so the strategy can reduce, count and merge gradients
and state exactly.

Bytes moved by megatron's own collectives are counted analytically here (they
are issued inside megatron's autograd functions, which cannot route them
through ``CommCounter``): ColumnParallelLinear's backward all-reduce of the
input gradient, RowParallelLinear's and VocabParallelEmbedding's forward
all-reduce of the output.

With sequence parallelism (``sp``, see :mod:`disagg_llm_tp.sequence_parallel`)
column linears read an already gathered input whose backward reduce-scatter
sums their input gradients, so they do not all-reduce them; row linears
reduce-scatter their output instead of all-reducing it.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from disagg.interfaces.comm import CommCounter
from disagg.kit.recompute import replaying
from disagg_llm_tp.sequence_parallel import SequenceParallelRegion


def _noop_init(_: torch.Tensor) -> None:
    """Weights are copied from the HF module right after construction."""


def _to_sbh(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """HF layout -> Megatron's ``[seq, batch, hidden]``: every token becomes one
    "sequence" position of batch 1, in HF's own (batch-major) order, so that the
    weight-gradient reductions run over tokens in the order HF's do (without
    sequence parallelism Megatron treats all leading positions alike)."""
    return x.reshape(-1, 1, x.shape[-1]), x.shape


def _from_sbh(y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return y.reshape(*shape[:-1], y.shape[-1])


def _allreduce_bytes(t: torch.Tensor, n: int) -> int:
    return 2 * (n - 1) * t.numel() * t.element_size() // n if n > 1 else 0


class TPColumnLinear(ColumnParallelLinear):
    """ColumnParallelLinear called like ``nn.Linear`` (output stays split)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        config: ModelParallelConfig,
        comm: CommCounter,
        sp: SequenceParallelRegion | None = None,
    ):
        super().__init__(
            in_features,
            out_features,
            config=config,
            init_method=_noop_init,
            bias=bias,
            gather_output=False,
            skip_bias_add=False,
            # Under sequence parallelism the gather before this layer sums the input gradient.
            disable_grad_reduce=sp is not None,
        )
        self.comm = comm
        self.tp_size = config.tensor_model_parallel_size
        self.sp = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x3, shape = _to_sbh(x)
        # The backward all-reduce of the input gradient, counted here; a recomputed
        # block's replay runs this forward again but its backward only once.
        if self.sp is None and x.requires_grad and not replaying():
            self.comm.add("all_reduce", _allreduce_bytes(x3, self.tp_size))
        with self.sp.save_shards() if self.sp is not None else contextlib.nullcontext():
            out, _ = super().forward(x3)
        return _from_sbh(out, shape)


class TPRowLinear(RowParallelLinear):
    """RowParallelLinear called like ``nn.Linear`` on an already split input."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        config: ModelParallelConfig,
        comm: CommCounter,
        sp: SequenceParallelRegion | None = None,
    ):
        super().__init__(
            in_features,
            out_features,
            config=config,
            init_method=_noop_init,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        self.comm = comm
        self.tp_size = config.tensor_model_parallel_size
        self.sp = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x3, shape = _to_sbh(x)
        if self.sp is not None:
            # RowParallelLinear.forward with sequence_parallel, minus megatron's
            # CUDA-only reduce-scatter: megatron's matmul, then ours, then the bias.
            out = self._forward_impl(
                input=x3,
                weight=self.weight,
                bias=None,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                allreduce_dgrad=False,
                sequence_parallel=False,
                tp_group=None,
                grad_output_buffer=None,
            )
            out = self.sp.reduce_scatter(out)
            return out + self.bias if self.bias is not None else out
        out, _ = super().forward(x3)
        self.comm.add("all_reduce", _allreduce_bytes(out, self.tp_size))
        return _from_sbh(out, shape)


class TPVocabEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding with ``nn.Embedding``'s ``padding_idx`` semantics
    (that row never receives gradient), so training matches HF exactly."""

    def __init__(
        self,
        padded_vocab: int,
        hidden: int,
        padding_idx: int | None,
        config: ModelParallelConfig,
        comm: CommCounter,
    ):
        super().__init__(padded_vocab, hidden, init_method=_noop_init, config=config)
        self.comm = comm
        self.tp_size = config.tensor_model_parallel_size
        self.padding_idx = padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(input_ids)
        self.comm.add("all_reduce", _allreduce_bytes(out, self.tp_size))
        if self.padding_idx is not None:
            # Lookups of padding_idx send no gradient to the table; a tied
            # output layer still updates that row, exactly as in nn.Embedding.
            pad = (input_ids == self.padding_idx).unsqueeze(-1)
            out = torch.where(pad, out.detach(), out)
        return out
