"""Rebuilds mjax/assets/sample_tokenizer.json from the bundled corpus (a byte-level BPE, 1024 tokens).

The corpus itself, mjax/assets/sample_corpus.jsonl.gz, is English prose from CPython's standard-library docstrings
(PSF licence), one document per line. Run: python -m tools.build_sample_assets
"""
import gzip
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "mjax" / "assets"


def main():
    with gzip.open(ASSETS / "sample_corpus.jsonl.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(ASSETS / "sample_tokenizer.json"))
    n = sum(len(tok.encode(t).ids) for t in texts)
    print(f"vocab {tok.get_vocab_size()}, {n} tokens over {len(texts)} documents")


if __name__ == "__main__":
    main()
