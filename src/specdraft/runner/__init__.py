"""specdraft's own model runner: Llama-family model code over a static KV cache.

    from specdraft.runner import from_transformers
    model, reason = from_transformers(hf_model)     # None and a one-line reason if unsupported
    cache = model.new_cache(slots=2, max_len=256)
    out = model(tokens, cache)                       # tokens [B, W] -> out.logits [B, W, vocab]
    cache.set_lengths(kept)                          # rollback: write the lengths back

The verifier and the drafters use it through :func:`load_runner` (``runner.py``); the cache it
runs over is :mod:`specdraft.cache`'s.
"""

from .convert import ARCHITECTURES, from_transformers
from .model import ForwardOutput, ModelArgs, SpecdraftModel
from .runner import WIDTH_BUCKETS, ModelRunner, default_compile, load_runner, width_bucket

__all__ = ["ARCHITECTURES", "WIDTH_BUCKETS", "ForwardOutput", "ModelArgs", "ModelRunner",
           "SpecdraftModel", "default_compile", "from_transformers", "load_runner", "width_bucket"]
