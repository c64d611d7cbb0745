"""Who may drive the server: API key, Host (DNS rebinding), CORS origins and Content-Type.

A web page the user opens must not be able to drive a local server. Browsers send
"simple" cross-site POSTs (``Content-Type: text/plain``) without a preflight, and a
DNS-rebinding page reaches 127.0.0.1 under its own host name. So:

- POSTs must be ``application/json`` (415 otherwise): a cross-site page cannot send that
  without a CORS preflight, which only an allowed origin passes;
- a request carrying an ``Origin`` that is not allowed gets 403, and CORS headers are only ever
  sent to allowed origins (none by default: closed);
- when bound to a loopback address, a ``Host`` header naming anything but a loopback name or
  the bound host gets 403;
- with an API key (``--api-key`` / ``MOEJAX_API_KEY``), /v1/* needs ``Authorization: Bearer <key>`` (401).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress

from aiohttp import web

from moejax.server.protocol import error_body

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """'name:port', '[::1]:port', 'name' -> the name (lowercased, brackets kept off)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h[1:]
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # exact origins ("http://localhost:3000") or "*"
    bind_host: str | None = None  # the address the server listens on; loopback enables the Host check

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.rstrip("/") in {o.rstrip("/") for o in self.allowed_origins}

    def host_allowed(self, host_header: str | None) -> bool:
        if not self.bind_host or not _is_loopback(self.bind_host) or not host_header:
            return True
        name = _host_name(host_header)
        return _is_loopback(name) or name == self.bind_host.strip("[]").lower()


def _deny(status: int, message: str, code: str | None = None, headers: dict | None = None) -> web.Response:
    typ = "invalid_request_error" if status != 403 else "permission_error"
    return web.json_response(error_body(message, typ, None, code or status), status=status, headers=headers)


def access_middleware(policy: AccessPolicy):
    @web.middleware
    async def check_access(request: web.Request, handler):
        if not policy.host_allowed(request.headers.get("Host")):
            return _deny(403, f"Host {request.headers.get('Host')!r} is not allowed: this server only answers "
                              "requests addressed to its loopback name", "host_not_allowed")
        origin = request.headers.get("Origin")
        if origin is not None and not policy.origin_allowed(origin):
            return _deny(403, f"Origin {origin!r} is not allowed (see --allowed-origins)", "origin_not_allowed")
        if request.method == "OPTIONS" and origin is not None:  # a CORS preflight of an allowed origin
            return web.Response(status=204, headers={"Access-Control-Allow-Methods": CORS_METHODS,
                                                     "Access-Control-Allow-Headers": CORS_HEADERS,
                                                     "Access-Control-Max-Age": "600"})
        if policy.api_key and request.path.startswith("/v1/"):
            auth = request.headers.get("Authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), policy.api_key.encode()):
                msg = "Incorrect API key provided" if auth else "Missing API key: send 'Authorization: Bearer <key>'"
                return _deny(401, msg, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if request.method == "POST" and request.content_type != "application/json":
            return _deny(415, f"Content-Type must be application/json, got {request.content_type!r}",
                         "unsupported_media_type")
        return await handler(request)

    return check_access


def add_cors_headers(policy: AccessPolicy):
    """on_response_prepare hook: CORS headers for allowed origins only (streams included)."""
    async def hook(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and policy.origin_allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
    return hook
