"""Tokenizers behind one small interface: `encode`, `encode_batch`, `decode`, `vocab_size`, `eod_id`.

`--tokenizer_type`:
  sample       the bundled byte-level BPE of the sample corpus (vocab 1024, `<|endoftext|>` = 0).
  huggingface  a Hugging Face `tokenizers` file: `--tokenizer_model` is a tokenizer.json or a directory holding one
               (its tokenizer_config.json, if any, names the end-of-document token).
  tiktoken     `--tokenizer_model` is an encoding name (cl100k_base, o200k_base; fetched by tiktoken, so it needs
               the network or tiktoken's cache) or a `.tiktoken` ranks file (read with the cl100k split pattern and
               `<|endoftext|>` appended as the end-of-document token). tiktoken is optional: `pip install tiktoken`.
Megatron's names (HuggingFaceTokenizer, TikTokenizer) are accepted too.
"""

import base64
import json
from pathlib import Path

from mjax.config import ConfigError, DataConfig
from mjax.data.indexed import DataError

SAMPLE_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "sample_tokenizer.json"
_ALIASES = {"huggingfacetokenizer": "huggingface", "hf": "huggingface", "tiktokenizer": "tiktoken"}
# End-of-document tokens of common tokenizers, tried in order when no tokenizer_config.json names one.
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
_CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                   r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


class Tokenizer:
    """Base interface; `eod_id` raises when the tokenizer has no end-of-document token."""

    name: str
    vocab_size: int
    _eod: int | None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        raise NotImplementedError

    @property
    def eod_id(self) -> int:
        if self._eod is None:
            raise ConfigError(f"tokenizer {self.name} has no end-of-document token (looked for "
                              f"{', '.join(_EOD_CANDIDATES)}); --append_eod and --eod_mask_loss need one")
        return self._eod


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path, eod_token: str | None = None):
        from tokenizers import Tokenizer as _Rust

        self.name = str(path)
        try:
            self._tok = _Rust.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise DataError(f"{path} is not a readable Hugging Face tokenizer file ({e}); check "
                            "--tokenizer_model") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = [eod_token] if eod_token else list(_EOD_CANDIDATES)
        self._eod = next((i for i in map(self._tok.token_to_id, names) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    def __init__(self, model: str):
        try:
            import tiktoken
        except ImportError:
            raise ConfigError("--tokenizer_type=tiktoken needs the tiktoken package: pip install tiktoken") from None
        self.name = model
        if Path(model).is_file():
            ranks = _read_tiktoken_ranks(Path(model))
            self._enc = tiktoken.Encoding(Path(model).stem, pat_str=_CL100K_PATTERN, mergeable_ranks=ranks,
                                          special_tokens={"<|endoftext|>": len(ranks)})
        else:
            try:
                self._enc = tiktoken.get_encoding(model)
            except Exception as e:  # unknown name, or no network to fetch it
                raise ConfigError(f"--tokenizer_model={model}: not a .tiktoken file and tiktoken cannot load an "
                                  f"encoding of that name ({e})") from e
        self.vocab_size = self._enc.n_vocab
        self._eod = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A `.tiktoken` file: one `base64(token) rank` pair a line."""
    try:
        return {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in path.read_text().splitlines()
                                                                   if ln.strip())}
    except ValueError as e:
        raise ConfigError(f"--tokenizer_model={path} is not a .tiktoken ranks file ({e})") from e


def _hf_path(model: str | None) -> tuple[Path, str | None]:
    """(tokenizer.json, end-of-document token named by tokenizer_config.json or None)."""
    if not model:
        raise ConfigError("--tokenizer_type=huggingface needs --tokenizer_model: a tokenizer.json or its directory")
    path = Path(model).expanduser()
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer_model={model}: no tokenizer file {path}")
    eod = None
    config = folder / "tokenizer_config.json"
    if config.is_file():
        eod = json.loads(config.read_text()).get("eos_token")
        eod = eod.get("content") if isinstance(eod, dict) else eod
    return path, eod


def build_tokenizer(data: DataConfig) -> Tokenizer:
    """The tokenizer named by `--tokenizer_type` / `--tokenizer_model`."""
    kind = _ALIASES.get(data.tokenizer_type.lower(), data.tokenizer_type.lower())
    if kind == "sample":
        return HFTokenizer(SAMPLE_TOKENIZER, "<|endoftext|>")
    if kind == "huggingface":
        return HFTokenizer(*_hf_path(data.tokenizer_model))
    if kind == "tiktoken":
        if not data.tokenizer_model:
            raise ConfigError("--tokenizer_type=tiktoken needs --tokenizer_model: an encoding name or .tiktoken file")
        return TiktokenTokenizer(data.tokenizer_model)
    raise ConfigError(f"--tokenizer_type={data.tokenizer_type!r} is unknown; use sample, huggingface or tiktoken")
