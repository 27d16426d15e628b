"""The `colibri` app as a whole: every command registered in one place, usage errors without tracebacks,
a fast start (no converter, engine, torch or CuPy for `inspect`), and the layering (the library never
imports the CLI)."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import colibri_format
from colibri_format.cli import app, main

PACKAGE = Path(colibri_format.__file__).resolve().parent
COMMANDS = {"convert": "convert", "inspect": "inspect", "validate": "validate", "infer": "infer", "chat": "chat",
            "cache-sim": "cache_sim", "bench": "bench", "serve": "serve"}  # name: module under colibri_format.cli


def test_every_command_module_is_registered_once():
    registered = {c.name: c.callback for c in app.registered_commands}
    assert set(registered) == set(COMMANDS)
    for name, module in COMMANDS.items():
        assert registered[name] is importlib.import_module(f"colibri_format.cli.{module}").command


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in COMMANDS:
        assert command in text


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"colibri-format {colibri_format.__version__}"


def test_no_arguments_shows_help(capsys):
    assert main([]) in (0, 2)                        # click >= 8.2 (and typer's copy of it) exits 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "inspect" in text and "Traceback" not in text


@pytest.mark.parametrize("args, needle", [(["inspect", "--bogus"], "--bogus"), (["inspect"], "Missing"),
                                          (["nonsense"], "nonsense"), (["infer", "f", "--max-new-tokens", "0"],
                                                                       "--max-new-tokens")])
def test_usage_errors_exit_2_without_traceback(capsys, args, needle):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_inspect_starts_without_heavy_modules(small_file):
    heavy = ("torch", "cupy", "safetensors", "tokenizers", "transformers", "colibri_format.convert",
             "colibri_format.runtime")
    code = (f"import sys, json; from colibri_format.cli import main; rc = main(['inspect', {small_file!r}, "
            f"'--json']); print(json.dumps([rc, [m for m in {heavy!r} if m in sys.modules]]), file=sys.stderr)")
    done = _run(code)
    rc, loaded = json.loads(done.stderr.strip().splitlines()[-1])
    assert rc == 0 and loaded == []


def test_module_entry_point(small_file):
    done = subprocess.run([sys.executable, "-m", "colibri_format", "validate", small_file, "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "valid" in done.stdout


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included), relative ones resolved."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_the_library_never_imports_the_cli():
    cli = PACKAGE / "cli"
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if cli not in p.parents and p.name != "__main__.py"
                 and any(m == "colibri_format.cli" or m.startswith("colibri_format.cli.") for m in _imports(p))]
    assert offenders == []


def test_command_modules_import_only_light_modules_at_start():
    allowed = {"__future__", "sys", "json", "os", "math", "pathlib", "typing", "re", "contextlib", "typer", "rich",
               "colibri_format.errors", "colibri_format.cli"}
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in top:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = "colibri_format" if node.level == 2 else "colibri_format.cli"
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.names[0].name if isinstance(node, ast.Import) else node.module
            assert any(name == a or name.startswith(a + ".") for a in allowed), f"{path.name}: {name}"
