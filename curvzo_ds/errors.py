"""Every exception a run stops with, and the exit codes the CLI maps them to (docs/contracts.md).

A `RunEnded` states its reason in one line; the CLI prints that line and exits with its `exit_code`. A
`ConfigError` is a bad input (exit 2) and names the key, the value and the fix.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # the run stopped for a reason it states (a non-finite loss, a failed checkpoint write, ...)
EXIT_BAD_INPUT = 2  # a bad configuration value, a missing file: nothing was trained
EXIT_PREEMPTED = 3  # stopped on a signal after saving a checkpoint: resume with --resume (or requeue)
EXIT_DIVERGED = 4  # the run diverged (on_divergence=stop, or its rollbacks spent): its checkpoints are intact


class RunEnded(RuntimeError):
    """A run stopped for a reason it states in one line (the CLI prints it and exits with `exit_code`)."""

    exit_code = EXIT_FAILED


class RanksDisagree(RunEnded):
    """Ranks that must agree (on the configuration, the model, the noise kernel, the data or the ZO state) do not."""


class NonFiniteLossError(RunEnded):
    """Raised after `max_consecutive_skips` steps in a row had a non-finite loss."""


class CheckpointWriteError(RunEnded):
    """A checkpoint could not be written on some rank (disk full, permissions): the previous ones are intact."""


class Preempted(RunEnded):
    """The run stopped on a signal at a step boundary, after saving its checkpoint."""

    exit_code = EXIT_PREEMPTED


class Diverged(RunEnded):
    """The run diverged and on_divergence says stop (or its max_rollbacks are spent): train/divergence.py."""

    exit_code = EXIT_DIVERGED


class ConfigError(ValueError):
    """A bad configuration value. The message names the key, the value and the fix."""


class RateRefused(ConfigError):
    """learning_rate=auto measured no rate it can serve (algo/rate.py's `line_rate`): set learning_rate to a number
    or change what the message names."""
