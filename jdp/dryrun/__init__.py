"""The dry run (`python -m jdp.main ... --dry_run`): the train step compiled from shapes
for the configured topology, and what it will cost, before anything runs.

`preflight` compiles it and gathers the figures, `estimate` does the arithmetic and
writes the plan (memory against capacity, the gradient all-reduce, scaling), `hlo`
reads the collectives out of a program, `lowering` lowers a step from shapes (also for
the benchmarks).
"""
