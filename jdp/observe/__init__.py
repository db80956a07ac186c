"""What a run reports: the writers (metrics.jsonl, TensorBoard), speed and memory figures
(`throughput`), the log lines (`console`) and profiler traces (`profiling`)."""
