"""Who may reach the API.

The key is resolved once, where the app is built (`AppArgs.api_key_digest`): the
config's `api_key_sha256`, else the SHA-256 of its `api_key`, else of the env var
STEPSTREAM_API_KEY in the process that builds the app. Every ingress replica gets
that digest as an argument and never reads its own node's environment, so an
ingress on a node without the variable is not open.

Without an API key every route is open to whoever can reach the server's
address. So with no key the server serves on a loopback address only; on any
other address it refuses to start unless `allow_unauthenticated: true` says
so explicitly. It logs a warning either way. The rule runs where the app is
built (`serve_local` knows the host from its flags; `AppArgs` asks a running
Serve controller) and again in every ingress replica's constructor against the
HTTP host the running Serve actually binds, so no way of starting the app skips it.

In no-key loopback mode a web page the local user opens must not reach the API:
a request whose `Host` header is not a loopback name or address is refused
(DNS rebinding), and POST bodies must be `application/json` (a page can send
`text/plain` without a CORS preflight; JSON needs one), with a key too.
"""
from __future__ import annotations

import functools
import hashlib
import ipaddress
import os

API_KEY_ENV = "STEPSTREAM_API_KEY"
JSON_MEDIA_TYPE = "application/json"


def key_digest(key: str) -> bytes:
    """A key's SHA-256: what configs carry, and what the ingress compares."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_sha256_hex(api_key: str | None, api_key_sha256: str | None) -> str | None:
    """The key's SHA-256 (hex), from the config or this process's environment;
    None when no key is set anywhere here."""
    if api_key_sha256:
        return api_key_sha256.lower()
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    return key_digest(api_key).hex() if api_key else None


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_access(host: str | None, has_key: bool, allow_unauthenticated: bool) -> str | None:
    """The warning to log when there is no key (None: nothing to say). Raises
    ValueError when serving without a key on a non-loopback address is not
    allowed explicitly."""
    if has_key or host is None:
        return None
    if is_loopback(host):
        return (f"No API key: every route is open to anyone on this machine (serving on "
                f"{host} only). Set {API_KEY_ENV} to require one.")
    if not allow_unauthenticated:
        raise ValueError(
            f"refusing to serve on {host}, a non-loopback address, without an API key: "
            f"set {API_KEY_ENV} (or api_key / api_key_sha256), bind 127.0.0.1, or set "
            "allow_unauthenticated: true")
    return (f"No API key and serving on {host}: every route is open to anyone who can "
            "reach it (allow_unauthenticated: true).")


@functools.lru_cache(maxsize=64)
def is_loopback_host_header(value: str | None) -> bool:
    """A `Host` header naming this machine's loopback (`localhost`, 127.x.y.z,
    `[::1]`), with or without a port. Anything else, or none, is not.

    NOTE: cached: it runs for every request, and its clients send a few values."""
    if not value:
        return False
    host = value.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host == "localhost" or host.endswith(".localhost") or is_loopback(host)


def is_json_content_type(value: str | None) -> bool:
    """`application/json`, with or without parameters (`; charset=utf-8`)."""
    return bool(value) and value.split(";", 1)[0].strip().lower() == JSON_MEDIA_TYPE


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxy binds, or None without a running Serve here.

    NOTE: never starts Ray or Serve: only asks a controller that already runs."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from cluster.transport.ray_internals import serve_controller_name, serve_namespace

        controller = ray.get_actor(serve_controller_name(), namespace=serve_namespace())
        return ray.get(controller.get_http_config.remote(), timeout=30).host
    except Exception:  # no controller (yet), or an older Serve: nothing to check
        return None
