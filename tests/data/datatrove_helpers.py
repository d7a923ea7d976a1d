"""What the datatrove tests share (with the `in_process` and `corpus` fixtures of conftest.py): datatrove's
local executor run in this process, through its own per-task method (`_run_for_rank`: logs and completion
marks as in a real run), in place of LocalPipelineExecutor.run, which always starts a manager process (the
tests of the real executor are slow), and the prepare the tests repeat."""

from __future__ import annotations

import copy
from pathlib import Path

from pilotrun.data.datatrove_prepare import prepare_with_datatrove


def in_process_run(self):
    """LocalPipelineExecutor.run without its manager process: each incomplete task in turn, in this
    process."""
    pipeline = self.pipeline
    for rank in self.get_incomplete_ranks():
        self.pipeline = copy.deepcopy(pipeline)
        self._run_for_rank(rank)


def prepare_fixture(corpus: Path, out: Path, tokenizer: Path, **options):
    return prepare_with_datatrove(out, str(corpus / "*.jsonl"), str(tokenizer), val_fraction=0.1,
                                  shard_tokens=5000, **options)
