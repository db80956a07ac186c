"""Models in and out of `transformers`, exactly: jdp's Transformer as GPT-2, GPT-NeoX and
Llama (jdp.models.hf), imports of models made by transformers (init_from=hf:DIR),
exports checked against transformers' forward (jdp.export), tokenizers as tokenizer.json.

Needs torch and transformers (the `test` extra; torch's CPU wheel is for Python 3.11).
"""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the test extra, Python 3.11)")
transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra)")

from jdp.checkpoint import CheckpointError, hf_import, tensor_file  # noqa: E402
from jdp.data.text import tokenizers  # noqa: E402
from jdp.errors import ConfigError  # noqa: E402
from jdp.export import tokenizer_files, weights  # noqa: E402
from jdp.export.directory import write_directory  # noqa: E402
from jdp.models import hf  # noqa: E402
from jdp.models.transformer import LLAMA, Transformer  # noqa: E402

VOCAB = 257  # the byte tokenizer's
LENGTH = 24
SMALL = dict(vocab_size=VOCAB, max_len=32, hidden_size=32, num_layers=2, num_heads=4,
             mlp_dim=64)
# The shipped configurations that map: learned + tied (GPT-2), the rotary default
# (GPT-NeoX), and the Llama options with grouped-query attention.
MODELS = {"gpt2": dict(positions="learned", tie_embeddings=True),
          "gpt_neox": dict(positions="rotary", tie_embeddings=True),
          "llama": dict(positions="rotary", **{**LLAMA, "num_kv_heads": 2})}
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, LENGTH)).astype(np.int32)


@functools.cache
def jdp_model(kind: str) -> tuple[Transformer, dict]:
    """A small model of `kind` and params off their init (biases and norms too)."""
    model = Transformer(**SMALL, **MODELS[kind])
    params = jax.jit(lambda key: nn.unbox(model.init(key, TOKENS, train=False))["params"])(
        jax.random.key(1, impl="rbg"))
    rng = np.random.default_rng(2)
    return model, jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, 0.05, x.shape)
                               .astype(np.float32), params)


def flat(params) -> dict:
    return {"/".join(k.key for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def jdp_logits(model: Transformer, params, tokens=TOKENS) -> np.ndarray:
    return np.asarray(jax.jit(lambda p: model.apply({"params": p}, tokens, train=False))(params))


def hf_logits(directory, tokens=TOKENS) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def export(tmp_path, kind: str, name: str = "out", **kwargs) -> str:
    model, params = jdp_model(kind)
    out = str(tmp_path / name)
    leaves = flat(params)
    held_out = np.random.default_rng(3).integers(0, VOCAB, 3 * SMALL["max_len"])
    result = write_directory(out, model, leaves.__getitem__, tokenizers.ByteTokenizer(),
                             held_out, **kwargs)
    assert result.max_abs_diff is not None and result.max_abs_diff <= 1e-4
    return out


# --- export --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(MODELS))
def test_an_export_loads_in_transformers_with_jdps_logits(kind, tmp_path):
    out = export(tmp_path, kind)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [hf.ARCHITECTURES[kind]]
    model, params = jdp_model(kind)
    np.testing.assert_allclose(hf_logits(out), jdp_logits(model, params), atol=1e-4, rtol=0)
    assert not list(tmp_path.glob("out.partial-*"))


def test_an_export_in_bfloat16_holds_the_params_rounded(tmp_path):
    out = export(tmp_path, "gpt_neox", dtype="bfloat16")
    _, params = jdp_model("gpt_neox")
    file = tensor_file.TensorFile(f"{out}/model.safetensors")
    embedding = file.read("gpt_neox.embed_in.weight")
    assert embedding.dtype == jnp.bfloat16
    np.testing.assert_array_equal(embedding, params["token_embedding"]["embedding"]
                                  .astype(jnp.bfloat16))


def test_a_large_export_is_sharded_with_an_index_transformers_reads(tmp_path):
    out = export(tmp_path, "llama", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / tensor_file.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
    model, params = jdp_model("llama")
    np.testing.assert_allclose(hf_logits(out), jdp_logits(model, params), atol=1e-4, rtol=0)


def test_the_safetensors_files_read_back_with_the_safetensors_library(tmp_path):
    from safetensors import safe_open

    out = export(tmp_path, "gpt2")
    _, params = jdp_model("gpt2")
    with safe_open(f"{out}/model.safetensors", "np") as f:
        np.testing.assert_array_equal(f.get_tensor("transformer.wpe.weight"),
                                      params["position_embedding"])
        assert f.metadata() == {"format": "pt"}


def test_an_export_whose_logits_differ_fails_and_leaves_nothing(tmp_path, monkeypatch):
    from jdp.export import verify

    real = verify.transformers_logits
    monkeypatch.setattr(verify, "transformers_logits", lambda d, t: real(d, t) + 1e-2)
    with pytest.raises(verify.ExportMismatch, match="differ from jdp's"):
        export(tmp_path, "gpt_neox")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fields, field", [
    (dict(tie_embeddings=False), "model.tie_embeddings=False"),
    (dict(num_kv_heads=2), "model.num_kv_heads=2"),
    (dict(norm="rmsnorm"), "model.norm='rmsnorm'"),
    (dict(mlp="swiglu"), "model.mlp='swiglu'"),
    (dict(**LLAMA, positions="learned"), "model.positions='learned'"),
])
def test_a_model_with_no_exact_equivalent_is_refused_naming_the_field(fields, field, tmp_path):
    model = Transformer(**{**SMALL, "positions": "rotary", "tie_embeddings": True, **fields})
    with pytest.raises(ConfigError, match="no exact transformers equivalent") as error:
        write_directory(str(tmp_path / "out"), model, {}.__getitem__,
                        tokenizers.ByteTokenizer(), np.zeros(8, np.int32))
    assert str(error.value).startswith(field) and "Fix:" in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_not_empty_is_refused_unless_overwrite(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    model, params = jdp_model("gpt2")
    with pytest.raises(ConfigError, match="exists and is not empty.*--overwrite"):
        write_directory(str(tmp_path / "out"), model, flat(params).__getitem__,
                        tokenizers.ByteTokenizer(), np.zeros(8, np.int32))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]
    export(tmp_path, "gpt2", overwrite=True)
    assert not (tmp_path / "out" / "mine.txt").exists()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    model = Transformer(**{**SMALL, "vocab_size": 200, **MODELS["gpt2"]})
    with pytest.raises(ConfigError, match="257 ids but the model embeds 200"):
        write_directory(str(tmp_path / "out"), model, {}.__getitem__,
                        tokenizers.ByteTokenizer(), np.zeros(8, np.int32))
    assert list(tmp_path.iterdir()) == []


# --- import ----------------------------------------------------------------------------


def save_transformers_model(directory, kind: str) -> tuple:
    """A model made by transformers (random init, save_pretrained), with jdp's byte
    tokenizer.json beside it; returns (the torch model, its directory)."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=32)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                         n_head=4, n_inner=64)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":  # grouped-query attention, untied head, Llama 3's rope_theta
        config = transformers.LlamaConfig(**sizes, num_key_value_heads=2, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPTNeoXConfig(**sizes, use_parallel_residual=False, rotary_pct=1.0,
                                            hidden_act="gelu_new", tie_word_embeddings=True)
        model = transformers.GPTNeoXForCausalLM(config)
    with torch.no_grad():  # biases and norms off their init values too
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    tokenizer_files.write(tokenizers.ByteTokenizer(), str(directory), max_len=32)
    return model.eval(), str(directory)


def imported(directory) -> tuple[Transformer, dict]:
    spec = f"hf:{directory}"
    model = Transformer(**hf_import.transformer_fields(spec))
    abstract = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), TOKENS,
                                                          train=False)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          abstract["params"])
    return model, hf_import.load_params(spec, target)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt_neox"])
def test_a_transformers_model_imports_with_its_logits(kind, tmp_path):
    reference, directory = save_transformers_model(tmp_path / kind, kind)
    model, params = imported(directory)
    with torch.no_grad():
        expected = reference(torch.as_tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(jdp_logits(model, params), expected, atol=1e-4, rtol=0)
    if kind == "llama":
        assert (model.num_kv_heads, model.rotary_base, model.tie_embeddings) == (2, 5e5, False)


def test_an_export_imports_back_to_the_same_params(tmp_path):
    out = export(tmp_path, "llama")
    _, params = jdp_model("llama")
    _, back = imported(out)
    for name, value in flat(back).items():
        np.testing.assert_array_equal(value, flat(params)[name], err_msg=name)


def test_an_hf_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json does not exist.*save_pretrained"):
        hf_import.transformer_fields(f"hf:{tmp_path}")


@pytest.mark.parametrize("config, key", [
    ({"model_type": "bert", "vocab_size": 10}, "model_type='bert'"),
    ({"model_type": "gpt_neox", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 8, "rotary_pct": 1.0,
      "use_parallel_residual": True},
     "use_parallel_residual=True"),
    ({"model_type": "gpt_neox", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 8, "rotary_pct": 0.25},
     "partial_rotary_factor"),
    ({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "intermediate_size": 8,
      "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters"),
])
def test_an_hf_architecture_jdp_cannot_compute_exactly_is_refused(config, key, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=key) as error:
        hf_import.transformer_fields(f"hf:{tmp_path}")
    assert "Fix:" in str(error.value)


# --- tokenizers ------------------------------------------------------------------------

TEXT = "def f(x):\n\treturn x + 1  # é, ü, 日本語, \x00 and \U0001F600\n"


@pytest.mark.parametrize("kind", ["bytes", "bpe", "sentencepiece"])
def test_auto_tokenizer_encodes_text_to_jdps_ids(kind, tmp_path):
    if kind == "bytes":
        tokenizer = tokenizers.ByteTokenizer()
    else:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text(TEXT * 20 + "class C:\n    pass\n" * 20 + "  spaces\t\ttabs\n" * 20)
        made = tokenizers.train_tokenizer([str(corpus)], vocab_size=300,
                                          out=str(tmp_path / "model"), kind=kind)
        tokenizer = tokenizers.from_spec(made)
    out = tmp_path / "out"
    out.mkdir()
    tokenizer_files.write(tokenizer, str(out), max_len=64)
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    for text in (TEXT, "", " leading space", "a  b\n\n\tc ", "x" * 100):
        assert auto(text)["input_ids"] == tokenizer.encode(text).tolist()
        assert auto.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    assert auto.eos_token_id == tokenizer.eos_id
    # hf_dir:DIR reads the directory's tokenizer back as jdp's.
    again = tokenizers.from_spec(f"hf_dir:{out}")
    assert type(again) is type(tokenizer) or kind == "bytes"
    assert again.encode(TEXT).tolist() == tokenizer.encode(TEXT).tolist()
    assert again.eos_id == tokenizer.eos_id


def test_the_safetensors_writer_streams_one_tensor_at_a_time(tmp_path):
    made = []

    def make(i):
        made.append(i)
        return np.full((2, 3), i, np.float32)

    total = tensor_file.write(str(tmp_path / "t.safetensors"), [("a", (2, 3)), ("b", (2, 3))],
                              np.float32, make)
    assert made == [0, 1] and total == 48
    file = tensor_file.TensorFile(str(tmp_path / "t.safetensors"))
    np.testing.assert_array_equal(file.read("b"), np.ones((2, 3)))
    assert weights.DEFAULT_MAX_SHARD_BYTES == 5 * 10**9


@pytest.mark.parametrize("variant, model_type", [
    ("", "gpt_neox"), (":gpt2_small", "gpt2"), (":llama", "llama")])
def test_the_shipped_gpt_variants_are_exportable(variant, model_type):
    from jdp.experiment import loader
    from jdp.main import load_config

    config = load_config(f"experiments/gpt.py{variant}", "--config.data.tokenizer=bytes",
                         "--config.model.vocab_size=300")
    model = loader.load("experiments/gpt.py").build_model(config)
    assert hf.architecture(model) == model_type
    if model_type == "llama":
        assert (model.num_kv_heads, model.tie_embeddings, model.use_bias) == (2, False, False)


def test_without_transformers_the_export_is_written_and_says_it_was_not_verified(
        tmp_path, monkeypatch):
    from jdp.export import verify

    monkeypatch.setattr(verify, "available", lambda: False)
    model, params = jdp_model("gpt2")
    said = []
    result = write_directory(str(tmp_path / "out"), model, flat(params).__getitem__,
                             tokenizers.ByteTokenizer(), np.zeros(8, np.int32), log=said.append)
    assert result.max_abs_diff is None and (tmp_path / "out" / "model.safetensors").exists()
    assert len(said) == 1 and "not verified" in said[0] and "jdp[hf]" in said[0]
