"""Graceful stop on SIGTERM (preemption, `scancel`, `kill`): finish the step, checkpoint, exit cleanly.

The first SIGTERM only sets a flag; the training loop checks it after each complete step (generate,
train, push), saves a checkpoint of that step and returns, so rerunning the same command resumes there.
A second SIGTERM while the step is still running restores the previous handler and re-sends the signal:
a scheduler that escalates is never ignored. `kill -9` cannot be caught; resuming then starts from the
newest *committed* checkpoint (learner_jax/checkpoint.py writes the COMMITTED marker last).
"""

from __future__ import annotations

import os
import signal
import threading


class StopRequest:
    """Context manager: `requested` turns True after SIGTERM (only installed in the main thread)."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum, self.requested, self._previous = signum, False, None

    def _handle(self, signum, frame):
        if self.requested:  # asked twice: stop now, the way the previous handler would
            signal.signal(self.signum, self._previous or signal.SIG_DFL)
            os.kill(os.getpid(), self.signum)
            return
        self.requested = True
        print(f"[train] received {signal.Signals(signum).name}: finishing this step, then checkpointing "
              "and exiting (send it again to stop at once)", flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None
