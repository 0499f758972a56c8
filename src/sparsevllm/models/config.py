"""The few fields of a Hugging Face config.json the engine needs, read from the JSON itself so any
transformers version (rope_theta/rope_scaling or the newer rope_parameters) works."""
import json
import os
from dataclasses import dataclass


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None   # the window Hugging Face applies to some layer, None: full attention
    eos_token_id: list[int]
    raw: dict

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        # Fields Hugging Face's Llama honours and our MLP (SiLU, no biases) does not: computing with
        # them ignored would give other tokens, or fail late on an unplaced checkpoint tensor.
        if d.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"config.json hidden_act={d['hidden_act']!r} is not supported; supported: 'silu'")
        if d.get("mlp_bias"):
            raise ValueError(f"config.json mlp_bias={d['mlp_bias']!r} is not supported; supported: false")
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=config_architecture(d), vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)), sliding_window=active_sliding_window(d),
            eos_token_id=eos, raw=d)


def active_sliding_window(d: dict) -> int | None:
    """The sliding_window that Hugging Face's model of this config applies to at least one layer.
    Mistral applies it to every layer when set; Qwen2/Qwen3 configs (Qwen2.5's among them) carry a
    sliding_window that is off unless use_sliding_window, and then only from max_window_layers on
    (or as layer_types says); Llama ignores the field."""
    window, arch = d.get("sliding_window"), config_architecture(d)
    if not window or arch not in ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    if d.get("layer_types"):
        return window if "sliding_attention" in d["layer_types"] else None
    if arch == "MistralForCausalLM":
        return window
    on = d.get("use_sliding_window", False) and d.get("max_window_layers", 28) < d["num_hidden_layers"]
    return window if on else None


# Some config.json files (older conversions, hand-written ones) name no `architectures`, only a
# model_type; the registry and the sliding-window rules know the class names.
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def config_architecture(d: dict) -> str:
    """The architecture a config.json names: its first `architectures` entry, else the class its
    `model_type` stands for (an unknown model_type as it is, for the registry to name it)."""
    if d.get("architectures"):
        return d["architectures"][0]
    model_type = d.get("model_type", "?")
    return ARCHITECTURE_OF_MODEL_TYPE.get(model_type, model_type)


def read_config_json(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"model folder {path!r} has no readable config.json (expected a Hugging Face "
                         "model folder, or model=None / 'smollm2-135m' for the embedded default model)")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {cfg_path}: {e}") from e
