"""The CLI's two consoles: results on stdout, errors, progress and statistics on stderr (one module both the
commands and the error map print through, so neither imports the other for it)."""

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)       # results: tables, generated text
err = Console(stderr=True, highlight=False)          # errors, progress bars, statistics
