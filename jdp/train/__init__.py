"""Training: the loop (`loop`), evaluation, the metric window read one step late, the
non-finite guard, and the periodic hooks the loop runs after each step (jdp's own
actions and the experiment's)."""
