"""A strategy's :class:`~disagg.interfaces.cost.Cost` from its parts: the query's defaults
filled (:func:`workload`), the tokens a rank holds (:func:`held_tokens`), and the parts
summed (:func:`assemble`)."""

from __future__ import annotations

from disagg.interfaces.compute import Compute
from disagg.interfaces.cost import Cost, CostQuery, Workload
from disagg.interfaces.precision import RECIPES
from disagg.interfaces.shapes import EncoderShape


def workload(query: CostQuery) -> Workload:
    """``query`` with its defaults filled: one sample per replica; an encoder ships
    ``seq_len / unit`` rows of ``out_hidden``, a decoder receives none."""
    if query.precision not in RECIPES:
        raise ValueError(
            f"unknown precision {query.precision!r} (train.precision, resolved); "
            f"allowed: {', '.join(RECIPES)}"
        )
    shape = query.shape
    rows, width = query.exchanged_rows, query.exchanged_width
    if rows is None:
        rows = query.seq_len // shape.unit if isinstance(shape, EncoderShape) else 0
    if width is None:
        width = shape.out_hidden if isinstance(shape, EncoderShape) else shape.hidden
    return Workload(
        degree=query.degree,
        replicas=query.replicas,
        seq_len=query.seq_len,
        samples=query.replicas if query.samples is None else query.samples,
        microbatches=query.microbatches,
        act_bytes=RECIPES[query.precision].activation_bytes,
        precision=query.precision,
        exchanged_rows=rows,
        exchanged_width=width,
    )


def held_tokens(query: CostQuery, w: Workload) -> int:
    """Tokens whose activations a rank of a replica holds at once (before any split
    of the sequence): its samples of one microbatch, ``inflight`` microbatches."""
    per_mb = -(-w.samples // (w.microbatches * w.replicas))
    return per_mb * w.seq_len * query.inflight


def assemble(
    w: Workload,
    *,
    state_bytes: int,
    activation_bytes: int,
    comm: dict[str, int],
    calls: dict[str, int],
    flops_per_sample: float,
    share: int,
    sent_bytes: int,
    exact: tuple[str, ...] = (),
    replay: tuple[dict[str, int], dict[str, int]] = ({}, {}),
    compute: Compute | None = None,
) -> Cost:
    """A :class:`Cost` from a strategy's parts: kinds that move nothing are dropped,
    a recompute replay's bytes and calls (``replay``) added on top, FLOPs of one
    sample times the replica's samples over the ``share`` ranks that split each;
    ``compute``: one sample's work on this rank by shape (already split), times the
    replica's samples."""
    kinds = {k: v for k, v in comm.items() if v}
    for k, v in replay[0].items():
        kinds[k] = kinds.get(k, 0) + v
    counts = {k: v for k, v in calls.items() if v}
    for k, v in replay[1].items():
        counts[k] = counts.get(k, 0) + v
    return Cost(
        state_bytes=state_bytes,
        activation_bytes=activation_bytes,
        comm_bytes_by_kind=kinds,
        sent_bytes=sent_bytes,
        flops=flops_per_sample * w.samples_per_replica / share,
        exact=exact,
        comm_calls_by_kind=counts,
        compute=None if compute is None else compute.scaled(w.samples_per_replica),
    )
