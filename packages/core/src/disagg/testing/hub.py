"""A Hugging Face hub cache written locally, in the hub's own layout, for tests.

``huggingface_hub`` resolves ``org/name@revision`` offline from
``$HF_HUB_CACHE/models--org--name/``: ``refs/<branch or tag>`` holds a commit
hash, ``snapshots/<commit>/`` the files (links into ``blobs/``, named by
content hash). :func:`populate_hub_cache` copies a local HF dir (a tiny model
from ``disagg make-tiny``, or only its ``config.json``) into that layout, so
``model.<module>.path: org/name`` is tested through the real resolution with
``HF_HUB_OFFLINE=1`` and no network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def populate_hub_cache(
    cache: str | Path,
    repo_id: str,
    src: str | Path,
    refs: tuple[str, ...] = ("main",),
    commit: str | None = None,
) -> Path:
    """Put the files of ``src`` (a dir, or one file) in ``cache`` as ``repo_id``
    at ``commit`` (default: a hash of the repo id), named by every ref in
    ``refs``; return the snapshot dir the hub resolves it to."""
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    src = Path(src)
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    for f in files:
        rel = f.name if src.is_file() else f.relative_to(src).as_posix()
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
