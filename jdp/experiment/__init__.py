"""What the user writes, and how jdp turns it into parts it can train.

`loader` reads an experiment file (`get_config`, `build_model` and the optional
`build_*` functions), `components` builds the data, task and model from the config and
checks them against each other, `task` defines objectives (weighted sums, never
means), `adapters` gives Linen and NNX models one functional interface, and
`optim` holds the learning-rate schedule and the default optimizer.
"""
