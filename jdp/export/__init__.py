"""A trained language model as a `transformers` model directory:
`python -m jdp.export --workdir=W --out=DIR [--step=N] [--dtype=float32|bfloat16]`.

DIR holds config.json, model.safetensors (shards and an index past 5 GB),
generation_config.json and the run's tokenizer (tokenizer.json, tokenizer_config.json):
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer` load it
with no network and no jdp. The Transformer maps exactly onto GPT-2, GPT-NeoX or Llama
(`jdp.models.hf`); a configuration with no exact equivalent is refused, naming the field.

Every export checks itself before it reports success: `transformers` loads DIR and its
logits on a few sequences of the run's held-out text must equal jdp's (`verify`); on a
mismatch nothing is left at DIR. The directory is written beside DIR and renamed into
place once checked. The params are read leaf by leaf from the checkpoint, one host, no
mesh, and written tensor by tensor (`weights`).

`directory` writes and checks one directory, `weights` the tensors, `tokenizer_files`
the tokenizer, `verify` the check, `hook` the exports of a live run
(`export.hf_every_steps`), `lm_eval_task` an lm-eval task over the run's held-out text.
"""
