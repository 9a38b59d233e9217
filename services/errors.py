"""Errors that are the user's to fix, kept apart from bugs so the command line can tell them apart.

`UserInputError` is bad input — a config field, a path, a file or one line of it — with a message
that names it and says what was expected. `threepo` prints it as one line and exits 2 (the
traceback only with `--debug`); anything else is a bug or an infrastructure failure and keeps its
traceback. Services raise these where they read the input; nothing here imports anything.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """Bad input from the user; the message names the field, file or line and what was expected."""


class MissingPathError(UserInputError, FileNotFoundError):
    """A path given by the user (a checkpoint, a dataset, a run directory) that is not there."""
