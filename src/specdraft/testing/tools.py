"""Tiny models and templates for tests of tool calling: a tokenizer whose JSON can spell calls
(with ``[`` and ``]``), a chat template that shows tools, and a *scripted* model, whose greedy
next token depends on the current token only, to emit a model's own call format (``auto``)."""

from __future__ import annotations

from typing import Mapping, Sequence

from .structured import EOS, tiny_bpe_tokenizer

#: a chat template that shows the tools' names and writes an assistant's calls (every character
#: one the tiny tokenizer spells)
TOOLS_TEMPLATE = ("{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{% for m in messages %}"
                  "{{ m.content or '' }} {% for c in m.tool_calls or [] %}{{ c.function.name }}"
                  "{{ c.function.arguments | tojson }} {% endfor %}{% endfor %}")


#: the characters a call array needs beyond the tiny tokenizer's (``[{"name": ..., "parameters": ...}]``)
CALL_PIECES = ("[", "]", "p", "i")


def tool_tokenizer():
    """:func:`~specdraft.testing.structured.tiny_bpe_tokenizer` with :data:`CALL_PIECES` and
    :data:`TOOLS_TEMPLATE`."""
    tokenizer = tiny_bpe_tokenizer(extra=CALL_PIECES)
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def scripted_tokenizer(pieces: Sequence[str], template: str):
    """:func:`tool_tokenizer` with each of ``pieces`` one token (added, not special: it decodes as
    its text) and ``template`` as its chat template."""
    from tokenizers import AddedToken

    tokenizer = tiny_bpe_tokenizer(extra=CALL_PIECES)
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    tokenizer.chat_template = template
    return tokenizer


def scripted_llama(vocab_size: int, script: Mapping[int, int], default: int = EOS, dtype=None):
    """A Llama whose next token after token ``c`` is ``script[c]`` (``default`` for any other),
    by a wide margin: its layers add nothing to the residual stream (zero output projections), so
    the last position's state is its token's embedding, a one-hot row that ``lm_head`` maps to the
    scripted successor. Real attention and MLP weights still run (random, their outputs zeroed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 64
    if vocab_size > hidden:
        raise ValueError(f"a scripted model holds at most {hidden} tokens, got {vocab_size}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype or torch.float64).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size, hidden))
        head = torch.zeros(vocab_size, hidden)
        for c in range(vocab_size):
            head[script.get(c, default), c] = 4.0
        model.lm_head.weight.copy_(head)
    return model


def greedy_call(model, tokenizer, prompt, request, max_new_tokens: int = 60) -> str:
    """Plain greedy decoding of ``model`` under ``request``'s call grammar (a
    :class:`~specdraft.tools.ToolRequest` that forces a call), llguidance's own matcher at every
    step (none of specdraft's grammar code), as text; it must end within ``max_new_tokens``."""
    import llguidance

    from .structured import greedy_under_grammar

    grammar = llguidance.LLMatcher.grammar_from_json_schema(request.grammar().source)
    out = greedy_under_grammar(model, tokenizer, prompt, grammar, max_new_tokens=max_new_tokens)
    assert out[-1] == EOS, "the reference should end within its limit"
    return tokenizer.decode(out[:-1])


__all__ = ["greedy_call", "TOOLS_TEMPLATE", "scripted_llama", "scripted_tokenizer", "tool_tokenizer"]
