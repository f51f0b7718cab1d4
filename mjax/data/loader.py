"""Batches for one process: its rows of each global batch, prepared ahead in a background thread.

Global batch b holds global samples [c + b*G, c + (b+1)*G) where c is the position the iterator started from and G
the global batch size; process p of P gets rows [p*G/P, (p+1)*G/P). The position (`state()`) is the number of
global samples consumed, so a resumed iterator yields exactly the batches the interrupted one would have.
"""

import functools
import queue
import threading

import numpy as np

from mjax.config import ConfigError

_END = object()


def make_batch(tokens: np.ndarray, doc_ids: np.ndarray, *, eod_id: int | None = None, eod_mask_loss: bool = False,
               reset_position_ids: bool = False, reset_attention_mask: bool = False) -> dict[str, np.ndarray]:
    """Model inputs from packed samples: tokens [B, L+1] and their document ids [B, L+1].

    As Megatron: targets are inputs shifted by one; `eod_mask_loss` zeroes the loss where the *input* is the EOD
    token (predicting across a document boundary). Documents (and so reset positions and segment ids) come from the
    dataset's document boundaries, which equal Megatron's EOD-based ones for data preprocessed with --append_eod.
    """
    inputs = tokens[:, :-1].astype(np.int32)  # [B, L]
    targets = tokens[:, 1:].astype(np.int32)  # [B, L]
    docs = doc_ids[:, :-1].astype(np.int32)  # [B, L]
    index = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)  # [B, L]
    if reset_position_ids:
        doc_start = np.where(np.diff(docs, axis=1, prepend=0) != 0, index, 0)  # [B, L], 0 inside documents
        positions = index - np.maximum.accumulate(doc_start, axis=1)
    else:
        positions = index.copy()
    loss_mask = np.ones(inputs.shape, np.float32)
    if eod_mask_loss and eod_id is not None:
        loss_mask[inputs == eod_id] = 0.0
    return {"inputs": inputs, "targets": targets, "loss_mask": loss_mask, "positions": positions,
            "segment_ids": docs if reset_attention_mask else np.ones_like(docs)}


class MockDataset:
    """Uniform random tokens, one document per sample; sample i depends only on (seed, i)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.random.default_rng((self.seed, i)).integers(0, self.vocab_size, self.seq_length + 1)
        return tokens.astype(np.int32), np.ones(self.seq_length + 1, np.int32)  # [L+1], [L+1]


class DataIterator:
    """Yields this process's share of consecutive global batches: dicts of [G/P, L] numpy arrays.

    `prefetch` batches are prepared ahead by a daemon thread (0: prepared on demand). `num_batches=None` runs forever.
    `state()` / `restore(state)` give and set the position; call `close()` (or use `with`) when done.
    """

    def __init__(self, dataset, global_batch_size: int, *, batch_fn=make_batch, process_index: int = 0,
                 process_count: int = 1, consumed_samples: int = 0, num_batches: int | None = None, prefetch: int = 2):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} is outside [0, process_count={process_count})")
        if global_batch_size % process_count:
            raise ConfigError(f"--global_batch_size={global_batch_size} is not divisible by the {process_count} "
                              f"processes; each process reads an equal share")
        self.dataset, self.global_batch_size, self.batch_fn = dataset, global_batch_size, batch_fn
        self.local_batch_size = global_batch_size // process_count
        self._first_row = process_index * self.local_batch_size
        self.num_batches, self.prefetch = num_batches, prefetch
        self._thread = None
        self._start(consumed_samples)

    def _batch(self, consumed: int) -> dict[str, np.ndarray]:
        start = consumed + self._first_row
        samples = [self.dataset[i] for i in range(start, start + self.local_batch_size)]
        return self.batch_fn(np.stack([s[0] for s in samples]), np.stack([s[1] for s in samples]))  # [G/P, L+1]

    def _start(self, consumed: int) -> None:
        self._consumed, self._start_consumed, self._exhausted, self._error = consumed, consumed, False, None
        if self.prefetch > 0:
            self._queue, self._stop = queue.Queue(self.prefetch), threading.Event()
            self._thread = threading.Thread(target=self._produce, args=(self._queue, self._stop, consumed),
                                            name="mjax-data-prefetch", daemon=True)
            self._thread.start()

    def _remaining(self, consumed: int) -> int | None:
        if self.num_batches is None:
            return None
        return self.num_batches - (consumed - self._start_consumed) // self.global_batch_size

    def _produce(self, q: queue.Queue, stop: threading.Event, consumed: int) -> None:
        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            while self._remaining(consumed) != 0:
                if not put(self._batch(consumed)):
                    return
                consumed += self.global_batch_size
            put(_END)
        except Exception as e:  # handed to the consumer, raised there
            put(e)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._error is not None:  # the prefetch thread has stopped after it: fail again, never block
            raise self._error
        if self._exhausted:
            raise StopIteration
        if self.prefetch > 0:
            item = self._queue.get()
        else:
            item = _END if self._remaining(self._consumed) == 0 else self._batch(self._consumed)
        if item is _END:
            self._exhausted = True
            raise StopIteration
        if isinstance(item, Exception):
            self._error = item
            raise item
        self._consumed += self.global_batch_size
        return item

    def state(self) -> dict:
        """The position, JSON-serialisable: global samples consumed so far."""
        return {"consumed_samples": self._consumed}

    def restore(self, state: dict) -> None:
        """Continues from a `state()`: the next batch is the one that followed it."""
        self.close()
        self._start(int(state["consumed_samples"]))

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "DataIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def batch_fn_for(data_cfg, eod_id: int | None):
    """`make_batch` with the masking and position options of `--eod_mask_loss`, `--reset_*`."""
    return functools.partial(make_batch, eod_id=eod_id, eod_mask_loss=data_cfg.eod_mask_loss,
                             reset_position_ids=data_cfg.reset_position_ids,
                             reset_attention_mask=data_cfg.reset_attention_mask)
