"""The one error map: ColibriFormatError subclasses -> exit code and one line; the rest is not swallowed."""

import json
from pathlib import Path

import pytest
import typer

from colibri_format import errors as E
from colibri_format.cli import app
from colibri_format.cli.errors import (EXIT_INTERRUPTED, EXIT_INVALID, EXIT_UNREADABLE, exit_code_for,
                                       message_for, report)


@pytest.mark.parametrize("kind, code", [(E.NotARegularFile, EXIT_UNREADABLE), (E.BadMagic, EXIT_INVALID),
                                        (E.CorruptExpert, EXIT_INVALID), (E.InvalidInput, EXIT_INVALID),
                                        (E.TokenIdOutOfRange, EXIT_INVALID), (E.WriteError, EXIT_INVALID),
                                        (E.ColibriFormatError, EXIT_INVALID)])
def test_exit_codes(kind, code):
    assert exit_code_for(kind("x")) == code


def test_report_prints_one_line_and_a_hint(capsys, monkeypatch):
    monkeypatch.delenv("COLIBRI_DEBUG", raising=False)
    exc = E.BadMagic("bad magic [red]", field="magic", value=b"GGUF")
    assert report(exc) == EXIT_INVALID
    err = capsys.readouterr().err
    assert f"error: {message_for(exc)}" in err                     # markup in the message is shown as text
    assert "COLIBRI_DEBUG=1" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_debug_reraises(monkeypatch):
    monkeypatch.setenv("COLIBRI_DEBUG", "1")
    with pytest.raises(E.CorruptHeader):
        report(E.CorruptHeader("x"))


def test_exit_interrupt_and_bugs():
    assert report(typer.Exit(3)) == 3
    assert report(KeyboardInterrupt()) == EXIT_INTERRUPTED
    with pytest.raises(ZeroDivisionError):                         # a bug keeps its traceback
        report(ZeroDivisionError("boom"))


def test_main_maps_library_errors(tmp_path, capsys, monkeypatch):
    from colibri_format.cli import main

    monkeypatch.setenv("COLIBRI_DEBUG", "1")
    with pytest.raises(E.NotARegularFile):
        main(["inspect", str(tmp_path)])
    monkeypatch.delenv("COLIBRI_DEBUG")
    assert main(["inspect", str(tmp_path)]) == EXIT_UNREADABLE


# --- usage errors of both click flavours, interrupts, JSON ------------------------------------------------------

def _usage_errors():
    """The same usage errors raised by click itself and by the app as installed (typer 0.2x: the copy of click
    vendored as typer._click; older typer: click)."""
    import click
    from typer.main import get_command

    from colibri_format.cli import app

    ctx = click.Context(click.Command("infer"), info_name="colibri infer")
    cases = [("click", click.exceptions.NoSuchOption("--bogus", ctx=ctx), "--bogus"),
             ("click", click.exceptions.BadParameter("nope", ctx=ctx, param=click.Option(["--top-p"])), "nope"),
             ("click", click.exceptions.MissingParameter(ctx=ctx, param=click.Argument(["path"])), "Missing")]
    group = get_command(app)
    for argv, needle in ((["infer", "f", "--bogus"], "--bogus"), (["infer", "f", "--top-p", "0"], "(0, 1]"),
                         (["infer"], "path")):
        try:
            group.main(argv, standalone_mode=False, prog_name="colibri")
        except Exception as exc:                     # noqa: BLE001 - the usage error the app raises
            cases.append((type(exc).__module__, exc, needle))
    return cases


@pytest.mark.parametrize("flavour, exc, needle", _usage_errors(), ids=lambda v: v if isinstance(v, str) else "")
def test_usage_errors_of_either_click_are_one_line_without_hint(capsys, flavour, exc, needle):
    assert report(exc) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("error: ") and needle.lower() in line.lower() and "'colibri infer --help'" in line
    assert captured.out == ""


def test_click_exit_and_abort_of_either_flavour():
    import click

    assert report(click.exceptions.Exit(4)) == 4
    assert report(click.exceptions.Abort()) == EXIT_INTERRUPTED


def test_errors_as_json_with_their_fields(capsys):
    exc = E.BadMagic("not a .colibri file", field="magic", value=b"GGUF", offset=0)
    assert report(exc, ["inspect", "x.colibri", "--json"], app) == EXIT_INVALID
    captured = capsys.readouterr()
    assert captured.err == ""
    assert json.loads(captured.out) == {"error": {"type": "BadMagic", "message": "not a .colibri file",
                                                  "field": "magic", "value": "b'GGUF'", "offset": 0}}
    assert report(E.InvalidInput("x", value=float("nan")), ["infer", "f", "--json"], app) == EXIT_INVALID
    assert json.loads(capsys.readouterr().out)["error"]["value"] == "nan"          # still valid JSON


def test_json_is_read_from_the_parsed_command_line(capsys):
    # "--json" as the value of --prompt is a prompt, not the flag
    assert report(E.InvalidInput("bad"), ["infer", "f", "--prompt", "--json"], app) == EXIT_INVALID
    assert capsys.readouterr().out == ""


def test_os_errors_are_one_line_with_the_hint(capsys, monkeypatch):
    monkeypatch.delenv("COLIBRI_DEBUG", raising=False)
    assert report(OSError(28, "No space left on device", "/data/t.jsonl")) == EXIT_INVALID
    assert capsys.readouterr().err.splitlines() == ["error: No space left on device: /data/t.jsonl",
                                                    "set COLIBRI_DEBUG=1 for a full traceback"]


def test_interrupt_notes_say_what_was_kept(capsys):
    argv = ["convert", "--model-path", "ckpt", "--output-path", "out/model.colibri"]
    assert report(KeyboardInterrupt(), argv, app) == EXIT_INTERRUPTED
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("interrupted: ") and ".model.colibri.part" in line and "--restart" in line
    assert report(KeyboardInterrupt(), ["infer", "m.colibri", "--ids", "1", "--trace", "t.jsonl"], app) == 130
    assert "routing trace so far is kept in t.jsonl" in capsys.readouterr().err


def test_a_command_can_register_its_interrupt_note(capsys, monkeypatch):
    from colibri_format.cli import errors

    monkeypatch.setitem(errors.INTERRUPT_NOTES, "convert", errors.INTERRUPT_NOTES["convert"])
    errors.on_interrupt("convert", lambda params: f"resume {Path(str(params['output_path'])).name}")
    assert report(KeyboardInterrupt(), ["convert", "--output-path", "o.colibri"], app) == 130
    assert capsys.readouterr().err.strip() == "interrupted: resume o.colibri"


def test_ctrl_c_inside_a_command_is_one_line_and_130(small_file, capsys, monkeypatch):
    import colibri_format.inspect as inspect_lib
    from colibri_format.cli import main

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(inspect_lib, "inspect_file", interrupted)
    assert main(["inspect", small_file]) == EXIT_INTERRUPTED          # not typer's silent 130, not "Aborted!"
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["interrupted: nothing was written"] and captured.out == ""


def test_ctrl_c_in_convert_says_how_to_resume(tmp_path, capsys, monkeypatch):
    from colibri_format.cli import main
    from colibri_format.convert import pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "convert", interrupted)
    assert main(["convert", "--model-path", str(tmp_path), "--output-path", str(tmp_path / "o.colibri"),
                 "--quiet"]) == 130
    (line,) = capsys.readouterr().err.splitlines()
    assert ".o.colibri.part" in line and "run the same command again to resume" in line
