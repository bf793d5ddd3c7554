"""What a strategy's cost hook (:meth:`Strategy.estimate`) receives and returns.

The planner (``disagg plan``) and ``disagg bench --predict`` ask every
registered strategy, for one module and one candidate mesh, what a rank would
hold, send and compute per optimizer step; each strategy answers with its own
formulas (its package's ``cost.py``). What they share lives here and in
:mod:`disagg.kit.cost.rules` (ring / all-to-all byte formulas, the
state-bytes rule per precision, activation and FLOP counts of a tower or
decoder held whole, recomputation) and :mod:`disagg.interfaces.shapes` (the
module shapes families describe).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.interfaces.compute import Compute
from disagg.interfaces.lora import LoraSpec
from disagg.interfaces.precision import RECIPES, Recipe
from disagg.interfaces.shapes import DecoderShape, EncoderShape, ParamTensor, Shape, VisionShape

#: bytes per activation element of a compute dtype
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: bytes per gradient element under ``fp32`` and ``bf16`` (gradients reduced in fp32); a cost
#: file reads the recipe's own from :attr:`Workload.grad_bytes`
GRAD_BYTES = 4


@dataclass
class Cost:
    """Per rank (the busiest one) per optimizer step."""

    #: parameters + gradients + optimizer state
    state_bytes: int
    #: bytes autograd holds saved for backward at the peak (``inflight`` microbatches)
    activation_bytes: int
    #: bytes sent in the group's collectives, by kind (CommCounter's kinds)
    comm_bytes_by_kind: dict[str, int]
    #: bytes shipped to the other group (encoder rows forward / embedding gradients back)
    sent_bytes: int
    #: training FLOPs this rank does (ideal split)
    flops: float
    #: which of the fields above are exact for this strategy (the rest are estimates)
    exact: tuple[str, ...] = field(default_factory=tuple)
    #: collective calls per step, by kind: each pays a fixed latency whatever its
    #: size; empty = the strategy reports none
    comm_calls_by_kind: dict[str, int] = field(default_factory=dict)
    #: the rank's matmuls, attention cores and element-wise bytes by shape, per step
    #: (:mod:`disagg.kit.cost.gemms`): what the planner charges compute time by;
    #: None = only ``flops`` is known (charged at the efficiency curve's ceiling)
    compute: Compute | None = field(default=None, compare=False, repr=False)
    #: parameters a forward or backward holds unpartitioned on top of ``state_bytes``
    #: at the peak (ZeRO-3's gathered weights); 0 for strategies that keep them whole
    gathered_bytes: int = 0
    #: state kept in host memory between steps (``offload: optimizer``); ``state_bytes`` is then
    #: what stays on the device
    host_bytes: int = 0
    #: communication buffers an engine allocates at set-up and holds for the whole run, on the
    #: device beside the state (DeepSpeed ZeRO-3's gradient reduce bucket); 0 for strategies
    #: whose buckets are counted elsewhere or transient
    buffer_bytes: int = 0

    @property
    def comm_bytes(self) -> int:
        """All bytes this rank sends: what ``comm_bytes_per_rank`` reports."""
        return sum(self.comm_bytes_by_kind.values()) + self.sent_bytes

    @property
    def memory_bytes(self) -> int:
        """State + gathered parameters + saved activations + held buffers: the
        machine-independent memory per rank."""
        return self.state_bytes + self.gathered_bytes + self.activation_bytes + self.buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_bytes": self.state_bytes,
            "gathered_bytes": self.gathered_bytes,
            "activation_bytes": self.activation_bytes,
            "memory_bytes": self.memory_bytes,
            "comm_bytes": self.comm_bytes,
            "comm_bytes_by_kind": dict(self.comm_bytes_by_kind),
            "sent_bytes": self.sent_bytes,
            "flops": self.flops,
            "exact": list(self.exact),
            "comm_calls_by_kind": dict(self.comm_calls_by_kind),
            # only where something is offloaded (the recorded predictions of the rest unchanged)
            **({"host_bytes": self.host_bytes} if self.host_bytes else {}),
            **({"buffer_bytes": self.buffer_bytes} if self.buffer_bytes else {}),
        }


@dataclass(frozen=True)
class CostQuery:
    """One module on one candidate mesh, for one optimizer step."""

    #: the module's shape, as its family describes it (``EncoderShape`` / ``DecoderShape``)
    shape: Shape
    degree: int
    replicas: int
    #: tokens per sample entering the module (vision: patches per image; audio: frames)
    seq_len: int
    #: ``train.precision``, resolved: one of :data:`disagg.interfaces.precision.RECIPES`
    #: (``fp32``, ``bf16`` with fp32 masters, ``bf16-pure``): the state's bytes per element, the
    #: gradients' and the activations' (the compute dtype)
    precision: str = "bf16"
    #: samples in the global batch (default: one per replica)
    samples: int | None = None
    #: microbatches per step (``train.microbatches``)
    microbatches: int = 1
    #: microbatches whose activations a rank holds at once
    inflight: int = 1
    #: rows per sample shipped to / received from the other group, and their width
    exchanged_rows: int | None = None
    exchanged_width: int | None = None
    #: ``parallel.<module>.recompute``: ``none``, ``full`` (each block keeps only its
    #: input) or ``selective`` (the attention core); ``True`` is the old spelling of ``full``
    recompute: str | bool = "none"
    #: ``train.modules.<module>.lora`` resolved (:class:`~disagg.interfaces.lora.LoraSpec`): the
    #: base frozen, adapters trained (:mod:`disagg.kit.cost.training`); None: no LoRA
    lora: LoraSpec | None = None
    #: ``train.modules.<module>.freeze``: the frozen parts' parameter-name patterns
    frozen: tuple[str, ...] = ()
    #: ``parallel.<module>.context_parallel``: ranks of a replica splitting each sample's
    #: sequence (the mesh then has ``degree x context_parallel x replicas`` ranks)
    context_parallel: int = 1

    @property
    def encoder(self) -> bool:
        return isinstance(self.shape, EncoderShape)


@dataclass(frozen=True)
class Workload:
    """One optimizer step of one group, as the cost formulas see it (:func:`workload`)."""

    degree: int
    replicas: int
    #: tokens per sample entering the module (vision: patches; llm: sequence length)
    seq_len: int
    #: samples in the global batch
    samples: int
    #: microbatches per step (each replica gets ceil(samples / (microbatches x replicas)) per microbatch)
    microbatches: int = 1
    #: bytes per activation element (the recipe's compute dtype: 4 in fp32, 2 in bf16)
    act_bytes: int = 4
    #: rows per sample the module exchanges with the other group (vision: N / merge²; llm: vision rows)
    exchanged_rows: int = 0
    #: width of those rows
    exchanged_width: int = 0
    #: the precision recipe (:data:`disagg.interfaces.precision.RECIPES`)
    precision: str = "fp32"

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.precision]

    @property
    def state_element(self) -> int:
        """Bytes a trained parameter element holds: weight, master copy, gradient, AdamW moments."""
        return self.recipe.state_bytes_per_element(True)

    @property
    def weight_bytes(self) -> int:
        """Bytes a frozen parameter element holds (its weight only)."""
        return self.recipe.state_bytes_per_element(False)

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as accumulated and reduced."""
        return self.recipe.grads.itemsize

    @property
    def world(self) -> int:
        return self.degree * self.replicas

    @property
    def samples_per_replica(self) -> int:
        return -(-self.samples // self.replicas)

    @property
    def tokens_per_replica(self) -> int:
        return self.samples_per_replica * self.seq_len


__all__ = [
    "DTYPE_BYTES",
    "GRAD_BYTES",
    "Cost",
    "CostQuery",
    "DecoderShape",
    "EncoderShape",
    "ParamTensor",
    "Shape",
    "VisionShape",
    "Workload",
]
