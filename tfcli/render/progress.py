"""Progress of a long step on stderr, only where stderr is a terminal (as bench's bar): a
spinner, what is being done, and the time so far. Pipes, files and tests see nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def working(text: str) -> Iterator[Callable[[str], None]]:
    """``with working("building the model on cpu") as say: …; say("running forward")``."""
    from rich.console import Console

    console = Console(stderr=True, markup=False)
    if not console.is_terminal:
        yield lambda _text: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(text, total=None)
        yield lambda new: progress.update(task, description=new)


def cells_bar():
    """bench's bar on stderr: what is being measured, cells done of all, time so far and left
    (transient: the record lines printed above it stay)."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True, markup=False), transient=True)
