"""InternVL's special tokens, the chat template of the transformers port and the tokenizer built from a trained
vocabulary.

An image part renders as ``<IMG_CONTEXT>\\n``; the processor (and ``InternVLSampleEncoder``) replaces the
``<IMG_CONTEXT>`` by ``<img>`` + the image's context tokens (tiles x tokens per tile) + ``</img>``. ChatML turns as
Qwen2 writes them, ``<|endoftext|>`` as padding, ``<|im_end|>`` closing every turn. The tokenizer names the image
tokens as transformers' ``InternVLProcessor`` reads them (``start_image_token``, ``end_image_token``,
``context_image_token``, ``video_token`` and their ids). The tokenizer (:data:`TOKENIZERS`) is the Qwen family's
byte-level BPE (``recipes.qwen.tokens.qwen2_bpe_tokenizer``: InternVL 3 / 3.5 keep their Qwen2 / Qwen3 language
model's tokenizer) with :data:`SPECIAL_TOKENS` and :data:`NAMED_TOKENS`; ``tools/build_tokenizer_assets.py`` writes
it.
"""

from __future__ import annotations

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
START_IMAGE_TOKEN = "<img>"
END_IMAGE_TOKEN = "</img>"
CONTEXT_IMAGE_TOKEN = "<IMG_CONTEXT>"
VIDEO_TOKEN = "<video>"

SPECIAL_TOKENS = [PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN, START_IMAGE_TOKEN, END_IMAGE_TOKEN, CONTEXT_IMAGE_TOKEN,
                  VIDEO_TOKEN]
# the names transformers' InternVLProcessor reads from the tokenizer
NAMED_TOKENS = {"start_image_token": START_IMAGE_TOKEN, "end_image_token": END_IMAGE_TOKEN,
                "context_image_token": CONTEXT_IMAGE_TOKEN, "video_token": VIDEO_TOKEN}

# OpenGVLab/InternVL3-*-hf's chat template: ChatML, no default system prompt, an image part as <IMG_CONTEXT>\n
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def internvl_tokenizer(train_bpe):
    """The Qwen2 BPE with InternVL's image tokens, named as ``InternVLProcessor`` reads them, ``<|im_end|>`` as eos
    and the chat template of the transformers port."""
    from recipes.qwen.tokens import qwen2_bpe_tokenizer

    return qwen2_bpe_tokenizer(train_bpe, INTERNVL_CHAT_TEMPLATE, special_tokens=SPECIAL_TOKENS,
                               named_tokens=NAMED_TOKENS, eos_token=IM_END_TOKEN)


TOKENIZERS = {"internvl": internvl_tokenizer}  # asset name -> build(train_bpe)
