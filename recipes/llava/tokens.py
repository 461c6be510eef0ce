"""LLaVA's special tokens (Llama's, a pad token and the image placeholder), LLaVA-1.5's chat template and the
tokenizer built from them (:data:`TOKENIZERS`, which ``tools/build_tokenizer_assets.py`` trains and writes)."""

from __future__ import annotations

IMAGE_TOKEN = "<image>"

# Llama's special tokens (unk/bos/eos at 0/1/2, as in Llama-2), a pad token and LLaVA's image placeholder; then the
# 256 byte-fallback tokens <0x00>..<0xFF> a SentencePiece-style Llama BPE falls back to for unseen characters.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]

# LLaVA-1.5's conversation format ("USER: <image>\n... ASSISTANT: ...</s>"), one line per turn. Every image part
# becomes "<image>\n"; the sample encoder expands each <image> to the model's number of image tokens. The space
# after "ASSISTANT:" belongs to the answer's first token (Llama's "▁word" pieces), so it is supervised with it.
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}USER: {% elif message['role'] == 'assistant' %}ASSISTANT: {% endif %}"
    "{% for part in parts %}{% if part['type'] == 'image' or 'image' in part %}<image>{{ '\n' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def llava_tokenizer(train_bpe, vocab_size: int = 3000):
    """Llama (SentencePiece-style) BPE trained by ``train_bpe`` (the asset tool's): Metaspace pre-tokenizer, byte
    fallback, no normalizer, as ``LlamaTokenizer`` builds it; Llama's special tokens, ``<pad>``, ``<image>`` and
    LLaVA-1.5's chat template."""
    from tokenizers import models, pre_tokenizers
    from transformers import AddedToken, LlamaTokenizer

    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    model = models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    vocab, merges = train_bpe(SPECIAL_TOKENS + BYTE_TOKENS, vocab_size, pre_tokenizer, model=model)
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<pad>", add_prefix_space=True,
                               model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(IMAGE_TOKEN, special=True,
                                                                           normalized=False)]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


TOKENIZERS = {"llava": llava_tokenizer}  # asset name -> build(train_bpe)
