"""From a `Config` to the train iterator and the validation-iterator factory the training loop consumes."""

import logging
from pathlib import Path

import numpy as np

from mjax.config import Config, ConfigError
from mjax.data.blend import BlendedDataset, parse_data_path
from mjax.data.dataset import SPLITS, GPTDataset, parse_split, split_ranges
from mjax.data.indexed import DataError, IndexedDataset
from mjax.data.loader import DataIterator, MockDataset, batch_fn_for
from mjax.data.preprocess import sample_corpus_prefix
from mjax.data.tokenizer import Tokenizer, build_tokenizer

log = logging.getLogger("mjax")
_CHECKED_TOKENS = 1 << 20  # tokens at the start of each dataset checked against the tokenizer's vocab


def open_dataset(prefix: str, tokenizer: Tokenizer) -> IndexedDataset:
    """Opens an indexed dataset and checks that its token ids fit the tokenizer (so it was made with that one)."""
    ds = IndexedDataset(prefix)
    flags = f"--tokenizer_type / --tokenizer_model (now {tokenizer.name}, {tokenizer.vocab_size} tokens)"
    if np.iinfo(ds.dtype).max < tokenizer.vocab_size - 1:
        raise DataError(f"{ds.bin_path} stores {ds.dtype} token ids, too narrow for the tokenizer's vocab: it was made "
                        f"with another tokenizer. Check {flags}")
    head = ds.first_tokens(_CHECKED_TOKENS)
    lo, hi = (int(head.min()), int(head.max())) if head.size else (0, 0)
    if lo < 0 or hi >= tokenizer.vocab_size:
        bad = lo if lo < 0 else hi
        raise DataError(f"{ds.bin_path} holds token id {bad}, outside the tokenizer's vocab: it was made with another "
                        f"tokenizer. Check {flags}")
    return ds


def _check_sources(d) -> None:
    """Data flags that would otherwise be silently ignored."""
    if d.mock_data and d.data_path:
        raise ConfigError("--mock_data and --data_path are both set: synthetic tokens would silently replace the "
                          "data; drop one")
    if not d.mock_data and not d.data_path and (d.tokenizer_type != "sample" or d.tokenizer_model):
        raise ConfigError(f"--tokenizer_type={d.tokenizer_type} needs --data_path: the bundled sample corpus is "
                          "tokenized with the sample tokenizer (or use --mock_data)")


def build_datasets(cfg: Config, tokenizer: Tokenizer | None = None,
                   splits=("train", "valid")) -> dict[str, object | None]:
    """{split name: a dataset indexable by global sample number, or None when `--split` gives it nothing}; a
    blend's split is a BlendedDataset whose `datasets` and `names` give its parts."""
    d, t = cfg.data, cfg.train
    _check_sources(d)
    if d.mock_data:
        return {name: MockDataset(cfg.model.vocab_size, t.seq_length, t.seed + SPLITS.index(name)) for name in splits}
    tokenizer = tokenizer or build_tokenizer(d)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but --vocab_size="
                          f"{cfg.model.vocab_size}; set --vocab_size={tokenizer.vocab_size}")
    if d.data_path:
        prefixes, weights = parse_data_path(d.data_path)
    else:
        prefixes, weights = [sample_corpus_prefix(d.data_cache_path)], [1.0]
    indexed = [open_dataset(p, tokenizer) for p in prefixes]
    fractions = parse_split(d.split)
    out = {}
    for name in splits:
        s = SPLITS.index(name)
        if fractions[s] == 0:
            out[name] = None
            continue
        parts = [GPTDataset(ix, split_ranges(fractions, len(ix))[s], t.seq_length, t.seed, s, k)
                 for k, ix in enumerate(indexed)]
        split_weights = weights or [p.num_tokens / max(sum(q.num_tokens for q in parts), 1) for p in parts]
        short = [p for p, w in zip(parts, split_weights) if w > 0 and p.samples_per_epoch == 0]
        if short and name == "test":  # only evaluated at the end, if it can be: a tiny test split is no error
            log.warning("the test split of %s holds %d tokens, fewer than --seq_length + 1 = %d: it is not evaluated",
                        short[0].indexed.prefix, short[0].num_tokens, t.seq_length + 1)
            out[name] = None
            continue
        if short:
            raise DataError(f"the {name} split of {short[0].indexed.prefix} holds {short[0].num_tokens} tokens, fewer "
                            f"than --seq_length + 1 = {t.seq_length + 1}; change --split={d.split} or --seq_length")
        out[name] = parts[0] if len(parts) == 1 else BlendedDataset(parts, split_weights, prefixes)
    if "train" in out and out["train"] is None:
        raise ConfigError(f"--split={d.split} leaves no training data")
    return out


def build_data_iterators(cfg: Config, *, process_index: int = 0, process_count: int = 1,
                         consumed_samples: int = 0):
    """(train iterator, {evaluation split name: factory of a fresh `eval_iters`-batch iterator}).

    Evaluation splits: "valid" and "test" when `--split` gives them data (the training loop runs valid* every
    --eval_interval and test* once at the end, as Megatron), and for a blend also each dataset's own,
    "valid/<dataset>". Every call of a factory yields the same batches (the split's first `eval_iters` global
    batches), so evaluations at different steps are comparable; Megatron instead continues through the valid split.
    """
    _check_sources(cfg.data)
    tokenizer = None if cfg.data.mock_data else build_tokenizer(cfg.data)
    datasets = build_datasets(cfg, tokenizer, splits=SPLITS)
    eod = tokenizer.eod_id if tokenizer and cfg.data.eod_mask_loss else None
    kwargs = dict(batch_fn=batch_fn_for(cfg.data, eod), process_index=process_index, process_count=process_count,
                  prefetch=cfg.data.prefetch)
    train = DataIterator(datasets["train"], cfg.train.global_batch_size, consumed_samples=consumed_samples, **kwargs)

    def factory(dataset):
        return lambda: DataIterator(dataset, cfg.train.global_batch_size, num_batches=cfg.train.eval_iters, **kwargs)

    evals = {}
    for split in SPLITS[1:]:
        dataset = datasets[split]
        if dataset is None or not cfg.train.eval_iters:
            continue
        evals[split] = factory(dataset)
        if isinstance(dataset, BlendedDataset):
            for name, part in zip(dataset.names, dataset.datasets):
                evals[f"{split}/{Path(name).name}"] = factory(part)
    return train, evals
