"""MLflow: a training run as an MLflow run (`tracker.kind=mlflow`, `pip install 'jdp[mlflow]'`).

Any tracking URI (`tracker.mlflow_uri`, else `MLFLOW_TRACKING_URI`); by default a SQLite
store in <workdir>/mlflow (`mlflow ui --backend-store-uri sqlite:///<workdir>/mlflow/mlflow.db`
shows it). The config goes in as parameters, each step's metrics as one batch (stored
whole), texts and the report's plots as artifacts. A resumed training run reopens the same
MLflow run, whose latest metrics say the last step it holds.
"""

from __future__ import annotations

import os
import time

from jdp.config.resume import flatten
from jdp.track.tracker import StepRecord


class MlflowTracker:
    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 artifact_dir: str | None = None):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.artifact_dir = artifact_dir  # a new experiment's artifacts (None: the store's)
        self.client = self.run_id = None

    def start(self, run_id: str | None, config: dict) -> tuple[str, int]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if self.artifact_dir:
            os.makedirs(self.artifact_dir, exist_ok=True)  # and the store's folder with it
        self.client = MlflowClient(self.tracking_uri)
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            latest = self.client.get_run(run_id).data.to_proto().metrics  # each key's last
            return run_id, max((metric.step for metric in latest), default=0)
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (experiment.experiment_id if experiment else
                         self.client.create_experiment(self.experiment,
                                                       artifact_location=self.artifact_dir))
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        # Parameters cannot change once logged: a resumed run keeps those it started with.
        self.client.log_batch(self.run_id, params=[Param(key, str(value)) for key, value
                                                   in flatten(config).items()])
        return self.run_id, 0

    def log(self, record: StepRecord) -> None:
        from mlflow.entities import Metric

        # Texts and plots first: the metrics are what mark the step as held.
        for name, text in record.texts.items():
            self.client.log_text(self.run_id, text, f"text/{name}/step_{record.step}.txt")
        for path in record.images.values():
            self.client.log_artifact(self.run_id, path, artifact_path="report")
        timestamp_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(key, float(value), timestamp_ms, record.step)
            for key, value in record.metrics.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
