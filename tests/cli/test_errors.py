"""The one error map: ColibriFormatError subclasses -> exit code and one line; the rest is not swallowed."""

import pytest
import typer

from colibri_format import errors as E
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
