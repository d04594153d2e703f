"""Generate text from a training checkpoint or a Hugging Face Llama folder, in one plain process.

PATH is a checkpoint (a step_N folder under {dump_dir}/checkpoints, of any parallel layout) or a Hugging
Face folder (config.json, safetensors, tokenizer files); its own tokenizer encodes the prompt (with bos
first where the tokenizer's models expect one) and decodes the completion. The model runs on one GPU
in bf16 when CUDA is available, else on the CPU in fp32, with a KV cache (model/kv_cache.py).
Temperature 0 is greedy; otherwise top-p sampling from a generator seeded with --seed, so a run is
reproducible. Generation stops after --max-new-tokens, or at the tokenizer's eos or another eos id the
model's folder declares (an instruct model's end of turn: model_folder.stop_ids).

Only the completion (the new text, without the eos) goes to stdout, with no newline added, so it can be
piped; errors are one line on stderr, with exit code 2. The text of a special token in the prompt is text,
as in training data (stderr notes it), unless --special-tokens makes it the token, as chat templates mean it.

    python scripts/generate.py PATH --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S]
                               [--special-tokens]
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
from collections.abc import Collection  # noqa: E402

import torch  # noqa: E402

from model.generate import Sampling, generate  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from parallel.errors import ConfigError  # noqa: E402
from trainer.checkpoint.model_folder import load_model, stop_ids  # noqa: E402
from trainer.data.tokenizer import Tokenizer, encode_with_special_tokens  # noqa: E402

DEFAULT_MAX_NEW_TOKENS = 64


def prompt_ids(tokenizer: Tokenizer, prompt: str, special_tokens: bool = False) -> list[int]:
    """The prompt's ids, after bos where the tokenizer's models start a text with it (Llama 3's do). With
    `special_tokens`, the text of a special token is that token (a chat template's `<|eot_id|>`), and a
    prompt that spells its own bos first gets no second one."""
    ids = encode_with_special_tokens(tokenizer, prompt) if special_tokens else tokenizer.encode(prompt)
    # Only a special token's text can give the bos id (encode reads it as text).
    return ([tokenizer.bos_id] if tokenizer.adds_bos and ids[:1] != [tokenizer.bos_id] else []) + ids


def spelled_special_token(tokenizer: Tokenizer, prompt: str) -> str | None:
    """The first special token's text the prompt spells (read as text without --special-tokens)."""
    return next((name for name in tokenizer.special_tokens if name in prompt), None)


def generate_ids(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 sampling: Sampling = Sampling(), special_tokens: bool = False,
                 stops: Collection[int] | None = None) -> list[int]:
    """The ids generated after `prompt`, the stop id included where generation stopped at one (`stops`:
    model_folder.stop_ids; None: the tokenizer's eos)."""
    ids = prompt_ids(tokenizer, prompt, special_tokens)
    if not ids:
        raise ConfigError("--prompt is empty and the tokenizer starts no text with bos: there is nothing to continue")
    stops = [tokenizer.eos_id] if stops is None else stops
    return generate(model, ids, max_new_tokens, stops, sampling, tokenizer.vocab_size)


def completion(tokenizer: Tokenizer, prompt: list[int], ids: list[int], stops: Collection[int] | None = None) -> str:
    """The text generated ids add to the prompt's, without the stop id that ended them. Decoded after the
    prompt, not alone: a decoder that drops a text's leading space (sentencepiece's, Llama 2's and
    Mistral's tokenizer.json) would print "Paris" for the ids of " Paris"."""
    stops = [tokenizer.eos_id] if stops is None else stops
    ids = ids[:-1] if ids and ids[-1] in stops else ids
    before, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + ids)
    return whole[len(before):] if whole.startswith(before) else tokenizer.decode(ids)


def _sampling(opts: argparse.Namespace) -> Sampling:
    """The options checked before the model is read: a bad value is one error line at once."""
    if opts.max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens={opts.max_new_tokens} must be 0 or more")
    try:
        return Sampling(opts.temperature, opts.top_p, opts.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, metavar="PATH",
                        help="a checkpoint (step_N folder) or a Hugging Face model folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (the default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample among the most likely tokens that together hold probability P")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="of the sampling generator")
    parser.add_argument("--special-tokens", action="store_true",
                        help="read the text of a special token in the prompt as that token (a chat template's "
                             "<|start_header_id|>, <|eot_id|>); without it, such text is text, as in training data")
    opts = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    try:
        sampling = _sampling(opts)
        model, tokenizer = load_model(opts.path, torch.device("cuda" if cuda else "cpu"),
                                      torch.bfloat16 if cuda else torch.float32)
        spelled = None if opts.special_tokens else spelled_special_token(tokenizer, opts.prompt)
        if spelled:
            print(f"note: the prompt spells {spelled}, read as text; --special-tokens reads it as the token",
                  file=sys.stderr, flush=True)
        stops = stop_ids(opts.path, tokenizer)
        ids = generate_ids(model, tokenizer, opts.prompt, opts.max_new_tokens, sampling, opts.special_tokens, stops)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    text = completion(tokenizer, prompt_ids(tokenizer, opts.prompt, opts.special_tokens), ids, stops)
    sys.stdout.buffer.write(text.encode())  # UTF-8 whatever the terminal's locale
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
