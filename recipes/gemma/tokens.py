"""Gemma's special tokens, Gemma 3's chat template and the tokenizer built from a trained vocabulary.

An image part renders as ``<start_of_image>``; the processor (and ``GemmaSampleEncoder``) replaces it by
``\\n\\n<start_of_image>`` + the image's soft tokens + ``<end_of_image>\\n\\n``. The tokenizer names them as
transformers' Gemma processors read them (``boi_token``, ``eoi_token``, ``image_token`` and their ids).
:func:`gemma_bpe` trains the family's vocabulary with the asset tool's ``train_bpe`` and :func:`gemma_tokenizer`
makes the tokenizer of it; :data:`TOKENIZERS` is Gemma 3's (``tools/build_tokenizer_assets.py`` writes it).
"""

from __future__ import annotations

BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_SOFT_TOKEN = "<image_soft_token>"
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"

# ids 0..4 as in Gemma's own vocabulary (pad, eos, bos, unk, mask), then the turn and image tokens
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", START_OF_TURN, END_OF_TURN, BOI_TOKEN, EOI_TOKEN,
                  IMAGE_SOFT_TOKEN]
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]  # Gemma's BPE falls back to bytes

# google/gemma-3-*-it's chat template: the system turn is folded into the first user turn, roles must alternate,
# the assistant is "model", text parts are trimmed
GEMMA3_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def gemma_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], chat_template: str,
                    image_tokens: dict[str, str] | None = None,
                    turn_tokens: tuple[str, str] = (START_OF_TURN, END_OF_TURN)):
    """``GemmaTokenizer`` (byte-fallback BPE, spaces as ``▁``) over a trained ``vocab`` / ``merges``, with the
    ``turn_tokens`` special (default Gemma 3's) and ``image_tokens`` (default Gemma 3's ``boi_token`` /
    ``eoi_token`` / ``image_token``) as named model-specific special tokens."""
    from transformers import AddedToken, GemmaTokenizer

    image_tokens = image_tokens or {"boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN, "image_token": IMAGE_SOFT_TOKEN}
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, extra_special_tokens=image_tokens, model_max_length=8192)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                                for t in turn_tokens]},
                                 replace_extra_special_tokens=False)
    tokenizer.chat_template = chat_template
    return tokenizer


def gemma_bpe(train_bpe, vocab_seed: list[str], vocab_size: int = 3000) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Gemma's byte-fallback BPE, trained by ``train_bpe`` (the asset tool's) with the words' ``▁`` pieces learned
    by a Metaspace split (``GemmaTokenizer`` then turns spaces into ``▁``, no pre-split), ``vocab_seed`` (the
    special and byte tokens) first: ``(vocab, merges)``."""
    from tokenizers import models, pre_tokenizers

    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    model = models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    return train_bpe(vocab_seed, vocab_size, pre_tokenizer, model=model)


def gemma3_tokenizer(train_bpe):
    """Gemma 3's tokenizer: the family's BPE, its special, turn and image tokens and Gemma 3's chat template."""
    return gemma_tokenizer(*gemma_bpe(train_bpe, SPECIAL_TOKENS + BYTE_TOKENS), GEMMA3_CHAT_TEMPLATE)


TOKENIZERS = {"gemma3": gemma3_tokenizer}  # asset name -> build(train_bpe)
