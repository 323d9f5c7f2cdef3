"""Training prompts and the target's own outputs on them."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..errors import ConfigError
from .io import file_sha256, key_of, read_cache, write_atomic, write_cache

if TYPE_CHECKING:  # pragma: no cover
    import torch

_JSON_TYPES = {str: "a string", int: "a number", float: "a number", bool: "true/false", list: "a list",
               dict: "an object", type(None): "null"}


def _text(value, field: str, where: str) -> str | None:
    """``value`` if it is a string (or absent), else a :class:`ConfigError` naming the line."""
    if value is None or isinstance(value, str):
        return value
    raise ConfigError(f"{where}: {field!r} must be a string, not {_JSON_TYPES.get(type(value), 'a value')} "
                      f"({json.dumps(value)[:40]})")


def _example_of(row: dict, where: str = "prompt file") -> tuple[str | None, str | None]:
    """``(prompt, reference answer or None)`` of one JSONL row (``where``: its file and line, for errors)."""
    if "instruction" in row:  # self-instruct: instruction + the first instance's input, its output
        instances = row.get("instances", [])
        if not isinstance(instances, list) or not all(isinstance(i, dict) for i in instances):
            raise ConfigError(f"{where}: 'instances' must be a list of objects with 'input' and 'output'")
        with_input = [i for i in instances if _text(i.get("input"), "input", where)]
        first = with_input[0] if with_input else (instances[0] if instances else {})
        instruction = _text(row["instruction"], "instruction", where) or ""
        prompt = instruction + (("\n\n" + first["input"]) if first.get("input") else "")
        return prompt, _text(first.get("output"), "output", where) or None
    if "question" in row:  # gsm8k; its calculator annotations <<48/2=24>> are not prose
        answer = _text(row.get("answer"), "answer", where)
        return _text(row["question"], "question", where), re.sub(r"<<[^>]*>>", "", answer) if answer else None
    if "turns" in row:  # spec-bench schema: no reference answers
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            raise ConfigError(f"{where}: 'turns' must be a non-empty list of strings")
        return _text(turns[0], "turns", where), None
    return (_text(row.get("prompt"), "prompt", where),
            _text(row.get("answer"), "answer", where) or _text(row.get("response"), "response", where))


def _check_exists(path: str | Path) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"prompt file {str(path)!r} does not exist")


def _read_rows(path: str | Path):
    """``(where, row)`` of each non-blank line: ``where`` is ``file:line``, ``row`` a JSON object."""
    _check_exists(path)
    for n, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark may start the file
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                              "save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object such as {{\"prompt\": \"...\"}}, not "
                              f"{_JSON_TYPES.get(type(row), 'a value')}")
        yield where, row


def _mixed(per_file: list[list], seed: int, limit: int | None) -> list:
    """Shuffle each file's items (seeded), interleave the files, drop duplicates, cut at ``limit``."""
    for items in per_file:
        random.Random(seed).shuffle(items)
    longest = max((len(g) for g in per_file), default=0)
    mixed = list(dict.fromkeys(g[i] for i in range(longest) for g in per_file if i < len(g)))
    return mixed[:limit] if limit else mixed


def load_prompts(paths: Sequence[str | Path], limit: int | None = None, seed: int = 0) -> list[str]:
    """Prompts from JSONL files in self-instruct, GSM8K, Spec-Bench or ``{"prompt": ...}`` form.

    Files are interleaved after a seeded shuffle each, so a ``limit`` keeps a mix of them.
    """
    per_file = [[p for p, _ in (_example_of(row, where) for where, row in _read_rows(path)) if p and p.strip()]
                for path in paths]
    mixed = _mixed(per_file, seed, limit)
    if not mixed:
        raise ConfigError("no prompts found in " + ", ".join(map(str, paths)))
    return mixed


def load_examples(paths: Sequence[str | Path], limit: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """``(prompt, reference answer)`` pairs (self-instruct outputs, GSM8K solutions), mixed like prompts."""
    per_file = [[(p, a) for p, a in (_example_of(row, where) for where, row in _read_rows(path)) if p and a]
                for path in paths]
    mixed = _mixed(per_file, seed, limit)
    if not mixed:
        raise ConfigError("no prompts with reference answers found in " + ", ".join(map(str, paths)))
    return mixed


def chat_sequences(tokenizer, examples: Sequence[tuple[str, str]], max_tokens: int = 384) -> list[dict]:
    """Examples as the target would see them: chat-formatted prompt, answer, end of turn.

    Returns ``[{"ids": ..., "prompt_len": n}]`` like :func:`generate_sequences`, cut at ``max_tokens``.
    """
    from ..models import encode_prompt

    out = []
    for prompt, answer in examples:
        ids = encode_prompt(tokenizer, prompt)
        answer_ids = tokenizer(answer, add_special_tokens=False).input_ids
        if tokenizer.eos_token_id is not None:
            answer_ids.append(tokenizer.eos_token_id)
        if len(ids) < max_tokens - 8:
            out.append({"ids": (ids + answer_ids)[:max_tokens], "prompt_len": len(ids)})
    return out


def frequent_tokens(sequences: list[dict], count: int, always: Sequence[int] = ()) -> "torch.Tensor":
    """Ids of the ``count`` most frequent answer tokens (plus ``always``), sorted."""
    import torch

    freq = Counter(t for s in sequences for t in s["ids"][s["prompt_len"]:])
    keep = list(dict.fromkeys([*always, *(t for t, _ in freq.most_common())]))[:count]
    return torch.tensor(sorted(keep), dtype=torch.long)


def target_identity(model, tokenizer=None) -> dict:
    """What identifies the target in a cache key: its weights' fingerprint, its dtype, its tokenizer."""
    from ..drafters.common.compact_draft import target_fingerprint

    out = {"fingerprint": target_fingerprint(model.get_input_embeddings().weight), "dtype": str(model.dtype)}
    if tokenizer is not None:
        out["tokenizer"] = key_of([sorted(tokenizer.get_vocab().items()), getattr(tokenizer, "chat_template", None),
                                   tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id])
    return out


def sequences_key(sequences: Sequence[dict]) -> str:
    """The key of training sequences' content (ids and where their answers start)."""
    return key_of([[s["ids"], s["prompt_len"]] for s in sequences])


def prompt_files_record(paths: Sequence[str | Path]) -> list[dict]:
    """Prompt files as cache keys know them: by their content's hash (and their name, to report)."""
    for path in paths:
        _check_exists(path)
    return [{"name": Path(p).name, "sha256": file_sha256(p)} for p in paths]


def target_generations(model, tokenizer, prompt_files: Sequence[str], cache_file: Path, num_prompts: int,
                       sampled_fraction: float = 0.25, max_new_tokens: int = 128, batch_size: int = 16,
                       seed: int = 0, progress: bool = True) -> list[dict]:
    """The target's answers to ``num_prompts`` training prompts: greedy, plus a sampled share (T=0.7).

    Cached in ``cache_file`` (the slow part of training), keyed by everything that produced
    them: reused when the prompt files' content, the counts, lengths, seed, batch size and
    target are the same, rebuilt otherwise.
    """
    inputs = {"prompt_files": prompt_files_record(prompt_files), "num_prompts": num_prompts,
              "sampled_fraction": sampled_fraction, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
              "seed": seed, "target": target_identity(model, tokenizer)}
    cached = read_cache(cache_file, inputs, "answers", progress)
    if cached is not None:
        return cached
    prompts = load_prompts(prompt_files, limit=num_prompts, seed=seed)
    n_sampled = int(len(prompts) * sampled_fraction)
    sequences = generate_sequences(model, tokenizer, prompts[n_sampled:], max_new_tokens, batch_size,
                                   progress=progress)
    if n_sampled:
        sequences += generate_sequences(model, tokenizer, prompts[:n_sampled], max_new_tokens, batch_size,
                                        temperature=0.7, seed=seed, progress=progress)
    write_cache(cache_file, inputs, sequences)
    return sequences


def generate_sequences(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 16,
                       temperature: float = 0.0, seed: int = 0, progress: bool = True) -> list[dict]:
    """The target's outputs: ``[{"ids": prompt+output ids, "prompt_len": n, "greedy": bool}]``, batched."""
    from tqdm.auto import tqdm

    from ..decoder import SpeculativeDecoder

    dec = SpeculativeDecoder(model, tokenizer, drafter="none")
    out = []
    bar = tqdm(total=len(prompts), disable=not progress, unit="prompt",
               desc=f"target outputs (T={temperature:g})")
    for start in range(0, len(prompts), batch_size):
        batch = [dec.encode(p) for p in prompts[start : start + batch_size]]
        results = dec.generate_ids(batch, max_new_tokens=max_new_tokens, temperature=temperature,
                                   seed=seed + start if temperature > 0 else None)
        out += [{"ids": ids + r.token_ids, "prompt_len": len(ids), "greedy": temperature == 0}
                for ids, r in zip(batch, results)]
        bar.update(len(batch))
    bar.close()
    return out


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's message begins."""
    marker = "\x00MARK\x00"
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the target has no chat template, so it cannot write prompts for itself")
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False).input_ids


def self_prompted_generations(model, tokenizer, cache_file: Path, count: int, max_new_tokens: int = 128,
                              batch_size: int = 16, seed: int = 0, progress: bool = True) -> list[dict]:
    """Prompts the target writes itself (sampled from its user-turn prefix), and its greedy answers.

    More varied than any fixed prompt set at hand, and in the target's own distribution.
    Cached in ``cache_file``, keyed like :func:`target_generations`.
    """
    from tqdm.auto import tqdm

    from ..decoder import SpeculativeDecoder

    inputs = {"self_prompts": count, "max_new_tokens": max_new_tokens, "batch_size": batch_size, "seed": seed,
              "target": target_identity(model, tokenizer)}
    cached = read_cache(cache_file, inputs, "self-written prompts and answers", progress)
    if cached is not None:
        return cached
    dec = SpeculativeDecoder(model, tokenizer, drafter="none")
    prefix = user_turn_prefix(tokenizer)
    prompts: list[str] = []
    bar = tqdm(total=count, disable=not progress, unit="prompt", desc="prompts written by the target")
    attempt, patience = 0, 4 * (count // batch_size + 1)
    while len(prompts) < count:
        results = dec.generate_ids([prefix] * batch_size, max_new_tokens=96, temperature=1.0, top_p=0.95,
                                   seed=seed + attempt)
        attempt += 1
        for r in results:
            text = (r.text or "").strip()
            finished = r.finish_reason == "eos" or attempt > patience  # then take unfinished ones too
            if finished and len(r.token_ids) >= 8 and text and text not in prompts and len(prompts) < count:
                prompts.append(text)
                bar.update()
    bar.close()
    sequences = generate_sequences(model, tokenizer, prompts, max_new_tokens, batch_size, progress=progress)
    write_cache(cache_file, inputs, sequences)
    return sequences


def states_file(work: Path, name: str, layers: Sequence[int] | None = None) -> Path:
    """Where :func:`target_features` caches ``name``'s states: ``WORK/NAME.safetensors`` for the
    last layer's, ``WORK/NAME_layers_2_15_27_30.safetensors`` for chosen layers' (so the caches
    of kinds that read other layers never overwrite one another)."""
    suffix = "" if layers is None else "_layers_" + "_".join(str(int(i)) for i in layers)
    return work / f"{name}{suffix}.safetensors"


def target_features(model, sequences: Sequence[dict], cache_file: Path | None = None, batch_tokens: int = 4096,
                    progress: bool = True, desc: str = "target states", layers: Sequence[int] | None = None,
                    dtype=None) -> list:
    """The target's last-layer hidden states (after its final norm) at every position of each sequence.

    Returns one ``[len(ids), hidden]`` float16 tensor per sequence, computed once in
    length-sorted batches and cached in ``cache_file`` (safetensors) when given, keyed by the
    sequences' content, the batching and the target.

    ``layers``: instead, the entries ``i`` of transformers' ``output_hidden_states`` side by side
    (``[len(ids), len(layers) * hidden]``, in the order given): entry ``i < n_layers`` is the
    residual stream entering block ``i``, entry ``n_layers`` the final-norm state (EAGLE-3
    reads three layers and trains on the last one's distribution). ``dtype``: of the returned
    states (default float16; layer states beyond its range, such as the massive activations of
    some middle layers, are clamped to it rather than becoming inf).
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    dtype = dtype or torch.float16
    inputs = {"sequences": sequences_key(sequences), "batch_tokens": batch_tokens, "target": target_identity(model)}
    if layers is not None:  # only then: the last-layer caches of earlier runs keep their key
        n_layers = model.config.get_text_config().num_hidden_layers
        layers = [int(i) for i in layers]
        if not layers or any(not 0 <= i <= n_layers for i in layers):
            raise ConfigError(f"target layers {layers} are not all among 0..{n_layers} (the target has {n_layers} "
                              f"layers; {n_layers} is its final-norm state)")
        inputs["layers"] = layers
    if dtype != torch.float16:
        inputs["dtype"] = str(dtype)

    def load(path: Path):
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["specdraft"])
            flat = {k: f.get_tensor(k) for k in ("states", "lengths")}
        return meta["key"], meta["inputs"], list(flat["states"].split(flat["lengths"].tolist()))

    if cache_file is not None:
        cached = read_cache(cache_file, inputs, desc, progress, load=load)
        if cached is not None:
            return cached
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["ids"]))
    lengths = [len(s["ids"]) for s in sequences]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    width = model.config.get_text_config().hidden_size * (len(layers) if layers is not None else 1)
    flat = torch.empty((starts[-1], width), dtype=dtype)  # every sequence's states, written in place: no copies
    limit = torch.finfo(dtype).max
    decoder = model.get_decoder()
    bar = tqdm(total=len(sequences), disable=not progress, desc=desc, unit="seq")
    i = 0
    with torch.inference_mode():
        while i < len(order):
            j = i + 1
            while j < len(order) and lengths[order[j]] * (j - i + 1) <= batch_tokens:
                j += 1
            batch = [sequences[o]["ids"] for o in order[i:j]]
            longest = max(len(b) for b in batch)
            ids = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for b, row in enumerate(batch):
                ids[b, : len(row)] = torch.tensor(row)
                mask[b, : len(row)] = 1
            out = decoder(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                          output_hidden_states=layers is not None)
            if layers is None:
                hidden = out.last_hidden_state
            else:  # [rows, W, len(layers) * H]
                hidden = torch.cat([out.hidden_states[k] for k in layers], -1).clamp(-limit, limit)
            for b, o in enumerate(order[i:j]):
                flat[starts[o] : starts[o + 1]] = hidden[b, : lengths[o]].to(dtype).cpu()
            del out, hidden
            bar.update(j - i)
            i = j
    bar.close()
    if cache_file is not None:
        meta = {"specdraft": json.dumps({"key": key_of(inputs), "inputs": inputs})}
        tensors = {"states": flat, "lengths": torch.tensor(lengths, dtype=torch.long)}
        write_atomic(cache_file, lambda tmp: save_file(tensors, tmp, metadata=meta))
    return list(flat.split(lengths))


#: instructions that make the target work over a document (summarize, extract, rewrite), so
#: that drafters also learn what it does with long inputs; ``{text}`` is one of its own answers
DOCUMENT_TASKS = (
    "Summarize: {text}",
    "Summarize the following text in a few sentences.\n\n{text}",
    "{text}\n\nWhat are the main points of the text above?",
    "Extract the key facts from this text as a bulleted list:\n\n{text}",
    "Rewrite the following text in simpler words:\n\n{text}",
    "{text}\n\nWrite a one-sentence summary of the text above.",
    "Read the text and answer: what is it mostly about?\n\n{text}",
)


def document_prompts(tokenizer, sequences: Sequence[dict], count: int, seed: int = 0, min_tokens: int = 64,
                     max_parts: int = 3) -> list[str]:
    """``count`` prompts asking the target to work over documents made of its own answers.

    A document joins one to ``max_parts`` answers of at least ``min_tokens`` tokens (long
    inputs like articles), and each prompt wraps it in one of :data:`DOCUMENT_TASKS`.
    """
    texts = [tokenizer.decode(s["ids"][s["prompt_len"]:], skip_special_tokens=True).strip() for s in sequences
             if len(s["ids"]) - s["prompt_len"] >= min_tokens]
    texts = [t for t in texts if t]
    if not texts:
        raise ConfigError(f"no answer of {min_tokens}+ tokens to build document prompts from")
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        parts = rng.sample(texts, min(len(texts), rng.randint(1, max_parts)))
        prompts.append(DOCUMENT_TASKS[i % len(DOCUMENT_TASKS)].format(text="\n\n".join(parts)))
    return prompts


def target_answers(model, tokenizer, prompt_files: Sequence[str], work: Path, num_prompts: int, self_prompts: int = 0,
                   sampled_fraction: float = 0.25, max_new_tokens: int = 128, batch_size: int = 16, seed: int = 0,
                   states: bool = True, progress: bool = True, document_prompts_count: int = 0,
                   layers: Sequence[int] | None = None):
    """The target's answers to ``num_prompts`` prompts from the files, ``self_prompts`` prompts it
    wrote itself and ``document_prompts_count`` prompts over documents made of those answers
    (:func:`document_prompts`), and (with ``states``) its hidden states over them (its last
    layer's, or those of ``layers``: see :func:`target_features`); everything cached in ``work``.

    Returns ``(sequences, states or None)``. distill and train-heads both train on this.
    """
    parts = [(target_generations(model, tokenizer, prompt_files, work / "sequences.json", num_prompts,
                                 sampled_fraction, max_new_tokens, batch_size, seed, progress), "answer_states")]
    if self_prompts:
        parts.append((self_prompted_generations(model, tokenizer, work / f"self_prompted_{self_prompts}.json",
                                                self_prompts, max_new_tokens, batch_size, seed, progress),
                      f"self_prompted_{self_prompts}_states"))
    if document_prompts_count:
        cache = work / f"document_prompted_{document_prompts_count}.json"
        sources = [s for part, _ in parts for s in part]
        inputs = {"document_prompts": document_prompts_count, "from": sequences_key(sources), "seed": seed,
                  "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                  "target": target_identity(model, tokenizer)}
        docs = read_cache(cache, inputs, "answers to document prompts", progress)
        if docs is None:
            prompts = document_prompts(tokenizer, sources, document_prompts_count, seed)
            docs = generate_sequences(model, tokenizer, prompts, max_new_tokens, batch_size, progress=progress)
            write_cache(cache, inputs, docs)
        parts.append((docs, f"document_prompted_{document_prompts_count}_states"))
    sequences = [s for part, _ in parts for s in part]
    if not states:
        return sequences, None
    found = []
    for part, name in parts:
        found += target_features(model, part, states_file(work, name, layers), progress=progress,
                                 desc=f"target states ({name.removesuffix('_states').replace('_', ' ')})",
                                 layers=layers)
    return sequences, found
