"""A whitespace word tokenizer with a chat template: one token per word, built in code, no downloads.

The tests' tokenizer (tests/toy_tokenizer.py re-exports it) and the one saved beside the serving
benchmarks' random-weight models, where it decodes every id of the model's vocabulary.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def word_tokenizer(chat_template: str | None = CHAT_TEMPLATE, vocab_size: int = 0) -> PreTrainedTokenizerFast:
    """Every whitespace-separated word is one token; optional chat template.

    With `vocab_size` N the words "w0".."w{N-1}" are ids 0..N-1 ("w0" pads, "w1" is unknown), so ids
    decode back to text; without it every word is [UNK].
    """
    vocab, unknown = ({f"w{i}": i for i in range(vocab_size)}, "w1") if vocab_size else ({"[UNK]": 0}, "[UNK]")
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unknown))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=unknown, pad_token="w0" if vocab_size else None
    )
    tokenizer.chat_template = chat_template
    return tokenizer
