"""A byte-level tokenizer: ids 0-255 are bytes, then a few special tokens. No vocabulary files needed."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class ByteTokenizer:
    vocab_size = 260  # 258 and 259 are reserved (pad, unk): the vocabulary the presets' shapes were made for
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return [self.bos_id, *text.encode("utf-8")]

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """A plain chat format: one `<|role|>` header line per message, then the assistant's header."""
        turns = [f"<|{message['role']}|>\n{message['content']}\n" for message in messages]
        return "".join(turns) + "<|assistant|>\n"


class IncrementalDecoder:
    """Turns a token stream into text pieces without splitting multi-byte UTF-8 characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id])) if 0 <= token_id < 256 else ""

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
