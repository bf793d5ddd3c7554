"""A group's cost with the layout keys the planner models on top of a strategy's own hook:
``context_parallel`` (a decoder's sequence over N ranks, :mod:`disagg.kit.cost.context_parallel`)
and ``offload: optimizer | activations | all`` (:mod:`disagg.kit.cost.offload`,
:mod:`disagg.kit.cost.activation_offload`), and its device memory as the allocator holds it
(:mod:`disagg.kit.cost.memory`).

The strategy is asked as usual, with these two keys left out of its options; a CP group is asked
for its equivalent data-parallel query (``T/N`` tokens, ``N`` times the replicas and samples) and
the CP terms added; an offloaded group's state is recounted by the offload rule. Both assume full
training (no LoRA, nothing frozen): the planner offers them only then. When the strategies state
these keys' cost themselves (the context-parallel and offload issues), :func:`extended_cost`
is where to ask them instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from disagg.interfaces import Cost
from disagg.interfaces.precision import RECIPES
from disagg.interfaces.shapes import DecoderShape, Shape
from disagg.kit.cost import activation_offload as act_off
from disagg.kit.cost import context_parallel as cpm
from disagg.kit.cost import offload as off
from disagg.kit.cost.memory import GroupMemory, communicators
from disagg.kit.cost.rules import one_block

#: the layout keys this module models (left out of the strategy's options)
KEYS = ("context_parallel", "offload")


def _no_shard(options: dict[str, Any]) -> str:
    return "none"


def _same(options: dict[str, Any]) -> dict[str, Any]:
    return dict(options)


@dataclass(frozen=True)
class Traits:
    """What the model needs to know of a strategy to count :data:`KEYS` for it, stated by whoever
    asks for them (the published setting's table, :data:`disagg.bench.published.MODELLED`): core
    names no strategy."""

    #: its state elements are the tensor-parallel slice of ``degree`` ranks
    tensor_parallel: bool = False
    #: how it composes with context parallelism: ``tp`` (TP x CP: the optimizer's part sharded over
    #: the CP ranks, weights and gradients whole), ``fsdp`` (FSDP + CP: everything over the group),
    #: or None (not modelled)
    context_parallel: str | None = None
    #: its state sharding under its options: ``none``, ``optimizer``, ``gradients`` or ``parameters``
    shard_mode: Callable[[dict[str, Any]], str] = _no_shard
    #: its options for the replicated query FSDP + CP asks (the sharding key removed)
    replicated: Callable[[dict[str, Any]], dict[str, Any]] = _same
    #: its optimizer offload is modelled
    offload: bool = True


@dataclass
class GroupCost:
    """A group's cost per rank, the allocator's view of it, and what offload adds."""

    cost: Cost
    memory: GroupMemory
    #: :func:`disagg.kit.cost.offload.offload_seconds`' keyword arguments (no ``compute_s``); None: no offload
    offload: dict[str, Any] | None = None
    #: :func:`disagg.kit.cost.activation_offload.offload_seconds`' keyword arguments; None: the
    #: saved activations stay on the device
    activation_offload: dict[str, Any] | None = None


def shards(
    traits: Traits, options: dict[str, Any], degree: int, replicas: int, cp: int
) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) shard counts of a rank's (tensor-parallel) slice."""
    if traits.tensor_parallel:
        return cpm.state_shards(cp, replicas) if cp > 1 else (1, 1, 1)
    n = degree * replicas * cp
    return {
        "none": (1, 1, 1),
        "optimizer": (1, 1, n),
        "gradients": (1, n, n),
        "parameters": (n, n, n),
    }[traits.shard_mode(options)]


def elements(shape: Shape, traits: Traits, degree: int) -> tuple[int, int]:
    """Trained elements a rank's slice holds before its state is sharded, and the tensors."""
    tensors = shape.tensors()
    tp = degree if traits.tensor_parallel else 1
    return sum(t.local_numel(tp) for t in tensors), len(tensors)


def _fsdp(
    cost: Cost, shape: Shape, precision: str, world: int, microbatches: int, seq: int, samples: int
) -> Cost:
    """FSDP2 (``shard: parameters``) over ``world`` ranks on top of a replicated decoder's cost: its
    all-gathers and reduce-scatters replace the gradient all-reduce
    (:func:`disagg.kit.sharding.cost.step_comm`), and two units are held gathered (the one computing
    and the one prefetched: FSDP2's default forward prefetch of one unit)."""
    from disagg.interfaces.cost import Workload
    from disagg.kit.sharding.cost import step_comm

    r = RECIPES[precision]
    w = Workload(1, world, seq, samples, microbatches, r.activation_bytes, 0, 0, precision)
    units = shape.layers + 1  # type: ignore[attr-defined]
    shapes = [t.shape for t in shape.tensors()]
    comm, calls = step_comm(shapes, "parameters", w, units, cost.comm_bytes_by_kind, cost.comm_calls_by_kind)
    layer = sum(t.numel for t in one_block(shape).tensors() if ".layers." in f".{t.name}")
    head = max(t.numel for t in shape.tensors())
    gathered = r.weights.itemsize * (max(layer, head) + layer)
    return replace(cost, comm_bytes_by_kind=comm, comm_calls_by_kind=calls, gathered_bytes=gathered)


def extended_cost(
    ask: Callable[..., Cost],
    shape: Shape,
    traits: Traits | None,
    degree: int,
    replicas: int,
    seq_len: int,
    precision: str,
    samples: int,
    microbatches: int,
    options: dict[str, Any],
    recompute: str,
    exchanged_rows: int | None,
) -> GroupCost | None:
    """``ask(shape=, degree=, replicas=, seq_len=, samples=, options=, recompute=, exchanged_rows=)``
    is the strategy's hook for one query (None: it states no cost for the module); ``options`` may
    hold :data:`KEYS`."""
    cp = int(options.get("context_parallel", 1) or 1)
    value = options.get("offload", "none")
    offload = value in ("optimizer", "all")
    activations = value in ("activations", "all")
    if activations and recompute != "full":
        raise ValueError(f"offload: {value} moves what recompute: full keeps; recompute is {recompute!r}")
    base = {k: v for k, v in options.items() if k not in KEYS}
    if (cp > 1 or offload) and traits is None:
        raise ValueError(f"{', '.join(k for k in KEYS if k in options)}: not modelled for this strategy")
    traits = traits or Traits(offload=False)
    if cp > 1 and (not isinstance(shape, DecoderShape) or traits.context_parallel is None):
        raise ValueError(f"context_parallel {cp}: only a decoder under a strategy that composes with CP")
    q = {
        "degree": degree,
        "replicas": replicas * cp,
        "seq_len": cpm.local_tokens(seq_len, cp),
        "samples": samples * cp,
        "options": base,
        "exchanged_rows": None if exchanged_rows is None else exchanged_rows // cp,
    }
    fsdp_cp = cp > 1 and traits.context_parallel == "fsdp"
    if fsdp_cp:  # FSDP2 for a decoder is asked replicated, the FSDP terms added below
        if traits.shard_mode(base) != "parameters":
            raise ValueError("context_parallel: FSDP + CP needs the parameters sharded")
        q["options"] = traits.replicated(base)
    cost = ask(shape=shape, recompute=recompute, **q)
    if cost is None:
        return None
    one = ask(shape=one_block(shape), recompute="none", **q)
    transient = one.activation_bytes if one is not None else 0
    acts = act_off.ActivationSplit(cost.activation_bytes, 0, 0)
    if activations:  # the strategy's own counts of the module and of one block under full
        one_full = ask(shape=one_block(shape), recompute="full", **q)
        if one_full is not None:
            acts = act_off.split(shape, cost.activation_bytes, one_full.activation_bytes)
            if not acts.host:  # one block (or none counted): nothing would stay away; not offered
                return None
    act = RECIPES[precision].activation_bytes
    per_rank_samples = -(-samples // replicas)
    state = cost.state_bytes
    host = 0
    split = shards(traits, base, degree, replicas, cp)
    n_el, n_t = elements(shape, traits, degree)
    if cp > 1:
        assert isinstance(shape, DecoderShape)
        kinds, calls = cpm.kv_exchange(shape, seq_len, cp, degree, act, per_rank_samples, recompute)
        comm = dict(cost.comm_bytes_by_kind)
        ncalls = dict(cost.comm_calls_by_kind)
        for k, v in kinds.items():
            comm[k] = comm.get(k, 0) + v
            ncalls[k] = ncalls.get(k, 0) + calls[k]
        compute = cost.compute
        flops = cost.flops
        if compute is not None:
            widened = cpm.attention(compute, cp)
            flops += widened.flops - compute.flops
            compute = widened
        gathered_kv = cpm.kv_gathered_bytes(shape, seq_len, cp, degree, act, recompute)
        cost = replace(
            cost,
            comm_bytes_by_kind=comm,
            comm_calls_by_kind=ncalls,
            compute=compute,
            flops=flops,
            activation_bytes=cost.activation_bytes + gathered_kv,
        )
        if traits.context_parallel == "tp":  # the replicas' full copy: optimizer sharded over the CP ranks
            state = off.state_split(n_el, precision, False, *split, tensors=n_t).device
        if fsdp_cp:
            cost = _fsdp(cost, shape, precision, replicas * cp, microbatches, q["seq_len"], samples * cp)
            state = off.state_split(n_el, precision, False, *split, tensors=n_t).device
    if offload:  # the offload rule's count replaces the strategy's (full training only)
        moved = off.state_split(n_el, precision, True, *split, tensors=n_t)
        state, host = moved.device, moved.host
    cost = replace(
        cost,
        state_bytes=state,
        activation_bytes=cost.activation_bytes - acts.moved,
        host_bytes=host + acts.host,
    )
    alltoall = degree - 1 if cost.comm_bytes_by_kind.get("all_to_all") else 0
    memory = GroupMemory(
        module="",
        state=cost.state_bytes,
        gathered=cost.gathered_bytes,
        saved=cost.activation_bytes,
        transient=transient,
        communicators=communicators(degree, cp, replicas),
        alltoall_peers=alltoall,
        buffers=cost.buffer_bytes,
        host=host + acts.host,
    )
    info = None
    if offload:
        info = {
            "elements": n_el,
            "precision": precision,
            "microbatches": microbatches,
            "grads_over": split[1],
            "optim_over": split[2],
        }
    act_info = {"host_bytes": acts.host, "microbatches": microbatches} if acts.host else None
    return GroupCost(cost, memory, info, act_info)
