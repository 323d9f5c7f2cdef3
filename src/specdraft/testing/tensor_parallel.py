"""Checks of a target sharded over 2 ranks (gloo on 127.0.0.1), run in a process of their own.

    python -m specdraft.testing.tensor_parallel results.json [--default-model]

A tensor-parallel group is one per process and its ranks are processes, so the tests run these
checks once in a fresh interpreter and read the JSON it writes (tests/runner/test_tensor_parallel.py):

* ``logits``: per tiny architecture, the largest difference between the sharded and the
  unsharded target's logits (float64) over a ragged prefill and a 3-token pass;
* ``refused``: the one line for more ranks than KV heads (qwen3's tiny model has one);
* ``greedy``: per drafter (prompt-lookup, draft-model, eagle chain and tree), whether greedy
  speculative output equals plain decoding of the same sharded target, and transformers'
  plain greedy of the unsharded one, on a ragged batch (float64);
* ``sampled`` / ``sampled bf16``: the chi-square p-value of a sampling draft-model's first K + 1
  tokens against the sharded target's exact distribution, enumerated from its own logits
  (:func:`~specdraft.testing.stats.sampled_joint_pvalue`), float64 / bfloat16;
* ``idle and close``: answers after idling past the pass timeout (with ``SPECDRAFT_TP_TIMEOUT``
  under a minute), and a closed decoder's runner refusing a pass with one line;
* ``default`` (with ``--default-model``): the same difference on SmolLM2-135M-Instruct, and
  whether greedy prompt-lookup equals plain decoding of the sharded model in bfloat16.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

TP = 2


def logits_difference(hf, group) -> float:
    """Largest |sharded - unsharded| logit over a ragged prefill of 2 rows then a 3-token pass."""
    import torch

    from ..runner import load_runner

    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefill, step = torch.randint(0, vocab, (2, 7), generator=gen), torch.randint(0, vocab, (2, 3), generator=gen)
    outs = []
    for runner in (load_runner(hf), group.runner(hf)):
        runner.cache.reset(2, 64)
        with torch.inference_mode():
            first = runner.forward(prefill, advance=torch.tensor([7, 5]))[0]
            second = runner.forward(step)[0]
        outs.append(torch.cat([first, second], dim=1))
        if hasattr(runner, "close"):
            runner.close()
    return float((outs[0] - outs[1]).abs().max())


def architectures(group) -> tuple[dict[str, float], str]:
    from ..errors import ConfigError
    from .architectures import KINDS, tiny_hf

    diffs, refused = {}, ""
    for kind in KINDS:
        hf = tiny_hf(kind)
        if hf.config.num_key_value_heads < TP:
            try:
                group.runner(hf)
            except ConfigError as exc:
                refused = str(exc)
            continue
        diffs[kind] = logits_difference(hf, group)
    return diffs, refused


def greedy(work: Path) -> dict[str, dict]:
    from ..decoder import SpeculativeDecoder
    from .models import random_heads, repetitive_prompts, tiny_llama
    from .reference import plain_greedy

    target = tiny_llama(vocab_size=64, seed=0)
    tiny_llama(vocab_size=64, seed=7, layers=1).save_pretrained(work / "draft")
    heads = random_heads("eagle", target, work / "eagle")
    prompts = repetitive_prompts(64, seed=0)[:3]
    new = 24
    reference = [plain_greedy(target, p, new) for p in prompts]
    plain = SpeculativeDecoder(target, None, drafter="none", max_batch=4, tensor_parallel=TP)
    expected = [r.token_ids for r in plain.generate_ids(prompts, max_new_tokens=new)]
    methods = {
        "prompt-lookup": ("prompt-lookup", {}),
        "draft-model": ("draft-model", {"model": str(work / "draft"), "dtype": "float64", "min_confidence": 0.0}),
        "eagle": ("eagle", {"heads": str(heads), "min_confidence": 0.0}),
        "eagle-tree": ("eagle", {"heads": str(heads), "min_confidence": 0.0, "tree_budget": 6}),
    }
    out = {"plain equals unsharded transformers": expected == reference}
    for label, (drafter, options) in methods.items():
        dec = SpeculativeDecoder(target, None, drafter=drafter, drafter_options=options, spec_length=3,
                                 adaptive=False, max_batch=4, tensor_parallel=TP)
        results = dec.generate_ids(prompts, max_new_tokens=new)
        out[label] = {"equal": [r.token_ids for r in results] == expected,
                      "accepted": sum(r.stats.accepted_tokens for r in results),
                      "drafted": sum(r.stats.drafted_tokens for r in results)}
        if label == "eagle-tree":  # again: every prompt pass (and its hidden states) from each rank's prefix cache
            again = dec.generate_ids(prompts, max_new_tokens=new)
            out["prefix cache"] = {"equal": [r.token_ids for r in again] == expected,
                                   "cached": [r.stats.cached_tokens for r in again],
                                   "prompt": [len(p) - 1 for p in prompts]}
        dec.close()
    plain.close()
    return out


def idle_and_close() -> dict:
    """A sharded decoder that answers, idles past the pass timeout (when ``SPECDRAFT_TP_TIMEOUT``
    makes it short, as the tests do: a server with no requests idles for hours), and answers the
    same again; then, closed, its runner refuses a pass with one line."""
    import time

    import torch

    from ..decoder import SpeculativeDecoder
    from ..errors import ConfigError
    from ..runner.tp import pass_timeout
    from .models import repetitive_prompts, tiny_llama

    prompts = repetitive_prompts(64, seed=0)[:2]
    dec = SpeculativeDecoder(tiny_llama(vocab_size=64, seed=0), None, drafter="prompt-lookup", max_batch=2,
                             tensor_parallel=TP)
    before = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=8)]
    out: dict = {"idled": None, "same after idling": None, "closed": None}
    if pass_timeout().total_seconds() < 60:
        out["idled"] = pass_timeout().total_seconds() + 2
        time.sleep(out["idled"])
        out["same after idling"] = [r.token_ids for r in dec.generate_ids(prompts, max_new_tokens=8)] == before
    runner = dec.runner
    dec.close()
    try:
        runner.forward(torch.tensor([prompts[0]]))
    except ConfigError as exc:
        out["closed"] = str(exc)
    return out


class _ShardedModel:
    """A sharded runner called as a transformers model (``model(ids).logits``), so the exact
    reference is enumerated from the sharded target's own rounding."""

    def __init__(self, hf, group):
        self.hf, self.runner, self.device = hf, group.runner(hf), hf.device

    def get_output_embeddings(self):
        return self.hf.get_output_embeddings()

    def __call__(self, ids):
        import types

        import torch

        self.runner.cache.reset(ids.shape[0], ids.shape[1] + 1)
        with torch.inference_mode():
            return types.SimpleNamespace(logits=self.runner.forward(ids)[0])


def sampled(work: Path, group, dtype: str = "float64") -> dict:
    """The sampled check with target and draft in ``dtype`` (acceptance arithmetic is float32
    whatever the dtype), against plain sampling of the sharded target enumerated exactly."""
    import torch

    from ..decoder import SpeculativeDecoder
    from .. import SamplingParams
    from .models import tiny_llama
    from .reference import enumerate_plain_sampling
    from .stats import sampled_joint_pvalue

    target = tiny_llama(vocab_size=16, seed=1, dtype=getattr(torch, dtype))
    with torch.no_grad():  # sharper than random, as the other sampled tests' target
        target.lm_head.weight.mul_(8.0)
    draft = work / f"draft16-{dtype}"
    tiny_llama(vocab_size=16, seed=5, layers=1).save_pretrained(draft)
    prompt, params, steps = [3, 5, 3, 5, 3], SamplingParams(temperature=1.0), 4
    sharded = _ShardedModel(target, group)
    exact = enumerate_plain_sampling(sharded, prompt, params, steps)
    sharded.runner.close()
    dec = SpeculativeDecoder(target, None, drafter="draft-model", spec_length=steps - 1, adaptive=False, max_batch=512,
                             drafter_options={"model": str(draft), "dtype": dtype, "min_confidence": 0.0},
                             tensor_parallel=TP)
    pvalue, results = sampled_joint_pvalue(dec, prompt, params, seed=0, exact=exact)
    dec.close()
    return {"pvalue": pvalue, "samples": len(results), "accepted": sum(r.stats.accepted_tokens for r in results)}


def default_model(group) -> dict:
    """The sharded default model: its logits against the unsharded ones (float64), and greedy
    prompt-lookup against plain decoding of the same sharding in bfloat16, where rounding is
    coarse enough to flip argmaxes if a verify pass rounded differently from one-token steps."""
    import torch

    from ..decoder import SpeculativeDecoder
    from ..models import load_target

    model, _, _ = load_target(None, dtype=torch.float64, device="cpu")
    out = {"logits": logits_difference(model, group)}
    del model
    model, tokenizer, name = load_target(None, dtype=torch.bfloat16, device="cpu")
    tokens = {}
    for drafter in ("none", "prompt-lookup"):
        with SpeculativeDecoder(model, tokenizer, drafter=drafter, target_name=name, tensor_parallel=TP) as dec:
            results = dec.generate(BF16_PROMPTS, max_new_tokens=64)
        tokens[drafter] = [r.token_ids for r in results]
        if drafter != "none":
            out["bf16 accepted"] = sum(r.stats.accepted_tokens for r in results)
    out["bf16 greedy equal"] = tokens["none"] == tokens["prompt-lookup"]
    return out


#: real prompts whose answers repeat them (prompt lookup drafts), for the bfloat16 parity check
BF16_PROMPTS = [
    "List the days of the week, then list them again.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
]


def main(argv: list[str]) -> int:
    import torch

    from ..runner.tp import start

    torch.set_num_threads(1)
    group = start(TP, "cpu")
    results: dict = {}
    results["logits"], results["refused"] = architectures(group)
    with tempfile.TemporaryDirectory() as tmp:
        results["greedy"] = greedy(Path(tmp))
        # bfloat16 only: float64's sharded logits equal the unsharded ones (above), and the sampling
        # path is the same in every dtype (float32 arithmetic); it took 70 s of the suite's time
        results["sampled bf16"] = sampled(Path(tmp), group, "bfloat16")
    results["idle and close"] = idle_and_close()
    if "--default-model" in argv:
        results["default"] = default_model(group)
    Path(argv[0]).write_text(json.dumps(results, indent=1))
    group.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
