"""The public entry point: :class:`SpeculativeDecoder`."""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping, Sequence

from pydantic import ValidationError

from .errors import ConfigError, describe_validation_error
from .sampling import SamplingParams
from .types import LOGPROBS_MODES, MAX_CHOICES, MAX_LOGPROBS, GenerationResult, TargetInfo


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The most tokens one round may draft: acceptance of the 16th drafted token is negligible
#: for any drafter measured, and a verify pass that wide costs several plain steps.
MAX_SPEC_LENGTH = 16
#: Seeds are 64-bit (torch.Generator.manual_seed).
MAX_SEED = 2**64 - 1


def check_spec_length(spec_length) -> None:
    if not _is_int(spec_length) or not 1 <= spec_length <= MAX_SPEC_LENGTH:
        raise ConfigError(f"spec_length must be an integer from 1 to {MAX_SPEC_LENGTH} (got {spec_length!r}); "
                          "4-6 suits most drafters")


def check_generation_args(max_new_tokens, sampling: Mapping[str, Any], seed, stop) -> tuple[SamplingParams, list[str]]:
    """Validate per-call settings: ``sampling`` holds :class:`SamplingParams` fields by name.

    Returns ``(sampling params, stop strings)`` or raises ConfigError.
    """
    try:
        params = SamplingParams(**sampling)
    except ValidationError as exc:
        raise ConfigError(f"invalid sampling settings: {describe_validation_error(exc)}") from None
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise ConfigError(f"seed must be an integer from 0 to 2**64 - 1, or None (got {seed!r})")
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings (got {type(stop).__name__} {stop!r})")
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise ConfigError(f"stop strings must be non-empty strings (got {stops!r})")
    return params, stops


#: the most a logit_bias entry may add or take away (OpenAI's range)
MAX_LOGIT_BIAS = 100.0


def check_logit_bias(logit_bias, vocab_size: int) -> "dict[int, float] | None":
    """``logit_bias`` (None, or a mapping of token ids to numbers from -100 to 100) as a dict of
    ints to floats (None when empty); ConfigError naming what is wrong."""
    import math

    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise ConfigError(f"logit_bias must be a mapping of token ids to numbers, got {type(logit_bias).__name__}")
    checked = {}
    for token, bias in logit_bias.items():
        if _token_id(token) is None or not 0 <= _token_id(token) < vocab_size:
            raise ConfigError(f"logit_bias has the key {token!r}; keys must be token ids from 0 to {vocab_size - 1}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or abs(bias) > MAX_LOGIT_BIAS:
            raise ConfigError(f"logit_bias[{token!r}] is {bias!r}; a bias must be a number from -100 to 100")
        checked[_token_id(token)] = float(bias)
    return checked or None


def check_stop_settings(max_new_tokens, ignore_eos=False, min_tokens=0, stop_token_ids=None,
                        vocab_size: int | None = None) -> tuple[bool, int, tuple[int, ...]]:
    """Validate ``ignore_eos``, ``min_tokens`` and ``stop_token_ids`` (against ``vocab_size`` when
    given); returns ``(ignore_eos, min_tokens, stop token ids)`` or raises a one-line ConfigError."""
    if not isinstance(ignore_eos, bool):
        raise ConfigError(f"ignore_eos must be True or False (got {ignore_eos!r})")
    most = max_new_tokens if _is_int(max_new_tokens) else None
    if not _is_int(min_tokens) or min_tokens < 0 or (most is not None and min_tokens > most):
        raise ConfigError(f"min_tokens must be an integer from 0 to max_new_tokens ({most}) (got {min_tokens!r})"
                          if most is not None else f"min_tokens must be an integer >= 0 (got {min_tokens!r})")
    if stop_token_ids is None:
        return ignore_eos, min_tokens, ()
    if isinstance(stop_token_ids, (str, bytes, dict)) or not hasattr(stop_token_ids, "__iter__"):
        raise ConfigError(f"stop_token_ids must be a list of token ids (ints), got {type(stop_token_ids).__name__}")
    ids = list(stop_token_ids)
    for value in ids:
        token = _token_id(value)
        if token is None:
            raise ConfigError(f"stop_token_ids holds {value!r} ({type(value).__name__}); token ids must be integers")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ConfigError(f"stop_token_ids holds {token}, outside the vocabulary [0, {vocab_size})"
                              if vocab_size is not None else f"stop_token_ids holds {token}; token ids are >= 0")
    return ignore_eos, min_tokens, tuple(sorted({_token_id(v) for v in ids}))


def check_logprobs(logprobs=None, logprobs_mode="processed") -> None:
    """Validate ``logprobs`` (None, or the top tokens to report per position, 0 to
    ``MAX_LOGPROBS``) and ``logprobs_mode``; a one-line ConfigError naming the field."""
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ConfigError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens to report "
                          f"at each position; 0: the output token's own only), or None for none (got {logprobs!r})")
    if not isinstance(logprobs_mode, str) or logprobs_mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode must be one of {', '.join(map(repr, LOGPROBS_MODES))} (got "
                          f"{logprobs_mode!r}): 'processed' after the sampling settings, 'raw' the model's own")


def _token_id(value) -> int | None:
    """``value`` as a token id if it is an integer (Python, numpy or a one-element torch tensor), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_prompts(prompts) -> list[str]:
    """Text prompts as a list of non-empty, encodable strings, or ConfigError."""
    if prompts is None or isinstance(prompts, (bytes, bytearray)):
        raise ConfigError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}"
                          + ("; decode bytes first (prompt.decode('utf-8'))" if prompts is not None else ""))
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise ConfigError("no prompts given")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"prompt {i} must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ConfigError(f"prompt {i} is empty; give some text to continue")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"prompt {i} is not valid text: {exc.reason} at character {exc.start} "
                              f"({text[exc.start:exc.end]!r}); pass valid Unicode (UTF-8) text") from None
    return texts


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> list[int]:
    """Token ids for ``prompt``: through the chat template unless ``raw`` or there is none."""
    if not raw and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(prompt, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def follow_if_worker(tensor_parallel, device=None) -> None:
    """Under torchrun, a rank other than 0 asked for a sharded target: follow rank 0 (no model
    loaded here: rank 0 hands out the shards), then end the process (SystemExit(0))."""
    from .runner.tp import check_size, launched_rank, start

    if check_size(tensor_parallel) > 1 and launched_rank() not in (None, 0):
        from .models import resolve_device

        start(tensor_parallel, resolve_device(device))


def describe_target(model, tokenizer=None, target_name: str = "") -> TargetInfo:
    """What drafters are told about a loaded target model."""
    config = model.config.get_text_config()
    return TargetInfo(
        vocab_size=model.get_output_embeddings().weight.shape[0],
        device=model.device,
        dtype=model.dtype,
        max_context=int(getattr(config, "max_position_embeddings", 0) or 2**31 - 1),
        eos_token_ids=_eos_ids(model, tokenizer),
        tokenizer=tokenizer,
        config=config,
        name=target_name or getattr(config, "_name_or_path", ""),
        embeddings=model.get_input_embeddings(),
        lm_head=model.get_output_embeddings(),
        hidden_size=int(getattr(config, "hidden_size", 0) or 0),
    )


class SpeculativeDecoder:
    """Speculative decoding of a target model with a pluggable drafter.

    Output is token-identical to plain greedy decoding at temperature 0 and distributed
    exactly as plain sampling from the target otherwise.

    Continuous batching: every call (from any thread) submits its prompts to one engine, which
    runs up to ``max_batch`` sequences together, admitting waiting ones as others finish; each
    caller gets exactly its own output. ``stream()`` yields text as tokens are accepted.

    >>> dec = SpeculativeDecoder.from_pretrained(drafter="ngram")      # doctest: +SKIP
    >>> dec.generate("Name three colours.", max_new_tokens=32)[0].text  # doctest: +SKIP
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        drafter: str | Any = "ngram",
        spec_length: int = 4,
        drafter_options: Mapping[str, Any] | None = None,
        *,
        adaptive: bool = True,
        target_name: str = "",
        compile: bool | None = None,
        quantize: str | None = None,
        max_batch: int = 8,
        max_waiting: int | None = None,
        prefill_chunk: int | None = None,
        tensor_parallel: int = 1,
    ) -> None:
        from .drafters.api import Drafter
        from .engine import Engine, EngineLoop
        from .engine.engine import DEFAULT_PREFILL_CHUNK, release_openmp_workers
        from .plugins import get_registry
        from .runner import default_compile
        from .structured import Grammars

        check_spec_length(spec_length)
        if not _is_int(max_batch) or not 1 <= max_batch <= 1024:
            raise ConfigError(f"max_batch must be an integer from 1 to 1024 (got {max_batch!r})")
        if max_waiting is not None and (not _is_int(max_waiting) or max_waiting < 0):
            raise ConfigError(f"max_waiting must be an integer >= 0, or None for no limit (got {max_waiting!r})")
        if prefill_chunk is not None and (not _is_int(prefill_chunk) or prefill_chunk < 0):
            raise ConfigError(f"prefill_chunk must be an integer >= 0 (prompt tokens per prefill pass; 0: whole "
                              f"prompts; None: the default, 256), got {prefill_chunk!r}")
        if compile is not None and not isinstance(compile, bool):
            raise ConfigError(f"compile must be True, False or None (the device's default), got {compile!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        #: why the target has its dtype (``from_pretrained`` says when it chose it)
        self.dtype_reason = "the loaded model's own"
        self.target = describe_target(model, tokenizer, target_name)
        if compile is None:
            compile = default_compile(self.target.device)
        self.runner = self._target_runner(compile, quantize, tensor_parallel)
        if isinstance(drafter, Drafter):
            if drafter_options:
                raise ConfigError("drafter_options only apply when the drafter is given by name")
            self.drafter = drafter
        else:
            self.drafter = get_registry().create(str(drafter), drafter_options, self.target)
        self.spec_length = spec_length
        self.engine = Engine(self.runner, self.drafter, self.target, spec_length, adaptive=adaptive,
                             max_batch=max_batch, max_waiting=max_waiting,
                             prefill_chunk=DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk)
        self._loop = EngineLoop(self.engine)
        self._grammars = Grammars(tokenizer, self.target)  # response_format: compiled at first use, cached
        # this thread built the model (OpenMP workers of its own); a server submits from other threads
        release_openmp_workers()

    def _target_runner(self, compile: bool, quantize: str | None, tensor_parallel: int):
        """The target's runner: ours (or transformers' as a fallback), or sharded over ``tensor_parallel`` ranks."""
        from .runner import load_runner
        from .runner.tp import check_size

        if check_size(tensor_parallel) == 1:
            return load_runner(self.model, compile=compile, quantize=quantize)
        from .runner.runner import check_quantize
        from .runner.tp import start

        if compile:
            raise ConfigError("compile=True with tensor_parallel > 1 is not supported yet: sharded passes run "
                              "eagerly (docs/tensor-parallel.md); drop --compile")
        check_quantize(quantize, self.target.device)
        return start(tensor_parallel, self.target.device).runner(self.model, quantize)

    @classmethod
    def from_pretrained(
        cls,
        target: str | None = None,
        drafter: str | Any = "ngram",
        spec_length: int = 4,
        drafter_options: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        adaptive: bool = True,
        *,
        compile: bool | None = None,
        quantize: str | None = None,
        max_batch: int = 8,
        max_waiting: int | None = None,
        prefill_chunk: int | None = None,
        tensor_parallel: int = 1,
    ) -> "SpeculativeDecoder":
        """Load ``target`` (None = SmolLM2-135M-Instruct, offline; else hub id, folder or .gguf).

        ``spec_length`` is the most tokens drafted per round; with ``adaptive`` (the default)
        each round drafts as many of those as pay off given the measured acceptance and
        verify costs (see ``specdraft.engine.policy``); ``adaptive=False`` always asks for
        ``spec_length``.

        ``compile`` runs the target through torch.compile (and CUDA graphs on a GPU), one graph
        per pass width; None takes the device's default (:func:`specdraft.runner.default_compile`).
        ``quantize="int8"`` (or ``"int4"``, CPU only) makes the target weight-only int8 (int4):
        speculative output then equals plain decoding of that quantized model.

        ``max_batch``: sequences decoded together (each holds a row of the KV cache); more wait
        and join as others finish. ``max_waiting``: with ``stream()``, at most this many requests
        wait (QueueFull beyond; None: no limit). ``prefill_chunk``: prompt tokens per prefill pass;
        while others decode, a step prefills at most this many, so a long prompt joining delays
        the running requests' next round by one such pass (None: 256; 0: each prompt in one pass).

        ``tensor_parallel``: shard the target over this many ranks (processes started here, gloo
        on CPU, NCCL on GPUs ``device``, ``device + 1``, ...; or torchrun's, where ranks other
        than 0 follow rank 0 from this call and then exit): see docs/tensor-parallel.md.
        """
        from .models import default_dtype, load_target, resolve_device

        follow_if_worker(tensor_parallel, device)

        model, tokenizer, name = load_target(target, dtype=dtype, device=device)
        decoder = cls(model, tokenizer, drafter, spec_length, drafter_options, adaptive=adaptive, target_name=name,
                      compile=compile, quantize=quantize, max_batch=max_batch, max_waiting=max_waiting,
                      prefill_chunk=prefill_chunk, tensor_parallel=tensor_parallel)
        decoder.dtype_reason = "asked for" if dtype is not None else default_dtype(resolve_device(device))[1]
        return decoder

    def warm_up(self, rows: int = 1) -> None:
        """Compile (or capture) the target's passes of every width a round can use, for ``rows``
        sequences, now rather than during the first generations; free when not compiled."""
        with self._loop.step_lock:
            if self.engine.has_work():
                raise ConfigError("warm_up() needs an idle decoder; call it before generating")
            # chains of up to spec_length drafts, and trees of up to the drafter's budget
            self.runner.warm_up(rows, range(1, max(self.spec_length, getattr(self.drafter, "tree_budget", 1)) + 2))
            self.engine.reset_cache()

    def end_requests(self, error: BaseException, *, running: bool = True) -> int:
        """End the waiting requests, and the running ones when ``running``, with ``error``: each
        one's stream raises it, and results already complete stay complete. Returns how many
        were ended. (A server's shutdown ends its requests this way.) No step runs meanwhile, so
        a running request cannot finish between the check and the end (its answer would be lost)."""
        from .engine.sequence import Status

        ended = 0
        with self._loop.step_lock:
            scheduler = self.engine.scheduler
            with scheduler.lock:
                sequences = list(scheduler.waiting) + (list(scheduler.running) if running else [])
            for seq in sequences:
                if seq.status is not Status.FINISHED and seq.error is None:
                    seq.error = error  # what its stream raises once it is done
                    self._loop.abort(seq)  # a waiting one ends now, a running one at the next step
                    ended += 1
        return ended

    def close(self) -> None:
        """Stop every request and the engine's thread (a later call raises)."""
        self._loop.stop()
        close = getattr(self.runner, "close", None)  # a sharded target's runner on the other ranks
        if close is not None:
            close()

    def __enter__(self) -> "SpeculativeDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def num_running(self) -> int:
        """Sequences being decoded now."""
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a free slot."""
        return self.engine.num_waiting

    @property
    def runner_info(self) -> dict:
        """How the target runs: ``{"implementation": "specdraft" | "transformers", "compiled": bool,
        "quantization": None | "int8" | "int4", "dtype": "bfloat16" | ..., "dtype_reason": str}``
        (a quantized target's products run in bfloat16 on CPU, whatever it was loaded in)."""
        return dict(self.runner.info, dtype_reason=self.dtype_reason)

    # -- generation ---------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        raw: bool = False,
        *,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        prediction: str | Sequence[str | None] | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        n: int = 1,
        logprobs: int | None = None,
        logprobs_mode: str = "processed",
        response_format: Any = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts; one result per prompt (``n`` per prompt,
        prompt by prompt, with ``n > 1``: each prompt's choices, prefilled once, each drawing its
        own random numbers; with a ``seed``, reproducible and distinct).

        Instruct models get their chat template (the prompt is the user's message) unless
        ``raw`` is True, in which case the prompt is tokenized as is. The sampling settings
        are :class:`~specdraft.SamplingParams`' fields (see there and docs/algorithm.md).
        ``prediction``: text the output is expected to repeat much of (OpenAI's Predicted
        Outputs), one per prompt (a list; None entries for prompts without one): those rows
        draft from it, with any drafter; the output stays the target's own.

        End of generation (vLLM's semantics): ``ignore_eos`` keeps generating past EOS (emitted
        like any other token) to ``max_new_tokens``; ``stop_token_ids`` end it like EOS (finish
        reason "stop"; the id is in ``token_ids``, its text is not); ``min_tokens``: the first
        ``min_tokens`` tokens are never EOS (unless ``ignore_eos``) or a stop token, their
        probability set to 0 in the target's distribution before acceptance, so the output stays
        exact, and stop strings do not end generation before them.

        ``logprobs=N`` (0 to 20): each result's ``logprobs`` has a
        :class:`~specdraft.types.TokenLogprob` per output token, its log-probability and the
        ``N`` most likely tokens at its position, the numbers plain decoding gives there:
        ``logprobs_mode="processed"`` from the distribution the token was drawn from (after the
        penalties, temperature and filters; greedy: the penalized logits), ``"raw"`` from the
        model's logits (see :mod:`specdraft.engine.logprobs`).

        ``logit_bias`` (OpenAI's): ``{token_id: bias}``, each bias from -100 to 100, added to that
        token's logit at every position before the penalties, temperature and filters (so it
        changes the target's distribution itself, and the output stays exact): -100 bans a token.

        ``response_format`` (structured output; needs ``pip install 'specdraft[structured]'``):
        ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ...,
        "schema": {...}}}``, ``{"type": "regex", "regex": ...}``, ``{"type": "choice", "choice":
        [...]}`` or ``{"type": "grammar", "grammar": ...}`` (Lark or GBNF; see
        :mod:`specdraft.structured`). The grammar sets the target's probability of every token it
        forbids to 0 at every verified position, so the output is exactly what plain decoding
        under the grammar gives; a complete output ends with EOS (finish reason "eos"). Not with
        ``ignore_eos``; ``min_tokens`` holds EOS back only while the grammar allows another token.
        """
        if self.tokenizer is None:
            raise ConfigError("this decoder has no tokenizer; use generate_ids() with token ids")
        texts = check_prompts(prompts)
        return self.generate_ids([self.encode(t, raw=raw) for t in texts], max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                                 min_p=min_p, repetition_penalty=repetition_penalty,
                                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                 prediction=self._encode_predictions(prediction, len(texts)), ignore_eos=ignore_eos,
                                 min_tokens=min_tokens, stop_token_ids=stop_token_ids, logprobs=logprobs,
                                 logprobs_mode=logprobs_mode, n=n,
                                 response_format=response_format, logit_bias=logit_bias)

    def _encode_predictions(self, prediction, count: int) -> list[list[int] | None] | None:
        """Token ids of each prompt's predicted text (``prediction``: a string for one prompt, or a
        list with an entry per prompt)."""
        from .verifier.prediction import check_prediction

        if prediction is None:
            return None
        texts = [prediction] if isinstance(prediction, str) else prediction
        if isinstance(texts, (bytes, dict)) or not hasattr(texts, "__len__") or len(texts) != count:
            raise ConfigError(f"prediction must be a string (one prompt) or a list of {count} strings or None, "
                              "one per prompt")
        return [None if text is None else self.tokenizer(check_prediction(text, f"prediction[{i}]") or "",
                                                          add_special_tokens=False).input_ids
                for i, text in enumerate(texts)]

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids for ``prompt``: through the chat template unless ``raw`` or there is none."""
        return encode_prompt(self.tokenizer, prompt, raw)

    def generate_ids(
        self,
        prompt_ids: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        *,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        prediction: Sequence[Sequence[int] | None] | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        n: int = 1,
        logprobs: int | None = None,
        logprobs_mode: str = "processed",
        response_format: Any = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> list[GenerationResult]:
        """Generate from token ids (one list per sequence); no chat template is applied.
        ``prediction``: each sequence's predicted output, token ids (None: none); the other
        settings as for :meth:`generate`."""
        from .engine import GenerationInterrupted, Stream

        seqs = self._sequences(prompt_ids, max_new_tokens, seed, stop, dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty), prediction,
            ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=stop_token_ids, logprobs=logprobs,
            logprobs_mode=logprobs_mode, n=n, response_format=response_format, logit_bias=logit_bias)
        streams = [Stream(self._loop, s, self.tokenizer) for s in seqs]
        self._loop.submit(seqs, limit=False)
        try:
            for stream in streams:
                for _ in stream:
                    pass
        except KeyboardInterrupt:  # Ctrl-C: stop this call's sequences, keep what they generated
            for stream in streams:
                stream.close()
            from .engine.stream import result_of
            from .engine.output import output_text

            results = []
            for s in seqs:
                reason = s.finish_reason if s.finish_reason not in (None, "aborted") else "interrupted"
                text = None if self.tokenizer is None else output_text(
                    self.tokenizer, s.new_tokens, reason, s.stop, min_tokens=s.min_tokens,
                    stop_token_ids=s.stop_token_ids)
                results.append(result_of(s, text))
                results[-1].finish_reason = reason
            raise GenerationInterrupted(results) from None
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        results = [stream.result for stream in streams]
        if any(r.finish_reason == "interrupted" for r in results):  # a drafter's KeyboardInterrupt
            raise GenerationInterrupted(results)
        return results

    def stream(
        self,
        prompt: str,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        raw: bool = False,
        *,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        prediction: str | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        logprobs_mode: str = "processed",
        response_format: Any = None,
        logit_bias: Mapping[int, float] | None = None,
    ):
        """Generate for one prompt, yielding text as tokens are accepted (several per step).

        Returns a :class:`~specdraft.engine.Stream`: iterate it for
        :class:`~specdraft.engine.StreamChunk` bursts (``.text``, ``.token_ids``, and with
        ``logprobs`` a ``.logprobs`` entry per token id); the texts add up to what :meth:`generate`
        returns, and ``stream.result`` has the whole result at the end. Close it (or use ``with``)
        to stop early. Settings as for :meth:`generate`.
        """
        if self.tokenizer is None:
            raise ConfigError("this decoder has no tokenizer; use stream_ids() with token ids")
        text = check_prompts(prompt)
        if len(text) != 1:
            raise ConfigError("stream() takes one prompt; call it once per prompt")
        predicted = self._encode_predictions(prediction, 1)
        return self.stream_ids(self.encode(text[0], raw=raw), max_new_tokens=max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, stop=stop, min_p=min_p,
                               repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty, prediction=predicted and predicted[0],
                               ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=stop_token_ids,
                               logprobs=logprobs, logprobs_mode=logprobs_mode,
                               response_format=response_format, logit_bias=logit_bias)

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        *,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        prediction: Sequence[int] | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        n: int = 1,
        logprobs: int | None = None,
        logprobs_mode: str = "processed",
        response_format: Any = None,
        logit_bias: Mapping[int, float] | None = None,
    ):
        """:meth:`stream` from token ids (one sequence; ``prediction``: its predicted output's
        token ids); raises QueueFull when ``max_waiting`` requests already wait. With ``n > 1``, a
        list of ``n`` streams: the prompt's choices (prefilled once; see :meth:`generate`)."""
        from .engine import Stream

        seqs = self._sequences([prompt_ids], max_new_tokens, seed, stop, dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty),
            None if prediction is None else [prediction], ignore_eos=ignore_eos, min_tokens=min_tokens,
            stop_token_ids=stop_token_ids, logprobs=logprobs, logprobs_mode=logprobs_mode, n=n,
            response_format=response_format, logit_bias=logit_bias)
        streams = [Stream(self._loop, seq, self.tokenizer) for seq in seqs]
        self._loop.submit(seqs)
        return streams[0] if n == 1 else streams

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], chat_template_kwargs: Mapping[str, Any] | None = None,
                    *, add_special_tokens: bool = False, check_text: Callable[[str], None] | None = None) -> list[int]:
        """Token ids of a conversation (``[{"role": ..., "content": ...}, ...]``) through the chat
        template, ending with the assistant's turn to speak.

        ``chat_template_kwargs``: more variables for the template (e.g. ``{"enable_thinking":
        False}``; ``add_generation_prompt`` and ``continue_final_message`` are transformers' own);
        ``add_special_tokens``: whether the tokenizer adds its special tokens (BOS) to the rendered
        text (the template usually has them); ``check_text`` is called with the rendered text before
        it is tokenized (the server refuses a text too long for the context there, untokenized).
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("this model has no chat template; use completions with a plain prompt")
        if chat_template_kwargs is not None and (not isinstance(chat_template_kwargs, Mapping)
                                                 or not all(isinstance(k, str) for k in chat_template_kwargs)):
            raise ConfigError("chat_template_kwargs must be a mapping of variable names (strings) to values, "
                              f"got {type(chat_template_kwargs).__name__}")
        options = {"add_generation_prompt": True, **(chat_template_kwargs or {})}
        # apply_chat_template's arguments that are not template variables (they change what it returns)
        reserved = sorted(set(options) & {"conversation", "tokenize", "chat_template", "tools", "documents",
                                          "return_dict", "return_tensors", "return_assistant_tokens_mask",
                                          "padding", "truncation", "max_length", "tokenizer_kwargs"})
        if reserved:
            raise ConfigError(f"chat_template_kwargs cannot set {', '.join(reserved)}: they are arguments of "
                              "apply_chat_template, not variables of the template")
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, **options)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint, in one line
            raise ConfigError(f"the chat template cannot render these messages: {exc}") from None
        if check_text is not None:
            check_text(text)
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _sequences(self, prompt_ids, max_new_tokens, seed, stop, sampling: dict, predictions=None, *,
                   ignore_eos=False, min_tokens=0, stop_token_ids=None, logprobs=None, logprobs_mode="processed", n=1,
                   response_format=None, logit_bias=None):
        from .engine.sequence import sequences_for

        if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise ConfigError(f"n must be an integer from 1 to {MAX_CHOICES} (choices per prompt), got {n!r}")
        if n > 1 and predictions is not None and any(predictions):
            raise ConfigError("prediction works with n=1 only: its acceptance counts are a request's, not a choice's")
        params, stops = check_generation_args(max_new_tokens, sampling, seed, stop)
        ignore_eos, min_tokens, stop_token_ids = check_stop_settings(max_new_tokens, ignore_eos, min_tokens,
                                                                     stop_token_ids, self.target.vocab_size)
        check_logprobs(logprobs, logprobs_mode)
        logit_bias = check_logit_bias(logit_bias, self.target.vocab_size)
        grammar = self._grammars.compile(response_format, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
        if stops and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer to decode the output; this decoder has none")
        prompts = self._check_prompt_ids(prompt_ids)
        return sequences_for(prompts, params, max_new_tokens, self.target.max_context, stops, seed,
                             self._check_predicted_ids(predictions, len(prompts)), ignore_eos=ignore_eos,
                             min_tokens=min_tokens, stop_token_ids=stop_token_ids, logprobs=logprobs,
                             logprobs_mode=logprobs_mode, n=n, grammar=grammar, logit_bias=logit_bias)

    def _check_predicted_ids(self, predictions, count: int) -> list[list[int] | None] | None:
        """``predictions`` (None, or one token-id list or None per prompt), checked."""
        if predictions is None:
            return None
        if isinstance(predictions, (str, bytes)) or not hasattr(predictions, "__len__") or len(predictions) != count:
            raise ConfigError(f"prediction must be a list with one entry per prompt ({count}): token ids or None")
        return [None if ids is None else self._token_ids(ids, f"prediction {i}") or None
                for i, ids in enumerate(predictions)]

    def _check_prompt_ids(self, prompt_ids) -> list[list[int]]:
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__") or len(prompt_ids) == 0:
            raise ConfigError("prompt_ids must be a non-empty list of token-id lists")
        if all(_token_id(t) is not None for t in prompt_ids):
            raise ConfigError("prompt_ids must be a list of lists (one per sequence); wrap a single prompt: [ids]")
        prompts = []
        for i, ids in enumerate(prompt_ids):
            ids = self._token_ids(ids, f"prompt {i}")
            if not ids:
                raise ConfigError(f"prompt {i} is empty; give at least one token")
            prompts.append(ids)
        return prompts

    def _token_ids(self, ids, what: str) -> list[int]:
        """``ids`` (any iterable of integers) as a list, checked against the vocabulary and the context."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ConfigError(f"{what} must be a list of token ids (ints), got {type(ids).__name__}")
        ids = list(ids)  # any iterable of ids, read once
        converted = [_token_id(t) for t in ids]
        if None in converted:
            bad = ids[converted.index(None)]
            raise ConfigError(f"{what} holds {bad!r} ({type(bad).__name__}); token ids must be integers")
        vocab, context = self.target.vocab_size, self.target.max_context
        if converted and (min(converted) < 0 or max(converted) >= vocab):
            raise ConfigError(f"{what} has token ids outside [0, {vocab})")
        if len(converted) >= context:
            raise ConfigError(f"{what} has {len(converted)} tokens but the model's context holds {context}; "
                              f"shorten it to at most {context - 1} tokens")
        return converted
