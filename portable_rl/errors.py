"""`UserError`: bad input (a name, a path, a file's content, a setting), not a bug in portable_rl.

The entry points (`train`, `evaluate`, `warmstart`, through `gin_utils.run`) print any `UserError` as one
line, `error: <message>`, and exit with status 1; every other exception keeps its traceback
(`PORTABLE_RL_TRACEBACK=1` shows it for a `UserError` too). So the message is the whole user interface:
say what was wrong and name the fix ("... ; set X to one of ...").

Each error class subclasses `UserError` together with the builtin that fits it (`ValueError`, `KeyError`,
`RuntimeError`, ...), so `except ValueError` in callers keeps working. This module imports nothing: every
layer uses it, the JAX side (learner_jax/, tis/) and the torch side (engines/) alike.
"""

from __future__ import annotations


class UserError(Exception):
    """Base class of every user-facing error: the CLI prints it as one line naming the fix."""


class ConfigError(UserError, ValueError):
    """A setting that is out of range, unknown, or unsupported on this machine (e.g. a memory knob)."""


class UnknownNameError(UserError, KeyError):
    """A name no registry knows (an engine, a reward); the message lists the known names."""

    def __str__(self):  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


# Builtin exceptions that also mean bad input (a path that is missing, a directory, unreadable).
FILE_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)

# What the entry points print as one line.
USER_ERRORS = (UserError,) + FILE_ERRORS
