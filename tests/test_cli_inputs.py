"""Bad input through the CLI, in process: one line and exit 2, before any model loads.

(``tests/e2e/test_cli.py`` runs one such error in a fresh process, and the errors that need the
real model or broken model files.)
"""

from __future__ import annotations

import io

import pytest

from specdraft.cli import main


@pytest.fixture(autouse=True)
def no_model(monkeypatch, tmp_path):
    """Loading a model fails the test: every error here comes first (a path that is no model fails
    in resolve_target, as in the real loader). Relative paths start in tmp_path."""
    from specdraft.models import resolve_target

    def load_target(target=None, *args, **kwargs):
        resolve_target(target)
        pytest.fail("the model was loaded before the bad input was reported")

    monkeypatch.setattr("specdraft.models.load_target", load_target)
    monkeypatch.chdir(tmp_path)


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert captured.out == "" and len(lines) == 1 and lines[0].startswith("specdraft: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "the prompt is empty"),
    (["generate", "--seed", str(2**64), "hi"],
     "seed must be an integer from 0 to 2**64 - 1, or None (got 18446744073709551616)"),
    (["generate", "--temperature", "-1", "hi"], "temperature: Input should be greater than or equal to 0"),
    (["generate", "--temperature", "1e-38", "hi"],
     "temperature: Value error, must be 0 (greedy) or from 0.0001 to 100"),
    (["generate", "--temperature", "inf", "hi"], "temperature: Input should be a finite number"),
    (["generate", "--spec-length", "0", "hi"], "spec_length must be an integer from 1 to 16 (got 0)"),
    (["generate", "--spec-length", "1000", "hi"], "spec_length must be an integer from 1 to 16 (got 1000)"),
    (["generate", "--top-p", "0", "hi"], "top_p: Input should be greater than 0"),
    (["generate", "--top-p", "2", "hi"], "top_p: Input should be less than or equal to 1"),
    (["generate", "--top-k", "-5", "hi"], "top_k: Input should be greater than or equal to 0"),
    (["generate", "--min-p", "2", "hi"], "min_p: Input should be less than or equal to 1"),
    (["generate", "--repetition-penalty", "0", "hi"], "repetition_penalty: Input should be greater than 0"),
    (["generate", "--presence-penalty", "9", "hi"], "presence_penalty: Input should be less than or equal to 2"),
    (["generate", "--frequency-penalty", "-9", "hi"],
     "frequency_penalty: Input should be greater than or equal to -2"),
    (["generate", "--max-new-tokens", "0", "hi"], "max_new_tokens must be an integer >= 1"),
    (["generate", "--drafter", "nope", "hi"], "unknown drafter 'nope'; known drafters: "),
    (["generate", "--drafter-option", "max_order=x", "hi"], "invalid options for drafter 'ngram': max_order"),
    (["generate", "--target", "./no/such/dir", "hi"], "no such model directory: './no/such/dir'"),
    (["generate", "--prediction", "./no/such/file.py", "hi"], "--prediction ./no/such/file.py: cannot read it"),
    (["bench", "--questions", "q.jsonl", "--drafters", "ngram", "--drafter-option", "draft-model:model=x"],
     "--drafter-option names draft-model, which --drafters does not run"),
    (["bench", "--questions", "q.jsonl", "--drafters", "ngram", "--drafter-option", "ngram:nope=1"],
     "invalid options for drafter 'ngram': nope"),
    (["train-heads", "--kind", "medusa", "--output", "x", "--prompts", "./missing.jsonl"],
     "prompt file './missing.jsonl' does not exist"),
    (["train-heads", "--kind", "eagle", "--output", "x", "--prompts", "./missing.jsonl", "--steps", "0"],
     "--steps must be >= 1"),
    (["distill", "--output", "x", "--prompts", "./missing.jsonl", "--generate-batch-size", "0"],
     "--generate-batch-size must be >= 1"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(args) == 2
    assert message in _one_line(capsys)


def test_argparse_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--top-k", "many", "hi"])
    assert info.value.code == 2
    assert capsys.readouterr().err.endswith("specdraft generate: error: argument --top-k: invalid int value: 'many'\n")


def test_a_prompt_argument_that_is_not_utf8_is_one_line(capsys):
    # what Python makes of argv bytes that are not UTF-8 (b"caf\xe9 au lait": Latin-1)
    assert main(["generate", "caf\udce9 au lait"]) == 2
    assert "the prompt is not valid UTF-8 (byte 0xe9 at offset 3)" in _one_line(capsys)


def test_stdin_that_is_not_utf8_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait")))
    assert main(["generate", "-"]) == 2
    assert "the prompt is not valid UTF-8 (byte 0xe9 at offset 3)" in _one_line(capsys)


def test_a_training_output_that_is_a_file_is_one_line(capsys, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "taken").write_text("a file")
    for args, message in [
        (["distill", "--output", "taken"], "--output 'taken' is a file; give a folder (it is made if missing)"),
        (["train-heads", "--kind", "medusa", "--output", "taken"], "--output 'taken' is a file; give a folder"),
        (["train-heads", "--kind", "eagle", "--output", "taken/heads"],
         "--output 'taken/heads' cannot be made: 'taken' is a file, not a folder"),
        (["distill", "--output", "out", "--work", "taken"], "--work 'taken' is a file; give a folder"),
    ]:
        assert main([*args, "--prompts", "prompts.jsonl"]) == 2
        assert message in _one_line(capsys), args


def test_stdin_and_a_prediction_past_the_limit_are_one_line_and_read_no_further(capsys, monkeypatch, tmp_path):
    from specdraft.cli import MAX_PROMPT_BYTES

    stdin = io.BytesIO(b"a" * (MAX_PROMPT_BYTES + 2))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(stdin))
    assert main(["generate", "-"]) == 2
    assert "the prompt is longer than 8 MiB, the most specdraft reads" in _one_line(capsys)
    assert stdin.tell() == MAX_PROMPT_BYTES + 1  # the rest of a huge input is never read
    (tmp_path / "big.txt").write_bytes(b"a" * (MAX_PROMPT_BYTES + 1))
    assert main(["generate", "--prediction", "big.txt", "hi"]) == 2
    assert "--prediction big.txt: it is longer than 8 MiB" in _one_line(capsys)


def test_a_prompt_no_context_could_hold_is_refused_before_it_is_tokenized(capsys, monkeypatch):
    """More characters than the context's tokens can cover (the server's bound: here no token
    covers more than 7) is one line, after the model loads and before the prompt is tokenized."""
    from types import SimpleNamespace

    class Tokenizer:
        def __call__(self, *args, **kwargs):
            pytest.fail("the prompt was tokenized")

    decoder = SimpleNamespace(target=SimpleNamespace(max_context=10), tokenizer=Tokenizer(),
                              generate=lambda *a, **k: pytest.fail("generate ran"),
                              stream=lambda *a, **k: pytest.fail("stream ran"))
    monkeypatch.setattr("specdraft.decoder.SpeculativeDecoder.from_pretrained", lambda *a, **k: decoder)
    monkeypatch.setattr("specdraft.limits.chars_per_token", lambda tokenizer: 7)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * 64)))
    assert main(["generate", "-"]) == 2
    assert ("the prompt has at least 10 tokens (64 characters, and no token of this model covers more than 7) but "
            "the model's context holds 10; shorten it to fewer than 10 tokens") in _one_line(capsys)


serve_extra = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("fastapi", "uvicorn", "prometheus_client")),
    reason="specdraft serve needs pip install 'specdraft[serve]'")


@serve_extra
def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(capsys):
    """Another server listens on the port: one line and exit 2, the model never loaded (the
    no_model fixture fails the test if it were)."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert (f"cannot listen on 127.0.0.1:{port}: Address already in use; pick another --port (0 = any free port)"
            in _one_line(capsys))


@serve_extra
def test_serve_binds_and_listens_before_the_model_loads():
    """A second server started while the first loads its model finds the port taken (bound alone,
    with SO_REUSEADDR, it would not)."""
    import socket

    from specdraft.errors import ConfigError
    from specdraft.server.cli import _bind

    first = _bind("127.0.0.1", 0)
    try:
        with socket.create_connection(first.getsockname()[:2], timeout=5):
            pass  # the kernel accepts it into the backlog: listening
        with pytest.raises(ConfigError, match="Address already in use"):
            _bind("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()


@serve_extra
@pytest.mark.parametrize("args, message", [
    (["--read-timeout", "-1"], "--read-timeout must be a number of seconds >= 0 (got -1)"),
    (["--drain-timeout", "nan"], "--drain-timeout must be a number of seconds >= 0 (got nan)"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be a number of seconds > 0 (got 0)"),
    (["--limit-concurrency", "0"], "--limit-concurrency must be >= 1 (got 0)"),
    (["--h11-max-incomplete-event-size", "100"], "--h11-max-incomplete-event-size must be >= 1024"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1 (got 0)"),
    (["--chat-template", "no-such-template"], "--chat-template: chat template 'no-such-template' is not a file"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: kv_cache_memory must be a size in bytes such as 512MiB"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory: kv_cache_memory must be more than 0 bytes"),
    (["--gpu-memory-utilization", "0.9"], "specdraft sizes the running requests' KV cache with --kv-cache-memory"),
])
def test_bad_serve_limits_are_one_line(capsys, args, message):
    assert main(["serve", "--port", "0", *args]) == 2
    assert message in _one_line(capsys)


@serve_extra
def test_a_tool_call_parser_specdraft_lacks_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--port", "0", "--tool-call-parser", "mistral"])
    assert caught.value.code == 2
    assert "--tool-call-parser: invalid choice: 'mistral' (choose from 'hermes', 'llama3_json')" in capsys.readouterr().err


@serve_extra
@pytest.mark.parametrize("host, key, warned", [
    ("0.0.0.0", None, "every interface"),
    ("0.0.0.0", "sesame", None),
    ("127.0.0.1", None, None),
    ("localhost", None, None),
])
def test_serve_warns_on_a_public_address_without_a_key(capsys, monkeypatch, host, key, warned):
    """One warning line on stderr, before the model loads (here its loading stops the command)."""
    from specdraft.errors import ConfigError

    def stop(*args, **kwargs):
        raise ConfigError("stopped where the model would load")

    monkeypatch.setattr("specdraft.decoder.SpeculativeDecoder.from_pretrained", stop)
    monkeypatch.delenv("SPECDRAFT_API_KEY", raising=False)
    assert main(["serve", "--host", host, "--port", "0", *(["--api-key", key] if key else [])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "specdraft: error: stopped where the model would load"
    if warned:
        assert err[:-1] == [f"specdraft: warning: serving on {warned} without --api-key: anyone who can reach this "
                            "port can use it and read /docs"]
    else:
        assert err[:-1] == []


def test_generate_stats_say_which_cuda_kernels_run():
    from specdraft.cli import format_runner

    base = {"implementation": "specdraft", "compiled": True, "quantization": None, "dtype": "bfloat16"}
    invariant = {"cuda": "invariant", "linear": {"triton": 121}, "attention": "triton", "rms_norm": "triton"}
    assert format_runner({**base, "kernels": invariant}).endswith(
        "bfloat16, row-invariant CUDA kernels (linear triton, attention triton, RMSNorm triton)")
    stock = {"cuda": "stock", "why": "SPECDRAFT_CUDA_KERNELS=stock: cuBLAS, SDPA, torch's RMSNorm (not row-invariant)"}
    assert format_runner({**base, "kernels": stock}).endswith("CUDA kernels: " + stock["why"])
    assert format_runner({**base, "kernels": {"packed": 7}}).endswith("unquantized weights, bfloat16")  # CPU: as before
