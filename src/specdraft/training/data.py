"""Training prompts and the target's own outputs on them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError


def _prompt_of(row: dict) -> str | None:
    if "instruction" in row:  # self-instruct: instruction + the first instance's input
        inputs = [i.get("input", "") for i in row.get("instances", []) if i.get("input")]
        return row["instruction"] + (("\n\n" + inputs[0]) if inputs else "")
    if "question" in row:  # gsm8k
        return row["question"]
    if "turns" in row:  # spec-bench schema
        return row["turns"][0]
    return row.get("prompt")


def load_prompts(paths: Sequence[str | Path], limit: int | None = None, seed: int = 0) -> list[str]:
    """Prompts from JSONL files in self-instruct, GSM8K, Spec-Bench or ``{"prompt": ...}`` form.

    Files are interleaved after a seeded shuffle each, so a ``limit`` keeps a mix of them.
    """
    per_file = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"prompt file {str(path)!r} does not exist")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = _prompt_of(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not JSON: {exc}") from None
            if prompt and prompt.strip():
                prompts.append(prompt)
        random.Random(seed).shuffle(prompts)
        per_file.append(prompts)
    longest = max((len(g) for g in per_file), default=0)
    mixed = [g[i] for i in range(longest) for g in per_file if i < len(g)]  # round-robin over files
    mixed = list(dict.fromkeys(mixed))
    if not mixed:
        raise ConfigError("no prompts found in " + ", ".join(map(str, paths)))
    return mixed[:limit] if limit else mixed


def generate_sequences(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 16,
                       temperature: float = 0.0, seed: int = 0, progress: bool = True) -> list[dict]:
    """The target's outputs: ``[{"ids": prompt+output ids, "prompt_len": n}]``, batched."""
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
        out += [{"ids": ids + r.token_ids, "prompt_len": len(ids)} for ids, r in zip(batch, results)]
        bar.update(len(batch))
    bar.close()
    return out
