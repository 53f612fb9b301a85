"""User-facing errors: the CLI prints their message without a traceback and exits with status 2."""


class TandemError(Exception):
    """Base class for errors whose message is meant for the user."""


class InvalidArgument(TandemError, ValueError):
    """A request or configuration value is out of range; the message names the field."""


class ModelNotFound(TandemError):
    """A model argument is not a registry name, a local directory, a GGUF file or a reachable hub id."""


class IncompatibleModels(TandemError):
    """Draft and target cannot be paired (different tokenizers or vocabularies)."""


class DownloadError(TandemError):
    """Fetching model parts failed; nothing half-made is left in the cache."""


class IntegrityError(TandemError):
    """An assembled file does not match its pinned checksum."""
