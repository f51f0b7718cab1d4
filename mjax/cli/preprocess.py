"""Tokenizes JSONL documents into Megatron `.bin/.idx` datasets that mjax and Megatron-LM both read.

    mjax-preprocess --input=corpus.jsonl --output_prefix=data/corpus \
        --tokenizer_type=huggingface --tokenizer_model=path/to/tokenizer.json --append_eod --workers=8

writes data/corpus_text_document.{bin,idx} (one pair per --json_keys key); train on it with
--data_path=data/corpus_text_document. (`mjax-preprocess` is also `python scripts/preprocess_data.py` or
`python -m mjax.cli.preprocess`.)
"""

from absl import flags

from mjax.cli.common import BAD_INPUT, fail, no_positional, run
from mjax.config import ConfigError, DataConfig
from mjax.data.indexed import DataError
from mjax.data.preprocess import preprocess_jsonl
from mjax.logging_setup import setup_logging

flags.DEFINE_list("input", None, "JSONL file(s), one document a line; .gz is read compressed.")
flags.DEFINE_string("output_prefix", None, "Output path prefix; `_{key}_document.{bin,idx}` is appended.")
flags.DEFINE_list("json_keys", ["text"], "JSON fields to tokenize, each into its own dataset.")
flags.DEFINE_string("tokenizer_type", "sample", "sample | huggingface | tiktoken (Megatron's names work too).")
flags.DEFINE_string("tokenizer_model", None, "tokenizer.json or its directory; tiktoken encoding name or file.")
flags.DEFINE_boolean("append_eod", False, "Append the end-of-document token to every document.")
flags.DEFINE_integer("workers", 1, "Tokenizer processes.")
flags.DEFINE_boolean("progress", True, "Progress bar on stderr.")
flags.mark_flags_as_required(["input", "output_prefix"])
FLAGS = flags.FLAGS


def main(argv) -> int:
    setup_logging()
    try:
        no_positional(argv)
    except ConfigError as e:
        return fail("config error", e, BAD_INPUT)
    data_cfg = DataConfig(tokenizer_type=FLAGS.tokenizer_type, tokenizer_model=FLAGS.tokenizer_model)
    try:
        stats = preprocess_jsonl(FLAGS.input, FLAGS.output_prefix, FLAGS.json_keys, data_cfg, FLAGS.append_eod,
                                 FLAGS.workers, FLAGS.progress)
    except (ConfigError, DataError, FileNotFoundError) as e:
        return fail("preprocess", e, BAD_INPUT)
    print(f"preprocessed {stats.summary()}")
    return 0


def entry() -> None:
    run(main)


if __name__ == "__main__":
    entry()
