"""Every built-in drafter on a device (a GPU, say): the conformance suite, then a sampled run.

The test suite runs on the CPU; this runs its ``check_drafter`` (greedy parity with
transformers' own greedy decoding at K = 1, 3, 5, valid drafts, ``reset``) on tiny random
float64 models on ``--device``, for every built-in drafter and the three head kinds with
and without a copy gate, then one sampled generation each:

    python benchmarks/device_check.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback

from specdraft import SpeculativeDecoder
from specdraft.testing import check_drafter, random_heads, tiny_llama


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    model = tiny_llama(vocab_size=64, seed=0).to(args.device)
    tmp = tempfile.mkdtemp()
    tiny_llama(vocab_size=64, seed=7, layers=1).save_pretrained(f"{tmp}/draft")
    cases = [("ngram", {}), ("prompt-lookup", {}), ("draft-model", {"model": f"{tmp}/draft", "dtype": "float64"})]
    for kind in ("medusa", "eagle", "mlp-speculator"):
        for gate in (False, True):
            path = random_heads(kind, model, f"{tmp}/{kind}-{gate}", seed=1, copy_gate=gate)
            cases.append((kind, {"heads": str(path)}))
    failures = 0
    for name, options in cases:
        start = time.time()
        label = name + (" (copy gate)" if options.get("heads", "").endswith("True") else "")
        try:
            check_drafter(name, model, drafter_options=options)
            dec = SpeculativeDecoder(model, None, drafter=name, spec_length=3, drafter_options=options)
            out = dec.generate_ids([[1, 2, 3, 4, 1, 2, 3]], max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1)[0]
            assert len(out.token_ids) == 20, f"sampled run gave {len(out.token_ids)} tokens, not 20"
            print(f"ok: {label} ({time.time() - start:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 -- report every drafter, then fail
            failures += 1
            traceback.print_exc()
            print(f"FAIL: {label}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(cases) - failures} of {len(cases)} passed on {args.device}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
