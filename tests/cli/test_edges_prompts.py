"""Heavy prompts: a text too big for max_seq_len is refused on its size before it is tokenized (tokenizing costs
about 200 bytes of memory a byte: a 5 MB prompt took 1 GB and 4 s, a 50 MB one would take ~10 GB), for every way a
prompt comes in: --file, standard input, --prompt, --system, a `colibri chat` line. Each case runs `python -m
colibri_format ...` in a subprocess: exit code, one line on standard error (plus the hint), clean standard output.
The time guard is a generous ceiling, not a performance claim (measured: about 0.4 s, 150 MB for 50 MB).
"""

from __future__ import annotations

import os
import resource

import pytest

from tests.cli.test_edges import assert_one_error, colibri, lines

pytestmark = pytest.mark.timeout(300)

GUARD_S = 20.0
BIG = 5_000_000
NEEDLE = "more than max_seq_len=2048 tokens can hold"


def _big_text(size: int = BIG) -> bytes:
    unit = "the quick brown fox jumps over the lazy dog, é中😀 ".encode()
    return (unit * (size // len(unit) + 1))[:size].rsplit(b" ", 1)[0]      # whole characters


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(*args, **kwargs):
    """(the finished `colibri` process, the CPU seconds it used): CPU, not wall time, so that other jobs on a loaded
    machine do not trip GUARD_S, while a command that works through the whole prompt still does."""
    t0 = _children_cpu_seconds()
    done = colibri(*args, **kwargs)
    return done, _children_cpu_seconds() - t0


@pytest.mark.parametrize("size", [BIG, 50_000_000], ids=["5MB", "50MB"])
def test_a_prompt_file_over_the_bound(chat_file, tmp_path, size):
    prompt = tmp_path / "p.txt"
    prompt.write_bytes(_big_text(size))
    done, seconds = _timed("infer", chat_file, "--file", str(prompt))
    line = assert_one_error(done, 1, "the prompt is", NEEDLE, "it was not tokenized", hint=True)
    assert f"{os.path.getsize(prompt):,} bytes" in line and seconds < GUARD_S


def test_a_prompt_on_standard_input_over_the_bound(chat_file):
    done, seconds = _timed("infer", chat_file, "--prompt", "-", stdin=_big_text())
    assert_one_error(done, 1, NEEDLE, hint=True)
    assert seconds < GUARD_S


def test_a_system_prompt_counts_with_the_prompt(chat_file, tmp_path):
    """250 kB of prompt is under the bound (2048 tokens x 164 bytes), 120 kB of system prompt too (one argument
    stays under 128 KiB), both together are over it."""
    prompt = tmp_path / "p.txt"
    prompt.write_bytes(_big_text(250_000))
    done = colibri("infer", chat_file, "--file", str(prompt), "--system", _big_text(120_000).decode())
    assert_one_error(done, 1, NEEDLE, "field=prompt", hint=True)


def test_a_json_refusal(chat_file, tmp_path):
    import json

    prompt = tmp_path / "p.txt"
    prompt.write_bytes(_big_text())
    done = colibri("infer", chat_file, "--file", str(prompt), "--json")
    assert done.returncode == 1 and done.stderr == b""
    error = json.loads(done.stdout)["error"]
    assert error["type"] == "SequenceTooLong" and error["field"] == "prompt" and error["value"] > BIG - 100


def test_a_chat_line_over_the_bound_is_skipped_and_the_chat_goes_on(chat_file):
    done, seconds = _timed("chat", chat_file, "--max-new-tokens", "3", stdin=_big_text() + b"\nhello\n")
    err = lines(done.stderr)
    assert done.returncode == 0, err
    assert len(err) == 1 and err[0].startswith("error: the message is") and NEEDLE in err[0], err
    assert len(lines(done.stdout)) == 1                                  # the reply to "hello"
    assert seconds < GUARD_S


def test_a_prompt_under_the_bound_is_still_counted_in_tokens(chat_file, tmp_path):
    """Under the size bound the tokens decide, as before: the error names the token count."""
    prompt = tmp_path / "p.txt"
    prompt.write_bytes(_big_text(100_000))
    assert_one_error(colibri("infer", chat_file, "--file", str(prompt)), 1, "tokens, over max_seq_len=2048",
                     hint=True)


def test_a_chat_line_over_64_mib_is_read_past_in_pieces(chat_file):
    from colibri_format.runtime.inputs import MAX_PROMPT_BYTES

    done = colibri("chat", chat_file, "--max-new-tokens", "2",
                   stdin=b"a" * (MAX_PROMPT_BYTES + 3_000_000) + b"\nhello\n")
    err = lines(done.stderr)
    assert done.returncode == 0, err
    assert err == [f"error: the message is over {MAX_PROMPT_BYTES:,} bytes; it was skipped (field=message)"]
    assert len(lines(done.stdout)) == 1
