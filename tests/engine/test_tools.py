"""Tool calling through the Python API (``SpeculativeDecoder.chat``) and its parts
(:mod:`specdraft.tools`): a forced call (``required``, a named function) is plain decoding's under
the call grammar (greedy, against llguidance's own matcher; sampled, a chi-square test against
plain sampling's exact law); ``auto`` reads a scripted model's own call format; a streamed reading
equals the whole one wherever the text is cut; every bad request is one line naming its field."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("llguidance", reason="tool calling's forced calls need pip install 'specdraft[structured]'")

import llguidance  # noqa: E402

from specdraft import ConfigError, SamplingParams, SpeculativeDecoder  # noqa: E402
from specdraft.testing import SIGNIFICANCE as ALPHA  # noqa: E402
from specdraft.testing import TargetDrafter, chi_square_pvalue, random_heads, tiny_llama  # noqa: E402
from specdraft.testing.structured import sampling_under_grammar  # noqa: E402
from specdraft.testing.tools import greedy_call, scripted_llama, scripted_tokenizer, tool_tokenizer  # noqa: E402
from specdraft.tools import (CallDelta, ContentDelta, ToolStream, assemble, check_template,  # noqa: E402
                             load_chat_template, read_tools)

GET = {"type": "function", "function": {"name": "get", "description": "look a colour up", "parameters": {
    "type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
    "required": ["c", "n"], "additionalProperties": False}}}
SUM = {"type": "function", "function": {"name": "sum"}}  # no parameters
TOOLS = [GET, SUM]
MESSAGES = [{"role": "user", "content": "yes no red"}]
NAMED = {"type": "function", "function": {"name": "get"}}
#: samples of the sampled test: 4,000 detects Cohen's w = 0.1 at ALPHA with power 0.9 for up to 12 degrees of
#: freedom (specdraft.testing.samples_needed(12) = 3,701)
SAMPLES = 4000


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_llama(vocab_size=len(tok), seed=4)  # a seed whose greedy calls end (integers can run on)


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    return str(random_heads("eagle", model, tmp_path_factory.mktemp("tools-eagle"), scale=0.05))


def _decoder(model, tok, drafter, heads):
    if drafter == "eagle-tree":
        return SpeculativeDecoder(model, tok, drafter="eagle", spec_length=3, adaptive=False, drafter_options={
            "heads": heads, "min_confidence": 0.0, "tree_budget": 6})
    return SpeculativeDecoder(model, tok, drafter=drafter, spec_length=3, adaptive=False)


def _reference(model, tok, dec, choice) -> str:
    """Plain greedy decoding under the call grammar (llguidance's own matcher), as text."""
    request = read_tools(TOOLS, choice)
    return greedy_call(model, tok, dec.encode_chat(MESSAGES, tools=request), request)


# -- forced calls: plain decoding under the grammar ------------------------------------------------


@pytest.mark.parametrize("drafter", ["ngram", "eagle-tree"])
def test_forced_calls_equal_plain_greedy_decoding_under_the_grammar(model, tok, heads, drafter):
    dec = _decoder(model, tok, drafter, heads)
    named = dec.chat(MESSAGES, tools=TOOLS, tool_choice=NAMED, max_new_tokens=60)
    assert named.result.text == _reference(model, tok, dec, NAMED)
    assert named.content is None and [c.name for c in named.tool_calls] == ["get"]
    arguments = json.loads(named.tool_calls[0].arguments)
    assert set(arguments) == {"c", "n"} and arguments["c"] in ("red", "blue") and isinstance(arguments["n"], int)
    assert named.tool_calls[0].arguments == named.result.text and named.finish_reason == "eos"  # OpenAI: "stop"

    required = dec.chat(MESSAGES, tools=TOOLS, tool_choice="required", max_new_tokens=60)
    assert required.result.text == _reference(model, tok, dec, "required")
    calls = json.loads(required.result.text)
    assert [c.name for c in required.tool_calls] == [c["name"] for c in calls] and calls
    assert [json.loads(c.arguments) for c in required.tool_calls] == [c["parameters"] for c in calls]
    assert required.finish_reason == "tool_calls" and required.content is None
    assert sum(r.result.stats.drafted_tokens for r in (named, required)) > 0


def test_sampled_calls_follow_plain_sampling_under_the_grammar(model, tok):
    """Whole outputs of a named function whose arguments are one of two colours (every tokenization
    up to EOS) against plain sampling's exact law under the call grammar: one chi-square test at
    ALPHA over SAMPLES seeded samples. The target drafter drafts from the unconstrained
    distribution, so drafts the grammar forbids are rejected and the residual resampled."""
    colour = {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"],
        "additionalProperties": False}}}
    request = read_tools([colour], NAMED)
    params = SamplingParams(temperature=1.0)
    prompt = [3]
    exact = sampling_under_grammar(model, tok, prompt, llguidance.LLMatcher.grammar_from_json_schema(
        request.grammar().source), params)
    dec = SpeculativeDecoder(model, tok, drafter=TargetDrafter(model, scale=0.5), spec_length=3, adaptive=False,
                             max_batch=512)
    settings = request.apply(dec_settings(params))
    results = dec.generate_ids([prompt] * SAMPLES, settings, seed=5)
    outputs = list(exact)
    index = {o: i for i, o in enumerate(outputs)}
    assert all(tuple(r.token_ids) in index for r in results)
    counts = torch.bincount(torch.tensor([index[tuple(r.token_ids)] for r in results]), minlength=len(outputs))
    assert chi_square_pvalue(counts, torch.tensor([exact[o] for o in outputs])) > ALPHA
    assert len(outputs) > 4 and sum(counts > 0) > 4  # several tokenizations of both colours
    stats = [r.stats for r in results]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.drafted_tokens for s in stats)


def dec_settings(params):
    from specdraft import GenerationSettings

    return GenerationSettings(max_new_tokens=16, **params.model_dump())


# -- auto: the model's own call format ---------------------------------------------------------------


HERMES = ["GO", "sure", "<tool_call>", '{"name": "get", "arguments": ', '{"c": "red", "n": 1}', "}</tool_call>",
          "<tool_call> ", '{"name": "sum", "arguments": {}}', " </tool_call>"]
LLAMA3 = ["GO", '{"name": "get", "parameters": ', '{"c": "blue", "n": 2}', "};", ' {"name": "sum", "parameters": {}}']
#: shows the tools, ends with GO (where the script starts)
SCRIPT_TEMPLATE = "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{% for m in messages %}{{ m.content }} " \
                  "{% endfor %}GO"


def scripted(pieces, **options):
    """A decoder whose greedy output after the chat template's GO is ``pieces[1:]``, then EOS."""
    tok = scripted_tokenizer(pieces, SCRIPT_TEMPLATE)
    chain = tok.convert_tokens_to_ids(pieces)
    model = scripted_llama(len(tok), dict(zip(chain, chain[1:])))
    return SpeculativeDecoder(model, tok, drafter="ngram", spec_length=3, **options)


def test_auto_reads_the_models_own_calls():
    dec = scripted(HERMES, tool_call_parser="hermes")
    answer = dec.chat(MESSAGES, tools=TOOLS)
    assert answer.content == "sure" and answer.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [("get", {"c": "red", "n": 1}),
                                                                            ("sum", {})]
    assert len({c.id for c in answer.tool_calls}) == 2 and all(c.id.startswith("call_") for c in answer.tool_calls)
    one = dec.chat(MESSAGES, tools=TOOLS, parallel_tool_calls=False)
    assert [c.name for c in one.tool_calls] == ["get"]
    text = dec.chat(MESSAGES, tools=TOOLS, tool_choice="none")
    assert text.tool_calls == [] and text.content == "".join(HERMES[1:]) and text.finish_reason == "eos"

    llama = scripted(LLAMA3, tool_call_parser="llama3_json")
    answer = llama.chat(MESSAGES, tools=TOOLS)
    assert answer.content is None and [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [
        ("get", {"c": "blue", "n": 2}), ("sum", {})]


def test_auto_needs_a_known_call_format():
    dec = scripted(HERMES)  # the template has no <tool_call>: no parser chosen
    assert dec.tool_call_parser is None
    with pytest.raises(ConfigError, match="--tool-call-parser") as caught:
        dec.chat(MESSAGES, tools=TOOLS)
    assert caught.value.param == "tool_choice"
    assert dec.chat(MESSAGES, tools=TOOLS, tool_choice="required", max_new_tokens=4).finish_reason == "length"


# -- reading calls: streamed equals whole ------------------------------------------------------------


READINGS = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get", "arguments": {"c": "red", "n": 1}}\n</tool_call>\n'
               '<tool_call>{"name": "sum", "arguments": {}}</tool_call>',
     "Let me look.", [("get", '{"c": "red", "n": 1}'), ("sum", "{}")]),
    ("hermes", "a <tool_call>not json</tool_call> b <tool_", "a <tool_call>not json</tool_call> b <tool_", []),
    ("hermes", '<tool_call>{"name": "get", "arguments": {"c": "}"}}', None, [("get", '{"c": "}"}')]),  # unclosed
    ("hermes", "  \n", "  \n", []),
    ("llama3_json", '<|python_tag|>{"name": "get", "parameters": {"s": "a;b}"}}; {"name": "sum", "parameters": {}}',
     None, [("get", '{"s": "a;b}"}'), ("sum", "{}")]),
    ("llama3_json", 'I think {"name": "get"}', 'I think {"name": "get"}', []),
    ("llama3_json", ' {"name": "get", "parameters": {}} and then, some text', " and then, some text", [("get", "{}")]),
    ("llama3_json", '{"a": 1}\n{"b": 2} }{"name": "sum", "parameters": {}}', '{"a": 1}\n{"b": 2} }', [("sum", "{}")]),
    ("llama3_json", '{"name": "get", "parameters": {"c": ', '{"name": "get", "parameters": {"c": ', []),  # cut short
    ("required", '[{"name": "get", "parameters": {"c": "]}"}}, {"name": "sum", "parameters": {}}]', None,
     [("get", '{"c": "]}"}'), ("sum", "{}")]),
    ("required", '[{"name": "get", "parameters": {}}, {"name": "su', '{"name": "su', [("get", "{}")]),
    ("named", '{"c": "red", "n": 1}', None, [("get", '{"c": "red", "n": 1}')]),
    ("none", "<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>", []),
]


def _stream(kind: str) -> ToolStream:
    if kind in ("hermes", "llama3_json"):
        return read_tools(TOOLS).stream(kind)
    return read_tools(TOOLS, NAMED if kind == "named" else kind).stream(None)


@pytest.mark.parametrize("kind, text, content, calls", READINGS)
def test_a_streamed_reading_equals_the_whole_one(kind, text, content, calls):
    whole = _stream(kind).read(text)
    assert whole[0] == content and [(c.name, c.arguments) for c in whole[1]] == calls
    rng = random.Random(0)
    for _ in range(20):  # the text cut anywhere, a character at a time included
        stream, deltas, at = _stream(kind), [], 0
        while at < len(text):
            step = 1 if rng.random() < 0.3 else rng.randrange(1, 8)
            deltas += stream.add(text[at:at + step])
            at += step
        deltas += stream.end()
        read = assemble(deltas)
        assert read[0] == content and [(c.name, c.arguments) for c in read[1]] == calls
        starts = [d for d in deltas if isinstance(d, CallDelta) and d.name is not None]
        assert [d.index for d in starts] == list(range(len(calls)))  # each call announced once, in order
        if kind == "hermes" and calls:  # no text of a call is ever sent as content
            assert "<tool" not in "".join(d.text for d in deltas if isinstance(d, ContentDelta))


def test_required_keeps_each_schemas_own_references(tok):
    """A function's ``$defs`` and ``$ref`` (what pydantic writes) still resolve once its schema sits
    inside the call array's grammar, recursion included; a schema without a type is an object."""
    import llguidance

    from specdraft.testing.structured import grammar_matcher

    node = {"type": "object", "properties": {"l": {"$ref": "#/$defs/L"}, "r": {"$ref": "#"}},
            "$defs": {"L": {"enum": ["ab"]}}, "required": ["l"], "additionalProperties": False}
    typeless = {"properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    request = read_tools([{"type": "function", "function": {"name": "ab", "parameters": node}},
                          {"type": "function", "function": {"name": "be", "parameters": typeless}}], "required")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(request.grammar().source))
    for text, ok in [('[{"name": "ab", "parameters": {"l": "ab", "r": {"l": "ab"}}}, {"name": "be", "parameters": '
                      '{"n": 1}}]', True), ('[{"name": "be", "parameters": 1}]', False)]:
        matcher = grammar_matcher(tok, grammar)
        assert (matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()) == ok


def test_calls_after_the_first_are_not_read_without_parallel_calls():
    stream = read_tools(TOOLS, parallel_tool_calls=False).stream("hermes")
    content, calls = stream.read('<tool_call>{"name": "get", "arguments": {}}</tool_call>'
                                 '<tool_call>{"name": "sum", "arguments": {}}</tool_call>')
    assert content is None and [c.name for c in calls] == ["get"]
    grammar = json.loads(read_tools(TOOLS, "required", parallel_tool_calls=False).grammar().source)
    assert grammar["maxItems"] == 1 and grammar["minItems"] == 1


# -- templates ---------------------------------------------------------------------------------------


def test_the_hermes_template_shows_tools_calls_and_results(tok):
    conversation = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Colour?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"c": "red", "n": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "scarlet"},
    ]
    from specdraft.tools import template_messages

    text = tok.apply_chat_template(template_messages(conversation), tools=read_tools(TOOLS).template_tools(),
                                   chat_template=load_chat_template("hermes"), tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(GET) in text or '"name": "get"' in text
    assert '<tool_call>\n{"name": "get", "arguments": {"c": "red", "n": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nscarlet\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n") and text.count("Be brief.") == 1


def test_a_template_that_cannot_show_them_is_refused(model):
    tok = tool_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content }} {% endfor %}"
    dec = SpeculativeDecoder(model, tok, drafter="ngram")
    with pytest.raises(ConfigError, match="does not show tools") as caught:
        dec.chat(MESSAGES, tools=TOOLS, tool_choice="required")
    assert caught.value.param == "tools"
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}]
    with pytest.raises(ConfigError, match="does not write an assistant's tool calls"):
        dec.encode_chat(MESSAGES + calls)
    hermes = SpeculativeDecoder(model, tool_tokenizer(), drafter="ngram", chat_template="hermes")
    assert hermes.tool_call_parser == "hermes"  # read from the template's call format
    # transformers' own {% generation %} tag (fine-tuning templates) is not Jinja's: the names are still found
    tagged = tool_tokenizer()
    tagged.chat_template = ("{% for t in tools %}{{ t.function.name }} {% endfor %}{% for m in messages %}"
                            "{% generation %}{{ m.content }} {% endgeneration %}{% endfor %}")
    check_template(tagged, True, MESSAGES)


@pytest.mark.parametrize("tools, choice, parallel, param, says", [
    ("get", None, None, "tools", "must be a list"),
    ([{"type": "function"}], None, None, "tools.0", "a tool must be"),
    ([{"type": "code_interpreter"}], None, None, "tools.0", "a tool must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools.0.function.name", "1 to 64 letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "tools.0.function.parameters",
     "JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None, "tools.0.function.strict",
     "true or false"),
    ([{"type": "function", "function": {"name": "f", "args": {}}}], None, None, "tools.0.function.args", "unknown key"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, None,
     "tools.0.function.parameters", "a JSON object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"maximum": float("inf")}}}], None, None,
     "tools.0.function.parameters", "not a JSON schema"),
    ([{"type": "function", "function": {"name": "caf\u00e9"}}], None, None, "tools.0.function.name", "letters"),
    (TOOLS, {"type": "function", "function": {"name": "get", "arguments": "{}"}}, None, "tool_choice", "nothing else"),
    ([SUM, SUM], None, None, "tools", "given twice"),
    (TOOLS, "always", None, "tool_choice", "must be none, auto, required"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "is not one of the tools"),
    (None, "required", None, "tool_choice", "needs tools"),
    (TOOLS, None, "yes", "parallel_tool_calls", "true or false"),
])
def test_bad_tools_name_the_field(tools, choice, parallel, param, says):
    with pytest.raises(ConfigError, match=says) as caught:
        read_tools(tools, choice, parallel)
    assert caught.value.param == param and "\n" not in str(caught.value)


def test_bad_chat_requests(model, tok):
    dec = SpeculativeDecoder(model, tok, drafter="ngram")
    with pytest.raises(ConfigError, match="response_format: not with tool_choice 'required'"):
        dec.chat(MESSAGES, tools=TOOLS, tool_choice="required", response_format="json_object")
    with pytest.raises(ConfigError, match="n=1"):
        dec.chat(MESSAGES, tools=TOOLS, tool_choice="required", n=2)
    with pytest.raises(ConfigError, match="tool call parser 'xml'"):
        SpeculativeDecoder(model, tok, drafter="ngram", tool_call_parser="xml")
    with pytest.raises(ConfigError, match="chat template 'nope'"):
        SpeculativeDecoder(model, tok, drafter="ngram", chat_template="nope")
    bad = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get", "arguments": "[1]"}}]}]
    with pytest.raises(ConfigError, match="must be a JSON object") as caught:
        dec.encode_chat(MESSAGES + bad)
    assert caught.value.param == "messages.1.tool_calls.0.function.arguments"
