"""The KV cache: a row (slot) per sequence, rolled back by writing lengths, tree paths kept.

Every runner's ``cache`` has this interface; the engine, the verifier and drafters with a
runner of their own talk to it, the runner only reads and writes it in its passes:

    cache.reset(rows, max_len)            # empty, ``rows`` rows of up to ``max_len`` tokens
    cache.reserve(max_len, rows=None)     # room for more, keeping what is stored
    cache.lengths                         # [rows] long: tokens each row holds
    cache.set_lengths(lengths, bound=None, slots=None)   # rollback: rows keep their first ``lengths``
    cache.keep_paths([(slot, start, nodes)])             # a tree's accepted path moved into place
    cache.save_block(key, slot, start, end)               # optional: prefix caching (specdraft.engine.prefix)
    cache.load_block(key, slot, start); cache.drop_block(key); cache.token_bytes

- :class:`StaticCache` (:mod:`.static`): specdraft's own, over :class:`KVCache` buffers
  ``[slots, kv_heads, max_len, head_dim]`` per layer with lengths on the device, for
  :class:`~specdraft.runner.ModelRunner` and :class:`~specdraft.runner.layers.LayerRunner`;
- :class:`HFCache` (:mod:`.hf`): the same over buffers transformers' attention writes into, for
  the transformers fallback (chains only: no ``keep_paths``; no prefix caching).
"""

from .static import KVCache, StaticCache, attention_mask

__all__ = ["HFCache", "KVCache", "StaticCache", "attention_mask"]


def __getattr__(name: str):  # HFCache imports transformers: only when asked for
    if name == "HFCache":
        from .hf import HFCache

        return HFCache
    raise AttributeError(name)
