"""Who may reach the API when no key is set.

Without an API key every route is open to whoever can reach the server's
address. So with no key the server serves on a loopback address only; on any
other address it refuses to start unless `allow_unauthenticated: true` says
so explicitly. It logs a warning either way.

The address is Serve's HTTP proxy's: `serve_local` knows it from its flags;
`build_app` (through `AppArgs`) asks the running Serve controller, and checks
nothing when there is none (a build without a deploy, unit tests).
"""
from __future__ import annotations

import ipaddress
import os

API_KEY_ENV = "STEPSTREAM_API_KEY"


def has_api_key(api_key: str | None, api_key_sha256: str | None) -> bool:
    """A key is configured, or set in this process's environment (where the
    ingress reads it too)."""
    return bool(api_key or api_key_sha256 or os.environ.get(API_KEY_ENV))


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


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxy binds, or None without a running Serve here.

    NOTE: never starts Ray or Serve: only asks a controller that already runs."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=30).host
    except Exception:  # no controller (yet), or an older Serve: nothing to check
        return None
