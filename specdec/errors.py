"""Domain errors raised anywhere in specdec; `specdec.serving` maps each to one gRPC status."""


class SpecdecError(Exception):
    """Base class; the message is shown to the client as is, so make it actionable."""


class InvalidRequestError(SpecdecError):
    """The request cannot be served as given (INVALID_ARGUMENT)."""


class CapacityError(SpecdecError):
    """Not enough KV cache or slots right now (RESOURCE_EXHAUSTED)."""


class IncompatibleModelsError(SpecdecError):
    """The draft and the target cannot work together (FAILED_PRECONDITION)."""


class UnsupportedModelError(SpecdecError):
    """A model the runtime cannot run (FAILED_PRECONDITION)."""


class ServiceUnavailableError(SpecdecError):
    """A backend service cannot be reached (UNAVAILABLE)."""


class NotFoundError(SpecdecError):
    """A named thing (e.g. a draft model) is not there (NOT_FOUND)."""


class PermissionDeniedError(SpecdecError):
    """An admin operation without the right token (PERMISSION_DENIED)."""
