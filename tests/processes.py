"""Process helpers for tests that launch and kill runs."""

import os


def alive(pid: int) -> bool:
    """True while a process with `pid` exists (a zombie counts until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
