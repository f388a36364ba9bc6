"""Domain errors. Library code raises these; only the CLI turns them into messages.

Each error carries what went wrong, where (file, line, row id, flag) and a hint
naming the flag or command that fixes it. `exit_code` is the process exit
status the CLI uses; the codes are documented in the README.
"""

from __future__ import annotations

import signal

EXIT_FATAL = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_ROW_ERRORS = 4
EXIT_MISMATCH = 5
EXIT_ENGINE = 6
EXIT_UNUSABLE = 7  # more than --max-unusable of the rows have no usable answer (output/flags.py)
EXIT_LOCKED = 75  # EX_TEMPFAIL: another run holds the output; try again later
# Stopped by a signal: the shell's convention, 128 + the signal's number.
EXIT_SIGHUP = 129
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class QbatchError(Exception):
    exit_code = EXIT_FATAL

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.where})" if self.where else self.message


class SpecError(QbatchError):
    """A flag, job-file key or combination of settings is invalid."""

    exit_code = EXIT_USAGE


class InputError(QbatchError):
    """An input file cannot be read as a whole (a bad row becomes an error row instead)."""

    exit_code = EXIT_INPUT


class ModelError(QbatchError):
    """The model or its tokenizer cannot be found or loaded."""

    exit_code = EXIT_INPUT


class CheckpointMismatch(QbatchError):
    """OUT_DIR holds results of a different configuration."""

    exit_code = EXIT_MISMATCH


class LockedError(QbatchError):
    """Another live run holds OUT_DIR."""

    exit_code = EXIT_LOCKED


class EngineError(QbatchError):
    """The inference engine failed; finished parts are kept and a rerun resumes."""

    exit_code = EXIT_ENGINE


class ServiceError(QbatchError):
    """The qbatch service a job was handed to (`--server`) cannot be reached, is no qbatch service, or its
    engines failed: as for an engine that failed, nothing ran or the finished parts are kept, and the same
    command resumes once the service is back (or without --server)."""

    exit_code = EXIT_ENGINE


class RemoteError(QbatchError):
    """An error a qbatch service answered for a job handed to it (`--server`): the message, place, hint
    and exit code the same job run here would have had."""

    def __init__(self, message: str, *, exit_code: int, where: str | None = None, hint: str | None = None):
        super().__init__(message, where=where, hint=hint)
        self.exit_code = exit_code


class OutputError(QbatchError):
    """OUT_DIR cannot be written (not a folder, disk full, permissions)."""

    exit_code = EXIT_FATAL


class MissingDependency(QbatchError):
    """An optional extra is not installed."""

    exit_code = EXIT_USAGE


class Stopped(QbatchError):
    """A run stopped at its caller's request (its `stop` was set): the rows finished by then are written, the
    run is recorded `interrupted`, and a rerun resumes. `reason`: why it was asked to stop."""

    def __init__(self, message: str, *, reason: str, where: str | None = None, hint: str | None = None):
        super().__init__(message, where=where, hint=hint)
        self.reason = reason


class RowError(Exception):
    """A problem with one row (its prompt, messages, id or sampling values); becomes an error row, never
    stops the batch. `kind` is the machine-readable error, `message` states the rule and the value."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, SIGHUP) stopped the run; finished parts are kept and a rerun resumes.

    A KeyboardInterrupt, not a QbatchError: no `except Exception` on its way up may swallow it.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum  # the shell's convention: EXIT_SIGINT, EXIT_SIGTERM, EXIT_SIGHUP


def first_line(exc: BaseException, limit: int = 500) -> str:
    """An exception's first line (library messages run to pages), for one-line reports."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:limit]


class StorageError(QbatchError):
    """An object store cannot be reached or used: no credentials, access denied, no such bucket, a missing
    library. The message never holds a credential (the store's own words, the URL, the hint)."""

    exit_code = EXIT_USAGE
