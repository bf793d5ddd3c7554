"""Memory per rank: model state (exact) and saved activations (an estimate).

State is parameters + gradients + AdamW's two moments, all fp32 under the dtype
rule (16 bytes per element), plus AdamW's 4-byte ``step`` tensor per parameter
tensor — what :meth:`Strategy.state_bytes` counts after a step. Exact for
``ddp``, ``ulysses`` and ``megatron_tp``. For ``zero`` it is what DeepSpeed
holds after its step in fp32 training (``disagg_zero`` counts the storages
themselves), over ``n`` ranks and ``ψ`` elements: stages 1-2 keep the whole
parameters and an fp32 master partition with its two moments, ``4ψ + 12ψ/n``
(DeepSpeed frees their gradients in the step); stage 3 keeps each tensor's
partition ``ceil(k/n)``, its own fp32 master copy, a gradient partition and the
two moments, ``20·Σceil(k/n)``, plus the tensors of at most
``stage3_param_persistence_threshold`` elements whole on every rank (DeepSpeed
does not partition those between calls). Not the ZeRO paper's ``16ψ/n``: the
paper counts mixed precision, where the master copy replaces an fp32
parameter. Estimates within per-tensor scalars (step counters, norms).

Activations are the bytes autograd saves for backward, counted per saved tensor
as :func:`disagg.interfaces.activations.saved_bytes_hooks` counts them (a
tensor saved by two layers counts twice), for the tokens one rank holds at once.
Per token of a Qwen2.5-VL vision block, from HF's code (sdpa, fp32; the same
coefficients match the count on the tiny model exactly):

- each RMSNorm: its input, the squared input, the normalised output ``3H`` + 2 scalars;
- attention: the qkv input ``H``, q/k/v and the output kept by sdpa ``4H``, the
  output projection's input ``H``, the rotary cos/sin of q and k ``4·hd``, the
  log-sum-exp ``heads``;
- MLP: the gate and up inputs ``2H``, gate, its activation, up and their
  product ``4I``.

So ``14H + 4hd + heads + 4 + 4I`` per token per block, plus the patch pixels
(``C·tp·p²``) and the merger (``6H + 2``); HF's own forward also saves the
window permutation's index twice (int64 per merged row), which ``ulysses``
(it permutes the pixels instead) does not. Under tensor parallelism the column
outputs and what follows them are split ``1/d``, the rest is a full replica;
sequence parallelism also splits the norms and saves the column inputs as
shards. Under bf16 the norms still save fp32 tensors, so the figure is an
estimate there (within ~20%). The decoder uses the same per-token terms (GQA's
repeated key/value heads counted as full), plus the fp32 logits ``2V``·4 bytes
kept for the loss.
"""

from __future__ import annotations

from disagg.cost.shapes import DecoderShape, ParamTensor, VisionShape

STATE_BYTES_PER_ELEMENT = 16  # fp32 parameter, gradient, exp_avg, exp_avg_sq
STEP_TENSOR_BYTES = 4  # AdamW's per-tensor step count (a 0-d fp32 tensor)
#: DeepSpeed's default stage3_param_persistence_threshold (deepspeed/runtime/zero/config.py)
DEEPSPEED_PERSISTENCE = 100_000


def state_bytes(
    tensors: list[ParamTensor],
    strategy: str,
    degree: int,
    world: int,
    stage: int = 0,
    persistence_threshold: int = DEEPSPEED_PERSISTENCE,
) -> int:
    """Parameter + gradient + optimizer bytes on one rank."""
    if strategy == "zero":
        return zero_state_bytes([t.numel for t in tensors], stage, world, persistence_threshold)
    local = degree if strategy == "megatron_tp" else 1
    elems = sum(t.local_numel(local) for t in tensors)
    return STATE_BYTES_PER_ELEMENT * elems + STEP_TENSOR_BYTES * len(tensors)


def zero_state_bytes(
    numels: list[int], stage: int, n: int, persistence_threshold: int = DEEPSPEED_PERSISTENCE
) -> int:
    """DeepSpeed's holdings after a step, fp32 training (see the module docstring)."""
    psi = sum(numels)
    if stage < 3:
        return 4 * psi + 12 * -(-psi // n)
    parts = sum(-(-k // n) for k in numels)
    return 20 * parts + 4 * sum(k for k in numels if k <= persistence_threshold)


def vision_activation_bytes(
    shape: VisionShape,
    tokens: int,
    strategy: str,
    degree: int,
    act_bytes: int,
    sequence_parallel: bool = False,
) -> int:
    """Saved bytes on one rank while ``tokens`` patches are in flight on it
    (for ``ulysses`` the whole sequence: the rank holds ``tokens / degree``)."""
    h, i, hd, heads = shape.hidden, shape.intermediate, shape.head_dim, shape.heads
    patch = shape.in_channels * shape.temporal_patch * shape.patch**2
    block = 14 * h + 4 * hd + heads + 4 + 4 * i
    merger = 6 * h + 2
    d = degree
    if strategy == "ulysses":
        per_token = (patch + shape.depth * block + merger) / d
    elif strategy == "megatron_tp" and d > 1:
        if sequence_parallel:
            block_tp = (14 * h + heads + 4 + 4 * i) / d + 4 * hd
            merger_tp = (4 * h + 2) / d + 2 * h / d
        else:
            block_tp = 9 * h + 4 + 4 * hd + (5 * h + heads + 4 * i) / d
            merger_tp = 4 * h + 2 + 2 * h / d
        per_token = patch + shape.depth * block_tp + merger_tp
    else:
        per_token = patch + shape.depth * block + merger
    index = 0 if strategy == "ulysses" else 2 * 8 * (tokens // shape.unit)
    return int(tokens * per_token * act_bytes) + index


def llm_activation_bytes(
    shape: DecoderShape,
    tokens: int,
    strategy: str,
    degree: int,
    act_bytes: int,
    sequence_parallel: bool = False,
) -> int:
    """Saved bytes on one rank for ``tokens`` tokens in one forward (an estimate)."""
    h, i, hd, heads = shape.hidden, shape.intermediate, shape.head_dim, shape.heads
    layer = 14 * h + 4 * hd + heads + 4 + 4 * i
    logits = 2 * shape.vocab * 4 / act_bytes  # fp32, in units of act_bytes
    d = degree
    if strategy == "megatron_tp" and d > 1:
        if sequence_parallel:
            layer = (14 * h + heads + 4 + 4 * i) / d + 4 * hd
            head = (4 * h) / d + logits / d
        else:
            layer = 9 * h + 4 + 4 * hd + (5 * h + heads + 4 * i) / d
            head = 4 * h + logits / d
    else:
        head = 4 * h + logits
    return int(tokens * (shape.layers * layer + head) * act_bytes)


def recomputed_activation_bytes(
    shape: VisionShape | DecoderShape,
    tokens: int,
    strategy: str,
    degree: int,
    act_bytes: int,
    sequence_parallel: bool = False,
) -> int:
    """Saved bytes under full activation recomputation (an estimate): each
    layer keeps only its input for the tokens this rank holds (``ulysses`` and
    tensor parallelism with sequence parallelism ``1/degree`` of them, others
    all), plus one layer's activations while it is recomputed (and, for a
    decoder, the fp32 logits of the loss)."""
    from dataclasses import replace

    split = strategy == "ulysses" or (strategy == "megatron_tp" and sequence_parallel)
    held = -(-tokens // degree) if split else tokens
    if isinstance(shape, VisionShape):
        one = replace(shape, depth=1, full_blocks=(0,) if shape.full_blocks else ())
        layer = vision_activation_bytes(one, tokens, strategy, degree, act_bytes, sequence_parallel)
        return shape.depth * held * shape.hidden * act_bytes + layer
    one_layer = replace(shape, layers=1)
    layer = llm_activation_bytes(one_layer, tokens, strategy, degree, act_bytes, sequence_parallel)
    return shape.layers * held * shape.hidden * act_bytes + layer
