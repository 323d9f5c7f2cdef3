"""KV caches owned by specdraft (shared by the target and by draft models)."""

from .kv_cache import KVCache, attention_backends, forward_step

__all__ = ["KVCache", "attention_backends", "forward_step"]
