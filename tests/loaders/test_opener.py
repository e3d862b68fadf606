"""loaders.opener: the one way a file of a cache or block map is opened (real links, FIFOs, sockets, devices)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from loaders.errors import FormatError, UnsafeFileError
from loaders.opener import folder_to_write, open_in, opened_in, read_fd, read_in

FIX = "the fix"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "root" / "sub" / "f").write_bytes(b"inside")
    (tmp_path / "outside").write_bytes(b"secret")
    return tmp_path / "root"


def test_a_regular_file_inside_opens(root: Path) -> None:
    assert read_in(root, "sub/f", FIX, 100) == b"inside"
    with opened_in(root, "./sub//f", FIX) as (fd, st):
        assert st.st_size == 6 and os.pread(fd, 6, 0) == b"inside"


def test_the_root_itself_may_be_reached_through_a_link(root: Path, tmp_path: Path) -> None:
    (tmp_path / "alias").symlink_to(root)
    assert read_in(tmp_path / "alias", "sub/f", FIX, 100) == b"inside"


@pytest.mark.parametrize("rel", ["f", "sub/f"])
def test_a_symlinked_file_is_refused(root: Path, tmp_path: Path, rel: str) -> None:
    (root / rel).unlink(missing_ok=True)
    (root / rel).symlink_to(tmp_path / "outside")
    with pytest.raises(
        UnsafeFileError,
        match=f"{root / rel}: is a symlink, not a regular file; refused .links are never followed.; the fix",
    ):
        read_in(root, rel, FIX, 100)


def test_a_symlinked_folder_is_refused(root: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_bytes(b"secret")
    (root / "sub" / "f").unlink()
    (root / "sub").rmdir()
    (root / "sub").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeFileError, match=f"{root / 'sub'}: is a symlink, where a folder"):
        read_in(root, "sub/f", FIX, 100)


def test_a_fifo_is_refused_without_blocking(root: Path) -> None:
    os.mkfifo(root / "fifo")
    keep = os.open(root / "fifo", os.O_RDWR)  # a writer: an open that forgot O_NONBLOCK returns, never hangs the test
    try:
        with pytest.raises(UnsafeFileError, match=f"{root / 'fifo'}: is a FIFO, not a regular file.*the fix"):
            read_in(root, "fifo", FIX, 100)
    finally:
        os.close(keep)


def test_a_socket_a_device_and_a_folder_are_refused(root: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(root / "sock"))
        with pytest.raises(UnsafeFileError, match="is a socket"):
            read_in(root, "sock", FIX, 100)
    with pytest.raises(UnsafeFileError, match="/dev/null: is a character device"):
        read_in("/dev", "null", FIX, 100)
    with pytest.raises(UnsafeFileError, match="is a folder"):
        read_in(root, "sub", FIX, 100)


@pytest.mark.parametrize("rel", ["../outside", "/etc/passwd", "sub/../../outside", ""])
def test_names_leaving_the_root_are_refused(root: Path, rel: str) -> None:
    with pytest.raises(UnsafeFileError, match="does not stay inside"):
        read_in(root, rel, FIX, 100)


def test_the_size_is_bounded_before_reading(root: Path) -> None:
    (root / "big").touch()
    os.truncate(root / "big", 1 << 40)  # sparse: no bytes stored
    with pytest.raises(UnsafeFileError, match=r"big: 1099511627776 bytes, over the 100 bytes"):
        read_in(root, "big", FIX, 100)


def test_a_file_truncated_while_read_is_named(root: Path) -> None:
    with opened_in(root, "sub/f", FIX) as (fd, st):
        os.truncate(root / "sub" / "f", 2)
        with pytest.raises(UnsafeFileError, match="sub/f: ends after 2 bytes, 6 expected.*the fix"):
            read_fd(fd, st.st_size, str(root / "sub" / "f"), FIX)


def test_a_missing_file_is_file_not_found_and_refusals_are_format_errors(root: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_in(root, "nothing", FIX)
    assert issubclass(UnsafeFileError, FormatError)


def test_a_folder_to_write_is_made_part_by_part_and_held(root: Path) -> None:
    fd = folder_to_write(root, "new/deeper", FIX)
    try:
        os.rename(root / "new", root / "moved")  # a swap after the open redirects nothing written relative to it
        os.symlink(root.parent, root / "new")
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
            f.write(b"x")
    finally:
        os.close(fd)
    assert (root / "moved" / "deeper" / "f").read_bytes() == b"x"
    assert not (root.parent / "deeper").exists()


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_folder_to_write_where_a_link_or_file_lies_is_refused(root: Path, planted: str) -> None:
    os.symlink(root.parent, root / "out") if planted == "symlink" else (root / "out").write_bytes(b"")
    with pytest.raises(UnsafeFileError) as info:
        folder_to_write(root, "out/shards", FIX)
    message = str(info.value)
    assert message.startswith(f"{root / 'out'}: is a {planted if planted == 'symlink' else 'regular file'}")
    assert message.endswith(FIX) and "\n" not in message
    assert not (root.parent / "shards").exists()
