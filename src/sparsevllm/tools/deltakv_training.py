"""The work of `python -m sparsevllm.tools.train_deltakv` (its docstring says what it trains and
how): the frozen model's attention reading reconstructed KV where the engine would, the held-out
judgement, and the training loop."""
import json
import logging
import os
import sys
import time

import torch
from tqdm.auto import tqdm

from sparsevllm.engine.cache_manager.deltakv.compressor import DeltaKVCompressor, load, make_config, validate_config

logger = logging.getLogger(__name__)


class _JointKV(torch.nn.Module):
    """Stands in for a sparse layer's k_proj: computes K and V, reconstructs them through the
    compressor, returns K; the paired _ReconstructedV returns V."""

    def __init__(self, k_proj, v_proj, compressor, layer: int, state: dict, k_norm=None, head_dim: int = 0):
        super().__init__()
        self.k_proj, self.v_proj, self.compressor = k_proj, v_proj, compressor
        self.layer, self.state = layer, state
        self.k_norm, self.head_dim = k_norm, head_dim

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        k, v = self.k_proj(hidden), self.v_proj(hidden)                 # [B, T, H_kv * D] each
        if self.k_norm is not None:
            # Qwen3: the engine's cache sees K after the per-head k-norm (the model applies it before
            # the cache hook), so that is the K the compressor learns; attention's own k_norm is
            # replaced by an identity in the sparse layers.
            k = self.k_norm(k.view(*k.shape[:-1], -1, self.head_dim)).flatten(-2)
        if self.state["bypass"]:                                         # the dense reference loss
            self.state["v"][self.layer] = v
            return k
        # The compressor trains in fp32 beside a bf16 model on a GPU; attention gets the model's dtype.
        x = torch.cat([k, v], dim=-1).float()
        x_hat = self.compressor.reconstruct(self.layer, x)
        self.state["mse"].append(torch.nn.functional.mse_loss(x_hat, x))
        x_hat = x_hat.to(k.dtype)
        k_hat, v_hat = x_hat[..., :k.shape[-1]], x_hat[..., k.shape[-1]:]
        if self.state["recent"] > 0:
            # raw and reconstructed side by side as twice the KV heads: the model's own reshape and
            # RoPE treat them alike, and _mixed_attention picks one per (query, key) pair
            self.state["v"][self.layer] = torch.cat([v, v_hat], dim=-1)
            return torch.cat([k, k_hat], dim=-1)
        self.state["v"][self.layer] = v_hat
        return k_hat


class _ReconstructedV(torch.nn.Module):
    def __init__(self, layer: int, state: dict):
        super().__init__()
        self.layer, self.state = layer, state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.layer not in self.state["v"]:
            raise RuntimeError("v_proj ran before k_proj in this transformers version; the DeltaKV trainer "
                               "relies on attention computing K before V")
        return self.state["v"].pop(self.layer)


def _mixed_attention(state: dict):
    """An attention function for transformers' registry: a layer whose K/V arrive with twice the KV
    heads (raw first, reconstructed second) reads the raw pair for keys fewer than state["recent"]
    tokens behind the query and the reconstructed pair for older keys; any other layer is plain
    causal attention."""
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n_q, n_kv, t = query.shape[1], key.shape[1], query.shape[2]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if n_kv != 2 * module.config.num_key_value_heads:
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                                   enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
        group = n_q // (n_kv // 2)
        k_raw, k_hat = (kk.repeat_interleave(group, dim=1) for kk in key.chunk(2, dim=1))
        v_raw, v_hat = (vv.repeat_interleave(group, dim=1) for vv in value.chunk(2, dim=1))
        pos = torch.arange(t, device=query.device)
        behind = pos.view(-1, 1) - pos.view(1, -1)                      # query i minus key j
        near = behind < state["recent"]
        scores = torch.where(near, query @ k_raw.transpose(-1, -2), query @ k_hat.transpose(-1, -2)) * scale
        scores = scores.float().masked_fill(behind < 0, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(query.dtype)
        out = (p * near) @ v_raw + (p * ~near) @ v_hat
        return out.transpose(1, 2).contiguous(), None
    return attention


def attach(model, compressor: DeltaKVCompressor, recent: int = 0) -> dict:
    """Route the compressor's layers through reconstruction; with recent > 0 attention reads raw KV
    for keys nearer than `recent` tokens to the query (the engine's raw window)."""
    state = {"mse": [], "v": {}, "bypass": False, "recent": recent}
    for layer in compressor.config["layers"]:
        attn = model.model.layers[layer].self_attn
        k_proj, v_proj = attn.k_proj, attn.v_proj
        k_norm = getattr(attn, "k_norm", None)
        attn.k_proj = _JointKV(k_proj, v_proj, compressor, layer, state, k_norm, compressor.config["head_dim"])
        if k_norm is not None:
            attn.k_norm = torch.nn.Identity()
        attn.v_proj = _ReconstructedV(layer, state)
    if recent > 0:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionInterface.register("deltakv_train", _mixed_attention(state))
        AttentionMaskInterface.register("deltakv_train", sdpa_mask)
        model.config._attn_implementation = "deltakv_train"
    return state


def token_stream(tokenizer, path: str | None) -> tuple[torch.Tensor, str]:
    if path:
        with open(path) as f:
            text, source = f.read(), os.path.abspath(path)
    else:
        from sparsevllm.regression.text import pydoc_text
        text, source = pydoc_text(), f"pydoc_data (CPython {sys.version.split()[0]})"
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long), source


HELD_OUT_WINDOWS = 4   # windows the trained compressor is judged on, recorded in its compressor.json


def held_out(model, state: dict, tokens: torch.Tensor, seq_len: int, windows: int, seed: int) -> dict:
    """The frozen model's next-token cross-entropy on windows the training did not draw (seed + 1),
    dense and reading the compressor's reconstructions as the engine would (raw within the window
    `attach` was given), with the MSE."""
    gen = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (windows,), generator=gen).tolist()
    dense, compressed, mse = [], [], []
    with torch.no_grad():
        for s in starts:
            ids = tokens[s:s + seq_len + 1].view(1, -1).to(next(model.parameters()).device)
            state["bypass"] = True
            dense.append(model(input_ids=ids, labels=ids).loss.item())
            state["bypass"], state["mse"] = False, []
            compressed.append(model(input_ids=ids, labels=ids).loss.item())
            mse.append(torch.stack(state["mse"]).mean().item())
    return {"windows": len(starts), "seq_len": seq_len,
            **{name: round(sum(xs) / len(xs), 4) for name, xs in (("ce_dense", dense), ("ce_compressed", compressed),
                                                                    ("mse", mse))}}


def train(args, ap) -> int:
    """Train (or, with --evaluate, judge) a compressor as the parsed arguments say; usage errors go
    through ap.error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparsevllm.default_model import resolve_model
    from sparsevllm.models.config import ModelConfig, read_config_json
    path = resolve_model(args.model)
    model_config = ModelConfig.from_dict(read_config_json(path))
    try:
        full = None if args.full_layers is None else [int(x) for x in args.full_layers.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--full_layers {args.full_layers!r} must be a comma list of layer ids")
    n = model_config.num_hidden_layers
    # The engine needs layer 0 full (it scores tokens for the first sparse layer) and a sparse layer
    # to compress: refuse here, not after training a compressor `deltakv` cannot load.
    if full is not None and (0 not in full or not set(range(n)) - set(full)):
        ap.error(f"--full_layers {args.full_layers!r} must include layer 0 and leave at least one of the model's "
                 f"{n} layers sparse")
    cfg = make_config(model_config, args.latent_dim, args.type, args.cluster_ratio, args.neighbors, args.sink, full)
    try:
        validate_config(cfg)
    except ValueError as e:
        ap.error(str(e))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokens, source = token_stream(tokenizer, args.data)
    if tokens.numel() <= args.seq_len + 1:
        ap.error(f"the data holds {tokens.numel()} tokens, fewer than --seq_len + 1")
    if args.evaluate:
        state = attach(model, load(args.out, model_config).to(device), args.recent)
        print(json.dumps({"compressor": args.out, "recent": args.recent,
                          **held_out(model, state, tokens, args.seq_len, args.evaluate, args.seed)}))
        return 0
    compressor = DeltaKVCompressor(cfg).to(device)
    state = attach(model, compressor, args.recent)
    opt = torch.optim.AdamW(compressor.parameters(), lr=args.lr)
    ckpt = os.path.join(args.out, "checkpoint")
    start, history = 0, []
    # What a checkpoint's compressor shape and data draw depend on: resuming under other values would
    # crash loading its weights or silently continue on other windows.
    settings = {"latent_dim": args.latent_dim, "type": args.type, "cluster_ratio": args.cluster_ratio,
                "neighbors": args.neighbors, "sink": args.sink, "full_layers": cfg["full_layers"], "seed": args.seed,
                "batch_size": args.batch_size, "seq_len": args.seq_len, "data": source}
    if args.resume and os.path.isfile(os.path.join(ckpt, "state.pt")):
        saved = torch.load(os.path.join(ckpt, "state.pt"), map_location=device)
        differ = [f"--{k} {saved['settings'][k]!r} (now {v!r})" for k, v in settings.items()
                  if "settings" in saved and saved["settings"].get(k) != v]
        if differ:
            ap.error(f"--resume: {ckpt} was trained with " + ", ".join(differ) + "; pass the same values or "
                     "another --out")
        compressor.load_state_dict(saved["compressor"])
        opt.load_state_dict(saved["optimizer"])
        start, history = saved["step"], saved["history"]
        logger.warning("resuming from step %d", start)
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, tokens.numel() - args.seq_len - 1, (args.steps, args.batch_size), generator=gen)
    # the frozen model's own loss on the first batch, for scale
    state["bypass"] = True
    with torch.no_grad():
        first = torch.stack([tokens[s:s + args.seq_len + 1] for s in starts[0].tolist()]).to(device)
        dense_ce = model(input_ids=first, labels=first).loss.item()
    state["bypass"] = False
    t0 = time.perf_counter()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train_deltakv", dynamic_ncols=True)
    for step in bar:
        batch = torch.stack([tokens[s:s + args.seq_len + 1] for s in starts[step].tolist()]).to(device)
        state["mse"].clear()
        out = model(input_ids=batch, labels=batch)      # transformers shifts the labels itself
        ce = out.loss
        mse = torch.stack(state["mse"]).mean()
        loss = ce + args.mse_weight * mse
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append({"step": step + 1, "ce": ce.item(), "mse": mse.item()})
        bar.set_postfix(ce=f"{history[-1]['ce']:.3f}", mse=f"{history[-1]['mse']:.4f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            os.makedirs(ckpt, exist_ok=True)
            torch.save({"compressor": compressor.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                        "history": history, "settings": settings}, os.path.join(ckpt, "state.pt"))
    bar.close()
    elapsed = time.perf_counter() - t0
    last = history[-min(10, len(history)):] if history else []
    final = {k: sum(h[k] for h in last) / max(len(last), 1) for k in ("ce", "mse")}
    judged = held_out(model, state, tokens, args.seq_len, HELD_OUT_WINDOWS, args.seed)
    compressor.save(args.out, {"training": {"data": source, "steps": args.steps, "batch_size": args.batch_size,
                                            "seq_len": args.seq_len, "lr": args.lr, "mse_weight": args.mse_weight,
                                            "recent": args.recent,
                                            "seed": args.seed, "device": device, "seconds_this_run": round(elapsed, 1),
                                            "first_losses": history[0] if history else None,
                                            "dense_ce_first_batch": dense_ce,
                                            "final_losses_mean_last10": final, "held_out": judged}})
    with open(os.path.join(args.out, "history.json"), "w") as f:
        json.dump(history, f)
    print(f"trained {args.steps} steps on {device} in {elapsed:.1f} s: ce {history[0]['ce']:.3f} -> {final['ce']:.3f} "
          f"(the dense model: {dense_ce:.3f} on the first batch), mse {history[0]['mse']:.4f} -> {final['mse']:.4f}; "
          f"held out: ce {judged['ce_compressed']:.3f} (dense {judged['ce_dense']:.3f}); wrote {args.out}")
    return 0

