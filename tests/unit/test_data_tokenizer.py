"""Tokenizers: the bundled sample one, Hugging Face files and directories, tiktoken (optional), clear errors."""

import base64
import json
import shutil
import sys

import pytest

from mjax.config import ConfigError, DataConfig
from mjax.data.tokenizer import SAMPLE_TOKENIZER, build_tokenizer


def test_sample_tokenizer():
    tok = build_tokenizer(DataConfig(tokenizer_type="sample"))
    assert tok.vocab_size == 1024 and tok.eod_id == 0
    text = "Return the number of items in a container.\n  Indented: ok?"
    ids = tok.encode(text)
    assert all(0 <= i < 1024 for i in ids) and tok.decode(ids) == text
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]


def test_huggingface_file_and_directory(tmp_path):
    shutil.copy(SAMPLE_TOKENIZER, tmp_path / "tokenizer.json")
    file = str(tmp_path / "tokenizer.json")
    by_file = build_tokenizer(DataConfig(tokenizer_type="huggingface", tokenizer_model=file))
    by_dir = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    assert by_file.encode("hello world") == by_dir.encode("hello world")
    assert by_dir.eod_id == 0  # found among the usual end-of-document names


def test_huggingface_eos_from_tokenizer_config(tmp_path):
    shutil.copy(SAMPLE_TOKENIZER, tmp_path / "tokenizer.json")
    token = json.loads(SAMPLE_TOKENIZER.read_text())["model"]["vocab"]
    name, index = next((k, v) for k, v in token.items() if v == 7)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": name}}))
    assert build_tokenizer(DataConfig(tokenizer_type="huggingface", tokenizer_model=str(tmp_path))).eod_id == index


def test_huggingface_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs --tokenizer_model"):
        build_tokenizer(DataConfig(tokenizer_type="huggingface"))
    with pytest.raises(FileNotFoundError, match="--tokenizer_model=.*no tokenizer file"):
        build_tokenizer(DataConfig(tokenizer_type="huggingface", tokenizer_model=str(tmp_path)))


def test_tokenizer_without_eod(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(DataConfig(tokenizer_type="huggingface", tokenizer_model=str(tmp_path)))
    with pytest.raises(ConfigError, match="no end-of-document token.*--append_eod and --eod_mask_loss need one"):
        tok.eod_id


def test_unknown_type():
    with pytest.raises(ConfigError, match="--tokenizer_type='sentencepiece' is unknown"):
        build_tokenizer(DataConfig(tokenizer_type="sentencepiece"))


def test_tiktoken_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if not installed
    with pytest.raises(ConfigError, match="--tokenizer_type=tiktoken needs the tiktoken package"):
        build_tokenizer(DataConfig(tokenizer_type="tiktoken", tokenizer_model="cl100k_base"))


def test_tiktoken_ranks_file(tmp_path):
    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tok = build_tokenizer(DataConfig(tokenizer_type="tiktoken", tokenizer_model=str(path)))
    assert tok.vocab_size == 261 and tok.eod_id == 260
    assert tok.encode("hello") == [259] and tok.decode(tok.encode("hello, world")) == "hello, world"
