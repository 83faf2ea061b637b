"""A simulated Redis server: a keyspace with TTLs on a simulated server clock, and Lua.

The library's Lua scripts run unchanged in Lua 5.1 (the Lua Redis embeds) through ``lupa``;
``redis.call`` is answered by :meth:`SimRedis.command` over this keyspace. Only the commands
the library uses are implemented, with Redis's semantics for them (reply types, expiry,
``PX``, the Lua <-> Redis conversion rules); anything else is an error that names the command,
so that a script using a new command fails loudly instead of being answered wrongly.

Time: the server's clock is ``world.now + clock_offset`` (seconds); key expiry and ``TIME``
read it, and it is frozen for the duration of one script, as in Redis 7. A clock step moves
``clock_offset``; expiry times are absolute (server wall clock), as Redis keeps them.

Persistence: ``"aof"`` (``appendfsync always``: a restart keeps every applied write),
``"none"`` (a restart comes back empty) and ``"snapshot"`` (a restart comes back with an
older copy of the keyspace, as from an RDB file).
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass
from typing import Any, Callable

from lupa import lua51

__all__ = ["CommandError", "Entry", "SimRedis"]


class CommandError(Exception):
    """An error reply (``-ERR ...``); raised inside a script it aborts the script."""


@dataclass
class Entry:
    kind: str  # "string" or "hash"
    value: Any  # bytes, or dict[bytes, bytes]
    expire_ms: int | None = None
    version: int = 0  # bumped by every write of this key (the checker's write stamp)


def _b(value: Any) -> bytes:
    """A command argument as Redis sees it."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise CommandError("ERR sim: bool argument")
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        # Redis formats a Lua number argument with %.17g
        return (b"%.17g" % value) if value != int(value) else str(int(value)).encode()
    raise CommandError(f"ERR sim: unsupported argument type {type(value).__name__}")


def _int(value: bytes, what: str = "value") -> int:
    try:
        text = value.decode()
        if text.strip() != text or not text:
            raise ValueError
        return int(text)
    except (ValueError, UnicodeDecodeError):
        raise CommandError(f"ERR {what} is not an integer or out of range") from None


WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"

_LUA_PRELUDE = """
local py_call, py_log = ...
redis = {}
local function do_call(raise, ...)
  local ok, value = py_call(...)
  if not ok then
    if raise then error({err = value}) end
    return {err = value}
  end
  return value
end
redis.call = function(...) return do_call(true, ...) end
redis.pcall = function(...) return do_call(false, ...) end
redis.error_reply = function(msg) return {err = msg} end
redis.status_reply = function(msg) return {ok = msg} end
redis.replicate_commands = function() return true end
redis.set_repl = function() end
redis.log = function(level, msg) py_log(msg) end
run_script = function(f)
  local ok, res = pcall(f)
  if ok then return true, res end
  if type(res) == 'table' and res.err then return false, res.err end
  return false, tostring(res)
end
redis.REPL_ALL = 3
redis.LOG_WARNING = 3
redis.LOG_NOTICE = 2
redis.LOG_VERBOSE = 1
redis.LOG_DEBUG = 0
"""


class _Status:
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


OK = _Status("OK")


class SimRedis:
    """One Redis server. ``clock()`` is the world's true time in seconds."""

    def __init__(self, clock: Callable[[], float], persistence: str = "aof") -> None:
        self._world_clock = clock
        self.clock_offset = 1_700_000_000.0  # the server's wall clock at the world's time 0
        self.persistence = persistence
        self.data: dict[bytes, Entry] = {}
        self.up = True
        self.epoch = 0  # bumped by a crash: connections of an older epoch are reset
        self.snapshots: list[tuple[float, dict[bytes, Entry]]] = []
        self._frozen_ms: int | None = None
        self._frozen_us: int | None = None
        self._version = 0
        self._lua = lua51.LuaRuntime(
            encoding=None, register_eval=False, unpack_returned_tuples=True
        )
        self._lua.execute("sandbox_prelude = function(...) " + _LUA_PRELUDE + " end")
        self._lua.globals().sandbox_prelude(self._lua_call, lambda msg: None)
        self._scripts: dict[str, Any] = {}
        self._run = self._lua.globals().run_script
        self._table = self._lua.eval("function(...) return {...} end")
        self._lua_table_type = type(self._lua.table())
        #: called after every key write/delete: (key) -> None (the checker's hook)
        self.commands: dict[bytes, Callable[[list[bytes]], Any]] = {
            b"GET": self._get,
            b"SET": self._set,
            b"DEL": self._del,
            b"UNLINK": self._del,
            b"EXISTS": self._exists,
            b"MGET": self._mget,
            b"PEXPIRE": self._pexpire,
            b"EXPIRE": self._expire,
            b"PEXPIREAT": self._pexpireat,
            b"PTTL": self._pttl,
            b"TTL": self._ttl,
            b"PERSIST": self._persist,
            b"TIME": self._time,
            b"HSET": self._hset,
            b"HMSET": self._hmset,
            b"HGET": self._hget,
            b"HMGET": self._hmget,
            b"HGETALL": self._hgetall,
            b"HDEL": self._hdel,
            b"HEXISTS": self._hexists,
            b"HSTRLEN": self._hstrlen,
            b"HLEN": self._hlen,
            b"HINCRBY": self._hincrby,
            b"INCR": lambda a: self._incrby([a[0], b"1"]),
            b"INCRBY": self._incrby,
            b"TYPE": self._type,
            b"GETRANGE": self._getrange,
            b"STRLEN": self._strlen,
            b"APPEND": self._append,
            b"GETDEL": self._getdel,
            b"SETNX": lambda a: int(self._set([*a, b"NX"]) is not None),
            b"PEXPIRETIME": self._pexpiretime,
            b"SCAN": self._scan,
            b"PING": lambda a: _Status("PONG"),
        }

    # -- clock ----------------------------------------------------------------------------

    def now_s(self) -> float:
        return self._world_clock() + self.clock_offset

    def now_us(self) -> int:
        if self._frozen_us is not None:
            return self._frozen_us
        return round(self.now_s() * 1_000_000)

    def now_ms(self) -> int:
        if self._frozen_ms is not None:
            return self._frozen_ms
        return self.now_us() // 1000

    # -- keyspace -------------------------------------------------------------------------

    def lookup(self, key: bytes) -> Entry | None:
        """The live entry under ``key`` (an expired one is deleted, as Redis does lazily)."""
        entry = self.data.get(key)
        if entry is None:
            return None
        if entry.expire_ms is not None and entry.expire_ms <= self.now_ms():
            del self.data[key]
            return None
        return entry

    def peek(self, key: bytes) -> Entry | None:
        """Like :meth:`lookup` without deleting: for the checker's eyes only."""
        entry = self.data.get(key)
        if entry is None:
            return None
        if entry.expire_ms is not None and entry.expire_ms <= self.now_ms():
            return None
        return entry

    def active_expire(self) -> None:
        """Redis's active expiry cycle: delete every key whose time has come."""
        now = self.now_ms()
        dead = [k for k, e in self.data.items() if e.expire_ms is not None and e.expire_ms <= now]
        for k in dead:
            del self.data[k]

    def _touch(self, entry: Entry) -> None:
        self._version += 1
        entry.version = self._version

    def _write(self, key: bytes, entry: Entry) -> None:
        self.data[key] = entry
        self._touch(entry)

    def _typed(self, key: bytes, kind: str) -> Entry | None:
        entry = self.lookup(key)
        if entry is not None and entry.kind != kind:
            raise CommandError(WRONGTYPE)
        return entry

    # -- commands -------------------------------------------------------------------------

    def command(self, args: list[bytes]) -> Any:
        """Run one command; returns its reply (bytes, int, list, None, _Status) or raises
        :class:`CommandError`."""
        if not args:
            raise CommandError("ERR wrong number of arguments")
        name = args[0].upper()
        handler = self.commands.get(name)
        if handler is None:
            raise CommandError(f"ERR sim: unknown command '{args[0].decode(errors='replace')}'")
        return handler(args[1:])

    @staticmethod
    def _arity(args: list[bytes], n: int, exact: bool = True) -> None:
        if (len(args) != n) if exact else (len(args) < n):
            raise CommandError("ERR wrong number of arguments")

    def _get(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self._typed(a[0], "string")
        return None if entry is None else entry.value

    def _set(self, a: list[bytes]) -> Any:
        self._arity(a, 2, exact=False)
        key, value = a[0], a[1]
        expire_ms: int | None = None
        nx = xx = keepttl = get = False
        i = 2
        while i < len(a):
            opt = a[i].upper()
            if opt in (b"PX", b"EX", b"PXAT", b"EXAT") and i + 1 < len(a):
                n = _int(a[i + 1])
                if n <= 0:
                    raise CommandError("ERR invalid expire time in 'set' command")
                now = self.now_ms()
                expire_ms = {
                    b"PX": now + n,
                    b"EX": now + n * 1000,
                    b"PXAT": n,
                    b"EXAT": n * 1000,
                }[opt]
                i += 2
            elif opt == b"NX":
                nx, i = True, i + 1
            elif opt == b"XX":
                xx, i = True, i + 1
            elif opt == b"KEEPTTL":
                keepttl, i = True, i + 1
            elif opt == b"GET":
                get, i = True, i + 1
            else:
                raise CommandError("ERR syntax error")
        old = self.lookup(key)
        if get and old is not None and old.kind != "string":
            raise CommandError(WRONGTYPE)
        old_value = None if old is None else old.value
        if (nx and old is not None) or (xx and old is None):
            return old_value if get else None
        if keepttl and old is not None:
            expire_ms = old.expire_ms
        self._write(key, Entry("string", value, expire_ms))
        return old_value if get else OK

    def _del(self, a: list[bytes]) -> Any:
        self._arity(a, 1, exact=False)
        n = 0
        for key in a:
            if self.lookup(key) is not None:
                del self.data[key]
                self._version += 1
                n += 1
        return n

    def _mget(self, a: list[bytes]) -> Any:
        # Redis answers nil for a key that holds another type, not WRONGTYPE.
        self._arity(a, 1, exact=False)
        out = []
        for key in a:
            entry = self.lookup(key)
            out.append(entry.value if entry is not None and entry.kind == "string" else None)
        return out

    def _exists(self, a: list[bytes]) -> Any:
        self._arity(a, 1, exact=False)
        return sum(1 for key in a if self.lookup(key) is not None)

    def _expire_at(self, key: bytes, at_ms: int) -> int:
        entry = self.lookup(key)
        if entry is None:
            return 0
        if at_ms <= self.now_ms():
            del self.data[key]
            self._version += 1
            return 1
        entry.expire_ms = at_ms
        self._touch(entry)
        return 1

    def _pexpire(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        return self._expire_at(a[0], self.now_ms() + _int(a[1]))

    def _expire(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        return self._expire_at(a[0], self.now_ms() + _int(a[1]) * 1000)

    def _pexpireat(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        return self._expire_at(a[0], _int(a[1]))

    def _pttl(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self.lookup(a[0])
        if entry is None:
            return -2
        if entry.expire_ms is None:
            return -1
        return entry.expire_ms - self.now_ms()

    def _ttl(self, a: list[bytes]) -> Any:
        ms = self._pttl(a)
        return ms if ms < 0 else (ms + 500) // 1000

    def _persist(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self.lookup(a[0])
        if entry is None or entry.expire_ms is None:
            return 0
        entry.expire_ms = None
        self._touch(entry)
        return 1

    def _time(self, a: list[bytes]) -> Any:
        self._arity(a, 0)
        us = self.now_us()
        return [str(us // 1_000_000).encode(), str(us % 1_000_000).encode()]

    def _hash_for_write(self, key: bytes) -> Entry:
        entry = self._typed(key, "hash")
        if entry is None:
            entry = Entry("hash", {})
            self.data[key] = entry
        return entry

    def _hset(self, a: list[bytes]) -> Any:
        if len(a) < 3 or len(a) % 2 == 0:
            raise CommandError("ERR wrong number of arguments for 'hset' command")
        entry = self._hash_for_write(a[0])
        added = 0
        for i in range(1, len(a), 2):
            if a[i] not in entry.value:
                added += 1
            entry.value[a[i]] = a[i + 1]
        self._touch(entry)
        return added

    def _hmset(self, a: list[bytes]) -> Any:
        self._hset(a)
        return OK

    def _hget(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        entry = self._typed(a[0], "hash")
        return None if entry is None else entry.value.get(a[1])

    def _hmget(self, a: list[bytes]) -> Any:
        self._arity(a, 2, exact=False)
        entry = self._typed(a[0], "hash")
        return [None if entry is None else entry.value.get(f) for f in a[1:]]

    def _hgetall(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self._typed(a[0], "hash")
        out: list[bytes] = []
        for k, v in entry.value.items() if entry else ():
            out += [k, v]
        return out

    def _hdel(self, a: list[bytes]) -> Any:
        self._arity(a, 2, exact=False)
        entry = self._typed(a[0], "hash")
        if entry is None:
            return 0
        n = 0
        for f in a[1:]:
            if f in entry.value:
                del entry.value[f]
                n += 1
        if n:
            self._touch(entry)
        if not entry.value:
            del self.data[a[0]]
        return n

    def _hexists(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        entry = self._typed(a[0], "hash")
        return int(entry is not None and a[1] in entry.value)

    def _hstrlen(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        entry = self._typed(a[0], "hash")
        return 0 if entry is None else len(entry.value.get(a[1], b""))

    def _hlen(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self._typed(a[0], "hash")
        return 0 if entry is None else len(entry.value)

    def _hincrby(self, a: list[bytes]) -> Any:
        self._arity(a, 3)
        entry = self._hash_for_write(a[0])
        n = _int(entry.value.get(a[1], b"0"), "hash value") + _int(a[2])
        entry.value[a[1]] = str(n).encode()
        self._touch(entry)
        return n

    def _incrby(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        entry = self._typed(a[0], "string")
        n = (0 if entry is None else _int(entry.value)) + _int(a[1])
        self._write(a[0], Entry("string", str(n).encode(), entry.expire_ms if entry else None))
        return n

    def _kind(self, key: bytes) -> str | None:
        entry = self.lookup(key)
        return None if entry is None else entry.kind

    def _getrange(self, a: list[bytes]) -> Any:
        self._arity(a, 3)
        entry = self._typed(a[0], "string")
        value = b"" if entry is None else entry.value
        start, end, n = _int(a[1]), _int(a[2]), len(value)
        if start < 0:
            start = max(n + start, 0)
        if end < 0:
            end = n + end
        end = min(end, n - 1)
        return b"" if start > end or n == 0 else value[start : end + 1]

    def _strlen(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self._typed(a[0], "string")
        return 0 if entry is None else len(entry.value)

    def _append(self, a: list[bytes]) -> Any:
        self._arity(a, 2)
        entry = self._typed(a[0], "string")
        if entry is None:
            self._write(a[0], Entry("string", a[1]))
            return len(a[1])
        entry.value += a[1]
        self._touch(entry)
        return len(entry.value)

    def _getdel(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self._typed(a[0], "string")
        if entry is None:
            return None
        del self.data[a[0]]
        self._version += 1
        return entry.value

    def _pexpiretime(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self.lookup(a[0])
        if entry is None:
            return -2
        return -1 if entry.expire_ms is None else entry.expire_ms

    def _type(self, a: list[bytes]) -> Any:
        self._arity(a, 1)
        entry = self.lookup(a[0])
        return _Status("none" if entry is None else entry.kind)

    def _scan(self, a: list[bytes]) -> Any:
        # One pass over the whole keyspace: cursor 0 in, cursor 0 out.
        pattern = b"*"
        i = 1
        while i < len(a):
            if a[i].upper() == b"MATCH":
                pattern = a[i + 1]
            i += 2
        keys = [k for k in sorted(self.data) if self.lookup(k) is not None]
        return [
            b"0",
            [
                k
                for k in keys
                if fnmatch.fnmatchcase(k.decode("latin-1"), pattern.decode("latin-1"))
            ],
        ]

    # -- Lua ------------------------------------------------------------------------------

    def _to_lua(self, reply: Any) -> Any:
        if reply is None:
            return False
        if isinstance(reply, (bytes, int)):
            return reply
        if isinstance(reply, _Status):
            t = self._lua.table()
            t[b"ok"] = reply.text.encode()
            return t
        if isinstance(reply, list):
            return self._table(*[self._to_lua(r) for r in reply])
        raise CommandError(f"ERR sim: cannot convert {reply!r} to Lua")

    def _lua_call(self, *args: Any) -> Any:
        try:
            reply = self.command([_b(a) for a in args])
        except CommandError as exc:
            return False, str(exc).encode()
        return True, self._to_lua(reply)

    def _from_lua(self, value: Any) -> Any:
        """Lua -> Redis reply conversion (numbers truncate; a table stops at its first nil)."""
        if value is None or value is False:
            return None
        if value is True:
            return 1
        if isinstance(value, (int, float)):
            return int(value)
        if isinstance(value, bytes):
            return value
        if isinstance(value, self._lua_table_type):
            err = value[b"err"]
            if err is not None:
                raise CommandError(err.decode(errors="replace"))
            ok = value[b"ok"]
            if ok is not None:
                return _Status(ok.decode(errors="replace"))
            out = []
            i = 1
            while True:
                item = value[i]
                if item is None:
                    break
                out.append(self._from_lua(item))
                i += 1
            return out
        raise CommandError(f"ERR sim: unsupported Lua reply {value!r}")

    def eval(self, script: str, keys: list[Any], args: list[Any]) -> Any:
        """``EVAL script numkeys keys... args...``: atomic, with the server clock frozen."""
        fn = self._scripts.get(script)
        if fn is None:
            try:
                fn = self._lua.execute("return function() " + script + "\nend")
            except Exception as exc:  # lupa.LuaSyntaxError
                raise CommandError(f"ERR Error compiling script: {exc}") from None
            self._scripts[script] = fn
        g = self._lua.globals()
        g.KEYS = self._table(*[_b(k) for k in keys])
        g.ARGV = self._table(*[_b(a) for a in args])
        self._frozen_us = None
        us = self.now_us()
        self._frozen_us, self._frozen_ms = us, us // 1000
        try:
            ok, result = self._run(fn)
            if not ok:
                text = result.decode(errors="replace") if isinstance(result, bytes) else str(result)
                raise CommandError(text if text.startswith(("ERR", "WRONGTYPE")) else f"ERR {text}")
            return self._from_lua(result)
        finally:
            self._frozen_us = self._frozen_ms = None

    # -- faults ---------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Save the keyspace as an RDB file would (kept for a later restart)."""
        self.snapshots.append((self.now_s(), copy.deepcopy(self.data)))

    def crash(self) -> None:
        self.up = False
        self.epoch += 1

    def start(self, mode: str, snapshot_index: int = -1) -> None:
        """Come back up after :meth:`crash`: with every write (aof), empty (none), or with
        the keyspace of an older snapshot."""
        if mode == "none":
            self.data = {}
        elif mode == "snapshot":
            self.data = copy.deepcopy(self.snapshots[snapshot_index][1]) if self.snapshots else {}
            self.active_expire()  # a master loading an RDB file skips the keys already expired
        self.up = True
