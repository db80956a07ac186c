"""Directories and files named for the machine and process that made them, and the
removal of those whose process is gone: a process killed with kill -9 cannot remove its
own temporary directories (the token store's build and set-aside siblings, a bucket run's
local staging, a bucket object's copy on its way into the local cache), so the next
process that makes one of the same kind removes them first."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket

# This machine's name with every character outside [A-Za-z0-9_.] replaced, so that "-"
# separates HOST from PID unambiguously in the names below.
HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def tag() -> str:
    """`HOST-PID` of this process, for the names of the directories it makes."""
    return f"{HOST}-{os.getpid()}"


def remove_dead(parent: str, before: str, after: str) -> None:
    """Removes the directories and files in `parent` named `BEFORE-HOST-PID-AFTER`
    (`before` and `after` are regular expressions, HOST this machine's) whose process PID
    is no longer running. Other machines' (on a shared file system their PIDs mean nothing
    here) and live processes' are left."""
    pattern = re.compile(rf"(?:{before})-{re.escape(HOST)}-(\d+)-(?:{after})")
    for name in os.listdir(parent):
        match = pattern.fullmatch(name)
        if match and not alive(int(match.group(1))):
            path = os.path.join(parent, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
