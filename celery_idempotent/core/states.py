"""The states of an idempotency key, spelled once: :class:`KeyState`."""

from __future__ import annotations

import enum

__all__ = ["IN_PROGRESS", "KeyState"]

#: How the command line's JSON (and ``KeyInfo.state``) spells :attr:`KeyState.RUNNING`: 0.1.0's
#: word, kept so that scripts reading ``inspect --json`` and ``stats --json`` keep working.
IN_PROGRESS = "in_progress"


class KeyState(str, enum.Enum):
    """What the store holds for a key. A ``str``: ``KeyState.RUNNING == "running"``, and it is
    written to JSON as its value.

    ``COMPLETED``: a record (a duplicate replays it). ``RUNNING``: no record, the lock is held
    (a delivery runs the body now). ``QUEUED``: the publish side's marker (a call was published
    and its body has not started). ``ABSENT``: nothing.
    """

    COMPLETED = "completed"
    RUNNING = "running"
    QUEUED = "queued"
    ABSENT = "absent"

    def __str__(self) -> str:
        return self.value

    @property
    def json_name(self) -> str:
        """The state as the command line's JSON spells it (``"in_progress"`` for RUNNING)."""
        return IN_PROGRESS if self is KeyState.RUNNING else self.value

    @classmethod
    def of(cls, name: str) -> KeyState:
        """The state a name spells, in either vocabulary (``"in_progress"`` is RUNNING).

        Raises ``ValueError`` naming the states for any other name.
        """
        if name == IN_PROGRESS:
            return cls.RUNNING
        try:
            return cls(name)
        except ValueError:
            states = ", ".join(repr(each.value) for each in cls)
            raise ValueError(
                f"not a key state: {name!r} (one of {states}, or {IN_PROGRESS!r})"
            ) from None
