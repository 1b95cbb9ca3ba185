"""HF <-> Flax conversion: bit-exact round trips, sharded checkpoints, the config round trip,
DLPack zero-copy torch export identical to the saved file, bounded buckets, clear errors."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file as torch_save_file

from portable_rl.convert import hf as hf_lib
from portable_rl.convert import copy_tokenizer_files, load_hf_model, param_mappings, save_hf_model
from portable_rl.convert.to_torch import iter_hf_tensors, jax_to_torch
from portable_rl.engines.buckets import bucketed
from portable_rl.learner_jax.config import ModelConfig
from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint


def read_tensors(path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(path / f, framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].contiguous().view(torch.uint8).equal(b[name].contiguous().view(torch.uint8)), name


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def bf16_ckpt(request, tmp_path_factory):
    return pathlib.Path(make_tiny_checkpoint(tmp_path_factory.mktemp(f"{request.param}_bf16"), request.param))


# ------------------------------------------------------------------------------------- round trips
def test_hf_flax_hf_round_trip_is_bit_exact(bf16_ckpt, tmp_path):
    src = bf16_ckpt
    model, config = load_hf_model(src)  # float32 master weights
    assert model.embed.embedding[...].dtype == jnp.float32
    out = tmp_path / "out"
    save_hf_model(model, config, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_bit_identical(read_tensors(src), read_tensors(out))
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_saved_checkpoint_loads_in_transformers_with_same_logits(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "llama", dtype="float32")
    model, config = load_hf_model(src, param_dtype=jnp.float32)
    save_hf_model(model, config, tmp_path / "out")  # float32, like the source
    ids = torch.randint(3, 98, (2, 9))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits
    assert torch.equal(ref, got)


def test_sharded_save_and_load(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3")
    model, config = load_hf_model(src)
    save_hf_model(model, config, tmp_path / "sharded", max_shard_bytes=100_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in files and len(shards) > 2
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in read_tensors(tmp_path / "sharded").values())
    assert_bit_identical(read_tensors(pathlib.Path(src)), read_tensors(tmp_path / "sharded"))
    reloaded, _ = load_hf_model(tmp_path / "sharded")
    for m in param_mappings(config):
        a, b = hf_lib.get_param(model, m.nnx_path)[...], hf_lib.get_param(reloaded, m.nnx_path)[...]
        assert jnp.array_equal(a, b), m.hf_name
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")  # loads sharded too


def test_save_is_atomic_and_refuses_to_clobber(tmp_path, monkeypatch):
    src = make_tiny_checkpoint(tmp_path / "src", "qwen2")
    model, config = load_hf_model(src)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf_model(model, config, src)
    calls = []

    def failing_save(tensors, filename, metadata=None):  # dies after the first shard
        if calls:
            raise OSError("disk full")
        calls.append(filename)
        return real_save(tensors, filename, metadata=metadata)

    import safetensors.flax
    real_save = safetensors.flax.save_file
    monkeypatch.setattr(safetensors.flax, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_hf_model(model, config, tmp_path / "out", max_shard_bytes=100_000)
    assert calls and not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no temp dir left behind
    monkeypatch.undo()
    save_hf_model(model, config, src, overwrite=True)
    assert sorted(os.listdir(src)) == ["config.json", "model.safetensors"]


def test_copy_tokenizer_files(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", "qwen2")
    model, config = load_hf_model(src)
    save_hf_model(model, config, tmp_path / "out")
    copied = copy_tokenizer_files(src, tmp_path / "out")
    assert "tokenizer.json" in copied
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.decode(tok("2+2=4")["input_ids"]) == "2+2=4"


# ------------------------------------------------------------------------------------- config
def test_config_round_trip_keeps_every_hf_key(bf16_ckpt):
    d = json.loads((bf16_ckpt / "config.json").read_text())
    config = ModelConfig.from_hf_dict(d)
    assert config.to_hf_dict() == d
    assert hash(config) == hash(ModelConfig.from_hf_dict(d))


def test_config_legacy_rope_format_round_trip():
    d = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
         "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
         "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
         "eos_token_id": [128001, 128008, 128009],
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    config = ModelConfig.from_hf_dict(d)
    assert config.rope_type == "llama3" and config.rope_theta == 500000.0
    assert config.torch_dtype == "bfloat16" and config.num_key_value_heads == 8
    assert config.to_hf_dict() == d


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "unsupported rope_scaling type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_rejects_unsupported_options(bf16_ckpt, change, message):
    d = {**json.loads((bf16_ckpt / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


# ------------------------------------------------------------------------------------- bad input
def test_load_errors_name_the_problem(tmp_path):
    src = tmp_path / "src"
    make_tiny_checkpoint(src, "qwen3")
    cfg = json.loads((src / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_model(tmp_path)
    (src / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 320}))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(256, 128\).*fix config.json"):
        load_hf_model(src)
    (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(KeyError, match="has tensor 'model.layers.1.*num_hidden_layers"):
        load_hf_model(src)
    (src / "config.json").write_text(json.dumps(cfg))
    tensors = read_tensors(src)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    torch_save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf_model(src)
    os.remove(src / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_model(src)


# ------------------------------------------------------------------------------------- torch export
def test_dlpack_export_is_zero_copy():
    for array in [jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4),
                  hf_lib._cast(jnp.ones((4, 6), jnp.float32), jnp.bfloat16, True),  # transposed in JAX
                  jnp.ones((5,), jnp.float32)]:
        tensor = jax_to_torch(array)
        assert tensor.data_ptr() == array.unsafe_buffer_pointer()
        assert tensor.is_contiguous() and tuple(tensor.shape) == array.shape
        np.testing.assert_array_equal(tensor.float().numpy(), np.asarray(array, np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_iter_hf_tensors_bit_identical_to_saved_file(bf16_ckpt, tmp_path, dtype):
    model, config = load_hf_model(bf16_ckpt)
    model.layers[0].mlp.up_proj.kernel[...] += 1e-3  # diverge from the source so this is not trivial
    save_hf_model(model, config, tmp_path / "out", dtype=dtype)
    pairs = list(iter_hf_tensors(model, config, dtype=dtype))
    assert [n for n, _ in pairs] == [m.hf_name for m in param_mappings(config)]
    assert_bit_identical(dict(pairs), read_tensors(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == dtype


def test_iter_hf_tensors_moves_no_bytes_for_bf16_params(bf16_ckpt):
    """bf16 learner params: every exported tensor aliases the parameter's buffer (transposes are views)."""
    model, config = load_hf_model(bf16_ckpt, param_dtype=jnp.bfloat16)
    for m, (name, tensor) in zip(param_mappings(config), iter_hf_tensors(model, config, dtype="bfloat16")):
        param = hf_lib.get_param(model, m.nnx_path)[...]
        assert name == m.hf_name
        assert tensor.data_ptr() == param.unsafe_buffer_pointer(), name
        assert tensor.is_contiguous() == (not m.transpose or 1 in param.shape), name


def test_bucketed_is_lazy_and_bounded():
    sizes = [10, 30, 20, 50, 200, 5, 5]  # float32 elements
    produced = []

    def pairs():
        for i, n in enumerate(sizes):
            produced.append(i)
            yield f"t{i}", torch.zeros(n)

    buckets = bucketed(pairs(), bucket_bytes=240)
    first = next(buckets)
    assert [n for n, _ in first] == ["t0", "t1", "t2"] and len(produced) == 4  # read one ahead only
    rest = list(buckets)
    assert [[n for n, _ in b] for b in rest] == [["t3"], ["t4"], ["t5", "t6"]]
    for bucket in [first] + rest:
        total = sum(t.numel() * t.element_size() for _, t in bucket)
        assert total <= 240 or len(bucket) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(bucketed(iter([]), 0))


# ------------------------------------------------------------------------------------- vLLM loads it
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_vllm_serves_a_saved_checkpoint_like_the_learner(tmp_path, family):
    """A Flax model saved with save_hf_model (llama: llama3 RoPE scaling in `rope_parameters`) starts
    in vLLM, and vLLM's logprobs of its own samples agree with the learner's (bf16 kernels differ)."""
    pytest.importorskip("vllm")
    from portable_rl.engines import SamplingConfig, create_engine
    from portable_rl.learner_jax.logprobs import sequence_logprobs

    src = make_tiny_checkpoint(tmp_path / "src", family)
    model, config = load_hf_model(src)
    model.layers[0].mlp.down_proj.kernel[...] *= 1.5  # the saved weights differ from the source
    out = tmp_path / "saved"
    save_hf_model(model, config, out)
    copy_tokenizer_files(src, out)
    prompts = [[1, 40, 41, 42], [1, 60, 61, 62, 63, 64]]
    with create_engine("vllm", model_path=str(out)) as engine:
        rollouts = engine.generate(prompts, SamplingConfig(temperature=1.0, max_tokens=8, seed=3))
    for r in rollouts:
        ids = jnp.asarray([list(r.prompt_token_ids) + list(r.response_token_ids)], jnp.int32)
        logp, _ = sequence_logprobs(model, ids, None, 1.0)
        learner = np.asarray(logp)[0, len(r.prompt_token_ids):]
        assert np.abs(learner - np.asarray(r.response_logprobs)).max() < 0.1


def test_config_family_defaults():
    dims = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    qwen2, qwen3, llama = (ModelConfig(family=f, **dims) for f in ("qwen2", "qwen3", "llama"))
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_proj_bias, qwen3.qk_norm) == (False, False, True)
    assert (llama.qkv_bias, llama.o_proj_bias, llama.qk_norm) == (False, False, False)
    assert ModelConfig(family="llama", attention_bias=True, **dims).o_proj_bias
    with pytest.raises(ValueError, match="unsupported model family"):
        ModelConfig(family="mistral", **dims)
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig(family="llama", **{**dims, "num_key_value_heads": 3})


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tiny_checkpoint_smallest_vocab_fits_its_tokenizer(tmp_path, family):
    """The smallest vocab_size make_tiny_checkpoint accepts is one the codec's vocabulary check accepts;
    one less is refused before anything is written."""
    from portable_rl.rl.codec import TextCodec
    from portable_rl.convert.tiny_checkpoint import min_vocab_size

    smallest = min_vocab_size(family)
    path = make_tiny_checkpoint(tmp_path / "ok", family, vocab_size=smallest)
    codec = TextCodec(path)
    assert max(codec.tokenizer.get_vocab().values()) == smallest - 1
    with pytest.raises(ValueError, match=f"use vocab_size >= {smallest}"):
        make_tiny_checkpoint(tmp_path / "bad", family, vocab_size=smallest - 1)
    assert not (tmp_path / "bad").exists()
