"""The one error type of checkpoint resolution and loading."""


class CheckpointError(ValueError):
    """A checkpoint could not be found, read, or matched to the model configuration."""
