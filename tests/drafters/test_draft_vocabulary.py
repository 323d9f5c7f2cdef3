"""A draft must cover every token id the target's tokenizer has: refused at load otherwise."""

from __future__ import annotations

import pytest

from specdraft import ConfigError, DrafterError, SpeculativeDecoder
from specdraft.testing import plain_greedy, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Target (64 ids, tokenizer of 64) and drafts saved with save_pretrained, as users have them."""

    def save(name, vocab, tokenizer_size):
        path = tmp_path_factory.mktemp(name)
        tiny_llama(vocab_size=vocab, seed=len(name), layers=1).save_pretrained(path)
        tiny_tokenizer(tokenizer_size).save_pretrained(path)
        return str(path)

    return {
        "target": save("target", 64, 64),
        "short": save("short", 60, 64),  # the tokenizer's 64 ids, an embedding of 60 rows
        "other-tokenizer": save("other", 64, 48),
        "padded": save("padded", 72, 64),  # 8 rows of padding past the tokenizer: fine
    }


def _load(folders, draft):
    return SpeculativeDecoder.from_pretrained(folders["target"], drafter="draft-model", dtype="float64",
                                              drafter_options={"model": folders[draft], "dtype": "float64"})


def test_a_draft_with_fewer_embedding_rows_than_the_tokenizer_is_refused(folders):
    with pytest.raises(ConfigError, match=rf"draft model '{folders['short']}' cannot draft for target "
                                          rf"'{folders['target']}': its input embedding has 60 rows but the target "
                                          r"uses token ids 0..63 \(64 tokens\)"):
        _load(folders, "short")


def test_a_draft_with_another_tokenizer_is_refused(folders):
    with pytest.raises(ConfigError, match=r"cannot draft for target .*their tokenizers differ \(vocabulary of 64 vs 48"):
        _load(folders, "other-tokenizer")


def test_padded_embedding_rows_are_accepted(folders):
    dec = _load(folders, "padded")
    prompt = [5, 9, 5, 9, 5, 9]
    result = dec.generate_ids([prompt], max_new_tokens=12)[0]
    assert result.token_ids == plain_greedy(dec.model, prompt, 12)


def test_an_id_the_draft_cannot_embed_is_a_drafter_error_naming_it(tmp_path):
    """A target whose output rows exceed its tokenizer (padding) can emit an id past a draft that
    covers the tokenizer only: the drafter says so by name, never IndexError."""
    target = tiny_llama(vocab_size=64, seed=0)
    draft_path = tmp_path / "draft"
    tiny_llama(vocab_size=60, seed=3, layers=1).save_pretrained(draft_path)
    dec = SpeculativeDecoder(target, tiny_tokenizer(60), drafter="draft-model",
                             drafter_options={"model": str(draft_path), "dtype": "float64"})
    with pytest.raises(DrafterError, match=r"drafter 'draft-model' \(draft model .*\) was handed token id 62, "
                                           r"which its embedding of 60 rows cannot embed"):
        dec.generate_ids([[4, 5, 62]], max_new_tokens=8)  # past the plain steps a new policy times first
