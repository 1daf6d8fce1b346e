"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class KestrelNote(UserWarning):
    """Something a user should know that is not an error (warnings.warn it); the CLI prints notes after a
    command's output, and drops them when the command fails, so that an error stays one line."""


class KestrelError(Exception):
    """A problem with the user's input or environment; the message names it and the fix."""


class CheckpointError(KestrelError):
    """The checkpoint on disk is truncated, corrupt, or does not match config.json."""


class ConfigError(KestrelError):
    """A config file, flag or config.json field is wrong."""


class PluginError(KestrelError):
    """A plugin is unknown, misspelt, or broke the residency contract."""


class BudgetError(KestrelError):
    """A memory budget is too small for the work, or the device ran out of memory."""


class NonFiniteError(KestrelError):
    """A computed value went NaN or inf; generation stops rather than emit meaningless ids."""


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C), SIGTERM or SIGHUP, with what the interrupted work left behind when that matters.

    A KeyboardInterrupt, so that every ``finally`` and ``except KeyboardInterrupt`` cleans up as for
    Ctrl-C. ``what`` is the CLI's line with ``{}`` for the word ("interrupted", "terminated", "hung up"),
    e.g. ``"{}: the old model in m is intact"``; the CLI exits with 128 + ``signum``, as a shell reports it.
    """

    WORDS = {1: "hung up", 15: "terminated"}  # SIGHUP, SIGTERM; anything else is Ctrl-C's

    def __init__(self, signum: int = 2, what: str = "{}"):
        self.signum = signum
        super().__init__(what.format(self.WORDS.get(signum, "interrupted")))

    @classmethod
    def of(cls, exc: BaseException, what: str) -> "Interrupted":
        """``exc`` (a plain KeyboardInterrupt is SIGINT) told with ``what``."""
        return cls(getattr(exc, "signum", 2), what)
