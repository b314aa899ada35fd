"""GGUF files written here the way llama.cpp's converter writes a Llama checkpoint
(its tensor names, q/k row permutation, metadata and byte-level BPE vocabulary),
converted by replicas/gguf/: the same tensors, config, tokenizer and greedy tokens
as the HF checkpoint they came from; every file stepstream cannot serve is one
GgufError that starts with the file's path, and the launcher says it in a line
before Ray starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from cluster.launcher import preflight
from deltas.tokenization import Tokenizer
from replicas import Engine, EngineConfig, SamplingParams
from replicas.checkpoints.cache_dirs import models_dir
from replicas.checkpoints.checkpoint_config import ASSETS_DIR
from replicas.gguf import GgufError, read_gguf
from replicas.gguf.convert import ensure_gguf_dir
from replicas.checkpoints.presets import ensure_model_dir
from replicas.checkpoints.random_checkpoint import write_random_checkpoint
from tests.model_dirs import FAMILIES

pytestmark = pytest.mark.timeout(120)

Q = gguf.GGMLQuantizationType
# llama.cpp's per-layer tensor names -> HF's (written out here, not taken from the code under test)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A type the gguf package has sizes for but cannot dequantize
_UNDEQUANTIZABLE = Q.Q8_1
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
TEXTS = ["Hello, world! How are you today?", "In 2024, 12345 people paid $3.50 each.",
         "def f(x):\n\treturn x ** 2\n\n", "Ünïcödé: café, Straße, 日本語, emoji 🎉",
         "<|im_start|>user\nspecial tokens inside<|im_end|>\n<|pad|>"]


def _llama_config(tied: bool) -> dict:
    config = {k: v for k, v in FAMILIES["llama"].items() if k != "rope_scaling"}
    return {**config, "tie_word_embeddings": tied}


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _hf_name(gguf_name: str) -> str:
    if not gguf_name.startswith("blk."):
        return {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                "output_norm.weight": "model.norm.weight"}[gguf_name]
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"


def _vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, llama.cpp token types, "a b" merges) of the committed tokenizer."""
    data = json.loads((ASSETS_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {i: token for token, i in data["model"]["vocab"].items()}
    special = {t["id"] for t in data["added_tokens"] if t["special"]}
    by_id.update({t["id"]: t["content"] for t in data["added_tokens"]})
    assert sorted(by_id) == list(range(len(by_id)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return ([by_id[i] for i in range(len(by_id))],
            [3 if i in special else 1 for i in range(len(by_id))], merges)


def _metadata(config: dict) -> dict[str, tuple[str, object]]:
    """key -> (GGUFWriter method, value), as llama.cpp writes a Llama checkpoint."""
    tokens, token_types, merges = _vocabulary()
    template = json.loads((ASSETS_DIR / "tokenizer_config.json").read_text()).get("chat_template")
    eos_ids = config["eos_token_id"]
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    meta = {
        "llama.block_count": ("add_uint32", config["num_hidden_layers"]),
        "llama.context_length": ("add_uint32", config["max_position_embeddings"]),
        "llama.embedding_length": ("add_uint32", config["hidden_size"]),
        "llama.feed_forward_length": ("add_uint32", config["intermediate_size"]),
        "llama.attention.head_count": ("add_uint32", config["num_attention_heads"]),
        "llama.attention.head_count_kv": ("add_uint32", config["num_key_value_heads"]),
        "llama.rope.freq_base": ("add_float32", config["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": ("add_float32", config["rms_norm_eps"]),
        "llama.vocab_size": ("add_uint32", config["vocab_size"]),
        "llama.rope.dimension_count": ("add_uint32", config["head_dim"]),
        "general.name": ("add_string", "tiny test llama"),
        "tokenizer.ggml.model": ("add_string", "gpt2"),
        "tokenizer.ggml.pre": ("add_string", "default"),
        "tokenizer.ggml.tokens": ("add_array", tokens),
        "tokenizer.ggml.token_type": ("add_array", token_types),
        "tokenizer.ggml.merges": ("add_array", merges),
        "tokenizer.ggml.bos_token_id": ("add_uint32", config["bos_token_id"]),
        "tokenizer.ggml.eos_token_id": ("add_uint32", eos_ids[0]),
        "tokenizer.ggml.padding_token_id": ("add_uint32", config["pad_token_id"]),
    }
    if len(eos_ids) > 1:
        meta["tokenizer.ggml.eot_token_id"] = ("add_uint32", eos_ids[1])
    if template:
        meta["tokenizer.chat_template"] = ("add_string", template)
    return meta


def _gguf_tensors(hf_dir: str, config: dict) -> dict[str, np.ndarray]:
    """llama.cpp name -> float32 array as its converter stores it (q/k rows permuted)."""
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    out = {"token_embd.weight": weights["model.embed_tokens.weight"]}
    for i in range(config["num_hidden_layers"]):
        for ours, theirs in _LAYER_NAMES.items():
            out[f"blk.{i}.{ours}.weight"] = weights[f"model.layers.{i}.{theirs}.weight"]
        for kind, heads in (("attn_q", "num_attention_heads"), ("attn_k", "num_key_value_heads")):
            out[f"blk.{i}.{kind}.weight"] = _permute(out[f"blk.{i}.{kind}.weight"], config[heads])
    out["output_norm.weight"] = weights["model.norm.weight"]
    if not config["tie_word_embeddings"]:
        out["output.weight"] = weights["lm_head.weight"]
    return out


class GgufWriter:
    """Writes small GGUF files from HF checkpoints it makes once per module."""

    def __init__(self, root: Path):
        self.root = root
        self._dirs: dict[bool, str] = {}

    def hf_dir(self, tied: bool = False) -> str:
        if tied not in self._dirs:
            path = self.root / f"llama-{'tied' if tied else 'untied'}"
            self._dirs[tied] = write_random_checkpoint(path, _llama_config(tied), seed=0)
        return self._dirs[tied]

    def config(self, tied: bool = False) -> dict:
        return json.loads(Path(self.hf_dir(tied), "config.json").read_text())

    def tensors(self, tied: bool = False) -> dict[str, np.ndarray]:
        return _gguf_tensors(self.hf_dir(tied), self.config(tied))

    def write(self, path: Path, tied: bool = False, arch: str = "llama", qtypes: dict | None = None,
              meta: dict | None = None, drop: tuple[str, ...] = (), raw: dict | None = None) -> Path:
        """qtypes: tensor name -> type to store it as (F32 otherwise); meta: keys to
        add or replace; drop: keys to leave out; raw: tensor name -> (bytes, type)."""
        writer = gguf.GGUFWriter(str(path), arch)
        for key, (method, value) in {**_metadata(self.config(tied)), **(meta or {})}.items():
            if key not in drop:
                getattr(writer, method)(key, value)
        for name, array in self.tensors(tied).items():
            data, qtype = (raw or {}).get(name) or (None, (qtypes or {}).get(name, Q.F32))
            if data is None:
                data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


@pytest.fixture(scope="module")
def writer(tmp_path_factory) -> GgufWriter:
    return GgufWriter(tmp_path_factory.mktemp("gguf-checkpoints").resolve())


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """STEPSTREAM_CACHE in tmp_path: nothing lands in the user's cache."""
    path = (tmp_path / "cache").resolve()
    monkeypatch.setenv("STEPSTREAM_CACHE", str(path))
    return path


@pytest.fixture
def files(tmp_path) -> Path:
    path = (tmp_path / "files").resolve()
    path.mkdir()
    return path


def _greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with Engine(EngineConfig(model=model, dtype="float32")) as engine:
        return [out.token_ids for out in engine.generate(prompts, params)]


# --- round trip -------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_float32_gguf_converts_back_to_the_same_checkpoint_and_tokens(writer, cache, files, tied):
    path = writer.write(files / "tiny.gguf", tied=tied)
    converted = ensure_gguf_dir(path, cache)
    assert Path(converted).parent == models_dir(cache)
    original = load_file(f"{writer.hf_dir(tied)}/model.safetensors")
    ours = load_file(f"{converted}/model.safetensors")
    assert set(ours) == set(original)  # no lm_head when tied, as the original
    for name, tensor in original.items():
        assert ours[name].dtype == np.float32 and np.array_equal(ours[name], tensor), name
    # the permutation is real here: a converter that skipped undoing it would differ
    raw_q = read_gguf(path).tensors["blk.0.attn_q.weight"]
    assert not np.array_equal(np.asarray(raw_q.data),
                              original["model.layers.0.self_attn.q_proj.weight"])

    theirs, config = writer.config(tied), json.loads(Path(converted, "config.json").read_text())
    assert {k: config[k] for k in SHAPE_KEYS} == {k: theirs[k] for k in SHAPE_KEYS}
    assert config["rope_theta"] == theirs["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-6)  # float32 in the file

    prompts = [[int(t) for t in np.random.default_rng(seed).integers(5, 8192, size)]
               for seed, size in ((0, 3), (1, 11), (2, 29))]
    expected = _greedy(writer.hf_dir(tied), prompts)
    assert all(len(ids) == 16 for ids in expected)
    assert _greedy(str(path), prompts) == expected  # the .gguf path, through ensure_model_dir
    assert ensure_model_dir(str(path)) == converted  # converted once, found again


def test_f16_and_q8_0_tensors_equal_the_dequantized_bytes(writer, cache, files):
    qtypes = {"token_embd.weight": Q.F16, "output.weight": Q.F16, "blk.1.attn_v.weight": Q.F16,
              "blk.0.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q8_0,
              "blk.0.ffn_down.weight": Q.Q8_0}
    path = writer.write(files / "mixed.gguf", qtypes=qtypes)
    assert {t.name: t.type_name for t in read_gguf(path).tensors.values() if t.name in qtypes} == \
        {name: qtype.name for name, qtype in qtypes.items()}
    ours = load_file(f"{ensure_gguf_dir(path, cache)}/model.safetensors")
    original = load_file(f"{writer.hf_dir()}/model.safetensors")
    config = writer.config()
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for name, array in writer.tensors().items():
        qtype = qtypes.get(name, Q.F32)
        stored = gguf.dequantize(gguf.quants.quantize(array, qtype), qtype)  # the same bytes
        kind = name.split(".")[-2]
        if kind in heads:  # the permutation undone on the dequantized rows
            stored = _unpermute(stored, heads[kind])
        hf = _hf_name(name)
        assert ours[hf].dtype == np.float32 and np.array_equal(ours[hf], stored), name
        np.testing.assert_allclose(ours[hf], original[hf], atol=1e-3, err_msg=name)
        if name in qtypes:
            assert not np.array_equal(ours[hf], original[hf]), f"{name} was not stored lossily"


def test_the_converted_tokenizer_encodes_as_the_original(writer, cache, files):
    converted = ensure_gguf_dir(writer.write(files / "tiny.gguf"), cache)
    ours, theirs = Tokenizer.from_dir(converted), Tokenizer.from_dir(writer.hf_dir())
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    for text in TEXTS[:-1]:
        assert ours.decode(ours.encode(text)) == text, text
    assert [ours.encode(t) for t in ("<|begin_of_text|>", "<|im_end|>", "<|pad|>")] == [[0], [3], [4]]
    tokenizer_config = json.loads(Path(converted, "tokenizer_config.json").read_text())
    assets = json.loads((ASSETS_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == assets["chat_template"]
    for key in ("bos_token", "eos_token", "pad_token"):
        assert tokenizer_config[key] == assets[key], key


# --- files stepstream cannot serve --------------------------------------------------

def _problem(call, path) -> str:
    with pytest.raises(GgufError) as raised:
        call(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("arch", ["gpt2", "qwen2moe"])
def test_another_architecture_is_refused(writer, files, arch):
    path = writer.write(files / f"{arch}.gguf", arch=arch)
    assert f"architecture {arch!r} is not supported" in _problem(read_gguf, path)


def test_a_type_the_gguf_package_cannot_dequantize_is_refused(writer, files):
    assert _UNDEQUANTIZABLE not in gguf.quants._type_traits  # still a type it lacks
    rows, cols = writer.tensors()["blk.1.ffn_down.weight"].shape
    block, size = gguf.GGML_QUANT_SIZES[_UNDEQUANTIZABLE]
    data = np.zeros((rows, cols // block * size), dtype=np.uint8)
    path = writer.write(files / "q8_1.gguf", raw={"blk.1.ffn_down.weight": (data, _UNDEQUANTIZABLE)})
    assert (f"tensor blk.1.ffn_down.weight has quantization type {_UNDEQUANTIZABLE.name}, which "
            "stepstream cannot dequantize") in _problem(read_gguf, path)


@pytest.mark.parametrize("keep", ["all but 1000 bytes", "200 bytes"])
def test_a_truncated_file_is_refused(writer, files, cache, keep):
    path = writer.write(files / "cut.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-1000] if keep.startswith("all") else data[:200])
    assert "truncated" in _problem(read_gguf, path)
    assert "truncated" in _problem(lambda p: ensure_gguf_dir(p, cache), path)
    assert not any(models_dir(cache).iterdir())  # nothing half-converted left behind


def test_a_file_that_is_not_gguf_is_refused(files):
    path = files / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in _problem(read_gguf, path)


def test_a_missing_file_is_refused(files, cache):
    path = files / "nowhere.gguf"
    assert "no such file" in _problem(read_gguf, path)
    assert "no such file" in _problem(lambda p: ensure_gguf_dir(p, cache), path)
    assert preflight.model_problem(str(path)) == f"{path}: no such file"


@pytest.mark.parametrize("meta, problem", [
    ({"tokenizer.ggml.model": ("add_string", "llama")}, "tokenizer model 'llama' is not supported"),
    ({"tokenizer.ggml.pre": ("add_string", "deepseek-llm")},
     "pre-tokenizer 'deepseek-llm' is not supported"),
], ids=["tokenizer-model", "pre-tokenizer"])
def test_a_tokenizer_stepstream_cannot_read_is_refused(writer, files, cache, meta, problem):
    path = writer.write(files / "tok.gguf", meta=meta)
    assert problem in _problem(lambda p: ensure_gguf_dir(p, cache), path)
    assert not any(models_dir(cache).iterdir())


@pytest.mark.parametrize("key", ["llama.block_count", "llama.attention.layer_norm_rms_epsilon"])
def test_a_missing_metadata_key_is_refused(writer, files, cache, key):
    path = writer.write(files / "nokey.gguf", drop=(key,))
    assert f"metadata key {key} is missing" in _problem(lambda p: ensure_gguf_dir(p, cache), path)
    assert preflight.model_problem(str(path)).startswith(f"{path}: metadata key {key} is missing")


def test_metadata_that_disagrees_with_the_tensors_is_refused_before_dequantizing(writer, files,
                                                                                 cache):
    # NOTE: 3 KV heads where the tensors have 2: the k rows cannot be unpermuted
    path = writer.write(files / "heads.gguf", meta={"llama.attention.head_count_kv": ("add_uint32", 3)})
    problem = _problem(lambda p: ensure_gguf_dir(p, cache), path)
    assert "tensor blk.0.attn_k.weight has shape" in problem and "the metadata implies" in problem
    assert preflight.model_problem(str(path)) == problem
    assert not any(models_dir(cache).iterdir())


# --- the launcher and its preflight --------------------------------------------------

def test_the_launcher_says_what_is_wrong_with_a_gguf_file_and_exits_before_ray(writer, files, cache):
    path = writer.write(files / "moe.gguf", arch="qwen2moe")
    env = {k: v for k, v in os.environ.items() if k != "STEPSTREAM_API_KEY"}
    # NOTE: a free --port, so that a launcher that went on to start Ray would not
    # fight another server over the default one
    flags = ["--model", str(path), "--port", str(preflight.free_port())]
    result = subprocess.run([sys.executable, "-m", "cluster.serve_local", *flags],
                            capture_output=True, text=True, timeout=90, env=env,
                            stdin=subprocess.DEVNULL)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: {path}: architecture 'qwen2moe' is not supported"), out
    assert "Traceback" not in out and len(out.splitlines()) <= 4, out  # an API key warning, a hint
    # NOTE: the launcher says "Starting a local Ray" just before it starts one; not
    # timed: beside the suite's other lanes the exit took 14 s once (2 s alone)
    assert "Starting a local Ray" not in out, out


def test_preflight_converts_a_good_gguf_file_into_the_cache(writer, files, cache):
    path = files / "good.gguf"
    writer.write(path, tied=True)
    assert preflight.model_problem(str(path)) is None
    [converted] = models_dir(cache).iterdir()
    assert converted.name.startswith("gguf-good-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in converted.iterdir()}
    assert ensure_model_dir(str(path)) == str(converted)  # what the replicas find
    assert json.loads((converted / "gguf_source.json").read_text())["file"] == str(path)
