"""Constrained decoding: the regex engine against Python's re, JSON schema -> regex, token masks on a real 49k
vocabulary, and regex / json_schema / choices through generate() (greedy, sampling, batches, beams, speculation)."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, pipeline

from tinyloop_hf import embedded_model_path
from tinyloop_hf.constraints import ByteDFA, RegexError, SchemaError, schema_to_regex
from tinyloop_hf.constraints.constrained import ConstrainedLogitsProcessor, compiled_constraint

PATTERNS = [
    r'"[^"\\\x00-\x1f]*"',  # a JSON string's characters, without escapes
    r"\d{3}-\d{4}",
    r"(cat|dog)s?",
    r"[A-Z][a-z]+ [^0-9]+",
    r"h.llo",
    r"a{2,3}b*",
    r"(?:ab|c)+\.?",
    r"[\w.]+@x\.io",
]
TEXTS = ["555-1234", "5551234", "cat", "dogs", "cats!", "Hello wörld", "Hello 1", "héllo", "h\nllo", "aa", "aaaa",
         "aabbb", "abcab.", "abc..", "a.b@x.io", "@x.io", "", '"a b"', '"a\nb"', '"a\\b"']  # fmt: skip


@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_engine_agrees_with_python_re(pattern):
    dfa = ByteDFA(pattern)
    for text in TEXTS:
        assert dfa.fullmatch(text.encode()) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize(
    "pattern, problem",
    [("a(b", "'(' without ')'"), ("a)b", "unbalanced"), ("*a", "nothing to repeat"), ("^a", "anchors are implicit"),
     ("a{3,1}", "low <= high"), (r"\bx", "unsupported escape"), ("(?=a)", "lookaround"), ("[z-a]", "bad range"),
     ("a+?", "lazy")],
)  # fmt: skip
def test_bad_patterns_name_the_position_and_problem(pattern, problem):
    with pytest.raises(RegexError, match=re.escape(problem)):
        ByteDFA(pattern)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "score": {"type": ["number", "null"]},
    },
    "required": ["name", "age"],
}


def test_json_schema_regex_accepts_valid_and_rejects_invalid_documents():
    dfa = ByteDFA(schema_to_regex(SCHEMA))
    valid = ['{"name":"Bob","age":42}', '{ "name": "Al", "age": -1, "tags": ["a", "b"] }',
             '{"name":"x","age":0,"tags":[],"score":null}', '{"name":"\\u00e9","age":3,"score":-1.5e3}']  # fmt: skip
    invalid = ['{"name":"Bob"}', '{"age":1,"name":"x"}', '{"name":"Bob","age":042}',
               '{"name":"x","age":1,"tags":["c"]}', '{"name":"123456789","age":1}',
               '{"name":"x","age":1,"tags":["a","a","a"]}']  # fmt: skip
    for text in valid:
        json.loads(text)
        assert dfa.fullmatch(text.encode()), text
    for text in invalid:
        assert not dfa.fullmatch(text.encode()), text


@pytest.mark.parametrize("pattern", [".{1,12}", "[^a]*", r'(a|"|\\)+', "é[àb]+x", r"[\x00-\x21]+", r'(ab|"c)*', "\n"])
def test_a_string_pattern_matches_json_escaped_values_only(pattern):
    """A schema's string ``pattern`` constrains the decoded value; its '"', '\\' and control characters appear escaped,
    so the text stays JSON: the constraint accepts json.dumps(v) exactly when the pattern matches v."""
    dfa = ByteDFA(schema_to_regex({"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}))
    generator = random.Random(0)
    alphabet = ["a", "b", "c", '"', "\\", "\n", "\x01", "é", "à", "x", " "]
    matched = 0
    for _ in range(2000):
        value = "".join(generator.choice(alphabet) for _ in range(generator.randint(0, 6)))
        text = json.dumps({"s": value}, ensure_ascii=False, separators=(",", ":"))
        assert dfa.fullmatch(text.encode()) == bool(re.fullmatch(pattern, value)), (pattern, value)
        matched += dfa.fullmatch(text.encode())
    assert matched > 0
    assert not dfa.fullmatch(b'{"s":"a"b"}') and not dfa.fullmatch(b'{"s":"\n"}'.replace(b"\\n", b"\n"))


@pytest.mark.parametrize(
    "schema, problem",
    [({"type": "object", "$ref": "#/x"}, r"unsupported keyword\(s\) \['\$ref'\]"), ({"type": "tuple"}, "type must be"),
     ("{not json", "not valid JSON"), ({"type": "array"}, "arrays need items"),
     ({"type": "string", "pattern": "[a-z]+", "minLength": 5}, "pattern with minLength / maxLength is not supported")],
)  # fmt: skip
def test_bad_schemas_fail_with_the_keyword(schema, problem):
    with pytest.raises(SchemaError, match=problem):
        schema_to_regex(schema)


@pytest.fixture(scope="module")
def embedded():
    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


PROMPT = "KING. My lord, the answer is"


def _text(tokenizer, output, prompt_length):
    return tokenizer.decode(output[prompt_length:], skip_special_tokens=True)


def test_regex_choices_and_schema_through_generate(embedded):
    model, tokenizer = embedded
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    out = model.generate(ids, max_new_tokens=30, do_sample=False, tokenizer=tokenizer, regex=r" (yes|no), my lord\.")
    assert re.fullmatch(r" (yes|no), my lord\.", _text(tokenizer, out[0], n))
    assert int(out[0, -1]) == tokenizer.eos_token_id  # end-of-sequence once the pattern is complete
    choices = [" Hamlet", " Ophelia", " the King"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False, tokenizer=tokenizer, choices=choices)
    assert _text(tokenizer, out[0], n) in choices
    out = model.generate(ids, max_new_tokens=60, do_sample=False, tokenizer=tokenizer, json_schema=SCHEMA)
    document = json.loads(_text(tokenizer, out[0], n))
    assert isinstance(document["name"], str) and isinstance(document["age"], int)


def test_sampling_batches_beams_and_speculation_stay_inside_the_pattern(embedded):
    model, tokenizer = embedded
    pattern = r" [a-z]+ (and|or) [a-z]+\."
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "HAMLET. I say", "It was the"], return_tensors="pt", padding=True)
    n = batch.input_ids.shape[1]
    torch.manual_seed(0)
    runs = {
        "sample": model.generate(**batch, max_new_tokens=24, do_sample=True, tokenizer=tokenizer, regex=pattern),
        "beams": model.generate(**batch, max_new_tokens=24, num_beams=3, do_sample=False, tokenizer=tokenizer,
                                regex=pattern),
        "speculative": model.generate(**batch, max_new_tokens=24, do_sample=False, tokenizer=tokenizer, regex=pattern,
                                      draft_loops=1, num_draft_tokens=3),
    }  # fmt: skip
    for name, out in runs.items():
        for row in out:
            assert re.fullmatch(pattern, _text(tokenizer, row, n)), (name, _text(tokenizer, row, n))
    plain = model.generate(**batch, max_new_tokens=24, do_sample=False, tokenizer=tokenizer, regex=pattern)
    assert torch.equal(runs["speculative"], plain)  # greedy self-speculation equals plain decoding under a constraint


def test_constraint_from_generation_config_and_pipeline(embedded, tmp_path):
    model, tokenizer = embedded
    model.generation_config.choices = [" yes", " no"]
    try:
        model.save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert reloaded.generation_config.choices == [" yes", " no"]
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        out = reloaded.generate(ids, max_new_tokens=5, do_sample=False)  # the checkpoint's own tokenizer files
        assert _text(tokenizer, out[0], ids.shape[1]) in (" yes", " no")
        assert reloaded._own_tokenizer() is reloaded._own_tokenizer()  # loaded once: the compiled masks are reused
        generator = pipeline("text-generation", model=reloaded, tokenizer=tokenizer)
        text = generator(PROMPT, max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
        assert text in (" yes", " no")
    finally:
        del model.generation_config.choices


@pytest.mark.parametrize(
    "kwargs, problem",
    [(dict(regex="a(b"), "'(' without ')'"), (dict(json_schema={"type": "tuple"}), "type must be"),
     (dict(choices=[]), "choices must be a non-empty list"), (dict(regex="a", choices=["a"]), "set one of")],
)  # fmt: skip
def test_invalid_constraints_fail_when_generate_starts(embedded, kwargs, problem):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match=re.escape(problem)):
        model.generate(tokenizer("x", return_tensors="pt").input_ids, max_new_tokens=2, tokenizer=tokenizer, **kwargs)


def test_masks_cover_exactly_the_tokens_that_keep_the_text_matchable(embedded):
    _, tokenizer = embedded
    pattern = r" (yes|no), my lord\."
    compiled = compiled_constraint(pattern, tokenizer, [tokenizer.eos_token_id], 49152)
    processor = ConstrainedLogitsProcessor(compiled)
    prefix = tokenizer(" yes,", return_tensors="pt").input_ids
    processor.prompt_length = 0
    allowed = processor(prefix, torch.zeros(1, 49152))[0].isfinite().nonzero().squeeze(1).tolist()
    dfa = ByteDFA(pattern)
    state = dfa.walk(dfa.start, b" yes,")
    expected = [i for i, piece in enumerate(compiled.pieces) if piece and dfa.walk(state, piece) != ByteDFA.DEAD]
    assert allowed == sorted(expected) and allowed  # eos is not allowed: " yes," does not match yet


def test_a_cached_state_reuses_its_mask(embedded):
    """Per-token overhead once masks exist is measured by eval/constraint_overhead.py (no timing in unit tests):
    here, a repeated prefix builds no new mask and gives the same result."""
    _, tokenizer = embedded
    compiled = compiled_constraint(r" (yes|no), my lord\.", tokenizer, [tokenizer.eos_token_id], 49152)
    processor = ConstrainedLogitsProcessor(compiled)
    prefix = tokenizer(" no, my", return_tensors="pt").input_ids
    processor.prompt_length = 0
    first = processor(prefix, torch.zeros(1, 49152))
    masks = len(compiled._row_of_state)
    assert torch.equal(processor(prefix, torch.zeros(1, 49152)), first) and len(compiled._row_of_state) == masks


GRAMMAR = 'root ::= " " answer ", my lord."\nanswer ::= "yes" | "no" | "perhaps" | "I know not"'
GRAMMAR_TEXT = re.compile(r" (yes|no|perhaps|I know not), my lord\.")


def test_grammar_through_xgrammar_greedy_sampling_beams_and_speculation(embedded):
    model, tokenizer = embedded
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "HAMLET. I say"], return_tensors="pt", padding=True)
    n = batch.input_ids.shape[1]
    common = dict(max_new_tokens=20, tokenizer=tokenizer, grammar=GRAMMAR)
    torch.manual_seed(0)
    runs = {
        "greedy": model.generate(**batch, do_sample=False, **common),
        "sample": model.generate(**batch, do_sample=True, **common),
        "beams": model.generate(**batch, do_sample=False, num_beams=3, **common),
        "speculative": model.generate(**batch, do_sample=False, draft_loops=1, num_draft_tokens=4, **common),
    }
    for name, out in runs.items():
        for row in out:
            assert GRAMMAR_TEXT.fullmatch(_text(tokenizer, row, n)), (name, _text(tokenizer, row, n))
    assert torch.equal(runs["speculative"], runs["greedy"])


def test_bad_grammar_fails_when_generate_starts(embedded):
    model, tokenizer = embedded
    ids = tokenizer("x", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="grammar does not parse"):
        model.generate(ids, max_new_tokens=2, tokenizer=tokenizer, grammar='root ::= "a" | ')
    with pytest.raises(ValueError, match="set one of regex, json_schema, choices, grammar"):
        model.generate(ids, max_new_tokens=2, tokenizer=tokenizer, grammar=GRAMMAR, regex="a")


def test_special_and_end_tokens_are_never_text(embedded):
    """The embedded tokenizer's chat markers (<|im_start|>, <|im_end|>: added special tokens its special-token map
    does not list) are no pattern bytes, and an end token is never text even where its characters would fit."""
    _, tokenizer = embedded
    marker = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiled = compiled_constraint(r"[a-z_<>|]{10}", tokenizer, [marker], 49152)
    assert compiled.pieces[marker] is None and compiled.pieces[tokenizer.convert_tokens_to_ids("<|im_start|>")] is None
    processor = ConstrainedLogitsProcessor(compiled)
    processor.prompt_length = 0
    allowed = processor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 49152))[0].isfinite()
    assert not allowed[marker] and allowed.any()


def test_a_row_stopped_by_a_stop_string_is_padded_not_failed(embedded):
    """generate() pads a row that stop_strings ended (pad != eos here): the constraint ends it there, and the other
    row stays inside the pattern (regex and grammar)."""
    model, tokenizer = embedded
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "HAMLET. I say"], return_tensors="pt", padding=True)
    n = batch.input_ids.shape[1]
    pad = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert pad != tokenizer.eos_token_id
    common = dict(max_new_tokens=12, do_sample=False, tokenizer=tokenizer, pad_token_id=pad, stop_strings=["no"])
    for constraint in (dict(regex=r" (yes|no), my lord\."), dict(grammar=GRAMMAR)):
        out = model.generate(**batch, **common, **constraint)
        texts = [_text(tokenizer, row, n) for row in out]
        for text in texts:
            assert GRAMMAR_TEXT.fullmatch(text) or "no" in text, (constraint, texts)  # matched, or stopped at "no"


def test_a_model_without_an_end_token_is_refused_when_generate_starts(embedded):
    model, tokenizer = embedded
    ids = tokenizer("x", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="need an end-of-sequence token"):
        model.generate(ids, max_new_tokens=2, tokenizer=tokenizer, regex="a", eos_token_id=[])


def test_a_constraint_passed_to_generate_replaces_the_saved_one(embedded):
    model, tokenizer = embedded
    model.generation_config.regex = r" (yes|no)\."
    try:
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=6, do_sample=False, tokenizer=tokenizer, choices=[" Hamlet"])
        assert _text(tokenizer, out[0], ids.shape[1]) == " Hamlet"
        assert model.generation_config.regex == r" (yes|no)\."  # the saved config is left as it was
    finally:
        del model.generation_config.regex


def test_the_processor_keeps_only_recent_prefixes(embedded):
    """Memory linear in the output length: after 200 steps of 3 rows the processor holds the prefixes of its last
    32-64 calls, and a rolled-back prefix (a rejected draft), recent or not, still gets its state."""
    _, tokenizer = embedded
    compiled = compiled_constraint(r"[a-z ]*", tokenizer, [tokenizer.eos_token_id], 49152)
    processor = ConstrainedLogitsProcessor(compiled)
    processor.prompt_length = 0
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "abc"]
    ids = torch.zeros(3, 0, dtype=torch.long)
    for _ in range(200):
        ids = torch.cat([ids, torch.tensor(letters)[:, None]], dim=1)
        processor(ids, torch.zeros(3, 49152))
    assert len(processor.states) <= 3 * 2 * processor.states.KEEP_CALLS + 1
    for length in (190, 20):  # recent, then long gone: the same masks as a fresh processor gives
        fresh = ConstrainedLogitsProcessor(compiled)
        fresh.prompt_length = 0
        scores = torch.zeros(3, 49152)
        assert torch.equal(processor(ids[:, :length], scores), fresh(ids[:, :length], scores))


@pytest.mark.parametrize(
    "pattern, text, matches",
    [(".", b"\xed\xa0\x80", False), (".", b"\xe0\x80\x80", False), (".", b"\xf4\x90\x80\x80", False),
     (".", b"\xc0\xaf", False), (".", "\U0010ffff".encode(), True), (r"\S+", "café".encode(), True),
     (r"\D+", "日本".encode(), True), (r"\W", "日".encode(), True), (r"[\S]x", "éx".encode(), True),
     (r"[^\S]+", b" \t", True), (r"[^\S]", "日".encode(), False), (r"\w", "é".encode(), False)],
)  # fmt: skip
def test_any_character_is_well_formed_utf8_and_negated_escapes_take_non_ascii(pattern, text, matches):
    assert ByteDFA(pattern).fullmatch(text) == matches


def test_every_valid_character_matches_a_dot():
    dot = ByteDFA(".")
    characters = [chr(c) for c in (*range(0x80, 0x800, 7), *range(0x800, 0xD800, 97), *range(0xE000, 0x10000, 89),
                                   *range(0x10000, 0x110000, 4099), 0x10FFFF)]  # fmt: skip
    assert all(dot.fullmatch(c.encode()) for c in characters)


@pytest.mark.parametrize(
    "schema, problem",
    [({"type": "string", "pattern": "[A-Z"}, r"at \$\.pattern: .*without"), ({"type": "string", "minLength": "3"},
      "minLength must be an integer"), ({"type": "string", "pattern": 5}, "pattern: must be a string"),
     ({"type": "object", "properties": [1]}, "properties must be an object"),
     ({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}, "minItems 3 is above maxItems 1"),
     ({"enum": []}, "enum must be a non-empty list"), ({"anyOf": []}, "anyOf must be a non-empty list"),
     ({"type": []}, "type must be a non-empty list"), ({"type": "array", "items": {"type": "null"}, "minItems": -1},
      "minItems must be an integer >= 0")],
)  # fmt: skip
def test_malformed_schemas_fail_naming_the_path_and_keyword(schema, problem):
    with pytest.raises(SchemaError, match=problem):
        schema_to_regex(schema)


def test_anchored_schema_patterns_mean_the_same_as_unanchored_ones():
    for anchored, plain, value in (("^[0-9]{5}$", "[0-9]{5}", "12345"), ("^a\\$", "a\\$", "a$")):
        dfa = ByteDFA(schema_to_regex({"type": "string", "pattern": anchored}))
        assert dfa.fullmatch(json.dumps(value).encode())
        assert schema_to_regex({"type": "string", "pattern": anchored}) == schema_to_regex(
            {"type": "string", "pattern": plain})


def test_branches_this_vocabulary_cannot_finish_are_never_entered():
    """A tokenizer without byte fallback and without '日': choices ["ab日", "cd"] must not start "ab" (a dead end for
    it) even where the model prefers "a"; a pattern it cannot spell at all fails at the first step, by name."""
    from tokenizers import Tokenizer, models
    from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast

    from helpers import tiny_model

    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None)),
                                        eos_token="<eos>", pad_token="<eos>")  # fmt: skip
    model = tiny_model("huginn", eos_token_id=0)

    class PreferA(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + 20 * (torch.arange(scores.shape[-1]) == vocab["a"])

    ids = torch.tensor([[5, 6, 7]])
    prefer_a = LogitsProcessorList([PreferA()])
    common = dict(tokenizer=tokenizer, max_new_tokens=6, do_sample=False, logits_processor=prefer_a)
    for constraint in (dict(choices=["ab日", "cd"]), dict(regex="ab日|cd")):
        out = model.generate(ids, **common, **constraint)
        assert out[0, 3:].tolist() == [vocab["c"], vocab["d"], 0], constraint
    with pytest.raises(ValueError, match="dead end for this tokenizer"):
        model.generate(ids, **common, choices=["日本"])


@pytest.mark.parametrize("do_sample", [False, True])
def test_min_new_tokens_past_a_complete_match_fails_clearly(embedded, do_sample):
    """min_new_tokens masks the end token, the only one a complete match allows: greedy would pick id 0 (the pad,
    ending the constraint) and sampling fail on NaN probabilities without the check."""
    model, tokenizer = embedded
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="masked by another logits processor"):
        model.generate(ids, max_new_tokens=8, min_new_tokens=6, do_sample=do_sample, tokenizer=tokenizer,
                       choices=[" yes", " no"])  # fmt: skip


def test_assisted_decoding_keeps_the_constraint_and_each_models_own_depth(embedded):
    """The assistant gets the target's constraint processor (not its own, which would need a tokenizer) and its
    own loop depth; a plain transformers assistant gets no TinyLoop keyword. Greedy assisted decoding is exact."""
    model, tokenizer = embedded
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    pattern = r" [a-z]+ (and|or) [a-z]+\."
    kwargs = dict(max_new_tokens=16, do_sample=False, tokenizer=tokenizer, regex=pattern, num_loops=2)
    plain = model.generate(ids, **kwargs)
    assert re.fullmatch(pattern, _text(tokenizer, plain[0], ids.shape[1]))
    assert torch.equal(model.generate(ids, assistant_model=model, **kwargs), plain)
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=model.config.vocab_size, num_key_value_heads=2, **shape))
    llama.generation_config.eos_token_id = model.generation_config.eos_token_id
    assert torch.equal(model.generate(ids, assistant_model=llama, **kwargs), plain)
