"""Write the resolved config into the run dir, so a run can be reproduced."""

from __future__ import annotations

from pathlib import Path

import yaml

from disagg.config.schema import Config

RESOLVED_NAME = "config.yaml"


def dump_resolved(cfg: Config, run_dir: str | Path) -> Path:
    """Write ``cfg`` (defaults filled in, overrides applied) as YAML to
    ``run_dir/config.yaml``; ``disagg train`` can run that file as is."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / RESOLVED_NAME
    out.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return out
