"""Tokenizers for the tiny packages, trained here from a built-in corpus (nothing is downloaded).

Both trainers run with fixed settings on a fixed corpus, so two runs give the same vocabulary.
The transformers tokenizer classes are then built from that vocabulary, so loading, padding and
special tokens behave exactly as they do for the real CLIP and T5/UMT5 tokenizers.
"""

from __future__ import annotations

import io
import itertools
from collections import Counter
from typing import Any

import sentencepiece as spm
from tokenizers import pre_tokenizers
from transformers import CLIPTokenizer, T5Tokenizer

CORPUS: tuple[str, ...] = (
    "a photo of a cat sitting on a red chair",
    "a curious raccoon exploring a garden, cinematic lighting",
    "a sunset over the mountains with a lake in the foreground",
    "an astronaut riding a horse on the moon, highly detailed",
    "a bowl of fruit on a wooden table, still life painting",
    "a city street at night in the rain with neon signs",
    "a dog running on the beach at dawn, slow motion",
    "a watercolor painting of a lighthouse by the sea",
    "turn the scene into a watercolor painting",
    "make the sky purple and add two birds",
    "a small robot reading a book in a library",
    "bright tones, overexposed, static, blurred details, subtitles",
    "worst quality, low quality, jpeg compression residue, ugly",
    "a forest of tall trees covered in snow, soft light",
    "a cup of coffee with steam rising, close up, 4k",
    "the quick brown fox jumps over the lazy dog",
    "a cat and a dog baking a cake together in a kitchen",
    "portrait of an old man with a beard, oil on canvas",
    "a red sports car driving along a coastal road",
    "an aerial view of green fields and a winding river",
)


def train_clip_tokenizer(num_merges: int = 200) -> CLIPTokenizer:
    """A CLIP byte-level BPE tokenizer (</w> word suffix), its merges learned from CORPUS.

    The merges are learned here, greedily with ties broken by the pair itself, because the
    tokenizers BPE trainer breaks count ties in hash order and so differs between runs.
    """
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    # Split the corpus exactly as transformers' CLIPTokenizer will split prompts.
    splitter = CLIPTokenizer(vocab={bos: 0, eos: 1}, merges=[]).backend_tokenizer
    words: Counter[tuple[str, ...]] = Counter()
    for line in CORPUS:
        normalized = splitter.normalizer.normalize_str(line)
        for word, _ in splitter.pre_tokenizer.pre_tokenize_str(normalized):
            words[(*word[:-1], word[-1] + "</w>")] += 1
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = Counter({_merge(word, best): count for word, count in words.items()})
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = [*alphabet, *(c + "</w>" for c in alphabet), *(a + b for a, b in merges)]
    vocab = {token: i for i, token in enumerate(dict.fromkeys([bos, eos, *symbols]))}
    # The annotation says list[str], but the BPE model it builds takes (left, right) pairs.
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)  # type: ignore[arg-type]


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train_t5_tokenizer(vocab_size: int = 300, extra_ids: int = 4) -> T5Tokenizer:
    """A T5/UMT5-style sentencepiece Unigram tokenizer: <pad>=0, </s>=1, <unk>=2, sentinels last."""
    model = io.BytesIO()
    # One line with every printable ASCII character, so capitals and punctuation are never <unk>.
    alphabet = " ".join(chr(c) for c in range(33, 127))
    # sentencepiece rather than the tokenizers Unigram trainer: single-threaded it is deterministic,
    # while the latter's scores and tie order vary between runs.
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((*CORPUS, alphabet)),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab_size - extra_ids,
        hard_vocab_limit=False,
        num_threads=1,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        normalization_rule_name="identity",
        character_coverage=1.0,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [(sp.id_to_piece(i), 0.0 if i < 3 else float(sp.get_score(i))) for i in range(sp.get_piece_size())]
    pieces += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(extra_ids))]
    return T5Tokenizer(vocab=pieces, extra_ids=extra_ids, model_max_length=512)


def t5_encoder_shape(tokenizer: Any, d_model: int) -> dict[str, Any]:
    """The tiny T5-family encoder both FLUX's T5 and Wan's UMT5 use, sized to `tokenizer`'s vocabulary."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": d_model,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "feed_forward_proj": "gated-gelu",
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
