"""Rank function of the recomputation tests: one strategy, every recompute mode in turn.

Each spawned rank builds the strategy once per mode (same weights, same seeds)
and trains 3 steps of data shaped like ``tests/mixed_data.py`` (step 1: a large
image and a two-image sample; step 2: text only; step 3: three images of the
three sizes; uneven across two replicas), 2 microbatches per step with both
encoded before either backward (``encoders_ahead``, ``max_inflight`` 2), and
dropout > 0 everywhere the family has it. It records what each mode computed:
outputs, losses, gradients after reduction, parameters after the last step,
collective calls and saved-activation bytes (counted as the worker counts them).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disagg.interfaces import GroupContext, OptimSpec, dropout_seed
from disagg.kit.recompute import replaying
from disagg.kit.recompute.activations import saved_bytes_hooks
from disagg.kit.strategy import clip_coefficient

SEED = 3
#: eps 1e-3, as the end-to-end configs: Adam's update is then Lipschitz in the gradient, so the
#: rounding noise of a near-zero gradient element (another layout's summation order, against HF)
#: moves its parameter by ~noise/eps lr instead of flipping a full lr step (``disagg.testing.tolerance``)
OPTIM = OptimSpec(lr=1e-3, weight_decay=0.1, eps=1e-3)
CLIP = 0.05  # active in every step
#: images per sample, per step (pixels, as in tests/mixed_data.py); step 2 is text only
IMAGE_STEPS = [[[(56, 56)], [(28, 28), (56, 28)]], [], [[(56, 28)], [(56, 56)], [(28, 28)]]]
#: seconds per clip, per sample (1 s windows in the tiny audio models): three windows and a
#: two-clip sample; no audio; a sliver, one window and a clip over two
AUDIO_STEPS = [[[2.3], [0.7, 0.45]], [], [[0.03], [1.0], [1.5]]]


@dataclass
class Case:
    strategy: str  # "package.module:Class"
    family: str  # "package.module:Class"
    path: str
    module: str = "vision"
    degree: int = 1
    replicas: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    family_options: dict[str, Any] = field(default_factory=dict)
    modes: tuple[str, ...] = ("none", "full")
    dropout: float = 0.2
    #: per step: encoder inputs [(sample inputs, upstream grad)] or llm [(inputs, embeds)]
    steps: list[list[tuple[dict, Any]]] = field(default_factory=list)


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def loads(raw: bytes) -> Any:
    return torch.load(io.BytesIO(raw), weights_only=False)


def load(path: str) -> Any:
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def set_dropout(module: nn.Module, p: float) -> int:
    """Dropout ``p`` wherever the built HF module has it (``attention_dropout``
    attributes, ``nn.Dropout`` layers, Whisper's ``dropout``/``activation_dropout``)."""
    n = 0
    for m in module.modules():
        for attr in ("attention_dropout", "dropout", "activation_dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, p)
                n += 1
        if isinstance(m, nn.Dropout):
            m.p = p
            n += 1
    return n


@contextlib.contextmanager
def dropout_spy() -> Iterator[dict[str, list]]:
    """Record the keep mask (``True`` = kept) of every dropout call of a forward, in call
    order (``masks``); a recomputed block's replay draws again and is not recorded (its masks
    are the forward's, as the comparison with ``none`` shows). Where the input is zero (causal
    and padding positions) the mask is ``True``: nothing is dropped that was there. Under
    ulysses, each batched attention call over segments (``_batched_by_length``: one call per
    distinct segment length) is recorded too (``groups``: its segments, whether they span the
    shards, and which masks it drew), so a reference can tell the masks' segments apart."""
    rec: dict[str, list] = {"masks": [], "groups": []}
    masks, real = rec["masks"], F.dropout

    def spy(x, p=0.5, training=True, inplace=False):  # noqa: ANN001, ANN202
        out = real(x, p, training, inplace)
        if training and p > 0 and not replaying():
            masks.append(torch.where(x.detach() != 0, out.detach() != 0, True))
        return out

    with contextlib.ExitStack() as stack:
        try:
            from disagg_vision_sp.ulysses import attention
        except ImportError:
            attention = None
        if attention is not None:
            batched = attention._batched_by_length

            def grouped(fn, module, q, k, v, segments, kwargs):  # noqa: ANN001, ANN202
                start = len(masks)
                out = batched(fn, module, q, k, v, segments, kwargs)
                if not replaying():
                    rt = attention.current()
                    rec["groups"].append(
                        {
                            "segments": [s for s in segments if s],
                            "spanning": rt is not None and rt.segments is not None,
                            "calls": (start, len(masks)),
                        }
                    )
                return out

            attention._batched_by_length = grouped
            stack.callback(setattr, attention, "_batched_by_length", batched)
        F.dropout = spy
        stack.callback(setattr, F, "dropout", real)
        yield rec


def encoder_steps(family: Any, images: Any) -> list[list[tuple[dict, torch.Tensor]]]:
    """Encoder inputs per step and a fixed upstream gradient per sample."""
    from disagg_vision_sp.testing import random_images

    steps = []
    for k, samples in enumerate(images):
        step = []
        for i, sizes in enumerate(samples):
            x = family.preprocess(random_images(sizes, seed=10 * k + i))
            rows = sum(family.num_tokens(x))
            g = torch.Generator().manual_seed(100 * k + i)
            step.append((x, torch.randn(rows, family.hidden_size(), generator=g)))
        steps.append(step)
    return steps


def audio_steps(family: Any, seconds: Any = AUDIO_STEPS) -> list[list[tuple[dict, torch.Tensor]]]:
    """Audio encoder inputs per step (decoded clips of ragged lengths) and a fixed
    upstream gradient per sample."""
    steps = []
    for k, samples in enumerate(seconds):
        rng = torch.Generator().manual_seed(1000 + k)
        step = []
        for i, clip_seconds in enumerate(samples):
            clips = [
                {"array": (0.1 * torch.randn(int(16000 * c), generator=rng)).numpy(), "sampling_rate": 16000}
                for c in clip_seconds
            ]
            x = family.preprocess(clips)
            g = torch.Generator().manual_seed(100 * k + i)
            step.append((x, torch.randn(sum(family.num_tokens(x)), family.hidden_size(), generator=g)))
        steps.append(step)
    return steps


def llm_steps(family: Any) -> list[list[tuple[dict, dict]]]:
    """Ragged samples with 0, 2 or 4 placeholders (step 2 text only), fixed encoder rows."""
    pid = family.placeholder_token_id("vision")
    vocab, hidden = family.text_config.vocab_size, family.text_config.hidden_size
    steps = []
    for k, counts in enumerate([(4, 0, 2), (0, 0, 0, 0), (2, 4, 0)]):
        g = torch.Generator().manual_seed(k)
        step = []
        for i, n_img in enumerate(counts):
            text = torch.randint(20, vocab, (6 + 3 * i,), generator=g)
            ids = torch.cat([text[:3], torch.full((n_img,), pid), text[3:]])
            labels = ids.clone()
            labels[: 3 + n_img] = -100
            s, e = {"input_ids": ids, "labels": labels}, {}
            if n_img:
                e["vision"] = torch.randn(n_img, hidden, generator=g)
                s.update(
                    family.extra_inputs({"vision": {"image_grid_thw": torch.tensor([[1, 2, n_img * 2]])}})
                )
            step.append((s, e))
        steps.append(step)
    return steps


def _microbatches(items: list, replica: int, replicas: int) -> list[list]:
    """This replica's samples (round robin: uneven when they do not divide), in 2 microbatches."""
    mine = items[replica::replicas]
    half = -(-len(mine) // 2)
    return [mine[:half], mine[half:]]


def rank(rank: int, cases_bytes: bytes, out_dir: str, first: int = 0) -> None:
    """Cases ``first`` on in turn (all on this world), every mode of each: ``{mode: record}``
    written to ``out_dir/<case index>-<rank>.pt`` as soon as the case ends, so that a case that
    fails leaves the records of those before it (``result_path``)."""
    cases: list[Case] = loads(cases_bytes)
    for i in range(first, len(cases)):
        record = dumps({mode: _run(rank, cases[i], mode) for mode in cases[i].modes})
        path = result_path(out_dir, i, rank)
        tmp = path.with_suffix(".tmp")  # whole or absent: the parent may kill this rank at any time
        tmp.write_bytes(record)
        os.replace(tmp, path)


def result_path(out_dir: str | os.PathLike, case: int, rank: int) -> Path:
    return Path(out_dir) / f"{case}-{rank}.pt"


def _run(rank: int, case: Case, mode: str) -> dict[str, Any]:
    strategy_cls, family = load(case.strategy), load(case.family)(case.path, case.family_options)
    ctx = GroupContext(
        case.module,
        rank,
        case.degree * case.replicas,
        case.degree,
        case.replicas,
        torch.device("cpu"),
        torch.float32,
        seed=SEED,
    )
    options = strategy_cls.options_model(**case.options, recompute=mode)
    strat = strategy_cls(ctx, family, options)
    torch.manual_seed(SEED)
    module = family.build(torch.float32)
    assert set_dropout(module, case.dropout), "the family must have dropout for this test"
    strat.setup(module, OPTIM)
    strat.module.train()
    torch.manual_seed(dropout_seed(SEED, ctx.replica))  # what the worker does after set-up
    rec: dict[str, Any] = {"out": [], "loss": [], "grads": [], "calls": [], "act": [], "egrads": []}
    rec["pos"] = []  # the rows of each sample's output a shard of ``out`` holds
    rec["masks"] = []  # per step, per microbatch: the forward's dropout keep masks in call order
    rec["groups"] = []  # per step, per microbatch: ulysses' batched attention calls (dropout_spy)
    live: dict[int, int] = {}
    peak = [0]

    def counter(mb: int) -> Any:
        live.setdefault(mb, 0)

        def add(n: int) -> None:
            live[mb] += n
            peak[0] = max(peak[0], sum(live.values()))

        def transient(n: int) -> None:
            peak[0] = max(peak[0], sum(live.values()) + n)

        return saved_bytes_hooks(strat.module, add, transient)

    for step in case.steps:
        peak[0] = 0
        mbs = _microbatches(list(range(len(step))), ctx.replica, case.replicas)
        rec["masks"].append([[] for _ in mbs])
        rec["groups"].append([[] for _ in mbs])
        if case.module == "llm":
            total = sum(int((s["labels"][1:] != -100).sum()) for s, _ in step)
            loss = 0.0
            for mb, part in enumerate(mbs):
                leaves = [{k: v.clone().requires_grad_(True) for k, v in step[i][1].items()} for i in part]
                with counter(mb), dropout_spy() as spied:
                    loss += strat.loss_and_backward(mb, [step[i][0] for i in part], leaves, 1.0 / total)
                rec["masks"][-1][mb], rec["groups"][-1][mb] = spied["masks"], spied["groups"]
                live.pop(mb)
                rec["egrads"].append([{k: v.grad.clone() for k, v in e.items()} for e in leaves])
            rec["loss"].append(loss)
        else:
            shards = {}
            for mb, part in enumerate(mbs):  # both microbatches in flight
                with counter(mb), dropout_spy() as spied:
                    shards[mb] = strat.encode(mb, [step[i][0] for i in part])
                rec["masks"][-1][mb], rec["groups"][-1][mb] = spied["masks"], spied["groups"]
                rec["out"].append([s.value.detach().clone() for s in shards[mb]])
                rec["pos"].append([s.positions.clone() for s in shards[mb]])
            for mb, part in enumerate(mbs):
                grads = [step[i][1][s.positions] for i, s in zip(part, shards[mb])]
                with dropout_spy() as spied:
                    strat.backward(mb, [s.value for s in shards[mb]], grads)
                assert not spied["masks"], "a backward draws only in replays"
                live.pop(mb)
        strat.reduce_gradients()
        norm_sq = strat.grad_norm_sq()
        rec["grads"].append(strat.full_grads())
        strat.step(clip_coefficient(math.sqrt(norm_sq), CLIP))
        strat.zero_grad()
        rec["calls"].append(ctx.comm.calls())
        ctx.comm.reset()
        rec["act"].append(peak[0])
    rec["params"] = strat.full_state_dict()
    return rec
