"""What the local launcher prints, and which of Ray's own lines it keeps out of the way.

The launcher says in a few plain lines where it serves, which model runs how, where
the metrics and the logs are, and on failure what to do. Ray's driver prints lines
of its own that mislead in this setting; without --verbose they are hidden:
- Serve's INFO lines ("Started Serve", "Connecting to existing Serve app ... New
  http_options/controller_options will not be applied": `serve.run` always looks for
  the Serve that `serve.start` just started with our options, and says so);
- "Task ServeController.graceful_shutdown (or .listen_for_change) failed ... killed
  by `ray.kill`": a clean `serve.shutdown` ends with Serve's controller killing
  itself, and Ray's driver reports the calls still open on it as failed tasks.
Ray's token-auth notice ("Set RAY_AUTH_MODE=disabled to opt out") does not appear
because the launcher sets RAY_AUTH_MODE=token itself, which is what Ray would pick.
Warnings and errors of Ray's still show.
"""
from __future__ import annotations

import json
import logging
import sys


def is_misleading(text: str) -> bool:
    """A line Ray's driver prints (to stdout) in a clean run that would only alarm:
    see the module docstring."""
    return "Task ServeController." in text and "killed by `ray.kill`" in text


class LineFilter:
    """A text stream that drops the lines `drop` picks.

    NOTE: Ray's driver prints each line with print(), which writes the text and
    its newline in two calls; the newline of a dropped line is dropped too."""

    def __init__(self, stream, drop=is_misleading) -> None:
        self._stream = stream
        self._drop = drop
        self._dropped_text = False

    def write(self, text: str) -> int:
        if self._drop(text):
            self._dropped_text = True
            return len(text)
        if self._dropped_text and text == "\n":
            self._dropped_text = False
            return len(text)
        self._dropped_text = False
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def quiet_ray() -> None:
    """Hide Serve's driver-side INFO lines and Ray's misleading ones (module docstring).
    Call before `ray.init`; pass logging_level=WARNING to `ray.init` as well."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    sys.stdout = LineFilter(sys.stdout)


def say(line: str) -> None:
    print(line, flush=True)


# The launcher's exit status when Ray's own start-up gave up on a busy machine: a
# temporary failure (sysexits' EX_TEMPFAIL), worth one more try (loadtests/serving/local_server.py).
EXIT_TRY_AGAIN = 75


def error(message: str, hint: str | None = None) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    if hint:
        print(f"  {hint}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def model_line(info: dict, num_engines: int, num_ingresses: int, engine_num_gpus: float) -> str:
    """`Model: smollm2-135m (bfloat16 on cpu, weights Q4_1/Q8_0 (native), 97 MB, attention
    backend cpu, ...); 1 engine replica, ...`."""
    how = [f"{info['dtype']} on {info['device']}"] if info.get("dtype") else []
    if info.get("weights"):
        size = f", {info['weight_bytes'] / 1e6:,.0f} MB" if info.get("weight_bytes") else ""
        how.append(f"weights {info['weights']}{size}")
    if info.get("attention_backend"):
        how.append(f"attention backend {info['attention_backend']}")
    if info.get("num_kv_tokens"):
        how.append(f"KV cache {info['num_kv_tokens']:,} tokens")
    gpus = f", {engine_num_gpus:g} GPU each" if engine_num_gpus else ""
    replicas = (f"{num_engines} engine replica{'s' if num_engines != 1 else ''}{gpus}, "
                f"{num_ingresses} ingress replica{'s' if num_ingresses != 1 else ''}")
    details = f" ({', '.join(how)})" if how else ""
    return f"Model: {info.get('model')}{details}; {replicas}"


def curl_line(base: str, model: str, has_key: bool) -> str:
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 32,
                       "stream": True})
    auth = ' -H "Authorization: Bearer $STEPSTREAM_API_KEY"' if has_key else ""
    return (f"curl -sN {base}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")
