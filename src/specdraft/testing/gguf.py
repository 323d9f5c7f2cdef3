"""A GGUF file of a small transformers Llama, written as llama.cpp's converter writes one (q and k
permuted, linears in Q4_0, Q4_1 or Q8_0 blocks), for tests of ``quantize="gguf"``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

#: transformers' names -> GGUF's, per layer
LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of q's (or k's) rows (``LlamaModel.permute``)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(hf_model, folder: str | Path, kind: str = "Q4_1", permute: bool = True) -> Path:
    """Write ``folder/model.gguf`` with ``hf_model``'s linear layers (a Llama, untied head) as ``kind``
    blocks, set those layers' weights to the blocks' values (so the transformers model is the file's
    model), and record the file as ``folder``'s source, as a converted GGUF folder records it; point
    ``hf_model`` at ``folder``. ``permute=False`` leaves q and k in transformers' order (a file the
    loader must refuse)."""
    import gguf

    from ..models import GGUF_SOURCE
    from ..runner.gguf_blocks import llama_permutation

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    config = hf_model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    with torch.no_grad():
        linears = [(f"model.layers.{i}.{hf}", f"blk.{i}.{name}.weight")
                   for i in range(config.num_hidden_layers) for hf, name in LAYER_TENSORS.items()]
        for module_name, name in linears + [("lm_head", "output.weight")]:
            module = hf_model.get_submodule(module_name)
            weight = module.weight.detach().float().numpy()
            group = heads if name.endswith("attn_q.weight") else kv_heads if name.endswith("attn_k.weight") else 0
            if group and permute:
                weight = llama_cpp_permute(weight, group)
            raw = gguf.quants.quantize(np.ascontiguousarray(weight), qtype)
            values = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(weight.shape).copy())
            if group and permute:
                values = values[llama_permutation(values.shape[0], group)]
            module.weight.copy_(values.to(module.weight.dtype))
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)  # the shape in bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (folder / GGUF_SOURCE).write_text(str(path.resolve()))
    config.name_or_path = hf_model.name_or_path = str(folder)
    return path


__all__ = ["llama_cpp_permute", "write_gguf"]
