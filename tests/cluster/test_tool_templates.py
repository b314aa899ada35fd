"""Tool calling on templates that know tools and on one that does not, without Ray:
the probe that tells them apart, the prompt each gets (its own rendering of tools
and past calls, or this server's system prompt and rewritten history), and the
engine (`tiny`, random weights: the form is what is tested, not the model's
judgment) held to each format's grammar, its per-step deltas (N-step windows:
several tokens a delta) parsed into the same calls as its final text, and free
neighbours in the same windows keeping their tokens."""
from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import jsonschema
import pytest

from cluster.api.ingress import Ingress
from cluster.api.openai_protocol import ChatCompletionRequest
from cluster.api.tools.formats import HERMES, LLAMA3_JSON, probe_template
from cluster.api.tools.grammar import tool_grammar
from cluster.api.tools.stream import ToolCallStream, tool_message
from deltas.text_stream import TextStream
from deltas.tokenization.tokenizer import Tokenizer
from replicas.checkpoints import presets

# A Qwen2.5-like template: tools in a system turn, calls in <tool_call> tags, results
# as <tool_response> user turns.
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools>\\nCall a function as "
    "<tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant\\n'"
    " + message.content }}{%- for call in message.tool_calls %}{{- '<tool_call>\\n{\"name\": \"'"
    " + call.function.name + '\", \"arguments\": ' + (call.function.arguments | tojson) +"
    " '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# A Llama-3.1-like template: tools in the system turn, a call as the whole answer.
LLAMA3_LIKE = (
    "{%- if tools %}{{- 'system: You may call these functions:\\n' }}{%- for tool in tools %}"
    "{{- (tool | tojson) + '\\n' }}{%- endfor %}{{- 'Answer with {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- 'assistant: ' }}"
    "{%- for call in message.tool_calls %}{{- '{\"name\": \"' + call.function.name + "
    "'\", \"parameters\": ' + (call.function.arguments | tojson) + '}' }}{%- endfor %}{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}{{- 'ipython: ' + message.content + '\\n' }}"
    "{%- else %}{{- message.role + ': ' + message.content + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "now": {"type": "object"}}
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "rain, 9 C"}]


def _tokenizer(template: str | None) -> Tokenizer:
    tokenizer = Tokenizer.from_dir(presets.resolve_tokenizer_dir("tiny"))
    if template is not None:
        tokenizer.chat_templates = {"default": template}
    return tokenizer


def _template_tools(tokenizer):
    return probe_template(lambda messages, tools: tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tools=tools))


@pytest.mark.parametrize("template, renders, fmt", [
    (QWEN_LIKE, True, HERMES), (LLAMA3_LIKE, True, LLAMA3_JSON), (None, False, HERMES)])
def test_each_template_is_probed_for_tools_and_its_form(template, renders, fmt):
    probed = _template_tools(_tokenizer(template))
    assert (probed.renders_tools, probed.format) == (renders, fmt)


def _prompt(template, body) -> str:
    tokenizer = _tokenizer(template)
    ingress = SimpleNamespace(_tokenizer=tokenizer, _developer_role="system",
                              _template_tools=_template_tools(tokenizer))
    req = ChatCompletionRequest.model_validate({"model": "tiny", **body})
    [ids] = Ingress.func_or_class._prompts_ids(ingress, req, True)
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_a_template_that_knows_tools_renders_them_and_the_history_itself():
    prompt = _prompt(QWEN_LIKE, {"messages": HISTORY, "tools": [WEATHER, NOW]})
    assert '"name": "get_weather"' in prompt and "# Tools" in prompt  # the template's words
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}' in prompt
    assert "<tool_response>\nrain, 9 C\n</tool_response>" in prompt
    assert "You can call functions" not in prompt  # not this server's prompt
    llama = _prompt(LLAMA3_LIKE, {"messages": HISTORY, "tools": [WEATHER]})
    assert '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}' in llama
    assert "ipython: rain, 9 C" in llama


def test_a_template_without_tools_gets_them_in_a_system_prompt_and_a_history_it_can_render():
    prompt = _prompt(None, {"messages": [{"role": "system", "content": "Be brief."}, *HISTORY],
                            "tools": [WEATHER]})
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert json.dumps(WEATHER) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "days": 1}}\n</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\nget_weather returned: rain, 9 C<|im_end|>" in prompt
    # tool_choice none: the model is shown no tools, the past call still renders
    none = _prompt(None, {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"})
    assert "You can call functions" not in none and "get_weather returned" in none


@pytest.fixture(scope="module")
def engine():
    from replicas import Engine, EngineConfig
    with Engine(EngineConfig(model="tiny", num_scheduler_steps=8)) as e:
        yield e


def _params(grammar: str, seed: int):
    from replicas import SamplingParams
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                          structured_output={"grammar": grammar})


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("choice, parallel", [("required", True), ("now", False),
                                              ("get_weather", True), ("auto", False)])
def test_the_engine_held_to_a_tool_grammar_makes_valid_calls(engine, fmt, choice, parallel):
    grammar = tool_grammar([WEATHER, NOW], fmt, choice=choice, parallel=parallel)
    prompt = [[5 + i, 77, 901, 4000 + i] for i in range(6)]
    outs = engine.generate(prompt, [_params(grammar, seed) for seed in range(6)])
    num_calls = 0
    for out in outs:
        content, calls = tool_message(out.text, fmt)
        if out.finish_reason.name == "LENGTH":
            continue  # cut: its last call may be unfinished
        if choice != "auto":
            assert calls and content is None, out.text
        if not parallel:
            assert len(calls) <= 1
        for call in calls:
            name = call["function"]["name"]
            assert name == choice if choice not in ("auto", "required") else name in SCHEMAS
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        num_calls += len(calls)
    if choice != "auto":
        assert num_calls >= 3


def test_per_step_deltas_parse_into_the_final_calls_and_neighbours_keep_their_tokens(engine):
    """Windows of 8 steps: each delta may hold several tokens of a call; the deltas
    parsed one by one give what the final text gives. Free greedy rows beside the
    calls make the tokens they make alone."""
    from replicas import SamplingParams
    from replicas.async_engine import AsyncEngine
    from replicas import EngineConfig

    grammar = tool_grammar([WEATHER, NOW], HERMES, choice="required", parallel=True)
    tokenizer = _tokenizer(None)
    free = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    free_prompts = [[11 + i, 300, 2000 + i] for i in range(4)]
    alone = engine.generate(free_prompts, free)
    eng = AsyncEngine(EngineConfig(model="tiny", num_scheduler_steps=8))

    async def call(i):
        text_stream, texts = TextStream(tokenizer), []
        async for delta in eng.generate(f"t{i}", [7, 8, 9 + i], _params(grammar, i)):
            texts.append(text_stream.push(delta).text)
        # NOTE: a reader behind gets several steps' tokens in one delta: fed in
        # groups of 1-4 steps, as merged
        rng, stream, deltas, k = random.Random(i), ToolCallStream(HERMES), [], 0
        while k < len(texts):
            n = rng.randint(1, 4)
            deltas.append((n, stream.feed("".join(texts[k:k + n]), k + n >= len(texts))))
            k += n
        return "".join(texts), deltas

    async def plain(i):
        ids = []
        async for delta in eng.generate(f"f{i}", free_prompts[i], free):
            ids += delta.token_ids
        return ids

    async def main():
        return await asyncio.gather(*[call(i) for i in range(4)], *[plain(i) for i in range(4)])
    try:
        results = asyncio.run(main())
    finally:
        eng.shutdown()
    assert max(n for _, deltas in results[:4] for n, _ in deltas) > 1  # merged deltas
    for text, deltas in results[:4]:
        joined: dict[int, list] = {}
        for _, d in deltas:
            for entry in d.get("tool_calls", []):
                joined.setdefault(entry["index"], [entry["function"].get("name"), ""])
                joined[entry["index"]][1] += entry["function"]["arguments"]
        calls = tool_message(text, HERMES)[1]
        assert calls, text
        assert [tuple(v) for _, v in sorted(joined.items())] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert list(results[4:]) == [o.token_ids for o in alone]
