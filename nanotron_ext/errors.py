"""The one base class of errors a user can fix: entry points print their message as one line, from one
rank, and exit with code 2 instead of showing a traceback per rank."""
from __future__ import annotations


class UserFacingError(Exception):
    """An error whose message alone says what is wrong (file, key, value) and what to do."""


class TrainingError(UserFacingError, RuntimeError):
    """Training cannot go on (a non-finite loss, a run folder in use); the message names the step or folder."""


class NoDenseEquivalent(UserFacingError, ValueError):
    """The model computes something no standard layout holds (nanotron_ext.models.dense); the message says which
    part and why, in one line."""
