"""An lm-eval task over a run's own held-out text, for scoring its export:

    python -m jdp.export.lm_eval_task --workdir=W --out=TASKS
    lm_eval --model hf --model_args pretrained=DIR --include_path TASKS --tasks jdp_heldout

writes TASKS/heldout.jsonl (one {"text": ...} per held-out document, decoded from the
run's token store) and TASKS/jdp_heldout.yaml: a loglikelihood_rolling task reporting
word and byte perplexity and bits per byte, read from local files only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TASK = "jdp_heldout"

_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def write_task(workdir: str, out: str, max_documents: int = 0) -> str:
    """Writes the task into `out`; returns the YAML file's path."""
    from jdp import trained_run

    run = trained_run.open_run(workdir)
    held_out, tokenizer = run.eval_store(), run.tokenizer()
    count = held_out.num_documents if max_documents <= 0 else min(max_documents,
                                                                  held_out.num_documents)
    os.makedirs(out, exist_ok=True)
    data = os.path.join(os.path.abspath(out), "heldout.jsonl")
    with open(data, "w") as f:
        for i in range(count):
            f.write(json.dumps({"text": tokenizer.decode(held_out.document(i))}) + "\n")
    path = os.path.join(out, f"{TASK}.yaml")
    with open(path, "w") as f:
        f.write(_YAML.format(task=TASK, data=json.dumps(data)))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.export.lm_eval_task",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a training run's workdir")
    parser.add_argument("--out", required=True, help="the directory for the task's files")
    parser.add_argument("--max_documents", type=int, default=0, help="0: all held-out ones")
    args = parser.parse_args(argv)
    from jdp.errors import ConfigError
    from jdp.runtime.exit_codes import BAD_CONFIG

    try:
        path = write_task(args.workdir, args.out, args.max_documents)
    except ConfigError as e:
        print(f"jdp: error: {e}", file=sys.stderr)
        return BAD_CONFIG
    print(f"wrote {path}; score an export with: lm_eval --model hf --model_args "
          f"pretrained=DIR --include_path {args.out} --tasks {TASK}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
