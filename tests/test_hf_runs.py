"""Trained runs in and out of `transformers`, end to end: `python -m jdp.export` of runs
trained on 8 devices with FSDP, greedy generation and the tokenizer against jdp's,
fine-tuning from transformers models (init_from=hf:DIR) on 1 and 8 devices, bad input,
and lm-eval scoring an export."""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the test extra, Python 3.11)")
transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra)")

from test_hf_models import save_transformers_model  # noqa: E402
from test_text_lm import GPT, settings, write_corpus  # noqa: E402

from jdp import trained_run  # noqa: E402
from jdp.checkpoint import hf_import  # noqa: E402
from jdp.checkpoint.saved_params import load_host_params  # noqa: E402
from runs import REPO, assert_same_trajectory, main_env, run_main, run_to_end, train  # noqa: E402

pytestmark = pytest.mark.slow
FSDP = ("--config.parallel.shard_params=true", "--config.parallel.shard_optimizer_state=true")
RUNS = {"default": ("--config.data.tokenizer=bpe:300",),  # the rotary default: GPT-NeoX
        "gpt2": ("--config.model.size=gpt2_micro", "--config.model.positions=learned")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module", params=list(RUNS))
def exported(request, corpus, tmp_path_factory):
    """(workdir, export dir) of a 4-step run on 8 devices with FSDP, exported by the CLI."""
    workdir = tmp_path_factory.mktemp(request.param)
    proc = run_main(f"--config={GPT}", f"--workdir={workdir}", *settings(corpus),
                    "--config.total_steps=4", *FSDP, *RUNS[request.param], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = workdir / "hf"
    proc = export_command(f"--workdir={workdir}", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transformers' logits within" in proc.stdout
    return workdir, str(out)


def export_command(*args) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "jdp.export", *args], env=main_env(1), timeout=600)


def run_logits(workdir, tokens) -> np.ndarray:
    run = trained_run.open_run(str(workdir))
    model = run.model().clone(dtype=np.float32)
    params = load_host_params(run.checkpoint_dir)
    return np.asarray(model.apply({"params": params}, tokens, train=False))


def test_an_fsdp_run_exports_with_logits_equal_to_jdps(exported):
    workdir, out = exported
    run = trained_run.open_run(str(workdir))
    tokens = np.asarray(run.eval_store().tokens[:64], np.int32).reshape(2, 32)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, run_logits(workdir, tokens), atol=1e-4, rtol=0)


def test_the_export_imports_back_to_the_runs_params(exported):
    workdir, out = exported
    run = trained_run.open_run(str(workdir))
    saved = load_host_params(run.checkpoint_dir)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), saved)
    back = hf_import.load_params(f"hf:{out}", target)
    for leaf, ref in zip(jax.tree.leaves(back), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), ref)


def test_auto_tokenizer_encodes_the_held_out_text_to_the_stores_ids(exported):
    workdir, out = exported
    run = trained_run.open_run(str(workdir))
    held_out, tokenizer = run.eval_store(), run.tokenizer()
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for i in range(held_out.num_documents):
        ids = held_out.document(i)
        assert auto(tokenizer.decode(ids))["input_ids"] == ids.tolist()


def test_greedy_generation_in_transformers_equals_jdp_sample(exported):
    workdir, out = exported
    sample = run_to_end([sys.executable, "-m", "jdp.sample", f"--workdir={workdir}",
                         "--prompt=def ", "--max_new_tokens=12", "--temperature=0"],
                        env=main_env(1), timeout=600)
    assert sample.returncode == 0, sample.stderr[-3000:]
    auto = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = auto("def ", return_tensors="pt")["input_ids"]
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:]
    new_ids = generated.tolist()
    if auto.eos_token_id in new_ids:  # jdp.sample stops at the end-of-document token
        new_ids = new_ids[:new_ids.index(auto.eos_token_id)]
    assert sample.stdout.rstrip("\n") == "def " + auto.decode(new_ids, skip_special_tokens=True)
    run = trained_run.open_run(str(workdir))
    from jdp.sample import sampler_for

    sampler = sampler_for(run.config, run.experiment.build_model,
                          run.params(run.model()), str(workdir))
    from jdp.models import decoding

    ids = decoding.generate(sampler.model, sampler.params, prompt[0].numpy().astype(np.int32),
                            max_new_tokens=12, temperature=0)
    assert ids.tolist() == generated.tolist()  # token for token


def test_lm_eval_scores_an_export_on_the_runs_held_out_text(exported, tmp_path):
    pytest.importorskip("lm_eval", reason="needs lm-eval (the test extra)")
    workdir, out = exported
    tasks = tmp_path / "tasks"
    made = subprocess.run([sys.executable, "-m", "jdp.export.lm_eval_task",
                           f"--workdir={workdir}", f"--out={tasks}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    lm_eval = shutil.which("lm_eval", path=os.path.dirname(sys.executable))
    proc = run_to_end([lm_eval, "--model", "hf", "--model_args",
                       f"pretrained={out},dtype=float32", "--include_path", str(tasks),
                       "--tasks", "jdp_heldout", "--device", "cpu", "--batch_size", "4",
                       "--output_path", str(tmp_path / "results")],
                      env=main_env(1, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in (tmp_path / "results").rglob("results*.json")]
    bits = results[0]["results"]["jdp_heldout"]["bits_per_byte,none"]
    # A 4-step model is near uniform over its tokens: far above 0, finite.
    assert math.isfinite(bits) and bits > 1


# --- fine-tuning from transformers models ----------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_fine_tuning_a_transformers_model_follows_one_trajectory_on_1_and_8_fsdp_devices(
        kind, corpus, tmp_path):
    _, directory = save_transformers_model(tmp_path / kind, kind)
    overrides = (*settings(corpus), f"--config.checkpoint.init_from=hf:{directory}",
                 f"--config.data.tokenizer=hf_dir:{directory}", "--config.total_steps=20",
                 "--config.log_every_steps=5")
    eight = train(GPT, tmp_path / "eight", *overrides, *FSDP)
    one = train(GPT, tmp_path / "one", *overrides, devices=jax.devices()[:1])
    assert_same_trajectory(one, eight, logged_steps=(5, 10, 15, 20))
    first = min(r["step"] for r in eight[1] if "train/loss" in r)
    assert first == 5  # from step 0


# --- bad input: one line, exit 2, nothing written ---------------------------------------


def test_exporting_a_workdir_without_checkpoints_is_refused(exported, tmp_path):
    workdir, _ = exported
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "run.json"):
        shutil.copy(workdir / name, bare / name)
    proc = export_command(f"--workdir={bare}", f"--out={tmp_path / 'out'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("jdp: error:")
    assert "no checkpoints" in proc.stderr and not (tmp_path / "out").exists()


def test_exporting_a_model_with_no_exact_equivalent_names_the_field(exported, tmp_path):
    workdir, _ = exported
    untied = tmp_path / "untied"
    shutil.copytree(workdir, untied, ignore=shutil.ignore_patterns("hf"))
    config = json.loads((untied / "config.json").read_text())
    config["model"]["tie_embeddings"] = False
    (untied / "config.json").write_text(json.dumps(config))
    proc = export_command(f"--workdir={untied}", f"--out={tmp_path / 'out'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "jdp: error: model.tie_embeddings=False" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_exporting_into_a_non_empty_out_is_refused(exported):
    workdir, out = exported
    before = sorted(os.listdir(out))
    proc = export_command(f"--workdir={workdir}", f"--out={out}")
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    assert sorted(os.listdir(out)) == before


def fails_at_start(tmp_path, *overrides) -> str:
    workdir = tmp_path / "run"
    proc = run_main(f"--config={GPT}", f"--workdir={workdir}", *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (workdir / "config.json").exists()
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jdp: error:")
    return last


def test_an_hf_directory_without_config_json_fails_at_start(corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    message = fails_at_start(tmp_path, *settings(corpus),
                             f"--config.checkpoint.init_from=hf:{tmp_path / 'empty'}")
    assert "config.json does not exist" in message


def test_an_hf_directory_of_another_architecture_fails_at_start(corpus, tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert", "vocab_size": 300}')
    message = fails_at_start(tmp_path, *settings(corpus),
                             f"--config.checkpoint.init_from=hf:{tmp_path / 'bert'}")
    assert "model_type='bert'" in message and "Fix:" in message


def test_an_hf_model_whose_vocabulary_does_not_match_the_tokenizer_fails_at_start(corpus,
                                                                                 tmp_path):
    directory = tmp_path / "small_vocab"
    directory.mkdir()
    transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=1,
                            n_head=2).save_pretrained(directory)
    message = fails_at_start(tmp_path, *settings(corpus),
                             f"--config.checkpoint.init_from=hf:{directory}")
    assert "does not match the tokenizer" in message and "257" in message and "100" in message


def test_a_live_run_exports_every_n_steps_keeping_the_newest(corpus, tmp_path):
    proc = run_main(f"--config={GPT}", f"--workdir={tmp_path}", *settings(corpus),
                    "--config.total_steps=4", "--config.export.hf_every_steps=2",
                    "--config.checkpoint.max_to_keep=1", *FSDP, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "hf")) == ["4"]  # step 2's went, as checkpoints do
    tokens = np.asarray(trained_run.open_run(str(tmp_path)).eval_store().tokens[:64],
                        np.int32).reshape(2, 32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "4",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, run_logits(tmp_path, tokens), atol=1e-4, rtol=0)
