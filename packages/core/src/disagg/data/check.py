"""``disagg data check``: every sample of a dataset through the real preprocessing, no training.

The same Ray Data stream as training, over every sample once in file order,
keeping only each sample's metadata (no tensors stay in the object store), so
every problem that would stop or be skipped in a run is found up front, with
its file and line, plus the token lengths a user sizes ``data.max_tokens`` by.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from disagg.config.schema import Config
from disagg.data.order import file_order
from disagg.data.source import build_data_source
from disagg.data.stream import SampleStream

#: problems listed in the report (all are counted)
MAX_LISTED = 200


def check_data(
    cfg: Config, families: dict[str, Any], *, split: str = "train", progress: bool = True
) -> dict[str, Any]:
    """A report: ``samples``, ``ok``, ``bad``, ``too_long``, ``problems`` (``file:line: problem``,
    first :data:`MAX_LISTED`), token and per-module media token ``min/mean/max``, and ``videos``:
    each usable row with video (first :data:`MAX_LISTED`) with its videos' sampled ``frames``
    and placeholder ``tokens``."""
    from tqdm.auto import tqdm

    # video rows are reported one by one below, not refused all at once
    src = build_data_source(cfg, families, split=split, refuse_video=False)
    # every problem is collected, none raised; too-long samples are reported whatever the policy
    # (truncate stays: what it refuses is a problem, what it cuts is counted)
    policy = "truncate" if cfg.data.on_too_long == "truncate" else "drop"
    scfg = dataclasses.replace(src.cfg, keep_inputs=False, on_error="skip", on_too_long=policy)
    stream = SampleStream(src.indexes, src.uid_base, file_order(src.sizes), scfg)
    report: dict[str, Any] = {
        "split": split,
        "files": [ix.path for ix in src.indexes],
        "formats": [f"{ix.path}: {ix.format} ({ix.how})" for ix in src.indexes],
        "samples": len(src),
        "ok": 0,
        "bad": 0,
        "too_long": 0,
        "truncated": 0,
        "problems": [],
        "videos": [],
    }
    tokens: list[int] = []
    media: dict[str, list[int]] = {}
    bar = tqdm(total=len(src), desc="data check", unit="sample", disable=not progress)
    for meta, _ in stream.entries(0, len(src), first=256):
        bar.update(1)
        status = meta["status"]
        if status == "ok":
            report["ok"] += 1
            report["truncated"] += int(bool(meta.get("truncated")))
            tokens.append(meta["num_tokens"])
            for m, n in meta["num_media_tokens"].items():
                media.setdefault(m, []).append(n)
            if meta.get("video_frames") and len(report["videos"]) < MAX_LISTED:
                report["videos"].append(
                    {"source": meta["source"], "frames": meta["video_frames"], "tokens": meta["video_tokens"]}
                )
            continue
        report["too_long" if status == "dropped" else "bad"] += 1
        if len(report["problems"]) < MAX_LISTED:
            report["problems"].append(meta["error"])
    bar.close()
    report["tokens"] = _summary(tokens)
    report["media_tokens"] = {m: _summary(v) for m, v in sorted(media.items())}
    if cfg.data.on_too_long == "error" and report["too_long"]:
        report["bad"] += report["too_long"]  # those would stop the run
    return report


def _summary(values: list[int]) -> dict[str, float]:
    if not values:
        return {"samples": 0}
    return {"samples": len(values), "min": min(values), "mean": sum(values) / len(values), "max": max(values)}


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{report['split']}: {report['samples']} samples in {', '.join(report['files'])}",
        f"ok: {report['ok']}, bad: {report['bad']}, too long (data.max_tokens): {report['too_long']}"
        + (f", truncated: {report['truncated']}" if report.get("truncated") else ""),
        *(f"format: {f}" for f in report.get("formats", [])),
    ]
    t = report["tokens"]
    if t.get("samples"):
        lines.append(f"tokens per sample: min {t['min']}, mean {t['mean']:.1f}, max {t['max']}")
    for m, s in report["media_tokens"].items():
        stats = f"min {s['min']}, mean {s['mean']:.1f}, max {s['max']}"
        lines.append(f"{m} tokens ({s['samples']} samples with {m}): {stats}")
    if report.get("videos"):
        lines.append("videos (sampled frames, tokens per video):")
        for v in report["videos"]:
            each = ", ".join(f"{f} frames -> {t} tokens" for f, t in zip(v["frames"], v["tokens"]))
            lines.append(f"  {v['source']}: {each}")
    if report["problems"]:
        lines.append("problems:")
        lines += [f"  {p}" for p in report["problems"]]
        hidden = report["bad"] + report["too_long"] - len(report["problems"])
        if hidden > 0:
            lines.append(f"  ... and {hidden} more")
    return "\n".join(lines)
