"""GLM-4.1V / 4.5V's special tokens, chat template and tokenizer (:data:`TOKENIZERS`;
``tools/build_tokenizer_assets.py --only glm4v`` writes the asset from them).

An image part renders as ``<|begin_of_image|><|image|><|end_of_image|>``, ``<|image|>`` expanded to the image's
merged token count; a video part as ``<|begin_of_video|><|video|><|end_of_video|>``, ``<|video|>`` replaced by one
``<|begin_of_image|>`` + ``<|image|>`` x n + ``<|end_of_image|>`` + whole seconds run per temporal patch
(``Glm4vProcessor.replace_video_token``): video frames reuse the image placeholder, and only their place between
the video markers says they are video (``mm_token_type_ids`` 2).

The released template leaves an assistant turn open (generation stops at the next ``<|user|>`` or
``<|endoftext|>``, both eos ids); training needs a supervised end, so this template closes every assistant turn
with ``<|endoftext|>``, as LLaMA-Factory's GLM-4.1V template does (``efficient_eos``).
"""

from __future__ import annotations

PAD_TOKEN = "<|endoftext|>"  # padding, and the end of every assistant turn
ASSISTANT_TOKEN = "<|assistant|>"
IMAGE_TOKEN = "<|image|>"
VIDEO_TOKEN = "<|video|>"  # what the template renders per video; never reaches the model's input_ids
BEGIN_IMAGE = "<|begin_of_image|>"
END_IMAGE = "<|end_of_image|>"
BEGIN_VIDEO = "<|begin_of_video|>"
END_VIDEO = "<|end_of_video|>"

# padding first (the tokenizer builder gives the first special token id 0), then GLM-4's role and prefix tokens
SPECIAL_TOKENS = [PAD_TOKEN, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  ASSISTANT_TOKEN, "<|observation|>", BEGIN_IMAGE, END_IMAGE, BEGIN_VIDEO, END_VIDEO, IMAGE_TOKEN,
                  VIDEO_TOKEN]

GLM4V_CHAT_TEMPLATE = r"""[gMASK]<sop>
{%- for msg in messages %}
    {%- if msg.role == 'system' %}<|system|>{{ '\n' }}
        {%- if msg.content is string %}{{ msg.content }}
        {%- else %}{%- for item in msg.content %}{%- if item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}
        {%- endif %}
    {%- elif msg.role == 'user' %}<|user|>{{ '\n' }}
        {%- if msg.content is string %}{{ msg.content }}
        {%- else %}
            {%- for item in msg.content %}
                {%- if item.type == 'video' or 'video' in item %}<|begin_of_video|><|video|><|end_of_video|>
                {%- elif item.type == 'image' or 'image' in item %}<|begin_of_image|><|image|><|end_of_image|>
                {%- elif item.type == 'text' %}{{ item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- elif msg.role == 'assistant' %}<|assistant|>{{ '\n' }}
        {%- if msg.content is string %}{{ msg.content }}
        {%- else %}{%- for item in msg.content %}{%- if item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}
        {%- endif %}<|endoftext|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{{ '\n' }}{% endif %}"""

# GLM-4's pre-tokenizer split (cl100k's, which GLM-4's tiktoken vocabulary was built with: digits in runs of 1-3)
GLM4_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def glm4v_tokenizer(train_bpe, vocab_size: int = 3000):
    """GLM-4's byte-level BPE trained by ``train_bpe`` (the asset tool's; cl100k split, no normalizer) in a
    ``PreTrainedTokenizerFast`` as GLM-4.1V ships it, with GLM-4.1V's special tokens and chat template,
    ``<|endoftext|>`` as padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AddedToken, PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    vocab, merges = train_bpe(SPECIAL_TOKENS, vocab_size, pre_tokenizer,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=PAD_TOKEN,
                                        model_max_length=32768, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                                for t in SPECIAL_TOKENS[1:]]})
    tokenizer.chat_template = GLM4V_CHAT_TEMPLATE
    return tokenizer


TOKENIZERS = {"glm4v": glm4v_tokenizer}  # asset name -> build(train_bpe)
