"""User-facing errors: the CLI prints their message without a traceback and exits with status 2."""

from __future__ import annotations

from collections.abc import Iterable


class TandemError(Exception):
    """Base class for errors whose message is meant for the user."""


class InvalidArgument(TandemError, ValueError):
    """A request or configuration value is out of range; the message names the field."""


def request_id_in_use(request_id: str) -> InvalidArgument:
    return InvalidArgument(f"request_id: {request_id!r} is already running")


def check_in_vocabulary(field: str, ids: Iterable[int], vocab_size: int) -> None:
    """InvalidArgument naming `field` where an id is no token of a vocabulary of `vocab_size`."""
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise InvalidArgument(f"{field}: {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")


class ContextLengthExceeded(InvalidArgument):
    """A prompt, or a prompt and its max_tokens, past the model's context window (OpenAI's context_length_exceeded,
    which clients such as litellm act on: they trim the conversation or move to a model of a longer context)."""


class ModelNotFound(TandemError):
    """A model argument is not a registry name, a local directory, a GGUF file or a reachable hub id."""


class IncompatibleModels(TandemError):
    """Draft and target cannot be paired (different tokenizers or vocabularies)."""


class DownloadError(TandemError):
    """Fetching model parts failed; nothing half-made is left in the cache."""


class IntegrityError(TandemError):
    """An assembled file does not match its pinned checksum."""


class WorkerStartFailed(TandemError):
    """A worker raised a user-facing error while it started (its model failed its checks, an argument was bad)."""


class BackendUnavailable(TandemError):
    """No worker of a pool can serve now (all failed, restarting or stopped): retry later."""


class RequestRefused(InvalidArgument):
    """One request cannot go on, for a reason of its own (its response format failed on a worker, its sequence
    outgrew the KV budget): that request fails, and the requests batched with it go on without it."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id

    def __reduce__(self):  # rebuilt from both arguments wherever it is unpickled (Exception's keeps the message only)
        return type(self), (self.request_id, str(self))


class KVBudgetExceeded(RequestRefused):
    """One request's sequence needs more KV cache than a worker's whole budget: it can never run, alone or not."""

    def __init__(self, request_id: str, needed: int, capacity: int) -> None:
        super().__init__(request_id, f"request {request_id}: its sequence needs {needed} KV cache tokens, more than "
                         f"this server's budget of {capacity} (--kv-tokens); shorten the prompt or max_tokens")
        self.needed, self.capacity = needed, capacity

    def __reduce__(self):
        return type(self), (self.request_id, self.needed, self.capacity)
