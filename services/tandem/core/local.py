"""In-process drafter and verifier over ModelRunners: the same roles the distributed workers play."""

from tandem.core.local_drafter import LocalDrafter
from tandem.core.local_verifier import LocalVerifier

__all__ = ["LocalDrafter", "LocalVerifier"]
