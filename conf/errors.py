"""The project's one error family (DESIGN.md "Layout"): every error a user can cause and fix derives from
`FlashtrainError`. Its message is one line naming what was wrong and what to do; the launch tools print it
as `error: <message>` and exit with status 2 (flashtrain.config.cli `exit_on_user_error`, which every
`launch/*.py` main goes through; `FLASHTRAIN_DEBUG=1` or `HYDRA_FULL_ERROR=1` shows the traceback instead).

This is the bottom module: it imports nothing at all, and model/, data/, parallel/ and train/ may all import
it."""

EXIT_USER_ERROR = 2  # the exit status of a configuration or input error


class FlashtrainError(Exception):
    """A configuration, input, data or checkpoint problem the user can fix; the message says how."""


class ConfigError(FlashtrainError, ValueError):
    """A configuration value that cannot work (found before any process group or model is built)."""


class DataError(FlashtrainError, ValueError):
    """Training or evaluation data that cannot be read as configured (no shard, no tokenizer, ...)."""


class InputNotFoundError(DataError, FileNotFoundError):
    """A file or directory the configuration names does not exist (a shard pattern, a tokenizer, ...)."""


class CheckpointError(FlashtrainError, RuntimeError):
    """A checkpoint that cannot be written, found or trusted."""


USER_ERRORS = (FlashtrainError, FileNotFoundError)  # what a launch tool reports as one line
