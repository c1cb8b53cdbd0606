"""What the loop does between steps, as a schedule of hooks: each a named action with its cadence
(every N steps, when a policy says, on the last step, on a stop request, where the logs could
not be written). The loop runs a step, then the hooks due, in the schedule's order; a new
periodic action is one more hook, not an edit of the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from longt5_jax.training.step import StepStats, TrainState


@dataclasses.dataclass
class Tick:
    """One trained step, as the hooks after it see it."""

    step: int  # the step just trained (1 for the first)
    state: TrainState  # the state after it
    stats: StepStats  # its statistics, still on the devices
    last: bool  # the run's last step: train_steps reached or a stop agreed
    stop: bool  # a signal asked some process to stop (every process agreed on it)
    wrote: bool = False  # a hook wrote to the logs at this step
    # Whether a log could not be written, on any process: asked once, after the hooks that
    # write logs, and only at a step where one did (None until then).
    failed: bool | None = None

    @property
    def ends(self) -> bool:
        """The loop stops after this step (its last step is saved by then)."""
        return self.last or bool(self.failed)


@dataclasses.dataclass(frozen=True)
class Cadence:
    """When a hook runs: any of the conditions set."""

    every: int = 0  # every `every` steps (0: not by count)
    last: bool = False  # on the run's last step (a stop request makes a step the last)
    stop: bool = False  # on a stop request
    failed: bool = False  # where a log could not be written
    due: Callable[[int], bool] | None = None  # whenever this says (a checkpoint policy)

    def fires(self, tick: Tick) -> bool:
        """Whether the hook runs after `tick`'s step; `due` is asked last, only if still needed."""
        return (
            bool(self.every and tick.step % self.every == 0)
            or (self.last and tick.last)
            or (self.stop and tick.stop)
            or (self.failed and bool(tick.failed))
            or (self.due is not None and self.due(tick.step))
        )


@dataclasses.dataclass(frozen=True)
class Hook:
    """A named action and its cadence."""

    name: str
    cadence: Cadence
    action: Callable[[Tick], None]
    writes_logs: bool = False  # a step where it ran asks whether every log could be written
    # Called with each step's number before the step is dispatched (a profiler's trace starts
    # there, so that it holds the whole step).
    before: Callable[[int], None] | None = None


class Schedule:
    """Hooks run in order after each step: those that write logs first (in their order), then
    whether every log could be written, then the rest (in theirs).

    `logs_failed()` answers whether a log could not be written on any process. In a run of
    several processes it is a collective: every process asks it at the same steps (those where a
    log was written, which every process knows alike) and at the same point of the schedule."""

    def __init__(self, hooks: Sequence[Hook], logs_failed: Callable[[], bool]):
        names = [h.name for h in hooks]
        if len(set(names)) != len(names):
            raise ValueError(f"hooks {names}: each name once")
        self.writers = [h for h in hooks if h.writes_logs]
        self.others = [h for h in hooks if not h.writes_logs]
        self.hooks = self.writers + self.others
        self.logs_failed = logs_failed

    def before(self, step: int) -> None:
        """Each hook's `before` action, ahead of dispatching `step`."""
        for hook in self.hooks:
            if hook.before is not None:
                hook.before(step)

    def after(self, tick: Tick) -> None:
        """The hooks due after `tick`'s step, in order."""
        for hook in self.writers:
            if hook.cadence.fires(tick):
                hook.action(tick)
                tick.wrote = True
        tick.failed = tick.wrote and self.logs_failed()
        for hook in self.others:
            if hook.cadence.fires(tick):
                hook.action(tick)
