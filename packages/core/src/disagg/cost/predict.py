"""``predict``: one module's cost per rank per optimizer step, from its shape alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.cost import calls, comm, flops, memory
from disagg.cost import recompute as rc
from disagg.cost.shapes import DecoderShape, Shape, VisionShape

STRATEGIES = ("ddp", "ulysses", "megatron_tp", "zero")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    #: collective calls per step, by kind (:mod:`disagg.cost.calls`): each pays a
    #: fixed latency whatever its size; empty = the strategy reports none
    comm_calls_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def comm_bytes(self) -> int:
        """All bytes this rank sends: what ``comm_bytes_per_rank`` reports."""
        return sum(self.comm_bytes_by_kind.values()) + self.sent_bytes

    @property
    def memory_bytes(self) -> int:
        """State + saved activations: the machine-independent memory per rank."""
        return self.state_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_bytes": self.state_bytes,
            "activation_bytes": self.activation_bytes,
            "memory_bytes": self.memory_bytes,
            "comm_bytes": self.comm_bytes,
            "comm_bytes_by_kind": dict(self.comm_bytes_by_kind),
            "sent_bytes": self.sent_bytes,
            "flops": self.flops,
            "exact": list(self.exact),
            "comm_calls_by_kind": dict(self.comm_calls_by_kind),
        }


def predict(
    module: Shape,
    strategy: str,
    degree: int,
    replicas: int,
    seq_len: int,
    dtype: str = "float32",
    *,
    samples: int | None = None,
    microbatches: int = 1,
    inflight: int = 1,
    options: dict[str, Any] | None = None,
    exchanged_rows: int | None = None,
    exchanged_width: int | None = None,
    recompute: str | bool = "none",
) -> Cost:
    """Cost of ``module`` under ``strategy`` on ``degree x replicas`` ranks, for a
    global batch of ``samples`` (default: one per replica) sequences of
    ``seq_len`` tokens (vision: patches per image) in ``microbatches``.

    ``exchanged_rows``/``exchanged_width``: rows per sample this module ships to
    the other group and their width (vision: ``seq_len / merge²`` rows of
    ``out_hidden``, the default; an LLM: the vision rows whose gradients it
    returns). ``options``: the strategy's keys (``stage``, ``sequence_parallel``,
    ``persistence_threshold``: DeepSpeed's ``stage3_param_persistence_threshold``).
    ``recompute``: ``parallel.<module>.recompute`` (``True``: ``full``): under
    ``full`` each layer keeps its input only
    (:func:`memory.recomputed_activation_bytes`), under ``selective`` the attention
    core's saves go; the replay's FLOPs and collectives are charged
    (:mod:`disagg.cost.recompute`).
    """
    mode = rc.mode_of(recompute)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; the cost model knows: {', '.join(STRATEGIES)}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    if strategy == "ulysses" and not isinstance(module, VisionShape):
        raise ValueError("strategy 'ulysses' shards vision encoders only")
    opts = options or {}
    sp = bool(opts.get("sequence_parallel", False))
    stage = int(opts.get("stage", 3))
    persist = int(opts.get("persistence_threshold", memory.DEEPSPEED_PERSISTENCE))
    samples = replicas if samples is None else samples
    vision = isinstance(module, VisionShape)
    if exchanged_rows is None:
        exchanged_rows = seq_len // module.unit if vision else 0
    if exchanged_width is None:
        exchanged_width = module.out_hidden if vision else module.hidden
    w = comm.Workload(
        degree=degree,
        replicas=replicas,
        seq_len=seq_len,
        samples=samples,
        microbatches=microbatches,
        act_bytes=DTYPE_BYTES[dtype],
        exchanged_rows=exchanged_rows,
        exchanged_width=exchanged_width,
    )
    tensors = module.tensors()
    numels = [t.numel for t in tensors]
    if strategy == "ulysses":
        kinds = comm.ulysses_comm(module, w)  # type: ignore[arg-type]
    elif strategy == "megatron_tp":
        kinds = (
            comm.megatron_vision_comm(module, w, sp)  # type: ignore[arg-type]
            if vision
            else comm.megatron_llm_comm(module, w, sp)  # type: ignore[arg-type]
        )
    elif strategy == "zero":
        kinds = comm.zero_comm(
            numels, stage, w, calls_per_mb=2 if vision else 1, persistence_threshold=persist
        )
    else:
        kinds = comm.replicated_comm(numels, w)
    kinds = {k: v for k, v in kinds.items() if v}

    per_mb = -(-samples // (microbatches * replicas))  # samples a replica holds in one microbatch
    tokens = per_mb * seq_len * inflight
    share = degree if strategy in ("ulysses", "megatron_tp") else 1
    if vision:
        act = memory.vision_activation_bytes(module, tokens, strategy, degree, w.act_bytes, sp)
        work = flops.vision_flops(module, seq_len)
    else:
        assert isinstance(module, DecoderShape)
        act = memory.llm_activation_bytes(module, tokens, strategy, degree, w.act_bytes, sp)
        work = flops.llm_flops(module, seq_len)
    if mode == "full":
        act = memory.recomputed_activation_bytes(module, tokens, strategy, degree, w.act_bytes, sp)
    elif mode == "selective":
        held = -(-tokens // degree) if strategy == "ulysses" else tokens
        act -= rc.selective_saving(module, held, w.act_bytes)
    work += rc.extra_flops(module, seq_len, work, mode)
    replay_bytes, replay_calls = rc.replay_comm(module, strategy, w, sp, mode)
    for k, v in replay_bytes.items():
        kinds[k] = kinds.get(k, 0) + v
    call_counts = calls.collective_calls(
        module, strategy, w, sequence_parallel=sp, stage=stage, persistence_threshold=persist
    )
    for k, v in replay_calls.items():
        call_counts[k] = call_counts.get(k, 0) + v
    exact = ["state_bytes"] if strategy != "zero" else []
    if vision and (strategy in ("ulysses", "ddp") or (strategy == "megatron_tp" and not sp)):
        exact.append("comm_bytes")
    return Cost(
        state_bytes=memory.state_bytes(tensors, strategy, degree, w.world, stage, persist),
        activation_bytes=act,
        comm_bytes_by_kind=kinds,
        sent_bytes=comm.transfer_bytes(strategy, w),
        flops=work * w.samples_per_replica / share,
        exact=tuple(exact),
        comm_calls_by_kind=call_counts,
    )
