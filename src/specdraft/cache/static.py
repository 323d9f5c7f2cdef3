"""The static KV cache: preallocated buffers, per-row lengths on the device, rollback by writing lengths.

:class:`StaticCache` is the cache a runner is given (:mod:`specdraft.cache`'s interface): a row
(slot) per sequence, grown when needed, rolled back by :meth:`StaticCache.set_lengths`, a tree's
accepted path moved into place by :meth:`StaticCache.keep_paths`, prompt passes kept for later
requests by :meth:`StaticCache.save_block` (the index: :mod:`specdraft.engine.prefix`). :class:`KVCache` is its
buffers, what a model's forward reads and writes.

Layout per layer: ``keys[i]`` and ``values[i]`` of shape ``[slots, kv_heads, max_len, head_dim]``,
allocated once. Slot ``s`` stores the key of its position ``p`` at index ``p`` of the ``max_len``
axis, and ``lengths[s]`` (a long tensor on the cache's device) says how many positions are
valid. A pass of width ``W`` over rows ``rows`` writes its keys at positions
``lengths[rows] .. lengths[rows] + W - 1`` and attends with a mask built from ``lengths`` on the
device: committed positions, plus the pass's own tokens causally (or as a tree mask says).
Everything per step is a tensor; the only Python ints are the shapes (``W``, ``max_len``), so one
compiled graph serves every step of a width.

Rolling back is writing smaller lengths (:meth:`KVCache.set_lengths`): nothing is copied, the
stale positions are masked out and the next pass overwrites them. Rows of different lengths
share a batch; a row whose pass carries padding advances by its own count (``advance``).

The caller keeps ``lengths[row] + W <= max_len``: writes past the end fail (an index error on
CPU, a device assert on CUDA) rather than wrapping.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

#: The cache's capacity grows in steps of this many positions (reallocating is rare).
CAPACITY_STEP = 256
#: :meth:`StaticCache.fit` gives memory back when the cache holds more than this many times what is asked
SHRINK_AT = 4


class StaticCache:
    """A :class:`KVCache` for a runner: ``allocate(slots, max_len)`` makes its buffers (the model's
    ``new_cache``), and every capacity keeps ``headroom`` positions past the longest row for a
    padded pass. ``bounds[s]`` is an upper bound of row ``s``'s length known on the host (no copy
    needed: the span a pass attends over); ``epoch`` counts reallocations (what holds the old
    buffers, a CUDA graph, must be made again)."""

    def __init__(self, allocate: Callable[[int, int], "KVCache"], headroom: int = 0) -> None:
        self.allocate = allocate
        self.headroom = headroom
        self.kv: KVCache | None = None
        self.bounds: list[int] = []
        self.epoch = 0
        self.saved: dict[int, torch.Tensor] = {}  # the prefix cache's blocks, by key

    def reset(self, rows: int, max_len: int) -> None:
        """An empty cache for ``rows`` sequences of up to ``max_len`` tokens (buffers kept when they fit)."""
        need = self.rounded(max_len)
        if self.kv is None or self.kv.slots != rows or self.kv.max_len < need:
            self.kv = self.allocate(rows, need)
            self.epoch += 1
        else:
            self.kv.reset()
        self.bounds = [0] * rows

    def reserve(self, max_len: int, rows: int | None = None) -> None:
        """Room for ``max_len`` tokens per row (and ``rows`` rows), keeping what is stored (grows
        by doubling, rarely)."""
        old = self.kv
        rows = old.slots if rows is None else max(rows, old.slots)
        if old.max_len >= max_len + self.headroom and old.slots >= rows:
            return
        need = self.rounded(max_len)
        self._reallocate(rows, max(need, 2 * old.max_len) if old.max_len < need else old.max_len)

    def _reallocate(self, rows: int, capacity: int) -> None:
        """New buffers of ``rows`` rows of ``capacity`` positions, holding what the old ones' first
        rows and positions held (lengths and bounds past the new capacity, free rows' only, cut to it)."""
        old = self.kv
        new = self.allocate(rows, capacity)
        kept, span = min(rows, old.slots), min(capacity, old.max_len)
        for dst, src in zip(new.keys + new.values, old.keys + old.values):
            dst[:kept, :, :span] = src[:kept, :, :span]
        new.lengths[:kept].copy_(old.lengths[:kept].clamp(max=capacity - self.headroom))
        self.kv = new
        self.bounds = [min(b, capacity - self.headroom) for b in self.bounds[:kept]] + [0] * (rows - kept)
        self.epoch += 1

    # -- sized by use, under a memory bound (the engine's: docs/algorithm.md#kv-cache-memory) ----

    def rounded(self, positions: int) -> int:
        """The capacity a row of ``positions`` tokens is given: headroom added, rounded up to a step."""
        return -(-(positions + self.headroom) // CAPACITY_STEP) * CAPACITY_STEP

    def bytes_for(self, rows: int, positions: int) -> int:
        """Bytes a cache of ``rows`` rows of ``positions`` tokens each takes (headroom and rounding included)."""
        return rows * self.rounded(positions) * self.token_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the rows' buffers take now."""
        return self.kv.slots * self.kv.max_len * self.token_bytes

    def fit(self, rows: int, positions: int, most: int) -> None:
        """Room for rows ``0 .. rows - 1`` of ``positions`` tokens each, keeping what they store.

        A row's capacity grows by doubling, never past ``most`` tokens' (a bound the caller keeps
        within its memory); a reallocation also drops the rows past ``rows`` (the caller uses
        none of them), and a cache holding over :data:`SHRINK_AT` times what is asked is made
        that size, so memory follows use. Rows' lengths past the new capacity (free rows only) are
        cut to it."""
        need, top = self.rounded(positions), max(self.rounded(positions), self.rounded(most))
        old = self.kv
        if old.slots >= rows and old.max_len >= need:
            if old.slots * old.max_len <= SHRINK_AT * rows * need:
                return
            capacity = need
        elif old.max_len >= need:
            capacity = min(old.max_len, top)
        else:
            capacity = min(max(need, 2 * old.max_len), top)
        self._reallocate(rows, capacity)

    @property
    def lengths(self) -> torch.Tensor:
        """Each row's stored token count, on the device.  # [rows]"""
        return self.kv.lengths

    @property
    def capacity(self) -> int:
        """Positions a row may hold (the headroom for a padded pass taken off)."""
        return self.kv.max_len - self.headroom

    def set_lengths(self, lengths, bound: int | None = None, slots=None) -> None:
        """Rollback (or any length change): row ``b`` keeps its first ``lengths[b]`` tokens.

        ``lengths`` a list (or a long tensor [rows]); ``bound``, an upper bound of them, lets a
        device tensor through without a copy to the host (default: its max, read from it).
        ``slots`` (a list of row indices): set those rows' lengths only."""
        if isinstance(lengths, torch.Tensor):
            values = [int(lengths.max()) if bound is None else bound] * lengths.shape[0]
        else:
            lengths = list(lengths)
            values = [int(n) for n in lengths]
        if slots is None:
            self.bounds = values
            self.kv.lengths.copy_(as_long(lengths, self.kv.device))
            return
        slots = [int(s) for s in slots]
        for s, n in zip(slots, values):
            self.bounds[s] = n
        self.kv.lengths[as_long(slots, self.kv.device)] = as_long(lengths, self.kv.device)

    def grow(self, slots: list[int] | None, width: int) -> int:
        """A pass of ``width`` tokens on ``slots`` (None: every row): their bounds grow by ``width``;
        returns the largest bound before (an overflow raises ValueError: :meth:`reserve` first)."""
        used = range(len(self.bounds)) if slots is None else slots
        bound = max((self.bounds[s] for s in used), default=0)
        if bound + width > self.capacity:
            raise ValueError(f"KV cache overflow: {bound} + {width} tokens > {self.kv.max_len} positions; "
                             "reserve() first")
        for s in used:
            self.bounds[s] += width
        return bound

    def move(self, src: torch.Tensor, dst: torch.Tensor, slots=None) -> None:
        """Copy each row's entries at positions ``src # [B, P]`` to ``dst # [B, P]`` (``slots``: the
        rows, default every row in order); pad rows with ``src == dst``. Lengths are unchanged."""
        rows = None if slots is None else as_long([int(s) for s in slots], self.kv.device)
        self.kv.move(rows, src.to(self.kv.device), dst.to(self.kv.device))

    # -- the prefix cache's blocks (see specdraft.engine.prefix): copies kept beside the rows ----

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes one position takes in every layer's keys and values (a saved block's size per token;
        the same whatever the rows' count and capacity)."""
        return sum(buf[0, :, 0].numel() * buf.element_size() for buf in self.kv.keys + self.kv.values)

    def save_block(self, key: int, slot: int, start: int, end: int) -> None:
        """Keep a copy of row ``slot``'s positions ``start .. end - 1`` under ``key``."""
        self.saved[key] = torch.stack([buf[slot, :, start:end] for buf in self.kv.keys + self.kv.values])

    def load_block(self, key: int, slot: int, start: int) -> None:
        """Copy block ``key`` into row ``slot`` from position ``start`` (lengths unchanged:
        :meth:`set_lengths` after)."""
        block = self.saved[key]  # [2 * layers, kv_heads, tokens, head_dim]
        for buf, part in zip(self.kv.keys + self.kv.values, block):
            buf[slot, :, start : start + block.shape[2]] = part

    def drop_block(self, key: int) -> None:
        del self.saved[key]

    def keep_paths(self, paths: list[tuple[int, int, list[int]]]) -> None:
        """Move each tree's accepted path into place: ``(slot, start, nodes)``, node ``j`` stored at
        ``start + 1 + j`` and kept at ``start + 1 + its place on the path`` (lengths unchanged:
        :meth:`set_lengths` after)."""
        if not paths:
            return
        width = max(len(nodes) for _, _, nodes in paths)
        src, dst = [], []
        for _, start, nodes in paths:  # padding: positions moved onto themselves
            kept = [start + 1 + m for m in range(len(nodes))]
            tail = [start + 1 + m for m in range(len(nodes), width)]
            src.append([start + 1 + j for j in nodes] + tail)
            dst.append(kept + tail)
        device = self.kv.device
        self.move(torch.tensor(src, device=device), torch.tensor(dst, device=device), slots=[p[0] for p in paths])


def as_long(values, device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).to(device, non_blocking=True)


class KVCache:
    """Keys and values of ``layers`` layers for ``slots`` sequences of up to ``max_len`` tokens."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # [slots]

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    def narrow(self, start: int, rows: int) -> "KVCache":
        """Slots ``start .. start + rows - 1`` as a cache of their own: views, so what a pass writes
        (keys, values, lengths) lands in this cache, with no gather of the rows' buffers."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[start : start + rows] for k in self.keys]
        view.values = [v[start : start + rows] for v in self.values]
        view.lengths = self.lengths[start : start + rows]
        return view

    # -- lengths: the only state that changes per step -------------------------------------

    def starts(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Current lengths of ``rows`` (all slots when None): where a pass starts writing.  # [B]"""
        return self.lengths if rows is None else self.lengths[rows]

    def advance(self, rows: torch.Tensor | None, by: torch.Tensor | int) -> None:
        """Add ``by`` (an int, or a long tensor ``[B]``) to the lengths of ``rows``."""
        if rows is None:
            self.lengths += by
        else:
            self.lengths[rows] += by  # rows are distinct, so the in-place add is well defined

    def set_lengths(self, lengths: torch.Tensor | int, rows: torch.Tensor | None = None) -> None:
        """Rollback (or any other length change): ``lengths[rows] = lengths``. Nothing is copied."""
        if rows is None:
            self.lengths.copy_(torch.as_tensor(lengths, device=self.device).expand_as(self.lengths))
        else:
            self.lengths[rows] = torch.as_tensor(lengths, device=self.device)

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Empty ``rows`` (all slots when None), e.g. to give a slot to a new sequence."""
        self.set_lengths(0, rows)

    def move(self, rows: torch.Tensor | None, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's entries at positions ``src # [B, P]`` to ``dst # [B, P]`` of ``rows``
        (all slots when None): one gather and one scatter per buffer. Keeps a tree's accepted path
        (pad with ``src == dst``); lengths are left alone."""
        slot = (torch.arange(self.slots, device=self.device) if rows is None else rows)[:, None]  # [B, 1]
        for buf in self.keys + self.values:
            buf[slot, :, dst] = buf[slot, :, src]  # the gather copies first: overlapping ranges are fine

    # -- one layer's write and read ---------------------------------------------------------

    def update(self, layer: int, rows: torch.Tensor | None, positions: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a pass's keys and values at ``positions`` and return the rows' whole buffers
        (see :func:`write_kv`)."""
        slot = torch.arange(self.slots, device=self.device) if rows is None else rows  # [B]
        return write_kv(self.keys[layer], self.values[layer], slot, positions, keys, values, rows is not None)


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slot: torch.Tensor, positions: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor, gather: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Write keys and values ``# [B, kv_heads, W, head_dim]`` of slots ``slot # [B]`` at ``positions # [B, W]``
    of one layer's buffers ``# [slots, kv_heads, max_len, head_dim]``.

    Returns ``(keys, values) # [B, kv_heads, max_len, head_dim]``: the buffers themselves, or with
    ``gather`` (the batch is a subset of the slots) a gathered copy of the batch's slots.
    """
    # Advanced indices around a slice put their dims first: the target is [B, W, kv_heads, head_dim].
    k_buf[slot[:, None], :, positions] = keys.transpose(1, 2)
    v_buf[slot[:, None], :, positions] = values.transpose(1, 2)
    if gather:
        return k_buf[slot], v_buf[slot]
    return k_buf, v_buf


def pass_positions(starts: torch.Tensor, width: int) -> torch.Tensor:
    """Positions of a pass of ``width`` tokens for rows starting at ``starts # [B]``.  # [B, W]"""
    return starts[:, None] + torch.arange(width, device=starts.device)


def attention_mask(starts: torch.Tensor, width: int, max_len: int, tree_mask: torch.Tensor | None = None,
                   window: int | None = None, depths: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """Which cache positions each token of a pass may attend to.  # [B, 1, W, max_len] bool

    ``starts # [B]``: each row's length before the pass (its tokens sit at ``starts + 0..W-1``).
    A token sees every committed position (``< starts``) and, among the pass's own tokens, those
    at or before it (causal), or as ``tree_mask`` says.

    ``tree_mask # [B, W, P]`` bool, ``P >= W``: visibility among the last ``P`` positions up to the
    pass's end, ``starts + W - P .. starts + W - 1`` (the pass's own ``W`` tokens are the last ``W``
    columns; the ``P - W`` before them are tree nodes stored by earlier passes, e.g. a drafter
    growing a tree level by level); positions before those are committed and always visible, and
    a token always sees itself. ``window``: a sliding window of that many positions (the query's
    own included), as Mistral's ``sliding_window``, measured from each query's position
    (``starts + depths`` in a tree, else its index). Positions past the pass are never visible.

    ``positions``: ``pass_positions(starts, width)``, where the caller has it already.

    Example: ``starts=[0, 2]``, ``width=2``, ``max_len=5`` gives rows ``[[1,0,0,0,0], [1,1,0,0,0]]``
    for the first sequence and ``[[1,1,1,0,0], [1,1,1,1,0]]`` for the second.
    """
    device = starts.device
    cols = torch.arange(max_len, device=device)  # [L]
    query_pos = pass_positions(starts, width) if positions is None else positions  # [B, W]
    if tree_mask is None:
        visible = cols[None, None, :] <= query_pos[:, :, None]  # [B, W, L]
    else:
        span = tree_mask.shape[-1]
        offset = cols[None, :] - (starts[:, None] + width - span)  # [B, L]: column of each position
        in_tree = (offset >= 0) & (offset < span)  # [B, L]
        own = tree_mask.clone()
        own[:, torch.arange(width, device=device), torch.arange(span - width, span, device=device)] = True
        index = offset.clamp(0, span - 1)[:, None, :].expand(-1, width, -1)  # [B, W, L]
        visible = (offset < 0)[:, None, :] | (in_tree[:, None, :] & own.gather(2, index))  # [B, W, L]
    if window is not None:
        logical = query_pos if depths is None else starts[:, None] + depths
        visible = visible & (cols[None, None, :] > logical[:, :, None] - window)
    return visible[:, None]  # [B, 1, W, L]: one mask for every head
