"""`ModelConfig`: the decoder's hyper-parameters, read from and written back to an HF `config.json`.

One frozen dataclass covers the supported families:

  family     | qkv bias       | o_proj bias     | q/k RMSNorm per head | RoPE scaling     | MLP
  qwen2      | always         | never           | no                   | none             | SwiGLU
  qwen3      | attention_bias (q,k,v,o)         | yes                  | none             | SwiGLU
  llama      | attention_bias (q,k,v,o)         | no                   | none or `llama3` | SwiGLU
  qwen3_moe  | attention_bias (q,k,v,o)         | yes                  | none             | routed experts
  qwen2_moe  | qkv_bias       | never           | no                   | none             | routed + shared expert

MoE families (`is_moe`): layer i is sparse (routed experts) unless i is in `mlp_only_layers` or
(i + 1) % decoder_sparse_step != 0, exactly as transformers decides; the other layers are dense SwiGLU
of `intermediate_size`. Qwen3-MoE checkpoints name the expert count `num_experts` or
`num_local_experts` (transformers 5 writes the latter); `experts_key` remembers which.

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

SUPPORTED_FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
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
    # Mixture of experts (qwen3_moe, qwen2_moe; 0 / None for dense families).
    num_experts: int = 0
    num_experts_per_tok: int = 0      # top-k
    moe_intermediate_size: int = 0    # each routed expert's SwiGLU width
    norm_topk_prob: bool = False      # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int | None = None  # qwen2_moe: the sigmoid-gated shared expert's width
    experts_key: str = "num_experts"  # the config.json key the expert count was read from
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
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                             f"{self.num_experts}; fix config.json")
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
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    def is_sparse_layer(self, i: int) -> bool:
        """Whether decoder layer `i` has routed experts (transformers' rule) rather than a dense MLP."""
        return (self.is_moe and i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_proj_bias(self) -> bool:
        return self.attention_bias and self.family not in ("qwen2", "qwen2_moe")

    @property
    def torch_dtype(self) -> str | None:
        """The checkpoint's dtype string ("bfloat16", "float32", ...) if config.json names one."""
        return self.hf_extra.get("torch_dtype", self.hf_extra.get("dtype"))

    # ---------------------------------------------------------------- HF config.json <-> ModelConfig
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        family = d.pop("model_type", None)
        if family not in SUPPORTED_FAMILIES and any(k in d for k in _EXPERT_COUNT_KEYS + ("n_routed_experts",)):
            raise ValueError(f"mixture-of-experts model_type {family!r} is not supported by the learner; "
                             f"supported MoE families: {', '.join(MOE_FAMILIES)} (convert the checkpoint to "
                             f"one of them or use a dense model)")
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
        elif family == "qwen2_moe":
            kw["attention_bias"] = bool(d.pop("qkv_bias", True))  # q/k/v only, like qwen2
        else:
            kw["attention_bias"] = bool(d.pop("attention_bias", False))
        kw["qk_norm"] = family in ("qwen3", "qwen3_moe")
        if family in MOE_FAMILIES:
            kw.update(_moe_fields(family, d))
        return cls(family=family, hf_extra=d, **kw)

    def to_hf_dict(self) -> dict:
        d = dict(self.hf_extra)
        d["model_type"] = self.family
        for k in _PLAIN_KEYS:
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.family == "qwen2_moe":
            d["qkv_bias"] = self.attention_bias
        elif self.family != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.is_moe:
            d[self.experts_key] = self.num_experts
            d.update(num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
            if self.family == "qwen2_moe":
                d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
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


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def _moe_fields(family: str, d: dict) -> dict:
    """Pops the MoE keys of a qwen3_moe / qwen2_moe config.json `d` into `ModelConfig` fields."""
    experts_key = next((k for k in _EXPERT_COUNT_KEYS if k in d), None)
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in d]
    if experts_key is None or missing:
        raise ValueError(f"{family} config.json lacks {missing or ['num_experts']}; is it a complete MoE config?")
    for k in _EXPERT_COUNT_KEYS:  # transformers 5 may write both; both are written back
        if k != experts_key and k in d and d[k] != d[experts_key]:
            raise ValueError(f"config.json has {experts_key}={d[experts_key]} but {k}={d[k]}; make them agree")
    out = dict(num_experts=int(d.pop(experts_key)), experts_key=experts_key,
               num_experts_per_tok=int(d.pop("num_experts_per_tok")),
               moe_intermediate_size=int(d.pop("moe_intermediate_size")),
               norm_topk_prob=bool(d.pop("norm_topk_prob", False)),
               decoder_sparse_step=int(d.pop("decoder_sparse_step", 1)),
               mlp_only_layers=tuple(d.pop("mlp_only_layers", None) or ()))
    if family == "qwen2_moe":
        if "shared_expert_intermediate_size" not in d:
            raise ValueError("qwen2_moe config.json lacks shared_expert_intermediate_size; add it (the shared "
                             "expert's SwiGLU width)")
        out["shared_expert_intermediate_size"] = int(d.pop("shared_expert_intermediate_size"))
    return out


def _check_supported(family: str, d: dict) -> None:
    """Rejects HF options the decoder does not implement (better a clear error than wrong logits)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (only silu / SwiGLU)")
    if d.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported by portable_rl's decoder")
    if d.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=true is not supported; set it to false (full attention)")
