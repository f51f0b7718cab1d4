"""The tokenizer a checkpoint goes with, as the Hugging Face files AutoTokenizer reads (tokenizer.json +
tokenizer_config.json), found once here for export (mjax_to_hf) and for mjax-generate.

Where it is found (`find`):
  hf, converted  the tokenizer files in the directory (hf_to_mjax copied them from the HF model);
  training       the tokenizer the saved config names, built as training built it (mjax.data.build_tokenizer):
                 sample       the bundled mjax/assets/sample_tokenizer.json, `<|endoftext|>` as eos;
                 huggingface  --tokenizer_model: a tokenizers file of any name (written as tokenizer.json, with the
                              tokenizer_config.json beside it if there is one) or a directory (its tokenizer files);
                 tiktoken     has no tokenizer.json form: an InputError (export with --skip_tokenizer).
Without a tokenizer_config.json one is written: PreTrainedTokenizerFast, the eos token, model_max_length.
"""

import dataclasses
import json
import logging
import shutil
from pathlib import Path

from mjax.config import ConfigError
from mjax.convert.source import Source
from mjax.convert.spec import InputError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
CONFIG = "tokenizer_config.json"
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    files: dict[str, Path]  # name to write -> the file it is copied from
    eos_token: str | None

    @property
    def tokenizer_json(self) -> Path | None:
        return self.files.get("tokenizer.json")

    def load(self):
        """The tokenizers.Tokenizer of tokenizer.json (None when the files hold none, e.g. only tokenizer.model)."""
        from tokenizers import Tokenizer  # noqa: PLC0415

        return Tokenizer.from_file(str(self.tokenizer_json)) if self.tokenizer_json else None

    def eos_id(self) -> int | None:
        tok = self.load() if self.eos_token else None
        return tok.token_to_id(self.eos_token) if tok else None


def _files_in(directory: Path) -> dict[str, Path]:
    return {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}


def _config_eos(files: dict[str, Path]) -> str | None:
    if CONFIG not in files:
        return None
    eos = json.loads(files[CONFIG].read_text()).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def _named(data) -> str:
    return f"--data.tokenizer_type={data.tokenizer_type}" + (
        f" --data.tokenizer_model={data.tokenizer_model}" if data.tokenizer_model else "")


def training_tokenizer(src: Source, skip: str):
    """The mjax tokenizer (mjax.data.tokenizer) a training checkpoint was trained with, built from its saved config
    as training built it; None for a --mock_data run (it never used one). `skip` names the flag that does without
    one, for the errors."""
    data = src.config.data
    if data.mock_data:
        log.warning("%s was trained on --mock_data: the tokenizer its config names was never used", src.describe())
        return None
    from mjax.data.tokenizer import build_tokenizer  # noqa: PLC0415

    try:
        tok = build_tokenizer(data)
    except (ConfigError, FileNotFoundError) as e:
        raise InputError(f"the tokenizer {src.describe()} was trained with ({_named(data)}, from its saved config) "
                         f"cannot be read here: {e}; restore it at that path, or pass {skip}") from e
    vocab = src.config.model.vocab_size
    if tok.vocab_size > vocab:
        raise InputError(f"the tokenizer of {src.describe()} ({_named(data)}, from its saved config) has "
                         f"{tok.vocab_size} tokens, more than the model's vocab of {vocab}: it is not the model's "
                         f"tokenizer; pass {skip}")
    return tok


def find(src: Source) -> TokenizerFiles | None:
    """The tokenizer files of `src`: None when a converted or HF directory holds none, or a --mock_data run."""
    if src.kind != "training":
        files = _files_in(src.directory)
        return TokenizerFiles(files, _config_eos(files)) if files else None
    data = src.config.data
    if data.tokenizer_type.lower() in ("tiktoken", "tiktokenizer"):
        raise InputError(f"{src.describe()} was trained with {_named(data)}, which has no Hugging Face "
                         "tokenizer.json form; export with --skip_tokenizer and ship the tiktoken encoding beside "
                         "the model")
    tok = training_tokenizer(src, "--skip_tokenizer")
    if tok is None:
        return None
    path = Path(tok.name)  # the tokenizers file it read
    model = Path(data.tokenizer_model).expanduser() if data.tokenizer_model else None
    if model is not None and model.is_dir() and path == model / "tokenizer.json":
        files = _files_in(model)
    else:  # the file itself under the standard name, with the config the training tokenizer read its eos from
        files = {"tokenizer.json": path, **{n: p for n, p in _files_in(path.parent).items() if n == CONFIG}}
    found = TokenizerFiles(files, None)
    try:
        eos = found.load().id_to_token(tok.eod_id)  # the end-of-document token training used
    except ConfigError:  # a tokenizer without one
        eos = None
    return dataclasses.replace(found, eos_token=eos)


def tokenizer_config(tok: TokenizerFiles, model_max_length: int) -> dict:
    """What transformers' AutoTokenizer needs beside a tokenizer.json (tokenizer_class) and what a trained model's
    tokenizer knows: its eos token and the context length."""
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
           "clean_up_tokenization_spaces": False}
    if tok.eos_token:
        out["eos_token"] = tok.eos_token
    return out


def copy(tok: TokenizerFiles, output: Path) -> list[str]:
    """Copies the tokenizer files into `output` as they are; their names."""
    for name, path in tok.files.items():
        shutil.copyfile(path, Path(output) / name)
    return list(tok.files)


def write(tok: TokenizerFiles, output: Path, model_max_length: int) -> list[str]:
    """The tokenizer files in `output`, plus a tokenizer_config.json when they have none; their names."""
    written = copy(tok, output)
    if tok.tokenizer_json and CONFIG not in tok.files:
        (output / CONFIG).write_text(json.dumps(tokenizer_config(tok, model_max_length), indent=2) + "\n")
        written.append(CONFIG)
    return written
