"""What the session-store tests share: a change that appends a name to a state's list."""

from __future__ import annotations


def _appended(name: str):
    def change(state: dict | None) -> dict:
        state = state or {"names": []}
        state["names"].append(name)
        return state

    return change
