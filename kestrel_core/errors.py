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
