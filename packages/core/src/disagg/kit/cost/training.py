"""What of a module trains, as the cost model counts it: ``train.modules.<m>.lora`` and
``train.modules.<m>.freeze`` (:class:`~disagg.interfaces.cost.CostQuery`'s ``lora`` and
``frozen``).

A frozen tensor holds its weight only (the recipe's weight bytes): no gradient, no optimizer
state, no gradient reduction, and no weight-gradient product in backward (its matmul still
runs forward and, where an input needs a gradient, backward to its input). LoRA freezes the
whole base except the parts it saves in full (``modules_to_save``) and adds two trained tensors
per adapted linear, as PEFT's ``lora.Linear`` holds them: ``lora_A`` ``[r, in]`` and
``lora_B`` ``[out, r]``, no bias. Under tensor parallelism they are cut as megatron_tp cuts
them (``disagg_llm_tp.lora``): a column-parallel base (column / kv) keeps ``lora_A``
whole and cuts ``lora_B`` like the base's output rows; a row-parallel base cuts ``lora_A``
like its input columns and keeps ``lora_B`` whole.

Names: a target matches a tensor's module name by PEFT's rule (the whole name or a suffix of
whole components, :func:`disagg.kit.lora.target_matches`); a planning shape may leave out
levels of the Hugging Face names (a decoder's ``layers.0.q_proj`` for
``model.layers.0.self_attn.q_proj``), so a target none of the shape's tensors match that way
matches by its last component. Part patterns (``merger.*``, ``model.layers.*``) match a tensor
name directly or with leading components of the pattern dropped (the shape's names have no
``model.`` prefix), never down to a bare wildcard.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fnmatch import fnmatchcase

from disagg.interfaces.compute import Compute, Gemm, Split
from disagg.interfaces.cost import CostQuery, Workload
from disagg.interfaces.lora import LoraSpec
from disagg.interfaces.shapes import EncoderShape, ParamTensor, Shape
from disagg.kit.cost.gemms import tensor_gemm
from disagg.kit.lora import target_matches

#: AdamW's per-tensor step count (a 0-d fp32 tensor, whatever the recipe)
STEP_TENSOR_BYTES = 4


@dataclass(frozen=True)
class Trained:
    """A module's tensors split by what trains."""

    #: base tensors that train, then the adapters (each with a gradient and AdamW state)
    trainable: tuple[ParamTensor, ...]
    #: base tensors held frozen (weights only)
    frozen: tuple[ParamTensor, ...]
    #: the LoRA adapters among ``trainable`` (``lora_A`` / ``lora_B`` per adapted linear)
    adapters: tuple[ParamTensor, ...] = ()
    #: the base weights the adapters wrap (each in ``frozen``)
    adapted: tuple[ParamTensor, ...] = ()

    @property
    def full(self) -> bool:
        """Every tensor trains and nothing is added: the full-training figures apply unchanged."""
        return not self.frozen and not self.adapters


def part_matches(name: str, pattern: str) -> bool:
    """A part's ``fnmatch`` pattern against a planning-shape tensor name (module docstring)."""
    if fnmatchcase(name, pattern):
        return True
    comps = pattern.split(".")
    for k in range(1, len(comps)):
        rest = comps[k:]
        if all(any(c in p for c in "*?[") for p in rest):
            return False
        if fnmatchcase(name, ".".join(rest)):
            return True
    return False


def module_name(tensor: str) -> str:
    """``blocks.0.attn.qkv.weight`` -> ``blocks.0.attn.qkv``."""
    return tensor.rsplit(".", 1)[0]


def _linear_weights(shape: Shape) -> list[ParamTensor]:
    """The 2-D weights (linears; a convolution's 5-D weight is no LoRA target)."""
    return [t for t in shape.tensors() if len(t.shape) == 2 and t.name.endswith(".weight")]


def adapted_weights(shape: Shape, lora: LoraSpec) -> list[ParamTensor]:
    """The base weights ``lora``'s targets wrap (outside the parts it saves in full)."""
    linears = [t for t in _linear_weights(shape) if not _saved(t.name, lora)]
    out = []
    for target in lora.targets:
        hit = [t for t in linears if target_matches(module_name(t.name), target)]
        if not hit and "." in target:
            last = target.rsplit(".", 1)[-1]
            hit = [t for t in linears if target_matches(module_name(t.name), last)]
        out += [t for t in hit if t not in out]
    order = {t.name: i for i, t in enumerate(shape.tensors())}
    return sorted(out, key=lambda t: order[t.name])


def _saved(name: str, lora: LoraSpec) -> bool:
    return any(part_matches(name, p) for p in lora.save_patterns)


def adapter_tensors(base: ParamTensor, r: int) -> tuple[ParamTensor, ParamTensor]:
    """``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` of one adapted linear, cut as
    megatron_tp cuts them (module docstring); both see the base's rows."""
    out, inner = base.shape
    prefix = module_name(base.name)
    row = base.tp == "row"
    a = ParamTensor(f"{prefix}.lora_A.weight", (r, inner), "row" if row else "replicated", rows=base.rows)
    b_kind = "replicated" if row or base.tp == "vocab" else base.tp
    b = ParamTensor(f"{prefix}.lora_B.weight", (out, r), b_kind, base.heads, rows=base.rows)
    return a, b


def trained(shape: Shape, lora: LoraSpec | None = None, frozen: tuple[str, ...] = ()) -> Trained:
    """``shape``'s tensors under ``lora`` and the ``frozen`` part patterns."""
    key = shape.params if isinstance(shape, EncoderShape) else ()
    return _trained(shape, key, lora, tuple(frozen))


@functools.lru_cache(maxsize=256)
def query_trained(query: CostQuery) -> Trained:
    """``query``'s module tensors split by what trains (its LoRA and frozen parts)."""
    return trained(query.shape, query.lora, query.frozen)


def _trained(
    shape: Shape, _params: tuple[ParamTensor, ...], lora: LoraSpec | None, frozen: tuple[str, ...]
) -> Trained:
    tensors = shape.tensors()
    if lora is None and not frozen:
        return Trained(tuple(tensors), ())
    if lora is not None:
        wrapped = adapted_weights(shape, lora)
        by_module = {module_name(t.name): adapter_tensors(t, lora.r) for t in wrapped}
        warm: list[ParamTensor] = []
        cold = []
        # module order, as the wrapped module lists its parameters (PEFT: the base layer's
        # weight and bias, then lora_A, lora_B), so the reduction's buckets fall as at run time
        last = {module_name(t.name): i for i, t in enumerate(tensors)}
        for i, t in enumerate(tensors):
            (warm if _saved(t.name, lora) else cold).append(t)
            here = module_name(t.name)
            if last[here] == i and here in by_module:
                warm += by_module[here]
        adapters = tuple(x for t in wrapped for x in by_module[module_name(t.name)])
        return Trained(tuple(warm), tuple(cold), adapters, tuple(wrapped))
    cold = [t for t in tensors if any(part_matches(t.name, p) for p in frozen)]
    warm = [t for t in tensors if t not in cold]
    return Trained(tuple(warm), tuple(cold))


# -- the terms each strategy's estimate counts -----------------------------------------------------
def state_bytes(tr: Trained, tp_degree: int = 1, per_element: int = 16, frozen_bytes: int = 4) -> int:
    """Parameters + gradients + optimizer state on a rank that holds each tensor whole
    (``tp_degree`` 1) or its tensor-parallel slice: ``per_element`` bytes per trained element
    (weight, master, gradient, moments) and AdamW's step per trained tensor, ``frozen_bytes``
    per frozen element."""
    warm = sum(t.local_numel(tp_degree) for t in tr.trainable)
    cold = sum(t.local_numel(tp_degree) for t in tr.frozen)
    return per_element * warm + STEP_TENSOR_BYTES * len(tr.trainable) + frozen_bytes * cold


def shard_shapes(tr: Trained, shard: str) -> list[tuple[int, ...]]:
    """Tensors the sharded state's collectives move: FSDP2 gathers every parameter (frozen
    ones too), ZeRO-1 partitions and broadcasts the trained ones."""
    tensors = tr.trainable if shard == "optimizer" else (*tr.trainable, *tr.frozen)
    return [t.shape for t in tensors]


def replicated_state_bytes(tr: Trained, shard: str, world: int, w: Workload | None = None) -> int:
    """The state term of a replicated strategy (``ddp``, ``ulysses``) under ``parallel.<m>.shard``
    in ``w``'s precision recipe (default ``fp32``): the trained tensors by
    :func:`disagg.kit.sharding.state_bytes`, each frozen element its weight's bytes (FSDP2
    shards it like any parameter). Exact without ``shard``; with it and frozen tensors an estimate."""
    from disagg.kit import sharding as sharded

    recipe = w.recipe if w is not None else None
    weight = w.weight_bytes if w is not None else 4
    if tr.full:
        return sharded.state_bytes([t.shape for t in tr.trainable], shard, world, recipe)
    if shard == "none" or world == 1:
        per = w.state_element if w is not None else 16
        return state_bytes(tr, 1, per, weight)
    warm = sharded.state_bytes([t.shape for t in tr.trainable], shard, world, recipe) if tr.trainable else 0
    if shard in sharded.FSDP_MODES:
        return warm + weight * sum(sharded.shard_rows(t.shape, world) for t in tr.frozen)
    return warm + weight * sum(t.numel for t in tr.frozen)


def numels(tr: Trained) -> list[int]:
    """Elements of each trained tensor: what the gradient reduction sums."""
    return [t.numel for t in tr.trainable]


def _products(tensors: tuple[ParamTensor, ...]) -> list[ParamTensor]:
    """Tensors whose matmul the FLOP rules count (an embedding is a lookup, not a product)."""
    return [t for t in tensors if "embed_tokens" not in t.name]


def flops_delta(tr: Trained, n: int) -> float:
    """Training FLOPs per sample of ``n`` tokens on top of the full-training count: each adapter's
    three products (``2·rows·numel`` each), less each frozen weight's weight-gradient product."""
    add = sum(3 * 2 * t.matmul_rows(n) * t.numel for t in tr.adapters)
    drop = sum(2 * t.matmul_rows(n) * t.numel for t in _products(tr.frozen))
    return float(add - drop)


def compute_delta(base: Compute, tr: Trained, n: int, split: Split) -> Compute:
    """``base`` (one sample's work by shape) with the adapters' products added (three each) and
    one product less per frozen weight (no weight gradient): same-shaped products fold together."""
    if tr.full:
        return base
    extra: list[Gemm] = []
    for t in tr.adapters:
        g = tensor_gemm(t, t.matmul_rows(n), split)
        if g is not None:
            extra.append(Gemm(g.m, g.n, g.k, 3.0))
    for t in _products(tr.frozen):
        g = tensor_gemm(t, t.matmul_rows(n), split)
        if g is not None:
            extra.append(Gemm(g.m, g.n, g.k, -1.0))
    counts: dict[tuple[int, int, int], float] = {}
    for g in (*base.gemms, *extra):
        counts[(g.m, g.n, g.k)] = counts.get((g.m, g.n, g.k), 0.0) + g.count
    gemms = tuple(Gemm(m, k_n, k, c) for (m, k_n, k), c in counts.items() if c > 1e-9)
    return Compute(gemms, base.attention, base.elementwise_bytes, base.elem_bytes)


def adapter_activation_bytes(tr: Trained, tokens: int, act_bytes: int) -> int:
    """What the adapters add to the saved activations of ``tokens`` tokens: ``lora_B``'s input,
    ``r`` elements per token and adapter (whole on every TP rank: a row-parallel ``lora_A``'s
    output is reduced). An estimate: the base linears' own saves are counted as in full training
    (an upper bound: a frozen weight needs no saved input for a weight gradient), adapter dropout's
    mask is not counted."""
    per_token = sum(t.shape[1] for t in tr.adapters if ".lora_B." in t.name)
    return int(tokens * per_token * act_bytes)


def adapter_sites(tr: Trained) -> dict[str, int]:
    """Adapted linears by how megatron_tp cuts them (``column`` includes kv), for its
    adapter collectives."""
    out = {"column": 0, "row": 0}
    for t in tr.adapted:
        out["row" if t.tp == "row" else "column"] += 1
    return out
