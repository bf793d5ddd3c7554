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


class TooLong(Exception):
    """The sample has more tokens than ``data.max_tokens`` (drop policy)."""


class TooLongError(DataError):
    """The sample has more tokens than ``data.max_tokens`` (error policy); never skipped."""


def modality_modules(families: dict[str, Any]) -> dict[str, str]:
    """Media kind -> the module whose encoder reads it (``image`` -> ``vision``)."""
    out: dict[str, str] = {}
    for module, fam in families.items():
        if isinstance(fam, EncoderFamily):
            out[fam.modality] = module
    return out


def preprocess_record(
    rec: Record,
    families: dict[str, Any],
    tokenizer: Any,
    *,
    max_tokens: int | None = None,
    on_too_long: str = "error",
    pixel_limits: dict[str, int] | None = None,
) -> Processed:
    """Decode media, expand placeholders, tokenize with the chat template, mask labels.

    Raises :class:`DataError` (with the record's location) for bad media and
    too-long samples under ``on_too_long: error``, :class:`TooLong` under ``drop``;
    ``truncate`` cuts the tokens after the last media placeholder or raises
    :class:`TooLongError`. ``pixel_limits`` (``min_pixels``/``max_pixels``) go to
    the image encoder's ``preprocess``.
    """
    llm: LanguageFamily = families["llm"]
    kind_module = modality_modules(families)
    enc_inputs: dict[str, dict[str, torch.Tensor]] = {}
    counts: dict[str, list[int]] = {}
    for kind, paths in rec.media.items():
        module = kind_module[kind]
        items = []
        for i, p in enumerate(paths):
            try:
                items.append(load_media(kind, p))
            except Exception as exc:  # PIL/wave raise many types; the location is what matters
                name = p if isinstance(p, str) else f"#{i + 1} (embedded bytes)"
                raise DataError(
                    rec.source, f"cannot decode {kind} {name}: {type(exc).__name__}: {exc}"
                ) from exc
        limits = pixel_limits if kind == "image" and pixel_limits else {}
        try:
            enc_inputs[module] = families[module].preprocess(items, **limits)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(
                rec.source, f"{module} preprocessing failed: {type(exc).__name__}: {exc}"
            ) from exc
        counts[module] = [int(n) for n in families[module].num_tokens(enc_inputs[module])]
        if len(counts[module]) != len(items):
            raise RuntimeError(
                f"family {families[module].name!r}.num_tokens returned {len(counts[module])} counts "
                f"for {len(items)} {kind} items"
            )

    messages = _expand(rec.messages, counts, kind_module, llm)
    ids, labels = tokenize_conversation(messages, tokenizer, rec.source)

    num_media: dict[str, int] = {}
    for module, ns in counts.items():
        found = int((ids == llm.placeholder_token_id(module)).sum())
        if found != sum(ns):
            raise DataError(
                rec.source,
                f"expected {sum(ns)} {module} placeholder tokens after tokenization, found {found} "
                "(does the text contain the placeholder token literally?)",
            )
        num_media[module] = found
    truncated = False
    if max_tokens is not None and len(ids) > max_tokens:
        if on_too_long == "truncate":
            ids, labels = _truncate(ids, labels, max_tokens, num_media, llm, rec.source)
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
    return Processed({"llm": llm_inputs, **enc_inputs}, len(ids), n_labels, num_media, truncated, digests)


def _truncate(
    ids: torch.Tensor,
    labels: torch.Tensor,
    max_tokens: int,
    num_media: dict[str, int],
    llm: LanguageFamily,
    source: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``max_tokens`` tokens, if every media placeholder token is among them: an
    image cut in half, or dropped from the text but not from the encoder's inputs, would
    no longer match its embeddings."""
    for module in num_media:
        where = torch.nonzero(ids == llm.placeholder_token_id(module)).flatten()
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
    kind_module: dict[str, str],
    llm: LanguageFamily,
) -> list[dict[str, str]]:
    """Replace each ``<image>``/``<audio>`` marker, in order, by the family's placeholder text."""
    next_item = {m: 0 for m in counts}

    def repl(match: re.Match[str]) -> str:
        module = kind_module[_KIND[match.group(0)]]
        n = counts[module][next_item[module]]
        next_item[module] += 1
        return llm.placeholder_text(module, n)

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
