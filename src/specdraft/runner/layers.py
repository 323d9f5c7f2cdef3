"""Decoder layers without a model around them, over the runner's KV cache: what EAGLE's draft layer runs on.

    runner, reason = layers_from_transformers(hf_layers, config, attention_norm=False)  # (None, reason) if not
    runner.cache.reset(rows=2, max_len=512)             # empty cache for 2 sequences
    y = runner.forward(x)                               # x [2, W, dim] float -> y [2, W, dim]
    runner.cache.set_lengths([40, 37])                  # rollback: write the lengths

A :class:`LayerRunner` is a :class:`~specdraft.runner.runner.ModelRunner` whose model is a stack
of :class:`~specdraft.runner.model.TransformerBlock`\\ s (:class:`LayerStack`) fed hidden states
instead of token ids: the same cache (``runner.cache``, a :class:`~specdraft.cache.StaticCache`;
ragged rows through ``advance``), and with ``compile=True`` the same width
buckets, compiled block and CUDA graphs. Its output is the last block's, with no final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import attention_backends
from ..cache import KVCache
from .convert import ARCHITECTURES, block_weights, config_args, placement_reason
from .gguf_blocks import q8_0_fits, q8_0_linear
from .kernels import pack_linears, replace_linears
from .model import ModelArgs, RMSNorm, TransformerBlock, rope_inv_freq, run_block, run_blocks
from .runner import ModelRunner, _tree_kwargs


class Eagle3Block(TransformerBlock):
    """EAGLE-3's decoder layer on specdraft's block: its input is ``[embed(x) ; h]`` (``2 * dim``
    wide), attention reads ``[attention_norm(embed(x)) ; hidden_norm(h)]`` and the residual is
    ``h`` (``hidden_norm(h)`` with ``norm_before_residual``); the output is ``dim`` wide."""

    def __init__(self, args: ModelArgs, layer: int, norm_before_residual: bool = False) -> None:
        super().__init__(args, layer)
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        wqkv = self.attention.wqkv
        self.attention.wqkv = nn.Linear(2 * args.dim, wqkv.out_features, bias=wqkv.bias is not None)

    def forward(self, x, cos, sin, mask, k_buf, v_buf, slot, positions, gather: bool, order=None) -> torch.Tensor:
        embeds, hidden = x.chunk(2, dim=-1)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attended = torch.cat([self.attention_norm(embeds), normed], dim=-1)
        h = residual + self.attention(attended, cos, sin, mask, k_buf, v_buf, slot, positions, gather, order)
        return h + self.feed_forward(self.ffn_norm(h))


class LayerStack(nn.Module):
    """``args.n_layers`` decoder blocks over a :class:`KVCache`, hidden states in and out.

    ``attention_norm=False``: the blocks' input norm is ``nn.Identity`` (EAGLE-1's layer reads
    its input unnormalised). ``eagle3``: one :class:`Eagle3Block` (its input ``2 * dim`` wide),
    ``eagle3="norm_before_residual"`` with that variant's residual.
    """

    def __init__(self, args: ModelArgs, attention_norm: bool = True, eagle3: bool | str = False) -> None:
        super().__init__()
        self.args = args
        self.input_dim = 2 * args.dim if eagle3 else args.dim
        if eagle3:
            self.layers = nn.ModuleList([Eagle3Block(args, 0, eagle3 == "norm_before_residual")])
        else:
            self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        if not attention_norm:
            for block in self.layers:
                block.attention_norm = nn.Identity()
        self.register_buffer("rope_inv_freq", rope_inv_freq(args), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].ffn_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].ffn_norm.weight.device

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, slots, a.n_kv_heads, max_len, a.head_dim, self.dtype, self.device)

    def forward(self, x: torch.Tensor, cache: KVCache, advance: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None, span: int | None = None, block_fn=None) -> torch.Tensor:
        """``x # [B, W, dim]`` after each row's stored positions (the cache slots ``rows # [B]``;
        None: every slot, in order) -> the last block's output ``[B, W, dim]``. Lengths grow by
        ``W``, or by ``advance # [B]``. ``tree_mask``, ``depths``: a tree, as for
        :meth:`~specdraft.runner.model.SpecdraftModel.forward`; ``span``, ``block_fn``: see
        :func:`~specdraft.runner.model.run_blocks`."""
        out = run_blocks(self.layers, x, cache, rows, self.rope_inv_freq, self.args.sliding_window, tree_mask,
                         block_fn or run_block, span, depths)
        cache.advance(rows, x.shape[1] if advance is None else advance)
        return out


class LayerRunner(ModelRunner):
    """A :class:`LayerStack` over its own static cache; see the module's docstring.

    Everything but the model's call is :class:`ModelRunner`'s own: its cache (``runner.cache``),
    spans, width buckets and their padding, the
    compiled block and CUDA-graph capture. Its inputs are hidden states and its output the last
    block's.
    """

    def forward(self, x: torch.Tensor, advance=None, slots=None, tree_mask: torch.Tensor | None = None,
                depths: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``x # [rows, W, dim]`` (the stack's dtype and device) after each row's stored positions.

        Returns the last block's output ``[rows, W, dim]``. Each row's length grows by ``W``, or
        by ``advance[b]`` (a list or long tensor ``[rows]``) when rows carry padding. ``slots``:
        the cache rows the pass runs on (default: every row, in order), as for a model runner.
        ``tree_mask # [rows, W, P]`` and ``depths # [rows, W]``: a tree (see ``ModelRunner.forward``).
        """
        tree = None if tree_mask is None else (tree_mask, depths)
        with attention_backends(x.device):
            return self._forward(x, None, False, advance, self._slots(slots, x.shape[0]), tree)[0]

    def _run(self, inputs, cache, rows, logits_at, hidden, advance, span, tree, block_fn):
        return self.model(inputs, cache, advance=advance, rows=rows, span=span, block_fn=block_fn,
                          **_tree_kwargs(tree)), None

    def _warm_variants(self, bucket: int) -> tuple[bool, ...]:
        return (False,)

    def _blank(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros((rows, width, self.model.input_dim), dtype=self.dtype, device=self.device)


def layers_from_transformers(hf_layers, config, attention_norm: bool = True, compile: bool = False,
                             quantize: str | None = None) -> tuple[LayerRunner | None, str]:
    """``(runner, "")`` running transformers decoder layers (one, or a sequence run in order) on
    specdraft's blocks, or ``(None, reason)`` for anything they do not reproduce exactly.

    ``config``: the layers' transformers config (shapes, norm epsilon, rotary settings: default
    or llama3 rope). q/k/v and gate/up are fused into new tensors; the other weights are the
    layers' own. ``attention_norm=False``: the blocks skip their input norm (EAGLE-1, whose
    layer has an ``nn.Identity`` there); True needs the layers' input norm weights.
    ``quantize="q8_0"``: the products whose width allows on 8-bit blocks (a drafter's choice, see
    :meth:`~specdraft.services.DrafterServices.drafting_quantize`), on a CPU one call per layer as
    a target's GGUF blocks are.
    """
    layers = [hf_layers] if isinstance(hf_layers, nn.Module) and not isinstance(hf_layers, nn.ModuleList) \
        else list(hf_layers)
    if not layers:
        return None, "no decoder layers given"
    eagle3: bool | str = False
    if any(hasattr(layer, "hidden_norm") for layer in layers):  # EAGLE-3's layer (see Eagle3Block)
        if len(layers) > 1:
            return None, "more than one EAGLE-3 layer: published EAGLE-3 heads have one"
        eagle3 = "norm_before_residual" if getattr(layers[0], "norm_before_residual", False) else True
    kinds = sorted({"LlamaDecoderLayer" if eagle3 else type(layer).__name__ for layer in layers})
    if len(kinds) > 1:
        return None, f"decoder layers of several types ({', '.join(kinds)}), not supported"
    name = kinds[0].replace("DecoderLayer", "ForCausalLM")
    if not kinds[0].endswith("DecoderLayer") or name not in ARCHITECTURES:
        supported = ", ".join(a.replace("ForCausalLM", "DecoderLayer") for a in ARCHITECTURES)
        return None, f"{kinds[0]} is not a supported decoder layer (supported: {supported})"
    reason = placement_reason(kinds[0], [p for layer in layers for p in layer.parameters()])
    if reason:
        return None, reason
    args, reason = config_args(name, config, label=kinds[0], vocab_size=getattr(config, "vocab_size", None) or 0,
                               n_layers=len(layers))
    if args is None:
        return None, reason
    weights = {}
    for i, layer in enumerate(layers):
        ours = block_weights(layer, args)
        if attention_norm and "attention_norm.weight" not in ours:
            return None, (f"{kinds[0]} has no input norm weight ({type(layer.input_layernorm).__name__}); "
                          "pass attention_norm=False to run it without one")
        if not attention_norm:
            ours.pop("attention_norm.weight", None)
        if eagle3:
            ours["hidden_norm.weight"] = layer.hidden_norm.weight.detach()
        weights.update({f"layers.{i}.{k}": v for k, v in ours.items()})
    with torch.device("meta"):
        stack = LayerStack(args, attention_norm, eagle3)
    missing, unexpected = stack.load_state_dict(weights, assign=True, strict=False)
    if missing or unexpected:  # a weight left on the meta device would fail far from here
        raise RuntimeError(f"converting {kinds[0]}: missing {missing}, unexpected {unexpected}")
    stack.rope_inv_freq = rope_inv_freq(args).to(stack.device)  # the meta one holds no values
    stack.requires_grad_(False).eval()
    if quantize == "q8_0":
        replace_linears(stack, q8_0_linear, when=q8_0_fits)
    stack.kernels = pack_linears(stack)
    if stack.device.type == "cpu" and stack.dtype != torch.float64:  # see .cpu_ops
        from . import cpu_ops

        stack.kernels.update(cpu_ops.use(stack))
    return LayerRunner(stack, compile=compile), ""


__all__ = ["LayerRunner", "LayerStack", "layers_from_transformers"]
