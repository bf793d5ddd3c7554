"""``parallel.<module>.offload: activations | all``: what ``recompute: full`` keeps per block, in
host memory, and the seconds its copies take (:mod:`disagg.kit.recompute.offload` does it).

Under ``full`` a rank holds each block's input for its held tokens
(:func:`disagg.kit.cost.rules.recomputed_activation_bytes`: ``blocks x held x H x bytes``) plus
one block's saves while that block is replayed. With the inputs offloaded the device keeps one
block's input (the one brought back for the replay in progress) and that block's saves; the host
keeps every block's input. From a strategy's own counts, whatever its split of the tokens:

- ``full`` = its count of the module under ``recompute: full``;
- ``one`` = its count of one block (:func:`~disagg.kit.cost.rules.one_block`) under ``full``;
- moved off the device: ``full - one`` (the inputs of all blocks but one); in host memory:
  ``(full - one) x blocks / (blocks - 1)`` (every block's input).

Time: each microbatch's inputs go to the host at the forward and come back at the replay, over
the GPU's host link. :data:`ACTIVATION_LINK_BYTES_PER_S` is **assumed** (not measured here):
about 25 GB/s per GPU each way, a PCIe Gen5 x16 uplink (64 GB/s) shared by the two GPUs behind one
PCIe switch on a DGX/HGX H100 board, at 80% of peak for pinned copies. torch's ``save_on_cpu``
copies on the compute stream, so the copies do not overlap the blocks' compute: the model
charges every byte on the critical path (``exposed_s``), an upper bound where a side-stream
prefetch would hide part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.interfaces.shapes import Shape
from disagg.kit.cost.rules import blocks_of

#: per-GPU host link for the saved inputs, each way (assumed; see the module's docstring)
ACTIVATION_LINK_BYTES_PER_S = 0.8 * 64e9 / 2


@dataclass(frozen=True)
class ActivationSplit:
    """Saved-activation bytes of one rank (one microbatch in flight) with the inputs offloaded."""

    #: what stays on the device: the strategy's count minus :attr:`moved`
    device: int
    #: every block's input, in host memory
    host: int
    #: what left the device (all blocks' inputs but the one being replayed)
    moved: int


def offloaded_input_bytes(shape: Shape, held: int, act_bytes: int) -> int:
    """Every block's kept input for ``held`` tokens: what the offload hooks put in host memory per
    microbatch (the rule :func:`disagg.kit.cost.rules.recomputed_activation_bytes` counts)."""
    return blocks_of(shape) * held * shape.hidden * act_bytes


def split(shape: Shape, full: int, one: int) -> ActivationSplit:
    """``full``: the strategy's saved bytes under ``recompute: full``; ``one``: its count of one
    block under ``full`` (the module's docstring)."""
    blocks = blocks_of(shape)
    moved = max(0, full - one)
    host = moved * blocks // (blocks - 1) if blocks > 1 else 0
    if blocks <= 1:  # one block: its input is the one brought back; nothing stays away longer
        moved = 0
    return ActivationSplit(full - moved, host, moved)


def offload_seconds(host_bytes: int, microbatches: int) -> dict[str, float]:
    """Seconds a rank's activation offload adds to a step: every microbatch's inputs out at the
    forward and back at the replay, on the compute stream (``exposed_s``: all of it)."""
    traffic = 2 * host_bytes * max(1, microbatches)
    seconds = traffic / ACTIVATION_LINK_BYTES_PER_S
    return {"exposed_s": seconds, "traffic_bytes": float(traffic)}
