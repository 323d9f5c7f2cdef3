"""Costs of the Llama-3.2-1B (draft) / Llama-3.2-3B (target) pair, from their real shapes.

Builds both models from their published configurations with random weights (no download),
then measures on the chosen device: one target decode step, one draft decode step (their
ratio c), a (K+1)-token verify pass for K = 1..8 relative to one target step, and specdraft's
own per-round overhead outside the model calls (a full speculative round minus its model
time). From these it projects the speedup at acceptance rates 0.6, 0.7 and 0.8:

    speedup(K) = (1 - a^(K+1)) / (1 - a)  /  (K c + v(K+1) + overhead)

and prints a Markdown table for docs/benchmarks.md (labelled a projection). Every pass runs
through specdraft's model runner (``--compile`` for torch.compile and, on CUDA, CUDA graphs; the
device's default otherwise). It also prints each step's weight-read floor: the model's weight
bytes over the device's measured read bandwidth. Run on a GPU:

    python benchmarks/llama_pair_costs.py --device cuda --dtype bfloat16

``--scale`` shrinks the width and depth (e.g. 0.125) to smoke-test the script on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft import Draft, Drafter, SpeculativeDecoder
from specdraft.runner import default_compile, load_runner
from specdraft.runner.kernels import PackedLinear

SHAPES = {  # Llama-3.2 1B and 3B: hidden, layers, heads, kv heads, intermediate
    "draft (1B)": (2048, 16, 32, 8, 8192),
    "target (3B)": (3072, 28, 24, 8, 8192),
}


#: Other scripts' named shapes (row_invariance.py --shape, launch_counts.py): the shape and the
#: configuration values that differ from Llama-3.2's. "default" is SmolLM2-135M-Instruct's, the
#: default model (vocabulary 49152, tied embeddings, rope theta 100000).
NAMED_SHAPES = {
    "default": ((576, 30, 9, 3, 1536), dict(vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                                             rms_norm_eps=1e-5)),
    "llama-1b": (SHAPES["draft (1B)"], {}),
    "llama-3b": (SHAPES["target (3B)"], {}),
}


def config(hidden, layers, heads, kv, inter, scale=1.0, **overrides) -> LlamaConfig:
    """A Llama configuration of this shape (``scale`` shrinks width and depth), Llama-3.2's values otherwise."""
    if scale != 1.0:
        hidden, layers, inter = int(hidden * scale) // heads * heads, max(1, int(layers * scale)), int(inter * scale)
    values = dict(vocab_size=128256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=131072,
                  rope_theta=500000.0, tie_word_embeddings=True)
    return LlamaConfig(**(values | overrides))


def named_config(name: str, layers: int | None = None) -> LlamaConfig:
    """The configuration of a :data:`NAMED_SHAPES` entry, cut to its first ``layers`` layers if given."""
    (hidden, depth, heads, kv, inter), overrides = NAMED_SHAPES[name]
    return config(hidden, depth if layers is None else layers, heads, kv, inter, **overrides)


def random_model(cfg: LlamaConfig, dtype, device):
    """A random-weight model of ``cfg`` (no download), in ``dtype`` on ``device``."""
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(dtype).eval()


def build(hidden, layers, heads, kv, inter, scale, dtype, device):
    return random_model(config(hidden, layers, heads, kv, inter, scale), dtype, device)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_pass(runner, width, context, reps, device):
    """Seconds per ``width``-token pass of ``runner`` over a cache of about ``context`` tokens.

    Each timed pass starts one token further along, as in decoding, so the key length is new
    every time (attention kernels that cache per-length plans pay for that here too). The median
    of the passes: a shared machine's stalls move the mean by several percent from run to run.
    """
    runner.cache.reset(1, context + reps + 16)
    vocab = runner.model.config.get_text_config().vocab_size if hasattr(runner.model, "config") else \
        runner.model.args.vocab_size
    ids = torch.randint(0, vocab, (1, context + reps + 16), device=device)
    with torch.inference_mode():
        runner.forward(ids[:, :context - 3])
        for i in range(3):  # warm-up (compiles the width's graph when compiled)
            runner.cache.set_lengths([context - 3 + i])
            runner.forward(ids[:, context - 3 + i:context - 3 + i + width])
        times = []
        for i in range(reps):
            runner.cache.set_lengths([context + i])
            sync(device)
            start = time.perf_counter()
            runner.forward(ids[:, context + i:context + i + width])
            sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(device, megabytes: int = 1024) -> float:
    """Bytes per second the device reads: the best of a few sums over a buffer far larger than its
    caches. On a CPU with specdraft's C++ operators, also the best of a one-row panel product over
    a weight that size, where that reads faster: torch's sum reads about 12.5 GB/s on the 2 threads
    of the model 85 Xeon, a streaming product 20-23 GB/s, and a floor from the slower reader would
    flatter every step measured against it."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - start)
    rate = x.numel() * 4 / best
    del x
    if torch.device(device).type == "cpu":
        from specdraft.models import cpu_flags
        from specdraft.runner import cpu_ops

        if "avx512f" in cpu_flags() and cpu_ops.load() == "":  # the panel loop (else a scalar one)
            k = 576  # panels [P, K, 16] bfloat16 of about `megabytes`
            panels = torch.ones((megabytes * 2**20 // (2 * 16 * k), k, 16), dtype=torch.bfloat16)
            row = torch.ones((1, k), dtype=torch.bfloat16)
            for _ in range(3):
                start = time.perf_counter()
                torch.ops.specdraft_cpu.linear(row, panels, None, panels.shape[0] * 16)
                rate = max(rate, panels.numel() * 2 / (time.perf_counter() - start))
    return rate


def weight_bytes(runner) -> int:
    """Bytes a decode step reads: every parameter and buffer of the runner's model but the input embedding
    (of which a step reads one row)."""
    model = runner.model
    skip = {id(t) for t in model.get_input_embeddings().parameters()} if hasattr(model, "get_input_embeddings") \
        else {id(model.tok_embeddings.weight)}
    tied = getattr(getattr(model, "output", None), "weight", None)
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    if tied is not None and id(tied) in skip:  # a tied head is read in full
        skip.discard(id(tied))
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, PackedLinear))  # oneDNN's copies of weights
    return packed + sum(t.numel() * t.element_size() for k, t in tensors.items() if k not in skip)


class _Fixed(Drafter):
    """Proposes K arbitrary tokens at no cost: isolates the verifier's own overhead."""

    def propose(self, ctx, k):
        return Draft(token_ids=torch.ones((ctx.batch_size, k), dtype=torch.long))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile (+ CUDA graphs on CUDA); default: the device's default")
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None)
    args = ap.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here")
    dtype = getattr(torch, args.dtype)
    compile = default_compile(args.device) if args.compile is None else args.compile
    models = {name: build(*shape, args.scale, dtype, args.device) for name, shape in SHAPES.items()}
    target, draft = models["target (3B)"], models["draft (1B)"]
    runners = {name: load_runner(m, compile=compile, quantize=args.quantize) for name, m in models.items()}
    step = time_pass(runners["target (3B)"], 1, args.context, args.reps, args.device)
    draft_step = time_pass(runners["draft (1B)"], 1, args.context, args.reps, args.device)
    c = draft_step / step
    verify = {k: time_pass(runners["target (3B)"], k + 1, args.context, args.reps, args.device) / step
              for k in range(1, 9)}
    bandwidth = read_bandwidth(args.device)
    floors = {name: weight_bytes(r) / bandwidth for name, r in runners.items()}

    overhead = {}
    for k in (1, 4, 8):  # a round's wall time minus its model time, with a free fixed drafter
        dec = SpeculativeDecoder(target, None, drafter=_Fixed(None, None), spec_length=k, adaptive=False,
                                 compile=compile, quantize=args.quantize)
        dec.generate_ids([[1] * args.context], max_new_tokens=16)  # warm-up: first-call kernel loads
        r = dec.generate_ids([[1] * args.context], max_new_tokens=64)[0]
        rounds = r.stats.target_passes
        overhead[k] = max(0.0, (r.stats.verify_time_s + r.stats.draft_time_s) / rounds / step - verify[k])

    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else f"cpu (scale {args.scale})"
    runner = runners["target (3B)"].info
    print(f"device: {device}, dtype {args.dtype}, context {args.context}, runner {runner}\n")
    print(f"read bandwidth: {bandwidth / 1e9:.0f} GB/s\n")
    print(f"target decode step: {step * 1e3:.2f} ms (weight-read floor {floors['target (3B)'] * 1e3:.2f} ms, "
          f"{step / floors['target (3B)']:.2f}x it); draft step: {draft_step * 1e3:.2f} ms (floor "
          f"{floors['draft (1B)'] * 1e3:.2f} ms); c = {c:.3f}\n")
    print("| K | verify pass (K+1 tokens) / target step | round overhead / target step |")
    print("|---|---|---|")
    for k, v in verify.items():
        ov_k = f"{overhead[k]:.3f}" if k in overhead else "-"
        print(f"| {k} | {v:.2f} | {ov_k} |")
    print("\nProjection (not a measurement): speedup = E[tokens] / (K c + v(K+1) + overhead)\n")
    print("| acceptance | " + " | ".join(f"K={k}" for k in verify) + " |")
    print("|---" * (len(verify) + 1) + "|")
    ov = sum(overhead.values()) / len(overhead)
    for a in (0.6, 0.7, 0.8):
        cells = [((1 - a ** (k + 1)) / (1 - a)) / (k * c + v + ov) for k, v in verify.items()]
        print(f"| {a} | " + " | ".join(f"{x:.2f}x" for x in cells) + " |")


if __name__ == "__main__":
    main()
