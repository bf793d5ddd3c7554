"""The ``data`` section's files and batch, and what ``train``/``checkpoint`` ask of it:
``train.epochs`` (counted into ``train.steps`` from the samples), ``train.eval_every`` and
``checkpoint.keep_best`` (a held-out set). The checks the families make of it are
:mod:`disagg.data.checks`'."""

from __future__ import annotations

import math
from pathlib import Path

from disagg.config.problems import Problems
from disagg.config.resolved import ResolvedConfig
from disagg.config.schema import Config


def check_data(cfg: Config, resolved: ResolvedConfig, out: Problems) -> None:
    d = cfg.data
    if d is None:
        return
    from disagg.data.checks import data_problems

    out.add_all(data_problems(cfg, {m: r.family for m, r in resolved.modules.items()}))
    if d.dataset_dir is not None:
        check_dataset_dir(cfg, out)
        return _check_batch(cfg, out)
    entries = (
        [(("data", "train"), d.train, None)]
        if isinstance(d.train, str)
        else [(("data", "train", i, "path"), e.path, e.media_root) for i, e in enumerate(d.train)]
    )
    if d.eval:
        entries.append((("data", "eval"), d.eval, None))
    for path, file, media_root in entries:
        # a Hugging Face dataset (data.format: hf) is a dir
        if not (Path(file).is_file() or Path(file).is_dir()):
            out.add(path, f"data file {file!r} does not exist (relative paths are from {Path.cwd()})")
        if media_root and not Path(media_root).is_dir():
            out.add((*path[:-1], "media_root"), f"{media_root!r} is not a directory")
    if not Path(d.media_root).is_dir():
        out.add(("data", "media_root"), f"{d.media_root!r} is not a directory")
    _check_batch(cfg, out)


def _check_batch(cfg: Config, out: Problems) -> None:
    d = cfg.data
    if d.batch_size < cfg.train.microbatches:
        out.add(
            ("data", "batch_size"),
            f"{d.batch_size} is smaller than train.microbatches = {cfg.train.microbatches}; "
            f"every microbatch needs a sample: use batch_size >= {cfg.train.microbatches}",
        )


def check_dataset_dir(cfg: Config, out: Problems) -> None:
    """``data.dataset_dir``: each named dataset's ``dataset_info.json`` entry and its file, and how
    its first rows read (a row the entry cannot read is named by file and row)."""
    from disagg.data.dataset_info import INFO_FILE, entry_mismatch, resolve
    from disagg.data.errors import DataError
    from disagg.data.files import DatasetFile, index_file, is_plain_file

    d = cfg.data
    if not (Path(d.dataset_dir) / INFO_FILE).is_file():
        out.add(
            ("data", "dataset_dir"), f"{d.dataset_dir!r} has no {INFO_FILE} (LLaMA-Factory's dataset list)"
        )
        return
    if "media_root" in d.model_fields_set and not Path(d.media_root).is_dir():
        out.add(("data", "media_root"), f"{d.media_root!r} is not a directory")
    if d.format != "auto":
        out.add(
            ("data", "format"),
            f"{d.format!r} is set with data.dataset_dir, whose {INFO_FILE} says each "
            "dataset's formatting; remove data.format",
        )
    named = (
        [(("data", "train"), d.train)]
        if isinstance(d.train, str)
        else [(("data", "train", i, "path"), e.path) for i, e in enumerate(d.train)]
    )
    if d.eval:
        named.append((("data", "eval"), d.eval))
    for i, e in enumerate([] if isinstance(d.train, str) else d.train):
        if e.format is not None:
            out.add(
                ("data", "train", i, "format"),
                f"{e.format!r} is set, but {INFO_FILE} says the dataset's formatting; remove it",
            )
    for path, name in named:
        if is_plain_file(d.dataset_dir, name):
            continue  # a dataset file beside the named ones: read like data.train's files
        try:
            file, columns = resolve(d.dataset_dir, name)
            ix = index_file(DatasetFile(file, d.dataset_dir, columns.formatting, columns=columns))
            # the first row against the entry: a key the entry names that the file's rows lack
            why = next((entry_mismatch(loc, row, columns) for loc, row in ix.first_rows(1)), None)
            if why:
                out.add(path, why)
        except DataError as exc:
            out.add(path, str(exc))


def check_evaluation(cfg: Config, out: Problems) -> None:
    """``train.epochs`` (instead of steps), ``train.eval_every`` and
    ``checkpoint.keep_best`` against what the data section provides. A
    config without ``data`` runs only with a data source given in code:
    the run checks it then."""
    t, d = cfg.train, cfg.data
    if t.epochs is not None:
        if "steps" in t.model_fields_set:
            out.add(
                ("train", "epochs"),
                f"{t.epochs:g} is set together with train.steps = {t.steps}; set exactly one of them",
            )
        if d is None:
            out.add(("train", "epochs"), "needs data.train to count the samples of an epoch")
    if d is None:
        return
    if t.eval_every and not d.eval:
        out.add(("train", "eval_every"), f"{t.eval_every} needs data.eval (a held-out dataset file)")
    if cfg.checkpoint.keep_best and not d.eval:
        out.add(
            ("checkpoint", "keep_best"),
            f"{cfg.checkpoint.keep_best!r} needs data.eval (a held-out dataset file)",
        )


def steps_from_epochs(cfg: Config, out: Problems) -> Config:
    """:func:`with_epoch_steps`, or ``cfg`` as it is with the problem added when the samples
    cannot be counted."""
    try:
        return with_epoch_steps(cfg)
    except Exception as exc:  # e.g. a row of unknown format: named with its file and line
        out.add(("train", "epochs"), f"cannot count the samples of data.train: {exc}")
        return cfg


def with_epoch_steps(cfg: Config) -> Config:
    """``cfg`` with ``train.steps`` derived from ``train.epochs``:
    ceil(epochs x samples in data.train / data.batch_size); ``epochs`` is
    then cleared, so the resolved config runs as written."""
    from disagg.data.files import dataset_files, index_file

    assert cfg.data is not None and cfg.train.epochs is not None
    samples = sum(index_file(f).size for f in dataset_files(cfg, "train"))
    steps = max(1, math.ceil(cfg.train.epochs * samples / cfg.data.batch_size))
    train = cfg.train.model_copy(update={"steps": steps, "epochs": None})
    return cfg.model_copy(update={"train": train})
