"""Hugging Face hub ids and their pinned revisions: `org/name@<40-hex commit>`.

A hub id without a commit loads whatever its branch points to at load time, so the weights (and tokenizer) can change
under a running deployment, or differ between the workers that load them at different moments. A commit hash is the
only immutable hub revision (a branch or tag can be moved), so tandem requires one unless the operator passes
--allow-unpinned, and even then resolves the branch to its commit once, at start, and loads that commit everywhere.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from tandem.errors import InvalidArgument, ModelNotFound
from tandem.models.registry import PAIRS, REGISTRY

log = logging.getLogger(__name__)

ALLOW_UNPINNED_FLAG = "--allow-unpinned"
HUB_PROBE_TIMEOUT_S = 3.0
_COMMIT = re.compile(r"^[0-9a-fA-F]{40}$")
# The hub's own rule: letters, digits, '-', '_', '.', at most one '/' (org/name or a legacy name).
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
FIND_COMMIT = "python -c \"from huggingface_hub import HfApi; print(HfApi().model_info('{repo}').sha)\""


@dataclass(frozen=True, slots=True)
class HubRef:
    """A hub id split at '@': the repository and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    @property
    def pinned(self) -> bool:
        return self.revision is not None and bool(_COMMIT.match(self.revision))

    def spec(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_hub_id(spec: str) -> HubRef | None:
    """`org/name` or `org/name@revision` -> HubRef (a full commit hash in lower case); None if it is neither."""
    repo_id, at, revision = spec.partition("@")
    if not _REPO_ID.match(repo_id) or (at and not revision) or "@" in revision:
        return None
    if _COMMIT.match(revision):
        revision = revision.lower()
    return HubRef(repo_id, revision or None)


def looks_local(spec: str) -> bool:
    """A spec written as a path (it may not exist): never a hub id."""
    return spec.startswith(("/", ".", "~")) or spec.endswith(".gguf")


def hub_ref(spec: str) -> HubRef | None:
    """The hub id `spec` names, or None for a registry name, a pair alias, a path or something else."""
    if spec in REGISTRY or spec in PAIRS or looks_local(spec) or Path(spec).expanduser().exists():
        return None
    return parse_hub_id(spec)


def _hub_reachable() -> bool:
    """Fail fast where the hub is unreachable, instead of sitting through huggingface_hub's retries."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def hub_local_only() -> bool:
    """Whether hub files must come from the local hub cache: HF_HUB_OFFLINE is set, or the hub is unreachable."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return offline or not _hub_reachable()


def hub_not_found(local_only: bool) -> str:
    where = "the local hub cache (hub unreachable or offline)" if local_only else "the hub"
    return f"not a registry name or local path, and not found in {where}"


def unpinned_error(spec: str, ref: HubRef) -> InvalidArgument:
    asked = f" ({ref.revision!r} is a branch, a tag or a short hash, not a fixed commit)" if ref.revision else ""
    # A bare name is more often a mistyped registry name than one of the hub's few legacy top-level models.
    registry = "" if "/" in ref.repo_id else f"not a registry model ({', '.join(REGISTRY)}), so read as a hub id; "
    return InvalidArgument(
        f"model {spec!r}: {registry}a Hugging Face hub id must be pinned to a full commit hash{asked}, or what it "
        f"loads can change between loads; give {ref.repo_id}@<40-hex commit> (find the current one with "
        f"`{FIND_COMMIT.format(repo=ref.repo_id)}` or on the model page's commit history), or pass "
        f"{ALLOW_UNPINNED_FLAG} to load the commit the hub serves now (resolved once at start and logged)")


def require_pinned(spec: str, ref: HubRef, allow_unpinned: bool) -> None:
    if not ref.pinned and not allow_unpinned:
        raise unpinned_error(spec, ref)


def current_commit(ref: HubRef, *, local_files_only: bool) -> str:
    """The commit `ref`'s revision (default: main) points to now, from the hub or, offline, the local hub cache.

    Asking for config.json returns its path in the cache's snapshots/<commit>/ folder (the hub cache's documented
    layout), which names the commit without another API call and works the same offline.
    """
    from huggingface_hub import hf_hub_download

    path = Path(hf_hub_download(ref.repo_id, "config.json", revision=ref.revision,
                                local_files_only=local_files_only))
    commit = path.parent.name
    if not _COMMIT.match(commit):
        raise ModelNotFound(f"model {ref.spec()!r}: could not tell which commit the hub serves (got {commit!r}); "
                            "pin one: org/name@<40-hex commit>")
    return commit.lower()


def pin(spec: str, ref: HubRef, *, local_files_only: bool) -> HubRef:
    """An unpinned ref resolved to its current commit, logged so that the operator can pin it next time."""
    if ref.pinned:
        return ref
    commit = current_commit(ref, local_files_only=local_files_only)
    log.warning("model %s is not pinned (%s): loading its current commit, %s@%s", spec, ALLOW_UNPINNED_FLAG,
                ref.repo_id, commit)
    return HubRef(ref.repo_id, commit)


def pin_spec(spec: str, *, allow_unpinned: bool = False) -> str:
    """`spec` with a hub id pinned to a commit: as given when it is pinned already or not a hub id; an unpinned hub
    id is refused, or with `allow_unpinned` resolved to `org/name@<commit it points to now>`. Commands pin their
    model arguments once at start, so that every process that loads them (Ray workers too) loads the same commit."""
    ref = hub_ref(spec)
    if ref is None or ref.pinned:
        return spec
    require_pinned(spec, ref, allow_unpinned)
    local_only = hub_local_only()
    try:
        return pin(spec, ref, local_files_only=local_only).spec()
    except ModelNotFound:
        raise
    except Exception as exc:  # hub errors come as OSError, ValueError, HTTP errors and more
        raise ModelNotFound(f"model {spec!r}: {hub_not_found(local_only)}") from exc
