"""The one error type that the command line turns into a clear line and exit code 2.

Anything a user can get wrong (a missing file, a bad config key, an incompatible checkpoint) raises
`PilotrunError` (or a subclass) with a message that names what and where. The CLI prints it without a
traceback; genuine bugs still raise ordinary exceptions so that they are not hidden.
"""


class PilotrunError(Exception):
    """Bad input or an incompatible state: reported as one line, exit code 2."""

    exit_code = 2


class ConfigError(PilotrunError):
    """A recipe that cannot be run: unknown key, wrong type, impossible geometry."""


class DataError(PilotrunError):
    """A data folder or source that is missing, damaged or inconsistent with its manifest."""


class CheckpointError(PilotrunError):
    """A checkpoint that is missing, uncommitted, damaged or incompatible with the run."""
