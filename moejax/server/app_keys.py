"""The aiohttp application's typed keys, in their own module so app.py (routes) and
lifecycle.py (start, drain, exit) both read them without importing each other."""

from aiohttp import web

from moejax.server import protocol
from moejax.server.async_engine import AsyncEngine

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
CTX_KEY = web.AppKey("ctx", protocol.ServingContext)
STATE_KEY = web.AppKey("state", object)
