"""Living with a trained language model run: `jdp.evaluate` on new text gives the run's own
loss on its own eval text (1 and 8 devices) and changes nothing of the run; `jdp.sample`,
`jdp.report` and a prepared token store work from relative paths; a store made by
`jdp.text prepare` (a bpe:N tokenizer included) is used by naming it alone, and a run
that contradicts it is refused without touching it; a dry run writes nothing."""

import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jdp.evaluate import EVALUATIONS_FILE, evaluate_run
from runs import REPO, load_config, main_env, read_metrics, train

GPT = "experiments/gpt.py"


def write_documents(directory, first: int, count: int) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(first)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else"]
    for i in range(first, first + count):
        text = "\n".join(" ".join(rng.choice(words, size=rng.integers(3, 9)))
                         for _ in range(rng.integers(4, 14)))
        (directory / f"doc{i:02d}.txt").write_text(f"# document {i}\n{text}\n")
    return str(directory / "*.txt")


SETTINGS = ("--config.data.tokenizer=bytes", "--config.data.seq_len=32",
            "--config.model.size=nano", "--config.batch_size=16", "--config.eval_batch_size=16",
            "--config.total_steps=6", "--config.warmup_steps=1", "--config.log_every_steps=3",
            "--config.eval_every_steps=0", "--config.eval.sample_prompt=")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return (write_documents(root / "train", 0, 24), write_documents(root / "held_out", 24, 8))


@pytest.fixture(scope="module")
def trained_run(corpus, tmp_path_factory):
    """6 steps on 8 devices, evaluated at the end on its own held-out files."""
    train_files, eval_files = corpus
    workdir = tmp_path_factory.mktemp("run")
    train(GPT, workdir, *SETTINGS, f"--config.data.text_files={train_files}",
          f"--config.data.eval_text_files={eval_files}")
    return workdir


def final_eval(workdir) -> dict:
    return [r for r in read_metrics(workdir) if "eval/loss" in r][-1]


def digest(directory) -> dict[str, str]:
    return {os.path.relpath(path, directory): hashlib.sha256(open(path, "rb").read()).hexdigest()
            for path in map(str, sorted(directory.rglob("*"))) if os.path.isfile(path)}


@pytest.mark.parametrize("device_count", [8, 1])
def test_new_text_evaluates_to_the_runs_own_loss_when_it_is_the_runs_eval_text(
        corpus, trained_run, device_count):
    _, eval_files = corpus
    before = digest(trained_run / "checkpoints"), (trained_run / "metrics.jsonl").read_bytes()
    metrics = evaluate_run(trained_run, changes={"data.eval_text_files": eval_files},
                           devices=jax.devices()[:device_count])
    reference = final_eval(trained_run)
    for name in ("eval/loss", "eval/bits_per_byte", "eval/token_accuracy"):
        np.testing.assert_allclose(metrics[name], reference[name], rtol=1e-6)
    assert metrics["eval/num_examples"] == reference["eval/num_examples"]
    # Tokenized into a store of the evaluation's own; the run is left as it was.
    assert (trained_run / "eval_tokens").is_dir()
    assert (digest(trained_run / "checkpoints"), (trained_run / "metrics.jsonl").read_bytes()) \
        == before
    records = [json.loads(line) for line in (trained_run / EVALUATIONS_FILE).open()]
    assert records[-1]["devices"] == device_count and records[-1]["step"] == 6
    assert records[-1]["evaluated"] == {"data.eval_text_files": eval_files}


def test_other_text_is_evaluated_and_recorded_with_what_it_was(corpus, trained_run, tmp_path):
    other = write_documents(tmp_path / "other", 40, 6)
    metrics = evaluate_run(trained_run, changes={"data.eval_text_files": other,
                                                 "eval_batch_size": 8})
    assert metrics["eval/loss"] != pytest.approx(final_eval(trained_run)["eval/loss"])
    record = json.loads((trained_run / EVALUATIONS_FILE).read_text().splitlines()[-1])
    assert record["evaluated"] == {"data.eval_text_files": other}
    assert record["eval/loss"] == metrics["eval/loss"]


def run_program(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=main_env(1),
                          capture_output=True, text=True, timeout=300)


def test_the_command_line_takes_a_relative_workdir_and_refuses_model_changes(trained_run):
    relative = {"cwd": trained_run.parent}
    proc = run_program("jdp.evaluate", f"--workdir={trained_run.name}", **relative)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = float(next(line.split()[1] for line in proc.stdout.splitlines()
                      if line.startswith("eval/loss ")))
    np.testing.assert_allclose(loss, final_eval(trained_run)["eval/loss"], rtol=1e-5)
    for bad, fragment in (("--config.model.size=small", "--config.model.size: evaluation keeps"),
                          ("--config.data.tokenizr=x", "unknown config key data.tokenizr"),
                          ("--step=3", "--step=3: ")):
        proc = run_program("jdp.evaluate", f"--workdir={trained_run.name}", bad, **relative)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and fragment in proc.stderr.splitlines()[-1]


def test_sample_and_report_take_a_relative_workdir(trained_run):
    relative = {"cwd": trained_run.parent}
    sampled = run_program("jdp.sample", f"--workdir={trained_run.name}", "--prompt=def ",
                          "--max_new_tokens=5", "--temperature=0", **relative)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.startswith("def ")
    reported = run_program("jdp.report", trained_run.name, **relative)
    assert reported.returncode == 0, reported.stderr[-3000:]
    assert (trained_run / "report" / "index.html").exists()


# -- a token directory prepared ahead -------------------------------------------------


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """`jdp.text prepare` with a bpe:300 tokenizer trained on the files, into a relative
    --out; the directory's files and their hashes."""
    train_files, _ = corpus
    root = tmp_path_factory.mktemp("prepared")
    proc = run_program("jdp.text", "prepare", f"--files={train_files}", "--tokenizer=bpe:300",
                       "--eval_fraction=0.3", "--out=store", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokenizing into" in proc.stderr  # progress as it goes
    return root / "store", digest(root / "store")


def test_a_prepared_store_is_trained_on_by_naming_it_alone(corpus, prepared, tmp_path,
                                                           monkeypatch):
    store, hashes = prepared
    monkeypatch.chdir(store.parent)  # a relative data.token_dir
    overrides = [o for o in SETTINGS if "tokenizer" not in o]
    _, records = train(os.path.join(REPO, GPT), tmp_path / "run", *overrides,
                       "--config.data.token_dir=store")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["tokenizer"] == "bpe:300" and saved["data"]["eval_fraction"] == 0.3
    assert saved["data"]["text_files"] == corpus[0]
    assert saved["data"]["token_dir"] == str(store)
    assert any("eval/loss" in r for r in records)
    assert digest(store) == hashes  # used as it is
    assert not (tmp_path / "run" / "tokens").exists()


def test_a_run_contradicting_a_prepared_store_is_refused_and_the_store_left_alone(
        corpus, prepared, tmp_path):
    store, hashes = prepared
    from jdp import main as jdp_main
    from jdp.errors import ConfigError

    config = load_config(GPT, *SETTINGS, f"--config.data.token_dir={store}",
                         "--config.data.eval_fraction=0.1")
    with pytest.raises(ConfigError) as error:
        jdp_main.run(config, GPT, str(tmp_path / "run"),
                     explicit_keys={"data.tokenizer", "data.eval_fraction"})
    message = str(error.value)
    assert "data.tokenizer='bytes' (the store's: 'bpe:300')" in message
    assert "data.eval_fraction=0.1 (the store's: 0.3)" in message
    assert "drop those --config.data keys" in message and "rebuild" not in message
    assert digest(store) == hashes
    assert not (tmp_path / "run").exists()


def test_a_dry_run_of_text_writes_nothing(corpus, tmp_path):
    train_files, _ = corpus
    workdir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jdp.main", f"--config={GPT}", f"--workdir={workdir}",
         "--dry_run", *SETTINGS, f"--config.data.text_files={train_files}",
         "--config.data.tokenizer=bpe:300", "--config.data.eval_fraction=0.3"],
        cwd=REPO, env=main_env(8), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not workdir.exists()
    assert not [p for p in os.listdir(tmp_path) if p != "run"]
