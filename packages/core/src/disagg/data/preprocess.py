"""One record -> the per-module input dicts the groups consume.

Runs in data workers. Everything model-specific comes from the families: the
encoder's ``preprocess``/``num_tokens`` say how many placeholder tokens each
media item becomes, the LLM family's tokenizer, chat template and
``placeholder_text`` say how they are spelled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg.data.digest import inputs_digest
from disagg.data.errors import DataError
from disagg.data.media import load_media
from disagg.data.records import PLACEHOLDERS, Record
from disagg.interfaces import EncoderFamily, LanguageFamily

IGNORE = -100
_MARKER = re.compile("|".join(re.escape(m) for m in PLACEHOLDERS.values()))
_KIND = {m: k for k, m in PLACEHOLDERS.items()}


@dataclass
class Processed:
    """A preprocessed sample: ``inputs[module]`` dicts plus the sizes the driver plans with."""

    inputs: dict[str, dict[str, torch.Tensor]]
    num_tokens: int
    num_label_tokens: int
    num_media_tokens: dict[str, int] = field(default_factory=dict)
    #: cut to ``data.max_tokens`` (``on_too_long: truncate``)
    truncated: bool = False
    #: per encoder module, a digest of its inputs' bytes (the media as preprocessed): the
    #: content part of a feature cache key (:mod:`disagg.data.digest`)
    media_digest: dict[str, str] = field(default_factory=dict)
    #: sampled frames and placeholder tokens of each video, in order (``disagg data check``)
    video_frames: list[int] = field(default_factory=list)
    video_tokens: list[int] = field(default_factory=list)


class TooLong(Exception):
    """The sample has more tokens than ``data.max_tokens`` (drop policy)."""


class TooLongError(DataError):
    """The sample has more tokens than ``data.max_tokens`` (error policy); never skipped."""


def modality_modules(families: dict[str, Any]) -> dict[str, str]:
    """Media kind -> the module whose encoder reads it (``image`` -> ``vision``); ``video`` goes
    to an encoder that ``reads_video`` when the LLM family has a video token to place it at."""
    out: dict[str, str] = {}
    llm = families.get("llm")
    for module, fam in families.items():
        if isinstance(fam, EncoderFamily):
            out[fam.modality] = module
            if fam.reads_video and isinstance(llm, LanguageFamily) and llm.video_token_id() is not None:
                out["video"] = module
    return out


def _token_id(llm: LanguageFamily, kind: str, module: str) -> int:
    """The token a media kind's rows are placed at: video has its own."""
    if kind == "video":
        tid = llm.video_token_id()
        assert tid is not None  # modality_modules routes video only to a family with one
        return tid
    return llm.placeholder_token_id(module)


def _load(kind: str, path: str | bytes, family: Any, video: dict[str, Any] | None) -> Any:
    if kind == "video":
        from disagg.data.video import load_video

        v = video or {"fps": 2.0, "max_frames": 768}
        return load_video(
            path,
            fps=v["fps"],
            max_frames=v["max_frames"],
            factor=family.video_frame_factor(),
            sampling=family.video_sampling,
        )
    return load_media(kind, path)


def preprocess_record(
    rec: Record,
    families: dict[str, Any],
    tokenizer: Any,
    *,
    max_tokens: int | None = None,
    on_too_long: str = "error",
    pixel_limits: dict[str, int] | None = None,
    video: dict[str, Any] | None = None,
) -> Processed:
    """Decode media, expand placeholders, tokenize with the chat template, mask labels.

    Raises :class:`DataError` (with the record's location) for bad media and
    too-long samples under ``on_too_long: error``, :class:`TooLong` under ``drop``;
    ``truncate`` cuts the tokens after the last media placeholder or raises
    :class:`TooLongError`. ``pixel_limits`` (``min_pixels``/``max_pixels``) go to
    the image encoder's ``preprocess``; ``video`` (``fps``, ``max_frames`` and the
    per-frame ``min_pixels``/``max_pixels``) to video sampling and ``preprocess_video``.
    A sample's image rows come before its video rows in the encoder's output.
    """
    llm: LanguageFamily = families["llm"]
    kind_module = modality_modules(families)
    enc_inputs: dict[str, dict[str, torch.Tensor]] = {}
    #: per media kind (not module: a vision module reads images and videos), tokens per item
    counts: dict[str, list[int]] = {}
    frames: list[int] = []
    #: per video, the seconds of each sampled frame (transformers' ``VideoMetadata.timestamps``)
    times: list[list[float]] = []
    # images before videos: the encoder's rows of a sample come in this order
    for kind in sorted(rec.media, key=lambda k: k == "video"):
        paths = rec.media[kind]
        module = kind_module[kind]
        items = []
        for i, p in enumerate(paths):
            try:
                items.append(_load(kind, p, families[module], video))
            except ImportError:
                raise  # PyAV missing: the install line, not a bad sample
            except Exception as exc:  # PIL/wave/PyAV raise many types; the location is what matters
                name = p if isinstance(p, str) else f"#{i + 1} (embedded bytes)"
                raise DataError(
                    rec.source, f"cannot decode {kind} {name}: {type(exc).__name__}: {exc}"
                ) from exc
        try:
            if kind == "video":
                limits = {k: v for k, v in (video or {}).items() if k.endswith("_pixels")}
                got = families[module].preprocess_video(items, **limits)
            else:
                limits = pixel_limits if kind == "image" and pixel_limits else {}
                got = families[module].preprocess(items, **limits)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(
                rec.source, f"{module} preprocessing of {kind} failed: {type(exc).__name__}: {exc}"
            ) from exc
        counts[kind] = [int(n) for n in families[module].num_tokens(got)]
        if len(counts[kind]) != len(items):
            raise RuntimeError(
                f"family {families[module].name!r}.num_tokens returned {len(counts[kind])} counts "
                f"for {len(items)} {kind} items"
            )
        if kind == "video":
            frames = [len(v.indices) for v in items]
            times = [[i / v.fps for i in v.indices] for v in items]
        enc_inputs[module] = {**enc_inputs.get(module, {}), **got}

    if "video" in counts and "image" in counts:
        _check_shared_token_order(rec, llm, kind_module)
    messages = _expand(rec.messages, counts, llm, kind_module, times)
    ids, labels = tokenize_conversation(messages, tokenizer, rec.source)

    num_media: dict[str, int] = {}
    # per placeholder token (a family may place images and video frames at the same one)
    by_token: dict[int, list[str]] = {}
    for kind in counts:
        by_token.setdefault(_token_id(llm, kind, kind_module[kind]), []).append(kind)
    for tid, kinds in by_token.items():
        want = sum(sum(counts[k]) for k in kinds)
        found = int((ids == tid).sum())
        if found != want:
            raise DataError(
                rec.source,
                f"expected {want} {' and '.join(kinds)} placeholder tokens after tokenization, found "
                f"{found} (does the text contain the placeholder token literally?)",
            )
        module = kind_module[kinds[0]]
        num_media[module] = num_media.get(module, 0) + found
    truncated = False
    if max_tokens is not None and len(ids) > max_tokens:
        if on_too_long == "truncate":
            tids = {_token_id(llm, kind, kind_module[kind]): kind_module[kind] for kind in counts}
            ids, labels = _truncate(ids, labels, max_tokens, tids, rec.source)
            truncated = True
        elif on_too_long == "drop":
            raise TooLong(f"{rec.source}: {len(ids)} tokens > data.max_tokens={max_tokens}")
        else:
            raise TooLongError(
                rec.source,
                f"{len(ids)} tokens exceed data.max_tokens={max_tokens}; raise data.max_tokens or set "
                "data.on_too_long: drop or truncate (allowed: error, drop, truncate)",
            )
    # the first token is never predicted (labels shift by one): count what the loss counts
    n_labels = int((labels[1:] != IGNORE).sum())
    if n_labels == 0:
        if truncated:
            raise TooLongError(
                rec.source,
                f"truncated to data.max_tokens={max_tokens}, no assistant token is left to learn; "
                "raise data.max_tokens or set data.on_too_long: drop",
            )
        raise DataError(rec.source, "no label tokens: the assistant turns are empty")

    llm_inputs = {"input_ids": ids, "labels": labels, **llm.extra_inputs(enc_inputs)}
    digests = {m: inputs_digest(x) for m, x in enc_inputs.items()}
    return Processed(
        {"llm": llm_inputs, **enc_inputs},
        len(ids),
        n_labels,
        num_media,
        truncated,
        digests,
        video_frames=frames,
        video_tokens=counts.get("video", []),
    )


def _check_shared_token_order(rec: Record, llm: LanguageFamily, kind_module: dict[str, str]) -> None:
    """Where video rows go to the image placeholder token (InternVL: frames are tiles), the
    encoder's rows (images, then videos) meet the tokens in text order only if every
    ``<image>`` marker comes before every ``<video>`` one."""
    if _token_id(llm, "video", kind_module["video"]) != _token_id(llm, "image", kind_module["image"]):
        return
    order = [_KIND[m.group(0)] for _, text in rec.messages for m in _MARKER.finditer(text)]
    order = [k for k in order if k in ("image", "video")]
    if "video" in order and "image" in order[order.index("video") :]:
        raise DataError(
            rec.source,
            f"an <image> after a <video>: family {llm.name!r} places a sample's images, then its "
            "videos' frames, at the same image tokens; put the row's <image> markers first",
        )


def _truncate(
    ids: torch.Tensor,
    labels: torch.Tensor,
    max_tokens: int,
    token_ids: dict[int, str],
    source: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``max_tokens`` tokens, if every media placeholder token is among them: an
    image cut in half, or dropped from the text but not from the encoder's inputs, would
    no longer match its embeddings."""
    for tid, module in token_ids.items():
        where = torch.nonzero(ids == tid).flatten()
        if where.numel() and int(where[-1]) >= max_tokens:
            raise TooLongError(
                source,
                f"{len(ids)} tokens exceed data.max_tokens={max_tokens} and truncating would cut "
                f"{module} placeholder tokens (the last is token {int(where[-1]) + 1}); raise "
                "data.max_tokens, lower data.max_pixels, or set data.on_too_long: drop",
            )
    return ids[:max_tokens].clone(), labels[:max_tokens].clone()


def _expand(
    messages: list[tuple[str, str]],
    counts: dict[str, list[int]],
    llm: LanguageFamily,
    kind_module: dict[str, str],
    times: list[list[float]] | None = None,
) -> list[dict[str, str]]:
    """Replace each ``<image>``/``<audio>``/``<video>`` marker, in order, by the family's
    placeholder text (a video's also gets its frames' seconds: Qwen3-VL writes them)."""
    next_item = {k: 0 for k in counts}

    def repl(match: re.Match[str]) -> str:
        kind = _KIND[match.group(0)]
        n = counts[kind][next_item[kind]]
        next_item[kind] += 1
        if kind == "video":
            i = next_item[kind] - 1
            return llm.video_placeholder_text(n, times[i] if times and i < len(times) else None)
        return llm.placeholder_text(kind_module[kind], n)

    return [{"role": role, "content": _MARKER.sub(repl, text)} for role, text in messages]


def tokenize_conversation(
    messages: list[dict[str, str]], tokenizer: Any, source: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` of the chat-templated conversation and ``labels`` that are
    -100 everywhere except on assistant turns.

    An assistant turn's span is what rendering it adds after the generation
    prompt of the conversation so far (its text and the end-of-turn token that
    teaches the model to stop), found by rendering prefixes. This needs a
    template where earlier turns render the same whatever follows them, which
    holds for ChatML (Qwen), Llama and most others; a template that rewrites
    history is reported instead of silently mislabelled.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], True) if i else ""
        upto = render(messages[: i + 1], False)
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise DataError(
                source,
                "the tokenizer's chat template renders earlier turns differently when later ones "
                "follow, so assistant turns cannot be located for the labels",
            )
        spans.append((len(prompt), len(upto)))

    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
    labels = torch.full_like(ids, IGNORE)
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        if end > start and any(a <= start < b for a, b in spans):
            labels[t] = ids[t]
    return ids, labels
