"""Tool calling through the server, with the official openai client over real HTTP on 127.0.0.1:
forced calls (a named function, ``required``) equal plain greedy decoding under the call grammar
with ngram and EAGLE trees; ``auto`` reads a scripted model's Hermes-style calls; streamed deltas,
reassembled, equal the whole answer; a conversation carries calls and their results back; what
cannot be served is a 400 naming its field. The real default model (e2e) answers a named function
through specdraft's Hermes template with arguments that parse and match its schema."""

from __future__ import annotations

import json

import openai
import pytest

pytest.importorskip("llguidance", reason="tool calling's forced calls need pip install 'specdraft[structured]'")

from specdraft import SpeculativeDecoder  # noqa: E402
from specdraft.server import create_app  # noqa: E402
from specdraft.testing import random_heads, tiny_llama  # noqa: E402
from specdraft.testing.structured import PERSON_SCHEMA, is_person  # noqa: E402
from specdraft.testing.tools import greedy_call, scripted_llama, scripted_tokenizer, tool_tokenizer  # noqa: E402
from specdraft.tools import read_tools  # noqa: E402

pytestmark = pytest.mark.server

GET = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
    "required": ["c", "n"], "additionalProperties": False}}}
SUM = {"type": "function", "function": {"name": "sum"}}
TOOLS = [GET, SUM]
MESSAGES = [{"role": "user", "content": "yes no red"}]
NAMED = {"type": "function", "function": {"name": "get"}}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def streamed(client, **kwargs):
    """A streamed answer reassembled as a client does: ``(content or None, [(id, name, arguments)],
    finish_reason)``; each call's first delta carries its id, type and name."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                if call.id is not None:
                    assert call.index not in calls and call.type == "function" and call.function.name
                    calls[call.index] = [call.id, call.function.name, ""]
                calls[call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def whole(answer):
    message = answer.choices[0].message
    return (message.content, [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()],
            answer.choices[0].finish_reason)


def same_but_ids(a, b) -> bool:
    return a[0] == b[0] and a[2] == b[2] and [c[1:] for c in a[1]] == [c[1:] for c in b[1]]


# -- forced calls --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_parts():
    tok = tool_tokenizer()
    return tiny_llama(vocab_size=len(tok), seed=4), tok  # a seed whose greedy calls end


@pytest.fixture(scope="module", params=["ngram", "eagle-tree"])
def forced(request, tiny_parts, serve, tmp_path_factory):
    """``(url, decoder)``: the tiny model served with the drafter."""
    model, tok = tiny_parts
    options = {}
    if request.param == "eagle-tree":
        heads = random_heads("eagle", model, tmp_path_factory.mktemp("tools-server-eagle"), scale=0.05)
        options = {"heads": str(heads), "min_confidence": 0.0, "tree_budget": 6}
    drafter = "eagle" if request.param == "eagle-tree" else request.param
    with SpeculativeDecoder(model, tok, drafter=drafter, spec_length=3, adaptive=False,
                            drafter_options=options) as dec:
        with serve(create_app(dec, model_name="tiny")) as url:
            yield url, dec


def test_forced_calls_equal_plain_greedy_decoding_under_the_grammar(forced, tiny_parts):
    url, dec = forced
    model, tok = tiny_parts
    client = _client(url)
    for choice in (NAMED, "required"):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=60, temperature=0)
        answer = client.chat.completions.create(**kwargs)
        content, calls, finish = whole(answer)
        request = read_tools(TOOLS, choice)
        expected = greedy_call(model, tok, dec.encode_chat(MESSAGES, tools=request), request)
        assert content is None and calls and all(c[0].startswith("call_") for c in calls)
        if choice == NAMED:
            assert finish == "stop" and [c[1:] for c in calls] == [("get", expected)]
            arguments = json.loads(calls[0][2])
            assert set(arguments) == {"c", "n"} and arguments["c"] in ("red", "blue")
        else:
            assert finish == "tool_calls"
            assert [(c[1], json.loads(c[2])) for c in calls] == [(c["name"], c["parameters"])
                                                                 for c in json.loads(expected)]
        assert same_but_ids(streamed(client, **kwargs), (content, calls, finish))
        if dec.drafter.name == "eagle":  # its trees draft every round
            assert answer.model_extra["spec_decode"]["drafted_tokens"] > 0


# -- auto ------------------------------------------------------------------------------------------------


HERMES = ["GO", "sure", "<tool_call>", '{"name": "get", "arguments": ', '{"c": "red", "n": 1}', "}</tool_call>",
          "<tool_call> ", '{"name": "sum", "arguments": {}}', " </tool_call>"]
SCRIPT_TEMPLATE = "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{% for m in messages %}" \
                  "{{ m.content or '' }} {% for c in m.tool_calls or [] %}{{ c.function.name }} {% endfor %}" \
                  "{% endfor %}GO"


@pytest.fixture(scope="module")
def scripted(serve):
    """``(url, decoder)``: a model whose greedy answer after GO is the Hermes calls of ``HERMES``, served."""
    tok = scripted_tokenizer(HERMES, SCRIPT_TEMPLATE)
    chain = tok.convert_tokens_to_ids(HERMES)
    with SpeculativeDecoder(scripted_llama(len(tok), dict(zip(chain, chain[1:]))), tok, drafter="ngram",
                            spec_length=3, tool_call_parser="hermes") as dec:
        with serve(create_app(dec, model_name="tiny")) as url:
            yield url, dec


def test_auto_reads_the_models_calls_whole_and_streamed(scripted):
    url, dec = scripted
    client = _client(url)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0)
    answer = whole(client.chat.completions.create(**kwargs))
    assert answer[0] == "sure" and answer[2] == "tool_calls"
    assert [(c[1], json.loads(c[2])) for c in answer[1]] == [("get", {"c": "red", "n": 1}), ("sum", {})]
    assert same_but_ids(streamed(client, **kwargs), answer)
    one = whole(client.chat.completions.create(parallel_tool_calls=False, **kwargs))
    assert [c[1] for c in one[1]] == ["get"] and one[2] == "tool_calls"
    assert same_but_ids(streamed(client, parallel_tool_calls=False, **kwargs), one)
    text = whole(client.chat.completions.create(tool_choice="none", **kwargs))
    assert text == ("".join(HERMES[1:]), [], "stop")
    cut = whole(client.chat.completions.create(**{**kwargs, "max_tokens": 4}))  # inside the first call
    assert cut == ("sure<tool_call>" + HERMES[3] + HERMES[4], [], "length")


def test_a_conversation_carries_calls_and_results_back(scripted):
    url, dec = scripted
    client = _client(url)
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=20)
    message = answer.choices[0].message
    follow = MESSAGES + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "done"} for call in message.tool_calls]
    again = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=20)
    offline = dec.encode_chat([{k: v for k, v in m.items()} for m in follow], tools=read_tools(TOOLS))
    assert again.usage.prompt_tokens == len(offline)
    assert "get sum" in dec.tokenizer.decode(offline)  # the template wrote the calls back


@pytest.mark.parametrize("extra, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "is not one of the tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "1 to 64 letters"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "not with tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
])
def test_bad_tool_requests_are_400s(scripted, extra, param, says):
    client = _client(scripted[0])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                       **{"tools": TOOLS, **extra})
    error = caught.value.body
    assert error["param"] == param and says in error["message"], error


def test_what_the_model_cannot_do_is_a_400(tiny_parts, serve):
    """``auto`` for a model whose call format is unknown, and tools for a template that cannot show them."""
    model, tok = tiny_parts
    with SpeculativeDecoder(model, tok, drafter="ngram") as dec, serve(create_app(dec, model_name="tiny")) as url:
        client = _client(url)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4)
        assert caught.value.body["param"] == "tool_choice" and "--tool-call-parser" in caught.value.body["message"]
    plain = tool_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    with SpeculativeDecoder(model, plain, drafter="ngram") as dec, serve(create_app(dec, model_name="tiny")) as url:
        with pytest.raises(openai.BadRequestError) as caught:
            _client(url).chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                 max_tokens=4)
        assert caught.value.body["param"] == "tools" and "--chat-template hermes" in caught.value.body["message"]


# -- the real default model --------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_calls_a_named_function_through_the_hermes_template(request, dtype, serve):
    """SmolLM2's own template has no tools; with specdraft's Hermes template it is shown the
    function, and a named call's arguments parse, match the schema, and equal plain decoding's
    (in float32 and in bfloat16, the CPU default)."""
    model, tokenizer = request.getfixturevalue("default_f32" if dtype == "float32" else "default_bf16")
    person = {"type": "function", "function": {"name": "add_person", "description": "Add a person to the list.",
                                               "parameters": PERSON_SCHEMA}}
    messages = [{"role": "user", "content": "Add Ada, who likes blue, is 36 and scored 9.5."}]
    choice = {"type": "function", "function": {"name": "add_person"}}
    with SpeculativeDecoder(model, tokenizer, drafter="none", chat_template="hermes") as plain:
        expected = plain.chat(messages, tools=[person], tool_choice=choice, max_new_tokens=80)
    assert tokenizer.chat_template != plain.tokenizer.chat_template  # the caller's template is left alone
    with SpeculativeDecoder(model, tokenizer, drafter="prompt-lookup", chat_template="hermes") as dec:
        with serve(create_app(dec, model_name="smol")) as url:
            client = _client(url)
            kwargs = dict(model="smol", messages=messages, tools=[person], tool_choice=choice, max_tokens=80,
                          temperature=0)
            answer = whole(client.chat.completions.create(**kwargs))
            assert same_but_ids(streamed(client, **kwargs), answer)
    assert answer[2] == "stop" and [c[1] for c in answer[1]] == ["add_person"]
    assert answer[1][0][2] == expected.tool_calls[0].arguments and is_person(json.loads(answer[1][0][2]))


def test_logprobs_with_calls_streamed_as_whole_and_no_empty_chunks(scripted):
    """Every output token's log-probability is sent once, streamed or whole, though the text of a
    call is held until the call is read; no chunk carries nothing."""
    client = _client(scripted[0])
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0, logprobs=True)
    answer = client.chat.completions.create(**kwargs)
    tokens = [entry.token for entry in answer.choices[0].logprobs.content]
    assert "".join(tokens) == "".join(HERMES[1:]) + "</s>"  # the end-of-sequence token too
    sent = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            entries = choice.logprobs.content if choice.logprobs is not None else None
            assert entries or choice.delta.content or choice.delta.tool_calls or choice.delta.role \
                or choice.finish_reason, chunk
            sent += [entry.token for entry in entries or ()]
    assert sent == tokens
