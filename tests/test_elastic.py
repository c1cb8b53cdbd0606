"""Elastic exact resume with real local processes: a run handed between 1, 4 and 2 processes
(and meshes) logs the losses of the same run in one process, packed and unpacked, with dropout
on.

The trainer saves and restores each process's data position as the stream gives it, whatever
the objective; the stream's own elasticity for every objective, packed and not (a position
saved by two processes, through JSON, resumed bitwise on one, two and four), is
`test_data_pipeline.py::test_a_position_saved_by_two_processes_resumes_on_one_and_four`. So the
real processes run summarization, whose packed chain goes through 4 processes and a mesh change.
"""

import json

import numpy as np
import pytest
from helpers import TINY_RUN, launch_local
from helpers import losses_of as _losses

from longt5_jax import train
from longt5_jax.data.aclsum import aclsum_source
from longt5_jax.data.objectives import split_sentences

# Processes of each segment of 2 steps. Packed: 1->4, 4->1, the last segment on another mesh
# (data 8, ZeRO-1). Unpacked, whose rows all stand at one position: 2->1. (Each handover
# regroups one position per global row between processes: 4->2 after 1->4 and 2->1 was no other
# code.) A chain starts and ends on one process where it can: those segments run in the test's
# own process, whose programs are compiled already, while each process started costs ~12 CPU-s
# (two processes of 2 steps took 16 s here, four 29.5 s).
LONG, UNPACKED = (1, 4, 1), (2, 1)
OTHER_MESH = ["--gin.ParallelConfig.data=8", "--gin.ParallelConfig.tensor=1", "--gin.ZERO_STAGE=1"]
# One learning-rate schedule for every chain: every parametrisation then runs the same programs
# (per process count and mesh), which later ones read back from the persistent cache.
TOTAL_STEPS = 2 * len(LONG)


def _short_docs(path):
    """Documents of 2-7 short sentences with a one-line summary: several fit a packed row."""
    records = []
    for i in range(12):
        sentences = split_sentences(aclsum_source("val")[i]["inputs"])
        short = [" ".join(s.split()[: 5 + j % 5]) + "." for j, s in enumerate(sentences[:60])]
        for start in range(0, len(short), 7):
            doc = short[start : start + 2 + (start + i) % 6]
            records.append({"article": " ".join(doc), "abstract": doc[0]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.slow
@pytest.mark.parametrize(
    "pack, chain", [(False, UNPACKED), (True, LONG)], ids=["unpacked", "packed"]
)
def test_a_run_handed_between_process_counts_logs_the_one_process_losses(tmp_path, pack, chain):
    _short_docs(tmp_path / "docs.jsonl")
    steps = 2 * len(chain)
    args = [
        "--gin.DataConfig.task='files'",
        f"--gin.DataConfig.train_files='{tmp_path / 'docs.jsonl'}'",
        f"--gin.DataConfig.pack={pack}",
        f"--gin.OptimizerConfig.total_steps={TOTAL_STEPS}",
        "--gin.CheckpointConfig.save_every=2",
        # Fine-tuning's dropout: a row's masks follow its global index, not the process count.
        "--gin.LongT5Config.dropout_rate=0.1",
    ]
    whole = [f"--gin.RunConfig.train_steps={steps}", f"--gin.MODEL_DIR='{tmp_path / 'whole'}'"]
    assert train.main([*TINY_RUN, *args, *whole]) == 0
    want = _losses(tmp_path / "whole")
    handed = tmp_path / "handed"
    for segment, processes in enumerate(chain):
        until = [f"--gin.RunConfig.train_steps={2 * (segment + 1)}", f"--gin.MODEL_DIR='{handed}'"]
        if pack and segment == len(chain) - 1:
            until += OTHER_MESH
        if processes == 1:
            assert train.main([*TINY_RUN, *args, *until]) == 0
            continue
        out = launch_local(processes, *args, *until)
        assert segment == 0 or f"resumed from step {2 * segment}" in out
    got = _losses(handed)
    assert len(got) == steps
    # The same rows in the same order; only the order of the reductions can differ.
    np.testing.assert_allclose(got, want, rtol=1e-5)
