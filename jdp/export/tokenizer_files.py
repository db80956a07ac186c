"""A run's tokenizer as the files `transformers.AutoTokenizer` reads: tokenizer.json (the
fast tokenizer) or tokenizer.model (SentencePiece), and tokenizer_config.json.

The byte tokenizer becomes a byte-level BPE without merges whose ids are the bytes
(GPT-2's byte-to-character table) plus <|endoftext|> at 256; a "bpe:N" or "hf:PATH"
tokenizer's tokenizer.json is copied as it is; a SentencePiece model is copied as
tokenizer.model for `LlamaTokenizer` without the prefix space and the bos it would
add. None adds special tokens when encoding, as jdp's tokenizers do not:
`AutoTokenizer` encodes text to the ids of jdp's token store.
"""

from __future__ import annotations

import json
import os
import shutil

from jdp.data.text import tokenizers
from jdp.errors import ConfigError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SENTENCEPIECE_MODEL = "tokenizer.model"


def byte_to_character() -> dict[int, str]:
    """GPT-2's table: each byte as a printable character (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _write_byte_tokenizer(path: str) -> str:
    """A tokenizer.json computing jdp's ByteTokenizer; returns its eos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {character: byte for byte, character in byte_to_character().items()}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens([tokenizers.HF_EOS])
    if model.token_to_id(tokenizers.HF_EOS) != tokenizers.ByteTokenizer.eos_id:
        raise AssertionError("the byte tokenizer's eos must be id 256")
    model.save(path)
    return tokenizers.HF_EOS


def write(tokenizer: tokenizers.Tokenizer, out: str, *, max_len: int) -> None:
    """Writes `tokenizer` into directory `out` for AutoTokenizer."""
    path = os.path.join(out, TOKENIZER_JSON)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    if isinstance(tokenizer, tokenizers.ByteTokenizer):
        eos = _write_byte_tokenizer(path)
    elif isinstance(tokenizer, tokenizers.HfTokenizer):
        shutil.copyfile(tokenizer.path, path)
        eos = tokenizer.eos_token
    elif isinstance(tokenizer, tokenizers.SentencePieceTokenizer):
        shutil.copyfile(tokenizer.path, os.path.join(out, SENTENCEPIECE_MODEL))
        eos = tokenizer.eos_token
        # jdp's SentencePiece models have no dummy prefix and add no bos.
        config.update(tokenizer_class="LlamaTokenizer", legacy=False, add_prefix_space=False,
                      add_bos_token=False, add_eos_token=False, unk_token=tokenizer.unk_token)
    else:
        raise ConfigError(f"data.tokenizer={tokenizer.spec!r}: the export writes byte, bpe:N, "
                          "hf: and sentencepiece: tokenizers. Fix: train with one of those.")
    config.update(eos_token=eos, bos_token=eos)
    with open(os.path.join(out, TOKENIZER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
