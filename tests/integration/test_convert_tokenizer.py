"""Export writes the tokenizer the run used: a default run (the bundled sample tokenizer) trained two steps and
exported has a tokenizer.json that encodes the sample corpus as training did, and a tokenizer_config.json naming
its eos token; a run's --tokenizer_model is found whatever the file's name; tiktoken is refused by name."""

import dataclasses
import gzip
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from mjax.convert import InputError, mjax_to_hf
from mjax.convert import source as sources
from mjax.convert import tokenizer as tokenizers_io
from mjax.data.tokenizer import SAMPLE_TOKENIZER, build_tokenizer
from tests.helpers.convert_utils import FIXTURES

# Training runs and compiled steps: the full suite (make test-all) only, not make test.
pytestmark = pytest.mark.slow

CORPUS = Path(SAMPLE_TOKENIZER).parent / "sample_corpus.jsonl.gz"


@pytest.fixture(scope="module")
def run(trained_run):
    save, cfg, _ = trained_run
    return save, cfg


def _corpus(n=200) -> list[str]:
    with gzip.open(CORPUS, "rt") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def test_default_run_exports_the_sample_tokenizer(run, tmp_path):
    save, cfg = run
    summary = mjax_to_hf(save, tmp_path / "hf")
    assert sorted(summary["tokenizer"]) == ["tokenizer.json", "tokenizer_config.json"]
    exported = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    trained = build_tokenizer(cfg.data)  # the tokenizer training used
    for text in _corpus():
        ids = exported.encode(text, add_special_tokens=False).ids
        assert ids == trained.encode(text)
        assert exported.decode(ids) == trained.decode(ids) == text
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == "<|endoftext|>" and exported.token_to_id("<|endoftext|>") == trained.eod_id
    assert config["model_max_length"] == cfg.model.max_position_embeddings
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == trained.eod_id


def test_skip_tokenizer_writes_none(run, tmp_path):
    save, _ = run
    assert mjax_to_hf(save, tmp_path / "hf", with_tokenizer=False)["tokenizer"] == []
    assert not list((tmp_path / "hf").glob("tokenizer*"))


def test_exported_tokenizer_loads_in_transformers(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    save, cfg = run
    mjax_to_hf(save, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = _corpus(1)[0]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok(text, add_special_tokens=False)["input_ids"] == build_tokenizer(cfg.data).encode(text)


def _as_trained_with(run, **data) -> sources.Source:
    """The run's training Source with its saved data section replaced (what another run would have saved)."""
    found = sources.resolve(run[0])
    return dataclasses.replace(found, config=found.config.replace(data=data))


def test_huggingface_tokenizer_file_of_any_name(run, tmp_path):
    shutil.copy(SAMPLE_TOKENIZER, tmp_path / "my_tokens.json")
    found = tokenizers_io.find(_as_trained_with(run, tokenizer_type="huggingface",
                                                tokenizer_model=str(tmp_path / "my_tokens.json")))
    assert found.files == {"tokenizer.json": tmp_path / "my_tokens.json"}
    assert found.eos_token == "<|endoftext|>"  # training's guess among common end-of-document tokens
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "x"}))
    found = tokenizers_io.find(_as_trained_with(run, tokenizer_type="huggingface",
                                                tokenizer_model=str(tmp_path / "my_tokens.json")))
    assert found.files == {"tokenizer.json": tmp_path / "my_tokens.json",
                           "tokenizer_config.json": tmp_path / "tokenizer_config.json"}  # copied, not generated


def test_huggingface_tokenizer_directory_copies_its_files(run):
    found = tokenizers_io.find(_as_trained_with(run, tokenizer_type="HuggingFaceTokenizer",
                                                tokenizer_model=str(FIXTURES / "llama3_gqa")))
    assert sorted(found.files) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert all(p.parent == FIXTURES / "llama3_gqa" for p in found.files.values())


def test_a_tokenizer_the_model_cannot_embed_is_refused_and_mock_data_has_none(run):
    small = _as_trained_with(run)
    small = dataclasses.replace(small, config=small.config.replace(model=dict(vocab_size=512)))
    with pytest.raises(InputError, match="has 1024 tokens, more than the model's vocab of 512"):
        tokenizers_io.find(small)
    assert tokenizers_io.find(_as_trained_with(run, mock_data=True)) is None


def test_tiktoken_and_missing_tokenizers_are_named(run, tmp_path):
    with pytest.raises(InputError, match=r"--data.tokenizer_type=tiktoken --data.tokenizer_model=cl100k_base, "
                                         r"which has no Hugging Face tokenizer.json form; export with "
                                         r"--skip_tokenizer"):
        tokenizers_io.find(_as_trained_with(run, tokenizer_type="tiktoken", tokenizer_model="cl100k_base"))
    gone = tmp_path / "gone.json"
    with pytest.raises(InputError, match=rf"--data.tokenizer_model={gone}.*--skip_tokenizer"):
        tokenizers_io.find(_as_trained_with(run, tokenizer_type="huggingface", tokenizer_model=str(gone)))
