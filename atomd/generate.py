"""`atomd generate`: offline generation for one or more prompts, printed to stdout."""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from atomd.config import add_engine_args

    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt as one user message in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt instead of the text")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    from atomd.config import EngineConfig
    from atomd.llm import LLM
    from contracts.sampling import SamplingParams

    try:
        config = EngineConfig.from_args(args)
        config.check_model_dir()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
                                stop=args.stop)
    except ValueError as e:
        print(f"atomd generate: error: {e}", file=sys.stderr)
        return 2
    llm = LLM.from_config(config)
    tok = llm.get_tokenizer()
    prompts = [{"prompt": p, "prompt_token_ids": tok.encode_chat([{"role": "user", "content": p}])}
               if args.chat else p for p in args.prompt]
    try:
        outputs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"atomd generate: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        c = out.outputs[0]
        if out.error:
            print(f"atomd generate: error: {out.error}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(c.text)
    return 0
