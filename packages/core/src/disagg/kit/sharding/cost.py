"""The analytic figures of ``parallel.<module>.shard`` (the cost files' state and communication
terms): bytes per rank of each mode, and the bytes and calls of the libraries' own collectives."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from disagg.interfaces.precision import RECIPES, Recipe
from disagg.kit.sharding.modes import FSDP_MODES


def zero1_partition(numels: list[int], world: int) -> list[int]:
    """Elements of each rank's ZeRO-1 partition: ``ZeroRedundancyOptimizer``'s greedy rule
    (largest tensor first, to the rank with the fewest elements so far; one param group)."""
    sizes = [0] * world
    for n in sorted(numels, reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += n
    return sizes


def zero1_tensors(numels: list[int], world: int) -> int:
    """Tensors in the busiest ZeRO-1 partition (each has an AdamW step count)."""
    sizes, count = [0] * world, [0] * world
    for n in sorted(numels, reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += n
        count[r] += 1
    return count[sizes.index(max(sizes))]


def shard_rows(shape: tuple[int, ...], world: int) -> int:
    """Elements FSDP2's rank 0 (the busiest) holds of a tensor split along dim 0 in
    ``ceil(D / N)``-row chunks."""
    if not shape:
        return 1
    rest = 1
    for s in shape[1:]:
        rest *= s
    return min(shape[0], -(-shape[0] // world)) * rest


def state_bytes(shapes: list[tuple[int, ...]], mode: str, world: int, recipe: Recipe | None = None) -> int:
    """Parameter + gradient + AdamW bytes on the busiest rank of an ``N``-rank group under
    ``parallel.<module>.shard`` (equal to :meth:`disagg.kit.Strategy.state_bytes` measured at a step's
    end in fp32; ``gradients`` adds the whole parameters held from a forward to its backward), in
    ``recipe``'s dtypes (default ``fp32``). ZeRO-1 keeps the weights, gradients and (``bf16``) the
    fp32 masters whole and partitions the moments: torch's ZeroRedundancyOptimizer steps each
    master on its owner and broadcasts it into every rank's whole master. FSDP2 shards what the
    optimizer steps (the master, or the weights without one), the gradients and the moments, and
    ``gradients`` holds the whole weights in the compute dtype."""
    r = recipe or RECIPES["fp32"]
    weight, grad = r.weights.itemsize, r.grads.itemsize
    numels = [_numel(s) for s in shapes]
    whole = sum(numels)
    if mode == "none" or world == 1:
        return r.state_bytes_per_element(True) * whole + 4 * len(shapes)
    if mode == "optimizer":
        part = zero1_partition(numels, world)
        return (
            (weight + grad + r.master_bytes) * whole
            + 2 * r.moments.itemsize * max(part)
            + 4 * zero1_tensors(numels, world)
        )
    local = sum(shard_rows(s, world) for s in shapes)
    sharded_element = (r.master or r.weights).itemsize + grad + 2 * r.moments.itemsize
    held = sharded_element * local + 4 * len(shapes)
    return held + weight * whole if mode == "gradients" else held


def decoder_gathered_elements(shape: Any) -> int:
    """Elements a decoder's FSDP2 ``parameters`` rank holds whole at once beside its shards (the
    unit computing and the one prefetched, FSDP2's default of one: the largest of a layer and the
    head, plus a layer); the count :mod:`disagg.plan.extended` models FSDP + CP with."""
    from disagg.kit.cost.rules import one_block

    layer = sum(t.numel for t in one_block(shape).tensors() if ".layers." in f".{t.name}")
    head = max(t.numel for t in shape.tensors())
    return max(layer, head) + layer


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def comm(
    shapes: list[tuple[int, ...]],
    mode: str,
    world: int,
    microbatches: int,
    units: int,
    act_bytes: int,
    grad_bytes: int = 4,
    stepped_bytes: int = 4,
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes a rank sends per step, and calls, for the state's own collectives, as
    :class:`~disagg.interfaces.CommCounter` counts them (an all-gather ``(N-1)`` x the rank's
    shard, a reduce-scatter ``(N-1)/N`` of the input): FSDP2 issues its own through the counter
    (:func:`disagg.kit.sharding.fsdp.counted_comms`; equal to this on the tiny LLaVA tower at
    d = 2, ``packages/vision-sp/tests/test_recipes.py``), ZeRO-1's broadcasts are
    ``ZeroRedundancyOptimizer``'s and go uncounted. ``shapes``: the tensors of the units that
    run (a unit whose forward never runs is never gathered), and for the reduce-scatter those
    that get a gradient (FSDP2 reduces no other). ``optimizer``: the default gradient
    all-reduce (the caller's) plus each owner's broadcast of its partition after the step.
    FSDP2: per microbatch, one all-gather of every unit for the forward and (``parameters``)
    one more for the backward, in the compute dtype, and one reduce-scatter of the whole
    gradient (``grad_bytes`` per element: fp32 but under ``bf16-pure``);
    ``units``: the FSDP units (blocks + 1)."""
    if world == 1 or mode == "none":
        return {}, {}
    numels = [_numel(s) for s in shapes]
    if mode == "optimizer":
        # the owners broadcast what they stepped (the fp32 master, or bf16-pure's bf16 weights)
        return {"broadcast": stepped_bytes * max(zero1_partition(numels, world))}, {"broadcast": world}
    local = sum(shard_rows(s, world) for s in shapes)
    gathers = (2 if mode == "parameters" else 1) * microbatches
    padded = local * world  # FSDP2 reduce-scatters the padded flat gradient
    return (
        {
            "all_gather": gathers * (world - 1) * local * act_bytes,
            "reduce_scatter": microbatches * (world - 1) * padded * grad_bytes // world,
        },
        {"all_gather": gathers * units, "reduce_scatter": microbatches * units},
    )


def step_comm(
    shapes: list[tuple[int, ...]],
    mode: str,
    w: Any,
    units: int,
    comm_bytes: dict[str, int],
    calls: dict[str, int],
    forwards_per_mb: int = 1,
) -> tuple[dict[str, int], dict[str, int]]:
    """A replicated strategy's communication (``comm_bytes``/``calls``: its gradient all-reduce)
    under ``mode`` for the :class:`~disagg.interfaces.cost.Workload` ``w``: FSDP2 replaces the
    all-reduce; ZeRO-1 adds its broadcasts. ``forwards_per_mb``: module forwards per
    microbatch on the busiest rank (``ddp`` runs one per sample; each gathers and reduces)."""
    extra, extra_calls = comm(
        shapes,
        mode,
        w.world,
        w.microbatches * forwards_per_mb,
        units,
        w.act_bytes,
        getattr(w, "grad_bytes", 4),
    )
    comm_bytes, calls = dict(comm_bytes), dict(calls)
    if mode in FSDP_MODES and w.world > 1:
        comm_bytes.pop("all_reduce", None)
        calls.pop("all_reduce", None)
    for k, v in extra.items():
        comm_bytes[k] = comm_bytes.get(k, 0) + v
    for k, v in extra_calls.items():
        calls[k] = calls.get(k, 0) + v
    return comm_bytes, calls


def offload_split(
    state: int,
    trainable: int,
    tensors: int,
    mode: str,
    recipe: Recipe | None = None,
    whole: int = 0,
    idle: int = 0,
) -> tuple[int, int]:
    """``(device, host)`` bytes of one rank's state under ``offload: optimizer``
    (:mod:`disagg.kit.offload`), from its ``state`` bytes without offload (this module's
    :func:`state_bytes`, or a strategy's own), the ``trainable`` elements it holds and the
    ``tensors`` it steps (one fp32 AdamW step count each). Host: per trainable element what the
    optimizer steps (the master, or under ``fp32``/``bf16-pure`` a separate copy of the weight),
    its gradient sum and the two moments, plus the step counts; the device keeps the rest, the
    working weights. Under FSDP2 (``gradients``/``parameters``) ``CPUOffloadPolicy`` moves the
    shards themselves: the device holds nothing at rest but (``gradients``) the ``whole`` weights
    bytes gathered from a forward to its backward. ``idle``: trainable elements that got no
    gradient (a layer the module never runs): a master each, no gradient, no moments."""
    r = recipe or RECIPES["fp32"]
    if mode in FSDP_MODES:
        device = whole if mode == "gradients" else 0
        return device, state - device
    stepped = (r.master or r.weights).itemsize
    if mode == "optimizer":  # ZeRO-1: moments of this rank's partition only (in ``state`` already)
        host_moments = state - (r.weights.itemsize + r.grads.itemsize + r.master_bytes) * trainable
        host = (stepped + r.grads.itemsize) * trainable + host_moments
    else:
        host = (stepped + r.grads.itemsize + 2 * r.moments.itemsize) * trainable + 4 * tensors
    host += stepped * idle
    # the masters were in ``state`` already under ``bf16``; under the other recipes a new copy
    device = state - host + (0 if r.master is not None else stepped * (trainable + idle))
    return device, host


def with_offload(
    cost: Any, trainable: int, tensors: int, mode: str, recipe: Recipe | None = None, whole: int = 0
) -> Any:
    """A strategy's :class:`~disagg.interfaces.Cost` under ``offload: optimizer``:
    ``state_bytes`` what stays on the device, ``host_bytes`` what moved (:func:`offload_split`)."""
    device, host = offload_split(cost.state_bytes, trainable, tensors, mode, recipe, whole)
    return replace(cost, state_bytes=device, host_bytes=host)
