"""The training log's lines: one per log step and one per evaluation."""

from __future__ import annotations

from absl import logging


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def log_train(step: int, total_steps: int, metrics: dict[str, float], eta: float) -> None:
    mfu = f"  MFU {100 * metrics['train/mfu']:.1f}%" if "train/mfu" in metrics else ""
    extras = "".join(f"  {label} {metrics[key]:.1f} s" for key, label in (
        ("time/eval_s", "eval"), ("time/checkpoint_s", "saving"), ("time/compile_s", "compile"))
        if metrics.get(key))
    rss = f"  RSS {metrics['memory/host_rss_mib']:.0f} MiB" \
        if "memory/host_rss_mib" in metrics else ""
    window = f"  ({metrics['train/window_steps']:.0f}-step window)" \
        if "train/window_steps" in metrics else ""
    # A language model's speed in real target tokens, anything else's in examples.
    unit = "tokens" if "train/tokens_per_s" in metrics else "examples"
    logging.info(
        "step %d/%d (%.0f%%)  loss %.4f  lr %.3g  |g| %.3g  %.0f %s/s  %.1f ms/step  "
        "input wait %.0f%%%s%s%s  ETA %s%s",
        step, total_steps, 100.0 * step / total_steps, metrics["train/loss"],
        metrics.get("train/learning_rate", float("nan")),
        metrics.get("train/grad_norm", float("nan")), metrics[f"train/{unit}_per_s"], unit,
        1000 * metrics["train/step_time_s"], 100 * metrics["train/data_wait_fraction"], mfu,
        extras, rss, format_duration(eta), window)


def log_eval(step: int, metrics: dict[str, float]) -> None:
    names = "".join(f"  {key[len('eval/'):]} {value:.4f}" for key, value in metrics.items()
                    if key not in ("eval/loss", "eval/num_examples"))
    logging.info("eval at step %d: loss %.4f%s  (%d examples)", step, metrics["eval/loss"],
                 names, metrics["eval/num_examples"])

