"""What specdraft lends a drafter that runs a model of its own: runners and model loading.

Drafters import only :mod:`specdraft.drafters.api`, never the runner or the model loading. A
drafter that needs them (``draft-model`` runs a draft model, ``eagle`` a decoder layer) calls
the methods of ``self.target.services``, a :class:`DrafterServices` unless whoever built the
:class:`~specdraft.TargetInfo` passed another object with the methods it needs (a test's stub).
This is the one place that knows where those pieces live: nothing is imported until a method
is called, so building a ``TargetInfo`` and listing drafters stay instant.
"""

from __future__ import annotations

from typing import Any


#: the values of a drafter's ``quantize`` option (:meth:`DrafterServices.drafting_quantize`)
QUANTIZE = ("auto", "none", "q8_0")


def _fast_product(linear, quantize: str | None):
    """How :meth:`DrafterServices.fast_linears` makes ``linear``'s product (a function of it), or None
    where it stays as it is: 8-bit blocks where ``quantize`` is ``"q8_0"`` and the width allows,
    else panels where they serve its dtype."""
    from .runner import cpu_ops
    from .runner.gguf_blocks import q8_0_fits, q8_0_linear

    if quantize == "q8_0" and q8_0_fits(linear):
        return q8_0_linear
    return cpu_ops.PanelLinear if cpu_ops.panels_apply(linear) else None


class DrafterServices:
    """specdraft's own runners and model loading, lent to drafters through ``TargetInfo.services``."""

    def model_runner(self, model, compile: bool | None = None):
        """A runner of its own for a drafter's transformers model (a draft model).

        It has the target's runner interface: ``forward(tokens # [rows, W], logits_at=None,
        hidden=False, advance=None, slots=None, tree_mask=None, depths=None) -> (logits, hidden)``
        and ``supports_tree``, over a KV cache of its own, ``runner.cache`` (the interface of
        :mod:`specdraft.cache`: ``reset(rows, max_len)``, ``reserve(max_len, rows=None)``,
        ``set_lengths(lengths, slots=None)``, ``lengths`` on the device). Llama-family models run
        on specdraft's own code (compiled per pass width when ``compile``; None: the device's
        default), anything else on transformers' modules, eagerly.
        """
        from .runner import default_compile, load_runner

        if compile is None:
            compile = default_compile(model.device)
        try:
            return load_runner(model, compile=compile)
        except Exception:  # noqa: BLE001 - e.g. compile asked for a model our code does not run
            if not compile:
                raise
            return load_runner(model, compile=False)

    def layer_runner(self, hf_layers, config, compile: bool | None = None, attention_norm: bool = True,
                     quantize: str | None = None):
        """A runner of its own for a drafter's transformers decoder layers (EAGLE's layer).

        ``hf_layers``: one layer or a sequence run in order; ``config``: their transformers config.
        The runner has the model runner's cache (``runner.cache``, as above) and
        ``forward(x # [rows, W, dim], advance=None, slots=None, tree_mask=None, depths=None) ->
        [rows, W, dim]``, the last layer's output. ``attention_norm=False``: the layers skip their
        input norm (EAGLE-1). Compiled per pass width when ``compile`` (None: the device's
        default). ``quantize="q8_0"``: the layers' products on 8-bit blocks (see
        :meth:`drafting_quantize`). Raises :class:`~specdraft.ConfigError` naming what specdraft's
        layer code does not reproduce.
        """
        import torch

        from .errors import ConfigError
        from .runner import default_compile
        from .runner.layers import layers_from_transformers

        layers = hf_layers if isinstance(hf_layers, torch.nn.Module) else torch.nn.ModuleList(hf_layers)
        if compile is None:
            compile = default_compile(next(layers.parameters()).device)
        runner, reason = layers_from_transformers(layers, config, attention_norm=attention_norm, compile=compile,
                                                  quantize=quantize)
        if runner is None:
            raise ConfigError(f"specdraft cannot run these decoder layers: {reason}")
        return runner

    def drafting_quantize(self, quantize: str, device, dtype) -> str | None:
        """What a drafter's ``quantize`` option (``"auto"``, ``"none"`` or ``"q8_0"``) means for
        products of ``dtype`` on ``device``: ``"q8_0"`` or None (the weights as loaded).

        ``q8_0``: each product's weight as 8-bit blocks with a float16 scale per 32 inputs (llama.cpp's
        Q8_0, :func:`~specdraft.runner.gguf_blocks.quantize_q8_0`), multiplied by specdraft's CPU
        operator on inputs rounded to 8 bits per group of 32 (``specdraft_cpu::block_linear``, exact
        integer sums): half the bytes of bfloat16, a quarter of float32's. A drafter's products
        need not equal the float ones: the verifier accepts by the distribution the drafter
        reports, so drafts change a little and the output never. ``auto`` is ``q8_0`` on a CPU
        where the operator runs (float32 and bfloat16, the C++ extension loaded), else None.
        Raises :class:`~specdraft.ConfigError` for ``q8_0`` where it cannot run (float64 runs
        the blocks' dequantised weights, for tests)."""
        import torch

        from .errors import ConfigError
        from .runner import cpu_ops

        if quantize not in QUANTIZE:
            raise ConfigError(f"quantize={quantize!r}: use one of {', '.join(QUANTIZE)}")
        if quantize == "none":
            return None
        device = torch.device(device)
        if device.type != "cpu":
            why = "the blocks' product is a CPU operator"
        elif dtype == torch.float64:  # the dequantised weights in float64 when asked for (tests), else none
            why = "" if quantize == "q8_0" else "float64"
        elif dtype not in (torch.float32, torch.bfloat16):
            why = f"it multiplies float32 and bfloat16 inputs (this drafter runs {str(dtype).removeprefix('torch.')})"
        else:
            why = cpu_ops.load()  # "" when the C++ extension's operators are there
        if not why:
            return "q8_0"
        if quantize == "q8_0":
            raise ConfigError(f"quantize='q8_0' cannot run here: {why}; use --drafter-option quantize=none")
        return None

    def fast_linears(self, module, skip: tuple[str, ...] = (), quantize: str | None = None) -> int:
        """Make the ``nn.Linear`` layers inside ``module`` (a drafter's own heads, for inference: no
        gradients) run on the fastest product specdraft has for them on this processor, in place:
        with ``quantize="q8_0"`` (:meth:`drafting_quantize`) 8-bit blocks where the width allows
        (a multiple of 32 inputs), else :class:`~specdraft.runner.cpu_ops.PanelLinear` where it
        serves their dtype (float32 on a CPU with AVX-512 or AVX2, and bfloat16 there), else left
        as they are. Submodules named in ``skip`` (attribute names at any depth) are left alone.
        Returns how many were replaced. A drafter's products need not be row-invariant; these are,
        and faster."""
        from .runner.kernels import replace_linears

        skipped = [m for name, m in module.named_modules() if name.rsplit(".", 1)[-1] in skip]
        inside = {id(m) for s in skipped for m in s.modules()}
        return len(replace_linears(module, lambda lin: _fast_product(lin, quantize)(lin),
                                   when=lambda lin: id(lin) not in inside and _fast_product(lin, quantize)))

    def fast_linear(self, weight, bias=None, quantize: str | None = None):
        """``(x) -> x @ weight.T + bias`` on the product :meth:`fast_linears` would choose, or None
        where that is ``F.linear``'s (for a head that keeps a bare weight)."""
        import torch

        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        make = _fast_product(linear, quantize)
        return make(linear) if make else None

    def cpu_operator(self, name: str):
        """specdraft's C++ operator ``name`` on CPU (``torch.ops.specdraft_cpu.<name>``: for example
        ``copy_choose``, greedy drafting through a copy gate), or None where the extension does not
        load (no compiler, ``SPECDRAFT_CPU_OPS=torch``)."""
        import torch

        from .runner import cpu_ops

        return None if cpu_ops.load() else getattr(torch.ops.specdraft_cpu, name)

    def attention_backends(self, device):
        """The attention kernels specdraft allows on ``device`` (on CUDA: no cuDNN, which plans per
        key length), as a context; for a drafter's own modules run outside a runner (training)."""
        from .runner.base import attention_backends

        return attention_backends(device)

    def load_model(self, source: str, dtype: Any = None, device: Any = None,
                   option: str = "--drafter-option model") -> tuple[Any, Any, str]:
        """``(model, tokenizer or None, name)`` for a hub id, a local folder or a ``.gguf`` file, as
        the target is loaded (``dtype``, ``device``: None for the defaults); ``option`` is how the
        user named ``source``, for the errors' advice. Raises :class:`~specdraft.ModelLoadError`."""
        from .models import load_target

        return load_target(source, dtype=dtype, device=device, require_tokenizer=False, option=option)

    def hub_folder(self, repo_id: str, allow_patterns: list[str] | None = None, what: str = "files",
                   option: str = "--drafter-option heads"):
        """The local folder (a ``Path``) of Hugging Face hub repository ``repo_id``, restricted to
        ``allow_patterns``, had as a target's hub id is: from the cache when offline, else
        downloaded. Raises :class:`~specdraft.ModelLoadError` in one line naming ``what`` and
        ``option``."""
        from .models import hub_folder

        return hub_folder(repo_id, allow_patterns, what=what, option=option)

    def resolve_device(self, device: Any):
        """A ``torch.device`` for ``device`` (a name, a device, or None: CUDA if there is one)."""
        from .models import resolve_device

        return resolve_device(device)

    def resolve_dtype(self, dtype: Any, device: Any):
        """A ``torch.dtype`` for ``dtype`` (a name such as ``"bfloat16"``, a dtype, or None: the
        device's default)."""
        from .models import resolve_dtype

        return resolve_dtype(dtype, device)


__all__ = ["DrafterServices"]
