"""What a GPU's allocator holds at a step's peak, term by term, beside what the strategies count.

:attr:`~disagg.interfaces.cost.Cost.memory_bytes` is the tensors a strategy keeps (state,
gathered parameters, saved activations). A real device holds more; each term below is named so
a table can say which one stops a layout, and each constant says where its figure comes from.
They are figures for one H100 80 GB with CUDA 12 and PyTorch 2.x, not measured here at size:

- ``cuda_context``: :data:`CUDA_CONTEXT_BYTES` per process on the device (two when two groups
  are collocated: each Ray actor is its own process with its own context), plus
  :data:`CUBLAS_WORKSPACE_BYTES` per process.
- ``nccl_buffers``: per communicator a process uses, :data:`NCCL_CHANNELS` channels x 2 ring
  connections x :data:`NCCL_CONNECTION_BYTES`; a group that runs all-to-alls (Ulysses, or a
  context-parallel all-to-all) connects every peer pair on every channel: :data:`NCCL_ALLTOALL_BYTES`
  more, scaled by its peers over 7.
- ``transient``: the step's largest buffer that is neither state nor saved: during a recomputed
  block's backward its saves exist twice (the replayed tensors and the gradients flowing through
  them), so one block's saves per group (the strategy's own count, :func:`one_block_saves`).
- ``fragmentation``: :data:`FRAGMENTATION` of everything the caching allocator serves.
- ``buffers``: communication buffers a strategy's engine holds for the run
  (:attr:`~disagg.interfaces.cost.Cost.buffer_bytes`: DeepSpeed ZeRO-3's reduce bucket).

The peak is ``state + gathered + saved + buffers + max(transient)`` (groups on one device run one
after the other, so only one group's block is in backward at a time), ``x (1 + FRAGMENTATION)``,
plus the contexts and NCCL buffers, which live outside PyTorch's allocator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 2**20

#: CUDA driver context + PyTorch's loaded kernels per process, with lazy module loading
#: (``CUDA_MODULE_LOADING=LAZY``, PyTorch's default since 1.13 on CUDA >= 11.7). Assumed, not
#: measured here: nvidia-smi after ``torch.cuda.init()`` shows about 500-600 MiB on an H100;
#: we take the top of that range.
CUDA_CONTEXT_BYTES = 600 * MiB
#: cuBLAS workspace per process (PyTorch's default on Hopper, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``:
#: 8 x 4096 KiB), served by the caching allocator once per handle/stream
CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: NCCL channels on an 8 x H100 NVLink node (NVIDIA/nccl#1685: ``NCCL_DEBUG=INFO`` shows 32
#: channels per GPU pair on 8 x H100)
NCCL_CHANNELS = 32
#: buffers per channel and connection: NVIDIA/nccl#1685's ``NCCL_DEBUG_SUBSYS=ALLOC`` shows one
#: 10 MiB (SIMPLE 4 MiB FIFO, ``NCCL_BUFFSIZE``, + LL128 + LL) and one 2 MiB allocation each; a
#: ring uses 2 connections per channel whatever the scale (NVIDIA/nccl#986)
NCCL_CONNECTION_BYTES = 12 * MiB
#: what the first all-to-all adds on 8 x H100: NVIDIA/nccl#1685 measured 1.06 GB before it and
#: 4.34 GB after (every peer pair connected on 32 channels); for 7 peers
NCCL_ALLTOALL_BYTES = int(4.34e9 - 1.06e9)
#: the caching allocator's unusable share of what it serves (blocks rounded up to 512 B / 2 MiB,
#: large segments split but not returned). Assumed, not measured at size: 5% of the peak
FRAGMENTATION = 0.05


def nccl_bytes(communicators: int, alltoall_peers: int = 0) -> int:
    """NCCL's device buffers for ``communicators`` ring/tree communicators, plus the all-to-all
    connections of a group with ``alltoall_peers`` peers (0: none)."""
    ring = communicators * NCCL_CHANNELS * 2 * NCCL_CONNECTION_BYTES
    return ring + (NCCL_ALLTOALL_BYTES * alltoall_peers // 7 if alltoall_peers else 0)


def communicators(degree: int, context_parallel: int, replicas: int) -> int:
    """Communicators a rank of a group uses: one per parallel dimension wider than 1, and the whole
    group's (the global norm, the step's checks) when there are several dimensions."""
    dims = sum(1 for d in (degree, context_parallel, replicas) if d > 1)
    return max(1, dims) + (1 if dims > 1 else 0)


@dataclass(frozen=True)
class GroupMemory:
    """One group's rank on a device: what its strategy counts and what the allocator adds."""

    module: str
    state: int
    gathered: int
    saved: int
    #: one block's saves (the strategy's count), the backward transient
    transient: int
    communicators: int = 1
    #: all-to-all peers (Ulysses degree - 1), 0 where the group runs no all-to-all
    alltoall_peers: int = 0
    #: state kept in host memory (optimizer offload), per rank
    host: int = 0
    #: communication buffers held for the run (``Cost.buffer_bytes``: ZeRO-3's reduce bucket)
    buffers: int = 0


@dataclass(frozen=True)
class DeviceMemory:
    """A device's peak, by named term, and the host memory its ranks use."""

    terms: dict[str, int]
    #: host bytes per rank of what is offloaded (summed over the groups on the device)
    host_per_device: int = 0
    groups: tuple[GroupMemory, ...] = field(default=(), repr=False)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def largest(self, k: int = 3) -> list[tuple[str, int]]:
        return sorted(((n, v) for n, v in self.terms.items() if v), key=lambda kv: -kv[1])[:k]


def device_memory(groups: list[GroupMemory], processes: int | None = None) -> DeviceMemory:
    """The peak of one device that holds one rank of each of ``groups`` (``processes``: processes
    on it, default one per group: collocated Ray actors)."""
    procs = len(groups) if processes is None else processes
    terms: dict[str, int] = {}
    for g in groups:
        terms[f"{g.module} state"] = g.state
        terms[f"{g.module} gathered"] = g.gathered
        terms[f"{g.module} activations"] = g.saved
        if g.buffers:  # only where a strategy holds some (the other tables' terms unchanged)
            terms[f"{g.module} buffers"] = g.buffers
    transient = max((g.transient for g in groups), default=0)
    terms["transient"] = transient
    served = sum(terms.values())
    terms["fragmentation"] = int(FRAGMENTATION * served)
    terms["cuda_context"] = procs * (CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES)
    terms["nccl_buffers"] = sum(nccl_bytes(g.communicators, g.alltoall_peers) for g in groups)
    return DeviceMemory(terms, sum(g.host for g in groups), tuple(groups))
