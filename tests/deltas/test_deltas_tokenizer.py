"""Tokenizer: loading an HF directory, special tokens, chat templates (transformers as oracle)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import processors

from deltas.tokenization.tokenizer import Tokenizer
from tests.deltas_tokenizers import SAMPLE_TEXTS, byte_level_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]

# Exercises what real templates use: loop controls, namespace, tojson, raise_exception,
# bos_token, a {% generation %} block, system-message handling and trim/lstrip rules.
CHAT_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] -%}{%- continue -%}{%- endif -%}
  {%- if message['role'] not in ['user', 'assistant'] -%}{{ raise_exception('unknown role ' + message['role']) }}{%- endif %}
<|{{ message['role'] }}|>
  {% if ns.system %}[{{ ns.system }}] {% set ns.system = '' %}{% endif %}
  {%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}
{{ eos_token }}
{%- endfor %}
{%- if tools %}tools: {{ tools | tojson }}{% endif %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo <b>wörld</b> 😀"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "日本語?"},
]


def write_dir(path: Path, backend, config: dict, generation_config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(scope="module")
def backend():
    return byte_level_tokenizer().backend


def test_from_dir_reads_special_tokens_and_eos_ids(tmp_path, backend):
    config = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
              "chat_template": CHAT_TEMPLATE}
    tokenizer = Tokenizer.from_dir(write_dir(tmp_path, backend, config, {"eos_token_id": [2, 1]}))
    s_id, eos_id, im_end_id = (backend.token_to_id(t) for t in ["<s>", "</s>", "<|im_end|>"])
    assert tokenizer.bos_token_id == s_id
    assert tokenizer.eos_token_ids == [eos_id, im_end_id]  # config eos first, then generation_config's
    assert tokenizer.all_special_ids == {s_id, eos_id, im_end_id, backend.token_to_id("<|é|>")}
    vocab = backend.get_vocab(with_added_tokens=True)
    assert tokenizer.vocab_size == len(vocab) == max(vocab.values()) + 1  # added tokens included
    assert tokenizer.vocab_size > backend.get_vocab_size(with_added_tokens=False)


def test_generation_config_eos_as_int(tmp_path, backend):
    tokenizer = Tokenizer.from_dir(write_dir(tmp_path, backend, {}, {"eos_token_id": 2}))
    assert tokenizer.eos_token_ids == [2] and tokenizer.bos_token_id is None


def test_encode_decode_round_trip(backend):
    tokenizer = Tokenizer(backend)
    for text in SAMPLE_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_add_bos_token_prepends_when_the_post_processor_does_not(backend):
    tokenizer = Tokenizer(backend, special_tokens={"bos_token": "<s>"}, add_bos_token=True)
    bos = tokenizer.bos_token_id
    assert tokenizer.encode("hi")[0] == bos
    assert tokenizer.encode("hi", add_special_tokens=False)[0] != bos
    assert tokenizer.decode(tokenizer.encode("hi")) == "hi"


def test_add_bos_token_false_strips_what_the_post_processor_adds():
    tokenizer = byte_level_tokenizer()
    backend = tokenizer.backend
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert Tokenizer(backend, special_tokens={"bos_token": "<s>"}).encode("hi")[0] == bos
    assert Tokenizer(backend, special_tokens={"bos_token": "<s>"}, add_bos_token=False).encode("hi")[0] != bos


def test_chat_template_matches_transformers(tmp_path, backend):
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    directory = write_dir(tmp_path, backend, config)
    ours = Tokenizer.from_dir(directory)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                   bos_token="<s>", eos_token="</s>")
    tools = [{"name": "get_weather", "description": "météo", "parameters": {"city": "string"}}]
    for add_generation_prompt in (True, False):
        for kwargs in ({}, {"tools": tools}):
            expected = theirs.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
            got = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs)
            assert got == expected
    assert "[Be brief.] Héllo" in got and "météo" in got


def test_template_raise_exception_is_a_value_error(backend):
    tokenizer = Tokenizer(backend, chat_templates={"default": CHAT_TEMPLATE})
    with pytest.raises(ValueError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_template_is_a_clear_value_error(backend):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend).apply_chat_template(MESSAGES)


def test_named_templates_and_jinja_file(tmp_path, backend):
    config = {"chat_template": [{"name": "default", "template": "D{{ messages|length }}"},
                                {"name": "tool_use", "template": "T"}]}
    tokenizer = Tokenizer.from_dir(write_dir(tmp_path / "named", backend, config))
    assert tokenizer.apply_chat_template(MESSAGES) == "D4"
    assert tokenizer.apply_chat_template(MESSAGES, template_name="tool_use") == "T"
    directory = write_dir(tmp_path / "jinja", backend, {"chat_template": "old"})
    (directory / "chat_template.jinja").write_text("new {{ add_generation_prompt }}")
    assert Tokenizer.from_dir(directory).apply_chat_template(MESSAGES) == "new True"


def test_token_bytes(backend):
    tokenizer = Tokenizer(backend)
    ids = tokenizer.encode("é")  # two byte tokens
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == "é".encode()
    assert tokenizer.token_bytes(backend.token_to_id("</s>")) == b"</s>"
    assert tokenizer.token_bytes(tokenizer.vocab_size + 5) is None


def test_default_model_assets_load():
    directory = REPO_ROOT / "replicas" / "assets"
    if not (directory / "tokenizer_config.json").is_file():
        pytest.skip("the default tokenizer is not committed yet")
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.eos_token_ids and tokenizer.vocab_size >= 1000
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "hi" in prompt
    assert tokenizer.decode(tokenizer.encode(prompt, add_special_tokens=False), skip_special_tokens=False) == prompt


def test_deltas_import_stays_light():
    code = "import sys, deltas; bad = {'torch', 'transformers', 'replicas', 'cluster'} & set(sys.modules); print(bad)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert result.stdout.strip() == "set()"
