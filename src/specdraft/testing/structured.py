"""A tiny tokenizer that grammar engines can read, and references for structured output written
without specdraft's code: the tokens a grammar allows after an output (a fresh llguidance matcher
per prefix, none of :mod:`specdraft.grammar`), plain greedy decoding under it (a full
forward per token), and the exact distribution of plain sampling under it (enumerated)."""

from __future__ import annotations

from typing import Sequence

#: the tiny tokenizer's pieces after its special tokens (``<pad> <s> </s>``, ids 0-2); "Ġ" is a space
PIECES = ("a", "b", "c", "d", "e", "g", "l", "m", "n", "o", "r", "s", "t", "u", "y", "Ġ", "{", "}", '"', ":", ",",
          "0", "1", "2", "ye", "yes", "no", "re", "red", "bl", "ue", "blue", "ay", "be")
MERGES = (("y", "e"), ("ye", "s"), ("n", "o"), ("r", "e"), ("re", "d"), ("b", "l"), ("u", "e"), ("bl", "ue"),
          ("a", "y"), ("b", "e"))
#: the tiny tokenizer's EOS id
EOS = 2


def tiny_bpe_tokenizer(extra=()):
    """A byte-level BPE tokenizer of 37 ids (``<pad> <s> </s>``, then :data:`PIECES`, then the
    byte-level characters ``extra``) whose text is the concatenation of its tokens' (llguidance
    reads it; :func:`specdraft.testing.tiny_tokenizer`'s word-level one it cannot). Words have
    several tokenizations ("yes": ``yes``, ``ye s``, ``y e s``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(special + list(PIECES) + list(extra))}
    tok = Tokenizer(models.BPE(vocab, list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in special])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def grammar_matcher(tokenizer, grammar: str, eos: int = EOS):
    """A fresh llguidance matcher of ``grammar`` (llguidance's grammar text, e.g.
    ``llguidance.grammar_from("choice", '["yes", "no"]')``) over ``tokenizer``, built with
    llguidance's own API (none of :mod:`specdraft.grammar`)."""
    import llguidance

    vocab = len(tokenizer)
    return llguidance.LLMatcher(llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=vocab,
                                                       eos_token=eos), grammar, log_level=0)


def allowed_after(tokenizer, grammar: str, output: Sequence[int], eos: int = EOS) -> list[int]:
    """The tokens ``grammar`` allows after ``output``, from a fresh matcher (EOS where it may end)."""
    matcher = grammar_matcher(tokenizer, grammar, eos)
    assert matcher.consume_tokens(list(output)), matcher.get_error()
    mask = matcher.compute_bitmask()
    return [i for i in range(len(tokenizer)) if mask[i >> 3] >> (i & 7) & 1]


def greedy_under_grammar(model, tokenizer, prompt: Sequence[int], grammar: str, eos: int = EOS,
                         max_new_tokens: int = 16) -> list[int]:
    """Plain greedy decoding of ``model`` (a transformers model; a full forward per token) with
    every step's argmax taken over :func:`allowed_after`'s tokens, up to EOS."""
    import torch

    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([list(prompt) + out])).logits[0, -1].double()
            token = max(allowed_after(tokenizer, grammar, out, eos), key=lambda i: (float(logits[i]), -i))
            out.append(token)
            if token == eos:
                break
    return out


def sampling_under_grammar(model, tokenizer, prompt: Sequence[int], grammar: str, params,
                           eos: int = EOS) -> dict[tuple[int, ...], float]:
    """P(output) of plain sampling from ``model`` with every step's logits -inf outside
    :func:`allowed_after`'s tokens, then :func:`~specdraft.testing.reference.reference_probs`,
    enumerated over every output up to EOS (a grammar with finitely many outputs)."""
    import torch

    from .reference import reference_probs

    done: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        while frontier:
            nxt: dict[tuple[int, ...], float] = {}
            for out, p in frontier.items():
                context = torch.tensor([list(prompt) + list(out)])
                logits = model(context).logits[:, -1].double()
                mask = torch.full_like(logits, float("-inf"))
                mask[0, allowed_after(tokenizer, grammar, out, eos)] = 0
                probs = reference_probs(logits + mask, context, torch.tensor([list(out)], dtype=torch.long), params)[0]
                for t in probs.nonzero()[:, 0].tolist():
                    (done if t == eos else nxt)[out + (t,)] = p * float(probs[t])
            frontier = nxt
    return done


#: A JSON schema with a string, an enum, an integer and a number, all required and nothing else:
#: what the default model's structured-output tests ask for (see :func:`is_person`).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "color": {"enum": ["red", "green", "blue"]},
                   "age": {"type": "integer"}, "score": {"type": "number"}},
    "required": ["name", "color", "age", "score"],
    "additionalProperties": False,
}


def is_person(value) -> bool:
    """Whether the parsed JSON ``value`` is valid under :data:`PERSON_SCHEMA` (a small validator:
    no jsonschema dependency)."""
    types = {"name": str, "age": int, "score": (int, float)}
    return (isinstance(value, dict) and set(value) == set(PERSON_SCHEMA["required"])
            and value["color"] in PERSON_SCHEMA["properties"]["color"]["enum"]
            and all(isinstance(value[k], t) and not isinstance(value[k], bool) for k, t in types.items()))
