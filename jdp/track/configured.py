"""The trackers a config names (`tracker.kind`: "wandb", "mlflow", both as a list or as
"wandb,mlflow"): checked before anything is written (`check`), then built as hooks
(`configured_hooks`). Their packages are extras, imported only when a tracker starts."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable

from jdp.config.checks import fail
from jdp.runtime import storage
from jdp.track.feed import tracking_hook
from jdp.track.mlflow_tracker import MlflowTracker
from jdp.track.tracker import Tracker
from jdp.track.wandb_tracker import WandbTracker
from jdp.train.hooks import Hook

# MLflow's SQL stores (SQLite, the default, among them) also need these.
_MLFLOW_SQL_SCHEMES = ("sqlite", "mysql", "postgresql", "mssql")
_MLFLOW_SQL_PACKAGES = ("sqlalchemy", "alembic")


def tracker_kinds(config) -> list[str]:
    """The kinds `tracker.kind` names, in order ([] for none)."""
    value = config.tracker.kind
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        fail("tracker.kind", value, "expected tracker names",
             "pass a name, a comma-separated list ('wandb,mlflow') or a list of names")
    return [name.strip() for name in names if name.strip()]


def check(config, workdir: str) -> None:
    """Unknown kinds, missing packages and an MLflow store that cannot be: ConfigError."""
    kinds = tracker_kinds(config)
    for kind in kinds:
        if kind not in KINDS:
            fail("tracker.kind", config.tracker.kind, f"unknown tracker {kind!r}",
                 f"use {' or '.join(map(repr, KINDS))} or both "
                 "('wandb,mlflow'); another tracker is a hook in the experiment's "
                 "build_hooks (jdp.hooks.tracking_hook)")
        _check_installed(KINDS[kind].packages, "tracker.kind", config.tracker.kind,
                         f"the {kind} tracker", kind)
    if len(set(kinds)) < len(kinds):
        fail("tracker.kind", config.tracker.kind, "names a tracker twice", "name each once")
    if "mlflow" in kinds:
        uri = mlflow_uri(config, workdir)
        if storage.is_bucket(workdir) and uri == default_mlflow_uri(workdir):
            fail("tracker.mlflow_uri", config.tracker.mlflow_uri, "MLflow's default store is "
                 "a SQLite file in the workdir, which a bucket cannot hold",
                 "set tracker.mlflow_uri (or MLFLOW_TRACKING_URI) to a tracking server or "
                 "a local sqlite:/// path")
        if uri.partition(":")[0].partition("+")[0] in _MLFLOW_SQL_SCHEMES:
            _check_installed(_MLFLOW_SQL_PACKAGES, "tracker.mlflow_uri", uri,
                             "MLflow's SQL store", "mlflow")


def _check_installed(packages, field: str, value, needs: str, extra: str) -> None:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        fail(field, value, f"{needs} needs {' and '.join(missing)}, which "
             f"{'is' if len(missing) == 1 else 'are'} not installed",
             f"pip install 'jdp[{extra}]'")


def mlflow_uri(config, workdir: str) -> str:
    """`tracker.mlflow_uri`, else $MLFLOW_TRACKING_URI, else a SQLite store in the workdir."""
    return (config.tracker.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or default_mlflow_uri(workdir))


def default_mlflow_uri(workdir: str) -> str:
    return "sqlite:///" + os.path.join(_mlflow_dir(workdir), "mlflow.db")


def _mlflow_dir(workdir: str) -> str:
    return storage.join(storage.absolute(workdir), "mlflow")


def configured_hooks(config, workdir: str) -> list[Hook]:
    """One tracking hook per kind in `tracker.kind` (checked by `check`)."""
    return [tracking_hook(KINDS[kind].build(config, workdir))
            for kind in tracker_kinds(config)]


def _run_name(config, workdir: str) -> str:
    return config.tracker.run_name or os.path.basename(os.path.normpath(workdir))


def _wandb(config, workdir: str) -> WandbTracker:
    local = not storage.is_bucket(workdir)  # W&B's files: <workdir>/wandb, else ./wandb
    return WandbTracker(config.tracker.project, _run_name(config, workdir),
                        storage.absolute(workdir) if local else None)


def _mlflow(config, workdir: str) -> MlflowTracker:
    uri = mlflow_uri(config, workdir)
    default_store = uri == default_mlflow_uri(workdir)
    return MlflowTracker(uri, config.tracker.project, _run_name(config, workdir),
                         artifact_dir=(os.path.join(_mlflow_dir(workdir), "artifacts")
                                       if default_store else None))


@dataclasses.dataclass(frozen=True)
class Kind:
    packages: tuple[str, ...]  # what it imports; `pip install 'jdp[KIND]'` installs them
    build: Callable[..., Tracker]  # (config, workdir) -> the tracker


KINDS = {"wandb": Kind(("wandb",), _wandb), "mlflow": Kind(("mlflow",), _mlflow)}
