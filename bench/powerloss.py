"""Simulated power loss: keep only what fsync made durable, discard everything else.

    with PowerLoss(root) as pl:       # patches os.fsync for the whole process
        ... write through the real code ...
        pl.image(dest)                # the tree a machine would find after losing power now

The model (pessimistic, like ext4 without data=journal): a file's bytes survive up to
its last `fsync` (what the file held at that moment); a directory entry (a name for a
file or folder, after a create or rename) survives only if the directory was fsynced
while the entry was there. Everything is tracked by inode, so a rename that was never
followed by an fsync of its folder loses the new name. `root` itself is durable; its
entries follow the same rule. Used by tests/test_power_loss.py and `bench faults`.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path


class PowerLoss:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root_ino = self.root.stat().st_ino
        self.files: dict[int, bytes] = {}  # inode -> bytes at its last fsync
        self.dirs: dict[int, dict[str, tuple[int, bool]]] = {}  # dir inode -> {name: (inode, is_dir)} at fsync
        self.fsyncs = 0
        self._lock = threading.Lock()
        self._real = os.fsync

    def __enter__(self) -> PowerLoss:
        os.fsync = self.fsync
        return self

    def __exit__(self, *exc) -> None:
        os.fsync = self._real

    def fsync(self, fd: int) -> None:
        self._real(fd)
        st = os.fstat(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        with self._lock:
            self.fsyncs += 1
            if stat.S_ISDIR(st.st_mode):
                entries = {}
                for entry in os.scandir(path):
                    entries[entry.name] = (entry.inode(), entry.is_dir(follow_symlinks=False))
                self.dirs[st.st_ino] = entries
            else:
                with open(path, "rb") as fh:
                    self.files[st.st_ino] = fh.read(st.st_size)

    def image(self, dest: str | Path) -> Path:
        """Write the durable state of `root` into the empty folder `dest`; returns dest."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._copy(self.root_ino, dest)
        return dest

    def _copy(self, dir_ino: int, dest: Path) -> None:
        for name, (ino, is_dir) in self.dirs.get(dir_ino, {}).items():
            if is_dir:
                (dest / name).mkdir()
                self._copy(ino, dest / name)
            else:
                (dest / name).write_bytes(self.files.get(ino, b""))
