"""``model.<module>.path``: a local Hugging Face dir, or a Hub model id.

An id (``Qwen/Qwen2.5-VL-7B-Instruct``, optionally ``@revision``: a branch, tag
or commit) is resolved once, on the driver, before any actor starts, with
``huggingface_hub.snapshot_download``: its cache and the environment it reads
(``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``) are honoured
as ``from_pretrained`` would. The config then carries the snapshot dir (which
names the commit), so every actor, checkpoint and export reads one local dir
and the resolved config pins the revision that was trained. On a Ray cluster
the actors on other nodes read that same path: the hub cache must be on
shared storage (docs/cluster.md), as model dirs must.

A path that exists is a dir, whatever it looks like; a path that does not and
is shaped like an id (``namespace/name``) is looked up on the Hub; anything
else is a missing dir. An id that cannot be resolved (offline and not cached,
gated, not found, no such revision) is one config error naming the key, the
id and the reason.
"""

from __future__ import annotations

import re
from pathlib import Path

from disagg.config.schema import Config
from disagg.config.source import SourceMap

#: a Hub repo id: namespace/name (letters, digits, '-', '_', '.'), optionally @revision
_MODEL_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")


class ModelPathError(ValueError):
    """A ``model.<module>.path`` that is neither a dir nor a resolvable id."""


def parse_model_id(path: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``path`` is shaped like a Hub model id, else None."""
    m = _MODEL_ID.match(path.strip())
    if m is None or m.group("repo").endswith((".", "-")) or ".." in m.group("repo"):
        return None
    return m.group("repo"), m.group("rev")


def resolve_model_path(path: str) -> str:
    """The local dir ``path`` names: itself when it exists, else the Hub
    snapshot of the id it spells (downloaded into the hub cache unless
    cached or offline). Raises :class:`ModelPathError` with the reason."""
    if Path(path).exists():
        return path
    parsed = parse_model_id(path)
    if parsed is None:
        raise ModelPathError(f"{path!r} does not exist (relative paths are from {Path.cwd()})")
    repo, revision = parsed
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = (
        f"{path!r} is not a local dir (relative paths are from {Path.cwd()}) and, as a Hugging Face model id,"
    )
    try:
        return snapshot_download(repo, revision=revision)
    except GatedRepoError:
        why = (
            f"{repo} is gated: accept its terms on huggingface.co/{repo} and set HF_TOKEN "
            "(or `hf auth login`) in the driver's environment"
        )
    except RevisionNotFoundError:
        why = f"{repo} has no revision {revision!r} (a branch, tag or commit of the repo)"
    except RepositoryNotFoundError:
        why = f"{repo} is not on the Hub (or it is private: set HF_TOKEN in the driver's environment)"
    except LocalEntryNotFoundError as exc:
        where = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            why = (
                f"it is not in the hub cache ({where}) and HF_HUB_OFFLINE is set: download it where the "
                f"Hub is reachable (`hf download {repo}`{' --revision ' + revision if revision else ''}) "
                "into that cache, or give a local dir"
            )
        else:
            why = f"it is not in the hub cache ({where}) and the Hub cannot be reached ({_first_line(exc)})"
    except HFValidationError as exc:
        why = f"it is not a valid repo id ({_first_line(exc)})"
    except OSError as exc:  # disk full, permissions on the cache...
        why = f"downloading it into {constants.HF_HUB_CACHE} failed: {type(exc).__name__}: {exc}"
    raise ModelPathError(f"{what} cannot be resolved: {why}")


def resolve_model_paths(cfg: Config) -> tuple[Config, dict[str, str]]:
    """``cfg`` with every ``model.<module>.path`` a local dir, and the problems
    (module -> message) of those that could not be resolved (left as they were)."""
    model = cfg.model.model_copy()
    problems: dict[str, str] = {}
    changed = False
    for m in cfg.modules():
        spec = getattr(cfg.model, m)
        try:
            local = resolve_model_path(spec.path)
        except ModelPathError as exc:
            problems[m] = str(exc)
            continue
        if local != spec.path:
            setattr(model, m, spec.model_copy(update={"path": local}))
            changed = True
    return (cfg.model_copy(update={"model": model}) if changed else cfg), problems


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def with_local_model_paths(cfg: Config, source: SourceMap | None = None) -> Config:
    """``cfg`` with ids resolved, or one :class:`ConfigError` naming each path
    that is neither a dir nor a resolvable id (for commands that read model
    dirs before :func:`disagg.config.validate.validate`: ``parallel: auto``,
    ``disagg plan``, ``disagg bench``)."""
    from disagg.config.errors import ConfigError, Problem

    cfg, problems = resolve_model_paths(cfg)
    if problems:
        raise ConfigError(
            [
                Problem(f"model.{m}.path", msg, source.where(("model", m, "path")) if source else None)
                for m, msg in problems.items()
            ]
        )
    return cfg
