"""The two errors a user can cause; the CLI turns both into one line and exit code 2."""


class InputError(ValueError):
    """Bad user input: an unknown preset, a malformed file, an impossible option."""

    exit_code = 2
    """What the command line exits with after printing the message (a subclass for a
    failure that is not the user's input, such as a dead peer, says 1)."""


class InfeasiblePlan(InputError):
    """A batch that no plan can run on the cluster (a document larger than the memory of
    every group that could hold it). The message names the document and the limit."""
