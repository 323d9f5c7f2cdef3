"""Tiny models, tokenizers, heads and prompts for tests of drafters."""

from __future__ import annotations

def tiny_llama(vocab_size: int = 64, seed: int = 0, layers: int = 2, max_positions: int = 256, dtype=None):
    """A small random Llama (float64 by default, so greedy ties cannot flip between paths)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype or torch.float64).eval()


def wide_bf16_llama():
    """A random bfloat16 Llama wide enough (256) that rounding follows a pass's shape: a prompt's
    keys and values computed in other passes, or padded beside longer prompts, round otherwise
    (at :func:`tiny_llama`'s width 32 they happened to round alike). Vocabulary 256, 512 positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def tiny_tokenizer(vocab_size: int = 64):
    """A word-level tokenizer over ``vocab_size`` ids for :func:`tiny_llama` models: ids 0-3 are
    ``<pad> <s> </s> <unk>``, id ``i >= 4`` is the word ``t{i}`` (text is space-separated words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(special)} | {f"t{i}": i for i in range(len(special), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def trusting_copy_gate(hidden: int, match_bias: float = 2.0, dtype=None):
    """A :class:`~specdraft.drafters.common.copy_gate.CopyGate` that often trusts its candidate (2- and
    3-gram matches) and mostly not (1-gram matches), so both halves of the mixture get drafted."""
    import torch

    from ..drafters.common.copy_gate import CopyGate

    gate = CopyGate(hidden).to(dtype or torch.float32)
    with torch.no_grad():
        gate.match.weight.fill_(match_bias)
        gate.match.weight[1] = -match_bias
        gate.agree.fill_(0.5)
    return gate


def gated_draft(model, path, head_tokens: int = 48, seed: int = 0, match_bias: float = 2.0) -> str:
    """Save a compact draft of ``model`` into ``path`` (one layer, the ``head_tokens`` first ids in its
    head, float64) with a :func:`trusting_copy_gate`, so both halves of the mixture get drafted; returns
    the path to pass as the draft model's ``model`` option."""
    import torch

    from ..drafters.common.compact_draft import build_compact_draft, save_compact_draft, target_fingerprint

    torch.manual_seed(seed)
    draft = build_compact_draft(model, 1, torch.arange(head_tokens), init_layers=[1])
    draft.copy_gate = trusting_copy_gate(model.config.hidden_size, match_bias, dtype=model.dtype)
    save_compact_draft(draft, path, "tiny", target_fingerprint(model.get_input_embeddings().weight), dtype=torch.float64)
    return str(path)


def random_heads(kind: str, model, path, seed: int = 0, head_ids=None, scale: float = 0.5, copy_gate: bool = False,
                 **config):
    """Save randomly initialised heads of ``kind`` for ``model`` into ``path`` (specdraft's format).

    ``scale`` is the std of the random weights (Medusa's blocks start at identity otherwise);
    ``head_ids`` trims the vocabulary; ``copy_gate`` adds a :func:`trusting_copy_gate`. Returns ``path``.
    """
    import torch

    from ..drafters.common.compact_draft import target_fingerprint
    from ..drafters.heads.formats import save_heads
    from ..drafters.heads.modules import SharedHead, build_heads

    torch.manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    if kind == "eagle3" and head_ids is not None:  # EAGLE-3 owns its draft vocabulary: d2t, not head_ids
        config = {"draft_vocab_size": len(head_ids), **config}
    module = build_heads(kind, model.config.get_text_config(), **config).to(model.dtype)
    if kind == "eagle3":
        if head_ids is not None:
            module.d2t.copy_(torch.as_tensor(head_ids) - torch.arange(len(head_ids)))
            head_ids = None
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name.endswith("norm.weight"):  # norms near 1, not 0
                    p.uniform_(0.5, 1.5)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale / p.shape[1] ** 0.5 * 3)
    if copy_gate:
        module.copy_gate = trusting_copy_gate(model.config.get_text_config().hidden_size, dtype=model.dtype)
    shared = SharedHead(model.get_output_embeddings(), vocab, head_ids)
    return save_heads(module, shared, path, "tiny", target_fingerprint(model.get_input_embeddings().weight),
                      dtype=model.dtype)



def repetitive_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (so copy-style drafters get accepted) and of different lengths."""
    import random

    rng = random.Random(seed)
    motif = [rng.randrange(vocab_size) for _ in range(5)]
    return [
        motif * 3 + motif[:2],
        [rng.randrange(vocab_size) for _ in range(11)],
        [rng.randrange(vocab_size)],
        (motif[::-1] * 2)[:7],
    ]




class RunnerAsModel:
    """A model runner seen as a transformers causal LM for the test references: ``model(ids).logits``
    runs each batch of contexts through ``runner`` from an empty cache, so references such as
    :func:`~specdraft.testing.reference.enumerate_plain_sampling` see the distribution the runner
    computes (a quantized or compiled target's own, which transformers' forward does not give).
    Contexts up to 32 tokens run through the runner's decode kernels, whose rows equal those of
    prefill plus one-token steps bit for bit (``specdraft.runner.kernels``)."""

    def __init__(self, runner, vocab_size: int) -> None:
        self.runner, self.vocab_size = runner, vocab_size
        self.device = runner.device

    def get_output_embeddings(self):
        import torch

        return torch.nn.Linear(1, self.vocab_size, bias=False, device="meta")  # its weight's shape is what is read

    def __call__(self, ids):
        from types import SimpleNamespace

        import torch

        self.runner.cache.reset(ids.shape[0], ids.shape[1])
        with torch.inference_mode():
            logits, _ = self.runner.forward(ids.to(self.device))
        return SimpleNamespace(logits=logits.float().clone())


def plain_reference(decoder):
    """What a decoder's plain sampling draws from, as a model for the test references: its runner's
    own logits (:class:`RunnerAsModel` over a fresh runner of the same converted model, so the
    decoder's cache is left alone) when it runs specdraft's model, else its transformers model.

    The runner's half-precision arithmetic is its own (the CPU operators of
    :mod:`specdraft.runner.cpu_ops`, oneDNN products, the CUDA kernels): it agrees with
    transformers' forward to rounding, not bit for bit, and a sharp distribution (temperature
    0.03) turns such rounding into a difference a chi-square test of thousands of samples finds.
    Speculation is exact with respect to the target as it runs."""
    runner = decoder.runner
    if getattr(runner, "implementation", None) != "specdraft" or runner.__class__.__name__ != "ModelRunner":
        return decoder.model
    vocab = runner.model.args.vocab_size
    return RunnerAsModel(runner.__class__(runner.model, quantization=runner.quantization), vocab)


def on_one_thread(fn, *args):
    """``fn(*args)`` with torch held to one thread (its thread count restored after): a kernel's
    result there must equal its result on all threads."""
    import torch

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def differing_widths(runner, vocab_size: int, widths, prompt_lengths=(9, 4, 13), seed: int = 0, subset=(0, 2)):
    """Where ``runner`` is not row-invariant: rows with prompts of ``prompt_lengths`` tokens (one
    cache slot each; three by default), their one-token steps (each row alone) against passes of
    every width in ``widths`` over all rows and over the rows ``subset`` names only (a gathered
    subset: rows 0 and 2 by default). Returns
    ``(widths where all rows differ, widths where the subset differs)`` by bit-identity of the
    logits: ``([], [])`` for a row-invariant runner (see ``specdraft.runner.kernels``)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    device = runner.device
    prompts = [torch.randint(vocab_size, (n,), generator=gen).to(device) for n in prompt_lengths]
    tokens = torch.randint(vocab_size, (len(prompts), max(widths)), generator=gen).to(device)
    runner.cache.reset(len(prompts), max(prompt_lengths) + max(widths) + 1)
    lengths = [len(p) for p in prompts]
    bad_all, bad_subset = [], []
    with torch.inference_mode():
        steps = []
        for slot, prompt in enumerate(prompts):
            runner.forward(prompt[None], slots=[slot])
            steps.append(torch.cat([runner.forward(tokens[slot:slot + 1, t:t + 1], slots=[slot])[0]
                                    for t in range(tokens.shape[1])], dim=1))
        steps = torch.cat(steps)  # [rows, max(widths), vocab]
        for width in widths:
            runner.cache.set_lengths(lengths)
            if not torch.equal(runner.forward(tokens[:, :width])[0], steps[:, :width]):
                bad_all.append(width)
            runner.cache.set_lengths(lengths)
            rows = list(subset)
            if not torch.equal(runner.forward(tokens[rows, :width], slots=rows)[0], steps[rows, :width]):
                bad_subset.append(width)
    return bad_all, bad_subset
