"""A static KV cache: preallocated buffers, per-row lengths on the device, rollback by writing lengths.

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

import torch


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
                   window: int | None = None, depths: torch.Tensor | None = None) -> torch.Tensor:
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

    Example: ``starts=[0, 2]``, ``width=2``, ``max_len=5`` gives rows ``[[1,0,0,0,0], [1,1,0,0,0]]``
    for the first sequence and ``[[1,1,1,0,0], [1,1,1,1,0]]`` for the second.
    """
    device = starts.device
    cols = torch.arange(max_len, device=device)  # [L]
    query_pos = pass_positions(starts, width)  # [B, W]
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
