"""The training stream, in global terms, so that a run saved by N processes resumes on M.

One sequence of examples is defined for the whole run: the source, reshuffled every epoch,
each example preprocessed with a random generator keyed by its index in that sequence. Row r
of every global batch of B rows reads the examples r, r + B, r + 2B, ... of it: one per step
unpacked, as many as fit one after another packed (next fit). So which examples fill which
row, and every random draw made for them, depend on the global example index only, never on
the number of processes or workers, and a position is one integer per global row.

A process builds the block of rows it feeds (rows p*B/n .. (p+1)*B/n - 1 for process p of n);
grain worker processes each build a share of those rows, and their shares are put back in
row order, so a batch is the same with any number of workers.
"""

from __future__ import annotations

from collections.abc import Iterator

import grain
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

from longt5_jax.data import batching

Example = dict[str, np.ndarray]


class _Rows(grain.IterDataset):
    """The rows `rows` of every global batch, from positions `start`; one grain element per
    step: the rows' examples laid out as padded or packed rows, and their next positions."""

    def __init__(self, examples, rows, start, batch_size, lengths, pack):
        super().__init__()
        self.examples, self.batch_size = examples, batch_size
        self.lengths, self.pack = lengths, pack
        self.rows, self.start = np.asarray(rows, np.int64), np.asarray(start, np.int64)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """A worker process's share of the rows (grain calls this in each worker)."""
        self.rows, self.start = self.rows[sl], self.start[sl]

    def __iter__(self):
        return _RowsIterator(self)

    def __str__(self) -> str:
        return f"_Rows(rows={len(self.rows)}, pack={self.pack})"


class _RowsIterator(grain.DatasetIterator):
    def __init__(self, ds: _Rows):
        super().__init__()
        self.ds, self.next = ds, ds.start.copy()
        # A packed row's example that did not fit: the next one of that row, kept, not redone.
        self.pending: dict[int, Example] = {}

    def _example(self, row: int, position: int) -> Example | None:
        index = int(self.ds.rows[row]) + self.ds.batch_size * int(position)
        if index >= len(self.ds.examples):
            return None  # a finite number of epochs is over for this row
        return self.ds.examples[index]

    def _fill(self, row: int) -> list[Example]:
        """This step's examples of one row; advances the row's position past them."""
        first = self.pending.pop(row, None)
        if first is None:
            first = self._example(row, self.next[row])
        if first is None:
            return []
        taken, used = [first], [len(first["inputs"]), len(first["targets"])]
        self.next[row] += 1
        while self.ds.pack:
            candidate = self._example(row, self.next[row])
            if candidate is None:
                break
            sizes = [len(candidate["inputs"]), len(candidate["targets"])]
            if any(u + s > limit for u, s, limit in zip(used, sizes, self.ds.lengths, strict=True)):
                self.pending[row] = candidate  # it opens the row's next step
                break
            taken.append(candidate)
            used = [u + s for u, s in zip(used, sizes, strict=True)]
            self.next[row] += 1
        return taken

    def __next__(self) -> dict[str, np.ndarray]:
        filled = [self._fill(r) for r in range(len(self.ds.rows))]
        rows = [batching.packed_row(examples, *self.ds.lengths) for examples in filled]
        out = {k: np.stack([r[k] for r in rows]) for k in batching.ROW_KEYS}
        out["_next"] = self.next.copy()
        return out

    def get_state(self) -> dict:
        return {"next": self.next.tolist()}

    def set_state(self, state: dict) -> None:
        self.next, self.pending = np.asarray(state["next"], np.int64), {}


class GlobalRows:
    """Process `index` of `count`'s batches of the training stream: an iterator of T5X
    feature dicts over its block of global rows (p*B/n .. (p+1)*B/n - 1 for process p of n).

    `state()` is where the whole stream stands after the batches handed out: the next example
    of every global row, gathered from all processes (so every process must call it);
    `restore` moves this process's rows there, whatever the process count that saved it.
    """

    def __init__(
        self,
        examples: grain.MapDataset,
        batch_size: int,
        lengths: tuple[int, int],
        pack: bool,
        index: int = 0,
        count: int = 1,
        workers: int = 0,
        buffer: int = 2,
    ):
        self.examples, self.batch_size = examples, batch_size
        self.lengths, self.pack = lengths, pack
        share = batch_size // count
        self.rows = np.arange(index * share, (index + 1) * share)
        self.count = count
        self.workers, self.buffer = min(workers, share), buffer
        self.next = np.zeros(share, np.int64)
        self._it: Iterator[dict[str, np.ndarray]] | None = None

    def position(self) -> list[int]:
        """The next example of each of this process's rows."""
        return self.next.tolist()

    def state(self) -> dict:
        """{'batch_size': B, 'next': [the next example of each global row]}."""
        position = self.next
        if self.count > 1:
            position = multihost_utils.process_allgather(position).reshape(-1)
        return {"batch_size": self.batch_size, "next": [int(x) for x in position]}

    def restore(self, state: dict) -> None:
        """Continue from `state` (as `state()` returned it, saved by any number of processes)."""
        saved = state.get("batch_size")
        if saved != self.batch_size or len(state.get("next", ())) != saved:
            raise ValueError(
                f"a data position for DataConfig.batch_size={state.get('batch_size')}; this run "
                f"has batch_size={self.batch_size} (the stream's rows would not line up)"
            )
        self.close()
        self.next = np.asarray(state["next"], np.int64)[self.rows]

    def _start(self) -> Iterator[dict[str, np.ndarray]]:
        ds = _Rows(self.examples, self.rows, self.next, self.batch_size, self.lengths, self.pack)
        if self.workers <= 0:
            return iter(ds)
        # grain's workers read absl flags; outside an absl app nobody has parsed them.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        options = grain.multiprocessing.MultiprocessingOptions(
            num_workers=self.workers, per_worker_buffer_size=self.buffer
        )
        return iter(ds.mp_prefetch(options))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None:
            self._it = self._start()
        step = next(self._it) if self.workers <= 1 else self._gather(self._it)
        if not step["inputs_segment_ids"].any():  # every row's epochs are over
            raise StopIteration
        self.next = step.pop("_next")
        return batching.to_features(step)

    def _gather(self, it: Iterator[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """One step from the workers: worker w holds rows w, w + W, ..., and grain hands out
        one element per worker in turn."""
        parts = [next(it) for _ in range(self.workers)]
        step = {}
        for k, first in parts[0].items():
            step[k] = np.empty((len(self.rows), *first.shape[1:]), first.dtype)
            for w, part in enumerate(parts):
                step[k][w :: len(parts)] = part[k]
        return step

    def close(self) -> None:
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None
