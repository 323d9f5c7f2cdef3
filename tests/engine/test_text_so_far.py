"""A stream's text deltas (:class:`~specdraft.engine.stream.TextSoFar`) decode only the tokens past
the settled ones, not the whole output at every burst: checked here against the whole output's
decode after every burst, on tokenizers of each kind transformers ships (byte-level BPE,
SentencePiece-style with byte fallback, word pieces with clean-up that rewrites across tokens),
over random token ids (characters split over tokens, special tokens among them) in random bursts."""

from __future__ import annotations

import json
import random

import pytest

from specdraft.engine.output import INCOMPLETE, output_text
from specdraft.engine.stream import TextSoFar
from specdraft.testing import tiny_tokenizer

CORPUS = ["the cat sat on the mat , and it 's fine .", "naïve café déjà vu — 東京 と 大阪 😀 🎉",
          "def f(x):\n    return x * 2  # twice", "I 'm sure they 've said : no ! why ?"] * 20


def _wrap(tok, **kw):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **kw)


def byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<unk>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _wrap(tok)


def sentencepiece_like():
    """Llama's decoder: ``▁`` to a space, byte fallback (``<0xE6>``...), the first space stripped."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    state = json.loads(trained.to_str())["model"]
    vocab = dict(state["vocab"])
    for b in range(256):  # the byte tokens are ordinary tokens, as in Llama's vocabulary
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = trained.normalizer
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return _wrap(tok)


def word_pieces_with_clean_up():
    """BERT's decoder, and transformers' clean-up (`` .`` -> ``.``, `` 's`` -> ``'s``): a later token
    rewrites the text before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    return _wrap(tok, clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte-level": byte_level_bpe, "sentencepiece": sentencepiece_like, "clean-up": word_pieces_with_clean_up,
              "words": lambda: tiny_tokenizer(64)}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def _outputs(tokenizer, rng: random.Random, count: int):
    """Token lists: random ids, and the corpus's own tokens (real words, whole characters)."""
    vocab = len(tokenizer)
    for i in range(count):
        if i % 2:
            yield [rng.randrange(vocab) for _ in range(rng.randint(1, 90))]
        else:
            ids = tokenizer(rng.choice(CORPUS[:4]) * 3, add_special_tokens=False).input_ids
            start = rng.randrange(len(ids))
            yield ids[start:]


def test_each_bursts_text_is_the_whole_outputs_decode(tokenizer):
    rng = random.Random(0)
    windows = 0
    for tokens in _outputs(tokenizer, rng, 120):
        text = TextSoFar(tokenizer)
        n = 0
        while n < len(tokens):
            n = min(len(tokens), n + rng.choice([1, 1, 2, 3, 5]))
            assert text.decode(tokens[:n]) == tokenizer.decode(tokens[:n], skip_special_tokens=True), (tokens, n)
            windows += text._settled > 0
    assert windows > 200  # most bursts decoded past a settled prefix, not the whole output


def test_the_deltas_add_up_to_the_final_text(tokenizer):
    """Also where a later token rewrites text before it (clean-up's ``they '`` + ``ve``, a byte
    run that a partial character makes invalid): that text waits."""
    rng = random.Random(1)
    early = whole = 0
    for tokens in _outputs(tokenizer, rng, 60):
        text, streamed, n = TextSoFar(tokenizer), "", 0
        while n < len(tokens):
            n = min(len(tokens), n + rng.choice([1, 2, 4]))
            streamed += text.delta(tokens[:n])
        early += len(streamed)
        streamed += text.delta(tokens, "length")
        assert streamed == output_text(tokenizer, tokens, "length")
        whole += len(streamed)
    assert early > 0.8 * whole  # streamed as it came, not held to the end


def test_which_tokenizers_rewrite_text_already_decoded():
    from specdraft.engine.output import byte_fallback_ids, cleans_up_spaces

    assert cleans_up_spaces(word_pieces_with_clean_up()) and not cleans_up_spaces(byte_level_bpe())
    assert not cleans_up_spaces(tiny_tokenizer(64)) and not cleans_up_spaces(object())
    sp = sentencepiece_like()
    assert byte_fallback_ids(sp) == frozenset(sp.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)]))
    assert byte_fallback_ids(byte_level_bpe()) == frozenset() == byte_fallback_ids(object())
