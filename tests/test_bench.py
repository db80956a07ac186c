"""Every `python -m jdp.bench` subcommand runs at a tiny size and prints its summary last.

No timing is asserted (figures depend on the machine); the test proves that
each benchmark still runs against the current jdp and prints its figure.
"""

from __future__ import annotations

import re

import pytest

from jdp.bench.__main__ import SUBCOMMANDS, main

# subcommand -> (tiny arguments, pattern of the summary line it prints last)
TINY = {
    "overhead": (["--steps=4", "--log_every=2", "--repeats=2", "--pairs_per_process=2",
                  "--devices=1", "--backends=pjit", "--prepared_input"],
                 r"^overhead: jdp loop / minimal loop examples/s = \d+\.\d{3} "
                 r"\(worst of pjit x 1 devices\)$"),
    "overhead_e2e": (["--steps=4", "--repeats=1", "--devices=1"],
                     r"^overhead_e2e: jdp wall time to final accuracy / minimal = \d+\.\d{3}$"),
    "step_overhead": (["--batch_size=16", "--steps=2", "--repeats=1", "--devices=2"],
                      r"^step_overhead: jdp step / minimal step examples/s = "
                      r"\d+\.\d{3} \(2 devices\)$"),
    "scaling": (["--model=nano", "--batch_size=16", "--steps=1", "--repeats=1",
                 "--max_devices=2"],
                r"^scaling vs 1 device: 1: 1\.00x(, \d+: \d+\.\d+x)+$"),
    "memory": (["--model=nano", "--image_size=32", "--patch_size=8", "--num_classes=16"],
               r"^memory: arguments \+ temporaries per device against replicated: "
               r"zero1 \d+\.\d{3}, zero1_host \d+\.\d{3}, fsdp \d+\.\d{3}, fsdp_host \d+\.\d{3}$"),
    "checkpoint": (["--model=nano", "--repeats=1"],
                   r"^checkpoint: async stall / synchronous stall = \d+\.\d+$"),
    "compile": (["--model=nano", "--batch_size=16", "--repeats=1"],
                r"^compile: cold first-step compile s / warm = \d+\.\d\d$"),
    "input": (["--data_dir={tmp_path}", "--num_images=32", "--batch_size=8", "--examples=16",
               "--max_workers=1", "--repeats=1"],
              r"^input: \d+ workers / 1 worker examples/s = \d+\.\d+$"),
    "tokenize": (["--data_dir={tmp_path}", "--mb=2", "--bpe_vocab=300"],
                 r"^tokenize: prepare with 2 processes / 1: bytes \d+\.\d\dx, bpe \d+\.\d\dx; "
                 r"prepare / encode_batch with as many threads: bpe at 1: \d+\.\d\d, "
                 r"bpe at 2: \d+\.\d\d$"),
    "communication": (["--models=vit:nano", "--image_size=32", "--num_classes=16"],
                      r"^communication: host modes over the same sharding across every "
                      r"device: (\S+ \S+ \d+\.\d\dx \S+(, )?)+$"),
}


# Run by their own tests: gpu's also reads what it writes (tests/test_bench_gpu.py);
# network's needs root, for emulated hosts (tests/test_netns.py).
OWN_TEST = {"gpu", "network"}


def _jdp_trains_alike_on_prepared_input(lines: list[str]) -> None:
    """jdp's loop fed the minimal loop's batches, prepared beforehand, is fed what its
    own input pipeline gives: the same last window's loss."""
    [described] = [line for line in lines if line.startswith("pjit 1 device(s)")]
    jdp, prepared = re.findall(r"last window's loss (\d+\.\d+)", described)
    assert jdp == prepared, described


# subcommand -> a check of what it printed besides the summary
ALSO = {"overhead": _jdp_trains_alike_on_prepared_input}


def test_every_subcommand_has_a_smoke_test():
    assert sorted([*TINY, *OWN_TEST]) == sorted(SUBCOMMANDS)


@pytest.mark.slow  # each runs a whole benchmark, its loops compiled and timed
@pytest.mark.parametrize("name", sorted(set(SUBCOMMANDS) - OWN_TEST))
def test_subcommand_runs_and_prints_its_summary_last(name, capsys, tmp_path):
    argv, summary = TINY[name]
    main([name, *(arg.format(tmp_path=tmp_path) for arg in argv)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.match(summary, lines[-1]), lines[-5:]
    ALSO.get(name, lambda lines: None)(lines)


@pytest.mark.parametrize("devices, message", [
    ("16", "--devices=16: this process has 8 devices. Fix: name counts up to it"),
    ("0", "argument --devices: '0' is not a list of device counts. Fix: pass positive"),
    ("one", "argument --devices: 'one' is not a list of device counts. Fix: pass positive"),
])
def test_step_overhead_refuses_device_counts_it_cannot_measure(devices, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["step_overhead", f"--devices={devices}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("hosts", ["3", "0"])
def test_memory_refuses_hosts_that_do_not_divide_the_devices_in_one_line(hosts, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["memory", f"--hosts={hosts}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"--hosts={hosts}: this process has 8 devices") and "Fix:" in err


def test_the_compared_loops_each_run_first_in_every_other_pair():
    from jdp.bench import pair_order

    assert [pair_order(pair) for pair in range(4)] == [("jdp", "minimal"), ("minimal", "jdp")] * 2


@pytest.mark.parametrize("flag", ["--repeats", "--pairs_per_process"])
def test_overhead_refuses_a_count_of_pairs_below_one(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["overhead", f"{flag}=0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: '0' is not a count of pairs. Fix:" in capsys.readouterr().err


def test_overhead_splits_its_pairs_over_processes_in_pair_order(monkeypatch):
    import argparse

    from jdp.bench import overhead

    started = []

    def pairs_in_child(args, backend, devices, cache_dir, first, count):
        started.append((first, count))
        return [{"jdp": 2.0 * pair, "minimal": 1.0, "input_wait": 0.0, "jdp_loss": 0.0,
                 "minimal_loss": 0.0, "workload": "w"} for pair in range(first, first + count)]

    monkeypatch.setattr(overhead, "_pairs_in_child", pairs_in_child)
    args = argparse.Namespace(repeats=7, pairs_per_process=3)
    measured = overhead._measure_in_children(args, "pjit", 1, "unused")
    assert started == [(0, 3), (3, 3), (6, 1)]
    assert measured["jdp"] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    assert measured["minimal"] == [1.0] * 7


def test_overhead_measures_the_input_share_pair_by_pair():
    """The input pipeline's share is the median over pairs of (prepared - jdp) / minimal,
    not the difference of medians, which slow spells in different pairs can even turn
    negative."""
    from jdp.bench import overhead

    measured = {"jdp": [10.0, 5.0, 9.0], "prepared": [10.5, 5.5, 9.0],
                "minimal": [10.0, 10.0, 9.0]}
    assert overhead._input_share(measured) == pytest.approx(0.05)  # of 0.05, 0.05, 0


@pytest.mark.parametrize("flag, message", [
    ("--rates_mbit=0", "argument --rates_mbit: '0' is not a list of link speeds. Fix: pass"),
    ("--rates_mbit=fast", "argument --rates_mbit: 'fast' is not a list of link speeds."),
    ("--modes=int8,flat", "argument --modes: 'int8,flat': flat is not first. Fix: start"),
    ("--modes=flat,int4", "argument --modes: 'flat,int4': unknown int4. Fix: start with flat"),
])
def test_network_refuses_link_speeds_and_modes_it_cannot_measure(flag, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["network", flag])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
@pytest.mark.slow  # two processes each compile a GPT and train it
def test_overhead_runs_the_lm_line_on_the_text_path_with_config_overrides(capsys, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(f"# document {i}\n" + "def f(x):\n    return x\n" * 40)
    main(["overhead", "--config=experiments/gpt.py", "--model=nano", "--steps=4",
          "--log_every=2", "--repeats=1", "--pairs_per_process=1", "--devices=1",
          "--backends=pjit", "--config.data.seq_len=16", "--config.batch_size=4",
          "--config.data.tokenizer=bytes", f"--config.data.text_files={corpus}/*.txt",
          "--config.data.eval_fraction=0.5", "--config.eval_batch_size=4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.match(r"^overhead: jdp loop / minimal loop examples/s = \d+\.\d{3} ", lines[-1])
    [described] = [line for line in lines if line.startswith("pjit 1 device(s)")]
    assert "gpt.py model nano, batch 4" in described and "--config.data.seq_len=16" in described
    [(jdp, minimal)] = re.findall(r"last window's loss (\d+\.\d+) and (\d+\.\d+)", described)
    assert jdp == minimal, described  # both loops trained on the same windows


def test_config_overrides_go_only_to_benchmarks_that_load_an_experiment(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["memory", "--config.batch_size=8"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --config.batch_size=8" in capsys.readouterr().err
