"""The embedded tokenizer: text round trip, stop ids, chat templates (a bounded sandbox; jinja2 missing gives one
error naming the install command), engine text I/O."""

from __future__ import annotations

import random
import resource
import sys
import time

import pytest

from colibri_format.errors import InvalidInput, InvalidMetadata
from colibri_format.runtime import Engine
from colibri_format.runtime.tokenizer import (CHAT_TEMPLATE_FIELD, ChatTemplateError, TemplateLimits, Tokenizer,
                                              render_chat_template)
from tests.runtime.numpy_tiny import WORDS, random_weights, tokenizer_entry
from tests.runtime.tiny_weights import write_colibri


def test_round_trip_and_stop_ids():
    tok = Tokenizer.from_metadata({"tokenizer": tokenizer_entry()})
    ids = tok.encode("hello world")
    assert ids == [3, 4] and tok.decode(ids) == "hello world"
    assert tok.decode([1, 3, 2]) == "hello"             # special tokens skipped
    assert tok.stop_ids == [2]                           # from the eos token when generation_config has none
    both = Tokenizer.from_metadata({"tokenizer": tokenizer_entry(generation_config={"eos_token_id": [2, 9]})})
    assert both.stop_ids == [2, 9]


def test_no_tokenizer_and_a_broken_one():
    assert Tokenizer.from_metadata({"tokenizer": None}) is None
    with pytest.raises(InvalidMetadata, match="tokenizer_json"):
        Tokenizer("{not json", {}, {})


def test_chat_template_renders_and_encodes():
    tok = Tokenizer.from_metadata({"tokenizer": tokenizer_entry()})
    messages = [{"role": "user", "content": "hi there"}]
    assert tok.apply_chat_template(messages) == "<s>user : hi there </s> assistant :"
    assert tok.encode_chat(messages) == [1, 5, 7, 8, 9, 2, 6, 7]


def test_chat_needs_a_template_and_jinja2(monkeypatch):
    plain = Tokenizer.from_metadata({"tokenizer": tokenizer_entry(tokenizer_config={})})
    with pytest.raises(InvalidInput, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    tok = Tokenizer.from_metadata({"tokenizer": tokenizer_entry()})
    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(InvalidInput, match="pip install 'jinja2>=3.1.6'") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def test_engine_text_prompt_and_default_stop(tmp_path):
    weights = random_weights(vocab_size=len(WORDS))
    weights.metadata = {"tokenizer": tokenizer_entry()}
    with Engine(write_colibri(weights, tmp_path / "words.colibri")) as eng:
        out = eng.generate("hello world", max_new_tokens=6)
        assert out.output_ids == eng.generate([3, 4], max_new_tokens=6).output_ids
        assert out.text == eng.tokenizer.decode(out.output_ids)
        assert 2 not in out.output_ids[:-1]              # </s> ends generation by default


# --- the file's chat template is untrusted code: a bounded sandbox ---------------------------------------------------
MESSAGES = [{"role": "user", "content": "hi"}]
QUICK = TemplateLimits(seconds=2.0)


def refusal(template: str, limits: TemplateLimits = QUICK) -> str:
    """The one-line message of the ChatTemplateError `template` raises, which must come within the time bound."""
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, limits, messages=MESSAGES)
    assert time.monotonic() - start < limits.seconds + 1.0
    assert info.value.field == CHAT_TEMPLATE_FIELD and f"field={CHAT_TEMPLATE_FIELD}" in str(info.value)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture(autouse=True, scope="module")
def _memory_cap():
    """A template that escaped the size bounds would hit this (2 GiB more than now) instead of the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * resource.getpagesize()
    cap = now + (2 << 30)
    if hard == resource.RLIM_INFINITY or hard > cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_wall_clock_bound():
    # 2**40 macro calls: within the loop and call bounds here, so only the clock stops it
    limits = TemplateLimits(seconds=0.3, loop_iterations=10**12, calls=10**12)
    message = refusal("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% else %}x{% endif %}{% endmacro %}"
                      "{{ f(40) }}", limits)
    assert "longer than 0.3 s" in message


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",        # 10**10, nested
    "{% for i in range(99999) %}{% for j in range(99999) %}{% for k in range(99) %}x{% endfor %}{% endfor %}"
    "{% endfor %}",
    "{% for x in [1, 2] recursive %}{% for i in range(1000) %}{% endfor %}{{ loop([1, 2]) }}{% endfor %}",
], ids=["nested", "triple", "recursive"])
def test_loop_bound_counts_every_loop_together(template):
    limits = TemplateLimits(seconds=5.0, loop_iterations=50_000)
    message = refusal(template, limits)
    assert "more than 50,000 iterations" in message or "recursed too deeply" in message


def test_range_is_capped_by_the_sandbox():
    assert "Range too big" in refusal("{% for i in range(10**10) %}x{% endfor %}")


def test_call_bound():
    assert "more than 1,000 calls" in refusal("{% for i in range(5000) %}{{ 'x'.upper() }}{% endfor %}",
                                              TemplateLimits(calls=1000))


@pytest.mark.parametrize("template", [
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% block a %}{{ self.a() }}{% endblock %}",
    "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
], ids=["macro", "block", "parser"])
def test_recursion_is_refused(template):
    assert "recursed too deeply" in refusal(template)


@pytest.mark.parametrize("template, what", [
    ("{{ 'a' * 10**9 }}", "`*` result"),
    ("{% set s = 'a' * 10**9 %}unused", "`*` result"),
    ("{% set l = ['a'] * 10**9 %}", "`*` result"),
    ("{% set s = 'a' * 500000 %}{{ ([s] * 1000)|join }}", "`*` result"),
    ("{{ 2 ** (10 ** 10) }}", "`**` result"),
    ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "`*` result"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "`~`"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "`+` result"),
    ("{% set s = 'a' * 500000 %}{{ [s, s, s]|join }}", "a value"),
    ("{% set s = 'a' * 500000 %}{{ {'a': s, 'b': s, 'c': s} }}", "a value"),
    ("{% set s = 'a' * 500000 %}{{ ''.join((s, s, s)) }}", "a value"),
    ("{% set s = 'a' * 500000 %}{{ ''.join(range(3)|map('string')|map('center', 500000)) }}", "a join"),
    ("{{ '{:>1000000000}'.format('a') }}", "format()"),
    ("{{ '{:{}}'.format('a', 1000000000) }}", "format()"),
    ("{{ '{x:>999999999}'.format_map({'x': 1}) }}", "format_map()"),
    ("{{ ('{:>999999999}'|attr('format'))(1) }}", "format()"),
    ("{{ '%1000000000d' % 1 }}", "`%` result"),
    ("{{ '%*d' % (1000000000, 1) }}", "`%` result"),
    ("{{ '%1000000000s'|format('a') }}", "|format"),
    ("{{ 'a'|center(1000000000) }}", "|center"),
    ("{{ 'a'.center(1000000000) }}", "center()"),
    ("{{ ('a'|attr('ljust'))(1000000000) }}", "ljust()"),
    ("{{ 'a'|indent(1000000000) }}", "|indent"),
    ("{% set s = 'a' * 100000 %}{{ s|replace('a', s) }}", "|replace"),
    ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", "replace()"),
    ("{% set s = 'a' * 100000 %}{{ s.translate({97: s}) }}", "translate()"),
    ("{{ '\t\t'.expandtabs(1000000000) }}", "expandtabs()"),
    ("{{ (1).to_bytes(1000000000, 'big') }}", "to_bytes()"),
    ("{{ [1]|batch(1000000000, 'x')|list }}", "|batch"),
    ("{{ [1]|slice(1000000000)|list }}", "|slice"),
    ("{{ [1, [2, [3]]]|tojson(indent=1000000000) }}", "|tojson"),
    ("{{ 5|round(-1000000000, 'ceil') }}", "|round"),
    ("{{ ([[1]] * 100000)|sum(start=[]) }}", "|sum"),
    ("{% set s = 'a ' * 400000 %}{{ s|wordwrap(1, wrapstring='-' * 100) }}", "|wordwrap"),
    ("{% set s = 'a' * 500000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "the output"),
    ("{% macro f() %}{% for i in range(100000) %}" + "y" * 1000 + "{% endfor %}{% endmacro %}{% set x = f() %}",
     "a block's output"),
], ids=lambda v: v[:40] if isinstance(v, str) and "{" in v else None)
def test_size_bounds(template, what):
    message = refusal(template)
    assert what in message and "characters (limit 1,048," in message


def test_total_of_values_built_is_bounded():
    # each value is small, their sum is not
    assert "more than 16,777,216 characters" in refusal("{{ range(100000)|map('string')|map('center', 100000)|join }}")
    assert "more than 16,777,216 characters" in refusal(
        "{% macro f() %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endmacro %}{% set x = f() %}")


def test_template_size_bound():
    assert "characters (limit 1,000)" in refusal("x" * 1001, TemplateLimits(template_chars=1000))


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ (''|attr('__class__')).__mro__ }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% set l = [1] %}{{ l.append(2) }}",
    "{% set d = {} %}{{ d.update({'a': 1}) }}",
])
def test_sandbox_refusals_are_one_error(template):
    assert "refused by the sandbox" in refusal(template)


@pytest.mark.parametrize("template, start", [
    ("{% for %}", "chat template does not parse"),
    ("{{ a.b.c }}", "chat template failed: UndefinedError"),
    ("{{ 'a' + 1 }}", "chat template failed: TypeError"),
    ("{{ lipsum(10**9) }}", "chat template failed: UndefinedError"),     # lipsum is not offered
])
def test_broken_templates_are_one_error(template, start):
    assert refusal(template).startswith(start)


def test_limits_grow_with_the_messages():
    long = [{"role": "user", "content": "word " * 400_000}]              # 2 MB: over the default output bound
    text = render_chat_template("{% for m in messages %}{{ m.role + ': ' + m.content }}{% endfor %}", QUICK,
                                messages=long)
    assert len(text) == 6 + 2_000_000


def test_raise_exception_still_refuses_the_messages():
    with pytest.raises(InvalidInput, match="no system role") as info:
        render_chat_template("{{ raise_exception('no system role') }}", QUICK, messages=MESSAGES)
    assert info.value.field == "messages"


def test_bounded_rendering_equals_plain_sandbox_rendering():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ("{%- set ns = namespace(last=-1) %}{%- for m in messages[::-1] %}{%- if m.role == 'user' and "
                "ns.last < 0 %}{%- set ns.last = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
                "{%- for m in messages %}{{ '<|' + m.role + '|>' ~ m.content|trim }}{% if m.tool_calls %}"
                "{{ m.tool_calls|tojson(indent=2) }}{% endif %}{% if loop.index0 == ns.last %}*{% endif %}"
                "{% endfor %}{{ '%s|%05d' % ('a', 42) }}{{ '{} {:>4}'.format('x', 7) }}{{ [1, 2]|join(',') }}"
                "{% for k, v in {'k': 1}.items() %}{{ k }}={{ v }}{% endfor %}{{ 'x'|center(9) }}"
                "{{ messages|map(attribute='role')|unique|list }}{% for x in [[1, [2]], [3]] recursive %}"
                "{{ x if x is number else loop(x) }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "system", "content": " be brief "}]
    for i in range(50):
        messages += [{"role": "user", "content": f"question {i}"},
                     {"role": "assistant", "content": "ok", "tool_calls": [{"name": "f", "arguments": {"x": i}}]}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    expected = plain.from_string(template).render(messages=messages, add_generation_prompt=True)
    assert render_chat_template(template, TemplateLimits(), messages=messages,
                                add_generation_prompt=True) == expected


# --- streamed text: incremental detokenization on a byte-level BPE that splits characters across tokens ---------

STREAM_TEXTS = ['="€"', "中文字", "café déjà", "😀😀🎉 end", 'a="€" 中文 é 😀🎉 字', "€€€", "ok"]


def _byte_tokenizer():
    from tests.cli.byte_bpe import byte_level_bpe

    hf = byte_level_bpe()
    return hf, Tokenizer(hf.to_str())


def _stream(tok, ids, stop_strings=(), final=None):
    """(pieces written while the ids came, every piece written) of a TextStream fed `ids`, then finished with
    `final` (default: the decode of all the ids)."""
    from colibri_format.runtime.infer import TextStream

    pieces: list[str] = []
    stream = TextStream(tok, pieces.append, stop_strings)
    for token in ids:
        stream(token)
    live = list(pieces)
    stream.finish(tok.decode(ids) if final is None else final)
    return live, pieces


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streamed_text_equals_the_final_decode_at_every_length(text):
    from tests.cli.byte_bpe import splits_a_character

    hf, tok = _byte_tokenizer()
    ids = hf.encode(text).ids
    assert hf.decode(ids) == text
    if text != "ok":
        assert splits_a_character(hf, ids)             # the case under test: a character across tokens
    for cut in range(1, len(ids) + 1):                 # every length, so also ending mid-character
        live, pieces = _stream(tok, ids[:cut])
        assert "".join(pieces) == tok.decode(ids[:cut]), (text, cut, pieces)
        assert not any("\ufffd" in p for p in live), (text, cut, live)   # no partial character while streaming


def test_a_sequence_ending_mid_character_shows_what_the_final_decode_shows():
    hf, tok = _byte_tokenizer()
    ids = hf.encode("x😀").ids[:-1]                     # x, then f0 9f: half an emoji
    live, pieces = _stream(tok, ids)
    assert "".join(live) == "x" and "".join(pieces) == tok.decode(ids) == "x\ufffd"


def test_streamed_text_equals_the_final_decode_on_random_bytes():
    """Random valid UTF-8 (1- to 4-byte characters) and random bytes (invalid sequences too), one token per byte or
    through the merges: the streamed text is the lossy final decode."""
    hf, tok = _byte_tokenizer()
    rng = random.Random(7)
    alphabet = "aé中文字€😀🎉ñ\u0301 \n\"="
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        for ids in (hf.encode(text).ids, list(text.encode())):            # merged tokens; single bytes (id = byte)
            _, pieces = _stream(tok, ids)
            assert "".join(pieces) == text
        raw = [rng.randrange(256) for _ in range(rng.randint(1, 30))]     # anything, invalid UTF-8 included
        _, pieces = _stream(tok, raw)
        assert "".join(pieces) == tok.decode(raw)


@pytest.mark.parametrize("text, stop", [('a="€" b', "€"), ("中文字 x", "文字"), ("😀😀🎉 end", "🎉"),
                                        ("café déjà", "é d"), ("abc", "zz")])
def test_streamed_text_stops_before_a_stop_string(text, stop):
    from colibri_format.runtime.sampling import find_stop

    hf, tok = _byte_tokenizer()
    ids = hf.encode(text).ids
    full = tok.decode(ids)
    at = find_stop(full, [stop])
    final = full[:at] if at >= 0 else full                                  # what Engine.generate returns
    live, pieces = _stream(tok, ids, [stop], final)
    assert "".join(pieces) == final and stop not in "".join(live)


def test_streaming_decodes_a_short_window_per_token():
    """The work per token does not grow with the output: each decode call sees a few ids only."""
    hf, tok = _byte_tokenizer()
    ids = hf.encode('a="€" 中文 é 😀🎉 字 ' * 200).ids
    sizes: list[int] = []
    plain = tok.decode
    tok.decode = lambda window, **kw: sizes.append(len(window)) or plain(window, **kw)
    _, pieces = _stream(tok, ids)
    assert "".join(pieces) == hf.decode(ids)
    assert len(ids) > 2000 and max(sizes[:-1]) <= 8                         # the last call: the final decode


# --- a cheap size bound before tokenizing ------------------------------------------------------------------------

def test_the_size_bound_never_refuses_a_text_that_fits():
    """For a byte-level BPE the bound is the longest entry times the margin: a text of as many longest tokens
    as max_seq_len allows passes, one byte more than the bound does not, and encode is never called then."""
    from colibri_format.errors import SequenceTooLong
    from colibri_format.runtime.inputs import NORMALIZER_MARGIN, check_text_fits, max_bytes_per_token

    hf, tok = _byte_tokenizer()
    longest = max(hf.get_vocab(), key=lambda t: len(t))
    per_token = max_bytes_per_token(tok)
    assert per_token == max(4, len(longest.encode())) * NORMALIZER_MARGIN
    rng = random.Random(3)
    alphabet = "aé中文字€😀🎉 \"="
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200)))
        n = len(hf.encode(text).ids)
        check_text_fits(text, tok, n)                                  # fits in its own token count: never refused
    encode = tok.encode
    tok.encode = lambda *a, **k: pytest.fail("tokenized a text over the bound")
    limit = 1000 // per_token                                          # tokens that hold at most 1000 bytes
    check_text_fits("é" * (limit * per_token // 2), tok, limit)        # at the bound: passes
    with pytest.raises(SequenceTooLong, match=rf"the prompt is 1,001 bytes, more than max_seq_len={limit} tokens"):
        check_text_fits("é" * 500 + "a", tok, limit)                   # 501 characters, 1001 bytes
    tok.encode = encode


@pytest.mark.parametrize("kind", ["wordlevel", "unigram", "fused-unknowns", "strip-accents"])
def test_no_size_bound_where_one_token_may_stand_for_any_length(kind):
    """An unknown-word token (WordLevel, Unigram, BPE fusing unknowns) or a normalizer that deletes text: a long
    text may be few tokens, so it is tokenized, never refused on its size."""
    from tokenizers import Tokenizer as HF, models, normalizers, pre_tokenizers

    from colibri_format.runtime.inputs import check_text_fits, max_bytes_per_token

    if kind == "wordlevel":
        hf = HF(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
    elif kind == "unigram":
        hf = HF(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))
    elif kind == "fused-unknowns":
        hf = HF(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    else:
        hf = HF(models.BPE({"a": 0}, []))
        hf.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    tok = Tokenizer(hf.to_str())
    assert max_bytes_per_token(tok) is None
    long = "b" * 100_000 if kind != "strip-accents" else "a" + "\u0301" * 100_000
    check_text_fits(long, tok, 4)
    assert len(tok.encode(long, add_special_tokens=False)) <= 4


def test_engine_refuses_a_huge_text_prompt_before_tokenizing(tmp_path):
    from colibri_format.errors import SequenceTooLong
    from colibri_format.runtime import EngineConfig
    from tests.cli.byte_bpe import write_chain_model

    hf, _ = _byte_tokenizer()
    path = write_chain_model(tmp_path / "chain.colibri", hf, {120: 61})
    with Engine(path, EngineConfig(max_seq_len=64)) as eng:
        eng.tokenizer.encode = lambda *a, **k: pytest.fail("tokenized a prompt over the bound")
        with pytest.raises(SequenceTooLong, match="it was not tokenized"):
            eng.generate("x" * 1_000_000, max_new_tokens=1)
