"""The single-process Hugging Face module trained on a recompute case's steps, with
the dropout masks the strategy's ranks drew (``recompute_cases.dropout_spy``).

Dropout masks are random inputs of the function being compared, not part of the
arithmetic: sharded ranks draw them from their own streams, so they cannot be the
masks HF would draw from one stream (``disagg_llm_tp/rng.py``). The reference takes
the ranks' masks as its input instead and is otherwise HF's own forward, untouched:
every dropout call of the HF module returns ``x * keep / (1 - p)`` with the keep mask
of that call, assembled from the ranks that computed it (:func:`assemble`):

* one rank per replica (``ddp``, ``zero``): that replica's masks, call for call;
* ``megatron_tp``: attention probabilities ``[batch, heads, q, k]`` are a head shard
  on each TP rank (contiguous heads in rank order), so the reference's mask is the
  ranks' masks side by side on the head axis (a column-parallel output's on its last
  axis); dropout of activations every TP rank holds whole must be the same on all of
  them (it is checked).

The reference runs the replica's microbatches as the strategy does (one HF forward
per microbatch of samples, the same padding), sums the loss over label tokens divided
by the global label count, clips the global gradient norm and steps one AdamW over
every parameter, as ``tests/hf_reference.py`` does. A mask of the wrong shape, a call
left over or one missing fails the reference itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from recompute_cases import CLIP, OPTIM, SEED, Case, _microbatches, load, set_dropout


def assemble(x: torch.Tensor, calls: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The reference's keep mask for dropout input ``x`` from the masks its ranks drew for
    that call (one per rank of the replica, rank order): a whole activation (every rank's
    mask has ``x``'s shape) must have been dropped alike on all of them; a shard (heads of
    attention probabilities, columns of a column-parallel output, a sequence shard) is
    the ranks' masks side by side on the one axis they split, in rank order."""
    if all(c.shape == x.shape for c in calls):
        if not all(torch.equal(c, calls[0]) for c in calls):
            raise AssertionError(f"a whole activation {tuple(x.shape)} was dropped differently on the ranks")
        return calls[0]
    for dim in range(x.dim()):
        parts = [tuple(c.shape[:dim]) + tuple(c.shape[dim + 1 :]) for c in calls]
        rest = tuple(x.shape[:dim]) + tuple(x.shape[dim + 1 :])
        if all(p == rest for p in parts) and sum(c.shape[dim] for c in calls) == x.shape[dim]:
            return torch.cat(calls, dim=dim)
    shapes = [tuple(c.shape) for c in calls]
    raise AssertionError(f"masks {shapes} do not make a dropout input {tuple(x.shape)}")


@contextlib.contextmanager
def replayed(per_rank: list[list[torch.Tensor]]) -> Iterator[None]:
    """Every dropout call inside takes its mask from the ranks' next call (:func:`assemble`)."""
    if len({len(m) for m in per_rank}) != 1:
        raise AssertionError(f"the ranks made {[len(m) for m in per_rank]} dropout calls")
    queue = list(zip(*per_rank))
    real = F.dropout

    def replay(x, p=0.5, training=True, inplace=False):  # noqa: ANN001, ANN202
        if not training or p == 0:
            return real(x, p, training, inplace)
        if not queue:
            raise AssertionError(f"the reference made a dropout call ({tuple(x.shape)}) the ranks did not")
        keep = assemble(x, queue.pop(0))
        return x * keep.to(x.dtype) / (1 - p)

    F.dropout = replay
    try:
        yield
    finally:
        F.dropout = real
    if queue:
        raise AssertionError(f"{len(queue)} dropout calls of the ranks the reference did not make")


def ulysses_segments(
    per_rank_masks: list[list[torch.Tensor]], per_rank_groups: list[list[dict]]
) -> list[list[torch.Tensor]]:
    """Ulysses' masks of one microbatch as the reference needs them: per block, one keep mask
    ``[heads, L, L]`` per attention segment (a window, an image) in compute order.

    A rank makes one batched call per distinct segment length (``_batched_by_length``): the
    call's mask ``[count, heads, L, L]`` is its segments of that length, in order. In a block
    whose attention spans the shards every rank holds every segment with its own contiguous
    head shard (the reference's mask: the ranks' side by side on the head axis); in a local
    block (windows) each rank holds its own windows, whole, and the shards follow each other."""
    per_rank = []
    for masks, groups in zip(per_rank_masks, per_rank_groups):
        blocks = []
        for g in groups:
            start, end = g["calls"]
            by_length: dict[int, list[int]] = {}
            for i, n in enumerate(g["segments"]):
                by_length.setdefault(n, []).append(i)
            calls = masks[start:end]
            if len(calls) != len(by_length):
                raise AssertionError(f"{len(calls)} dropout calls for {len(by_length)} segment lengths")
            segs: list[torch.Tensor | None] = [None] * len(g["segments"])
            for (length, idx), m in zip(by_length.items(), calls):
                if m.shape[0] != len(idx) or tuple(m.shape[-2:]) != (length, length):
                    raise AssertionError(f"mask {tuple(m.shape)} for {len(idx)} segments of {length}")
                for j, i in enumerate(idx):
                    segs[i] = m[j]
            blocks.append((g["spanning"], segs))
        per_rank.append(blocks)
    if len({len(b) for b in per_rank}) != 1 or sum(len(m) for m in per_rank_masks) != sum(
        g["calls"][1] - g["calls"][0] for groups in per_rank_groups for g in groups
    ):
        raise AssertionError("the ranks' dropout calls are not all in their blocks' attention")
    out = []
    for block in zip(*per_rank):
        if block[0][0]:  # spanning: every segment on every rank, a head shard each
            if len({len(segs) for _, segs in block}) != 1:
                raise AssertionError("ranks disagree on a spanning block's segments")
            out.append([torch.cat(parts, dim=0) for parts in zip(*(segs for _, segs in block))])
        else:
            out.append([m for _, segs in block for m in segs])
    return out


@contextlib.contextmanager
def replayed_by_segment(module: torch.nn.Module, per_block: list[list[torch.Tensor]]) -> Iterator[None]:
    """The reference's dropout calls inside its block ``b`` (Hugging Face's gradient-checkpointing
    layers, in order) take the next segments of ``per_block[b]``: a call over ``B`` segments
    (``[B, heads, L, L]``: one window, or a sample's images batched) takes ``B`` of them."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    # (a tower may stop before its last blocks: LLaVA's features are the second-to-last layer's;
    # ulysses never runs the last one, HF runs it and discards it)
    blocks = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]
    if len(blocks) < len(per_block):
        raise AssertionError(f"{len(per_block)} blocks of masks for a module of {len(blocks)} blocks")
    current, taken = [-1], [0] * len(per_block)
    hooks = [
        b.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))
        for i, b in enumerate(blocks)
    ]
    real = F.dropout

    def replay(x, p=0.5, training=True, inplace=False):  # noqa: ANN001, ANN202
        if not training or p == 0:
            return real(x, p, training, inplace)
        b = current[0]
        if b >= len(per_block):  # a block past the ranks' last: its output is discarded (compared)
            return real(x, p, training, inplace)
        if b < 0:
            raise AssertionError("a dropout call outside the module's blocks")
        segs = per_block[b][taken[b] : taken[b] + x.shape[0]]
        taken[b] += x.shape[0]
        keep = torch.stack(segs) if segs else None
        if keep is None or keep.shape != x.shape:
            shape = None if keep is None else tuple(keep.shape)
            raise AssertionError(f"block {b}: masks {shape} for a dropout input {tuple(x.shape)}")
        return x * keep.to(x.dtype) / (1 - p)

    F.dropout = replay
    try:
        yield
    finally:
        F.dropout = real
        for h in hooks:
            h.remove()
    if taken != [len(b) for b in per_block]:
        have = [len(b) for b in per_block]
        raise AssertionError(f"the reference took {taken} of the ranks' segment masks {have}")


def hf_run(
    case: Case, masks: list[list[list[list[torch.Tensor]]]], groups: list[list[list[list[dict]]]]
) -> dict[str, Any]:
    """``masks[rank][step][microbatch]``: the masks rank drew (mode ``none``'s), ``groups`` the
    batched attention calls they came from (ulysses; ``recompute_cases.dropout_spy``). Returns what
    each rank's record holds, per replica: ``loss[replica][step]``, ``egrads[replica]``,
    ``out[replica]`` (encoder outputs per microbatch, whole samples); and ``grads`` per
    step, ``params`` after the last."""
    family = load(case.family)(case.path, case.family_options)
    torch.manual_seed(SEED)
    module = family.build(torch.float32)
    assert set_dropout(module, case.dropout)
    module.train()
    params = dict(module.named_parameters())
    opt = torch.optim.AdamW(
        params.values(),
        lr=OPTIM.lr,
        weight_decay=OPTIM.weight_decay,
        betas=OPTIM.betas,
        eps=OPTIM.eps,
        foreach=False,
    )
    rec: dict[str, Any] = {
        "loss": [[] for _ in range(case.replicas)],
        "egrads": [[] for _ in range(case.replicas)],
        "out": [[] for _ in range(case.replicas)],
        "grads": [],
        "state_grads": [],
    }
    for k, step in enumerate(case.steps):
        total = sum(int((s["labels"][1:] != -100).sum()) for s, _ in step) if case.module == "llm" else 0
        for replica in range(case.replicas):
            ranks = range(replica * case.degree, (replica + 1) * case.degree)
            loss = 0.0
            for mb, part in enumerate(_microbatches(list(range(len(step))), replica, case.replicas)):
                mb_masks = [masks[r][k][mb] for r in ranks]
                if case.strategy.endswith("UlyssesStrategy"):
                    per_block = ulysses_segments(mb_masks, [groups[r][k][mb] for r in ranks])
                    replay = replayed_by_segment(module, per_block) if part else contextlib.nullcontext()
                else:
                    replay = replayed(mb_masks)
                with replay:
                    if case.module == "llm":
                        if not part:
                            rec["egrads"][replica].append([])
                            continue
                        leaves = [
                            {n: v.clone().requires_grad_(True) for n, v in step[i][1].items()} for i in part
                        ]
                        logits, labels = family.forward(module, [step[i][0] for i in part], leaves)
                        loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
                        (loss_sum / total).backward()
                        loss += float(loss_sum.detach())
                        rec["egrads"][replica].append([{n: v.grad for n, v in e.items()} for e in leaves])
                    else:
                        outs = [family.encode(module, step[i][0]) for i in part]
                        rec["out"][replica].append([o.detach().clone() for o in outs])
                        if outs:
                            torch.autograd.backward(outs, [step[i][1] for i in part])
            if case.module == "llm":
                rec["loss"][replica].append(loss)
        grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        rec["grads"].append(grads)
        # by state-dict name, a tied weight (lm_head = embed_tokens) under each of its names: the
        # parameter bound's gradients (tolerance.first_grads), named as the state it bounds
        rec["state_grads"].append(
            {
                n: v.grad.detach().clone()
                for n, v in module.state_dict(keep_vars=True).items()
                if isinstance(v, torch.nn.Parameter) and v.grad is not None
            }
        )
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        coef = min(1.0, CLIP / (norm + 1e-6))  # torch's clip_grad_norm_ factor
        for p in params.values():
            if p.grad is not None:
                p.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec["params"] = {n: v.detach().clone() for n, v in module.state_dict().items()}
    return rec
