"""The public entry point: :class:`SpeculativeDecoder`."""

from __future__ import annotations

import copy

from typing import Any, Callable, Mapping, Sequence

from .errors import ConfigError
from .limits import check_spec_length
from .models import encode_prompt
from .settings import GenerationSettings, check_prompts, check_token_ids, is_int, token_id
from .speculative_config import choose_drafter
from .speculators import read_checkpoint
from .types import GenerationResult, describe_target


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
        drafter: str | Any = None,
        spec_length: int | None = None,
        drafter_options: Mapping[str, Any] | None = None,
        *,
        speculative_config: str | Mapping[str, Any] | None = None,
        adaptive: bool = True,
        target_name: str = "",
        compile: bool | None = None,
        quantize: str | None = None,
        max_batch: int = 8,
        max_waiting: int | None = None,
        prefill_chunk: int | None = None,
        tensor_parallel: int = 1,
        prefix_caching: bool = True,
        prefix_cache_memory: int | str | None = None,
        kv_cache_memory: int | str | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        from .drafters.api import Drafter
        from .engine import Engine, EngineLoop
        from .engine.engine import DEFAULT_PREFILL_CHUNK, release_openmp_workers
        from .engine.memory import DEFAULT_KV_MEMORY, check_kv_memory
        from .engine.prefix import DEFAULT_MEMORY, parse_memory, turn_mark
        from .plugins import get_registry
        from .runner import default_compile
        from .structured import Grammars

        chosen = choose_drafter(drafter, spec_length, drafter_options, speculative_config)
        drafter, spec_length, drafter_options = chosen.drafter, chosen.spec_length, chosen.options
        check_spec_length(spec_length)
        if not is_int(max_batch) or not 1 <= max_batch <= 1024:
            raise ConfigError(f"max_batch must be an integer from 1 to 1024 (got {max_batch!r})")
        if max_waiting is not None and (not is_int(max_waiting) or max_waiting < 0):
            raise ConfigError(f"max_waiting must be an integer >= 0, or None for no limit (got {max_waiting!r})")
        if prefill_chunk is not None and (not is_int(prefill_chunk) or prefill_chunk < 0):
            raise ConfigError(f"prefill_chunk must be an integer >= 0 (prompt tokens per prefill pass; 0: whole "
                              f"prompts; None: the default, 256), got {prefill_chunk!r}")
        if compile is not None and not isinstance(compile, bool):
            raise ConfigError(f"compile must be True, False or None (the device's default), got {compile!r}")
        if not isinstance(prefix_caching, bool):
            raise ConfigError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        memory = parse_memory(DEFAULT_MEMORY if prefix_cache_memory is None else prefix_cache_memory)
        kv_memory = check_kv_memory(DEFAULT_KV_MEMORY if kv_cache_memory is None else kv_cache_memory)
        from .tools import choose_parser, load_chat_template

        if chat_template is not None:
            if tokenizer is None:
                raise ConfigError("chat_template needs a tokenizer (the decoder has none)", param="chat_template")
            tokenizer = copy.copy(tokenizer)  # the caller's tokenizer keeps its own template
            tokenizer.chat_template = load_chat_template(chat_template)
        #: how ``tool_choice="auto"`` reads calls out of an output (:data:`specdraft.tools.PARSERS`; None: unknown)
        self.tool_call_parser = choose_parser(tool_call_parser, tokenizer)
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
                             prefill_chunk=DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk,
                             prefix_cache_memory=memory if prefix_caching else 0, kv_cache_memory=kv_memory)
        self.engine.turn_mark = turn_mark(tokenizer)  # a chat's next turn finds all of this one's prompt cached
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
        drafter: str | Any = None,
        spec_length: int | None = None,
        drafter_options: Mapping[str, Any] | None = None,
        dtype: Any = None,
        device: Any = None,
        adaptive: bool = True,
        *,
        speculative_config: str | Mapping[str, Any] | None = None,
        compile: bool | None = None,
        quantize: str | None = None,
        max_batch: int = 8,
        max_waiting: int | None = None,
        prefill_chunk: int | None = None,
        tensor_parallel: int = 1,
        prefix_caching: bool = True,
        prefix_cache_memory: int | str | None = None,
        kv_cache_memory: int | str | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
    ) -> "SpeculativeDecoder":
        """Load ``target`` (None = SmolLM2-135M-Instruct, offline; else hub id, folder or .gguf).

        A speculators checkpoint as ``target`` (vLLM's format: see :mod:`specdraft.speculators`)
        loads its verifier, drafted by the checkpoint's heads (``eagle3`` or ``eagle``) with its
        ``speculative_tokens`` unless ``spec_length`` is given; ``drafter_options`` add to its heads.

        ``drafter`` (a registered name, default ``"ngram"``, or a :class:`~specdraft.Drafter`) with
        its ``drafter_options``; or ``speculative_config``, vLLM's (a dict or its JSON:
        ``{"method": "eagle3", "model": ..., "num_speculative_tokens": 3}``; see
        :mod:`specdraft.speculative_config`) in place of ``drafter``, ``spec_length`` and
        ``drafter_options``.

        ``spec_length`` is the most tokens drafted per round; with ``adaptive`` (the default)
        each round drafts as many of those as pay off given the measured acceptance and
        verify costs (see ``specdraft.engine.policy``); ``adaptive=False`` always asks for
        ``spec_length``.

        ``compile`` runs the target through torch.compile (and CUDA graphs on a GPU), one graph
        per pass width; None takes the device's default (:func:`specdraft.runner.default_compile`).
        ``quantize="int8"`` (or ``"int4"``, CPU only) makes the target weight-only int8 (int4);
        ``"gguf"`` (CPU only) runs a GGUF target's own Q4_0/Q4_1/Q8_0 blocks as they are
        (:mod:`specdraft.runner.gguf_blocks`): speculative output then equals plain decoding of
        that quantized model.

        ``max_batch``: sequences decoded together (each holds a row of the KV cache); more wait
        and join as others finish. ``kv_cache_memory``: the most bytes those rows take (an int, or
        a size such as ``"8GiB"``; None: 4 GiB); each sequence reserves room for its prompt and
        ``max_new_tokens``, newcomers wait while the running ones' reservations fill it, and one
        that could never fit is refused (ConfigError). What is allocated grows with use up to
        that (see :mod:`specdraft.engine.memory`). ``max_waiting``: with ``stream()``, at most this many requests
        wait (QueueFull beyond; None: no limit). ``prefill_chunk``: prompt tokens per prefill pass;
        while others decode, a step prefills at most this many, so a long prompt joining delays
        the running requests' next round by one such pass (None: 256; 0: each prompt in one pass,
        but for passes that end where a chat's earlier turns ended: see :meth:`Engine._pass_end
        <specdraft.engine.engine.Engine._pass_end>`).

        ``prefix_caching`` (on by default): prompt prefill passes are kept, at most
        ``prefix_cache_memory`` bytes of them (an int, or a size such as ``"512MiB"``; None: 1 GiB),
        and a later prompt that begins with the same passes copies them instead of computing them;
        its output is the same bit for bit (see :mod:`specdraft.engine.prefix`). Results report
        ``stats.cached_tokens``.

        ``chat_template``: the chat template to render conversations with, in place of the
        tokenizer's (``"hermes"``, specdraft's ChatML template with tools; a file; or Jinja text).
        ``tool_call_parser``: how :meth:`chat` with ``tool_choice="auto"`` reads calls out of an
        output (``"hermes"`` or ``"llama3_json"``; None: the one the template's call format needs).

        ``tensor_parallel``: shard the target over this many ranks (processes started here, gloo
        on CPU, NCCL on GPUs ``device``, ``device + 1``, ...; or torchrun's, where ranks other
        than 0 follow rank 0 from this call and then exit): see docs/tensor-parallel.md.
        """
        from .models import default_dtype, load_target, resolve_device
        from .runner.tp import follow_if_worker

        follow_if_worker(tensor_parallel, device)
        checkpoint = read_checkpoint(target)
        if checkpoint is not None:  # the verifier, drafted by the checkpoint
            chosen = checkpoint.choose(drafter, spec_length, drafter_options, speculative_config)
            target, drafter, spec_length = checkpoint.verifier, chosen.drafter, chosen.spec_length
            drafter_options = chosen.options
            speculative_config = None
        choose_drafter(drafter, spec_length, drafter_options, speculative_config)  # a bad one fails before loading
        if kv_cache_memory is not None:
            from .engine.memory import check_kv_memory

            check_kv_memory(kv_cache_memory)

        model, tokenizer, name = load_target(target, dtype=dtype, device=device)
        decoder = cls(model, tokenizer, drafter, spec_length, drafter_options, speculative_config=speculative_config,
                      adaptive=adaptive, target_name=name,
                      compile=compile, quantize=quantize, max_batch=max_batch, max_waiting=max_waiting,
                      prefill_chunk=prefill_chunk, tensor_parallel=tensor_parallel,
                      prefix_caching=prefix_caching, prefix_cache_memory=prefix_cache_memory,
                      kv_cache_memory=kv_cache_memory, chat_template=chat_template,
                      tool_call_parser=tool_call_parser)
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
        self.runner.close()  # a sharded target's runner stops its other ranks

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
    def kv_cache_usage(self) -> float:
        """The fraction (0..1) of the target cache's memory (``kv_cache_memory``) the running
        sequences have reserved: at 1.0 newcomers wait for room."""
        from .engine.report import kv_cache_usage

        return kv_cache_usage(self.engine)

    def observe(self, observer: Callable[[Any], None]) -> Callable[[], None]:
        """Call ``observer`` with each of the engine's reports as it steps (a round, a prefill, a
        sequence's end: :class:`~specdraft.engine.report.StepReport`, on the engine's thread; keep it
        quick: one that raises is logged and skipped). Returns a function that stops the calls."""
        observers = self.engine.observers
        observers.append(observer)

        def stop() -> None:
            if observer in observers:
                observers.remove(observer)

        return stop

    @property
    def runner_info(self) -> dict:
        """How the target runs: ``{"implementation": "specdraft" | "transformers", "compiled": bool,
        "quantization": None | "int8" | "int4" | "gguf", "dtype": "bfloat16" | ..., "dtype_reason": str}``
        (a quantized target's products run in bfloat16 on CPU, whatever it was loaded in)."""
        return dict(self.runner.info, dtype_reason=self.dtype_reason)

    # -- generation ---------------------------------------------------------------------

    def generate(self, prompts: str | Sequence[str], settings: GenerationSettings | Sequence[GenerationSettings]
                 | None = None, *, raw: bool = False, **options) -> list[GenerationResult]:
        """Generate for one prompt or a list of prompts; one result per prompt (``n`` per prompt,
        prompt by prompt, with ``n > 1``: each prompt's choices, prefilled once, each drawing its
        own random numbers; with a ``seed``, reproducible and distinct).

        ``settings``: a :class:`~specdraft.GenerationSettings` (for every prompt, or a list with
        one per prompt; None: the defaults). The keyword form: ``options`` are its fields by name
        (``max_new_tokens=64, temperature=0.7, stop=["\\n"], ...``), applied over ``settings``;
        there ``prediction`` has an entry per prompt (a string for one prompt, or a list of
        strings or None). Instruct models get their chat template (the prompt is the user's
        message) unless ``raw`` is True, in which case the prompt is tokenized as is.

        What the settings do (see :class:`~specdraft.GenerationSettings`, docs/algorithm.md):

        - The sampling settings (temperature, top-k/p, min-p, the penalties) shape the target's
          distribution; speculative output is distributed exactly as plain sampling from it
          (token-identical to plain greedy decoding at temperature 0).
        - ``prediction``: text the output is expected to repeat much of (OpenAI's Predicted
          Outputs): those rows draft from it, with any drafter; the output stays the target's own.
        - End of generation (vLLM's semantics): ``ignore_eos`` keeps generating past EOS (emitted
          like any other token) to ``max_new_tokens``; ``stop_token_ids`` end it like EOS (finish
          reason "stop"; the id is in ``token_ids``, its text is not); ``min_tokens``: the first
          ``min_tokens`` tokens are never EOS (unless ``ignore_eos``) or a stop token, their
          probability set to 0 in the target's distribution before acceptance, so the output stays
          exact, and stop strings do not end generation before them.
        - ``logprobs=N`` (0 to 20): each result's ``logprobs`` has a
          :class:`~specdraft.types.TokenLogprob` per output token, its log-probability and the ``N``
          most likely tokens at its position, the numbers plain decoding gives there:
          ``logprobs_mode="processed"`` from the distribution the token was drawn from (after the
          penalties, temperature and filters; greedy: the penalized logits), ``"raw"`` from the
          model's logits (see :mod:`specdraft.engine.logprobs`).
        - ``logit_bias`` (OpenAI's): ``{token_id: bias}``, each bias from -100 to 100, added to that
          token's logit at every position before the penalties, temperature and filters (so it
          changes the target's distribution itself, and the output stays exact): -100 bans a token.
        - ``response_format`` (structured output; needs ``pip install 'specdraft[structured]'``):
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
        each = self._each_prompt(settings, options, len(texts), text=True)
        return self.generate_ids([self.encode(t, raw=raw) for t in texts], each)

    def encode(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids for ``prompt``: through the chat template unless ``raw`` or there is none."""
        return encode_prompt(self.tokenizer, prompt, raw)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], settings: GenerationSettings
                     | Sequence[GenerationSettings] | None = None, **options) -> list[GenerationResult]:
        """Generate from token ids (one list per sequence); no chat template is applied. Settings as
        for :meth:`generate`; the keyword ``prediction``: each sequence's predicted output, token ids
        (None: none)."""
        from .engine import GenerationInterrupted, Stream

        each = self._each_prompt(settings, options, self._prompt_count(prompt_ids), text=False)
        seqs = self._sequences(self._check_prompt_ids(prompt_ids, each), each)
        streams = [Stream(self._loop, s, self.tokenizer) for s in seqs]
        self._loop.submit(seqs, limit=False)
        try:
            for stream in streams:
                stream.wait()
        except KeyboardInterrupt:  # Ctrl-C: stop this call's sequences, keep what they generated
            for stream in streams:
                stream.close()
            raise GenerationInterrupted([self._interrupted(s) for s in seqs]) from None
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        results = [stream.result for stream in streams]
        if any(r.finish_reason == "interrupted" for r in results):  # a drafter's KeyboardInterrupt
            raise GenerationInterrupted(results)
        return results

    def _interrupted(self, seq) -> GenerationResult:
        """What ``seq`` generated before Ctrl-C stopped it."""
        from .engine.output import output_text
        from .engine.stream import result_of

        reason = seq.finish_reason if seq.finish_reason not in (None, "aborted") else "interrupted"
        text = None if self.tokenizer is None else output_text(
            self.tokenizer, seq.new_tokens, reason, seq.stop, min_tokens=seq.min_tokens,
            stop_token_ids=seq.stop_token_ids)
        result = result_of(seq, text)
        result.finish_reason = reason
        return result

    def stream(self, prompt: str, settings: GenerationSettings | None = None, *, raw: bool = False, **options):
        """Generate for one prompt, yielding text as tokens are accepted (several per step).

        Returns a :class:`~specdraft.engine.Stream`: iterate it for
        :class:`~specdraft.engine.StreamChunk` bursts (``.text``, ``.token_ids``, and with
        ``logprobs`` a ``.logprobs`` entry per token id); the texts add up to what :meth:`generate`
        returns, and ``stream.result`` has the whole result at the end. Close it (or use ``with``)
        to stop early. Settings as for :meth:`generate` (``prediction``: this prompt's text).
        """
        if self.tokenizer is None:
            raise ConfigError("this decoder has no tokenizer; use stream_ids() with token ids")
        text = check_prompts(prompt)
        if len(text) != 1:
            raise ConfigError("stream() takes one prompt; call it once per prompt", param="prompt")
        settings = GenerationSettings.of(settings, **options)
        return self.stream_ids(self.encode(text[0], raw=raw), settings)

    def stream_ids(self, prompt_ids: Sequence[int], settings: GenerationSettings | None = None, **options):
        """:meth:`stream` from token ids (one sequence; ``prediction``: its predicted output, text or
        token ids); raises QueueFull when ``max_waiting`` requests already wait. With ``n > 1``, a
        list of ``n`` streams: the prompt's choices (prefilled once; see :meth:`generate`)."""
        from .engine import Stream

        settings = GenerationSettings.of(settings, **options)
        seqs = self._sequences(self._check_prompt_ids([prompt_ids], [settings]), [settings])
        streams = [Stream(self._loop, seq, self.tokenizer) for seq in seqs]
        self._loop.submit(seqs)
        return streams[0] if settings.n == 1 else streams

    def chat(self, messages: Sequence[Mapping[str, Any]], settings: GenerationSettings | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
             parallel_tool_calls: bool | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
             **options) -> "ChatResult":
        """The assistant's answer to a conversation (OpenAI's messages: ``system``, ``user``,
        ``assistant`` with ``tool_calls``, ``tool`` with ``tool_call_id``), rendered by the chat template.

        ``tools``, ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function",
        "function": {"name": ...}}``) and ``parallel_tool_calls`` as in OpenAI's API: see
        :mod:`specdraft.tools` for how each is decoded (``required`` and a named function under a
        grammar, so the call is plain decoding's under it). ``settings`` and ``options`` as in
        :meth:`generate` (n=1). Returns a :class:`~specdraft.tools.ChatResult`: ``content``,
        ``tool_calls``, ``finish_reason`` ("tool_calls" when the answer calls tools) and the
        generation's ``result``.
        """
        from .tools import ChatResult, read_tools

        request = read_tools(tools, tool_choice, parallel_tool_calls)
        settings = GenerationSettings.of(settings, **options)
        if settings.n != 1:
            raise ConfigError("chat() answers one choice (n=1); call it again for more", param="n")
        reader = None
        if request is not None:
            reader = request.stream(self.tool_call_parser)
            settings = request.apply(settings)
        ids = self.encode_chat(messages, chat_template_kwargs, tools=request)
        result = self.generate_ids([ids], settings)[0]
        return ChatResult.of(result, reader, request)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], chat_template_kwargs: Mapping[str, Any] | None = None,
                    *, add_special_tokens: bool = False, check_text: Callable[[str], None] | None = None,
                    tools=None) -> list[int]:
        """Token ids of a conversation (``[{"role": ..., "content": ...}, ...]``) through the chat
        template, ending with the assistant's turn to speak.

        ``chat_template_kwargs``: more variables for the template (e.g. ``{"enable_thinking":
        False}``; ``add_generation_prompt`` and ``continue_final_message`` are transformers' own);
        ``add_special_tokens``: whether the tokenizer adds its special tokens (BOS) to the rendered
        text (the template usually has them); ``check_text`` is called with the rendered text before
        it is tokenized (the server refuses a text too long for the context there, untokenized);
        ``tools``: a :class:`~specdraft.tools.ToolRequest` whose functions the template shows the
        model (ConfigError when the template shows no tools, or drops an assistant's tool calls).
        """
        from .tools import check_template, template_messages

        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError("this model has no chat template; use completions with a plain prompt", param="messages")
        if chat_template_kwargs is not None and (not isinstance(chat_template_kwargs, Mapping)
                                                 or not all(isinstance(k, str) for k in chat_template_kwargs)):
            raise ConfigError("chat_template_kwargs must be a mapping of variable names (strings) to values, "
                              f"got {type(chat_template_kwargs).__name__}", param="chat_template_kwargs")
        options = {"add_generation_prompt": True, **(chat_template_kwargs or {})}
        # apply_chat_template's arguments that are not template variables (they change what it returns)
        reserved = sorted(set(options) & {"conversation", "tokenize", "chat_template", "tools", "documents",
                                          "return_dict", "return_tensors", "return_assistant_tokens_mask",
                                          "padding", "truncation", "max_length", "tokenizer_kwargs"})
        if reserved:
            raise ConfigError(f"chat_template_kwargs cannot set {', '.join(reserved)}: they are arguments of "
                              "apply_chat_template, not variables of the template", param="chat_template_kwargs")
        check_template(self.tokenizer, tools is not None, messages)
        if tools is not None:
            options["tools"] = tools.template_tools()
        messages = template_messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint, in one line
            raise ConfigError(f"the chat template cannot render these messages: {exc}", param="messages") from None
        if check_text is not None:
            check_text(text)
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def _each_prompt(self, settings, options: dict, count: int, *, text: bool) -> list[GenerationSettings]:
        """Each prompt's settings: ``settings`` (one, or a list with one per prompt) with the
        keyword ``options``, where ``prediction`` has an entry per prompt (text when ``text``, else
        token ids)."""
        predictions = options.pop("prediction", None)
        if isinstance(settings, (list, tuple)):
            if len(settings) != count:
                raise ConfigError(f"settings must be one GenerationSettings or a list of {count}, one per prompt "
                                  f"(got {len(settings)})", param="settings")
            each = [GenerationSettings.of(s, **options) for s in settings]
        else:
            each = [GenerationSettings.of(settings, **options)] * count
        if predictions is None:
            return each
        if text:
            from .verifier.prediction import check_prediction

            items = [predictions] if isinstance(predictions, str) else predictions
            if isinstance(items, (bytes, dict)) or not hasattr(items, "__len__") or len(items) != count:
                raise ConfigError(f"prediction must be a string (one prompt) or a list of {count} strings or None, "
                                  "one per prompt", param="prediction")
            items = [check_prediction(t, f"prediction[{i}]") for i, t in enumerate(items)]
        else:
            if isinstance(predictions, (str, bytes)) or not hasattr(predictions, "__len__") \
                    or len(predictions) != count:
                raise ConfigError(f"prediction must be a list with one entry per prompt ({count}): token ids or None",
                                  param="prediction")
            items = [None if ids is None else self._token_ids(ids, f"prediction {i}", "prediction") or None
                     for i, ids in enumerate(predictions)]
        return [s if p is None else s.replace(prediction=p) for s, p in zip(each, items)]

    def _sequences(self, prompts: list[list[int]], each: list[GenerationSettings]):
        """The engine's sequences for ``prompts`` (checked), prompt ``i`` with the settings ``each[i]``."""
        from .engine.sequence import sequences_for

        predictions, grammars = [], []
        for settings in each:
            settings.check_ids(self.target.vocab_size)
            if settings.stop and self.tokenizer is None:
                raise ConfigError("stop strings need a tokenizer to decode the output; this decoder has none",
                                  param="stop")
            predictions.append(self._predicted_ids(settings.prediction))
            grammars.append(self._grammars.compile(settings.response_format, stop_token_ids=settings.stop_token_ids))
        return sequences_for(prompts, each, self.target.max_context, predictions=predictions, grammars=grammars)

    def _predicted_ids(self, prediction) -> list[int] | None:
        """A request's predicted output (text, or token ids) as token ids, checked; None: none."""
        if prediction is None:
            return None
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise ConfigError("a predicted text needs a tokenizer; give token ids", param="prediction")
            prediction = self.tokenizer(prediction, add_special_tokens=False).input_ids
        return self._token_ids(prediction, "prediction", "prediction") or None

    @staticmethod
    def _prompt_count(prompt_ids) -> int:
        """How many prompts ``prompt_ids`` (a list of token-id lists) holds; ConfigError for another shape."""
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__") or len(prompt_ids) == 0:
            raise ConfigError("prompt_ids must be a non-empty list of token-id lists", param="prompt")
        if all(token_id(t) is not None for t in prompt_ids):
            raise ConfigError("prompt_ids must be a list of lists (one per sequence); wrap a single prompt: [ids]",
                              param="prompt")
        return len(prompt_ids)

    def _check_prompt_ids(self, prompt_ids, each: list[GenerationSettings]) -> list[list[int]]:
        """The prompts' token ids, checked, prompt ``i`` cut to its last ``each[i].truncate_prompt_tokens``."""
        self._prompt_count(prompt_ids)
        prompts = []
        for i, (ids, settings) in enumerate(zip(prompt_ids, each)):
            ids = self._token_ids(ids, f"prompt {i}", keep_last=settings.truncate_prompt_tokens)
            if not ids:
                raise ConfigError(f"prompt {i} is empty; give at least one token", param="prompt")
            prompts.append(ids)
        return prompts

    def _token_ids(self, ids, what: str, param: str = "prompt", keep_last: int | None = None) -> list[int]:
        """``ids`` (any iterable of integers) as a list (its last ``keep_last``), checked against the
        vocabulary and the context."""
        return check_token_ids(ids, what, self.target.vocab_size, self.target.max_context, param, keep_last)
