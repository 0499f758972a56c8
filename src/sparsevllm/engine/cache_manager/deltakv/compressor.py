"""DeltaKV's compressor: per-layer down/up projections of a token's KV vector, its file format, and
the reference computations the trainer and the runtime share (arXiv 2602.08005).

A token's vector is x_t = [K_t before RoPE (all KV heads) ; V_t]. References are the first `sink`
tokens and every s-th token after them (s = round(1 / cluster_ratio)); they stay raw. Every other
token t is stored as z_t = down(x_t) - down(r_t), where r_t is the mean of its `neighbors` nearest
earlier references by L2 distance, and read back as x_hat_t = up(z_t) + r_t. down/up are per layer:
"linear" (one Linear each way) or "mlp_gelu" (Linear-GELU-Linear).

Saved as a folder: `compressor.safetensors` (layers.<id>.down.* / layers.<id>.up.*) and
`compressor.json` (the model shape it was trained for, layer ids, KV heads, head dim, latent dim,
type, cluster ratio, neighbours, sink, training data and steps). Loading checks the shape against
the model and names what differs.
"""
import json
import os

import torch
from torch import nn

from sparsevllm.config import need

FORMAT = "sparsevllm-deltakv-compressor"
TYPES = ("linear", "mlp_gelu")
WEIGHTS, CONFIG = "compressor.safetensors", "compressor.json"


def default_full_layers(num_layers: int) -> list[int]:
    """The paper's full (raw) layers 0, 1, 2, 8, 18 of 32, scaled to the depth like OmniKV's."""
    return sorted({min(num_layers - 1, round(f * num_layers / 32)) for f in (0, 1, 2, 8, 18)} | {0})


def reference_mask(length: int, sink: int, stride: int, device=None) -> torch.Tensor:
    """[length] bool: the sink tokens and every stride-th token after them."""
    pos = torch.arange(length, device=device)
    return (pos < sink) | ((pos - sink) % stride == 0)


def nearest_reference_mean(x: torch.Tensor, is_ref: torch.Tensor, neighbors: int) -> torch.Tensor:
    """x: [..., T, F]; is_ref: [T] bool -> r: [..., T, F], the mean of each token's `neighbors`
    nearest references at earlier positions (L2 in x); references map to themselves. Every
    non-reference token must have at least one earlier reference (the sink guarantees it)."""
    T = x.shape[-2]
    ref_pos = torch.nonzero(is_ref).squeeze(-1)                              # [R]
    refs = x[..., ref_pos, :]                                                # [..., R, F]
    dist = torch.cdist(x.float(), refs.float())                              # [..., T, R]
    earlier = ref_pos.view(1, -1) < torch.arange(T, device=x.device).view(-1, 1)
    dist = dist.masked_fill(~earlier, float("inf"))
    k = min(neighbors, ref_pos.numel())
    d, idx = dist.topk(k, dim=-1, largest=False)                             # [..., T, k]
    weights = torch.isfinite(d).to(x.dtype)                                  # fewer than k earlier refs
    gathered = torch.gather(refs.unsqueeze(-3).expand(*x.shape[:-1], refs.shape[-2], x.shape[-1]), -2,
                            idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))            # [..., T, k, F]
    mean = (gathered * weights.unsqueeze(-1)).sum(-2) / weights.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(is_ref.view(-1, 1), x, mean)


class LayerCodec(nn.Module):
    def __init__(self, dim: int, latent_dim: int, kind: str):
        super().__init__()
        if kind == "linear":
            self.down, self.up = nn.Linear(dim, latent_dim), nn.Linear(latent_dim, dim)
        else:
            hidden = max(dim, latent_dim)
            self.down = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, latent_dim))
            self.up = nn.Sequential(nn.Linear(latent_dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def encode(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.down(x) - self.down(r)

    def decode(self, z: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.up(z) + r


class DeltaKVCompressor(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        dim = 2 * config["num_key_value_heads"] * config["head_dim"]
        self.layers = nn.ModuleDict({str(i): LayerCodec(dim, config["latent_dim"], config["type"])
                                     for i in config["layers"]})

    @property
    def stride(self) -> int:
        return max(1, round(1.0 / self.config["cluster_ratio"]))

    def reconstruct(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x: [..., T, F] -> x_hat: references (and the sink) raw, every other token through its
        latent: what attention reads for a compressed token."""
        cfg = self.config
        is_ref = reference_mask(x.shape[-2], cfg["sink"], self.stride, x.device)
        r = nearest_reference_mean(x, is_ref, cfg["neighbors"])
        codec = self.layers[str(layer)]
        x_hat = codec.decode(codec.encode(x, r), r)
        return torch.where(is_ref.view(-1, 1), x, x_hat)

    def save(self, folder: str, extra: dict | None = None) -> None:
        from safetensors.torch import save_file
        os.makedirs(folder, exist_ok=True)
        save_file({f"layers.{k}": v.detach().contiguous().cpu() for k, v in self.layers.state_dict().items()},
                  os.path.join(folder, WEIGHTS))
        with open(os.path.join(folder, CONFIG), "w") as f:
            json.dump({**self.config, **(extra or {})}, f, indent=1)


def make_config(model_config, latent_dim: int = 128, kind: str = "linear", cluster_ratio: float = 0.1,
                neighbors: int = 4, sink: int = 8, full_layers: list[int] | None = None) -> dict:
    n = model_config.num_hidden_layers
    full = default_full_layers(n) if full_layers is None else sorted(full_layers)
    return {"format": FORMAT, "version": 1, "architecture": model_config.architecture, "num_hidden_layers": n,
            "hidden_size": model_config.hidden_size, "num_key_value_heads": model_config.num_key_value_heads,
            "head_dim": model_config.head_dim, "full_layers": full,
            "layers": [i for i in range(n) if i not in full], "latent_dim": latent_dim, "type": kind,
            "cluster_ratio": cluster_ratio, "neighbors": neighbors, "sink": sink}


def validate_config(cfg: dict) -> None:
    """ValueError naming the field and its valid range."""
    def check(ok: bool, field: str, valid: str) -> None:
        need(ok, f"DeltaKV compressor {field}", cfg.get(field), valid)
    check(cfg.get("format") == FORMAT, "format", FORMAT)
    check(isinstance(cfg.get("latent_dim"), int) and cfg["latent_dim"] > 0, "latent_dim", "an integer > 0")
    check(cfg.get("type") in TYPES, "type", " | ".join(TYPES))
    check(isinstance(cfg.get("cluster_ratio"), (int, float)) and 0 < cfg["cluster_ratio"] < 1, "cluster_ratio",
          "a number in (0, 1)")
    check(isinstance(cfg.get("neighbors"), int) and cfg["neighbors"] >= 1, "neighbors", "an integer >= 1")
    check(isinstance(cfg.get("sink"), int) and cfg["sink"] >= 1, "sink", "an integer >= 1 (tokens before the first "
                                                                          "compressed one need an earlier reference)")
    n = cfg.get("num_hidden_layers")
    check(all(isinstance(i, int) and 0 <= i < n for i in cfg.get("full_layers", [])), "full_layers",
          f"layer ids in [0, {n - 1 if isinstance(n, int) else '?'}]")


def read_config(folder: str, model_config) -> dict:
    """The compressor.json of a folder, checked, and checked against the model it will run on; every
    mismatch is named."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"deltakv_compressor_path={folder!r} holds no {CONFIG}; train one with "
                         "`python -m sparsevllm.tools.train_deltakv --out DIR`")
    with open(path) as f:
        cfg = json.load(f)
    try:
        validate_config(cfg)
    except ValueError as e:
        raise ValueError(f"deltakv_compressor_path={folder!r}: {e}") from None
    want = {"architecture": model_config.architecture, "num_hidden_layers": model_config.num_hidden_layers,
            "hidden_size": model_config.hidden_size, "num_key_value_heads": model_config.num_key_value_heads,
            "head_dim": model_config.head_dim}
    wrong = [f"{k}: compressor {cfg.get(k)!r}, model {v!r}" for k, v in want.items() if cfg.get(k) != v]
    if wrong:
        raise ValueError(f"deltakv_compressor_path={folder!r} was trained for another model shape ("
                         + "; ".join(wrong) + ")")
    return cfg


# What a compressor's own training record must show before the engine trusts it without a warning:
# a 20-step compressor whose cross-entropy stayed worse than the dense model's answered 1 of 12
# needles where vanilla answered 12; 300 steps that brought held-out CE within 0.1 nats of dense
# answered 80-95% (src/sparsevllm/regression/README.md).
MIN_TRAINING_STEPS = 100
CE_MARGIN = 0.25   # nats of cross-entropy above the dense model's


def training_warning(cfg: dict) -> str | None:
    """Why a compressor's training record (compressor.json's `training`, written by the trainer)
    says it is under-trained, or None. The held-out cross-entropy against the dense model's when the
    record has it; else the mean of the last training steps against the dense model's on the first
    batch. A compressor without a record is not judged."""
    record = cfg.get("training")
    if not isinstance(record, dict):
        return None
    why = []
    steps = record.get("steps")
    if isinstance(steps, int) and steps < MIN_TRAINING_STEPS:
        why.append(f"it was trained {steps} steps (fewer than {MIN_TRAINING_STEPS})")
    held = record.get("held_out") or {}
    ce, dense, what = held.get("ce_compressed"), held.get("ce_dense"), "held-out"
    if ce is None:
        ce, dense = (record.get("final_losses_mean_last10") or {}).get("ce"), record.get("dense_ce_first_batch")
        what = "training"
    if isinstance(ce, (int, float)) and isinstance(dense, (int, float)) and ce > dense + CE_MARGIN:
        why.append(f"its {what} cross-entropy {ce:.3f} is {ce - dense:.2f} nats above the dense model's {dense:.3f}")
    return "; ".join(why) or None


def load(folder: str, model_config) -> DeltaKVCompressor:
    """Load and check against the model it will run on."""
    cfg = read_config(folder, model_config)
    from safetensors.torch import load_file
    comp = DeltaKVCompressor(cfg)
    state = {k[len("layers."):]: v for k, v in load_file(os.path.join(folder, WEIGHTS)).items()}
    comp.layers.load_state_dict(state)
    return comp
