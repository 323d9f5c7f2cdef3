"""Tokens per target pass of forced tool calls (``tool_choice`` "required" or a named function,
decoded under the call grammar), with each drafter, and whether every call equals plain decoding's.

    python benchmarks/tool_call_acceptance.py
    python benchmarks/tool_call_acceptance.py --drafters none,suffix --target FOLDER --chat-template hermes

The calls' JSON is half boilerplate (``{"name": "...", "parameters": {"``) that lookup drafters
find in the tools the prompt shows; the figures are acceptance, not time (``specdraft bench``
measures time). Every round drafts ``--spec-length`` tokens (no adaptive length, which follows
measured costs and so the machine's load), so the figures repeat exactly. The four requests are
written here (Spec-Bench has no tool calls).
"""

from __future__ import annotations

import argparse

from specdraft import SpeculativeDecoder

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "color": {"enum": ["red", "green", "blue"]},
                                           "age": {"type": "integer"}, "score": {"type": "number"}},
          "required": ["name", "color", "age", "score"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "add_person", "description": "Add a person to the list.",
                                      "parameters": PERSON}},
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
]
ASKS = [
    ("Add Ada, who likes blue, is 36 and scored 9.5.", {"type": "function", "function": {"name": "add_person"}}),
    ("Add Bob, who likes red, is 41 and scored 7.", "required"),
    ("What is the weather in Paris, in celsius?", "required"),
    ("What is the weather in Tokyo?", {"type": "function", "function": {"name": "get_weather"}}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="the model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--drafters", default="none,prompt-lookup,ngram,suffix,eagle3")
    p.add_argument("--chat-template", default="hermes")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec-length", type=int, default=4)
    args = p.parse_args()
    plain = None
    for drafter in args.drafters.split(","):
        with SpeculativeDecoder.from_pretrained(args.target, drafter=drafter, spec_length=args.spec_length,
                                                adaptive=False, chat_template=args.chat_template) as dec:
            calls, new, passes, accepted, drafted = [], 0, 0, 0, 0
            for text, choice in ASKS:
                answer = dec.chat([{"role": "user", "content": text}], tools=TOOLS, tool_choice=choice,
                                  max_new_tokens=args.max_tokens, temperature=0)
                calls.append([(c.name, c.arguments) for c in answer.tool_calls])
                stats = answer.result.stats
                new, passes = new + stats.new_tokens, passes + stats.target_passes
                accepted, drafted = accepted + stats.accepted_tokens, drafted + stats.drafted_tokens
        plain = calls if plain is None else plain
        print(f"{drafter:14s} same calls as the first: {calls == plain}  tokens {new}  target passes {passes}  "
              f"tokens/pass {new / passes:.2f}  accepted/drafted {accepted}/{drafted}")


if __name__ == "__main__":
    main()
