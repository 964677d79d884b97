"""The data pipeline: documents -> tokens -> cached uint16 shards -> batches of T+1-token windows,
in three modules by job: ``wiola.train.sources`` (where text comes from: ``--data``),
``wiola.train.token_cache`` (tokenisation into memmap shards, cached by source and tokenizer) and
``wiola.train.batches`` (windows, the training stream, evaluation batches). This module re-exports
their public names (and ``tokenizer_for`` from ``wiola.train.env``, ``token_byte_lengths`` and
``unigram_entropy`` from ``wiola.train.evaluate``) for code that imports them from here.
"""

from __future__ import annotations

from wiola.train.batches import BatchStream, check_split, check_targets, eval_batches, eval_windows, num_windows
from wiola.train.env import tokenizer_for
from wiola.train.evaluate import token_byte_lengths, unigram_entropy
from wiola.train.sources import (
    DEFAULT_HF_DATASET,
    EOT_TEXT,
    PIPELINE_VERSION,
    TEXT_FIELDS,
    TEXT_SUFFIXES,
    VAL_NAMES,
    DataSource,
    absolute_data_path,
    is_named_source,
    iter_documents,
    resolve_source,
    source_fingerprint,
    validation_source,
)
from wiola.train.token_cache import (
    SHARD_TOKENS,
    TokenData,
    TokenSplit,
    default_cache_dir,
    prepare_data,
    prepare_val_data,
    token_dtype,
)

__all__ = [
    "DEFAULT_HF_DATASET",
    "EOT_TEXT",
    "PIPELINE_VERSION",
    "SHARD_TOKENS",
    "TEXT_FIELDS",
    "TEXT_SUFFIXES",
    "VAL_NAMES",
    "BatchStream",
    "DataSource",
    "TokenData",
    "TokenSplit",
    "absolute_data_path",
    "check_split",
    "check_targets",
    "default_cache_dir",
    "eval_batches",
    "eval_windows",
    "is_named_source",
    "iter_documents",
    "num_windows",
    "prepare_data",
    "prepare_val_data",
    "resolve_source",
    "source_fingerprint",
    "token_byte_lengths",
    "token_dtype",
    "tokenizer_for",
    "unigram_entropy",
    "validation_source",
]
