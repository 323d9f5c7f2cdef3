"""``specdraft train-heads``: train Medusa, EAGLE, EAGLE-3 or MLP-speculator heads on a frozen target.

Two phases, 5:2 in steps (Medusa's recipe):

1. **Text.** Prompts with reference answers (self-instruct outputs, GSM8K solutions),
   chat-formatted; the heads learn the causal-LM objective (the answer's real next tokens)
   over the target's frozen hidden states.
2. **Self-distillation.** The target's own answers to training prompts (greedy plus a
   sampled share); the heads learn to match the target's distribution at every answer
   position, which is what verification rewards.

The target's hidden states are computed once per sequence and cached (``DIR/work``), as
are its answers; training steps then only run the heads. The target's embeddings and LM
head are shared and frozen; the output vocabulary can be trimmed to the most frequent
answer tokens (``head_tokens``). EAGLE-3 reads the target's states at three layers, owns
its norm and an LM head over such a draft vocabulary, and is trained on its own unrolled
guesses (:func:`eagle3_loss`). Training uses :func:`specdraft.training.loop.train`, the
loop ``specdraft distill`` uses: resumable checkpoints, a progress bar, a loss plot.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..drafters.common.compact_draft import target_fingerprint
from ..types import describe_target
from ..drafters.heads.formats import load_heads, save_heads
from ..drafters.heads.modules import KINDS, SharedHead, build_heads, eagle3_default_layers
from ..errors import ConfigError
from .batches import eagle3_features, eagle_unroll, padded_batch
from .copy_gate import GateSource, fit_copy_gate
from .data import (chat_sequences, frequent_tokens, load_examples, sequences_key, states_file, target_answers,
                   target_features, target_identity)
from .evaluate import heads_predictor, held_out_acceptance, split_held_out
from .io import key_of, write_atomic
from .loop import autocast_dtype, batch_indices, check_lr, seeded, step_generator, train

#: EAGLE-1's weighting of its two losses: feature regression 1, token classification 0.1
EAGLE_CLASSIFICATION_WEIGHT = 0.1
#: drafting steps EAGLE is trained over (each after the first is fed the layer's own guesses)
EAGLE_DEPTH = 2
#: drafting steps of EAGLE-3's training-time test. The paper and the EAGLE repository unroll 7
#: (``self.length = 7`` in ``traineagle3/cnets.py``). Each step runs the layer and the heads'
#: LM head once more over every position, and its pairs attend to all pairs before them
#: (:func:`eagle_unroll`), so 7 steps cost 7/4 of 4 steps' layer and head work and 28/10 of
#: their attention: about twice the time a step, on a CPU where a step of 4 already costs
#: about 2 of EAGLE-1's (depth 2); and on a small budget chains past 4 tokens are rarely accepted
EAGLE3_DEPTH = 4
#: EAGLE-3's weight of unrolled step ``s``'s loss: ``EAGLE3_STEP_DECAY ** (s - 1)`` (its ``0.8 ** i``)
EAGLE3_STEP_DECAY = 0.8


def token_loss(out: torch.Tensor, at: int, ids, feats, answer, head: SharedHead, soft: bool,
                student=None) -> torch.Tensor:
    """Cross-entropy of the guesses from ``out # [B, T, H]`` (T = W - at) for the tokens at ``at..W-1``.

    Only answer positions count, and only they go through the head (most of the cost).
    ``student`` maps features to logits over ``head``'s vocabulary (default: ``head.small``,
    the target's own rows). Hard: the sequence's real tokens. Soft: the target's distribution
    there, from its state one position earlier (restricted to the head's vocabulary and
    renormalised).
    """
    mask = answer[:, at:]  # [B, T]
    if not bool(mask.any()):
        return out.sum() * 0
    logits = (student or head.small)(out[mask]).float()  # [M, N]
    if soft:
        with torch.no_grad():
            target = head.small(feats[:, at - 1 : -1][mask]).float().softmax(-1)  # [M, N]
        return -(target * logits.log_softmax(-1)).sum(-1).mean()
    return F.cross_entropy(logits, head.to_small(ids[:, at:][mask]), ignore_index=-100)


def heads_loss(kind: str, module, head: SharedHead, embeddings, ids, feats, valid, answer, soft: bool,
               noise: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Teacher-forced training loss of one padded batch (see :func:`padded_batch`); ``generator``
    draws EAGLE's input noise (default: torch's global one)."""
    width = ids.shape[1]
    if kind == "medusa":
        losses = []
        for i in range(1, module.num_heads + 1):  # head i on f_t guesses x_{t+i+1}
            if width <= i + 1:
                break
            out = module.blocks[i - 1](feats[:, : width - i - 1])
            losses.append(token_loss(out, i + 1, ids, feats, answer, head, soft))
        return torch.stack(losses).mean()
    if kind == "mlp-speculator":
        losses, state = [], feats[:, : width - 2]  # stage i on (state_{i-1}, x_{t+i}) guesses x_{t+i+1}
        for i in range(1, module.num_stages + 1):
            if width <= i + 1:
                break
            n = width - i - 1
            state, out = module.stage(i - 1, state[:, :n], embeddings(ids[:, i : i + n]))
            losses.append(token_loss(out, i + 1, ids, feats, answer, head, soft))
        return torch.stack(losses).mean()
    if kind == "eagle":
        return _eagle_loss(module, head, embeddings, ids, feats, valid, answer, soft, noise, generator=generator)
    if kind == "eagle3":
        return eagle3_loss(module, head, embeddings, ids, feats, answer, soft)
    raise ConfigError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")


def _eagle_loss(module, head, embeddings, ids, feats, valid, answer, soft: bool, noise: float,
                depth: int = EAGLE_DEPTH, token_weight: float = EAGLE_CLASSIFICATION_WEIGHT,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """EAGLE's loss over ``depth`` drafting steps (:func:`eagle_unroll`), summed.

    Each step: smooth-L1 between guessed and true features plus ``token_weight`` x the token
    loss of the guesses. Without the steps after the first, the layer never sees its own
    guesses as input and later draft tokens are rarely right.
    """
    loss = 0
    for s, guess in enumerate(eagle_unroll(module, embeddings, ids, feats, depth, noise, generator), 1):
        target, keep = feats[:, s:], valid[:, s:]  # f_{j+s}
        regression = F.smooth_l1_loss(guess[keep].float(), target[keep].float())
        loss = loss + regression + token_weight * token_loss(guess[:, :-1], s + 1, ids, feats, answer, head, soft)
    return loss


def eagle3_loss(module, head: SharedHead, embeddings, ids, feats, answer, soft: bool,
                depth: int = EAGLE3_DEPTH) -> torch.Tensor:
    """EAGLE-3's training-time test: the token loss of ``depth`` unrolled drafting steps, step ``s``
    weighted ``EAGLE3_STEP_DECAY ** (s - 1)``; no feature regression (EAGLE-3 drops it).

    ``feats # [B, W, (k + 1) * H]``: the target's states at ``module.aux_layers`` (fused by
    ``fc`` into the chains' first features) and its final-norm states. ``head``: the target's
    LM head over the draft vocabulary (``head_ids`` = ``module.head_ids()``, or None for a
    draft vocabulary of every token): it maps labels into the draft vocabulary and, soft, gives
    the target's distribution there, from the final-norm state one position earlier,
    restricted to the draft vocabulary and renormalised (as ``cnets.py`` does with ``t2d``).
    The guesses' logits are the heads' own (:meth:`~.modules.Eagle3Draft.logits`). Positions
    whose real token is outside the draft vocabulary do not count: the drafter can never
    propose it (EAGLE-3 masks the positions whose target top token is outside; on the
    target's greedy answers that is the same token).
    """
    width = ids.shape[1]
    final = feats[..., module.fc.in_features :]  # [B, W, H]
    if head.head_ids is not None:
        answer = answer & (head.to_small(ids) >= 0)
    counted = answer.clone()
    counted[:, :2] = False  # the first guess is of x_2 (from the pair (f_0, x_1))
    probs, loss = None, module.fc.weight.sum() * 0
    if soft:  # the target's distributions at every counted position, once for all steps
        row = torch.full(counted.shape, -1, dtype=torch.long, device=ids.device)
        row[counted] = torch.arange(int(counted.sum()), device=ids.device)
        with torch.no_grad():
            probs = head.small(final[:, :-1][counted[:, 1:]]).float().softmax(-1)  # [M, N]
    for s, guess in enumerate(eagle_unroll(module, embeddings, ids, eagle3_features(module, feats), depth), 1):
        at = s + 1  # guess[:, j] (j < W - s - 1) is of x_{j+s+1}
        if width <= at:
            break
        mask = counted[:, at:]  # [B, W - at]
        if not bool(mask.any()):
            loss = loss + guess.sum() * 0
            continue
        logits = module.logits(guess[:, :-1][mask]).float()  # [M_s, N]
        if soft:
            step_loss = -(probs[row[:, at:][mask]] * logits.log_softmax(-1)).sum(-1).mean()
        else:
            step_loss = F.cross_entropy(logits, head.to_small(ids[:, at:][mask]))
        loss = loss + EAGLE3_STEP_DECAY ** (s - 1) * step_loss
    return loss


def feature_layers(kind: str, aux_layers, n_layers: int) -> tuple[int, ...] | None:
    """The target states a kind trains on, as :func:`~.data.target_features`' ``layers``: None
    (the last layer's) for all but EAGLE-3, whose are its ``aux_layers`` and the final-norm state."""
    return (*(int(i) for i in aux_layers), n_layers) if kind == "eagle3" else None


def train_heads(target, tokenizer, target_name: str, kind: str, prompt_files: Sequence[str], out_dir: str | Path,
                num_texts: int = 600, num_prompts: int = 600, self_prompts: int = 0,
                document_prompts: int = 0, max_new_tokens: int = 128,
                steps: int = 700,
                batch_size: int = 8, lr: float = 1e-3, head_tokens: int | None = 8192, gen_batch_size: int = 16,
                seed: int = 0,
                work_dir: str | Path | None = None, progress: bool = True, train_dtype: str = "auto",
                copy_gate: bool = True, gate_steps: int = 300, init_from: str | Path | None = None,
                **head_config) -> Path:
    """Train heads of ``kind`` for ``target`` and save them in specdraft's format in ``out_dir``.

    ``work_dir`` (default ``out_dir/work``) caches the target's answers and hidden states,
    which do not depend on the kind: point several runs at one to compute them once.
    Checkpoints go to ``work_dir/<kind>``. Then, unless ``copy_gate`` is False, the heads'
    copy gate is fitted with the heads frozen (``gate_steps``, checkpoints in
    ``work_dir/<kind>-copy-gate``). ``init_from``: start from the heads in that folder
    (specdraft's format, same kind; their vocabulary is kept) instead of fresh ones; with
    ``steps=0`` only the copy gate is fitted.

    ``eagle3`` trains on the target's states at its three layers and its final-norm states
    (cached apart from the other kinds'), over a draft vocabulary of the ``head_tokens`` most
    frequent answer tokens (:func:`eagle3_loss`); its copy gate reads the layer's output and its
    own norm and LM head, as its drafter does.

    The same inputs and ``seed`` give the same heads, bit for bit on the same machine and
    threads, whether or not the run was interrupted and resumed.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")
    check_lr(lr)
    out_dir = Path(out_dir)
    work = Path(work_dir) if work_dir else out_dir / "work"
    (work / kind).mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    device = target.device
    n_layers = target.config.get_text_config().num_hidden_layers
    initial = None
    if init_from is not None:  # before the data: EAGLE-3 heads name the layers their data comes from
        module, head, initial = load_heads(init_from, describe_target(target, tokenizer, target_name), kind,
                                           dtype=torch.float32, device=device)
        if hasattr(module, "copy_gate"):
            del module.copy_gate  # refitted below, for the heads as they end up
        layers = feature_layers(kind, getattr(module, "aux_layers", ()), n_layers)
    else:
        layers = feature_layers(kind, head_config.get("aux_layers") or eagle3_default_layers(n_layers), n_layers)

    texts = chat_sequences(tokenizer, load_examples(prompt_files, limit=num_texts, seed=seed)) if steps else []
    answers, answer_states = target_answers(target, tokenizer, prompt_files, work, num_prompts, self_prompts,
                                            max_new_tokens=max_new_tokens, batch_size=gen_batch_size, seed=seed,
                                            progress=progress,
                                            document_prompts_count=document_prompts, layers=layers)
    text_states = target_features(target, texts, states_file(work, "text_states", layers), progress=progress,
                                  desc="target states (text)", layers=layers) if texts else []
    data_seconds = time.perf_counter() - began
    keep, held = split_held_out(answers)  # greedy answers never trained on, to measure acceptance
    held_answers, held_states = [answers[i] for i in held], [answer_states[i] for i in held]
    answers, answer_states = [answers[i] for i in keep], [answer_states[i] for i in keep]

    specials = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) if t is not None]
    lm_head = target.get_output_embeddings()
    vocab = lm_head.weight.shape[0]
    if init_from is None:
        head_ids = frequent_tokens(answers + texts, head_tokens, specials) if head_tokens else None
        if kind == "eagle3":  # its draft vocabulary: the most frequent answer tokens (EAGLE-3's d2t)
            module = _fresh_eagle3(target, layers[:-1], torch.arange(vocab) if head_ids is None else head_ids, seed,
                                   head_config)
        else:
            head = SharedHead(lm_head, vocab, head_ids).to(device=device, dtype=torch.float32)
            with seeded(seed):
                module = build_heads(kind, target.config.get_text_config(), **head_config)
        module = module.to(device=device, dtype=torch.float32)
    if kind == "eagle3":  # the loss's head: the target's own rows over the draft vocabulary
        head = SharedHead(lm_head, vocab, module.head_ids().cpu()).to(device=device, dtype=torch.float32)
    module.train()
    params = dict(module.named_parameters())
    embeddings = target.get_input_embeddings()
    with torch.no_grad():  # EAGLE's input noise is relative to the states' own scale
        noise = 0.1 * float(torch.cat(answer_states[:50]).float().std()) if kind == "eagle" else 0.0
    phase1 = round(steps * 5 / 7)

    def loss_fn(step: int) -> torch.Tensor:  # a function of the step alone, so that resuming is exact
        phase = 1 if step < phase1 else 2
        seqs, states = (texts, text_states) if phase == 1 else (answers, answer_states)
        picked = batch_indices(step - (0 if phase == 1 else phase1), batch_size, len(seqs), seed + phase)
        ids, feats, valid, answer = padded_batch([seqs[i] for i in picked], [states[i] for i in picked], torch.float32,
                                           device)
        return heads_loss(kind, module, head, lambda t: embeddings(t).float(), ids, feats, valid, answer,
                          soft=phase == 2, noise=noise, generator=step_generator(seed, step, device))

    target_id = target_identity(target, tokenizer)
    settings = {"kind": kind, "texts": sequences_key(texts), "answers": sequences_key(answers), "target": target_id,
                "head_tokens": key_of(head.head_ids.tolist() if head.head_ids is not None else None),
                "batch_size": batch_size, "seed": seed, **({"layers": list(layers)} if layers else {})}
    losses = []
    if steps:
        with torch.enable_grad():
            losses = train(params, loss_fn, steps, work / kind, lr=lr, progress=progress,
                           desc=f"train-heads ({kind})", autocast=autocast_dtype(train_dtype, target.device),
                           settings=settings)
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    if kind == "eagle3":  # from here on (copy gate, held-out check): its own norm and LM head, as its drafter's
        head = module.draft_head(vocab)
    gate_info = {}
    if copy_gate and gate_steps:
        source = heads_gate_source(kind, module, head, lambda t: embeddings(t).float())
        gate_losses = fit_copy_gate(module, source, answers, work / f"{kind}-copy-gate", states=answer_states,
                                    steps=gate_steps, seed=seed, progress=progress, device=device,
                                    settings={"target": target_id})
        if gate_losses:
            gate_info = {"copy_gate": {"steps": gate_steps,
                                       "final_loss": sum(gate_losses[-20:]) / max(1, len(gate_losses[-20:]))}}
    train_seconds = time.perf_counter() - began - data_seconds
    depth = {"medusa": getattr(module, "num_heads", 0), "mlp-speculator": getattr(module, "num_stages", 0)}.get(kind, 4)
    acceptance = held_out_acceptance(heads_predictor(kind, module, head, lambda t: embeddings(t).float(), depth),
                                     held_answers, held_states, depth, device=device) if held_answers else []
    tail = losses[-20:]
    save_heads(module, head, out_dir, target_name, target_fingerprint(embeddings.weight), extra={
        "name": f"{target_name}-{kind}",
        "steps": steps, "phase1_steps": phase1, "batch_size": batch_size, "lr": lr, "train_dtype": train_dtype,
        "text_sequences": len(texts), "answer_sequences": len(answers), "self_prompted": self_prompts,
        "document_prompted": document_prompts,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "held_out": {"answers": len(held_answers), "acceptance_by_position": [round(a, 4) for a in acceptance]},
        "seconds": {"target_answers_and_states": round(data_seconds, 1), "training": round(train_seconds, 1),
                    "total": round(time.perf_counter() - began, 1)},
        "prompt_files": [Path(p).name for p in prompt_files],
        **({"initialised_from": {"folder": Path(init_from).name, **{
            k: v for k, v in initial.items() if k not in ("format", "kind", "target", "target_fingerprint", "config",
                                                          "head_tokens", "copy_gate")}}} if initial else {}),
        **gate_info,
        **({"unrolled_steps": EAGLE3_DEPTH} if kind == "eagle3" else {}),
    })
    for name in ("loss.png", "losses.json"):
        if steps and (work / kind / name).is_file():
            write_atomic(out_dir / name, (work / kind / name).read_bytes())
        if gate_info and (work / f"{kind}-copy-gate" / name).is_file():
            write_atomic(out_dir / f"copy_gate_{name}", (work / f"{kind}-copy-gate" / name).read_bytes())
    return out_dir


def _fresh_eagle3(target, aux_layers, draft_ids: torch.Tensor, seed: int, head_config: dict):
    """New EAGLE-3 heads over the draft vocabulary ``draft_ids`` (sorted target ids; ``d2t`` =
    ``draft_ids - arange``): ``fc`` and the layer randomly initialised (seeded).

    Warm start: the LM head starts as the target's rows at the draft tokens and the norm as the
    target's final norm, so that from the first step a feature shaped like the target's last
    residual state reads as the target reads it; learning a 576 x 8192 head from scratch would
    take much of a small CPU budget. Both are trained from there.
    """
    config = {k: v for k, v in head_config.items() if k not in ("aux_layers", "draft_vocab_size")}
    with seeded(seed):
        module = build_heads("eagle3", target.config.get_text_config(), aux_layers=list(aux_layers),
                             draft_vocab_size=len(draft_ids), **config)
    lm_head = target.get_output_embeddings()
    norm = getattr(target.get_decoder(), "norm", None)
    with torch.no_grad():
        ids = draft_ids.long().cpu()
        module.d2t.copy_(ids - torch.arange(len(ids)))
        module.lm_head.weight.copy_(lm_head.weight.detach()[ids.to(lm_head.weight.device)].float().cpu())
        if norm is not None and getattr(norm, "weight", None) is not None:
            module.norm.weight.copy_(norm.weight.detach().float().cpu())
    return module


def first_features(kind: str, module, embeddings, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The feature each head kind's first guess reads, teacher-forced: ``[B, W, H]`` whose entry
    ``p-1`` guesses token ``p`` (from ``f_{p-2}`` and ``x_{p-1}``; entry 0 is zeros)."""
    if kind == "medusa":
        first = module.blocks[0](feats[:, :-1])
    elif kind == "mlp-speculator":
        first = module.stage(0, feats[:, :-1], embeddings(ids[:, 1:]))[1]
    elif kind == "eagle3":  # the fused features in, the layer's output (before the heads' norm) out
        first = eagle_unroll(module, embeddings, ids, eagle3_features(module, feats), 1)[0]
    else:
        first = eagle_unroll(module, embeddings, ids, feats, 1)[0]  # entry j guesses f_{j+1}, hence x_{j+2}
    return torch.cat([torch.zeros_like(first[:, :1]), first], dim=1)


def heads_gate_source(kind: str, module, head: SharedHead, embeddings) -> GateSource:
    """The heads' first guesses, for :func:`~.copy_gate.fit_copy_gate`."""
    return GateSource(features=lambda ids, valid, feats: first_features(kind, module, embeddings, ids, feats),
                      logits=head.small, head_ids=head.head_ids, hidden_size=int(module.config["hidden_size"]))


__all__ = ["eagle3_loss", "feature_layers", "first_features", "heads_gate_source", "heads_loss", "token_loss",
           "train_heads"]
