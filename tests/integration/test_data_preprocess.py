"""JSONL -> .bin/.idx: contents, several keys, worker processes, the script, the sample-corpus cache, bad input."""

import concurrent.futures
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mjax.config import DataConfig
from mjax.data.indexed import DataError, IndexedDataset
from mjax.data.preprocess import preprocess_jsonl, sample_corpus_prefix
from mjax.data.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOCS = [{"text": "The quick brown fox.", "title": "Fox"}, {"text": "", "title": "Empty"},
        {"text": "Jumps over\nthe lazy dog.", "title": "Dog"}] * 50


def write_jsonl(path, docs):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    return path


def test_contents_keys_and_eod(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl.gz", DOCS)
    stats = preprocess_jsonl([src], str(tmp_path / "out"), ("text", "title"), append_eod=True, progress=False)
    tok = build_tokenizer(DataConfig())
    text = IndexedDataset(tmp_path / "out_text_document")
    title = IndexedDataset(tmp_path / "out_title_document")
    assert text.dtype == np.uint16 and len(text) == 100 and len(title) == 150  # empty texts are skipped
    assert stats.skipped == 50 and stats.documents == 250
    assert text[1].tolist() == tok.encode("Jumps over\nthe lazy dog.") + [tok.eod_id]
    assert title[0].tolist() == tok.encode("Fox") + [0]
    assert stats.tokens == text.num_tokens + title.num_tokens
    assert "tokens/s" in stats.summary()


def test_script_with_workers_matches_in_process(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", DOCS)
    preprocess_jsonl([src], str(tmp_path / "one"), progress=False)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"), f"--input={src}",
                          f"--output_prefix={tmp_path / 'two'}", "--workers=2", "--tokenizer_type=sample"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stdout and "100%" in run.stderr
    for ext in ("bin", "idx"):
        two, one = tmp_path / f"two_text_document.{ext}", tmp_path / f"one_text_document.{ext}"
        assert two.read_bytes() == one.read_bytes()


def test_script_reports_bad_flag_cleanly(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"),
                          f"--input={tmp_path / 'missing.jsonl'}", f"--output_prefix={tmp_path / 'x'}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and "--input file" in run.stderr and "missing.jsonl does not exist" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("lines, message", [
    (['{"text": "ok"}', "{not json"], r"in\.jsonl:2 is not valid JSON"),
    (['{"text": "ok"}', '{"body": "no text"}'], r"in\.jsonl:2 has no string field 'text' \(--json_keys\)"),
])
def test_bad_lines_name_file_and_line(tmp_path, lines, message):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        preprocess_jsonl([src], str(tmp_path / "out"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing half-written


def test_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="--input file .*nope.jsonl does not exist"):
        preprocess_jsonl([tmp_path / "nope.jsonl"], str(tmp_path / "out"))


def test_sample_corpus_cache(tmp_path):
    prefix = sample_corpus_prefix(str(tmp_path))
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 1275 and ds.dtype == np.uint16
    assert all(ds[i][-1] == 0 for i in range(0, len(ds), 100))  # EOD appended
    stamp = Path(prefix + ".idx").stat().st_mtime_ns
    assert sample_corpus_prefix(str(tmp_path)) == prefix  # second use: cached, not rebuilt
    assert Path(prefix + ".idx").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in Path(prefix).parent.iterdir()) == [
        "sample_corpus_text_document.bin", "sample_corpus_text_document.idx"]


def test_sample_corpus_cache_concurrent_first_use(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefixes = list(pool.map(sample_corpus_prefix, [str(tmp_path)] * 2))
    assert prefixes[0] == prefixes[1] and IndexedDataset(prefixes[0]).num_documents == 1275
    assert len(list(Path(prefixes[0]).parent.iterdir())) == 2  # no temporaries left
