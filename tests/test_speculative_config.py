"""vLLM's ``--speculative-config`` / ``speculative_config=``: each method gives the drafter
configuration its equivalent flags give, and a config specdraft cannot honour is one line."""

from __future__ import annotations

import json

import pytest

from specdraft import ConfigError, SpeculativeDecoder
from specdraft.cli import build_parser, main
from specdraft.cli_args import resolve_drafter
from specdraft.speculative_config import read_speculative_config
from specdraft.testing import plain_greedy, repetitive_prompts

#: (vLLM's config, the equivalent specdraft flags)
EQUIVALENT = [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
     ["--drafter", "prompt-lookup", "--spec-length", "3", "--drafter-option", "max_ngram=4",
      "--drafter-option", "min_ngram=2"]),
    ({"method": "ngram"}, ["--drafter", "prompt-lookup"]),
    ({"method": "eagle3", "model": "org/eagle3-heads", "num_speculative_tokens": 5},
     ["--drafter", "eagle3", "--spec-length", "5", "--drafter-option", "heads=org/eagle3-heads"]),
    ({"method": "eagle", "model": "heads-dir"}, ["--drafter", "eagle", "--drafter-option", "heads=heads-dir"]),
    ({"method": "medusa", "model": "m", "draft_tensor_parallel_size": 1},
     ["--drafter", "medusa", "--drafter-option", "heads=m"]),
    ({"method": "mlp_speculator", "model": "s"}, ["--drafter", "mlp-speculator", "--drafter-option", "heads=s"]),
    ({"method": "draft_model", "model": "HuggingFaceTB/SmolLM2-135M", "num_speculative_tokens": 2},
     ["--drafter", "draft-model", "--spec-length", "2", "--drafter-option", "model=HuggingFaceTB/SmolLM2-135M"]),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 16, "suffix_decoding_min_token_prob": 0.2},
     ["--drafter", "suffix", "--drafter-option", "max_depth=16", "--drafter-option", "min_prob=0.2"]),
    # vLLM's detection from the model's name when there is no method
    ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}, ["--drafter", "eagle3", "--drafter-option",
                                                        "heads=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"]),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, ["--drafter", "eagle", "--drafter-option",
                                                     "heads=yuhuili/EAGLE-LLaMA3-Instruct-8B"]),
    ({"model": "some/small-model"}, ["--drafter", "draft-model", "--drafter-option", "model=some/small-model"]),
]


def _resolved(command: str, flags: list[str]) -> tuple:
    args = build_parser().parse_args([command, *flags, *(["hi"] if command == "generate" else [])])
    resolve_drafter(args)
    # option values as the drafter's options model coerces them (flags are strings, JSON has numbers)
    return args.drafter, args.spec_length, {k: str(v) for k, v in args.drafter_options}


@pytest.mark.parametrize("config, flags", EQUIVALENT)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_config_configures_the_drafter_its_flags_do(command, config, flags):
    assert _resolved(command, ["--speculative-config", json.dumps(config)]) == _resolved(command, flags)


@pytest.mark.parametrize("config, says", [
    ("{method: ngram}", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ({"method": "ngram", "disable_by_batch_size": 30}, "unknown key 'disable_by_batch_size': specdraft takes method"),
    ({"method": "mtp"}, "method 'mtp' is not one specdraft has; it has ngram, eagle, eagle3"),
    ({"num_speculative_tokens": 3}, "give a method (ngram, eagle"),
    ({"method": "eagle3"}, "method 'eagle3' needs a model"),
    ({"method": "ngram", "model": "x"}, "method 'ngram' loads no model"),
    ({"method": "eagle3", "model": "x", "prompt_lookup_max": 3}, "prompt_lookup_max is a setting of method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1 to 16"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer from 1 to 16"),
    ({"method": "eagle", "model": "x", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2"),
])
def test_a_config_specdraft_cannot_honour_is_one_line(config, says):
    with pytest.raises(ConfigError) as caught:
        read_speculative_config(config if isinstance(config, str) else json.dumps(config))
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.param == "speculative_config"


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("extra, says", [
    (["--drafter", "ngram"], "--speculative-config: it names the drafter and its settings; give it or --drafter"),
    (["--spec-length", "3"], "give it or --spec-length, not both"),
    ([], "--speculative-config: unknown key 'max_model_len'"),
])
def test_the_cli_refuses_a_bad_config_before_the_model_loads(monkeypatch, capsys, command, extra, says):
    from specdraft.cli import main

    monkeypatch.setattr("specdraft.models.load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    config = {"method": "ngram"} if extra else {"method": "ngram", "max_model_len": 512}
    argv = [command, "--speculative-config", json.dumps(config), *extra, *(["hi"] if command == "generate" else [])]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says in err[0], err


def test_the_python_api_takes_a_config(tiny_model):
    """The decoder a config builds drafts with its drafter and length, and its greedy output is
    plain decoding's; a config beside the drafter's arguments is refused."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with SpeculativeDecoder(tiny_model, None, speculative_config=config) as dec:
        assert (dec.drafter.name, dec.spec_length) == ("prompt-lookup", 3)
        assert (dec.drafter.options.max_ngram, dec.drafter.options.min_ngram) == (3, 1)
        prompt = repetitive_prompts(64)[0]
        r = dec.generate_ids([prompt], max_new_tokens=16)[0]
        assert r.token_ids == plain_greedy(tiny_model, prompt, 16) and r.stats.drafted_tokens > 0
    with pytest.raises(ConfigError, match="give it or drafter, not both"):
        SpeculativeDecoder(tiny_model, None, "ngram", speculative_config=config)
    with pytest.raises(ConfigError, match="give it or spec_length, not both"):
        SpeculativeDecoder.from_pretrained(spec_length=4, speculative_config=config)


def _methods(command: str, flags: list[str]) -> tuple:
    """What ``bench`` / ``bench-serve`` will run for ``flags``: methods, draft length, options."""
    from specdraft.bench.serve_load import PLAIN
    from specdraft.cli_args import resolve_methods

    args = build_parser().parse_args([command, "--questions", "q.jsonl", *flags])
    resolve_methods(args, "ngram,prompt-lookup", always=PLAIN if command == "bench-serve" else "")
    return args.drafters, args.spec_length, {(d, k, str(v)) for d, k, v in args.drafter_options}


@pytest.mark.parametrize("command, flags", [
    ("bench", ["--drafters", "prompt-lookup", "--spec-length", "3", "--drafter-option", "prompt-lookup:max_ngram=4"]),
    ("bench-serve", ["--drafters", "none,prompt-lookup", "--spec-length", "3",
                     "--drafter-option", "prompt-lookup:max_ngram=4"]),
])
def test_bench_and_bench_serve_run_what_a_config_configures(command, flags):
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert _methods(command, ["--speculative-config", config]) == _methods(command, flags)
    with pytest.raises(ConfigError, match="give it or --drafters, not both"):
        _methods(command, ["--speculative-config", config, "--drafters", "ngram"])


# -- SGLang's flags ---------------------------------------------------------------------------------

#: (SGLang's flags, the equivalent specdraft flags)
SGLANG_EQUIVALENT = [
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "org/eagle3-heads"],
     ["--drafter", "eagle3", "--drafter-option", "heads=org/eagle3-heads"]),
    (["--speculative-algorithm", "eagle", "--speculative-draft-model", "heads-dir", "--speculative-num-steps", "5"],
     ["--drafter", "eagle", "--spec-length", "5", "--drafter-option", "heads=heads-dir"]),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h", "--speculative-num-steps", "3",
      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
     ["--drafter", "eagle3", "--spec-length", "3", "--drafter-option", "heads=h"]),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h", "--speculative-num-steps", "5",
      "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
     ["--drafter", "eagle3", "--spec-length", "5", "--drafter-option", "heads=h", "--drafter-option", "tree_width=4",
      "--drafter-option", "tree_budget=7"]),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "HuggingFaceTB/SmolLM2-135M",
      "--speculative-num-steps", "2"],
     ["--drafter", "draft-model", "--spec-length", "2", "--drafter-option", "model=HuggingFaceTB/SmolLM2-135M"]),
]


@pytest.mark.parametrize("sglang, flags", SGLANG_EQUIVALENT)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_sglang_flags_configure_the_drafter_their_equivalents_do(command, sglang, flags):
    assert _resolved(command, sglang) == _resolved(command, flags)


@pytest.mark.parametrize("command", ["bench", "bench-serve"])
def test_bench_and_bench_serve_take_sglang_flags(command):
    sglang = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h", "--speculative-num-steps",
              "5", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]
    config = json.dumps({"method": "eagle3", "model": "h", "num_speculative_tokens": 5})
    drafters, length, options = _methods(command, sglang)
    assert (drafters, length) == _methods(command, ["--speculative-config", config])[:2]
    assert options == {("eagle3", "heads", "h"), ("eagle3", "tree_width", "4"), ("eagle3", "tree_budget", "7")}
    with pytest.raises(ConfigError, match="give them or --drafters, not both"):
        _methods(command, [*sglang, "--drafters", "ngram"])


EAGLE3 = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h"]


@pytest.mark.parametrize("argv, says", [
    (["--speculative-num-steps", "3"], "--speculative-num-steps needs --speculative-algorithm (EAGLE, EAGLE3, "
                                       "STANDALONE)"),
    (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm NGRAM: SGLang's n-gram cache of every request's "
                                           "recent tokens, searched breadth-first, has no twin here; use --drafter "
                                           "suffix"),
    (["--speculative-algorithm", "NEXTN"], "does not run a model's own multi-token-prediction layers"),
    (["--speculative-algorithm", "DFLASH"], "--speculative-algorithm DFLASH is not one specdraft has; it has EAGLE, "
                                            "EAGLE3, STANDALONE"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm EAGLE3 needs --speculative-draft-model-path"),
    ([*EAGLE3, "--speculative-num-steps", "17"], "--speculative-num-steps must be from 1 to 16, got 17"),
    ([*EAGLE3, "--speculative-eagle-topk", "9"], "--speculative-eagle-topk must be from 1 to 8, got 9"),
    ([*EAGLE3, "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "40"],
     "--speculative-num-draft-tokens must be from 1 to 32, got 40"),
    ([*EAGLE3, "--speculative-eagle-topk", "4"], "--speculative-eagle-topk 4 drafts a tree: give its size with "
                                                 "--speculative-num-draft-tokens"),
    ([*EAGLE3, "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "1"],
     "a tree verifies the last token and at least one drafted; give 2 or more"),
    ([*EAGLE3, "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8"],
     "--speculative-num-draft-tokens 8: a chain (--speculative-eagle-topk 1) of 3 steps verifies 4 tokens"),
    ([*EAGLE3, "--drafter", "eagle3"], "--speculative-algorithm: SGLang's flags name the drafter and its settings; "
                                       "give them or --drafter, not both"),
    ([*EAGLE3, "--spec-length", "3"], "give them or --spec-length, not both"),
    ([*EAGLE3, "--drafter-option", "tree_budget=4"], "give them or --drafter-option, not both"),
    ([*EAGLE3, "--speculative-config", '{"method": "ngram"}'], "give them or --speculative-config, not both"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_sglang_flags_specdraft_cannot_honour_are_one_line(monkeypatch, capsys, command, argv, says):
    monkeypatch.setattr("specdraft.models.load_target", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main([command, *argv, *(["hi"] if command == "generate" else [])]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says in err[0], err
