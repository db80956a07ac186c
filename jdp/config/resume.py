"""Which config fields a resumed run may change, and what differs from the saved run."""

from __future__ import annotations

import json

from jdp.config.defaults import defaults

# Fields that may change when a run resumes: how it is logged, evaluated, saved and
# spread over devices; where the data and compiled programs live; how long it runs. Everything else
# shapes the trajectory and must match the run being resumed.
RESUMABLE_CHANGES = ("total_steps", "log_every_steps", "eval_every_steps", "eval_batch_size",
                     "crash_on_nan", "skip_nonfinite_steps", "tensorboard", "tracker", "profile",
                     "watchdog_timeout_s", "checkpoint", "parallel", "data.data_dir",
                     "data.num_threads", "data.num_workers", "data.in_memory",
                     "data.token_dir", "data.rebuild_tokens", "data.tokenize_processes",
                     "compile_cache_dir")


def flatten(tree: dict, prefix: str = "") -> dict:
    """A nested dict (a config as JSON) as {dotted key path: leaf value}."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def resume_differences(saved: dict, current: dict) -> list[str]:
    """'field: saved -> current' for each field that may not change on resume."""

    def resumable(path: str) -> bool:
        return any(path == f or path.startswith(f + ".") for f in RESUMABLE_CHANGES)

    saved_flat, current_flat = flatten(saved), flatten(current)
    # A field added to jdp after the run was saved, at its default, changes nothing.
    added = {path: value for path, value in flatten(json.loads(defaults().to_json())).items()
             if path not in saved_flat and current_flat.get(path) == value}
    saved_flat.update(added)
    return [f"{path}: {saved_flat.get(path, '<absent>')!r} -> "
            f"{current_flat.get(path, '<absent>')!r}"
            for path in sorted(set(saved_flat) | set(current_flat))
            if not resumable(path) and saved_flat.get(path) != current_flat.get(path)]

