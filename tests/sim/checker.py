"""The invariants, checked after every step from the simulation's own history.

The checker never trusts what the library reports: it watches the server's keyspace change
(through :class:`~.adapter.Layout`), knows which request caused each change, when each body
started and ended, and what each body returned or raised. The library's reports (the value a
call returned, ``LockLostError``) are themselves checked against that history.

Invariants (``Violation.rule``):

- ``exclusion``: at most one body of a key runs while holding a valid lease by the server's
  clock: a body that starts under a live lease finds every other running body of that key
  with a lease lost by expiry on the server's clock or by a restart that lost data. (A body
  whose lease had already lapsed when it started, its claim's reply having come late, holds
  no valid lease; it is counted, and its commit must be refused.)
- ``lease-end``: a live lease ends only by expiry on the server's clock, by its holder's own
  request, or by a restart that lost data; never by another holder's request.
- ``stale-commit``: a record is written only by a request carrying the lease that holds the
  key at that moment (a body whose lease lapsed never commits).
- ``overwrite``: a committed record is never overwritten, and removed only by its TTL, an
  explicit forget, or a restart that lost data.
- ``fence``: fencing tokens strictly increase per key across all holders; the token a body
  sees is the one the server granted. A key that carries the last token (the lock, as a lease
  or as a tombstone; the record; the fence key) may go away by expiry only once the server
  clock has passed the token, and a lock only once it has passed it by the margin
  (``keyspace.FENCE_MARGIN_MS``). A lower token is excused only when no such key is left and
  the server clock is behind the last token: after a restart that lost data, an explicit
  forget (the store's delete of the record), or a step back of the clock, after the last key
  expired, larger than what the keyspace documents (the expiry check proves the step was).
- ``rerun``: a claim never takes the lease of a key whose record is live, and no body starts
  under a live lease while its key's record is live (a completed key never runs again); with
  persistence this holds across restarts.
- ``replay``: a replayed value is the value of a record of that key that was live during
  the call.
- ``failed-body``: a failed body stores nothing, and its exception reaches the caller.
- ``report``: a call reported as committed stored its value; one reported as not committed
  (``LockLostError``) left no live record of its value.
- ``publish``: the publish-side decision (the ``PUBLISH`` script), judged by the server's
  state at the moment the script ran: a key with a live record yields no new message; a key
  queued under another task id yields no second message, and one queued under another
  fingerprint is refused as a mismatch; a marker is set only on a key with no record, no
  other live marker and no live lease. A marker a delivery claimed (state ``c``) lives only
  while a live lease holds the lock (SPEC §8): after that it is dead, and a publish may set
  its own over it.
- ``marker``: a queued marker never overwrites or removes a record (``overwrite``), and ends
  only by the commit that replaces it, its own task's drop, its expiry, a forget, data loss,
  or (dead) a publish's new marker; a claim only turns it to state ``c`` (same task id).
- ``abandon``: a holder told "not ours" by a renewal sends no more renewals or commits for
  that lease.

Documented exceptions: a restart without persistence or from an older snapshot ends leases
and removes or brings back records (README: "if Redis loses data, a key can run again"): the
checker then takes the keyspace the restart left as the new truth, and every other rule still
holds. Fencing tokens stay increasing across such a restart only while the server clock does
not go back, which the README states; the checker asserts exactly that.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .adapter import FENCE_MARGIN_US, KeyView, Layout, holds, owner_of

__all__ = ["Checker", "Violation"]


class Violation(AssertionError):
    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message


@dataclass
class Lease:
    token: str
    key: str
    fence: int | None
    granted_at: float
    ended: str | None = None  # expired / holder / data-loss


@dataclass
class Body:
    proc: str
    key: str
    token: str
    value: Any = None
    state: str = "running"  # running / returned / raised / killed


@dataclass
class RecordLife:
    value: Any
    start: float
    end: float | None = None


@dataclass
class KeyState:
    layout: Layout
    view: KeyView
    max_fence: int = 0
    max_fence_server_us: int = 0
    clock_went_back: bool = False
    # per grant role: how the last key that floored such a grant by the highest token went
    # away since it was granted ("time", "data-loss", "forget")
    lost: dict[str, str] = field(default_factory=dict)
    record_lost: bool = False  # a restart lost the key's record (it may run again)
    records: list[RecordLife] = field(default_factory=list)
    expired_stamps: set[int | None] = field(default_factory=set)


class _Ctx(NamedTuple):
    """What caused a change of the keyspace: whose request, which script, which lease."""

    proc: str | None
    role: str
    token: str | None
    cause: str
    now_ms: int


class Checker:
    """Fed by the harness; raises :class:`Violation` at the first broken rule."""

    def __init__(self, keys: list[str], server: Any) -> None:
        self.server = server
        self.keys = {k: KeyState(Layout(k), Layout(k).view(server)) for k in keys}
        self.leases: dict[str, Lease] = {}
        self.bodies: dict[str, list[Body]] = {k: [] for k in keys}
        self.lost_known: set[str] = set()  # tokens whose holder was told "not ours"
        self.commit_sent: set[str] = set()
        self.late_starts = 0
        self.unchecked_publishes = 0
        self.marker_ends: Counter[str] = Counter()
        self.excused_fences = 0
        self.excused_by: Counter[str] = Counter()
        self.reruns_after_loss = 0
        self.committed_values: dict[Any, str] = {}  # value -> token of the commit
        self.checks = 0
        self.now = 0.0
        self.first: Violation | None = None

    def violated(self, rule: str, message: str) -> Violation:
        """Record the first violation (raised wherever it was found: a greenlet too)."""
        v = Violation(rule, message)
        if self.first is None:
            self.first = v
        return v

    # -- observation ---------------------------------------------------------------------

    def before_request(self, proc: str, role: str, token: str | None) -> None:
        if token is None or role not in ("renew", "commit"):
            return
        # A commit sent before the "not ours" may be resent (its own record answers it);
        # a renewal, or a first commit, after it may not.
        resend = role == "commit" and token in self.commit_sent
        if role == "commit":
            self.commit_sent.add(token)
        if token in self.lost_known and not resend:
            raise self.violated(
                "abandon",
                f"{proc} sent a {role} for lease {short(token)} after a renewal told it "
                "the lease is not its own",
            )

    def after_request(
        self, proc: str, role: str, token: str | None, cause: str = "request"
    ) -> None:
        """After the server applied a request (its time is frozen at the script's time)."""
        self._diff(proc, role, token, cause)

    def reply_delivered(self, role: str, token: str | None, reply: Any) -> None:
        if role == "renew" and token is not None and reply == 0:
            self.lost_known.add(token)

    def tick(self, now: float) -> None:
        """After any step: time passed, expiries happened."""
        self.now = now
        self._diff(None, "time", None, "time")

    def restart(self, mode: str) -> None:
        if mode != "aof":
            for ks in self.keys.values():
                # (an older snapshot may bring back an older floor: as good as none)
                ks.lost = {"claim": "data-loss", "acquire": "data-loss"}
        self._diff(None, "restart", None, "data-loss" if mode != "aof" else "restart")

    def clock_step(self, delta: float) -> None:
        if delta < 0:
            for ks in self.keys.values():
                ks.clock_went_back = True
        self._diff(None, "clock", None, "time")

    # -- bodies and calls ----------------------------------------------------------------

    def body_start(self, proc: str, key: str, token: str, fence: int) -> Body:
        self.checks += 1
        lease = self.leases.get(token)
        if lease is None:
            raise self.violated("exclusion", f"{proc} runs a body of {key} under an unknown lease")
        if lease.fence is not None and fence != lease.fence:
            raise self.violated(
                "fence",
                f"{proc}'s body sees fencing token {fence}, the server granted {lease.fence}",
            )
        view = self.keys[key].view
        live = holds(view.holder, token) and (
            view.holder_expire_ms is None or view.holder_expire_ms > self.server.now_ms()
        )
        if not live:
            # Its lease lapsed before the body started (the claim's reply came late, or the
            # process stalled between the reply and the body): the body holds no valid
            # lease, so it is outside "at most one body holding a valid lease"; its commit
            # must be refused (stale-commit) like any lapsed holder's.
            self.late_starts += 1
        if live and view.record_stamp is not None:
            raise self.violated(
                "rerun",
                f"{proc} starts a body of {key} although its record {view.record_value!r} is live",
            )
        for other in self.bodies[key] if live else ():
            if other.state != "running":
                continue
            other_lease = self.leases[other.token]
            if other_lease.ended not in ("expired", "data-loss"):
                raise self.violated(
                    "exclusion",
                    f"{proc} starts a body of {key} while {other.proc}'s body runs under "
                    f"lease {short(other.token)} ({other_lease.ended or 'still held'})",
                )
        body = Body(proc, key, token)
        self.bodies[key].append(body)
        return body

    def body_end(self, body: Body, state: str, value: Any = None) -> None:
        body.state = state
        body.value = value

    def call_result(
        self, proc: str, key: str, started: float, body: Body | None, *, kind: str, value: Any
    ) -> None:
        """What the guard returned (``kind``: fresh / replay / lost / unknown / raised / ...)."""
        self.checks += 1
        ks = self.keys[key]
        if kind == "fresh":
            if body is None or body.state != "returned" or value != body.value:
                raise self.violated(
                    "report", f"{proc} got a fresh value {value!r} no body returned"
                )
            if self.committed_values.get(value) != body.token:
                raise self.violated(
                    "report", f"{proc}'s call reported {value!r} committed; it was not stored"
                )
        elif kind == "replay":
            if not any(
                r.value == value and r.start <= self.now and (r.end is None or r.end >= started)
                for r in ks.records
            ):
                raise self.violated(
                    "replay", f"{proc} got {value!r} replayed for {key}: no such live record"
                )
        elif kind == "lost":
            if body is not None and body.state == "returned":
                for r in ks.records:
                    if r.value == body.value and r.end is None:
                        raise self.violated(
                            "report",
                            f"{proc}'s call raised LockLostError, but its value "
                            f"{body.value!r} is stored",
                        )
        elif kind == "raised" and body is not None and body.state != "raised":
            raise self.violated("failed-body", f"{proc}: the body's exception was not propagated")

    # -- the keyspace diff ---------------------------------------------------------------

    def _diff(self, proc: str | None, role: str, token: str | None, cause: str) -> None:
        server = self.server
        now_ms = server.now_ms()
        ctx = _Ctx(proc, role, token, cause, now_ms)
        for key, ks in self.keys.items():
            old = ks.view
            new = ks.layout.view(server)
            self.checks += 1
            if new == old:
                continue
            ks.view = new
            for grant in ("claim", "acquire"):
                if ks.layout.token_forgotten(new, grant) and grant not in ks.lost:
                    # nothing floors such a grant's token now
                    ks.lost[grant] = self._token_dropped(key, ks, grant, old, ctx)
            # -- the lease
            if old.holder != new.holder:
                if old.holder is not None:
                    self._lease_ended(key, old, ctx)
                if new.holder is not None:
                    self._lease_granted(key, ks, old, new, ctx)
            elif (
                new.holder is not None
                and new.holder_expire_ms != old.holder_expire_ms
                and cause == "request"
                and not holds(new.holder, token)
            ):
                raise self.violated(
                    "lease-end",
                    f"{proc}'s {role} changed the lease of {short(new.holder)} on {key}",
                )
            # -- the queued marker
            if old.marker is not None and (new.marker is None or new.marker[2] != old.marker[2]):
                self._marker_ended(key, old, new, ctx)
            # -- the record
            if old.record_stamp != new.record_stamp:
                self._record_changed(key, ks, old, new, ctx)

    def _marker_ended(self, key: str, old: KeyView, new: KeyView, ctx: _Ctx) -> None:
        proc, role, _token, cause, now_ms = ctx
        assert old.marker is not None
        expired = old.marker[3] is not None and old.marker[3] <= now_ms
        replaced = new.record_stamp is not None  # a write of the record (its rules judge it)
        if new.marker is not None and new.marker[0] == old.marker[0] and role == "publish":
            return  # its own publish sent again (the same task id): the same marker
        if (
            new.marker is not None
            and new.marker[0] == old.marker[0]
            and new.marker[1] == old.marker[1]
            and new.marker[3] == old.marker[3]
            and role == "claim"
            and new.marker[4] == "c"
        ):
            self.marker_ends["claimed"] += 1
            return  # the claim marks it claimed (same task id, its TTL kept)
        if role == "publish" and new.marker is not None and _dead(old, now_ms):
            self.marker_ends["dead, replaced by a publish"] += 1
            return
        if replaced:
            self.marker_ends["replaced by a commit"] += 1
            return
        if role in ("forget", "drop_queued"):
            self.marker_ends[f"ended by {role}"] += 1
            return
        if expired or cause in ("data-loss", "time"):
            self.marker_ends["expired or lost"] += 1
            return
        raise self.violated(
            "marker",
            f"the queued marker of {old.marker[0]} on {key} was "
            f"{'replaced' if new.marker or new.record_stamp else 'removed'} by "
            f"{proc or 'nobody'}'s {role}",
        )

    def publish_applied(
        self, proc: str, key: str, call: tuple[str, str | None], before: KeyView, reply: Any
    ) -> str:
        """Judge one run of the publish script against the state it ran on; the decision."""
        task_id, fp = call
        status = int(reply[0]) if isinstance(reply, list) and reply else -1
        message = status in (1, 7)  # the caller publishes (7: unchecked, the guard decides)
        now_ms = self.server.now_ms()
        if before.record_stamp is not None and message:
            raise self.violated(
                "publish",
                f"{proc}'s publish of {task_id} on completed {key} "
                f"(record {before.record_value!r}) answered {status}: a new message",
            )
        marker = before.marker
        if marker is not None and _dead(before, now_ms):
            marker = None  # claimed, and its lease is over: it stands for nothing
        if marker is not None and marker[0] != task_id:
            if message:
                raise self.violated(
                    "publish",
                    f"{proc}'s publish of {task_id} on {key}, queued as {marker[0]}, "
                    f"answered {status}: a second message",
                )
            if marker[1] and fp and marker[1] != fp and status != 5:
                raise self.violated(
                    "publish",
                    f"{proc}'s publish of {task_id} on {key} with fingerprint {fp}, queued "
                    f"with {marker[1]}, answered {status}: not refused as a mismatch",
                )
        live = before.holder is not None and (
            before.holder_expire_ms is None or before.holder_expire_ms > now_ms
        )
        after = self.keys[key].layout.view(self.server)
        over = (
            "a record"
            if before.record_stamp is not None
            else "a marker"
            if marker is not None and marker[0] != task_id
            else "a live lease"
            if live
            else None
        )
        new_marker = after.marker is not None and (
            before.marker is None or before.marker[2] != after.marker[2]
        )
        if new_marker and over is not None:
            raise self.violated(
                "publish", f"{proc}'s publish set the marker of {task_id} on {key} over {over}"
            )
        if status == 7:
            self.unchecked_publishes += 1
        return {1: "publish", 2: "completed", 3: "completed", 5: "mismatch", 6: "queued"}.get(
            status, "unchecked"
        )

    def _lease_ended(self, key: str, old: KeyView, ctx: _Ctx) -> None:
        proc, role, token, cause, now_ms = ctx
        assert old.holder is not None
        lease = self.leases.get(old.holder)
        expired = old.holder_expire_ms is not None and old.holder_expire_ms <= now_ms
        if expired:
            how = "expired"
        elif cause == "data-loss":
            how = "data-loss"
        elif cause == "request" and holds(old.holder, token):
            how = "holder"
        else:
            raise self.violated(
                "lease-end",
                f"the live lease {short(old.holder)} on {key} was ended by "
                f"{proc or 'nobody'}'s {role} (token {short(token)})",
            )
        if lease is not None and lease.ended is None:
            lease.ended = how

    def _lease_granted(self, key: str, ks: KeyState, old: KeyView, new: KeyView, ctx: _Ctx) -> None:
        proc, role, _token, cause, _ = ctx
        assert new.holder is not None
        if new.holder in self.leases:
            lease = self.leases[new.holder]
            # An older snapshot brings a lease back; so does a clock step back for a lease
            # whose time had come but that Redis had not deleted yet (nobody took the key
            # since: a claim would have deleted it), an expired copy from a snapshot too.
            if cause == "data-loss" or (
                cause == "time" and lease.ended in ("expired", "data-loss")
            ):
                lease.ended = None
                return
            if cause != "request" or lease.ended is None:
                raise self.violated("lease-end", f"lease {short(new.holder)} on {key} came back")
            # A client's resend of a claim whose reply was lost, after that lease expired,
            # takes the key again with the same token: a new grant.
        fence = ks.layout.grant_fence(new)
        lease = Lease(new.holder, key, fence, self.now)
        self.leases[new.holder] = lease
        if cause != "request":
            if cause == "data-loss":
                lease.ended = None
                return
            raise self.violated("lease-end", f"a lease on {key} appeared without a request")
        if (
            role == "claim"
            and old.record_stamp is not None
            and new.record_stamp == old.record_stamp
        ):
            raise self.violated(
                "rerun",
                f"{proc}'s {role} took the lease of {key} although its record "
                f"{old.record_value!r} is live",
            )
        if ks.record_lost:
            # The documented outcome of a restart that lost data: the key runs again.
            self.reruns_after_loss += 1
            ks.record_lost = False
        if fence is None:
            raise self.violated("fence", f"lease on {key} granted without a fencing token")
        forgotten = ks.lost.get(role) in ("time", "data-loss", "forget")
        if fence <= ks.max_fence and forgotten and self.server.now_us() < ks.max_fence:
            # Documented: with no key left that carries the last token (lost in a restart,
            # forgotten, or expired: then only once the clock had passed it by the bound, see
            # _token_dropped), tokens are floored by the server clock alone, which is behind
            # that token (it stepped back further than the bound).
            self.excused_fences += 1
            self.excused_by[ks.lost[role]] += 1
        elif fence <= ks.max_fence:
            raise self.violated(
                "fence",
                f"{proc} was granted fencing token {fence} on {key}; {ks.max_fence} was "
                "granted before",
            )
        ks.max_fence = fence
        ks.lost = {}

    def _token_dropped(self, key: str, ks: KeyState, grant: str, old: KeyView, ctx: _Ctx) -> str:
        """The last key that floors ``grant``'s next token by the highest token went away
        (``old`` still had it): how. Expiry must wait until the server clock has passed the
        token (a lock: by the margin)."""
        proc, role, _token, cause, _now_ms = ctx
        if not ks.max_fence or ks.layout.token_forgotten(old, grant):
            return "none"  # nothing was granted yet, or it was dropped before (seen now)
        if cause == "data-loss":
            return "data-loss"
        if role == "forget":
            return "forget"
        if role == "commit" and grant == "acquire":
            # The record carries the token from now on; an acquire (the two-step path) does
            # not read it. Not an excuse: a lower acquire grant after this is still caught.
            return "commit"
        # Whatever the step that revealed it (a tick, a request, Redis coming back up), the
        # only way left is expiry: no script deletes the last such key (a mutant that does is
        # caught here, as an expiry before its time).
        now_us = self.server.now_us()
        need = ks.max_fence + (FENCE_MARGIN_US if old.lock_present else 0)
        if ks.max_fence and now_us + 1000 <= need:  # (expiry is in whole ms)
            what = "lock" if old.lock_present else "record or fence key"
            raise self.violated(
                "fence",
                f"the {what} of {key} carrying fencing token {ks.max_fence} went away at server "
                f"time {now_us} ({proc or 'nobody'}'s {role}), {(need - now_us) / 1e6:.3f}s "
                "before the clock had passed the token by the documented margin",
            )
        return "time"

    def _record_changed(
        self, key: str, ks: KeyState, old: KeyView, new: KeyView, ctx: _Ctx
    ) -> None:
        proc, role, token, cause, now_ms = ctx
        if old.record_stamp is not None:
            expired = old.record_expire_ms is not None and old.record_expire_ms <= now_ms
            allowed = (
                expired or cause == "data-loss" or (role == "forget" and new.record_stamp is None)
            )
            if not allowed:
                what = "removed" if new.record_stamp is None else "overwritten"
                raise self.violated(
                    "overwrite",
                    f"the record {old.record_value!r} of {key} was {what} by "
                    f"{proc or 'nobody'}'s {role}",
                )
            for r in ks.records:
                if r.end is None:
                    r.end = self.now
            if cause == "data-loss" and not expired:
                ks.record_lost = True
        if new.record_stamp is None:
            ks.expired_stamps.add(old.record_stamp)
            return
        ks.records.append(RecordLife(new.record_value, self.now))
        if cause == "data-loss":
            return
        if cause == "time" and new.record_stamp in ks.expired_stamps:
            return  # a record revived by a clock step back before Redis deleted it
        if cause != "request":
            raise self.violated("overwrite", f"a record of {key} appeared without a request")
        # A commit: only under the live lease, only a value its body returned.
        if not holds(old.holder, token) or (
            old.holder_expire_ms is not None and old.holder_expire_ms <= now_ms
        ):
            raise self.violated(
                "stale-commit",
                f"{proc}'s {role} stored {new.record_value!r} on {key} without holding its "
                f"lease (holder: {short(old.holder)}, request: {short(token)})",
            )
        body = next((b for b in reversed(self.bodies[key]) if holds(old.holder, b.token)), None)
        if body is None or body.state != "returned" or body.value != new.record_value:
            raise self.violated(
                "failed-body",
                f"{proc} stored {new.record_value!r} on {key}, which no finished body of "
                "that lease returned",
            )
        lease = self.leases.get(old.holder or "")
        if lease is not None and new.record_fence != lease.fence:
            raise self.violated(
                "fence",
                f"record of {key} carries fencing token {new.record_fence}, its lease "
                f"{lease.fence}",
            )
        self.committed_values[new.record_value] = body.token


_ALIASES: dict[str, str] = {}


def short(token: str | None) -> str:
    """A lease token as the trace shows it: ``L<n>@<owner>``, numbered in order of first
    appearance in the run (the random part differs between runs; the order does not)."""
    if token is None:
        return "-"
    rand = token.split("@", 1)[0].rsplit("/", 1)[-1]
    alias = _ALIASES.get(rand)
    if alias is None:
        alias = _ALIASES[rand] = f"L{len(_ALIASES) + 1}"
    return f"{alias}@{owner_of(token)}"


def reset_aliases() -> None:
    _ALIASES.clear()


def _dead(view: KeyView, now_ms: float) -> bool:
    """Whether ``view``'s queued marker was claimed by a delivery whose lease is over (no live
    lease holds the lock): it then stands for nothing (SPEC §8, the marker's life cycle)."""
    marker = view.marker
    if marker is None or marker[4] != "c":
        return False
    live = view.holder is not None and (
        view.holder_expire_ms is None or view.holder_expire_ms > now_ms
    )
    return not live
