"""DeltaKV's compressor and trainer: references and their causal choice against a naive oracle, an
identity-like compressor reconstructs exactly, the file format round-trips and refuses another
model's shape or bad fields, and the trainer's loss falls on a tiny model in a few steps and resumes."""
import json

import pytest
import torch

from sparsevllm.engine.cache_manager.deltakv import compressor as dc
from sparsevllm.models.config import ModelConfig, read_config_json


def naive_reference_mean(x, sink, stride, k):
    T = x.shape[0]
    refs = [p for p in range(T) if p < sink or (p - sink) % stride == 0]
    out = x.clone()
    for t in range(T):
        if t in refs:
            continue
        earlier = [p for p in refs if p < t]                       # causal: only earlier references
        d = sorted(earlier, key=lambda p: (float((x[t] - x[p]).double().norm()), p))[:k]
        out[t] = torch.stack([x[p] for p in d]).mean(0)
    return out


@pytest.mark.parametrize("sink,stride,k", [(4, 10, 4), (1, 3, 2), (8, 5, 1)])
def test_nearest_reference_mean_equals_a_causal_oracle(sink, stride, k):
    g = torch.Generator().manual_seed(sink * 100 + stride)
    x = torch.randn(57, 12, generator=g)
    is_ref = dc.reference_mask(57, sink, stride)
    assert is_ref[:sink].all() and is_ref[sink::stride].all() and int(is_ref.sum()) == sink + len(range(sink, 57, stride))
    got = dc.nearest_reference_mean(x, is_ref, k)
    torch.testing.assert_close(got, naive_reference_mean(x, sink, stride, k), atol=1e-6, rtol=1e-6)
    batched = dc.nearest_reference_mean(torch.stack([x, x.flip(0)]), is_ref, k)
    torch.testing.assert_close(batched[0], got)


def model_config(tiny_model, **kw):
    return ModelConfig.from_dict(read_config_json(tiny_model("llama", num_hidden_layers=4, **kw)))


def test_identity_like_compressor_round_trip_is_exact(tiny_model):
    mc = model_config(tiny_model)
    cfg = dc.make_config(mc, latent_dim=2 * mc.num_key_value_heads * mc.head_dim, full_layers=[0])
    comp = dc.DeltaKVCompressor(cfg)
    with torch.no_grad():
        for codec in comp.layers.values():
            codec.down.weight.copy_(torch.eye(codec.down.weight.shape[0]))
            codec.up.weight.copy_(torch.eye(codec.up.weight.shape[0]))
            codec.down.bias.zero_()
            codec.up.bias.zero_()
    x = torch.randn(2, 40, 2 * mc.num_key_value_heads * mc.head_dim)
    torch.testing.assert_close(comp.reconstruct(1, x), x, atol=1e-5, rtol=1e-5)


def test_format_round_trips_and_refuses_other_shapes(tiny_model, tmp_path):
    mc = model_config(tiny_model)
    comp = dc.DeltaKVCompressor(dc.make_config(mc, latent_dim=8, kind="mlp_gelu", full_layers=[0, 2]))
    comp.save(str(tmp_path / "c"), {"training": {"steps": 0}})
    back = dc.load(str(tmp_path / "c"), mc)
    assert back.config["layers"] == [1, 3] and back.config["training"] == {"steps": 0}
    x = torch.randn(30, 2 * mc.num_key_value_heads * mc.head_dim)
    torch.testing.assert_close(back.reconstruct(3, x), comp.reconstruct(3, x))
    other = model_config(tiny_model, num_key_value_heads=4)
    with pytest.raises(ValueError, match="trained for another model shape .*num_key_value_heads: compressor 2, model 4"):
        dc.load(str(tmp_path / "c"), other)
    with pytest.raises(ValueError, match="holds no compressor.json; train one"):
        dc.load(str(tmp_path), mc)


@pytest.mark.parametrize("field,value,msg", [
    ("latent_dim", 0, "latent_dim=0 is invalid; valid: an integer > 0"),
    ("cluster_ratio", 1.0, r"cluster_ratio=1.0 is invalid; valid: a number in \(0, 1\)"),
    ("neighbors", 0, "neighbors=0 is invalid"), ("type", "conv", "type='conv' is invalid; valid: linear | mlp_gelu"),
    ("full_layers", [0, 9], r"full_layers=\[0, 9\] is invalid; valid: layer ids in \[0, 3\]"),
])
def test_bad_compressor_fields_are_named(tiny_model, field, value, msg):
    cfg = dc.make_config(model_config(tiny_model))
    cfg[field] = value
    with pytest.raises(ValueError, match=msg):
        dc.validate_config(cfg)


def test_trainer_loss_falls_and_resumes(tiny_model, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sparsevllm.tools import train_deltakv
    path = tiny_model("llama", num_hidden_layers=3)
    # a word-level tokenizer over the tiny vocabulary, so the trainer runs on text as it does for real models
    vocab = {f"w{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    data = tmp_path / "data.txt"
    g = torch.Generator().manual_seed(0)
    # a repetitive corpus: reconstructing KV well is learnable in a few steps
    data.write_text(" ".join(f"w{int(t)}" for t in torch.randint(3, 40, (3000,), generator=g)))
    out = tmp_path / "comp"
    args = ["--recent", "16", "--model", path, "--out", str(out), "--data", str(data), "--steps", "12", "--batch_size", "2",
            "--seq_len", "64", "--latent_dim", "16", "--sink", "4", "--full_layers", "0", "--lr", "3e-3",
            "--save_every", "6", "--device", "cpu"]
    assert train_deltakv.main(args[:-6] + ["--steps", "6"] + args[-4:]) == 0   # 6 steps, checkpoint at 6
    assert train_deltakv.main(args + ["--resume"]) == 0                      # resumes at 6, ends at 12
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 13))
    first, last = history[0], history[-1]
    assert last["mse"] < first["mse"] and (last["ce"] + last["mse"]) < (first["ce"] + first["mse"])
    cfg = json.loads((out / "compressor.json").read_text())
    assert cfg["training"]["steps"] == 12 and cfg["layers"] == [1, 2] and cfg["latent_dim"] == 16
    held = cfg["training"]["held_out"]   # judged on windows it did not train on, beside the dense model
    assert held["windows"] == 4 and held["ce_dense"] > 0 and held["ce_compressed"] > 0 and held["mse"] > 0
    dc.load(str(out), ModelConfig.from_dict(read_config_json(path)))
    capsys.readouterr()
    assert train_deltakv.main(args + ["--evaluate", "2"]) == 0                  # held-out CE, nothing trained
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["windows"] == 2 and report["ce_compressed"] > 0 and 0 < report["mse"] < first["mse"]
    assert json.loads((out / "history.json").read_text()) == history


def test_trainer_resume_with_other_settings_names_them(tiny_model, tmp_path, capsys):
    """--resume with a checkpoint trained under another compressor shape or data draw: a usage error
    naming the flags (it crashed in load_state_dict, or silently trained on other windows)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sparsevllm.tools import train_deltakv
    path = tiny_model("llama", num_hidden_layers=3)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    data = tmp_path / "data.txt"
    data.write_text(" ".join(f"w{i % 37 + 3}" for i in range(400)))
    out = tmp_path / "comp"
    args = ["--model", path, "--out", str(out), "--data", str(data), "--steps", "2", "--batch_size", "1",
            "--seq_len", "16", "--latent_dim", "8", "--full_layers", "0", "--recent", "4", "--device", "cpu"]
    assert train_deltakv.main(args) == 0
    capsys.readouterr()
    for flag, value in (("--latent_dim", "4"), ("--seed", "3")):
        with pytest.raises(SystemExit) as e:
            train_deltakv.main(args + [flag, value, "--steps", "3", "--resume"])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    assert train_deltakv.main(args + ["--steps", "3", "--resume"]) == 0   # the same settings resume


@pytest.mark.parametrize("full", ["1,2", "0,1,2", "a"])
def test_trainer_refuses_full_layers_the_engine_cannot_load(tiny_model, tmp_path, full):
    """Without layer 0, with no sparse layer left or not integers: a usage error before the model
    loads (it used to train a compressor that `deltakv` then refuses, or crash with a traceback)."""
    from sparsevllm.tools import train_deltakv
    path = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(SystemExit) as e:
        train_deltakv.main(["--model", path, "--out", str(tmp_path / "c"), "--full_layers", full, "--device", "cpu"])
    assert e.value.code == 2 and not (tmp_path / "c").exists()


def test_trainer_compresses_k_after_the_k_norm_as_the_engine_sees_it(tiny_model):
    """Qwen3 (q/k norm): with an identity-like compressor the attached model equals the original,
    and the x it compresses holds K after the k-norm."""
    import transformers

    from sparsevllm.tools import deltakv_training
    path = tiny_model("qwen3", num_hidden_layers=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        attn = model.model.layers[1].self_attn
        hidden = torch.randn(1, 5, model.config.hidden_size)
        k_normed = attn.k_norm(attn.k_proj(hidden).view(1, 5, -1, attn.head_dim)).flatten(-2)
    cfg = dc.make_config(ModelConfig.from_dict(read_config_json(path)), latent_dim=2 * 2 * 16, full_layers=[0])
    comp = dc.DeltaKVCompressor(cfg)
    F = cfg["latent_dim"]
    with torch.no_grad():
        for codec in comp.layers.values():
            for lin in (codec.down, codec.up):
                lin.weight.copy_(torch.eye(F))
                lin.bias.zero_()
    seen = []
    reconstruct = comp.reconstruct
    comp.reconstruct = lambda layer, x: seen.append((layer, x)) or reconstruct(layer, x)
    deltakv_training.attach(model, comp)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        model.model.layers[1].self_attn.k_proj(hidden)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(seen[-1][1][..., :k_normed.shape[-1]], k_normed)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_trainer_reads_raw_kv_inside_the_recent_window_and_reconstructions_beyond(tiny_model, arch):
    """With --recent W, attention reads raw KV for keys fewer than W tokens behind the query (the
    engine's raw window) and reconstructions for older keys: with a compressor that reconstructs
    badly, logits before position W equal the original model's, later ones do not; with W past the
    sequence nothing changes at all."""
    import transformers

    from sparsevllm.tools import deltakv_training
    path = tiny_model(arch, num_hidden_layers=3)
    ids = torch.randint(3, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    cfg = dc.make_config(ModelConfig.from_dict(read_config_json(path)), latent_dim=8, full_layers=[0], sink=2)
    comp = dc.DeltaKVCompressor(cfg)
    with torch.no_grad():
        for p in comp.parameters():
            p.normal_(0, 1.0)                           # reconstructions far from the true KV
    for recent, same_until in ((12, 12), (64, 40)):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        deltakv_training.attach(model, comp, recent=recent)
        with torch.no_grad():
            got = model(input_ids=ids).logits
        torch.testing.assert_close(got[:, :same_until], want[:, :same_until], atol=1e-4, rtol=1e-4)
        if same_until < ids.shape[1]:
            assert (got[:, same_until:] - want[:, same_until:]).abs().amax() > 1e-2


@pytest.mark.parametrize("training,warned", [
    (None, None),                                                                   # no record: not judged
    (dict(steps=20, dense_ce_first_batch=2.6, final_losses_mean_last10=dict(ce=3.4)), ["20 steps", "training"]),
    (dict(steps=900, held_out=dict(ce_dense=2.371, ce_compressed=2.340)), None),   # the README's 900-step one
    (dict(steps=900, held_out=dict(ce_dense=2.371, ce_compressed=2.9)), ["held-out cross-entropy 2.900"]),
])
def test_an_under_trained_compressor_is_named_at_load(tiny_model, tmp_path, caplog, training, warned):
    """The engine warns, before any weight loads, when the compressor's own training record says it
    is under-trained (too few steps, or cross-entropy well above the dense model's)."""
    from sparsevllm import LLM
    path = tiny_model("llama", num_hidden_layers=3)
    cfg = dc.make_config(ModelConfig.from_dict(read_config_json(path)), latent_dim=4, full_layers=[0])
    dc.DeltaKVCompressor(cfg).save(str(tmp_path / "c"), {"training": training} if training else None)
    assert (dc.training_warning(json.loads((tmp_path / "c" / "compressor.json").read_text())) is None) == (not warned)
    with caplog.at_level("WARNING"):
        LLM(path, vllm_sparse_method="deltakv", device="cpu", deltakv_compressor_path=str(tmp_path / "c"))
    messages = [r.getMessage() for r in caplog.records if "under-trained" in r.getMessage()]
    assert len(messages) == (1 if warned else 0)
    assert all(w in messages[0] for w in warned or [])
