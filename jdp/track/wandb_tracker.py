"""Weights & Biases: a training run as a W&B run (`tracker.kind=wandb`, `pip install
'jdp[wandb]'`).

The entity, API key and mode are W&B's own settings: `WANDB_MODE=offline` keeps the run in
<workdir>/wandb for a later `wandb sync`, with no network. A resumed training run continues
the same W&B run. Online, W&B's server says the last step it holds. Offline, every restart
adds a run directory of the same id (`wandb sync` uploads them as one run), and the last
step they hold is read back with W&B's own reader (`wandb leet inspect`): W&B writes its
file every few seconds, so a kill can cut off steps already sent, and the resumed run
sends those again (none twice).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from jdp.track.tracker import StepRecord


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, run_name: str, directory: str | None):
        self.project = project
        self.run_name = run_name
        self.directory = directory  # W&B's files go to <directory>/wandb (None: ./wandb)
        self.run = None

    def start(self, run_id: str | None, config: dict) -> tuple[str, int]:
        import wandb

        self.run = wandb.init(project=self.project, name=self.run_name, id=run_id,
                              resume="allow" if run_id else None, dir=self.directory)
        # A resumed run may change how it is logged or how long it runs.
        self.run.config.update(config, allow_val_change=True)
        if run_id is None:
            return self.run.id, 0
        if not self.run.offline:
            return self.run.id, max(self.run.starting_step - 1, 0)
        return self.run.id, offline_last_step(self.run.sync_dir, self.run.id)

    def log(self, record: StepRecord) -> None:
        import wandb

        values = {**record.metrics, **record.texts,
                  **{name: wandb.Image(path) for name, path in record.images.items()}}
        self.run.log(values, step=record.step, commit=True)

    def finish(self) -> None:
        self.run.finish()


def offline_run_dirs(wandb_dir: str, run_id: str) -> list[str]:
    """The offline run directories of `run_id` in `wandb_dir`, oldest first."""
    return sorted(glob.glob(os.path.join(wandb_dir, f"offline-run-*-{glob.escape(run_id)}")))


def offline_last_step(current_dir: str, run_id: str) -> int:
    """The last step held by the earlier offline directories of `run_id` (beside
    `current_dir`, this process's own); 0 if none holds a step. The newest that holds one
    has the last: each restart sends only steps past it."""
    earlier = [d for d in offline_run_dirs(os.path.dirname(current_dir), run_id)
               if d != current_dir]
    for run_dir in reversed(earlier):
        step = read_summary(run_dir)["step"]
        if step is not None:
            return int(step)
    return 0


def read_summary(run_dir: str) -> dict:
    """`wandb leet inspect --summary --json`: an offline run directory's state, config,
    last step and latest values, read by W&B's own reader."""
    return json.loads(wandb_cli("leet", "inspect", "--summary", "--json", run_dir))


def wandb_cli(*args: str) -> str:
    """The standard output of the `wandb` command line of this interpreter's wandb."""
    done = subprocess.run([sys.executable, "-m", "wandb", *args], capture_output=True,
                          text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"wandb {' '.join(args)} exited {done.returncode}: "
                           f"{done.stderr.strip()[-500:]}")
    return done.stdout
