"""The folders `prep cache` writes into, held open: every file is made, opened, renamed and removed relative to them.

`check_output` looks at the output before the run takes its lock, but a folder checked then may be swapped for a
symlink to a folder elsewhere later (`shards/` -> /elsewhere mid-run): a write by path would follow it. So each
folder is opened once (`O_DIRECTORY | O_NOFOLLOW`, relative to the output's own descriptor) and every write names
its file relative to that descriptor (`dir_fd=`): a later swap of a path redirects nothing. Worker processes
cannot inherit descriptors, so each task opens its own and compares their (st_dev, st_ino) with the ones the
run opened (`OutputDirs.ids`, passed down in the task's spec); a folder that differs is refused in one line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from loaders.opener import made_folder
from prep.errors import UnsafeOutputError

_FIX = "remove it, or choose another --output (prep cache never writes through a link)"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
Ids = tuple[tuple[str, int, int], ...]  # (folder name, "" for the output; st_dev; st_ino)


class OutputDirs:
    """Descriptors of the output folder ("") and of its subfolders (`fd(name)`, made if missing), opened once.

    `ids`: the identities the run opened them with (a worker's check); a folder that is another one now (swapped
    since) is an UnsafeOutputError naming it. A context manager: the descriptors close with it."""

    def __init__(self, root: str | os.PathLike[str], ids: Ids = ()) -> None:
        self.root = Path(root)
        self._want = {name: (dev, ino) for name, dev, ino in ids}
        self._fds: dict[str, int] = {}
        # the output itself is the user's argument and may be reached through links; nothing below it may
        self._fds[""] = self._checked("", os.open(self.root, _DIR))

    def fd(self, name: str = "") -> int:
        """The descriptor of the output ("") or of its folder `name`, created (mode 0755) where missing."""
        if name not in self._fds:

            def refuse(what: str) -> Exception:
                return UnsafeOutputError(f"{self.root / name}: is {what} now (swapped during the run), where "
                                         f"`prep cache` writes a folder; refused; {_FIX}")  # fmt: skip

            self._fds[name] = self._checked(name, made_folder(name, self._fds[""], refuse))
        return self._fds[name]

    def _checked(self, name: str, fd: int) -> int:
        st = os.fstat(fd)
        want = self._want.get(name)
        if stat.S_ISDIR(st.st_mode) and (want is None or want == (st.st_dev, st.st_ino)):
            return fd
        os.close(fd)
        raise UnsafeOutputError(f"{self.root / name if name else self.root}: is not the folder this `prep cache` "
                                f"run opened at start-up (replaced during the run); refused; {_FIX}")  # fmt: skip

    def ids(self) -> Ids:
        """(name, st_dev, st_ino) of every folder opened so far, for tasks in other processes."""
        return tuple((name, *_identity(fd)) for name, fd in sorted(self._fds.items()))

    def close(self) -> None:
        """Close every descriptor."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> OutputDirs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
