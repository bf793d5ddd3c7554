"""Checkpoints: per-rank resumable state plus a merged copy of every module,
from which ``disagg export`` writes Hugging Face dirs without starting actors.

Layout of ``checkpoints/step-N/``: ``meta.json`` (step, resolved config),
``<module>/rank-K*`` (each strategy's own resumable state) and
``<module>/full.safetensors`` (merged weights named like ``family.build()``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from disagg.config.fingerprint import run_fingerprint
from disagg.config.schema import Config
from disagg.plugins import Registry
from disagg.runtime.orchestrator import Orchestrator
from disagg.runtime.plan import families_for


def save_checkpoint(orch: Orchestrator, cfg: Config, run_dir: Path, step: int) -> Path:
    path = Path(run_dir) / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True, exist_ok=True)
    orch.save(str(path))
    for g in orch.groups:
        full = orch.full_state_dict(g.module)
        save_file(_contiguous(full), str(path / g.module / "full.safetensors"))
    (path / "meta.json").write_text(
        json.dumps(
            {"step": step, "config": cfg.model_dump(mode="json"), "fingerprint": run_fingerprint(cfg)},
            indent=2,
        )
    )
    return path


def checkpoint_step(path: str | Path) -> int:
    return int(json.loads((Path(path) / "meta.json").read_text())["step"])


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, registry: Registry) -> list[Path]:
    """Write HF dirs for a checkpoint: one per source dir of the config's modules
    (a whole-VLM source gets every module that came from it)."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    meta = json.loads((checkpoint / "meta.json").read_text())
    cfg = Config.model_validate(meta["config"])
    families = families_for(cfg, registry)
    by_source: dict[Path, list[str]] = {}
    for m, fam in families.items():
        by_source.setdefault(fam.path.resolve(), []).append(m)
    written = []
    for source, modules in by_source.items():
        dest = out_dir if len(by_source) == 1 else out_dir / "-".join(modules)
        _copy_non_weights(source, dest)
        tensors = _load_weights(source)
        for m in modules:
            full = load_file(str(checkpoint / m / "full.safetensors"))
            tensors.update(families[m].export_state(full))
        save_file(_contiguous(tensors), str(dest / "model.safetensors"), metadata={"format": "pt"})
        written.append(dest)
    return written


def _copy_non_weights(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if (
            f.is_file()
            and not f.name.endswith((".safetensors", ".bin"))
            and f.name != "model.safetensors.index.json"
        ):
            shutil.copy2(f, dest / f.name)


def _load_weights(source: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _contiguous(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied embeddings): store independent copies
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
