"""Redis: every Redis name, Lua script, redis-py client and Redis error."""
