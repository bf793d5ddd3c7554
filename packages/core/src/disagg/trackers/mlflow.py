"""``logging.trackers: [mlflow]``: an MLflow run per training run.

The store defaults to an SQLite file in the run dir (``sqlite:///<run
dir>/mlflow.db``): it works offline and ``mlflow ui --backend-store-uri`` opens
it. MLflow 3 refuses the plain file store unless ``MLFLOW_ALLOW_FILE_STORE``
is set, so a database is the local default. The config goes in as flat
parameters (``train.lr``), each step's scalars as metrics at that step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from disagg import hookimpl
from disagg.interfaces.tracker import Tracker, TrackerOptions, flatten_config

#: MLflow's limits per log_batch call (metrics, params) and on a parameter value
_METRICS_PER_CALL, _PARAMS_PER_CALL, _PARAM_CHARS = 1000, 100, 6000


class MLflowOptions(TrackerOptions):
    tracking_uri: str | None = None
    """Tracking store: a server URL or a database URI; default ``$MLFLOW_TRACKING_URI``, else
    ``sqlite:///<run dir>/mlflow.db``."""
    experiment: str | None = None
    """Experiment name; default ``logging.project``."""


class MLflowTracker(Tracker):
    name = "mlflow"
    requires = ("mlflow", "sqlalchemy", "alembic")
    install = "pip install mlflow"
    options_model = MLflowOptions

    @hookimpl
    def disagg_run_started(self, config: dict[str, Any], run_dir: Path) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir).resolve()
        uri = (
            self.options.tracking_uri  # type: ignore[attr-defined]
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{run_dir / 'mlflow.db'}"
        )
        self.client = MlflowClient(tracking_uri=uri)
        name = self.options.experiment or self.project  # type: ignore[attr-defined]
        found = self.client.get_experiment_by_name(name)
        experiment = (
            found.experiment_id
            if found is not None
            else self.client.create_experiment(name, artifact_location=(run_dir / "mlartifacts").as_uri())
        )
        run = self.client.create_run(experiment, run_name=self.run_name or run_dir.name)
        self.run_id = run.info.run_id
        self.tracking_uri = uri
        params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), _PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_CALL])

    @hookimpl
    def disagg_log_metrics(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), _METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _METRICS_PER_CALL])

    @hookimpl
    def disagg_run_finished(self, summary: dict[str, Any]) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if summary.get("status") == "ok" else "FAILED")
