"""Data: Megatron `.bin/.idx` datasets, tokenizers, preprocessing, GPT sample packing, blending and the loader.

The training loop needs only `build_data_iterators(cfg, process_index=..., process_count=...)`.
"""

from mjax.data.blend import BlendedDataset, parse_data_path
from mjax.data.build import build_data_iterators, build_datasets, open_dataset
from mjax.data.dataset import GPTDataset, parse_split, split_ranges
from mjax.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, optimal_dtype
from mjax.data.loader import DataIterator, MockDataset, make_batch
from mjax.data.preprocess import preprocess_jsonl, sample_corpus_prefix
from mjax.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "BlendedDataset", "DataError", "DataIterator", "GPTDataset", "IndexedDataset", "IndexedDatasetWriter",
    "MockDataset", "Tokenizer", "build_data_iterators", "build_datasets", "build_tokenizer", "make_batch",
    "open_dataset", "optimal_dtype", "parse_data_path", "parse_split", "preprocess_jsonl", "sample_corpus_prefix",
    "split_ranges",
]
