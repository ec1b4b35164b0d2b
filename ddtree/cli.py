"""`ddtree` command line."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from .config import GenerateConfig


def _generate(args: argparse.Namespace) -> int:
    try:
        config = GenerateConfig(
            model=args.model,
            drafter=args.drafter,
            budget=args.budget,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop=args.stop or [],
            dtype=args.dtype,
        )
    except ValidationError as err:
        for e in err.errors():
            print(f"ddtree generate: --{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}", file=sys.stderr)
        return 2
    from .engine import Engine  # heavy imports after the arguments are known to be valid

    engine = Engine.from_config(config)
    for prompt, result in zip(args.prompt, engine.generate(args.prompt)):
        seconds = result.prefill_s + result.decode_s
        record = {
            "prompt": prompt,
            "text": result.text,
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "budget": config.budget,
            "rounds": len(result.rounds),
            "tau": round(result.tau, 3),
            "tokens_per_s": round(len(result.tokens) / seconds, 2) if seconds else None,
            "prefill_s": round(result.prefill_s, 4),
            "decode_s": round(result.decode_s, 4),
            "round_time_s": {
                phase: round(sum(getattr(r, f"{phase}_s") for r in result.rounds), 4)
                for phase in ("draft", "tree", "verify", "commit")
            },
        }
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(result.text, flush=True)
            print(
                f"[{len(result.tokens)} tokens, {record['rounds']} rounds, tau {record['tau']}, "
                f"{record['tokens_per_s']} tokens/s, budget {config.budget}]",
                file=sys.stderr,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for chat prompts, in-process")
    gen.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    gen.add_argument("--model", help="target: Hugging Face checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", help="DFlash drafter checkpoint dir (default: seeded untrained drafter)")
    gen.add_argument("--budget", default="16", help="tree budget: 0 = plain decoding, 'chain' = DFlash, N = DDTree")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    gen.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
