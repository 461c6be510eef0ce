"""GLM-4.1V / 4.5V's special tokens and chat template (``tools/build_tokenizer_assets.py --only glm4v`` writes the
asset from them).

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
