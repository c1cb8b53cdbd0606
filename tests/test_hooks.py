"""The loop's schedule of hooks: cadences, their order, the one question about the logs, and a
hook registered from outside the loop running at exactly its steps in a real run."""

import dataclasses
import json

import pytest
from helpers import TINY_RUN

from longt5_jax import train
from longt5_jax.training.hooks import Cadence, Hook, Schedule, Tick


def _tick(step: int, last: bool = False, stop: bool = False) -> Tick:
    return Tick(step, state=None, stats={}, last=last, stop=stop)


def _fired(cadence: Cadence, steps: int, stop_at: int = 0) -> list[int]:
    """The steps of a run of `steps` (stopped at `stop_at` if set) where `cadence` fires."""
    fired = []
    for n in range(1, steps + 1):
        stop = n == stop_at
        if cadence.fires(_tick(n, last=n == steps or stop, stop=stop)):
            fired.append(n)
        if stop:
            break
    return fired


def test_a_cadence_fires_every_n_steps_on_the_last_on_a_stop_and_when_due():
    assert _fired(Cadence(every=3), 10) == [3, 6, 9]
    assert _fired(Cadence(every=3, last=True), 10) == [3, 6, 9, 10]
    assert _fired(Cadence(every=3, last=True), 10, stop_at=5) == [3, 5]
    assert _fired(Cadence(stop=True), 10) == []
    assert _fired(Cadence(stop=True), 10, stop_at=4) == [4]
    assert _fired(Cadence(due=lambda n: n in (2, 7)), 10) == [2, 7]
    assert _fired(Cadence(), 10) == []


def test_a_policy_is_asked_only_where_no_other_condition_fired():
    asked = []

    def due(n: int) -> bool:
        asked.append(n)
        return False

    assert _fired(Cadence(last=True, due=due), 4) == [4]
    assert asked == [1, 2, 3]  # the last step saves without asking (a checkpoint policy)


def _run(hooks: list[tuple[str, Cadence, bool]], steps: int, fault_at: int = 0):
    """What a schedule of `hooks` (name, cadence, writes logs) did over `steps` steps: each
    hook's calls as 'name@step', and the steps where it asked whether the logs could be written
    (they could not at `fault_at`)."""
    calls: list[str] = []
    asked: list[int] = []
    schedule = Schedule(
        [
            Hook(name, cadence, lambda t, name=name: calls.append(f"{name}@{t.step}"), writes)
            for name, cadence, writes in hooks
        ],
        logs_failed=lambda: asked.append(tick.step) or tick.step == fault_at,
    )
    for n in range(1, steps + 1):
        tick = _tick(n, last=n == steps)
        schedule.after(tick)
        if tick.ends:
            break
    return calls, asked


def test_hooks_that_write_logs_run_first_and_the_logs_are_asked_about_once_where_written():
    hooks = [
        ("save", Cadence(every=2, last=True, failed=True), False),
        ("log", Cadence(every=3, last=True), True),
        ("eval", Cadence(every=4), True),
        ("stop", Cadence(stop=True), False),
    ]
    done, asked = _run(hooks, 6)
    assert done == ["save@2", "log@3", "eval@4", "save@4", "log@6", "save@6"]
    assert asked == [3, 4, 6]  # a collective across processes: at the same steps on each


def test_a_log_that_cannot_be_written_saves_that_step_and_ends_the_run():
    hooks = [
        ("log", Cadence(every=1, last=True), True),
        ("save", Cadence(every=10, last=True, failed=True), False),
    ]
    done, asked = _run(hooks, 6, fault_at=2)
    assert done == ["log@1", "log@2", "save@2"]
    assert asked == [1, 2]


def test_each_hook_is_named_once():
    with pytest.raises(ValueError, match="each name once"):
        Schedule([Hook("log", Cadence(), print), Hook("log", Cadence(every=2), print)], bool)


def test_a_registered_hook_runs_at_its_steps_with_the_state_and_statistics(tmp_path, monkeypatch):
    seen = []

    def probe(tick: Tick) -> None:
        rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
        logged = json.loads(rows[-1])  # the log hook runs first: this step's row is written
        seen.append((tick.step, int(tick.state.step), float(tick.stats["loss"]), logged))

    hook = Hook("probe", Cadence(every=2, last=True), probe)
    parts = train._parts
    monkeypatch.setattr(train, "_parts", lambda exp: dataclasses.replace(parts(exp), hooks=(hook,)))
    steps = ["--gin.RunConfig.train_steps=5", "--gin.OptimizerConfig.total_steps=5"]
    assert train.main([*TINY_RUN, *steps, f"--gin.MODEL_DIR='{tmp_path}'"]) == 0
    assert [s[:2] for s in seen] == [(2, 2), (4, 4), (5, 5)]
    for step, _, loss, row in seen:
        assert row["step"] == step and row["loss"] == loss
