"""JSONL documents to Megatron `.bin/.idx`, as Megatron's `tools/preprocess_data.py` lays them out.

Each JSON key becomes its own dataset `{output_prefix}_{key}_document`, one sequence per document (plus the
end-of-document token with `append_eod`). Empty documents are skipped. Inputs may be gzip-compressed (`.gz`).
Workers are spawned processes (never forked: the caller may hold JAX or tokenizer threads).
"""

import contextlib
import gzip
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mjax.config import DataConfig
from mjax.data.indexed import DataError, IndexedDatasetWriter, dataset_exists, optimal_dtype
from mjax.data.tokenizer import SAMPLE_TOKENIZER, build_tokenizer

SAMPLE_CORPUS = SAMPLE_TOKENIZER.parent / "sample_corpus.jsonl.gz"
_CHUNK = 64  # documents per task sent to a worker
_log = logging.getLogger(__name__)


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    skipped: int
    seconds: float
    input_bytes: int
    prefixes: list[str]

    def summary(self) -> str:
        s = max(self.seconds, 1e-9)
        return (f"{self.documents} documents ({self.skipped} empty skipped), {self.tokens} tokens in {s:.1f} s: "
                f"{self.documents / s:,.0f} docs/s, {self.tokens / s:,.0f} tokens/s, "
                f"{self.input_bytes / s / 1e6:.1f} MB/s -> {', '.join(self.prefixes)}")


def _read_lines(paths, progress):
    """Yields (path, line number, raw line) over all inputs, reporting bytes read to `progress`."""
    done = 0
    for path in paths:
        with open(path, "rb") as raw:
            lines = gzip.GzipFile(fileobj=raw) if str(path).endswith(".gz") else raw
            for n, line in enumerate(lines, 1):
                if line.strip():
                    yield str(path), n, line
                progress.position(done + raw.tell())
            done += raw.tell()


class _Progress:
    """A one-line progress bar on stderr, redrawn at most twice a second."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.enabled, self.start, self.last = max(total_bytes, 1), enabled, time.time(), 0.0
        self.read = self.docs = self.tokens = self.bytes = 0

    def position(self, read: int) -> None:
        self.read = read

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        if self.enabled and time.time() - self.last > 0.5:
            self._draw(min(self.read / self.total, 1.0))

    def _draw(self, frac: float) -> None:
        self.last = time.time()
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        rate = self.bytes / max(self.last - self.start, 1e-9) / 1e6
        sys.stderr.write(f"\r[{bar}] {100 * frac:3.0f}% {self.docs} docs {self.tokens} tokens {rate:.1f} MB/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(1.0)
            sys.stderr.write("\n")


_worker: dict = {}


def _init_worker(data_cfg: DataConfig, json_keys: tuple[str, ...], append_eod: bool) -> None:
    tok = build_tokenizer(data_cfg)
    _worker.update(tok=tok, keys=json_keys, eod=[tok.eod_id] if append_eod else [],
                   dtype=optimal_dtype(tok.vocab_size))


def _encode_chunk(chunk: list[tuple[str, int, bytes]]) -> tuple[dict[str, list[np.ndarray]], int]:
    """Parses and tokenizes documents: ({key: [tokens [n] per document]}, bytes of input)."""
    texts = {k: [] for k in _worker["keys"]}
    for path, n, line in chunk:
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{n} is not valid JSON ({e})") from None
        for k in _worker["keys"]:
            if not isinstance(doc, dict) or not isinstance(doc.get(k), str):
                raise DataError(f"{path}:{n} has no string field {k!r} (--json_keys); its keys: "
                                f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
            texts[k].append(doc[k])
    out = {k: [np.asarray(ids + _worker["eod"] if ids else ids, _worker["dtype"])
               for ids in _worker["tok"].encode_batch(v)] for k, v in texts.items()}
    return out, sum(len(line) for _, _, line in chunk)


def _chunks(lines, slots: threading.Semaphore, stop: threading.Event):
    """Groups lines into tasks; waits for a free slot before each, so reading stays a bounded way ahead."""
    chunk = []
    for item in lines:
        chunk.append(item)
        if len(chunk) == _CHUNK:
            slots.acquire()
            if stop.is_set():
                return
            yield chunk
            chunk = []
    if chunk and (slots.acquire() and not stop.is_set()):
        yield chunk


def _unblock(slots: threading.Semaphore, stop: threading.Event, n: int) -> None:
    stop.set()
    slots.release(n)


def preprocess_jsonl(inputs, output_prefix: str, json_keys=("text",), data_cfg: DataConfig = DataConfig(),
                     append_eod: bool = False, workers: int = 1, progress: bool = True) -> PreprocessStats:
    """Tokenizes JSONL `inputs` (paths) into `{output_prefix}_{key}_document.{bin,idx}` for each key."""
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"--input file {p} does not exist")
    if workers < 1:
        raise DataError(f"--workers={workers}: need at least 1")
    json_keys = tuple(json_keys)
    _init_worker(data_cfg, json_keys, append_eod)  # also validates the tokenizer flags before any work
    prefixes = [f"{output_prefix}_{k}_document" for k in json_keys]
    bar = _Progress(sum(p.stat().st_size for p in paths), progress)
    slots, stop = threading.Semaphore(4 * workers), threading.Event()
    chunks = _chunks(_read_lines(paths, bar), slots, stop)
    start, skipped = time.time(), 0
    with contextlib.ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(p, _worker["dtype"])) for p in prefixes]
        if workers == 1:
            results = map(_encode_chunk, chunks)
        else:
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
                workers, _init_worker, (data_cfg, json_keys, append_eod)))
            stack.callback(_unblock, slots, stop, 4 * workers + 1)  # runs before the pool closes, even on error
            results = pool.imap(_encode_chunk, chunks)
        for encoded, nbytes in results:
            slots.release()
            docs = tokens = 0
            for writer, key in zip(writers, json_keys):
                for ids in encoded[key]:
                    if ids.size:
                        writer.add_document(ids)
                        docs, tokens = docs + 1, tokens + ids.size
                    else:
                        skipped += 1
            bar.update(docs, tokens, nbytes)
    bar.close()
    return PreprocessStats(bar.docs, bar.tokens, skipped, time.time() - start, bar.bytes, prefixes)


def sample_corpus_prefix(cache_dir: str | None = None) -> str:
    """The bundled sample corpus as an indexed dataset, preprocessed on first use (EOD appended).

    The cache lives in `cache_dir` (`--data_cache_path`), else $MJAX_CACHE_DIR, else ~/.cache/mjax, under a name
    that hashes the corpus and tokenizer. Concurrent first uses are safe: each writes temporary files and renames
    identical results into place.
    """
    digest = hashlib.sha256(SAMPLE_CORPUS.read_bytes() + SAMPLE_TOKENIZER.read_bytes()).hexdigest()[:12]
    base = Path(cache_dir or os.environ.get("MJAX_CACHE_DIR") or "~/.cache/mjax").expanduser()
    prefix = base / f"sample-{digest}" / "sample_corpus"
    full = f"{prefix}_text_document"
    if not dataset_exists(full):
        stats = preprocess_jsonl([SAMPLE_CORPUS], str(prefix), ("text",), DataConfig(tokenizer_type="sample"),
                                 append_eod=True, progress=False)
        _log.info("preprocessed the sample corpus: %s", stats.summary())
    return full
