"""Builders shared by the regression-harness tests: a small byte-level BPE tokenizer trained on
the bundled Python docs (no hub access) with a ChatML template, and a tiny random Llama beside it.
Imported by the regression-harness and server tests."""

import json
import os

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_tokenizer(vocab_size: int = 1024, chat_template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sparsevllm.regression.text import pydoc_text

    text = pydoc_text()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text[i:i + 10000] for i in range(0, len(text), 10000)], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  unk_token="<|endoftext|>")
    if chat_template:
        tok.chat_template = CHATML
    return tok


def build_tiny_llama(path: str, max_position_embeddings: int = 4096) -> str:
    """A 2-layer random Llama (the engine's smoke-test model) with the tokenizer saved beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    assert json.load(open(os.path.join(path, "config.json")))["vocab_size"] == len(tok)
    return path
