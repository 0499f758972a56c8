"""Weights from a Hugging Face safetensors folder (one file or shards), or random ones (dummy)."""
import glob
import json
import logging
import os

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {path!r} has no *.safetensors weights "
                         "(use load_format='dummy' for random weights from config.json alone)")
    return files


def load_weights(model: torch.nn.Module, path: str) -> None:
    params = dict(model.named_parameters())
    loaded, unexpected = set(), []
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = hf_name.removeprefix("model.")
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue  # tied: the embedding matrix is the head
                target, shard = name, None
                for hf_part, (packed, idx) in model.packed_modules.items():
                    if f".{hf_part}." in name:
                        target, shard = name.replace(hf_part, packed), (packed, idx)
                        break
                if target not in params:
                    unexpected.append(hf_name)   # reported with every other mismatch after the pass
                    continue
                param = params[target]
                owner = model.get_submodule(target.rpartition(".")[0]) if "." in target else model
                if hasattr(owner, "weight_loader"):
                    # tensor-parallel layer: it reads only this rank's slice out of the file
                    try:
                        owner.weight_loader(param, f.get_slice(hf_name), shard[1] if shard else None)
                    except ValueError as e:
                        raise ValueError(f"{hf_name} in {file}: {e}") from None
                    loaded.add((target, shard[1] if shard else None))
                    continue
                tensor = f.get_tensor(hf_name)
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{hf_name} in {file}: checkpoint shape {tuple(tensor.shape)} does not "
                                         f"match config.json (expects {tuple(param.shape)})")
                    param.data.copy_(tensor)
                else:
                    sizes = model.shard_sizes(shard[0])
                    start = sum(sizes[:shard[1]])
                    param.data.narrow(0, start, sizes[shard[1]]).copy_(tensor)
                loaded.add((target, shard[1] if shard else None))
    expected = set()
    for name, _ in model.named_parameters():
        packed = name.split(".")[-2] if name.count(".") else ""
        if packed in ("qkv_proj", "gate_up_proj"):
            expected.update((name, i) for i in range(len(model.shard_sizes(packed))))
        elif not (name == "lm_head.weight" and model.cfg.tie_word_embeddings):
            expected.add((name, None))
    missing = sorted(_checkpoint_name(model, name, shard) for name, shard in expected - loaded)
    if unexpected or missing:
        def listed(names):
            return ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise ValueError(f"checkpoint in {path!r} does not match {type(model).__name__} for its config.json:"
                         + (f" tensors with no place in the model: {listed(unexpected)};" if unexpected else "")
                         + (f" weights missing from the checkpoint: {listed(missing)}" if missing else ""))


def _checkpoint_name(model: torch.nn.Module, name: str, shard: int | None) -> str:
    """Our parameter (and shard of a packed one) under its Hugging Face checkpoint name."""
    for hf_part, packed in model.packed_modules.items():
        if packed == (name.split(".")[-2], shard):
            name = name.replace(packed[0], hf_part)
    return name if name.startswith("lm_head.") else "model." + name


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of realistic scale, for benchmarks at real sizes without checkpoints."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.device.type == "cpu":
            p.data.normal_(0.0, 0.02, generator=gen)
        else:
            p.data.normal_(0.0, 0.02)  # device RNG: generating 8B params on the host would take minutes
