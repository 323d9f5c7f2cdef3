"""Command-line options that several commands share (``generate``, ``bench``, ``serve``)."""

from __future__ import annotations

import argparse

from .errors import ConfigError


def parse_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip(), value


def parse_drafter_option(text: str) -> tuple[str, str, str]:
    """``DRAFTER:KEY=VALUE`` (an option for one of several drafters) as ``(drafter, key, value)``."""
    drafter, sep, option = text.partition(":")
    if not sep or not drafter.strip():
        raise argparse.ArgumentTypeError(f"expected DRAFTER:KEY=VALUE (for example draft-model:model=DIR), got {text!r}")
    return (drafter.strip(), *parse_option(option))


def decoder_args(p: argparse.ArgumentParser) -> None:
    """The target and its drafter: what every command that builds a decoder takes."""
    p.add_argument("--target", default=None,
                   help="hub id, local folder or .gguf file (default: SmolLM2-135M-Instruct, offline); a speculators "
                        "checkpoint loads its verifier, drafted by the checkpoint (docs/coming-from-vllm.md)")
    p.add_argument("--drafter", default=None, help="drafter name (see `specdraft drafters`; default: ngram)")
    p.add_argument("--drafter-option", dest="drafter_options", action="append", type=parse_option, default=[],
                   metavar="KEY=VALUE", help="an option for the drafter (repeatable)")
    p.add_argument("--spec-length", type=int, default=None, metavar="K",
                   help="most tokens drafted per round, 1 to 16 (default: 4)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative config instead of --drafter, --spec-length and --drafter-option: "
                        "'{\"method\": \"eagle3\", \"model\": \"...\", \"num_speculative_tokens\": 3}' "
                        "(docs/coming-from-vllm.md)")
    sglang_args(p)
    p.add_argument("--fixed-spec-length", action="store_true",
                   help="always draft K tokens instead of adapting to acceptance and verify cost")


def device_args(p: argparse.ArgumentParser) -> None:
    """Where and how the target runs: dtype, device, compile, quantize."""
    p.add_argument("--dtype", default=None,
                   help="bfloat16 (the default on GPUs and on CPUs with native bfloat16 products, avx512_bf16 or "
                        "AMX, or with AVX-512 or AVX2), float32 (the default on other CPUs), float16, float64")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    runner_args(p)


def runner_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the target, one graph per pass width (CUDA graphs on a GPU); "
                        "default: on with CUDA, off on a CPU (see docs/benchmarks.md)")
    p.add_argument("--quantize", choices=["int8", "int4", "gguf"], default=None,
                   help="weight-only int8 (per channel) or int4 (per group of 32; CPU only) target, or gguf: a GGUF "
                        "target's own Q4_0/Q4_1/Q8_0 blocks as they are (CPU only; the default model's 98 MB "
                        "instead of 269 MB of bfloat16 a step): the quantized model is the one decoded, exactly")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the target over N ranks (processes started here; gloo on CPU, NCCL on N GPUs; "
                        "or torchrun's ranks): see docs/tensor-parallel.md (default: 1)")


def structured_args(p: argparse.ArgumentParser) -> None:
    """Structured output (``generate``): the answer matches a JSON schema or a regular expression."""
    p.add_argument("--response-format", default=None, metavar="json_object|FILE",
                   help="json_object: the answer is a JSON object; FILE: an OpenAI response_format in JSON "
                        "({\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}); "
                        "exact under speculation; needs pip install 'specdraft[structured]'")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the answer is JSON matching the JSON schema in FILE")
    p.add_argument("--regex", default=None, metavar="R", help="the answer matches the regular expression R")


def sglang_args(p: argparse.ArgumentParser) -> None:
    """SGLang's speculative flags, in place of ``--drafter`` (``--drafters``), ``--spec-length`` and
    ``--drafter-option`` (:func:`specdraft.speculative_config.read_sglang_flags`)."""
    p.add_argument("--speculative-algorithm", default=None, metavar="NAME",
                   help="SGLang's flags in place of the drafter's: EAGLE, EAGLE3 or STANDALONE (docs/coming-from-vllm.md)")
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None, metavar="MODEL",
                   help="SGLang's: the heads (EAGLE, EAGLE3) or draft model (STANDALONE), a folder or hub id")
    p.add_argument("--speculative-num-steps", type=int, default=None, metavar="N", help="SGLang's: as --spec-length")
    p.add_argument("--speculative-eagle-topk", type=int, default=None, metavar="K",
                   help="SGLang's: K > 1 drafts a tree of K children per node (tree_width=K); 1: a chain")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, metavar="N",
                   help="SGLang's: tokens a round verifies (a tree: tree_budget=N-1)")


def _sglang(args: argparse.Namespace, names: tuple[str, ...]):
    """The drafter SGLang's flags ask for (None: none given); ConfigError when they come with
    any of ``names`` (the config, the drafter, the draft length and the options)."""
    from .speculative_config import SGLANG_FLAGS, read_sglang_flags

    choice = read_sglang_flags(**{name: getattr(args, name, None) for name in SGLANG_FLAGS})
    if choice is None:
        return None
    flag = next(SGLANG_FLAGS[name] for name in SGLANG_FLAGS if getattr(args, name) is not None)
    values = (args.speculative_config, getattr(args, "drafters", getattr(args, "drafter", None)), args.spec_length,
              args.drafter_options or None)
    given = [name for name, value in zip(names, values) if value is not None]
    if given:
        raise ConfigError(f"{flag}: SGLang's flags name the drafter and its settings; give them or {given[0]}, "
                          "not both", param="speculative_config")
    return choice


def _checkpoint(args: argparse.Namespace, sglang):
    """The speculators checkpoint given as ``--target`` (None: it is not one); ConfigError when
    SGLang's flags come with it."""
    from .speculators import read_checkpoint

    checkpoint = read_checkpoint(args.target)
    if checkpoint is not None and sglang is not None:
        raise ConfigError(f"--speculative-algorithm: the model {checkpoint.source!r} is a speculators checkpoint, "
                          f"which names the drafter ({checkpoint.drafter}, its own heads); leave SGLang's flags "
                          f"out, or give the target {checkpoint.verifier!r} as the model with them",
                          param="speculative_config")
    return checkpoint


def resolve_drafter(args: argparse.Namespace) -> None:
    """``args.drafter``, ``args.spec_length`` and ``args.drafter_options`` as asked for by a
    speculators checkpoint given as ``--target`` (which becomes its verifier), by
    ``--speculative-config``, by SGLang's flags or by those flags (their defaults filled in);
    ConfigError for two of them."""
    from .speculative_config import CLI_NAMES, choose_drafter

    sglang = _sglang(args, CLI_NAMES)
    checkpoint = _checkpoint(args, sglang)
    if checkpoint is not None:
        choice = checkpoint.choose(args.drafter, args.spec_length, dict(args.drafter_options) or None,
                                   args.speculative_config, CLI_NAMES)
        args.target = checkpoint.verifier
    elif sglang is not None:
        choice = choose_drafter(sglang.drafter, sglang.spec_length, sglang.options)
    else:
        choice = choose_drafter(args.drafter, args.spec_length, dict(args.drafter_options) or None,
                                args.speculative_config, CLI_NAMES)
    args.drafter, args.spec_length, args.drafter_options = choice.drafter, choice.spec_length, list(choice.options.items())


def speculative_config_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help=f"vLLM's speculative config: {what} (docs/coming-from-vllm.md)")
    sglang_args(p)


def resolve_methods(args: argparse.Namespace, default_drafters: str, always: str = "") -> None:
    """``bench`` and ``bench-serve``: ``args.drafters``, ``args.spec_length`` and
    ``args.drafter_options`` as a speculators checkpoint given as ``--target`` (which becomes its
    verifier), ``--speculative-config`` or SGLang's flags ask for (that drafter, after ``always``),
    or as given (their defaults filled in); ConfigError when one comes with another or with any of them."""
    from .speculative_config import choose_drafter

    names = ("--speculative-config", "--drafters", "--spec-length", "--drafter-option")
    sglang = _sglang(args, names)
    checkpoint = _checkpoint(args, sglang)
    others = []  # options for drafters a checkpoint's does not run (refused by the command, naming them)
    if checkpoint is not None:
        others = [option for option in args.drafter_options if option[0] != checkpoint.drafter]
        choice = checkpoint.choose(args.drafters, args.spec_length,
                                   {key: value for drafter, key, value in args.drafter_options
                                    if drafter == checkpoint.drafter} or None, args.speculative_config, names)
        args.target = checkpoint.verifier
    elif sglang is not None:
        choice = choose_drafter(sglang.drafter, sglang.spec_length, sglang.options)
    elif args.speculative_config is not None:
        choice = choose_drafter(args.drafters, args.spec_length, args.drafter_options or None, args.speculative_config,
                                names)
    else:
        args.drafters = default_drafters if args.drafters is None else args.drafters
        args.spec_length = 4 if args.spec_length is None else args.spec_length
        return
    args.drafters = ",".join(name for name in (always, choice.drafter) if name)
    args.spec_length = choice.spec_length
    args.drafter_options = [(choice.drafter, key, value) for key, value in choice.options.items()] + others
