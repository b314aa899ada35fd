"""Ingress: the OpenAI-compatible HTTP API, a Ray Serve deployment over FastAPI.

Per request: auth -> the ingress's bound on requests without a first token
(cluster/api/pending_gate.py: 429 past it, before any other work) -> read the body
(size-bounded) -> parse (pydantic: JSON types and the API's own fields) ->
SamplingParams (their own rules) -> chat template ->
tokenize (off the event loop, after a cheap length check) -> the model's limits
(`replicas.request_validation.RequestLimits`) -> admit an `EngineRequest` on an
EngineReplica through a Serve handle -> deltas on the per-step channel
(cluster/transport/channels, cluster/transport/relay) -> text deltas -> SSE events or one JSON body.
All checks happen BEFORE the replica is called; errors are OpenAI-shaped 4xx
(cluster/errors), never a traceback.
"""
# NOTE: no `from __future__ import annotations` here: FastAPI must see `Request`
# as a class, not a string, through Serve's class-based views.
import asyncio
import contextvars
import dataclasses
import hmac
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from cluster.api.access import (API_KEY_ENV, check_access, is_json_content_type, is_loopback,
                                is_loopback_host_header, key_digest, serve_http_host)
from cluster.errors import ApiError, bad_request
from cluster.api.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                         validation_error_message)
from cluster.transport.channels import ChannelHub
from cluster.api.choice_runs import ChoiceRuns
from cluster.api.engine_health import EngineHealth, EngineHealthCheck
from cluster.errors import replica_error
from cluster.http_scheduling import batch_this_process
from cluster.api.openai_events import SSE_HEADERS, ChatFormatter, CompletionFormatter, TokenLabels
from cluster.api.pending_gate import RETRY_AFTER_S, PendingGate
from cluster.api.tools.formats import probe_template
from cluster.api.tools.grammar import call_schema, tool_grammar
from cluster.api.tools.prompt import chat_for_template
from cluster.api.tools.stream import ToolAnswers
from cluster.api.response_writer import SSEResponse, abort_all, json_answer, sse_events
from replicas.config import InvalidValue, SamplingParams  # plain data: no torch
from replicas.request_validation import RequestLimits
from replicas.sampling.grammar_text import GrammarChecks, LanesBusy, checked_grammar_text
from deltas.text_stream import TextStream

logger = logging.getLogger("ray.serve")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# A request body must be all in within this long (408 past it): it is read before the
# request takes a pending slot, and the deadline ends a body that trickles in.
DEFAULT_BODY_TIMEOUT_S = 30.0
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it, which Serve's access log uses too
# /v1/models waits this long at most for the engine's model info (its max_model_len): a
# model list must answer while no engine replica is up yet
MODEL_CARD_INFO_WAIT_S = 2.0
# Prompts of at most this many characters are tokenized on the event loop: the
# tokenizer holds the GIL for a text this short anyway (deltas/tokenization/tokenizer.py,
# _RELEASE_GIL_CHARS), so a worker thread would stall the loop as long, and add its
# hand-offs.
INLINE_TOKENIZE_CHARS = 4096
# ... and chats of at most this many messages (the template's Python work grows with them).
INLINE_TEMPLATE_MESSAGES = 32

app = FastAPI(title="stepstream", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return bad_request(f"Invalid request: {first.get('msg', 'invalid value')}", param).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    state = request.app.state
    # NOTE: deny by default: with an API key set, unknown routes answer 401, not 404.
    if getattr(state, "api_key_digest", None) and not _is_authorized(request):
        return _unauthorized().response()
    message = exc.detail if isinstance(exc.detail, str) else "Request failed"
    if exc.status_code == 404:
        message = f"Not found: {request.method} {request.url.path}"
    return ApiError(exc.status_code, message).response()


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error in %s %s", request.method, request.url.path)
    return ApiError(500, "Internal server error", code="internal_error").response()


def _unauthorized() -> ApiError:
    return ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key")


def _access_mode(api_key_sha256: str | None, allow_unauthenticated: bool,
                 num_tries: int = 3) -> tuple[bytes | None, bool]:
    """(the expected key digest, whether only loopback Host headers may be served).

    NOTE: the digest comes from where the app was built (cluster/api/access.py), never
    from this replica's environment. Without one, the no-key rule is checked here
    against the host the running Serve binds: raises ValueError (the replica does
    not start) on a non-loopback host, or when that host cannot be learned, unless
    allow_unauthenticated."""
    if api_key_sha256:
        return bytes.fromhex(api_key_sha256), False
    host = None
    for _ in range(num_tries):
        host = serve_http_host()
        if host is not None:
            break
    if host is None and not allow_unauthenticated:
        raise ValueError("refusing to serve without an API key: the HTTP host Serve binds "
                         "could not be learned from its controller, so it may not be "
                         f"loopback; set {API_KEY_ENV} (or api_key / api_key_sha256), or "
                         "allow_unauthenticated: true")
    warning = check_access(host, has_key=False, allow_unauthenticated=allow_unauthenticated)
    logger.warning(warning or "No API key")
    return None, host is not None and is_loopback(host)


def _forbidden_host(request: Request) -> ApiError | None:
    """No-key loopback mode: a request for a name other than loopback's is a web
    page's (DNS rebinding), never a local client's."""
    if not getattr(request.app.state, "loopback_hosts_only", False):
        return None
    if is_loopback_host_header(request.headers.get("host")):
        return None
    return ApiError(403, "Host not allowed: without an API key this server answers "
                    "requests for localhost / 127.0.0.1 / [::1] only", code="host_not_allowed")


def _unsupported_media_type(request: Request) -> ApiError | None:
    if is_json_content_type(request.headers.get("content-type")):
        return None
    return ApiError(415, "Unsupported media type: send the body as "
                    "'Content-Type: application/json'", code="unsupported_media_type")


def _is_authorized(request: Request) -> bool:
    expected = getattr(request.app.state, "api_key_digest", None)
    if not expected:
        return True
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Digests of equal length compared in constant time: neither the key nor its
    # length leaks through timing.
    return hmac.compare_digest(key_digest(token.strip()), expected)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit} bytes",
                    code="request_too_large")


def _parse(model_cls, body: bytes):
    if not body:
        raise bad_request("The request body is empty; send a JSON object")
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as e:
        message, param = validation_error_message(e)
        raise bad_request(message, param) from None


def _bad_value(error: InvalidValue) -> ApiError:
    message = str(error)
    if error.code is None and error.param:
        message = f"Invalid value for '{error.param}': {message}"
    return bad_request(message, error.param, error.code)


def _sampling_params(req) -> SamplingParams:
    """The request's SamplingParams; a 400 naming the field the client sent."""
    try:
        return req.sampling_params()
    except InvalidValue as e:
        raise _bad_value(e) from None


def _check_limits(limits: RequestLimits, prompts: list[list[int]],
                  params: SamplingParams) -> list[int]:
    """The most output tokens each prompt may make; a 400 naming the field (and a
    batch's prompt) if the model cannot run one (prompt ids, stop ids, prompt +
    max_tokens past the context)."""
    most = []
    for index, prompt_ids in enumerate(prompts):
        try:
            most.append(limits.check(prompt_ids, params, must_fit=True))
        except InvalidValue as e:
            error = _bad_value(e)
            # NOTE: stop_token_ids and logit_bias are the request's, not the prompt's
            if len(prompts) > 1 and e.param in ("prompt", "max_tokens"):
                error.message = f"Prompt {index} of the batch: {error.message}"
            raise error from None
    return most


def _check_engine_requests(num_prompts: int, n: int, most: int | None) -> None:
    """A 400 for a request whose choices (n for each prompt, each an engine request)
    are more than the engine replicas admit at once at their most (`most`; None: no
    bound known). They cannot all hold an admission together: unless the first finish
    before the last are admitted (the shortest answers), the engines refuse the
    request (429) however often its client retries. One stated limit beats a refusal
    by timing. Below it a request may still meet 429s that a retry can pass: busy
    engines, a prompt's choices kept on one replica, fewer replicas up than
    autoscaling's most."""
    needed = num_prompts * n
    if most is None or needed <= most:
        return
    # NOTE: a batch names `prompt`, as the protocol's 128-choice check does
    what = (f"n={n}" if num_prompts == 1 else
            f"a batch of {num_prompts} prompts" + (f" with n={n}" if n > 1 else ""))
    raise bad_request(
        f"{what} makes {needed} choices, each an engine request; this server's engine "
        f"replicas admit at most {most} at once. Ask for fewer choices per request.",
        "n" if num_prompts == 1 else "prompt")


def _prompt_chars(req, chat: bool) -> list[int]:
    """Characters each prompt holds at least (0 for token ids): a bound on its
    tokens. A chat prompt counts each message's role, content and template framing,
    so that many empty messages count too."""
    if chat:
        # NOTE: the fewest characters a chat template adds around a message besides
        # its role (ChatML adds 24, Llama 3 about 45, Mistral's [INST] 15 a turn).
        min_framing_chars = 2
        return [sum(len(m.role) + len(m.text()) + min_framing_chars for m in req.messages)]
    return [len(p) if isinstance(p, str) else 0 for p in req.prompts]


def _bad_tool(req, fmt) -> tuple[str, str] | None:
    """(message, param) naming the first tool whose `parameters` the grammar engine
    refuses; None where each is accepted alone."""
    for index, tool in enumerate(req.tools):
        function = tool.function
        try:
            checked_grammar_text({"json": call_schema(function.name, function.parameters, fmt)})
        except InvalidValue as e:
            detail = str(e).split(": ", 1)[-1]
            param = f"tools.{index}.function.parameters"
            return f"Invalid value for '{param}': not a JSON schema the server can hold " \
                   f"arguments to: {detail}", param
    return None


def _max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for (None: unknown)."""
    table = tokenizer.byte_table
    if table is None:
        return None
    return max(1, max(len(b) for b in table.piece_bytes))


def developer_role(tokenizer) -> str:
    """The role a `developer` message renders as: its own where the chat template
    names it (as a quoted role, not a word of its default system prompt), else
    `system` (most templates know no developer role, and would add their default
    system prompt before it)."""
    template = tokenizer.chat_templates.get("default", "")
    return "developer" if "'developer'" in template or '"developer"' in template else "system"


def _ingress_identity() -> tuple[str, object]:
    """A channel owner id unique to this ingress replica's life, and its actor handle
    (the engine replicas ping it to notice that it died)."""
    import ray

    try:
        replica_id = serve.get_replica_context().replica_id.unique_id
    except Exception:
        replica_id = "local"
    try:
        handle = ray.get_runtime_context().current_actor
    except Exception:  # not inside an actor (tests)
        handle = None
    # NOTE: the suffix is this ingress's channel capability: 122 random bits, never logged.
    return f"{replica_id}-{uuid.uuid4().hex}", handle


def _server_timing(first_token_s: float) -> str:
    """The `Server-Timing` header of an answer: from the moment this ingress let the
    request in (cluster/api/pending_gate.py) to its first token, in ms. What a client
    measures on top of it is the network, the front door and its own queue."""
    return f"ttft;dur={first_token_s * 1000:.1f}"


HEALTH_CACHE_TTL_S = 1.0


class _HealthCache:
    """The engine's health as /health reports it (cluster/api/engine_health.py: every
    engine replica's). /health is open without a key, so however often it is hit, the
    engine is asked at most once per `ttl_s`, by one check that every hit meanwhile shares.
    `check` never raises."""

    def __init__(self, ttl_s: float, check) -> None:
        self._ttl_s = ttl_s
        self._check_engine = check  # async () -> EngineHealth
        self._checked_at = float("-inf")
        self._health = EngineHealth(error="not checked yet")
        self._check_task: asyncio.Task | None = None

    async def health(self) -> EngineHealth:
        if time.monotonic() - self._checked_at < self._ttl_s:
            return self._health
        if self._check_task is None or self._check_task.done():
            # NOTE: a fresh context: a task started inside a request's context is
            # cancelled with that request (a client hanging up), and would then fail
            # every later hit.
            self._check_task = asyncio.get_running_loop().create_task(
                self._check(), context=contextvars.Context())
        # NOTE: shielded: a client hanging up must not cancel the check others wait on.
        await asyncio.shield(self._check_task)
        return self._health

    async def _check(self) -> None:
        health = await self._check_engine()
        self._health, self._checked_at, self._check_task = health, time.monotonic(), None


# NOTE: the class comes last: serve.ingress copies the route methods with a snapshot
# of the module globals taken here, so every helper they use must be defined above.
# NOTE: deployment options only in `AppArgs.ingress_options` (cluster/app.py), which sets them.
@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, engine, served_model_name: str, model: str,
                 api_key_sha256: str | None = None, allow_unauthenticated: bool = False,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 request_timeout_s: float | None = None,
                 queue_timeout_s: float | None = None,
                 max_pending_requests: int | None = None,
                 max_engine_requests: int | None = None) -> None:
        from deltas.tokenization.tokenizer import Tokenizer
        from replicas.checkpoints.presets import resolve_tokenizer_dir

        # NOTE: first, so that the threads the replica starts from here on inherit it
        batch_this_process()
        self._engine = engine
        # NOTE: by value (gRPC), not through the object store: per-request and
        # per-step messages are small, and the store's round trip costs more.
        self._engine_stream = engine.options(stream=True, _by_reference=False)
        owner, owner_handle = _ingress_identity()
        # NOTE: channels get a handle of their own, so a router of their own: a
        # channel call never waits in the queue of a burst of admission calls (which
        # wait, in turn, for the channel to take their deltas).
        channel_handle = serve.get_deployment_handle(
            engine.deployment_name, app_name=engine.app_name).options(
            stream=True, _by_reference=False)
        self._channels = ChannelHub(channel_handle, owner, owner_handle)
        self._served_model_name = served_model_name
        self._model = model
        self._tokenizer = Tokenizer.from_dir(resolve_tokenizer_dir(model))
        self._token_labels = TokenLabels.of_tokenizer(self._tokenizer)
        self._max_token_chars = _max_token_chars(self._tokenizer)
        self._developer_role = developer_role(self._tokenizer)
        # NOTE: once: does the template render tools, and in which form do its calls come
        self._template_tools = probe_template(
            lambda messages, tools: self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=False, tools=tools))
        self._max_body_bytes = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._request_timeout_s = request_timeout_s
        self._queue_timeout_s = queue_timeout_s
        self._pending = PendingGate(max_pending_requests)
        self._grammar_checks = GrammarChecks()
        self._max_engine_requests = max_engine_requests
        self._model_info: dict | None = None
        self._limits: RequestLimits | None = None  # from the engine's model_info
        self._created = int(time.time())
        app.state.api_key_digest, app.state.loopback_hosts_only = _access_mode(
            api_key_sha256, allow_unauthenticated)
        self._metrics = None
        try:
            from cluster.metrics import IngressMetrics
            self._metrics = IngressMetrics(served_model_name)
        except Exception:
            logger.warning("ingress metrics disabled", exc_info=True)

    # ---- routes -----------------------------------------------------------------

    # NOTE: HEAD too: load balancers' and uptime checkers' probes often use it
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self) -> JSONResponse:
        cache = getattr(self, "_health_cache", None)
        if cache is None:  # made on first use: one per ingress replica
            cache = self._health_cache = _HealthCache(
                HEALTH_CACHE_TTL_S, EngineHealthCheck(self._engine).run)
        # NOTE: 200 while any engine replica serves; the body counts them and names the rest
        return (await cache.health()).response()

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [await self._model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        """One model's card (the OpenAI client's `models.retrieve`)."""
        self._authorize(request)
        if model_id != self._served_model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves "
                           f"'{self._served_model_name}'", param="model", code="model_not_found")
        return JSONResponse(await self._model_card())

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._handle(request, chat=True)

    # ---- request path -----------------------------------------------------------

    async def _handle(self, request: Request, chat: bool):
        route = "chat" if chat else "completions"
        try:
            response = await self._generate(request, chat)
        except ApiError as e:
            self._count(route, e.status)
            raise
        except asyncio.CancelledError:
            # NOTE: the client left before its answer's status: counted as what a
            # proxy logs for it (a stream's later hang-up was counted 200 already)
            self._count(route, CLIENT_CLOSED_REQUEST)
            raise
        self._count(route, response.status_code)
        return response

    async def _generate(self, request: Request, chat: bool):
        self._authorize(request)
        unsupported = _unsupported_media_type(request)
        if unsupported is not None:
            raise unsupported
        # NOTE: past the bound a request costs a counter check, its body unread ...
        self._pending.check()
        # ... and a body is read before the request takes a slot: one that trickles in
        # holds its own connection until its deadline, never a slot of everyone's.
        body = await self._read_body(request)
        self._pending.enter()
        admitted_at = time.monotonic()
        try:
            req = _parse(ChatCompletionRequest if chat else CompletionRequest, body)
            if req.model != self._served_model_name:
                raise ApiError(404, f"The model '{req.model}' does not exist; this server "
                               f"serves '{self._served_model_name}'", param="model",
                               code="model_not_found")
            if chat and req.calls_tools:
                req.with_tool_grammar(await self._tool_grammar(req, len(body)))
            params = _sampling_params(req)
            if params.structured_output is not None:
                params = await self._check_grammar(req, params, len(body))
            _check_engine_requests(1 if chat else len(req.prompts), req.n,
                                   self._max_engine_requests)
            info = await self._info()
            num_chars = self._check_prompt_chars(req, chat, info["max_model_len"])
            if num_chars <= INLINE_TOKENIZE_CHARS and (not chat or len(req.messages)
                                                       <= INLINE_TEMPLATE_MESSAGES):
                prompts = self._prompts_ids(req, chat)
            else:
                # NOTE: off the event loop: a long prompt or chat template must not
                # stall every other stream of this ingress.
                prompts = await asyncio.to_thread(self._prompts_ids, req, chat)
            _check_limits(self._limits, prompts, params)
            num_prompt_tokens = sum(len(prompt_ids) for prompt_ids in prompts)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            started_at = time.monotonic()
            # NOTE: each prompt's n choices are n engine requests, bounded and aborted
            # as n (cluster/api/choices.py)
            runs = ChoiceRuns(
                self._engine_stream, self._channels, request_id, prompts, params, req.n,
                lambda: TextStream(self._tokenizer, stop=req.stop_strings,
                                   include_stop_str_in_output=req.include_stop_str_in_output,
                                   skip_special_tokens=req.skip_special_tokens,
                                   min_tokens=params.min_tokens),
                self._pending, self._request_timeout_s, self._queue_timeout_s)
            relays = await runs.open()
        finally:
            self._pending.leave()  # its first token is in, or it was refused
        timing = {"Server-Timing": _server_timing(time.monotonic() - admitted_at)}
        formatter_cls = ChatFormatter if chat else CompletionFormatter
        formatter = formatter_cls(request_id, self._served_model_name, int(time.time()),
                                  include_usage=req.include_usage)
        labels = self._token_labels if params.logprobs is not None else None
        tool_answers = None
        if chat and req.calls_tools:
            tool_answers = ToolAnswers(self._template_tools.format,
                                       named=req.tool_choice_name not in ("auto", "required"))
        if req.stream:
            choice_prompt_tokens = ([len(p) for p in prompts for _ in range(req.n)]
                                    if req.continuous_usage else None)
            events = sse_events(relays, formatter, chat, labels, self._metrics, started_at,
                                num_prompt_tokens, choice_prompt_tokens, tool_answers)
            return SSEResponse(events, media_type="text/event-stream",
                               headers={**SSE_HEADERS, **timing},
                               on_end=lambda: abort_all(relays))
        return JSONResponse(await json_answer(relays, runs.open_again, formatter, chat,
                                              labels, num_prompt_tokens,
                                              metrics=self._metrics, tool_answers=tool_answers),
                            headers=timing)

    async def _tool_grammar(self, req, size: int) -> str:
        """The grammar of the calls `req` may make, in the template's format (off the
        event loop for a large request: it holds every tool's schema)."""
        args = (req.template_tools(), self._template_tools.format)
        kwargs = {"choice": req.tool_choice_name, "parallel": req.parallel_tool_calls}
        if size <= INLINE_TOKENIZE_CHARS:
            return tool_grammar(*args, **kwargs)
        return await asyncio.to_thread(tool_grammar, *args, **kwargs)

    async def _check_grammar(self, req, params: SamplingParams, size: int) -> SamplingParams:
        """`params` with its structured output as the checked grammar text engines
        compile (replicas/sampling/grammar_text.py): checked once, here, off the event
        loop; a 400 naming the field sent, or a 429 while every checker is busy."""
        try:
            checked = await self._grammar_checks.checked(params.structured_output, size)
        except InvalidValue as e:
            if getattr(req, "calls_tools", False):
                bad = await asyncio.to_thread(_bad_tool, req, self._template_tools.format)
                if bad is not None:
                    raise bad_request(*bad) from None
            sent = req.field_sent_for(e.param)
            raise _bad_value(InvalidValue(str(e).replace(f"{e.param} ", f"{sent} ", 1),
                                          sent, e.code)) from None
        except LanesBusy as e:
            raise ApiError(429, f"The server is busy checking structured outputs ({e}); retry "
                           "later", code="rate_limit_exceeded",
                           retry_after_s=RETRY_AFTER_S) from None
        return dataclasses.replace(params, structured_output=checked)

    def _check_prompt_chars(self, req, chat: bool, max_model_len: int) -> int:
        """400 before tokenizing a prompt too long for the context whatever it holds;
        else the characters the prompts hold at least (`_prompt_chars`)."""
        prompt_chars = _prompt_chars(req, chat)
        if self._max_token_chars is None:
            return sum(prompt_chars)  # no bound to check
        # NOTE: x4 headroom for normalizers that drop characters.
        max_chars = max_model_len * self._max_token_chars * 4
        longest = max(prompt_chars)
        if longest > max_chars:
            which = ("The prompt" if len(prompt_chars) == 1 else
                     f"Prompt {prompt_chars.index(longest)} of the batch")
            what = (f"The {len(req.messages)} messages make at least {longest} characters "
                    "with the chat template" if chat else f"{which} has {longest} characters")
            raise bad_request(
                f"{what}, more than this model's maximum context length of {max_model_len} "
                f"tokens can hold (at most {max_chars} characters). Please shorten the prompt.",
                "messages" if chat else "prompt", "context_length_exceeded")
        return sum(prompt_chars)

    def _prompts_ids(self, req, chat: bool) -> list[list[int]]:
        """The token ids of each prompt: chat's one, or a completions batch's."""
        if chat:
            try:
                messages, tools = chat_for_template(req.template_messages(self._developer_role),
                                                    req.template_tools(), self._template_tools)
                # NOTE: special-token text in the messages stays text: a user cannot forge a turn
                return [self._tokenizer.encode_chat(
                    messages, add_generation_prompt=req.add_generation_prompt, tools=tools)]
            except Exception as e:
                raise bad_request(f"Could not apply the chat template: {e}", "messages") from None
        return [self._tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str)
                else list(p) for p in req.prompts]

    async def _model_card(self) -> dict:
        card = {"id": self._served_model_name, "object": "model", "created": self._created,
                "owned_by": "stepstream", "root": self._model}
        try:
            info = await asyncio.wait_for(self._info(), MODEL_CARD_INFO_WAIT_S)
            card["max_model_len"] = info["max_model_len"]
            # NOTE: which weights run and their bytes in memory, where the engine says
            for key in ("quantization", "weights", "weight_bytes"):
                if key in info:
                    card[key] = info[key]
        except (ApiError, asyncio.TimeoutError):
            pass  # no engine replica answers now: the card without its context length
        return card

    async def _info(self) -> dict:
        if self._model_info is None:
            try:
                info = await self._engine.model_info.remote()
            except Exception as e:
                raise replica_error(e) from None
            self._limits = RequestLimits(info["vocab_size"], info["max_model_len"],
                                         tuple(info["eos_token_ids"]))
            self._model_info = info
        return self._model_info

    async def _read_body(self, request: Request) -> bytes:
        """The body, at most max_body_bytes (413), all in within body_timeout_s (408)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_body_bytes:
            raise _too_large(self._max_body_bytes)
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > self._max_body_bytes:
                    raise _too_large(self._max_body_bytes)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self._body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"The request body did not arrive within {self._body_timeout_s:g} "
                           f"s ({size} bytes came)", code="request_timeout") from None
        return b"".join(chunks)

    def _authorize(self, request: Request) -> None:
        if not _is_authorized(request):
            raise _unauthorized()
        forbidden = _forbidden_host(request)
        if forbidden is not None:
            raise forbidden

    def _count(self, route: str, status: int) -> None:
        if self._metrics is not None:
            self._metrics.count_request(route, status)
