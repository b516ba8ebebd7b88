"""Output files (--csv, --plot, --profile, --png): checked before any work, written atomically.

A file is written to a temporary name beside it and renamed into place only when complete, so a
failed or interrupted run leaves an existing file byte for byte as it was. An output that is a
symbolic link is written through it: the temporary file goes beside the link's target and is
renamed onto the target, so the link stays a link.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tfcli.errors import TfcliError


@dataclass(frozen=True)
class Output:
    path: Path | None
    option: str  # e.g. "--csv"
    suffix: str | None = None  # required file-name ending, e.g. ".png"
    directory: bool = False  # --profile: a directory of files


def _writable_dir(path: Path, where: str) -> None:
    if not path.exists():
        raise TfcliError(f"{where}: no such directory {str(path)!r}")
    if not path.is_dir():
        raise TfcliError(f"{where}: {str(path)!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise TfcliError(f"{where}: cannot write in directory {str(path)!r} (permission denied)")


def check_outputs(*outputs: Output) -> None:
    """Refuse, before anything runs, an output that cannot be written: a directory where a file
    goes (or the reverse), a missing or read-only parent, a device, the wrong suffix, or two
    options naming the same path."""
    seen: dict[Path, str] = {}
    for out in outputs:
        if out.path is None:
            continue
        path, where = out.path, f"{out.option} {str(out.path)!r}"
        if not str(path).strip():
            raise TfcliError(f"{out.option} '': expected a file name")
        if out.suffix and path.suffix.lower() != out.suffix:
            raise TfcliError(f"{where}: the file name must end in {out.suffix}")
        if out.directory:
            if path.exists():
                if not path.is_dir():
                    raise TfcliError(f"{where}: exists and is not a directory")
                _writable_dir(path, out.option)
            else:
                _writable_dir(path.parent, where)
        else:
            if path.exists() or path.is_symlink():
                mode = os.stat(path).st_mode if path.exists() else 0
                if stat.S_ISDIR(mode):
                    raise TfcliError(f"{where}: is a directory; give a file name")
                if not stat.S_ISREG(mode):
                    raise TfcliError(f"{where}: not a regular file (a device, pipe or dangling "
                                     f"link); give a file name")
                if not os.access(path, os.W_OK):
                    raise TfcliError(f"{where}: exists and is not writable")
            _writable_dir(written_path(path).parent, where)  # where the temporary file goes
        key = path.resolve()
        if key in seen:
            raise TfcliError(f"{seen[key]} and {out.option} both name {str(path)!r}; give each "
                             f"output its own path")
        seen[key] = out.option


# Temporary files not yet renamed into place or removed: a run ended at once (a second Ctrl-C)
# removes them, so it leaves no stray ".name.XXXX.tmp" beside the outputs.
_PENDING: set[Path] = set()
# Directories the run made for outputs not yet written (--profile's): removed too, if empty
_MADE: set[Path] = set()


def remove_pending() -> None:
    for temp in list(_PENDING):
        try:
            os.unlink(temp)
        except OSError:
            pass
    _PENDING.clear()
    for directory in list(_MADE):
        try:
            directory.rmdir()  # only an empty one
        except OSError:
            pass
    _MADE.clear()


def made_directory(directory: Path, pending: bool = True) -> None:
    """``directory`` was made by this run and holds nothing written yet (or, ``pending``
    False, now holds an output): a run ended at once removes it if it is still empty."""
    if pending:
        _MADE.add(directory)
    else:
        _MADE.discard(directory)


def _pending(temp: Path, pending: bool = True) -> None:
    """``temp`` is (or no longer is) a temporary file to remove if the run ends at once: a
    second signal (remove_pending) or a crash in the model's code (its handler removes it)."""
    from tfcli.subjects.contain import remove_on_crash

    if pending:
        _PENDING.add(temp)
    else:
        _PENDING.discard(temp)
    remove_on_crash(temp, pending)


def written_path(path: Path) -> Path:
    """The file a write to ``path`` replaces: the target of a symbolic link (renaming onto the
    link would replace the link with a regular file), else ``path`` itself."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


class AtomicFile:
    """A file written under a temporary name in the target's directory; :meth:`commit` renames
    it into place, :meth:`discard` removes it. Either way the target is never half-written.
    ``path`` is the name the user gave (for messages); ``target`` is the file replaced, the
    link's target when ``path`` is a symbolic link."""

    def __init__(self, path: Path, newline: str | None = None) -> None:
        self.path = path
        self.target = written_path(path)
        fd, name = tempfile.mkstemp(dir=self.target.parent, prefix=f".{self.target.name}.",
                                    suffix=f".tmp{self.target.suffix}")
        self.temp = Path(name)
        _pending(self.temp)
        os.close(fd)
        self._file: IO[str] | None = None
        self._newline = newline
        self._also: list[Path] = []

    def also(self, temp: Path) -> None:
        """Another temporary file that the writer of ``temp`` (a library) may leave: removed
        with this one by :meth:`discard`, :meth:`commit` and :func:`remove_pending`."""
        self._also.append(temp)
        _pending(temp)

    def _drop_also(self) -> None:
        for temp in self._also:
            try:
                os.unlink(temp)
            except OSError:
                pass
            _pending(temp, False)

    def text(self) -> IO[str]:
        if self._file is None:
            self._file = self.temp.open("w", newline=self._newline, encoding="utf-8")
        return self._file

    def commit(self) -> None:
        if self._file is not None:
            self._file.close()
        mode = (os.stat(self.target).st_mode & 0o7777 if self.target.exists()
                else 0o666 & ~_umask())
        os.chmod(self.temp, mode)  # mkstemp makes 0600; keep the file's or the umask's
        os.replace(self.temp, self.target)
        _pending(self.temp, False)
        self._drop_also()

    def discard(self) -> None:
        try:
            if self._file is not None:
                self._file.close()
        except OSError:
            pass
        try:
            self.temp.unlink()
        except OSError:
            pass
        _pending(self.temp, False)
        self._drop_also()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
