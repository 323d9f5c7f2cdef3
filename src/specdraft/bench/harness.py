"""``specdraft bench``: every method on every prompt, interleaved in one process."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError, SpecdraftError
from .report import PLAIN, RunRecord, markdown, summarize

PEERS = {"hf": ("hf-generate", "hf-prompt-lookup"), "llama-cpp": ("llama-cpp",)}
LLAMA_CPP_INSTALL = ("pip install 'specdraft[llama-cpp]' (llama-cpp-python; it compiles llama.cpp, about 5 minutes "
                     "on 2 cores)")


@dataclass
class BenchSettings:
    questions: str
    categories: Sequence[str] | None = None
    limit_per_category: int | None = 5
    drafters: Sequence[str] = ("ngram", "prompt-lookup")
    spec_length: int = 4
    #: False: every drafter drafts ``spec_length`` tokens every round (``--fixed-spec-length``)
    adaptive: bool = True
    max_new_tokens: int = 128
    temperature: float = 0.0
    peers: Sequence[str] = ()
    drafter_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the GGUF file the target was loaded from: the llama-cpp peer runs that same file
    gguf: str | None = None
    #: how specdraft runs the target (every specdraft method alike): see SpeculativeDecoder
    compile: bool | None = None
    quantize: str | None = None
    tensor_parallel: int = 1
    #: passes over every prompt, each with fresh decoders; each method keeps its median-time run of
    #: a prompt, so a slow moment of a shared machine skews one run, not the comparison (``--repeats``)
    repeats: int = 1


def split_method(entry: str) -> tuple[str, str]:
    """A ``--drafters`` entry -> ``(label, drafter)``: ``LABEL=DRAFTER`` runs DRAFTER under its own
    label (so one drafter can run twice with different options), a bare name is both."""
    label, sep, drafter = entry.partition("=")
    label, drafter = label.strip(), drafter.strip()
    if not sep:
        return label, label
    if not label or not drafter:
        raise ConfigError(f"--drafters entry {entry!r}: expected DRAFTER or LABEL=DRAFTER")
    return label, drafter


def load_questions(path: str | os.PathLike, categories: Sequence[str] | None = None,
                   limit_per_category: int | None = None) -> list[dict]:
    """Spec-Bench schema (``question_id``, ``category``, ``turns``); the first turn is the prompt
    (``turns`` and an optional ``system`` prompt are kept for ``bench-serve --multi-turn``).
    An optional ``prediction`` (text the answer is expected to mostly repeat, e.g. the original of
    an edit; ``null`` for none) is kept as the row's ``prediction``: see :class:`_Methods`;
    optional ``tools`` and ``tool_choice`` are kept for ``bench-serve`` (tool calling)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"questions file {str(path)!r} does not exist")
    rows, seen = [], {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            row = {"question_id": int(q["question_id"]), "category": str(q["category"]), "prompt": str(q["turns"][0])}
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: not a Spec-Bench question (need question_id, category, turns): {exc}") from None
        prediction = q.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise ConfigError(f"{path}:{n}: 'prediction' must be a string or null, not {type(prediction).__name__}")
        if prediction:  # "" predicts nothing, like null
            row["prediction"] = prediction
        row["turns"] = [str(t) for t in q["turns"]]  # bench-serve --multi-turn sends them all, in one conversation
        if q.get("system"):
            row["system"] = str(q["system"])
        for key in ("tools", "tool_choice"):  # bench-serve sends them as the chat request's (tool calling)
            if q.get(key) is not None:
                row[key] = q[key]
        if categories and row["category"] not in categories:
            continue
        if limit_per_category is not None and seen.get(row["category"], 0) >= limit_per_category:
            continue
        seen[row["category"]] = seen.get(row["category"], 0) + 1
        rows.append(row)
    if categories:
        missing = sorted(set(categories) - set(seen))
        if missing:
            raise ConfigError(f"no questions in categories {missing}; the file has {sorted(_categories(path))}")
    if not rows:
        raise ConfigError(f"no questions selected from {path}")
    return rows


def _categories(path: Path) -> set[str]:
    return {json.loads(line)["category"] for line in path.read_text().splitlines() if line.strip()}


def _version(package: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def environment(model, settings: BenchSettings, name: str) -> dict:
    import torch
    import transformers

    from .. import __version__

    from ..models import cpu_field, cpu_flags

    cpu = cpu_field("model name") or platform.processor() or platform.machine()
    device = model.device
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": name,
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({cpu}, {os.cpu_count()} cores; {', '.join(flags) or 'no AVX2'})",
        "torch_threads": torch.get_num_threads(),
        **({"llama-cpp": f"llama-cpp-python {_version('llama-cpp-python')}, {Path(settings.gguf).name}, "
                         f"{torch.get_num_threads()} threads"} if "llama-cpp" in settings.peers else {}),
        "spec_length": settings.spec_length if settings.adaptive else f"{settings.spec_length} (fixed)",
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        **({"repeats": f"{settings.repeats} (whole passes, each with fresh decoders; each method's median-time run "
                       "per prompt)"} if settings.repeats > 1 else {}),
        "versions": f"specdraft {__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
                    f"python {platform.python_version()}",
    }


class _Methods:
    """The runnable methods: plain, the drafters, and the peers, sharing one model.

    A question's ``prediction`` goes to the drafters' decoders as token ids of the text alone
    (no chat template, no special tokens: what the answer is expected to repeat), not to plain
    decoding nor to the peers, which have no way to use one."""

    def __init__(self, model, tokenizer, settings: BenchSettings) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.decoders = self._decoders()
        self.names = list(self.decoders)
        for peer in settings.peers:
            if peer not in PEERS:
                raise ConfigError(f"unknown peer {peer!r}; known peers: {', '.join(PEERS)}")
            self.names += PEERS[peer]
        self.llama = _llama_cpp(settings.gguf, model) if "llama-cpp" in settings.peers else None
        self.eos = set(self.decoders[PLAIN].target.eos_token_ids)
        self._predictions: dict[str, list[int]] = {}

    def _decoders(self) -> dict:
        """plain decoding's and each drafter's decoder, by label."""
        from ..decoder import SpeculativeDecoder

        s = self.settings
        runner = dict(compile=s.compile, quantize=s.quantize, tensor_parallel=s.tensor_parallel)
        decoders = {PLAIN: SpeculativeDecoder(self.model, self.tokenizer, drafter="none", spec_length=s.spec_length,
                                              **runner)}
        for entry in s.drafters:
            label, drafter = split_method(entry)
            if label in decoders:
                raise ConfigError(f"--drafters runs {label!r} twice; give one of them a label (LABEL={drafter})")
            decoders[label] = SpeculativeDecoder(self.model, self.tokenizer, drafter=drafter, spec_length=s.spec_length,
                                                 adaptive=s.adaptive, drafter_options=s.drafter_options.get(label),
                                                 **runner)
        return decoders

    def renew(self) -> None:
        """Fresh decoders in place of the ones that ran (closed): what a decoder keeps between
        requests (its prefix cache, a drafter's memory of earlier outputs as suffix decoding's,
        the learnt draft lengths) starts again empty. The peers keep nothing of a prompt once
        the next one has run."""
        for decoder in self.decoders.values():
            decoder.close()
        self.decoders = self._decoders()

    def prediction_ids(self, question: dict) -> list[int] | None:
        """The question's prediction as token ids (tokenized once), or None without one."""
        text = question.get("prediction")
        if text is None:
            return None
        if text not in self._predictions:
            self._predictions[text] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._predictions[text]

    def run(self, method: str, ids: list[int], question: dict) -> RunRecord:
        s = self.settings
        seed = question["question_id"]
        kw: dict[str, Any] = {}
        if method in self.decoders and method != PLAIN:
            prediction = self.prediction_ids(question)  # before the clock starts
            if prediction is not None:
                kw["prediction"] = [prediction]
        start = time.perf_counter()
        if method in self.decoders:
            r = self.decoders[method].generate_ids([ids], max_new_tokens=s.max_new_tokens,
                                                   temperature=s.temperature, seed=seed, **kw)[0]
            elapsed = time.perf_counter() - start
            st = r.stats
            return RunRecord(method, question["question_id"], question["category"], len(r.token_ids), elapsed,
                             r.token_ids, st.drafted_tokens, st.accepted_tokens, st.target_passes,
                             st.drafted_per_position, st.accepted_per_position, st.draft_time_s, st.verify_time_s,
                             st.drafts)
        token_ids = self._llama_cpp(ids, seed) if method == "llama-cpp" else self._hf(method, ids, seed)
        elapsed = time.perf_counter() - start
        return RunRecord(method, question["question_id"], question["category"], len(token_ids), elapsed, token_ids)

    def _hf(self, method: str, ids: list[int], seed: int) -> list[int]:
        import torch

        s = self.settings
        kw: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "pad_token_id": self.tokenizer.eos_token_id}
        if s.temperature > 0:
            torch.manual_seed(seed)
            kw.update(do_sample=True, temperature=s.temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if method == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = s.spec_length
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([ids], device=self.model.device), **kw)
        return out[0, len(ids):].tolist()


    def _llama_cpp(self, ids: list[int], seed: int) -> list[int]:
        """llama.cpp on the same token ids (the chat template applied by the same tokenizer)."""
        s, out = self.settings, []
        self.llama.set_seed(seed)
        for token in self.llama.generate(ids, temp=s.temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                         reset=True):
            out.append(int(token))
            if token in self.eos or len(out) >= s.max_new_tokens:
                break
        return out


def _llama_cpp(gguf: str | None, model):
    """A llama.cpp model of the target's own GGUF file, with as many threads as torch uses."""
    import torch

    if gguf is None:
        raise ConfigError("the llama-cpp peer runs the target's GGUF file: use the default model or "
                          "--target FILE.gguf")
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(f"the llama-cpp peer needs llama-cpp-python: {LLAMA_CPP_INSTALL}") from None
    context = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 8192)
    threads = torch.get_num_threads()
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=min(context, 8192), n_threads=threads,
                           n_threads_batch=threads, verbose=False)


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_bench`. ``records``, ``summary`` and ``env`` cover the prompts that
    finished for every method (``finished`` of ``total``); the prompt under way is dropped, so every
    method is compared on the same prompts. A ``KeyboardInterrupt``, so callers that do not look
    for it still stop as on any Ctrl-C."""

    def __init__(self, records: list[RunRecord], summary: dict, env: dict, finished: int, total: int) -> None:
        super().__init__(f"bench interrupted after {finished} of {total} prompts")
        self.records, self.summary, self.env = records, summary, env
        self.finished, self.total = finished, total


def run_bench(model, tokenizer, settings: BenchSettings, name: str = "", progress: bool = True):
    """Run everything; returns ``(records, summary, env)``. On Ctrl-C raises :class:`BenchInterrupted`
    with the same three for the prompts that finished for every method."""
    from tqdm.auto import tqdm

    questions = load_questions(settings.questions, settings.categories, settings.limit_per_category)
    methods = _Methods(model, tokenizer, settings)
    runs: dict[tuple[str, int], list[RunRecord]] = {}  # (method, question) -> its runs, one a pass
    finished = 0
    bar = tqdm(total=len(questions) * len(methods.names) * settings.repeats, disable=not progress, unit="run",
               desc="bench")
    try:
        encoded = [methods.decoders[PLAIN].encode(q["prompt"]) for q in questions]
        for repeat in range(settings.repeats):
            if repeat:  # a pass as the first ran: fresh decoders (no prefix cache, drafter memory nor
                methods.renew()  # learnt lengths from the pass before, which has just run these prompts)
            for decoder in methods.decoders.values():  # compiles every pass width up front, not counted
                decoder.warm_up()
            for method in methods.names:  # warm-up, not counted
                methods.run(method, encoded[0][:64], {**questions[0], "question_id": 0})
            for q, ids in zip(questions, encoded):
                row = []
                for method in methods.names:
                    bar.set_postfix_str(f"{q['category']} #{q['question_id']} {method}"
                                        + (f" (pass {repeat + 1} of {settings.repeats})" if settings.repeats > 1 else ""))
                    row.append(methods.run(method, ids, q))
                    bar.update()
                for record in row:  # only whole prompts: every method on it
                    runs.setdefault((record.method, record.question_id), []).append(record)
                finished += repeat == 0
    except KeyboardInterrupt:  # GenerationInterrupted from inside a generation included
        interrupted = True
    else:
        interrupted = False
    finally:
        bar.close()
    records = [median_run(runs[(method, q["question_id"])]) for q in questions[:finished] for method in methods.names]
    env = environment(model, settings, name)
    plain = methods.decoders[PLAIN]
    env["runner"] = plain.runner_info
    if plain.runner_info["compiled"]:
        env["compile_seconds"] = round(sum(d.runner.compile_seconds for d in methods.decoders.values()), 1)
    if interrupted:
        env["questions"] = f"{settings.questions} ({finished} of {len(questions)} prompts: interrupted)"
        env["interrupted"] = f"after {finished} of {len(questions)} prompts (Ctrl-C); the unfinished prompt is dropped"
    else:
        env["questions"] = f"{settings.questions} ({len(questions)} prompts)"
    predicted = sum(q.get("prediction") is not None for q in questions)
    if predicted:
        env["predictions"] = (f"{predicted} of {len(questions)} prompts carry a prediction, given to the drafters "
                              f"(not to plain decoding nor the peers)")
    for drafter, options in settings.drafter_options.items():
        env[f"{drafter} options"] = ", ".join(f"{k}={v}" for k, v in options.items())
    if interrupted:
        raise BenchInterrupted(records, summarize(records), env, finished, len(questions)) from None
    return records, summarize(records), env


def median_run(runs: list[RunRecord]) -> RunRecord:
    """The run of median time (the lower one of an even count). specdraft's repeats must give the
    same tokens (greedy, or sampled with the prompt's seed): a run that differs is a determinism
    bug, not noise, and the bench stops with one line. (A peer's are its own affair.)"""
    if runs[0].drafted is not None and any(r.token_ids != runs[0].token_ids for r in runs[1:]):
        raise SpecdraftError(f"{runs[0].method} gave different tokens on repeats of prompt {runs[0].question_id} "
                             "with the same inputs and seed: its output is not deterministic; report it "
                             "(and run without --repeats meanwhile)")
    return sorted(runs, key=lambda r: r.time_s)[(len(runs) - 1) // 2]


def write_outputs(output: str | os.PathLike, records: list[RunRecord], summary: dict, env: dict) -> Path:
    """results.json, results.md and the PNG plots in ``output``."""
    from .plots import acceptance_by_position, speedup_by_category

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "summary": summary, "records": [r.to_dict() for r in records]}
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    (out / "results.md").write_text(markdown(summary, env))
    speedup_by_category(summary, out / "speedup_by_category.png")
    acceptance_by_position(summary, out / "acceptance_by_position.png")
    return out
