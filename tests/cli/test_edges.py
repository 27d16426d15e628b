"""Safe and polite at the edges: each case family runs `python -m colibri_format ...` in a subprocess and checks
the exit code, the one line on standard error (plus the COLIBRI_DEBUG hint where cli/errors.py prints one:
library and OS errors, never usage errors, missing packages or interrupts), and a clean standard output.

Families: usage errors of every command; --device cuda / bench / --devices without CuPy; --trace into a missing
folder, onto a folder, onto a device and past a file size limit (RLIMIT_FSIZE: EFBIG; the model itself, links,
FIFOs, existing files and a full disk are in test_edges_trace.py);
--chat / --system / chat without jinja2; NaN, negative, infinite and tiny sampling values; prompts that are not
UTF-8 (argv, --file, standard input); nothing printed before the inputs are checked; Ctrl-C (infer, infer --json,
chat); a pinning trace of another model; errors as JSON; the scripted chat.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from colibri_format.cli.errors import DEBUG_HINT
from colibri_format.runtime.cache.trace import read_trace
from tests.subprocesses import default_sigint

ENV = {k: v for k, v in os.environ.items() if k != "COLIBRI_DEBUG"} | {"COLUMNS": "200", "NO_COLOR": "1"}


def colibri(*args, stdin: bytes = b"", env: dict | None = None, preexec_fn=None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m colibri_format ARGS` (bytes arguments pass undecodable bytes through) -> stdout/stderr bytes."""
    return subprocess.run([sys.executable, "-m", "colibri_format", *args], input=stdin, capture_output=True,
                          env=env or ENV, preexec_fn=preexec_fn, timeout=timeout)


def lines(data: bytes) -> list[str]:
    return data.decode("utf-8", "backslashreplace").splitlines()


def assert_one_error(done: subprocess.CompletedProcess, code: int, *needles: str, hint: bool = False,
                     prefix: str = "error:") -> str:
    """Exit `code`, standard output empty, standard error exactly one `prefix` line (plus the hint)."""
    err = lines(done.stderr)
    assert done.returncode == code, err
    assert done.stdout == b"", done.stdout[:300]
    assert len(err) == (2 if hint else 1), err
    assert err[0].startswith(prefix + " "), err
    if hint:
        assert err[1] == DEBUG_HINT
    for needle in needles:
        assert needle in err[0], err
    return err[0]


def json_error(done: subprocess.CompletedProcess, code: int) -> dict:
    """--json: exit `code`, nothing on standard error, one {"error": {...}} object on standard output."""
    assert done.returncode == code, lines(done.stderr)
    assert done.stderr == b""
    doc = json.loads(done.stdout)
    assert set(doc) == {"error"} and set(doc["error"]) == {"type", "message", "field", "value", "offset"}
    return doc["error"]


def hide(tmp_path: Path, *modules: str) -> dict:
    """An environment in which importing `modules` fails (a package whose __init__ raises ImportError)."""
    root = tmp_path / "hidden"
    for name in modules:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(f"raise ImportError({f'No module named {name!r} (hidden)'!r})\n")
    return ENV | {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [ENV.get("PYTHONPATH")])])}


@pytest.fixture()
def trace_file(model_file, tmp_path):
    path = tmp_path / "t.jsonl"
    assert colibri("infer", model_file, "--ids", "1,2", "--max-new-tokens", "2", "--trace", str(path)).returncode == 0
    return str(path)


# --- usage errors: one line, exit 2, no hint (nothing to trace), for every command -------------------------------

USAGE = [
    (["convert", "--bogus"], "--bogus"),
    (["convert", "--output-path", "o.colibri"], "Missing option '--model-path'"),
    (["convert", "--model-path", "m", "--output-path", "o", "--workers", "x"], "'--workers'"),
    (["inspect", "{file}", "--bogus"], "No such option"),
    (["inspect"], "Missing argument"),
    (["inspect", "{file}", "--json=yes"], "does not take a value"),
    (["validate", "{file}", "--bogus"], "No such option"),
    (["validate"], "Missing argument"),
    (["validate", "{file}", "--quick=1"], "does not take a value"),
    (["infer", "{file}", "--bogus"], "No such option"),
    (["infer"], "Missing argument"),
    (["infer", "{file}", "--max-new-tokens", "x"], "'--max-new-tokens'"),
    (["infer", "{file}", "--ids"], "requires an argument"),
    (["infer", "{file}", "--device", "tpu"], "'--device'"),
    (["chat", "{file}", "--bogus"], "No such option"),
    (["chat"], "Missing argument"),
    (["chat", "{file}", "--top-k", "x"], "'--top-k'"),
    (["cache-sim", "{trace}", "--bogus"], "No such option"),
    (["cache-sim"], "Missing argument"),
    (["cache-sim", "{trace}", "--blob-bytes", "x"], "'--blob-bytes'"),
    (["bench", "{file}", "--bogus"], "No such option"),
    (["bench"], "Missing argument"),
    (["bench", "{file}", "--batch-size", "0"], "'--batch-size'"),
    (["nonsense"], "No such command 'nonsense'"),
    (["--bogus"], "No such option"),
]


def _fill(args, model_file, trace_file):
    return [a.format(file=model_file, trace=trace_file) for a in args]


@pytest.mark.parametrize("args, needle", USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_usage_errors_are_one_line_exit_2(args, needle, model_file, trace_file):
    line = assert_one_error(colibri(*_fill(args, model_file, trace_file)), 2, needle)
    assert "--help" in line                                 # where to look, on the same line


@pytest.mark.parametrize("args", [["convert", "--bogus"], ["inspect"], ["infer", "{file}", "--top-p", "0"],
                                  ["cache-sim", "{trace}", "--bogus"], ["chat", "{file}", "--bogus"]])
def test_usage_errors_as_json(args, model_file, trace_file):
    error = json_error(colibri(*_fill(args, model_file, trace_file), "--json"), 2)
    assert error["type"] in ("NoSuchOption", "MissingParameter", "BadParameter") and "--help" not in error["message"]


def test_no_arguments_shows_the_help():
    done = colibri()
    assert done.returncode in (0, 2) and "infer" in (done.stdout + done.stderr).decode()
    assert b"Traceback" not in done.stderr


# --- sampling values: checked as they are parsed, with the same ranges as the engine ---------------------------

BAD_SAMPLING = [("--temperature", "nan"), ("--temperature", "-1"), ("--temperature", "inf"),
                ("--top-p", "0"), ("--top-p", "nan"), ("--top-p", "1.5"), ("--min-p", "1.5"), ("--min-p", "nan"),
                ("--repeat-penalty", "0"), ("--repeat-penalty", "nan"), ("--repeat-penalty", "-1"),
                ("--top-k", "-1"), ("--seed", "-1"), ("--stop", "")]


@pytest.mark.parametrize("flag, value", BAD_SAMPLING)
def test_bad_sampling_values_are_usage_errors(chat_file, flag, value):
    assert_one_error(colibri("infer", chat_file, "--prompt", "hi", f"{flag}={value}"), 2, flag)


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--top-p", "0"), ("--min-p", "-0.5")])
def test_bad_sampling_values_in_chat(chat_file, flag, value):
    assert_one_error(colibri("chat", chat_file, f"{flag}={value}"), 2, flag)


def test_a_tiny_temperature_acts_greedy(model_file):
    greedy = colibri("infer", model_file, "--ids", "3,4", "--max-new-tokens", "8")
    tiny = colibri("infer", model_file, "--ids", "3,4", "--max-new-tokens", "8", "--temperature", "1e-320",
                   "--seed", "5")
    assert greedy.returncode == tiny.returncode == 0 and tiny.stderr == b""
    assert tiny.stdout == greedy.stdout and len(tiny.stdout.split()) == 8


def test_help_and_engine_agree_on_the_top_p_range(model_file):
    help_text = " ".join(colibri("infer", "--help").stdout.decode().split())
    assert "(0, 1]; 1 = off" in help_text
    assert colibri("infer", model_file, "--ids", "1", "--top-p", "1e-9", "--temperature", "1").returncode == 0
    assert_one_error(colibri("infer", model_file, "--ids", "1", "--top-p", "0"), 2, "(0, 1]")


# --- missing optional packages: one line naming the install command ----------------------------------------------

@pytest.mark.parametrize("args", [["infer", "{file}", "--ids", "1", "--device", "cuda"],
                                  ["infer", "{file}", "--ids", "1,2", "--devices", "0,1", "--device", "cuda"],
                                  ["chat", "{file}", "--device", "cuda"],
                                  ["bench", "{file}"]])
def test_cuda_without_cupy_names_the_install_command(args, model_file, tmp_path):
    done = colibri(*_fill(args, model_file, ""), env=hide(tmp_path, "cupy"))
    assert_one_error(done, 1, "needs CuPy", "pip install 'colibri-format[")


@pytest.mark.parametrize("args", [["infer", "{file}", "--prompt", "hi", "--chat"],
                                  ["infer", "{file}", "--prompt", "hi", "--system", "be brief"],
                                  ["chat", "{file}"]])
def test_chat_template_without_jinja2(args, chat_file, tmp_path):
    done = colibri(*_fill(args, chat_file, ""), stdin=b"hello\n", env=hide(tmp_path, "jinja2"))
    assert_one_error(done, 1, "jinja2", "pip install")


# --- --trace: the path is checked before the run, and a failing disk is one line -----------------------------------

def test_trace_into_a_missing_folder(model_file, tmp_path):
    done = colibri("infer", model_file, "--ids", "1", "--trace", str(tmp_path / "no" / "t.jsonl"))
    assert_one_error(done, 1, "folder of --trace does not exist", hint=True)


def test_trace_onto_a_folder(model_file, tmp_path):
    assert_one_error(colibri("infer", model_file, "--ids", "1", "--trace", str(tmp_path)), 1, "is a folder", hint=True)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_trace_onto_a_device(model_file):
    # a device is no trace file (a full disk is a tmpfs in test_edges_trace.py)
    done = colibri("infer", model_file, "--ids", "1,2", "--max-new-tokens", "4", "--trace", "/dev/full")
    assert_one_error(done, 1, "--trace exists and is not a regular file", hint=True)


def test_trace_past_the_file_size_limit(model_file, tmp_path):
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))   # noqa: E731 - EFBIG past 2000 B
    done = colibri("infer", model_file, "--ids", "1,2", "--max-new-tokens", "30", "--trace",
                   str(tmp_path / "t.jsonl"), preexec_fn=limit)
    assert_one_error(done, 1, "cannot write the routing trace", "File too large", hint=True)


# --- prompts that are not UTF-8, and nothing on standard output before every input is checked ----------------------

def test_prompt_not_utf8_from_argv(chat_file):
    line = assert_one_error(colibri("infer", chat_file, "--prompt", b"abc\xfe"), 1, "not valid UTF-8", hint=True)
    assert "offset=3" in line and "field=prompt" in line


def test_prompt_not_utf8_from_a_file(chat_file, tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes("café ".encode() + b"\xc3(")
    line = assert_one_error(colibri("infer", chat_file, "--file", str(bad)), 1, "prompt file is not valid UTF-8",
                            hint=True)
    assert "offset=6" in line


def test_prompt_not_utf8_from_standard_input(chat_file):
    line = assert_one_error(colibri("infer", chat_file, "--prompt", "-", stdin=b"\xffhello"), 1, "standard input",
                            hint=True)
    assert "offset=0" in line


def test_system_prompt_not_utf8(chat_file):
    assert_one_error(colibri("infer", chat_file, "--prompt", "hi", "--system", b"\xe2\x82"), 1, "system", hint=True)


def test_the_prompt_is_not_printed_before_the_inputs_are_checked(chat_file, model_file, trace_file, tmp_path):
    hello = ["infer", chat_file, "--prompt", "hello there"]
    assert_one_error(colibri(*hello, "--trace", str(tmp_path / "no" / "t.jsonl")), 1, "--trace", hint=True)
    assert_one_error(colibri(*hello, "--cache-policy", "static", "--max-cached-experts", "2", "--pin-from-trace",
                             trace_file), 1, "another shape", hint=True)
    long = tmp_path / "long.txt"
    long.write_text("hello there " * 2000)                                  # over max_seq_len tokens
    assert_one_error(colibri("infer", chat_file, "--file", str(long)), 1, "max_seq_len", hint=True)
    assert_one_error(colibri(*hello, "--ids", "1"), 1, "exactly one", hint=True)


# --- a pinning trace of another model -----------------------------------------------------------------------------

def test_pin_from_a_trace_of_another_model(small_file, trace_file):
    done = colibri("infer", small_file, "--ids", "1", "--cache-policy", "static", "--max-cached-experts", "2",
                   "--pin-from-trace", trace_file)
    assert_one_error(done, 1, "pin_from_trace was recorded on a model of another shape", hint=True)


# --- errors as JSON: stdout, same exit code -----------------------------------------------------------------------

def test_library_errors_as_json(model_file, chat_file, tmp_path):
    error = json_error(colibri("infer", model_file, "--ids", "1,x", "--json"), 1)
    assert error["type"] == "InvalidInput" and error["field"] == "ids" and error["value"] == "1,x"
    error = json_error(colibri("infer", chat_file, "--prompt", b"ab\xfe", "--json"), 1)
    assert error["field"] == "prompt" and error["offset"] == 2 and "not valid UTF-8" in error["message"]
    zeros = tmp_path / "zeros.colibri"
    zeros.write_bytes(bytes(1024))
    error = json_error(colibri("inspect", str(zeros), "--json"), 1)
    assert error["type"] == "BadMagic" and error["field"] == "magic" and error["offset"] == 0
    error = json_error(colibri("infer", model_file, "--ids", "1", "--device", "cuda", "--json",
                               env=hide(tmp_path, "cupy")), 1)
    assert error["type"] == "MissingDependency" and error["field"] == "device"


# --- Ctrl-C ------------------------------------------------------------------------------------------------------

class Running:
    """A colibri process whose standard output is collected as it comes; `interrupt()` sends SIGINT."""

    def __init__(self, *args: str, stdin: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "colibri_format", *args], env=ENV,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)
        self.out = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := os.read(self.proc.stdout.fileno(), 4096):
            self.out += chunk

    def wait_for(self, ready, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while not ready() and time.monotonic() < end and self.proc.poll() is None:
            time.sleep(0.02)
        assert ready(), "the process never got going"

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self, timeout: float = 60) -> tuple[int, bytes, bytes]:
        err = self.proc.stderr.read()
        self.proc.wait(timeout)
        self._reader.join(timeout)
        return self.proc.returncode, self.out, err


def test_ctrl_c_in_infer_stops_with_the_timings_and_keeps_the_trace(chat_file, tmp_path):
    trace = tmp_path / "t.jsonl"
    run = Running("infer", chat_file, "--prompt", "Once upon a time", "--max-new-tokens", "2000", "--trace",
                  str(trace))
    run.wait_for(lambda: len(run.out) > len("Once upon a time"))              # generating
    run.interrupt()
    rc, out, err = run.finish()
    assert rc == 130, lines(err)
    assert out.startswith(b"Once upon a time") and out.endswith(b"\n")      # the streamed line is ended
    (line,) = lines(err)
    assert line.startswith("interrupted: stopped after ") and "tokens/s" in line and str(trace) in line
    records = read_trace(trace).records                                     # complete up to the stop
    assert 0 < len(records) < 2000 + 4


def test_ctrl_c_in_infer_json_is_a_json_error(model_file, tmp_path):
    trace = tmp_path / "t.jsonl"
    run = Running("infer", model_file, "--ids", "1,2", "--max-new-tokens", "2000", "--trace", str(trace), "--json")
    run.wait_for(lambda: trace.exists() and trace.stat().st_size > 2000)
    run.interrupt()
    rc, out, err = run.finish()
    assert rc == 130 and err == b""
    error = json.loads(out)["error"]
    assert error["type"] == "Interrupted" and "stopped after" in error["message"]


def test_ctrl_c_in_chat_ends_the_reply_not_the_chat(chat_file):
    run = Running("chat", chat_file, "--max-new-tokens", "2000", stdin=True)
    run.proc.stdin.write(b"tell me a long story\n")
    run.proc.stdin.flush()
    run.wait_for(lambda: len(run.out) > 0)
    run.interrupt()
    time.sleep(0.5)
    run.proc.stdin.write(b"/exit\n")
    run.proc.stdin.close()
    rc, out, err = run.finish()
    assert rc == 0, lines(err)
    (line,) = lines(err)
    assert line.startswith("reply stopped after ") and "tokens/s" in line
    assert out.endswith(b"\n")


# --- chat with a scripted standard input ---------------------------------------------------------------------------

def _replies(path: str, messages: list[str], **options) -> list[str]:
    """What ChatSession answers, in process (the reference the CLI must stream)."""
    from colibri_format.runtime import Engine
    from colibri_format.runtime.infer import ChatSession

    with Engine(path) as engine:
        session = ChatSession(engine, **options)
        return [session.reply(m)["text"] for m in messages]


def test_chat_streams_each_reply_and_keeps_the_history(chat_file):
    done = colibri("chat", chat_file, "--max-new-tokens", "12", "--system", "You are brief.",
                   stdin=b"hello\n\nhow are you?\n/exit\nnever read\n")
    assert done.returncode == 0 and done.stderr == b"", lines(done.stderr)
    expected = _replies(chat_file, ["hello", "how are you?"], system="You are brief.", max_new_tokens=12)
    assert done.stdout.decode() == "".join(reply + "\n" for reply in expected)


def test_chat_ends_at_the_end_of_input(chat_file):
    done = colibri("chat", chat_file, "--max-new-tokens", "5", stdin=b"hello")            # Ctrl-D: no newline
    assert done.returncode == 0 and done.stderr == b""
    assert done.stdout.decode() == _replies(chat_file, ["hello"], max_new_tokens=5)[0] + "\n"


def test_chat_reports_a_bad_message_and_goes_on(chat_file):
    done = colibri("chat", chat_file, "--max-new-tokens", "5", stdin=b"\xff\xfe\nhello\n")
    assert done.returncode == 0
    (line,) = lines(done.stderr)
    assert line.startswith("error: message is not valid UTF-8") and "offset=0" in line
    assert done.stdout.decode() == _replies(chat_file, ["hello"], max_new_tokens=5)[0] + "\n"


def test_chat_needs_a_tokenizer(model_file):
    assert_one_error(colibri("chat", model_file, stdin=b"hi\n"), 1, "tokenizer", hint=True)



def test_max_seq_len_bounds_the_sequence_in_one_line(model_file):
    ok = colibri("infer", model_file, "--ids", "1,2", "--max-new-tokens", "3", "--max-seq-len", "8", "--json")
    assert ok.returncode == 0 and len(json.loads(ok.stdout)["output_ids"]) == 3
    assert_one_error(colibri("infer", model_file, "--ids", ",".join(["1"] * 9), "--max-seq-len", "8"), 1,
                     "max_seq_len", hint=True)
    assert_one_error(colibri("infer", model_file, "--ids", "1,2", "--max-seq-len", "0"), 2, "--max-seq-len")


def test_gpu_memory_sizes_the_cache_or_says_why_in_one_line(model_file):
    ok = colibri("infer", model_file, "--ids", "1,2", "--max-new-tokens", "3", "--gpu-memory", "1TiB", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["output_ids"]
    assert_one_error(colibri("infer", model_file, "--ids", "1,2", "--gpu-memory", "a lot"), 1, "gpu_memory",
                     hint=True)
    assert_one_error(colibri("infer", model_file, "--ids", "1,2", "--gpu-memory", "1MiB"), 1, "gpu_memory",
                     "at least", hint=True)
    assert_one_error(colibri("infer", model_file, "--ids", "1,2", "--gpu-memory", "1GiB",
                             "--max-cached-experts", "2"), 1, "not both", hint=True)


def test_chat_takes_the_same_memory_budget(chat_file):
    ok = colibri("chat", chat_file, "--gpu-memory", "1TiB", "--max-new-tokens", "2", stdin=b"hi\n")
    assert ok.returncode == 0, ok.stderr
    assert_one_error(colibri("chat", chat_file, "--gpu-memory", "a lot"), 1, "gpu_memory", hint=True)
    assert_one_error(colibri("chat", chat_file, "--gpu-memory", "1GiB", "--max_cached_experts", "2"), 1, "not both",
                     hint=True)
