"""Pydantic models of the OpenAI requests we accept (completions and chat).

Strict on purpose: wrong JSON types are 400s, not silent coercions ("2" is not 2),
unknown fields are 400s (as OpenAI itself answers), NaN and infinities are
refused. Value ranges of the sampling fields are not repeated here:
`sampling_params()` builds the engine's `replicas.config.SamplingParams`, whose
own checks name the field, and the ingress turns the error into a 400. For fields
whose name differs from the engine's (chat's `top_logprobs`,
`max_completion_tokens`) the error names the field the client sent. Responses are
built as plain dicts in `cluster/api/openai_events.py` (cheaper than models on the per-chunk
path).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError,
                      ValidationInfo, field_validator, model_validator)

# NOTE: plain data: no torch
from replicas.config import STRUCTURED_OUTPUT_KEYS, InvalidValue, SamplingParams

MAX_STOP_STRINGS = 16
# Choices of one request, as OpenAI bounds `n`; each runs as an engine request of
# its own, so the engine's queue bounds count every one.
MAX_CHOICES = 128
MAX_STOP_STRING_CHARS = 512

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
# A sampling field the client leaves out takes the engine's default: declared once,
# in `SamplingParams`.
_ENGINE_DEFAULT = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    # NOTE: the output is held to the schema whether strict is true or not
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_its_type(self):
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of its fields."""

    model_config = _STRICT
    json_: Union[dict, str, None] = Field(None, alias="json")  # a schema, or its JSON text
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark

    def spec(self) -> dict:
        """The engine's `structured_output`; raises InvalidValue."""
        sent = self.model_dump(by_alias=True, exclude_none=True)
        if len(sent) != 1:
            raise InvalidValue(f"structured_outputs must set exactly one of "
                               f"{', '.join(STRUCTURED_OUTPUT_KEYS)}; got {sorted(sent) or 'none'}",
                               "structured_outputs")
        (key, value), = sent.items()
        if key == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidValue(f"structured_outputs.json is not valid JSON: {e}",
                                   "structured_outputs") from None
        return {key: value}


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = None
    temperature: float = _ENGINE_DEFAULT["temperature"]
    top_p: float = _ENGINE_DEFAULT["top_p"]
    top_k: int = _ENGINE_DEFAULT["top_k"]
    min_p: float = _ENGINE_DEFAULT["min_p"]
    seed: int | None = _ENGINE_DEFAULT["seed"]
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = _ENGINE_DEFAULT["ignore_eos"]
    presence_penalty: float = _ENGINE_DEFAULT["presence_penalty"]
    frequency_penalty: float = _ENGINE_DEFAULT["frequency_penalty"]
    repetition_penalty: float = _ENGINE_DEFAULT["repetition_penalty"]
    min_tokens: int = _ENGINE_DEFAULT["min_tokens"]
    # JSON keys are strings: token ids as decimal strings, as OpenAI sends them
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("n")
    @classmethod
    def _num_choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}]")
        return n

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options, info: ValidationInfo):
        # As OpenAI: never ignore a field silently.
        if options is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        if stop is None:
            return stop
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in stops:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} "
                                 "characters")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk too (as vLLM: only with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """The engine's `logprobs`: None, or how many alternatives per token."""
        return None

    def sampling_params(self) -> SamplingParams:
        """The engine's sampling settings, checked by their own rules. Raises
        InvalidValue naming the field the client sent."""
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, seed=self.seed, max_tokens=self.requested_max_tokens,
                min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, logprobs=self.num_logprobs,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=_token_id_keys(self.logit_bias),
                structured_output=self._structured_output())
        except InvalidValue as e:
            sent = self.field_sent_for(e.param)
            if sent == e.param:
                raise
            message = str(e).replace(f"{e.param} ", f"{sent} ", 1)
            raise InvalidValue(message, sent, e.code) from None

    def _structured_output(self) -> dict | None:
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise InvalidValue("structured_outputs cannot be sent with a response_format other "
                               "than text", "structured_outputs")
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"json_object": True}
        return {"json": fmt.json_schema.schema_}

    def field_sent_for(self, engine_field: str | None) -> str | None:
        """The request's field that an engine field named in an error came from."""
        if engine_field == "structured_output":
            return "structured_outputs" if self.structured_outputs is not None else "response_format"
        return engine_field


def _is_batch(prompt) -> bool:
    """A list of prompts, not one prompt's token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def _token_id_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    # NOTE: at most 19 digits (int64), and int() never sees a huge string
    bad = next((k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 19)), None)
    if bad is not None:
        raise InvalidValue(f"logit_bias keys must be token ids as decimal strings, got {bad[:40]!r}",
                           "logit_bias")
    return {int(k): b for k, b in bias.items()}


class CompletionRequest(_SamplingFields):
    # A string, or token ids, or a batch of either: each prompt gets `n` choices, at
    # most MAX_CHOICES in all (each is an engine request). A batch of one is its prompt.
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch's, in order."""
        return list(self.prompt) if _is_batch(self.prompt) else [self.prompt]

    @field_validator("prompt")
    @classmethod
    def _prompt_or_batch(cls, prompt, info: ValidationInfo):
        if _is_batch(prompt):
            if len(prompt) == 1:
                prompt = prompt[0]
            else:
                # NOTE: `n` is declared (and checked) before `prompt`; absent if it failed
                n = info.data.get("n", 1)
                if len(prompt) * n > MAX_CHOICES:
                    raise ValueError(f"a batch of {len(prompt)} prompts with n={n} makes "
                                     f"{len(prompt) * n} choices; at most {MAX_CHOICES} are "
                                     "allowed per request")
                empty = next((i for i, p in enumerate(prompt) if not p), None)
                if empty is not None:
                    raise ValueError(f"prompt {empty} of the batch is empty")
                return prompt
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, best_of, info: ValidationInfo):
        # NOTE: best_of == n returns every sequence made: the same as n alone.
        if best_of is not None and best_of != info.data.get("n", 1):
            raise ValueError("best_of must equal n (default 1): choosing the best of more "
                             "sequences than are returned is not supported")
        return best_of


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


# As OpenAI names functions
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: no arguments
    # NOTE: the arguments are held to the schema whether strict is true or not
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _TOOL_NAME.fullmatch(name):
            raise ValueError("a function's name must be 1 to 64 letters, digits, '_' or '-'")
        return name


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @model_validator(mode="after")
    def _content_given(self):
        # NOTE: as the OpenAI API: only an assistant message may come without content
        # (a replayed turn); a null prompt from any other role is a client's bug, not
        # an empty message
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message may hold tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the call it answers), and "
                             "only a tool message may hold one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    # the grammar of the calls the request may make (cluster/api/tools/grammar.py):
    # it depends on the chat template's format, which the ingress knows
    _tool_grammar: str | None = PrivateAttr(None)

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools):
        if tools is None:
            return tools
        if not 1 <= len(tools) <= MAX_TOOLS:
            raise ValueError(f"tools must hold 1 to {MAX_TOOLS} tools (leave it out for none)")
        names = [t.function.name for t in tools]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"the function name {twice!r} is given twice")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info: ValidationInfo):
        if choice is None:
            return choice
        # NOTE: tools is declared (and checked) before tool_choice; absent if it failed
        tools = info.data.get("tools")
        if not tools:
            raise ValueError("tool_choice is only allowed when tools are given")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in tools]
            if choice.function.name not in names:
                raise ValueError(f"the function {choice.function.name[:64]!r} is not one of "
                                 f"the tools ({', '.join(names[:8])}{' ...' if len(names) > 8 else ''})")
        return choice

    @property
    def tool_choice_name(self) -> str | None:
        """What the request asks of its tools: "none", "auto", "required", or the
        named function's name; None without tools. OpenAI's default: "auto" with
        tools."""
        if not self.tools:
            return None
        if self.tool_choice is None:
            return "auto"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice

    @property
    def calls_tools(self) -> bool:
        """The model may call the tools (and its answer is parsed for calls)."""
        return self.tool_choice_name not in (None, "none")

    def with_tool_grammar(self, grammar: str | None) -> "ChatCompletionRequest":
        self._tool_grammar = grammar
        return self

    def _structured_output(self) -> dict | None:
        if not self.calls_tools:
            return super()._structured_output()
        fmt = self.response_format
        if (fmt is not None and fmt.type != "text") or self.structured_outputs is not None:
            raise InvalidValue("tools the model may call cannot be combined with "
                               "response_format or structured_outputs (both decide the "
                               "answer's form); send tool_choice \"none\" or leave one out",
                               "structured_output")
        return None if self._tool_grammar is None else {"grammar": self._tool_grammar}

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, k, info: ValidationInfo):
        if k is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")  # as OpenAI
        return k

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs

    def field_sent_for(self, engine_field: str | None) -> str | None:
        """The request's field that an engine field named in an error came from."""
        if engine_field == "structured_output" and self.calls_tools:
            return "tool_choice" if self.tool_choice is not None else "tools"
        if engine_field == "logprobs":
            return "top_logprobs"
        if engine_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().field_sent_for(engine_field)

    def template_messages(self, developer_role: str = "system") -> list[dict]:
        """The messages for the chat template. A `developer` message takes the
        system prompt's place, as in the OpenAI API (`developer_role`: the role a
        template that knows none named "developer" gets it as). Past calls and tool
        results keep their fields (cluster/api/tools/prompt.py renders them)."""
        messages = []
        for m in self.messages:
            message = {"role": developer_role if m.role == "developer" else m.role,
                       "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages

    def template_tools(self) -> list[dict] | None:
        """The tools the model is shown: none with tool_choice "none"."""
        if not self.calls_tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


_UNPAIRED_SURROGATE = (" (\\uD800-\\uDFFF escapes come in pairs, a \\uD800-\\uDBFF then a"
                       " \\uDC00-\\uDFFF: text cannot hold half of one)")


def validation_error_message(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem pydantic found, OpenAI style."""
    first = err.errors(include_url=False)[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        msg = first.get("msg", "")
        if "hex escape" in msg:
            # NOTE: the parser's words for a \uD800-\uDFFF escape without its pair
            # ("unexpected end of hex escape", "lone leading surrogate") name no rule
            msg += _UNPAIRED_SURROGATE
        return f"Invalid JSON body: {msg}", None
    loc = [str(part) for part in first.get("loc", ()) if isinstance(part, (str, int))]
    # Union members appear in `loc` as type names ("str", "list[int]"); drop them.
    loc = [part for part in loc if "[" not in part and part not in ("str", "int", "float",
                                                                    "bool", "none")]
    param = ".".join(loc) if loc else None
    msg = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"Missing required field: {param}", param
    if kind == "model_type":
        return "The request body must be a JSON object", None
    msg = msg.removeprefix("Value error, ")
    return (f"Invalid value for '{param}': {msg}" if param else msg), param
