"""The whitespace word tokenizer (`eval.toy_tokenizer`), importable from any test as `toy_tokenizer`.

pytest puts tests/ on sys.path for tests/conftest.py.
"""

from __future__ import annotations

from eval.toy_tokenizer import CHAT_TEMPLATE, word_tokenizer

__all__ = ["CHAT_TEMPLATE", "word_tokenizer"]
