"""Issue 22 in process: structured outputs (atomd/structured.py) and tool-call parsing
(atomd/api/tools.py), checked against references: `jsonschema` for schema outputs, Python's
`re.fullmatch` for regexes, `json` for tool calls, and a plain-Python bit test for the
vocabulary mask. The built-in default model writes Python, not JSON: every valid output
below is the mask's doing."""
from __future__ import annotations

import json
import logging
import re

import jsonschema
import numpy as np
import pytest
import torch

from atomd.model.default import default_model_dir
from atomd.engine.sampler import Sampler
from atomd import structured
from atomd.structured import GrammarCompiler, apply_bitmask, check
from atomd.api.tool_parsers import HermesParser
from atomd.api.tools import forced_grammar
from contracts.sampling import SamplingParams, StructuredOutputsParams as SO
from scheduler.sequence import Sequence

pytestmark = pytest.mark.unit

VOCAB = 4096
END = [2, 6]
# Nested objects, enums, arrays, required fields; bounded strings, numbers and arrays, so a
# model that never learnt JSON still ends every value (the mask closes them when it must).
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                             "kind": {"enum": ["a", "b", "c"]}},
            "required": ["id", "kind"], "additionalProperties": False}}},
     "required": ["ok", "items"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 5},
]
REGEXES = [r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]",
           r"def [a-z_]{1,12}\((x|y)?\):"]
CHOICES = ["yes", "no", "maybe later", "q\"uoted"]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler((default_model_dir() / "tokenizer.json").read_text(), VOCAB, END)


@pytest.fixture(scope="module")
def llm():
    from atomd import LLM

    torch.set_num_threads(1)
    return LLM(max_model_len=512, num_threads=1)


def allowed_tokens(bits: np.ndarray, vocab: int = VOCAB) -> set[int]:
    """The reference reading of a bitmask row: token t is allowed iff bit t % 32 of word t // 32."""
    words = [int(w) & 0xFFFFFFFF for w in bits]
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


# ------------------------------------------------------------------ the mask

def reference_mask(logits: np.ndarray, rows: list[int], bitmask: np.ndarray) -> np.ndarray:
    """Bit by bit: a token whose bit is 0 in its row's mask gets logit - 1e30 (in float32)."""
    vocab = logits.shape[1]
    want = logits.copy()
    for j, r in enumerate(rows):
        allowed = allowed_tokens(bitmask[j], vocab)
        banned = [t for t in range(vocab) if t not in allowed]
        want[r, banned] = logits[r, banned] - np.float32(1e30)
    return want


@pytest.mark.parametrize("kernel", [True, False], ids=["C kernel", "numpy"])
@pytest.mark.parametrize("vocab", [VOCAB, 4093, 37])
def test_apply_bitmask_equals_the_bit_by_bit_reference(kernel, vocab):
    """The C kernel (atomd/kernels/csrc/bitmask.c) and the numpy fallback, in place and into another
    array, every row or a subset (in any order), a vocabulary that is not a multiple of 32;
    masks with words of all ones, all zeros and mixed."""
    assert structured.bitmask_kernel() is not None, "the C kernel did not build here"
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    for rows in ([0, 1, 2, 3], [1, 3], [3, 0, 2], [2]):
        logits = rng.standard_normal((4, vocab)).astype(np.float32) * 4
        logits[0, :5] = [0.0, -0.0, 1e30, -1e30, np.inf]
        bitmask = rng.integers(-2 ** 31, 2 ** 31, (len(rows), words), dtype=np.int64).astype(np.int32)
        bitmask[0, : words // 3] = -1  # all allowed
        bitmask[-1, words // 3: 2 * words // 3] = 0  # all banned
        want = reference_mask(logits, rows, bitmask)
        out = np.full_like(logits, np.nan)
        before = logits.copy()
        got = apply_bitmask(logits, rows, bitmask, out=out, kernel=kernel)
        assert got is out
        np.testing.assert_array_equal(logits, before)  # out of place: the input is not written
        np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32))  # the same bits
        got = apply_bitmask(logits, rows, bitmask, kernel=kernel)
        assert got is logits
        np.testing.assert_array_equal(logits.view(np.int32), want.view(np.int32))
        if vocab == VOCAB:
            probs = torch.from_numpy(logits[1:]).softmax(dim=-1)  # (row 0 holds an inf)
            assert torch.equal(probs == 0, torch.from_numpy(want[1:] < np.float32(-1e29)))  # exactly 0, as -inf


def test_apply_bitmask_kernel_takes_strided_rows_and_refuses_a_bad_row():
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((3, 100)).astype(np.float32)
    logits = wide[:, :70]  # rows 100 floats apart, 70 tokens
    bitmask = rng.integers(-2 ** 31, 2 ** 31, (2, 3), dtype=np.int64).astype(np.int32)
    want = reference_mask(np.ascontiguousarray(logits), [2, 0], bitmask)
    out = np.empty((3, 70), dtype=np.float32)
    apply_bitmask(logits, [2, 0], bitmask, out=out, kernel=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(wide[:, :70], logits)
    with pytest.raises(ValueError, match="out of range"):
        apply_bitmask(np.zeros((2, 64), np.float32), [5], np.zeros((1, 2), np.int32), kernel=True)


def test_bitmask_kernel_falls_back_to_numpy_without_a_compiler_or_when_switched_off(
        fresh_kernels, monkeypatch, caplog, compiler):
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="atomd.structured"):
        assert structured.bitmask_kernel() is None
    assert "no C compiler (no-such-compiler): grammar masks are applied by numpy" in caplog.text
    logits = np.random.default_rng(4).standard_normal((2, VOCAB)).astype(np.float32)
    bitmask = np.random.default_rng(5).integers(-2 ** 31, 2 ** 31, (1, VOCAB // 32), dtype=np.int64).astype(np.int32)
    want = reference_mask(logits, [1], bitmask)
    np.testing.assert_array_equal(apply_bitmask(logits.copy(), [1], bitmask), want)  # the numpy path
    with pytest.raises(ValueError, match="did not build"):
        apply_bitmask(logits.copy(), [1], bitmask, kernel=True)
    # the sampler too: the same tokens through either path
    monkeypatch.delenv("CC")
    structured.bitmask_kernel.cache_clear()
    assert structured.bitmask_kernel() is not None
    through_c = sample_constrained_rows(compiler)
    monkeypatch.setenv(structured.KERNEL_ENV, "0")
    structured.bitmask_kernel.cache_clear()
    assert structured.bitmask_kernel() is None
    assert sample_constrained_rows(compiler) == through_c
    assert len(list((fresh_kernels / "kernels").glob("bitmask-*.so"))) == 1  # built once, cached


def sample_constrained_rows(compiler) -> list[list[int]]:
    """30 steps of 5 rows (4 constrained: a regex, a schema, a choice, a regex row sampled
    twice for one forking sequence; 1 free), the sampled tokens and their logprobs."""
    rng = np.random.default_rng(6)
    kinds = [SO(regex=REGEXES[0]), SO(json=SCHEMAS[1]), None, SO(choice=CHOICES), SO(regex=REGEXES[1])]
    seqs = [seq_of([10 + i, 20 + i], temperature=1.0, seed=100 + i, logprobs=2, structured_outputs=so)
            for i, so in enumerate(kinds)]
    sampler = Sampler(0, END, compiler)
    out = []
    for _ in range(30):
        live = [s for s in seqs if not (set(s.token_ids[2:]) & set(END))]
        if not live:
            break
        logits = torch.from_numpy(rng.standard_normal((len(live) + 1, VOCAB)).astype(np.float32) * 3)
        tokens, logprobs = sampler.sample(logits, live + live[:1])
        out.append([tokens, [lp.top for lp in logprobs]])
        for s, t in zip(live, tokens):
            s.token_ids.append(t)
    return out


def test_each_grammar_compiles_once_and_matchers_are_independent(compiler):
    so = SO(regex=r"ab+c")
    misses, hits = compiler.misses, compiler.hits
    a, b = compiler.matcher(so), compiler.matcher(SO(regex=r"ab+c"))
    assert (compiler.misses, compiler.hits) == (misses + 1, hits + 1)
    tok = {c: int(compiler.tokenizer.tokenize_str(c)[-1]) for c in "abc"}
    assert a.advance([tok["a"], tok["b"]])
    ra, rb = compiler.new_bitmask(1)[0], compiler.new_bitmask(1)[0]
    a.fill(ra)
    b.fill(rb)
    assert tok["c"] in allowed_tokens(ra) and tok["c"] not in allowed_tokens(rb)  # b has not moved
    assert not a.advance([tok["a"]])  # "aba" breaks the grammar: only the end tokens remain
    a.fill(ra)
    assert allowed_tokens(ra) == set(END)


@pytest.mark.parametrize("so, needle", [
    (SO(regex="[a-z"), "unclosed character class"),
    (SO(json='{"type": "object"'), "not valid JSON"),
    (SO(json={"type": "objekt"}), "objekt"),
    (SO(json={"$ref": "#/definitions/missing"}), "missing"),
    (SO(grammar='start: "a" | b'), "b"),
])
def test_a_grammar_that_cannot_compile_is_a_value_error(compiler, so, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check(so)
    with pytest.raises(ValueError):
        compiler.compile(so)


# ------------------------------------------------------------------ the sampler

def seq_of(prompt: list[int], **params) -> Sequence:
    return Sequence(prompt, SamplingParams(max_tokens=64, **params))


def test_constrained_and_free_rows_share_a_step_and_free_rows_are_unchanged(compiler):
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.standard_normal((6, VOCAB)).astype(np.float32) * 3)
    structured = SO(regex=REGEXES[0])
    kinds = [None, structured, None, structured, None, SO(choice=CHOICES)]
    seqs = [seq_of([10 + i, 20 + i], temperature=1.0, seed=100 + i, structured_outputs=so)
            for i, so in enumerate(kinds)]
    before = logits.clone()
    tokens, _ = Sampler(0, END, compiler).sample(logits, seqs)
    assert torch.equal(logits, before)  # the caller's logits are not written
    free = [i for i, so in enumerate(kinds) if so is None]
    alone, _ = Sampler(0, END, compiler).sample(logits[free], [seqs[i] for i in free])
    assert [tokens[i] for i in free] == alone
    for i, so in enumerate(kinds):
        if so is not None:
            row = compiler.new_bitmask(1)[0]
            compiler.matcher(so).fill(row)
            assert tokens[i] in allowed_tokens(row)


def test_the_matcher_takes_every_accepted_token_forks_and_drafts_included(compiler):
    """A row sampled for a sequence that later appended tokens (its own, a fork's first,
    P's T0) is masked at its new state; `extra` rows at the state after the drafts."""
    sampler = Sampler(0, END, compiler)
    seq = seq_of([5, 6, 7], temperature=0.0, structured_outputs=SO(choice=["abc", "abd"]))
    flat = torch.zeros(1, VOCAB)
    first, _ = sampler.sample(flat, [seq])
    seq.token_ids.append(first[0])  # accepted, as the scheduler appends it
    text = compiler.tokenizer.decode_str([first[0]])
    assert "abc".startswith(text)
    second, _ = sampler.sample(flat, [seq])
    assert compiler.tokenizer.decode_str([first[0], second[0]]) in ("abc", "abd", "ab")
    seq2 = seq_of([5, 6, 7], temperature=0.0, structured_outputs=SO(choice=["abc", "abd"]))
    a, ab = compiler.tokenizer.tokenize_str("a")[-1], compiler.tokenizer.tokenize_str("ab")
    got, _ = sampler.sample(torch.zeros(2, VOCAB), [seq2, seq2], extra=[[], [a]])
    assert compiler.tokenizer.decode_str([got[0]]) in ("a", "ab", "abc", "abd")
    assert compiler.tokenizer.decode_str([a, got[1]]) in ("ab", "abc", "abd")
    bad, _ = sampler.sample(torch.zeros(1, VOCAB), [seq2], extra=[[int(ab[-1]), int(ab[-1])]])
    assert bad[0] in END  # drafts that break the grammar: only the end tokens


# ------------------------------------------------------------------ the engine, the built-in model

def completions(llm, prompt: str, sps: list[SamplingParams]):
    return [o.outputs for o in llm.generate([prompt] * len(sps), sps, use_tqdm=False)]


def test_schema_outputs_validate_for_many_seeded_samples(llm):
    sps = [SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=SO(json=schema))
           for schema in SCHEMAS for seed in range(10)]
    outs = completions(llm, "Write a JSON record:\n", sps)
    for sp, (out,) in zip(sps, outs):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), sp.structured_outputs.json)
    assert len({o[0].text for o in outs}) > len(outs) // 2  # sampled, not one answer


def test_regex_choice_json_object_and_grammar_outputs(llm):
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured_outputs=SO(regex=r))
           for r in REGEXES for s in range(6)]
    sps += [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured_outputs=SO(choice=CHOICES))
            for s in range(6)]
    lark = 'start: "x = " NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'
    sps += [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=SO(grammar=lark))
            for s in range(4)]
    sps += [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=SO(json_object=True))
            for s in range(6)]
    for sp, (out,) in zip(sps, completions(llm, "import re\n", sps)):
        so = sp.structured_outputs
        if so.regex is not None:
            assert re.fullmatch(so.regex, out.text), out.text
        elif so.choice is not None:
            assert out.text in CHOICES
        elif so.grammar is not None:
            assert re.fullmatch(r"x = [0-9]{1,3}(,[0-9]{1,3})*", out.text) or out.finish_reason == "length", out.text
        elif out.finish_reason == "stop":  # any object: only its length is unbounded
            assert isinstance(json.loads(out.text), dict), out.text


def test_forked_choices_each_follow_the_grammar_and_free_requests_are_unchanged(llm):
    schema = SCHEMAS[1]
    forked = SamplingParams(temperature=1.0, seed=7, max_tokens=200, n=4, structured_outputs=SO(json=schema))
    free = [SamplingParams(temperature=1.0, seed=s, max_tokens=24) for s in range(3)]
    free_alone = [o[0].token_ids for o in completions(llm, "def main():\n", free)]
    prompts = ["Write a JSON record:\n"] + ["def main():\n"] * 3
    outs = llm.generate(prompts, [forked] + free, use_tqdm=False)
    choices = outs[0].outputs
    assert [c.index for c in choices] == [0, 1, 2, 3] and len({c.text for c in choices}) > 1
    for c in choices:
        jsonschema.validate(json.loads(c.text), schema)
    assert [o.outputs[0].token_ids for o in outs[1:]] == free_alone


def test_a_bad_grammar_is_refused_on_arrival(llm):
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.engine.add_request("bad-grammar", [1, 2, 3], SamplingParams(structured_outputs=SO(regex="(")))
    assert not llm.engine.has_unfinished_requests()


# ------------------------------------------------------------------ tool calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


@pytest.mark.parametrize("text, content, names", [
    (CALL, None, ["get_weather"]),
    ("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"), "Let me look.", ["get_weather"] * 2),
    ("no calls <tool_ here", "no calls <tool_ here", []),
    ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ("  a <tool_call>\n{\"name\": \"f\", \"arguments\": \"{}\"}\n</tool_call>  b  ", "a   b", ["f"]),
    ("cut off <tool_call>\n{\"name\": ", "cut off <tool_call>\n{\"name\":", []),
])
def test_hermes_parser_whole_and_streamed_agree(text, content, names):
    whole_content, calls = HermesParser.parse(text)
    assert whole_content == content and [c["function"]["name"] for c in calls] == names
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict) and c["type"] == "function"
    for step in (1, 3, 7):  # any split of the text streams the same content and calls
        parser, streamed, streamed_calls = HermesParser(), "", []
        for i in range(0, len(text), step):
            part, got = parser.stream(text[i:i + step])
            streamed, streamed_calls = streamed + part, streamed_calls + got
        streamed += parser.finish()[0]
        assert (streamed or None) == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_forced_tool_calls_always_parse_and_validate(llm):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    other = {"type": "object", "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["q"], "additionalProperties": False}
    one = SO(grammar=forced_grammar([("get_weather", params)], several=False))
    any_of = SO(grammar=forced_grammar([("get_weather", params), ("search", other)], several=False))
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=so)
           for so in (one, any_of) for s in range(5)]
    seen = set()
    for sp, (out,) in zip(sps, completions(llm, "<|bos|><|user|>\nweather?<|end|>\n<|assistant|>\n", sps)):
        content, calls = HermesParser.parse(out.text)
        assert out.finish_reason == "stop" and content is None and len(calls) == 1, out.text
        fn = calls[0]["function"]
        seen.add(fn["name"])
        jsonschema.validate(json.loads(fn["arguments"]), params if fn["name"] == "get_weather" else other)
        if sp.structured_outputs is one:
            assert fn["name"] == "get_weather"
    assert "get_weather" in seen


def test_speculative_drafts_are_checked_against_the_mask(llm):
    """With n-gram drafts (verified rows sample under the mask after the drafts before
    them) the outputs equal those without speculation, greedy and seeded alike."""
    from atomd import LLM

    spec = LLM(max_model_len=512, num_threads=1, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 8}
    sps = [SamplingParams(temperature=t, seed=s, max_tokens=120, structured_outputs=so)
           for so in (SO(json=schema), SO(regex=r"(ab|cd){2,9}")) for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    prompt = "x = [1, 2, 3]\nx = [1, 2, 3]\n"
    want = [o[0].text for o in completions(llm, prompt, sps)]
    assert [o[0].text for o in completions(spec, prompt, sps)] == want
    accepted = spec.engine.stats().get("spec_decode_num_accepted_tokens")
    assert accepted is None or accepted > 0  # drafts were verified and taken
    for sp, text in zip(sps, want):
        so = sp.structured_outputs
        assert re.fullmatch(so.regex, text) if so.regex else jsonschema.validate(json.loads(text), schema) is None
