"""``disagg export``: Hugging Face dirs from a checkpoint, plus the manifest that reassembles them.

One HF dir is written per *source* dir of the config's modules: a whole-VLM
source (vision and LLM from one Qwen2.5-VL dir) gets every module that came
from it, so ``from_pretrained`` of the model class still loads it; a model
composed of separate dirs (Qwen2.5-VL vision + Whisper audio + Qwen2 LLM) gets
one dir per source. No single HF class loads such a composition, so
``OUT_DIR/disagg_model.json`` records which dir holds which module, with its
family, role and options (a Whisper projector's width, say): everything
:func:`load_exported` needs to rebuild each module through its family's
``from_pretrained`` path. Its ``model`` entry has the shape of the config's
``model:`` section, so the export also trains further as it is.

Core stays free of model code: what goes into each dir is the families'
``export_state`` (a name mapping); this module copies files, writes JSON and
streams the tensors into HF sharded safetensors (:mod:`disagg.runtime.hf_shards`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from disagg.config.resolved import role_of
from disagg.config.schema import Config
from disagg.interfaces import EncoderFamily, Family
from disagg.plugins import Registry
from disagg.runtime.export_lora import ADAPTERS, lora_specs, merged_entries, write_adapter_dir
from disagg.runtime.hf_shards import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    Entry,
    dcp_refs,
    parse_max_shard_size,
    set_config_dtype,
    tensor_refs,
    write_sharded,
)
from disagg.runtime.plan import families_for

MANIFEST = "disagg_model.json"
FORMAT = "disagg-export/1"


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    registry: Registry,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str = "fp32",
    merge: bool = False,
) -> list[Path]:
    """Write the HF dirs and ``OUT_DIR/disagg_model.json`` for a checkpoint of
    any layout (read from its full form, no actors); return the HF dirs.
    With one source the HF dir is ``OUT_DIR`` itself, otherwise
    ``OUT_DIR/<modules joined by ->``. Weights are streamed tensor by tensor
    into HF sharded safetensors of at most ``max_shard_size`` (``5GB``,
    ``500MB``; one ``model.safetensors`` when it all fits), floating-point
    tensors in ``dtype`` (``fp32`` or ``bf16``): no process holds the model.
    A module trained with LoRA becomes a PEFT adapter dir over the HF dir, or
    with ``merge`` merged weights in it (:mod:`disagg.runtime.export_lora`)."""
    from disagg.runtime.checkpoint import verify_checkpoint

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    parse_max_shard_size(max_shard_size)  # a bad size fails before anything is written
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    verify_checkpoint(checkpoint)
    meta = json.loads((checkpoint / "meta.json").read_text())
    cfg = Config.model_validate(meta["config"])
    families = families_for(cfg, registry)
    lora = lora_specs(cfg, families)
    by_source: dict[Path, list[str]] = {}
    for m, fam in families.items():
        by_source.setdefault(fam.path.resolve(), []).append(m)
    written, where = [], {}
    adapters: dict[str, Path] = {}
    for source, modules in by_source.items():
        dest = out_dir if len(by_source) == 1 else out_dir / "-".join(modules)
        _copy_non_weights(source, dest)
        # the source dir's own tensors first (a whole-VLM dir's parts no module trained stay as they were)
        entries: dict[str, Entry] = dict(tensor_refs(sorted(source.glob("*.safetensors"))))
        for m in modules:
            full = checkpoint / m / "full.safetensors"
            if m not in lora:
                entries.update(_module_entries(families[m], full))
            elif merge:
                entries.update(merged_entries(families[m], full, lora[m], entries))
            # unmerged: the source's base weights stay; the adapters go to their own dir below
            where[m] = dest
        write_sharded(entries, dest, DTYPES[dtype], max_shard_size)
        set_config_dtype(dest, DTYPES[dtype])
        written.append(dest)
        for m in modules:
            if m in lora and not merge:
                adapters[m] = write_adapter_dir(
                    families[m], checkpoint / m / "full.safetensors", lora[m], out_dir / ADAPTERS / m, dest
                )
    manifest = {
        "format": FORMAT,
        "step": int(meta["step"]),
        "checkpoint": str(checkpoint.resolve()),
        "dtype": dtype,
        "modules": {m: _entry(m, fam, where[m], out_dir) for m, fam in families.items()},
    }
    for m in lora:
        # unmerged: the module's HF dir holds its base; PEFT's adapter dir holds what trained
        entry = manifest["modules"][m]
        entry["lora"] = "merged" if merge else adapters[m].relative_to(out_dir).as_posix()
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _readable_modes(out_dir)
    return written


def _readable_modes(out_dir: Path) -> None:
    """Every file the umask allows others to read (0644 under the usual 022): safetensors
    writes its files 0600 and ``copy2`` keeps a source's mode, but an export is meant to be
    shared (a serving user, a Hub upload, a colleague's ``from_pretrained``)."""
    umask = os.umask(0)
    os.umask(umask)
    mode = 0o666 & ~umask
    for f in out_dir.rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(mode)


def _module_entries(family: Family, full: Path) -> dict[str, Entry]:
    """A module's checkpoint tensors under the names of its source dir's files.

    ``export_state`` is the family's mapping; it is called on storage-less
    stand-ins, so for a family that only renames (every family today) each
    output is one of the stand-ins and names a tensor still on disk. A family
    whose export computes new tensors gets its module's state read for real
    (that module is then held once, the rest still streams)."""
    # the full form's file, or a sharded checkpoint's pieces beside where it would be
    # (each tensor assembled when its shard is written)
    sharded = (full.parent / "dcp" / ".metadata").is_file()
    refs: dict[str, Any] = dcp_refs(full.parent / "dcp") if sharded else tensor_refs([full])
    stand_ins = {k: r.meta() for k, r in refs.items()}
    back = {id(t): k for k, t in stand_ins.items()}
    try:
        mapped = family.export_state(stand_ins)
    except Exception:  # e.g. a family that reads values: fall back to the real state below
        mapped = None
    if mapped is not None and all(id(t) in back for t in mapped.values()):
        return {name: refs[back[id(t)]] for name, t in mapped.items()}
    whole = {k: r.read() for k, r in refs.items()} if sharded else load_file(str(full))
    return dict(family.export_state(whole))


def _entry(module: str, fam: Family, dest: Path, out_dir: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "family": fam.name,
        "role": fam.role,
        # relative, so the export can be moved or copied as one dir
        "path": dest.relative_to(out_dir).as_posix() or ".",
        "options": fam.options,
        "source": str(fam.path),
    }
    if isinstance(fam, EncoderFamily):
        entry["modality"] = fam.modality
    return entry


def read_manifest(export_dir: str | Path) -> dict[str, Any]:
    """The manifest of an export, with a clear error for anything else."""
    path = Path(export_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {export_dir} is not a `disagg export` dir")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    for m, e in manifest["modules"].items():
        if e["role"] != role_of(m):
            raise ValueError(f"{path}: modules.{m}.role is {e['role']!r}; module {m!r} is a {role_of(m)}")
    return manifest


def model_section(export_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The config's ``model:`` section for the exported modules (absolute paths)."""
    root = Path(export_dir).resolve()
    return {
        m: {"family": e["family"], "path": str(root / e["path"]), "options": dict(e["options"])}
        for m, e in read_manifest(root)["modules"].items()
    }


def load_exported(export_dir: str | Path, registry: Registry) -> dict[str, Family]:
    """Family instances for every exported module; ``build()`` on each loads
    the trained weights with the family's ``from_pretrained`` path."""
    from disagg.interfaces.family import link_to_llm

    families = {
        m: registry.family(role_of(m), s["family"])(s["path"], s["options"])
        for m, s in model_section(export_dir).items()
    }
    link_to_llm(families)
    return families


def _copy_non_weights(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if (
            f.is_file()
            and not f.name.endswith((".safetensors", ".bin"))
            and f.name not in ("model.safetensors.index.json", MANIFEST)
        ):
            shutil.copy2(f, dest / f.name)
