"""``parallel.<module>.offload: optimizer``: what stays on the device, what goes to host memory,
and the seconds it adds.

Per trained element, in the run's recipe (:data:`disagg.interfaces.precision.RECIPES`):

- on the device: the working weight (the compute dtype) and its gradient in flight, also in the
  compute dtype (``bf16``: 2 + 2 bytes; ``fp32``: 4 + 4; ``bf16-pure``: 2 + 2);
- in host memory: the copy AdamW steps (the fp32 master under ``bf16``, the weight itself
  otherwise), the gradient accumulator in the recipe's gradient dtype and the two moments
  (``bf16``: 4 + 4 + 8 = 16 bytes; ``fp32``: 16; ``bf16-pure``: 2 + 2 + 4 = 8).

Sharding applies as without offload (:func:`state_split`): the weight over ``weights_over`` ranks,
the gradient over ``grads_over`` and the optimizer's part over ``optim_over`` (ZeRO-1: ``1, 1, n``;
ZeRO-3 / FSDP: ``n, n, n``; tensor parallelism: the elements are already the rank's slice).

Time (:func:`offload_seconds`): each microbatch's gradients go to the host over PCIe and are
added into the accumulator there while the next microbatch computes; after the last one the host
steps AdamW (streaming the copy, the moments and the accumulator: memory-bandwidth bound) and the
new weights come back. Only what does not fit under the next microbatch's compute is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.interfaces.precision import RECIPES

#: H100 SXM's host link, PCIe Gen5 x16: 64 GB/s per direction (NVIDIA H100 datasheet, "PCIe Gen5
#: 128 GB/s" both ways); pinned copies reach about 80% of it
PCIE_BYTES_PER_S = 0.8 * 64e9
#: host memory bandwidth per node: a DGX H100's 2 x Xeon 8480C, 16 channels of DDR5-4800
#: (16 x 38.4 GB/s = 614 GB/s peak); a streaming multi-threaded AdamW at STREAM-triad efficiency,
#: about 70% of peak
HOST_STREAM_BYTES_PER_S = 0.7 * 16 * 38.4e9
#: host memory of a DGX H100 node (datasheet: 2 TB)
HOST_MEMORY_BYTES = 2 * 10**12


@dataclass(frozen=True)
class StateSplit:
    """Bytes per rank on the device and in host memory."""

    device: int
    host: int


def device_bytes_per_element(precision: str) -> tuple[int, int]:
    """(weight, gradient in flight) bytes per element on the device with offload."""
    r = RECIPES[precision]
    return r.weights.itemsize, r.weights.itemsize


def host_bytes_per_element(precision: str) -> int:
    """The stepped copy + gradient accumulator + two moments, per element in host memory."""
    r = RECIPES[precision]
    stepped = r.master_bytes or r.weights.itemsize
    return stepped + r.grads.itemsize + 2 * r.moments.itemsize


def state_split(
    elements: int,
    precision: str,
    offload: bool,
    weights_over: int = 1,
    grads_over: int = 1,
    optim_over: int = 1,
    tensors: int = 0,
) -> StateSplit:
    """A rank's state for ``elements`` trained elements (its tensor-parallel slice), sharded as
    stated, with and without ``offload``; ``tensors``: AdamW's 4-byte step per tensor (with the
    optimizer, on the device without offload, on the host with it)."""
    r = RECIPES[precision]
    w_el = -(-elements // weights_over)
    g_el = -(-elements // grads_over)
    o_el = -(-elements // optim_over)
    step = 4 * tensors
    if not offload:
        opt = r.master_bytes + 2 * r.moments.itemsize
        return StateSplit(r.weights.itemsize * w_el + r.grads.itemsize * g_el + opt * o_el + step, 0)
    w, g = device_bytes_per_element(precision)
    return StateSplit(w * w_el + g * g_el, host_bytes_per_element(precision) * o_el + step)


def offload_seconds(
    elements: int,
    precision: str,
    microbatches: int,
    compute_s: float,
    ranks_per_node: int = 8,
    grads_over: int = 1,
    optim_over: int = 1,
) -> dict[str, float]:
    """Seconds a rank's offloaded optimizer adds to a step: ``exposed`` (on the critical path) and
    its parts. ``compute_s``: the group's compute per step (each microbatch's transfer hides under
    the next microbatch's compute); ``ranks_per_node``: the ranks sharing the node's host memory."""
    r = RECIPES[precision]
    g_el, o_el = -(-elements // grads_over), -(-elements // optim_over)
    grad_out = r.weights.itemsize * g_el  # one microbatch's gradients to the host
    # adding them into the accumulator: read the gradient, read + write the accumulator
    accumulate = g_el * (r.weights.itemsize + 2 * r.grads.itemsize)
    host_bw = HOST_STREAM_BYTES_PER_S / ranks_per_node
    per_mb = grad_out / PCIE_BYTES_PER_S + accumulate / host_bw
    mb_compute = compute_s / max(1, microbatches)
    hidden = (microbatches - 1) * min(per_mb, mb_compute)
    # AdamW on the host: read + write the stepped copy and both moments, read the accumulator, write
    # the working weight
    stepped = r.master_bytes or r.weights.itemsize
    adam = o_el * (2 * stepped + 4 * r.moments.itemsize + r.grads.itemsize + r.weights.itemsize) / host_bw
    weights_in = r.weights.itemsize * o_el / PCIE_BYTES_PER_S
    exposed = microbatches * per_mb - hidden + adam + weights_in
    return {
        "exposed_s": exposed,
        "gradients_s": microbatches * per_mb,
        "adam_s": adam,
        "weights_in_s": weights_in,
    }
