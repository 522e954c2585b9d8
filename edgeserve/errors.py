"""Errors that front ends turn into one clear message (CLI line, HTTP 4xx body)."""


class EdgeserveError(Exception):
    """Base for errors a user can act on; the message is shown as is."""


class ModelLoadError(EdgeserveError):
    """A model file or folder is missing, corrupt, or of an unsupported kind."""


class ModelNotFoundError(ModelLoadError):
    """No catalog entry, local path or reachable hub id matches the name."""


class PromptTooLongError(EdgeserveError):
    """A prompt does not fit in the model's context or the KV pool."""


class GroupLostError(EdgeserveError):
    """A rank of a model split across processes is gone, so no step can run again."""
