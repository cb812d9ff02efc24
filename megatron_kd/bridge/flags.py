"""The Megatron-LM data flags of a Bridge config: what ``megatron-kd cache build`` takes to hold the
windows Bridge's dataset yields for the recipe.

Bridge and Megatron-LM build the same megatron-core GPTDataset from the same settings under
different names; ``megatron_data_flags(cfg)`` writes Bridge's as Megatron-LM's flags:

- ``dataset.blend`` / ``data_path``: ``--data-path`` (weights before their paths); ``dataset.blend_per_split``:
  ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``;
- ``dataset.split``, ``seq_length``, ``random_seed``: ``--split``, ``--seq-length``, ``--seed`` (always written:
  they choose the windows);
- ``dataset.reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``, ``path_to_cache``,
  ``mmap_bin_files``, ``mid_level_dataset_surplus``, ``num_dataset_builder_threads``,
  ``allow_ambiguous_pad_tokens``: their flags (``DATASET_FLAGS``), where they differ from Megatron-LM's default;
- ``tokenizer.<field>`` for each of ``TOKENIZER_FIELDS``: the flag Megatron-LM's parser has for it (one name
  in both);
- ``train.micro_batch_size``, ``global_batch_size``, ``train_iters`` / ``train_samples``: their flags, so the
  cache holds the samples the run consumes; ``validation.eval_interval``, ``eval_iters``: theirs.

A setting that changes the windows and has no flag (``add_extra_token_to_sequence``, a Hugging Face
tokenizer ``revision``) is one ``BridgeError`` line. The cache is keyed by the tokens of each window,
so a cache built with these flags serves the Bridge run whose dataset yields the same windows, and
training refuses one that yields others, with the count held (``TeacherRows``).
"""

from __future__ import annotations

import argparse

from megatron_kd.bridge.compat import BridgeError

# Megatron-LM's tokenizer settings: the same field names in Bridge's TokenizerConfig and the parser's dests
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_size", "vocab_file", "merge_file", "vocab_extra_ids",
                    "special_tokens", "tiktoken_pattern", "tiktoken_num_special_tokens",
                    "tokenizer_sentencepiece_legacy", "tokenizer_sentencepiece_ignore_extra_whitespaces",
                    "tokenizer_hf_no_use_fast", "tokenizer_hf_no_include_special_tokens", "trust_remote_code",
                    "null_tokenizer_eod_id", "null_tokenizer_pad_id", "chat_template")
DATASET_FLAGS = {"random_seed": "seed", "seq_length": "seq_length", "split": "split",
                 "reset_position_ids": "reset_position_ids", "reset_attention_mask": "reset_attention_mask",
                 "eod_mask_loss": "eod_mask_loss", "path_to_cache": "data_cache_path",
                 "mmap_bin_files": "mmap_bin_files", "mid_level_dataset_surplus": "mid_level_dataset_surplus",
                 "num_dataset_builder_threads": "num_dataset_builder_threads",
                 "allow_ambiguous_pad_tokens": "allow_ambiguous_pad_tokens"}


def _blend_words(blend) -> list[str]:
    """A megatron-core blend (paths, weights or None) as ``--data-path`` words."""
    paths, weights = blend
    if weights is None:
        return [str(p) for p in paths]
    return [word for weight, path in zip(weights, paths) for word in (repr(float(weight)), str(path))]


def _words(action: argparse.Action, value, *, always: bool = False) -> list[str]:
    """``value`` for ``action`` as command-line words; [] where it is None or (unless ``always``) the
    parser's default."""
    if value is None or (value == action.default and not always):
        return []
    flag = action.option_strings[0]
    if action.nargs == 0:  # store_true / store_false: the flag sets the value its default is not
        return [flag]
    if action.nargs in ("*", "+"):
        return [flag, *(str(v) for v in value)]
    return [flag, str(value)]


def megatron_data_flags(cfg) -> list[str]:
    """Megatron-LM flags for ``cfg``'s data, tokenizer and sample count (module docstring)."""
    from megatron_kd.megatron.flags import megatron_parser

    actions = {a.dest: a for a in megatron_parser()._actions if a.option_strings}
    dataset, tokenizer = cfg.dataset, cfg.tokenizer
    if not getattr(dataset, "add_extra_token_to_sequence", True):
        raise BridgeError("cfg.dataset.add_extra_token_to_sequence is False: Megatron-LM has no flag for it (its "
                          "windows are seq_length + 1 tokens); set it True to build the cache with megatron-kd")
    if (tokenizer.hf_tokenizer_kwargs or {}).get("revision"):
        raise BridgeError("cfg.tokenizer.hf_tokenizer_kwargs['revision'] has no Megatron-LM flag: give the tokenizer's "
                          "local snapshot directory as cfg.tokenizer.tokenizer_model")
    words: list[str] = []
    if dataset.blend_per_split is not None:
        for flag, blend in zip(("--train-data-path", "--valid-data-path", "--test-data-path"), dataset.blend_per_split):
            if blend is not None:
                words += [flag, *_blend_words(blend)]
    elif dataset.blend is not None:
        words += ["--data-path", *_blend_words(dataset.blend)]
    elif dataset.data_path:
        paths = dataset.data_path.split() if isinstance(dataset.data_path, str) else [str(p) for p in dataset.data_path]
        words += ["--data-path", *paths]
    else:
        raise BridgeError("cfg.dataset has no data (blend, blend_per_split or data_path): mock data has no files a "
                          "cache can be built from")
    for field, dest in DATASET_FLAGS.items():  # the window's own settings always written
        words += _words(actions[dest], getattr(dataset, field), always=field in ("random_seed", "seq_length", "split"))
    for field in TOKENIZER_FIELDS:
        words += _words(actions[field], getattr(tokenizer, field, None))
    train, validation = cfg.train, cfg.validation
    words += ["--micro-batch-size", str(train.micro_batch_size), "--global-batch-size", str(train.global_batch_size)]
    words += ["--train-samples", str(train.train_samples)] if train.train_samples else \
        ["--train-iters", str(train.train_iters)]
    words += _words(actions["eval_interval"], validation.eval_interval)
    words += _words(actions["eval_iters"], validation.eval_iters)
    return words
