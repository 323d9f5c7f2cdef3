"""specdraft's own model runner: Llama-family model code over a static KV cache.

    from specdraft.runner import from_transformers
    model, reason = from_transformers(hf_model)     # None and a one-line reason if unsupported
    cache = model.new_cache(slots=2, max_len=256)
    out = model(tokens, cache)                       # tokens [B, W] -> out.logits [B, W, vocab]
    cache.set_lengths(kept)                          # rollback: write the lengths back

Not yet used by the verifier or the decoder.
"""

from .cache import KVCache, attention_mask
from .convert import ARCHITECTURES, from_transformers
from .model import ForwardOutput, ModelArgs, SpecdraftModel

__all__ = ["ARCHITECTURES", "ForwardOutput", "KVCache", "ModelArgs", "SpecdraftModel", "attention_mask",
           "from_transformers"]
