"""`ModelConfig`: the decoder's hyper-parameters, read from and written back to an HF `config.json`.

One frozen dataclass covers the three supported families:

  family  | qkv bias | o_proj bias     | q/k RMSNorm per head | RoPE scaling
  qwen2   | always   | never           | no                   | none
  qwen3   | attention_bias (q,k,v,o)   | yes                  | none
  llama   | attention_bias (q,k,v,o)   | no                   | none or `llama3`

HF keys this class does not model (architectures, dtype, layer_types, ...) are kept in `hf_extra`, so
`ModelConfig.from_hf_dict(d).to_hf_dict() == d` for every config it accepts: a checkpoint saved by the
learner loads in transformers and vLLM exactly like the one it came from.

RoPE is written the way it was read: transformers >= 5 writes `rope_parameters` (theta inside),
older checkpoints write `rope_theta` + `rope_scaling`; `rope_format` remembers which.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

SUPPORTED_FAMILIES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# HF keys that map onto fields directly (same name, same meaning).
_PLAIN_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
               "pad_token_id")


def _freeze(x: Any) -> Any:
    """A hashable stand-in for nested dicts / lists (so configs can be jit static arguments)."""
    return json.dumps(x, sort_keys=True, default=str)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str                       # "qwen2" | "qwen3" | "llama" (HF `model_type`)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict | None = None  # None for plain RoPE, else e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None  # None -> family default: qwen2 True (q, k, v only); else False (q, k, v, o)
    qk_norm: bool | None = None         # None -> family default: True for qwen3 (RMSNorm on q, k heads)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    rope_format: str = "legacy"       # "legacy" (rope_theta + rope_scaling) | "parameters" (rope_parameters)
    hf_extra: dict = dataclasses.field(default_factory=dict)  # unmodelled HF keys, written back verbatim

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", self.family == "qwen2")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.family == "qwen3")
        if self.family == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases; attention_bias must be True (or None)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r}; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)} (set rope_scaling to null for plain RoPE)")

    # dicts are unhashable; hash a canonical JSON form instead (equality stays field-wise).
    def __hash__(self):
        return hash(tuple(_freeze(getattr(self, f.name)) for f in dataclasses.fields(self)))

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.family != "qwen2"

    @property
    def torch_dtype(self) -> str | None:
        """The checkpoint's dtype string ("bfloat16", "float32", ...) if config.json names one."""
        return self.hf_extra.get("torch_dtype", self.hf_extra.get("dtype"))

    # ---------------------------------------------------------------- HF config.json <-> ModelConfig
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        family = d.pop("model_type", None)
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"unsupported model_type {family!r} in config.json; supported: "
                             f"{', '.join(SUPPORTED_FAMILIES)}")
        _check_supported(family, d)
        # Explicit nulls stay in hf_extra, so they are written back as they were.
        kw: dict[str, Any] = {k: d.pop(k) for k in _PLAIN_KEYS if d.get(k) is not None}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in kw]
        if missing:
            raise ValueError(f"config.json lacks required keys {missing}; is it a decoder LM config?")
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        if kw.get("head_dim") is None:
            kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
        # RoPE: transformers >= 5 nests theta and scaling in `rope_parameters`.
        if "rope_parameters" in d:
            params = dict(d.pop("rope_parameters") or {})
            kw["rope_format"] = "parameters"
            kw["rope_theta"] = float(params.pop("rope_theta", 10_000.0))
            rope_type = params.get("rope_type", params.get("type", "default"))
            kw["rope_scaling"] = None if (rope_type == "default" and set(params) <= {"rope_type"}) else params
            # A legacy key next to rope_parameters is redundant; keep it verbatim if present.
        else:
            kw["rope_theta"] = float(d.pop("rope_theta", 10_000.0))
            if d.get("rope_scaling") is not None:
                kw["rope_scaling"] = d.pop("rope_scaling")
        if family == "qwen2":
            kw["attention_bias"] = True  # Qwen2 always has q/k/v biases; config.json has no key for it.
        else:
            kw["attention_bias"] = bool(d.pop("attention_bias", False))
        kw["qk_norm"] = family == "qwen3"
        return cls(family=family, hf_extra=d, **kw)

    def to_hf_dict(self) -> dict:
        d = dict(self.hf_extra)
        d["model_type"] = self.family
        for k in _PLAIN_KEYS:
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.family != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.rope_format == "parameters":
            params = {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"})}
            d["rope_parameters"] = params
        else:
            d["rope_theta"] = self.rope_theta
            if self.rope_scaling is not None:
                d["rope_scaling"] = self.rope_scaling
        if "architectures" not in d:
            d["architectures"] = [_ARCHITECTURES[self.family]]
        return dict(sorted(d.items()))

    @classmethod
    def from_json_file(cls, path: str) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _check_supported(family: str, d: dict) -> None:
    """Rejects HF options the decoder does not implement (better a clear error than wrong logits)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (only silu / SwiGLU)")
    if d.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported by portable_rl's decoder")
    if d.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true is not supported; set it to false (full attention)")
