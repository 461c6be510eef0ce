"""Gemma 4's turn and image tokens and its chat template (the family's tokenizer builder, ``recipes.gemma.tokens``,
makes the tokenizer from them: :data:`TOKENIZERS`; ``tools/build_tokenizer_assets.py --only gemma4`` writes the
asset).

Gemma 4 renames Gemma 3's markers: turns are ``<|turn>role\\n ... <turn|>\\n``, an image part renders as
``\\n\\n<|image|>\\n\\n`` and the processor replaces the placeholder by ``<|image>`` + the image's soft tokens
(``<|image|>`` each) + ``<image|>``.
"""

from __future__ import annotations

from recipes.gemma.tokens import BYTE_TOKENS, gemma_bpe, gemma_tokenizer

BOI_TOKEN = "<|image>"
EOI_TOKEN = "<image|>"
IMAGE_SOFT_TOKEN = "<|image|>"
START_OF_TURN = "<|turn>"
END_OF_TURN = "<turn|>"
IMAGE_TOKENS = {"boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN, "image_token": IMAGE_SOFT_TOKEN}

# ids 0..4 as in Gemma's vocabulary (pad, eos, bos, unk, mask), then Gemma 4's turn and image tokens
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", START_OF_TURN, END_OF_TURN, BOI_TOKEN, EOI_TOKEN,
                  IMAGE_SOFT_TOKEN]
VOCAB_SEED = SPECIAL_TOKENS + BYTE_TOKENS

# Gemma 4's turn layout: the system turn is a turn of its own, the assistant is "model", text parts are trimmed
GEMMA4_CHAT_TEMPLATE = r"""{{ bos_token }}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<|turn>' + role + '\n' }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '\n\n<|image|>\n\n' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<turn|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<|turn>model\n'}}
{%- endif -%}
"""


def gemma4_tokenizer(train_bpe):
    """Gemma 3's byte-fallback BPE (``recipes.gemma.tokens``) with Gemma 4's turn and image tokens and chat
    template."""
    return gemma_tokenizer(*gemma_bpe(train_bpe, VOCAB_SEED), GEMMA4_CHAT_TEMPLATE, image_tokens=IMAGE_TOKENS,
                           turn_tokens=(START_OF_TURN, END_OF_TURN))


TOKENIZERS = {"gemma4": gemma4_tokenizer}  # asset name -> build(train_bpe)
