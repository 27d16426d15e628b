"""Safe and polite at the edges, for files from strangers: each case runs `python -m colibri_format ...` in a
subprocess and checks the exit code, the one line on standard error (plus the COLIBRI_DEBUG hint where
cli/errors.py prints one), and a clean standard output.

Families:
* chat templates are code from whoever made the file: loops of 10**10, string and join bombs, `.format` widths,
  recursion, sandbox escapes and broken templates are one `ChatTemplateError` line (exit 1), fast; without jinja2
  one line names the install command;
* paths that are not regular files (directory, FIFO, device, /proc and /sys pseudo-files, missing) are unreadable
  (exit 2) for inspect, validate and infer, never invalid;
* a file truncated while `validate` reads it is one TruncatedFile line, never SIGBUS: a real race with another
  process, and a deterministic shrinking read;
* the lean install: convert, inspect, validate and infer (--chat included) on the CPU import neither torch nor
  transformers; --device cuda without CuPy names a GPU extra that pyproject.toml defines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colibri_format import synthetic
from colibri_format.cli.errors import DEBUG_HINT
from colibri_format.synthetic import synthetic_model, write_synthetic

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "colibri-demo-moe"
ENV = {k: v for k, v in os.environ.items() if k != "COLIBRI_DEBUG"} | {"COLUMNS": "200", "NO_COLOR": "1"}

pytestmark = pytest.mark.timeout(300)


def colibri(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri_format", *args], capture_output=True, env=env or ENV,
                          timeout=timeout, cwd=ROOT)


def assert_one_error(done: subprocess.CompletedProcess, code: int, *needles: str, hint: bool = True) -> str:
    """Exit `code`, nothing on standard output, standard error one `error:` line (plus the hint line)."""
    err = done.stderr.decode("utf-8", "backslashreplace").splitlines()
    assert done.returncode == code, err
    assert done.stdout == b"", done.stdout[:300]
    assert len(err) == (2 if hint else 1), err
    assert err[0].startswith("error: "), err
    if hint:
        assert err[1] == DEBUG_HINT, err
    for needle in needles:
        assert needle in err[0], err
    return err[0]


def hide(tmp_path: Path, *modules: str, marker: Path | None = None) -> dict:
    """An environment in which importing `modules` fails (and, with `marker`, writes the module's name there)."""
    root = tmp_path / "hidden"
    for name in modules:
        (root / name).mkdir(parents=True, exist_ok=True)
        note = f"open({str(marker)!r}, 'a').write({name + chr(10)!r})\n" if marker else ""
        message = f"No module named {name!r} (hidden)"
        (root / name / "__init__.py").write_text(f"{note}raise ImportError({message!r})\n")
    return ENV | {"PYTHONPATH": os.pathsep.join([str(root), *filter(None, [ENV.get("PYTHONPATH")])])}


def chat_file_with(path: Path, template: str) -> str:
    """A small synthetic model embedding the demo tokenizer with `template` as its chat template."""
    config = json.loads((DEMO / "tokenizer_config.json").read_text()) | {"chat_template": template}
    tokenizer = {"tokenizer_json": (DEMO / "tokenizer.json").read_text(), "tokenizer_config": config,
                 "generation_config": json.loads((DEMO / "generation_config.json").read_text())}
    plain = synthetic.synthetic_metadata
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synthetic, "synthetic_metadata", lambda *a, **k: {**plain(*a, **k), "tokenizer": tokenizer})
        write_synthetic(path, synthetic_model(vocab=4096, layers=2, experts=4, top_k=2))
    return str(path)


# --- chat templates from strangers ---------------------------------------------------------------------------------
HOSTILE = {
    # the 90-byte hang: 10**10 iterations through nested loops (range alone is capped by the sandbox)
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "iterations"),
    "range": ("{% for i in range(10**10) %}{% endfor %}", "Range too big"),
    "string-bomb": ("{{ 'a' * 10**9 }}", "`*` result would be 1,000,000,000 characters"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 "`~` concatenation"),
    "join-bomb": ("{% set s = 'a' * 500000 %}{{ ([s] * 10000)|join }}", "characters (limit"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", "the result of format()"),
    "percent-width": ("{{ '%999999999d' % 1 }}", "`%` result"),
    "macro-recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    "attribute-escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused by the sandbox"),
    "mutation": ("{% set l = [] %}{{ l.append(1) }}", "refused by the sandbox"),
    "syntax": ("{% for m in messages %}", "does not parse"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_chat_template_is_one_line(name, tmp_path):
    template, needle = HOSTILE[name]
    path = chat_file_with(tmp_path / f"{name}.colibri", template)
    start = time.monotonic()
    done = colibri("infer", path, "--prompt", "hi", "--chat", "--max-new-tokens", "2")
    line = assert_one_error(done, 1, "chat template", needle, "field=tokenizer.chat_template")
    assert time.monotonic() - start < 60, line


def test_hostile_chat_template_as_json(tmp_path):
    path = chat_file_with(tmp_path / "bomb.colibri", HOSTILE["string-bomb"][0])
    done = colibri("infer", path, "--prompt", "hi", "--chat", "--json")
    assert done.returncode == 1 and done.stderr == b""
    error = json.loads(done.stdout)["error"]
    assert error["type"] == "ChatTemplateError" and error["field"] == "tokenizer.chat_template"


def test_template_refusing_the_messages(tmp_path):
    path = chat_file_with(tmp_path / "raise.colibri", "{{ raise_exception('only system roles') }}")
    done = colibri("infer", path, "--prompt", "hi", "--chat")
    assert_one_error(done, 1, "only system roles", "field=messages")


def test_a_friendly_template_still_renders(tmp_path):
    path = chat_file_with(tmp_path / "ok.colibri", (DEMO / "chat_template.jinja").read_text())
    done = colibri("infer", path, "--prompt", "hi", "--chat", "--max-new-tokens", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prompt_ids"]


def test_chat_without_jinja2_names_the_install_command(tmp_path):
    path = chat_file_with(tmp_path / "ok.colibri", (DEMO / "chat_template.jinja").read_text())
    done = colibri("infer", path, "--prompt", "hi", "--chat", env=hide(tmp_path, "jinja2"))
    assert_one_error(done, 1, "jinja2", "pip install", hint=False)


# --- paths that are not regular files: unreadable (2), never invalid (1) -------------------------------------------
def _special_paths(tmp_path: Path) -> list[str]:
    fifo = tmp_path / "pipe.colibri"
    os.mkfifo(fifo)
    paths = [str(tmp_path), str(fifo), str(tmp_path / "missing.colibri"), "/dev/zero", "/proc/self/mem",
             "/proc/self/status", "/sys/kernel/mm/transparent_hugepage/enabled"]
    return [p for p in paths if p.startswith(str(tmp_path)) or os.access(p, os.R_OK)]


@pytest.mark.parametrize("command", [["inspect"], ["validate"], ["validate", "--quick"],
                                     ["infer", "--ids", "1", "--max-new-tokens", "1"]])
def test_non_regular_paths_are_unreadable(command, tmp_path):
    for path in _special_paths(tmp_path):
        done = colibri(command[0], path, *command[1:], timeout=60)      # a FIFO nobody writes must not hang
        assert_one_error(done, 2, "field=path")


def test_non_regular_paths_as_json(tmp_path):
    for path in _special_paths(tmp_path):
        done = colibri("validate", "--json", path, timeout=60)
        assert done.returncode == 2 and done.stderr == b"", done.stderr
        assert json.loads(done.stdout)["error"]["type"] == "NotARegularFile"


def test_an_empty_regular_file_is_invalid_not_unreadable(tmp_path):
    empty = tmp_path / "empty.colibri"
    empty.touch()
    assert_one_error(colibri("inspect", str(empty)), 1, "header")


# --- a file truncated while validate reads it ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    """About 170 MB (the CPU's caches are far smaller): validate needs some tens of milliseconds."""
    path = tmp_path_factory.mktemp("big") / "big.colibri"
    write_synthetic(path, synthetic_model(vocab=1024, hidden=1024, layers=6, heads=8, kv_heads=1, experts=32,
                                          top_k=8, expert_inter=256), dense_dtype=synthetic.S.DType.F16,
                    reuse_expert=True)
    return path


def _opened_by(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to see when the child opens the file")
def test_truncated_by_another_process_while_validating(big_file, tmp_path):
    """A real race: truncate as soon as the child has the file open. Lost races (the child already done) are
    retried; whatever happens, the child never dies by a signal."""
    outcomes = []
    for attempt in range(5):
        target = tmp_path / f"t{attempt}.colibri"
        target.write_bytes(big_file.read_bytes())
        child = subprocess.Popen([sys.executable, "-m", "colibri_format", "validate", str(target)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=ROOT)
        deadline = time.monotonic() + 60
        while child.poll() is None and not _opened_by(child.pid, target) and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.truncate(target, target.stat().st_size // 3)
        out, err = child.communicate(timeout=120)
        done = subprocess.CompletedProcess(child.args, child.returncode, out, err)
        assert child.returncode >= 0, f"killed by signal {-child.returncode}"
        outcomes.append(child.returncode)
        if child.returncode == 1:
            assert_one_error(done, 1, "shrank")
            return
        assert child.returncode == 0, err                   # the race was lost: it had checked everything
    pytest.skip(f"the child finished before the truncation in all attempts: {outcomes}")


def test_shrinking_read_through_the_cli(big_file, tmp_path):
    """Deterministic: the child's third data read finds the file cut to a third (an injected truncation)."""
    target = tmp_path / "cut.colibri"
    target.write_bytes(big_file.read_bytes())
    script = textwrap.dedent(f"""
        import os, sys
        from colibri_format.inspect import validate
        real, calls = os.preadv, []
        def preadv(fd, buffers, offset):
            calls.append(offset)
            if len(calls) == 3:
                os.truncate({str(target)!r}, {target.stat().st_size // 3})
            return real(fd, buffers, offset)
        validate.os.preadv = preadv
        from colibri_format.cli import main
        sys.exit(main(["validate", {str(target)!r}]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, env=ENV, cwd=ROOT, timeout=120)
    assert_one_error(done, 1, "shrank", "field=", "offset=")


@pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="no SIGBUS on this platform")
def test_a_mapping_would_have_died_by_sigbus(tmp_path):
    """Why validate does not map the file: touching a mapped page past a truncation kills the process."""
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"x" * (1 << 20))
    script = textwrap.dedent(f"""
        import mmap, os
        with open({str(path)!r}, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate({str(path)!r}, 0)
        m[len(m) - 1]
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGBUS


# --- the lean install ----------------------------------------------------------------------------------------------
def test_the_demo_path_imports_neither_torch_nor_transformers(tmp_path):
    """convert (safetensors), inspect, validate, infer and infer --chat with torch and transformers unimportable:
    all succeed, and none even tries to import them."""
    marker = tmp_path / "imported.txt"
    env = hide(tmp_path, "torch", "transformers", marker=marker)
    out = tmp_path / "demo.colibri"
    steps = [["convert", "--model-path", str(DEMO), "--output-path", str(out), "--dtype", "float16",
              "--quantize", "expert", "--restart"],
             ["inspect", str(out)], ["validate", str(out)],
             ["infer", str(out), "--prompt", "def f", "--max-new-tokens", "4"],
             ["infer", str(out), "--prompt", "def f", "--chat", "--max-new-tokens", "4"]]
    for args in steps:
        done = colibri(*args, env=env, timeout=300)
        assert done.returncode == 0, (args, done.stderr[-2000:])
    assert not marker.exists(), marker.read_text()


def test_without_cupy_the_install_command_names_a_gpu_extra(tmp_path):
    tomllib = pytest.importorskip("tomllib")                # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu = {name for name, reqs in extras.items() if any(r.startswith("cupy") for r in reqs)}
    assert gpu == {"gpu-cuda12", "gpu-cuda13"}
    done = colibri("bench", str(write_synthetic(tmp_path / "s.colibri")), env=hide(tmp_path, "cupy"))
    line = assert_one_error(done, 1, "CuPy", "pip install 'colibri-format[", hint=False)
    named = line.split("colibri-format[", 1)[1].split("]", 1)[0]
    if named not in gpu:
        pytest.skip(f"the installed metadata predates pyproject.toml (names [{named}]): reinstall with pip install -e .")
