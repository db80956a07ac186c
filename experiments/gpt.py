"""A GPT-style language model trained on your own text.

The default needs no network and no files: the Python standard library's own sources
(`data.text_files="stdlib"`, found where the running interpreter keeps them, ~9 MB),
tokenized by a byte-level BPE of 2,048 ids trained on them at the start (`bpe:2048`,
~0.3 tokens per byte), packed into windows of 128 tokens with document masks. It reaches
`eval/bits_per_byte` 1.98 in 300 steps (4.5 minutes on 2 CPU cores, 8 simulated
devices; byte-level, `--config.data.tokenizer=bytes --config.data.seq_len=256`: 2.24 in
8.6 minutes). Reported:
`eval/loss`, `eval/perplexity`, `eval/bits_per_byte` (comparable across tokenizers),
`eval/token_accuracy`, and `train/tokens_per_s`.

    python -m jdp.main --config=experiments/gpt.py --workdir=runs/gpt
    python -m jdp.main --config=experiments/gpt.py --workdir=runs/mine \\
        --config.data.text_files='/data/*.txt' --config.data.tokenizer=sentencepiece:/data/m.model
    python -m jdp.main --config=experiments/gpt.py:gpt2_small --workdir=runs/gpt2   # a GPU host
    python -m jdp.main --config=experiments/gpt.py:llama --workdir=runs/llama   # Llama's block
    python -m jdp.sample --workdir=runs/gpt --prompt="def " --max_new_tokens=200
    python -m jdp.export --workdir=runs/gpt --out=runs/gpt-hf      # for transformers, lm-eval

Fine-tuning a transformers model (GPT-2, GPT-NeoX, Llama) saved with save_pretrained:
`--config.checkpoint.init_from=hf:DIR --config.data.tokenizer=hf_dir:DIR`; the model's
shape then comes from DIR/config.json, and a `model.vocab_size` or `model.max_len` set
to something else is refused.
"""

import ml_collections
from absl import logging

from jdp import task
from jdp.config import defaults
from jdp.data.text import lm
from jdp.errors import ConfigError
from jdp.hooks import Hook
from jdp.models.transformer import TRANSFORMER_SIZES, Transformer, flops_per_token, transformer

VARIANTS = ("default", "gpt2_small", "llama")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "default"
    if variant not in VARIANTS:
        raise ValueError(f"experiments/gpt.py:{variant}: unknown variant; use one of "
                         f"{', '.join(VARIANTS)}")
    config = defaults()
    config.model = ml_collections.ConfigDict()
    config.model.size = "tiny"
    config.model.positions = "rotary"
    config.model.tie_embeddings = True
    config.model.dropout_rate = 0.0
    config.model.vocab_size = 0  # 0 = the tokenizer's
    config.model.max_len = 0  # the longest sequence it takes; 0 = data.seq_len

    config.data.text_files = "stdlib"
    config.data.tokenizer = "bpe:2048"
    config.data.seq_len = 128

    config.batch_size = 32
    config.total_steps = 300
    config.warmup_steps = 100
    config.learning_rate = 3e-3
    config.weight_decay = 0.1
    config.grad_clip_norm = 1.0
    config.base_batch_size = config.batch_size
    config.log_every_steps = 50
    config.eval_every_steps = 150
    config.eval_batch_size = 64
    config.eval = ml_collections.ConfigDict()
    config.eval.sample_prompt = "def "  # a greedy sample at each evaluation ("" = none)
    config.eval.sample_tokens = 64
    config.export = ml_collections.ConfigDict()
    # > 0: every N steps (and at the end) a transformers export in <workdir>/hf/<step>,
    # checked as `python -m jdp.export` checks it; the newest checkpoint.max_to_keep kept.
    config.export.hf_every_steps = 0

    if variant == "gpt2_small":  # GPT-2 small (124M parameters) at 1024 tokens
        config.model.size = "gpt2_small"
        config.data.tokenizer = "bpe:50257"  # GPT-2's vocabulary size: 124M parameters
        config.model.positions = "learned"
        config.model.max_len = 1024
        config.data.seq_len = 1024
        config.batch_size = config.base_batch_size = 256
        config.eval_batch_size = 256
        config.learning_rate = 6e-4
        config.total_steps = 5000
        config.warmup_steps = 500
        config.compute_dtype = "bfloat16"
        config.remat = "dots_saveable"
    if variant == "llama":  # the default run with Llama's block (RMSNorm, SwiGLU, GQA)
        config.model.size = "llama_micro"
        config.model.tie_embeddings = False
    return config


def _imports(config) -> bool:
    return config.checkpoint.init_from.startswith("hf:")


def _model_fields(config) -> dict:
    """The Transformer's fields that the config sets (over its named size's), or with
    init_from=hf:DIR all of them, from DIR/config.json (its shape and architecture)."""
    if _imports(config):
        from jdp.checkpoint import hf_import  # Orbax: loaded only where needed

        fields = hf_import.transformer_fields(config.checkpoint.init_from)
        for key in ("vocab_size", "max_len"):
            if config.model[key] not in (0, fields[key]):
                raise ConfigError(
                    f"config.model.{key}={config.model[key]}: the model in "
                    f"{config.checkpoint.init_from} has {key}={fields[key]}. Fix: pass "
                    f"--config.model.{key}=0 (the checkpoint's).")
        needed = lm.tokenizer_vocab_size(config.data)
        if fields["vocab_size"] < needed:
            raise ConfigError(
                f"config.data.tokenizer={config.data.tokenizer!r} has {needed} ids but the model "
                f"in {config.checkpoint.init_from} embeds {fields['vocab_size']}: the vocabulary "
                f"does not match the tokenizer. Fix: its own tokenizer, "
                f"--config.data.tokenizer=hf_dir:{config.checkpoint.init_from[3:]}")
        return fields
    return {"positions": config.model.positions, "tie_embeddings": config.model.tie_embeddings,
            "vocab_size": config.model.vocab_size or lm.tokenizer_vocab_size(config.data),
            "max_len": config.model.max_len or config.data.seq_len}


def build_model(config):
    import jax.numpy as jnp

    fields = _model_fields(config)
    lm.check_model_fits(config.data, vocab_size=fields["vocab_size"], max_len=fields["max_len"])
    common = dict(dropout_rate=config.model.dropout_rate,
                  dtype=jnp.dtype(config.compute_dtype), remat=config.remat)
    if _imports(config):
        return Transformer(**fields, **common)
    return transformer(config.model.size, **fields, **common)


def build_task(config) -> task.Task:
    inputs = ("inputs", "segment_ids", "positions") if config.data.document_mask else "inputs"
    return task.next_token(inputs=inputs, exact_match=False, tokens_per_byte="tokens_per_byte")


def build_hooks(config) -> list[Hook]:
    """A short greedy sample of the model at each evaluation, in the log and TensorBoard;
    the transformers exports of `export.hf_every_steps`."""
    from jdp.export.hook import hf_export_hook

    hooks = [hook for hook in (hf_export_hook(config, build_model),) if hook is not None]
    if not config.eval.sample_prompt:
        return hooks

    def sample(step, info):
        from jdp.sample import sampler_for

        text = sampler_for(config, build_model, info.state.params, info.workdir).continuation(
            config.eval.sample_prompt, max_new_tokens=config.eval.sample_tokens, temperature=0)
        logging.info("sample at step %d: %r", step, config.eval.sample_prompt + text)
        info.write_text("eval/sample", config.eval.sample_prompt + text)

    return [Hook(sample, every=config.eval_every_steps, at_end=True), *hooks]


def flops_per_example(config) -> float:
    fields = {**TRANSFORMER_SIZES.get(config.model.size, {}), **_model_fields(config)}
    heads = fields["num_heads"]
    return config.data.seq_len * flops_per_token(
        hidden_size=fields["hidden_size"], num_layers=fields["num_layers"],
        mlp_dim=fields["mlp_dim"], vocab_size=fields["vocab_size"], length=config.data.seq_len,
        kv_size=fields["hidden_size"] // heads * (fields.get("num_kv_heads") or heads),
        mlp_matrices=3 if fields.get("mlp") == "swiglu" else 2)
