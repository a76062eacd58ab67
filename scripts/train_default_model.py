#!/usr/bin/env python
"""Train atomd's built-in default model: a tiny Llama on the Python standard library.

Every machine with Python has the corpus, so the checkpoint is reproducible anywhere:
a byte-level BPE tokenizer and a few-million-parameter `LlamaForCausalLM` (the Hugging
Face reference implementation, so the checkpoint is HF format by construction), trained
on CPU from a seed with a fixed data order. Besides raw source files the model sees
chat-formatted pairs (a docstring asked for, the function given back), so that chat
requests answer with code and end their turn with <|end|>.

    .venv/bin/python scripts/train_default_model.py --steps 900 --max-minutes 75 --seed 0

Training is never run by tests or CI; the output is committed under
atomd/model/default_checkpoint/.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import pathlib
import random
import sys
import sysconfig
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers: stay on one core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from atomd.model.default import HELD_OUT_FILES, write_manifest  # noqa: E402

BOS, EOS, PAD, END = "<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", END]
# HF-style template: one marker per role, every turn closed by <|end|>; the generation
# prompt opens the assistant turn. Rendering starts with BOS, so encode it without
# adding special tokens again.
# Without tools a turn is `<|role|>\ncontent<|end|>\n`. With `tools` (OpenAI's tool dicts, as
# transformers passes them) a system turn lists them and asks for Hermes-style calls,
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (atomd/api/tools.py parses them);
# an assistant turn's `tool_calls` are rendered the same way.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call functions. Their signatures, one per line, in <tools></tools>:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\n\nTo call a function, reply with:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|' + message['role'] + '|>\n' }}{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% if not loop.first or message['content'] %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n' }}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '\n</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Test suites, and data dressed as code (codec tables, pydoc's topic prose, the HTML
# entity table) that would otherwise dominate what a tiny model learns to write.
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"}
EXCLUDED_FILES = {"html/entities.py"}


def corpus_files(stdlib: pathlib.Path) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """Sorted stdlib sources minus the exclusions, split into (train, held out)."""
    files = sorted(
        f for f in stdlib.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(f.relative_to(stdlib).parts[:-1])
        and f.relative_to(stdlib).as_posix() not in EXCLUDED_FILES
    )
    held = [f for f in files if f.relative_to(stdlib).as_posix() in HELD_OUT_FILES]
    return [f for f in files if f not in held], held


def read_source(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def chat_examples(texts: list[str]) -> list[list[dict]]:
    """(user asks for a docstring's summary, assistant answers with the function) pairs."""
    examples = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(text, node)
            if not doc or not source or len(source) > 1500:
                continue
            summary = doc.strip().splitlines()[0]
            examples.append([
                {"role": "user", "content": f"Write a Python function: {summary}"},
                {"role": "assistant", "content": source},
            ])
    return examples


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


def render_chat(messages: list[dict]) -> str:
    import jinja2

    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    return template.render(messages=messages, bos_token=BOS, eos_token=EOS,
                           add_generation_prompt=False)


def token_stream(tok: Tokenizer, texts: list[str], chats: list[list[dict]], seed: int) -> torch.Tensor:
    """All documents, each BOS ... EOS (chats end their turns with <|end|>), shuffled by seed."""
    eos = tok.token_to_id(EOS)
    docs = [ids + [eos] for ids in (e.ids for e in tok.encode_batch(texts))]
    rendered = [render_chat(m) for m in chats]
    docs += [e.ids for e in tok.encode_batch(rendered, add_special_tokens=False)]
    random.Random(seed).shuffle(docs)
    return torch.tensor([t for d in docs for t in d], dtype=torch.long)


def stop_token_ids(tok: Tokenizer) -> list[int]:
    """End of document and end of turn: generation stops at either (as Llama 3 lists several)."""
    return [tok.token_to_id(EOS), tok.token_to_id(END)]


def build_model(tok: Tokenizer, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=stop_token_ids(tok),
        pad_token_id=tok.token_to_id(PAD),
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def mean_cross_entropy(model, stream: torch.Tensor, seq_len: int) -> float:
    """Mean next-token cross-entropy over consecutive windows of a token stream."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, seq_len):
        window = stream[start:start + seq_len + 1]
        if len(window) < 2:
            break
        out = model(window[None, :-1], labels=window[None, :-1])
        n = len(window) - 2
        total, count = total + out.loss.item() * n, count + n
    model.train()
    return total / count


def train(model, stream: torch.Tensor, held: torch.Tensor, args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    start, tokens, ema, step = time.monotonic(), 0, None, 0
    for step in range(args.steps):
        if time.monotonic() - start > args.max_minutes * 60:
            print(f"wall-time cap of {args.max_minutes} min reached at step {step}", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        offsets = torch.randint(0, len(stream) - args.seq_len, (args.batch,), generator=gen)
        batch = torch.stack([stream[o:o + args.seq_len] for o in offsets.tolist()])
        loss = model(batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.monotonic() - start
            print(f"step {step:5d}  loss {loss.item():.4f}  ema {ema:.4f}  lr {lr_at(step, args):.2e}  "
                  f"{tokens / elapsed:,.0f} tok/s  {elapsed / 60:.1f} min", flush=True)
    else:
        step = args.steps
    return {"steps": step, "final_loss_ema": round(ema, 4), "train_tokens": tokens,
            "train_minutes": round((time.monotonic() - start) / 60, 2),
            "held_out_cross_entropy": round(mean_cross_entropy(model, held, args.seq_len), 4)}


def save(out: pathlib.Path, model, tok: Tokenizer, info: dict, command: str) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    model.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config.setdefault("rope_theta", 10000.0)  # transformers < 5 and most loaders read it here
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=tok.token_to_id(BOS), eos_token_id=stop_token_ids(tok),
                     pad_token_id=tok.token_to_id(PAD), do_sample=False).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": PAD, "additional_special_tokens": SPECIAL_TOKENS[3:],
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(info, command))
    write_manifest(out)


def model_card(info: dict, command: str) -> str:
    return f"""# atomd default model

A tiny Llama-architecture language model (`LlamaForCausalLM`, {info['parameters']:,} parameters,
float32) with a byte-level BPE tokenizer of {info['vocab_size']} tokens, trained from scratch on the
Python standard library's own source files (Python {info['python']}, test suites, codec tables and pydoc topics excluded) plus
chat pairs built from its docstrings. It writes plausible Python, nothing more: it exists so that
atomd serves recognisable text offline, with no download.

- architecture: hidden {info['hidden']}, {info['layers']} layers, {info['heads']} heads / {info['kv_heads']} KV heads (GQA),
  intermediate {info['intermediate']}, untied embeddings, RoPE theta 10000, max positions 2048
- data: {info['train_files']} source files, {info['chat_examples']} chat pairs, {info['stream_tokens']:,} tokens;
  held out: {', '.join(info['held_out_files'])}
- training: seed {info['seed']}, {info['steps']} steps of {info['batch']} x {info['seq_len']} tokens
  ({info['train_tokens']:,} tokens), AdamW lr {info['lr']}, {info['train_minutes']} min on one CPU thread
- final training loss (EMA): {info['final_loss_ema']}; held-out cross-entropy {info['held_out_cross_entropy']}
  nats/token (log V = {math.log(info['vocab_size']):.3f})
- chat: `<|system|>`, `<|user|>`, `<|assistant|>` open a turn, `<|end|>` closes it; generation stops at
  `<|eos|>` or `<|end|>` (eos_token_id in config.json and generation_config.json)

Reproduce (from the repository root):

    {command}
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=REPO / "atomd/model/default_checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=900, help="optimizer steps (the LR schedule spans them)")
    p.add_argument("--max-minutes", type=float, default=20.0, help="wall-time cap; stops early if hit")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    train_files, held_files = corpus_files(stdlib)
    if len(held_files) != len(HELD_OUT_FILES):
        raise SystemExit(f"held-out files missing from {stdlib}: {HELD_OUT_FILES}")
    texts = [read_source(f) for f in train_files]
    t0 = time.monotonic()
    tok = train_tokenizer(texts, args.vocab_size)
    chats = chat_examples(texts)
    stream = token_stream(tok, texts, chats, args.seed)
    eos = tok.token_to_id(EOS)
    held = torch.tensor([t for f in held_files for t in tok.encode(read_source(f)).ids + [eos]])
    print(f"tokenizer + data: {time.monotonic() - t0:.0f} s, {len(train_files)} files, {len(chats)} chats, "
          f"{len(stream):,} train tokens, {len(held):,} held-out tokens", flush=True)
    model = build_model(tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    result = train(model, stream, held, args)
    info = {**{k: v for k, v in vars(args).items() if k not in ("out", "log_every")},
            **result, "parameters": n_params, "python": sys.version.split()[0],
            "train_files": len(train_files), "chat_examples": len(chats), "stream_tokens": len(stream),
            "held_out_files": list(HELD_OUT_FILES)}
    command = "python scripts/train_default_model.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    save(args.out, model, tok, info, command.strip())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
