"""A language model on the user's own text (experiments/gpt.py): the packed,
document-masked stream trains the same on every topology, a killed run resumes
exactly, bits per byte is exact, a trained run samples reproducibly, and every bad
input fails at start with one line."""

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jdp.data.text import store
from runs import (
    REPO,
    assert_same_trajectory,
    checkpoint_arrays,
    losses,
    main_command,
    main_env,
    read_metrics,
    run_main,
    run_two_processes,
    train,
)

GPT = "experiments/gpt.py"


def write_corpus(directory) -> str:
    """Thirty small documents of varied length: a pattern a tiny model learns a little."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else"]
    for i in range(30):
        text = "\n".join(" ".join(rng.choice(words, size=rng.integers(3, 9)))
                         for _ in range(rng.integers(2, 12)))
        (directory / f"doc{i:02d}.txt").write_text(f"# document {i}\n{text}\n")
    return str(directory / "*.txt")


def settings(corpus: str, **extra: str) -> tuple[str, ...]:
    base = {"data.text_files": corpus, "data.tokenizer": "bytes", "data.eval_fraction": "0.3",
            "data.seq_len": "32",
            "model.size": "nano", "batch_size": "16", "eval_batch_size": "16",
            "total_steps": "12", "warmup_steps": "2", "log_every_steps": "3",
            "eval_every_steps": "0", "eval.sample_prompt": "", **extra}
    return tuple(f"--config.{key}={value}" for key, value in base.items())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def eight_devices(corpus, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("eight")
    return workdir, train(GPT, workdir, *settings(corpus))


def test_packed_text_follows_one_trajectory_on_1_and_8_devices(corpus, eight_devices, tmp_path):
    _, run = eight_devices
    one = train(GPT, tmp_path, *settings(corpus), devices=jax.devices()[:1])
    assert_same_trajectory(one, run)


def test_a_process_that_looks_after_the_token_dir_was_published_takes_it(tmp_path):
    """Process 0 can build a small corpus's directory and rename it into place between two
    looks of another process, which then must not wait for DIR.building any longer."""
    from jdp.data.text import lm

    intent = {"format": lm.DESCRIPTION_FORMAT, "version": 1,
              **dict.fromkeys(lm.DESCRIBED, "")}
    directory, building = tmp_path / "tokens", tmp_path / f"tokens.{lm.BUILDING}"
    directory.mkdir()
    (directory / lm.DESCRIPTION).write_text(json.dumps(intent))
    assert lm._wait_for_building(str(building), str(directory), intent) is False
    building.mkdir()
    (building / lm.DESCRIPTION).write_text(json.dumps(intent))
    assert lm._wait_for_building(str(building), str(directory), intent) is True


@pytest.mark.slow
def test_packed_text_follows_one_trajectory_on_2_processes_of_4_devices(corpus, eight_devices,
                                                                       tmp_path):
    _, (_, records) = eight_devices
    launched = run_two_processes(main_command(f"--config={GPT}", f"--workdir={tmp_path}",
                                              *settings(corpus)))
    assert launched.returncode == 0, launched.stderr[-3000:]
    two, reference = losses(read_metrics(tmp_path)), losses(records)
    assert sorted(two) == sorted(reference) == [3, 6, 9, 12]
    np.testing.assert_allclose([two[s] for s in (3, 6, 9, 12)],
                               [reference[s] for s in (3, 6, 9, 12)], rtol=1e-5)


def test_bits_per_byte_is_the_loss_over_the_exact_bytes_of_the_held_out_text(eight_devices):
    workdir, (result, _) = eight_devices
    held_out = store.open_store(str(workdir / "tokens" / "split" / "eval"))
    texts_bytes = held_out.num_bytes
    targets = held_out.num_tokens - 1  # every token after the leading eos is a target once
    evaluation = result.eval_metrics
    expected = evaluation["eval/loss"] * targets / texts_bytes / math.log(2)
    assert evaluation["eval/bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    assert evaluation["eval/perplexity"] == pytest.approx(math.exp(evaluation["eval/loss"]))
    # The byte count is the UTF-8 bytes of the held-out documents, nothing else.
    documents = [held_out.tokens[held_out.document_starts[i]:held_out.document_starts[i + 1] - 1]
                 for i in range(held_out.num_documents)]
    assert texts_bytes == sum(len(d) for d in documents)  # byte tokenizer: a token per byte


def test_tokens_per_s_counts_the_real_target_tokens(eight_devices):
    _, (_, records) = eight_devices
    window = next(r for r in records if "train/tokens_per_s" in r)
    # No padding in training windows: batch 16 x 32 targets per step.
    assert window["train/tokens_per_s"] == pytest.approx(
        16 * 32 / window["train/step_time_s"], rel=1e-6)


@pytest.fixture(scope="module")
def checkpointed(corpus, tmp_path_factory):
    """The uninterrupted 12-step run with checkpoints at 6 and 12, in a subprocess."""
    workdir = tmp_path_factory.mktemp("whole")
    proc = run_main(f"--config={GPT}", f"--workdir={workdir}", *settings(corpus),
                    "--config.checkpoint.every_steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def cut_at_step_6(whole, workdir):
    """The run as a kill after its step-6 checkpoint left it (the store is kept)."""
    (workdir / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "6", workdir / "checkpoints" / "6")
    shutil.copytree(whole / "tokens", workdir / "tokens")
    for name in ("config.json", "run.json"):
        shutil.copy(whole / name, workdir / name)
    return workdir


def test_a_run_killed_mid_epoch_resumes_bitwise(corpus, checkpointed, tmp_path):
    workdir = cut_at_step_6(checkpointed, tmp_path / "cut")
    proc = run_main(f"--config={GPT}", f"--workdir={workdir}", *settings(corpus),
                    "--config.checkpoint.every_steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr
    resumed, whole = losses(read_metrics(workdir)), losses(read_metrics(checkpointed))
    assert resumed == {step: whole[step] for step in (9, 12)}
    for leaf, ref in zip(jax.tree.leaves(checkpoint_arrays(workdir, 12)),
                         jax.tree.leaves(checkpoint_arrays(checkpointed, 12)), strict=True):
        np.testing.assert_array_equal(leaf, ref)


def test_a_run_killed_mid_epoch_resumes_on_another_topology(corpus, checkpointed, tmp_path):
    workdir = cut_at_step_6(checkpointed, tmp_path / "moved")
    _, records = train(GPT, workdir, *settings(corpus), "--config.checkpoint.every_steps=6",
                       devices=jax.devices()[:2])
    resumed, whole = losses(records), losses(read_metrics(checkpointed))
    np.testing.assert_allclose([resumed[s] for s in (9, 12)], [whole[s] for s in (9, 12)],
                               rtol=1e-5)


def test_the_trained_run_samples_the_same_text_for_the_same_seed(checkpointed, tmp_path):
    # The run's compile_cache_dir is "", so the sampler uses $JDP_COMPILE_CACHE_DIR.
    cache = tmp_path / "compile_cache"

    def sample(*args):
        proc = subprocess.run([sys.executable, "-m", "jdp.sample", f"--workdir={checkpointed}",
                               "--prompt=def ", "--max_new_tokens=20", *args], cwd=REPO,
                              # Every program written (a helper's compile may take about
                              # the 0.1 s below which jdp writes none), so that the second
                              # sample shows what it compiled, whatever the machine's load.
                              env=main_env(1, JDP_COMPILE_CACHE_DIR=str(cache),
                                           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("def ")
        return proc.stdout

    first = sample("--seed=3")
    written = sorted(os.listdir(cache))
    assert any(name.startswith("jit_run-") for name in written), written
    assert sample("--seed=3") == first
    assert sorted(os.listdir(cache)) == written  # the second compiled nothing: read back
    assert sample("--temperature=0") == sample("--temperature=0", "--seed=9")  # greedy


# -- bad input: one line naming the field and the fix, before training -----------------


def fails_at_start(tmp_path, *overrides) -> str:
    workdir = tmp_path / "run"
    proc = run_main(f"--config={GPT}", f"--workdir={workdir}", *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not workdir.exists()  # checked before anything, a token store included, is written
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jdp: error:")
    return last


def test_no_file_matching_the_glob_is_named(corpus, tmp_path):
    message = fails_at_start(tmp_path, *settings(str(tmp_path / "none" / "*.txt")))
    assert "config.data.text_files=" in message and "no file matches" in message


def test_an_empty_corpus_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    message = fails_at_start(tmp_path, *settings(str(tmp_path / "empty" / "*.txt")))
    assert "config.data.text_files" in message and "Fix:" in message


def test_a_missing_tokenizer_file_is_named(corpus, tmp_path):
    message = fails_at_start(tmp_path, *settings(corpus),
                             f"--config.data.tokenizer=sentencepiece:{tmp_path}/m.model")
    assert "config.data.tokenizer=" in message and "m.model" in message and "Fix:" in message


def test_a_model_vocabulary_below_the_tokenizers_is_named(corpus, tmp_path):
    message = fails_at_start(tmp_path, *settings(corpus), "--config.model.vocab_size=100")
    assert "config.model.vocab_size=100" in message and "257" in message


def test_a_sequence_longer_than_the_model_takes_is_named(corpus, tmp_path):
    message = fails_at_start(tmp_path, *settings(corpus), "--config.model.max_len=16")
    assert "config.data.seq_len=32" in message and "(16)" in message


def test_an_eval_split_smaller_than_one_batch_is_named(corpus, tmp_path):
    message = fails_at_start(tmp_path, *settings(corpus, eval_batch_size="4096"))
    assert "config.eval_batch_size=4096" in message and "Fix:" in message


def test_a_corrupt_token_store_is_refused(corpus, checkpointed, tmp_path):
    tokens = tmp_path / "tokens"
    shutil.copytree(checkpointed / "tokens", tokens)
    with open(tokens / "split" / "train" / "tokens.bin", "r+b") as f:
        f.truncate(10)
    message = fails_at_start(tmp_path, *settings(corpus), f"--config.data.token_dir={tokens}")
    assert "corrupt" in message and str(tokens / "split" / "train") in message


def test_the_store_is_reused_by_a_rerun_and_refused_for_other_text(corpus, checkpointed,
                                                                   tmp_path):
    manifest = json.loads((checkpointed / "tokens" / "split" / "train" / "manifest.json")
                          .read_text())
    assert manifest["documents"] > 0
    other = write_corpus(tmp_path / "other")
    (tmp_path / "other" / "doc00.txt").write_text("changed\n")
    tokens = checkpointed / "tokens"
    before = {p: p.read_bytes() for p in tokens.rglob("*") if p.is_file()}
    message = fails_at_start(tmp_path, *settings(other), f"--config.data.token_dir={tokens}")
    assert f"data.text_files='{other}'" in message and "drop those --config.data keys" in message
    assert {p: p.read_bytes() for p in tokens.rglob("*") if p.is_file()} == before
    # The run's own store (no data.token_dir) is the run's to rebuild.
    workdir = tmp_path / "own"
    shutil.copytree(tokens, workdir / "tokens")
    proc = run_main(f"--config={GPT}", f"--workdir={workdir}", *settings(other))
    assert proc.returncode == 2 and "rebuild_tokens=true" in proc.stderr.splitlines()[-1]


def text_config(corpus: str, tmp_path, **data):
    from jdp.main import load_config

    config = load_config(GPT, *settings(corpus))
    with config.unlocked():
        config.data.update(data)
    return config.data


def test_a_bpe_tokenizer_is_trained_on_the_training_text_once_and_reused(corpus, tmp_path):
    from jdp.data.text import lm

    data_config = text_config(corpus, tmp_path, tokenizer="bpe:300")
    first = lm.build(data_config, workdir=str(tmp_path), eval_batch_size=16)
    trained = tmp_path / "tokens" / "bpe-300.json"
    made = trained.stat().st_mtime_ns
    manifest = json.loads((tmp_path / "tokens" / "split" / "train" / "manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "hf" and manifest["tokenizer"]["sha256"]
    again = lm.build(data_config, workdir=str(tmp_path), eval_batch_size=16)
    assert trained.stat().st_mtime_ns == made  # neither retrained nor retokenized
    np.testing.assert_array_equal(first.train[5]["inputs"], again.train[5]["inputs"])
    assert lm.tokenizer_vocab_size(data_config) == 300 >= int(first.train.store.vocab_size)


def test_a_store_prepared_ahead_with_jdp_text_is_what_the_run_uses(corpus, tmp_path):
    from jdp.data.text import lm

    prepared = subprocess.run(
        [sys.executable, "-m", "jdp.text", "prepare", f"--files={corpus}", "--tokenizer=bytes",
         f"--out={tmp_path / 'ahead'}", "--eval_fraction=0.3"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert f"--config.data.token_dir={tmp_path / 'ahead'}" in prepared.stdout
    manifest = tmp_path / "ahead" / "split" / "train" / "manifest.json"
    made = manifest.stat().st_mtime_ns
    data = lm.build(text_config(corpus, tmp_path, token_dir=str(tmp_path / "ahead")),
                    workdir=str(tmp_path / "run"), eval_batch_size=16)
    assert manifest.stat().st_mtime_ns == made and len(data.train) > 0
    assert not (tmp_path / "run").exists()  # nothing prepared in the workdir
