"""The tuner, `python -m jdp.tune`: the fastest configuration that fits the devices, at the
same global batch, model, data and seed.

- `space`: the knobs searched, the candidates and the order that rules some out unseen;
- `footprint`: a candidate's per-device memory, compiled from shapes;
- `trial`: a candidate's speed, measured on the real training loop;
- `agree`: process 0's decisions, carried to every process;
- `result`: the table, `tune.json`, and applying it (`--config.tune=FILE`);
- `search`: the search itself, which the command line and tests call.
"""
