"""Two tokenizers of one vocabulary size but other tokens are told apart, whatever form the library
hands the vocabulary in (megatron-core's text tokenizers give a list, transformers a dict).

1. the tokenizer fingerprint a cache records differs for two real Hugging Face tokenizers of equal
   size whose ids map to other tokens, and is equal for a copy of one of them
2. ``vocabulary`` reads a list, a dict and a ``get_vocab()`` object alike; a tokenizer without a
   table (NullTokenizer) has none
3. a Hugging Face teacher whose tokenizer has the dataset tokenizer's size but other tokens is
   refused at ``cache build`` in one line naming the first differing id
"""

import shutil

import pytest

from megatron_kd.cache import CacheError
from megatron_kd.megatron.data import tokenizer_fingerprint, vocabulary
from megatron_kd.teacher.build import check_teacher_tokenizer
from tests.fixtures.chat_inputs import CHATML_SPECIALS, megatron_tokenizer, save_tokenizer

# the same three special tokens in another order: the same size, ids 1 and 2 swapped
SWAPPED = [CHATML_SPECIALS[0], CHATML_SPECIALS[2], CHATML_SPECIALS[1]]


@pytest.fixture
def two_tokenizers(tmp_path):
    first = save_tokenizer(tmp_path / "first", CHATML_SPECIALS, eos="<|im_end|>")
    second = save_tokenizer(tmp_path / "second", SWAPPED, eos="<|im_end|>")
    return first, second


def test_equal_size_vocabularies_have_other_fingerprints(two_tokenizers, tmp_path):
    first, second = two_tokenizers
    a, b = megatron_tokenizer(first), megatron_tokenizer(second)
    assert a.vocab_size == b.vocab_size
    assert isinstance(a.vocab, list)  # what megatron-core hands out: the form the fingerprint once skipped
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
    copy = shutil.copytree(first, tmp_path / "copy")
    assert tokenizer_fingerprint(megatron_tokenizer(copy)) == tokenizer_fingerprint(a)


def test_vocabulary_reads_every_form():
    class Listed:
        vocab = ["a", "b"]

    class Mapped:
        vocab = {"b": 1, "a": 0}

    class Library:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    class Null:
        @property
        def vocab(self):
            raise NotImplementedError

    class Wrapped:
        vocab = Library()

    for tokenizer in (Listed(), Mapped(), Library(), Wrapped()):
        assert vocabulary(tokenizer) == {"a": 0, "b": 1}, type(tokenizer).__name__
    assert vocabulary(Null()) is None


def test_a_teacher_with_other_tokens_of_the_same_size_is_refused(two_tokenizers):
    first, second = two_tokenizers
    dataset_tokenizer = megatron_tokenizer(first)
    check_teacher_tokenizer(str(first), dataset_tokenizer)  # its own tokenizer: accepted
    with pytest.raises(CacheError, match=r"vocabulary differs from the dataset's tokenizer \(first at id 1: "):
        check_teacher_tokenizer(str(second), dataset_tokenizer)
