"""Canary arms in the gateway: sticky weighted assignment of sessions to arms (draft model, target, speculation
overrides), weights shared through Redis, per-arm metrics, and automatic stepwise promotion or rollback."""

from tandem.canary.analysis import HOLD, PROMOTE, ROLLBACK, Thresholds, Verdict, evaluate, judge
from tandem.canary.arms import ENV_ARMS, ArmSpec, arms_from_env, parse_arms
from tandem.canary.assignment import Assignment
from tandem.canary.controller import CanaryController
from tandem.canary.greedy_check import GreedyChecker, PlainReference
from tandem.canary.observations import ArmSummary, Outcome, summarize
from tandem.canary.secret import CanarySecret, configured_secret
from tandem.canary.state import CanaryState, DecisionRecord, new_state
from tandem.canary.store import CanaryStore, CanaryStoreError, MemoryCanaryStore, RedisCanaryStore, open_canary_store

__all__ = [
    "ENV_ARMS",
    "HOLD",
    "PROMOTE",
    "ROLLBACK",
    "ArmSpec",
    "ArmSummary",
    "Assignment",
    "CanaryController",
    "CanarySecret",
    "CanaryState",
    "CanaryStore",
    "CanaryStoreError",
    "DecisionRecord",
    "GreedyChecker",
    "MemoryCanaryStore",
    "Outcome",
    "PlainReference",
    "RedisCanaryStore",
    "Thresholds",
    "Verdict",
    "arms_from_env",
    "configured_secret",
    "evaluate",
    "judge",
    "new_state",
    "open_canary_store",
    "parse_arms",
    "summarize",
]
