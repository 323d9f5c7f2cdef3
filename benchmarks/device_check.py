"""Every built-in drafter on a device (a GPU, say): the conformance suite, then a sampled run.

The test suite runs on the CPU; this runs its ``check_drafter`` (greedy parity with
transformers' own greedy decoding at K = 1, 3, 5, valid drafts, ``reset``) on tiny random
float64 models on ``--device``, for every registered drafter (the built-in ones and any
installed plugin; the head kinds with and without a copy gate), then one sampled generation
each. It needs no model file (the drafters' weights are random):

    python benchmarks/device_check.py --device cuda
    python benchmarks/device_check.py --device cpu --only ngram,eagle3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

from specdraft import SpeculativeDecoder
from specdraft.plugins import get_registry
from specdraft.testing import check_drafter, random_heads, tiny_llama


#: head drafters: random heads of this kind, each with and without a copy gate
HEADS = ("medusa", "eagle", "eagle3", "mlp-speculator")
#: drafters that start on the tiny model with the saved tiny draft model
DRAFT_MODELS = ("draft-model", "llama-1b")


def cases(names, model, tmp) -> list[tuple[str, str, dict | None]]:
    """``(label, drafter, options)`` for each drafter in ``names``: the options it needs on the tiny model."""
    out = []
    for name in names:
        if name in DRAFT_MODELS:
            if not os.path.isdir(f"{tmp}/draft"):
                tiny_llama(vocab_size=64, seed=7, layers=1).save_pretrained(f"{tmp}/draft")
            out.append((name, name, {"model": f"{tmp}/draft", "dtype": "float64"}))
        elif name in HEADS:
            for gate in (False, True):
                path = random_heads(name, model, f"{tmp}/{name}-{gate}", seed=1, copy_gate=gate)
                out.append((name + (" (copy gate)" if gate else ""), name, {"heads": str(path)}))
        else:  # ngram, prompt-lookup, suffix, none, and plugins that need no options
            out.append((name, name, None))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--only", default=None, help="comma-separated drafters (default: every registered one)")
    p.add_argument("--samples", type=int, default=None,
                   help="samples of check_drafter's sampled test (default: its power calculation's; 0: off)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="compile the decoders (CUDA graphs, the default on CUDA since issue 43): each drafter's "
                        "check then takes 30-60 s of compiling; default: eager (the graphs' exactness is "
                        "row_invariance.py's to check)")
    args = p.parse_args()
    import torch

    import specdraft.runner

    if not args.compile:  # every decoder the checks build, eager (they build many, each would compile)
        specdraft.runner.default_compile = lambda device: False

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here", flush=True)
        return 2
    registered = get_registry().names()
    names = registered if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(registered))
    if unknown:
        print(f"not registered: {', '.join(unknown)} (registered: {', '.join(registered)})", flush=True)
        return 2
    model = tiny_llama(vocab_size=64, seed=0).to(args.device)
    tmp = tempfile.mkdtemp()
    todo = cases(names, model, tmp)
    failures = []
    for label, name, options in todo:
        start = time.time()
        try:
            check_drafter(name, model, drafter_options=options, samples=args.samples)
            dec = SpeculativeDecoder(model, None, drafter=name, spec_length=3, drafter_options=options)
            out = dec.generate_ids([[1, 2, 3, 4, 1, 2, 3]], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1)[0]
            assert len(out.token_ids) == 20, f"sampled run gave {len(out.token_ids)} tokens, not 20"
            print(f"ok: {label} ({time.time() - start:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 -- report every drafter, then fail
            failures.append(label)
            traceback.print_exc()
            print(f"FAIL: {label}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(todo) - len(failures)} of {len(todo)} passed on {args.device}"
          + (f"; failed: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
