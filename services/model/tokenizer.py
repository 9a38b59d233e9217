"""The embedded default's character-level tokenizer, built with the `tokenizers` library (no hub).

One token per character of `CHARSET` plus three specials (`<pad>` 0, `<eos>` 1, `<unk>` 2). It is
written as a byte-level BPE *without merges*: every character is its own token, and the file is
exactly what transformers' `Qwen2Tokenizer` (which `AutoTokenizer` forces for `model_type: qwen2`
checkpoints in transformers 5), `TokenizersBackend`, vLLM and SGLang all read the same way — a
plain WordLevel tokenizer would be re-wrapped by Qwen2Tokenizer, which drops spaces. No BOS token:
engines tokenize plain-text prompts themselves, and nothing would add it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# The alphabet of the synthetic tasks (services/tasks/synthetic.py keeps every prompt, answer and
# solution inside it): changing it changes every token id of the embedded default.
CHARSET = " 0123456789abcdefghijklmnopqrstuvwxyzQA+-*/=()?:.,<>\\{}[]_^'\"%!"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = (PAD, EOS, UNK)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = keep[:], 0
    for b in range(256):
        if b not in keep:  # unprintable bytes map to 256, 257, ... in byte order
            keep.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return dict(zip(keep, map(chr, chars)))


def vocabulary() -> dict[str, int]:
    """Token -> id: the specials first, then the byte-level form of every character of CHARSET."""
    to_unicode = _byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in CHARSET:
        vocab.setdefault(to_unicode[ord(ch)], len(vocab))
    return vocab


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A char-level fast tokenizer: each character of CHARSET is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab=vocabulary(), merges=[], unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left",
        model_max_length=1024,
    )
