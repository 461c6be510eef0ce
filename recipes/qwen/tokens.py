"""The Qwen vision-language families' special tokens (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 share them):
placeholders inside ``<|vision_start|>...<|vision_end|>``, ChatML turns, ``<|endoftext|>`` as padding and bos,
``<|im_end|>`` as eos; their chat templates, and the tokenizers built from them (:data:`TOKENIZERS`, which
``tools/build_tokenizer_assets.py`` trains and writes under ``assets/tokenizers/<name>``).

Every one is :func:`qwen2_bpe_tokenizer`, a Qwen2 byte-level BPE (the ids differ from the real ones; the tiny configs
take them from the tokenizer), with its family's chat template; Qwen3.5 on its own tokenizer class.
"""

from __future__ import annotations

from functools import partial

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# every special token of the Qwen vision-language tokenizers, padding first (id 0)
SPECIAL_TOKENS = [PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN, IMAGE_TOKEN,
                  VIDEO_TOKEN]

# Qwen2-VL-Instruct's chat template (image/video parts become <|vision_start|><|image_pad|><|vision_end|>; the
# processor or sample encoder then expands <|image_pad|> to the image's merged token count).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen3-VL-Instruct's chat template: no default system prompt, a system turn's text parts only, tool calls and tool
# responses as Qwen3 writes them. A video part renders as <|vision_start|><|video_pad|><|vision_end|>, which the
# processor (or sample encoder) replaces whole by one "<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>" run
# per temporal patch.
QWEN3_VL_CHAT_TEMPLATE = r"""{%- macro render_parts(content) %}
    {%- for part in content %}
        {%- if part.type == 'image' or 'image' in part or 'image_url' in part %}
            {%- set image_count.value = image_count.value + 1 %}
            {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
            <|vision_start|><|image_pad|><|vision_end|>
        {%- elif part.type == 'video' or 'video' in part %}
            {%- set video_count.value = video_count.value + 1 %}
            {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
            <|vision_start|><|video_pad|><|vision_end|>
        {%- elif 'text' in part %}
            {{- part.text }}
        {%- endif %}
    {%- endfor %}
{%- endmacro %}
{%- macro render_text(content) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for part in content %}{%- if 'text' in part %}{{- part.text }}{%- endif %}{%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_text(messages[0].content) }}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " }}
    {{- "<tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' }}
    {{- render_text(messages[0].content) }}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {{- render_parts(message.content) }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {{- render_text(message.content) }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and message.content) or (not loop.first) %}{{- '\n' }}{%- endif %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {{- render_parts(message.content) }}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def qwen2_bpe_tokenizer(train_bpe, chat_template: str, vocab_size: int = 3000, tokenizer_cls=None,
                        split_regex: str | None = None, special_tokens: list[str] | None = None,
                        named_tokens: dict[str, str] | None = None, **tokenizer_kwargs):
    """A Qwen2 byte-level BPE trained by ``train_bpe`` (the asset tool's; Qwen2's own split regex and NFC, which
    Qwen3 tokenises alike), the Qwen vision-language special tokens and ``chat_template``; ``tokenizer_cls`` /
    ``split_regex`` replace Qwen2's (Qwen3.5), ``special_tokens`` the Qwen ones (the first is padding),
    ``named_tokens`` names some as a processor reads them (InternVL's ``context_image_token``, ...)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from transformers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    special_tokens = special_tokens or SPECIAL_TOKENS
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex or PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    vocab, merges = train_bpe(special_tokens, vocab_size, pre_tokenizer, normalizers.NFC(),
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer = (tokenizer_cls or Qwen2Tokenizer)(vocab=vocab, merges=merges, model_max_length=32768, errors="replace",
                                                  **({"extra_special_tokens": named_tokens} if named_tokens else {}),
                                                  **tokenizer_kwargs)
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in special_tokens[1:]]},
        replace_extra_special_tokens=not named_tokens,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def qwen3_5_tokenizer(train_bpe):
    """The same BPE on Qwen3.5's own tokenizer (``Qwen3_5Tokenizer``: its split regex keeps digits single), with
    Qwen3-VL's chat template: Qwen3.5's adds a thinking block only around reasoning content, which the training
    records here do not carry."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    return qwen2_bpe_tokenizer(train_bpe, QWEN3_VL_CHAT_TEMPLATE, tokenizer_cls=Qwen3_5Tokenizer,
                               split_regex=PRETOKENIZE_REGEX)


# asset name -> build(train_bpe): Qwen2.5-VL-Instruct keeps Qwen2-VL-Instruct's template, Qwen3-VL Qwen2's tokenizer
TOKENIZERS = {
    "qwen2_vl": partial(qwen2_bpe_tokenizer, chat_template=QWEN2_VL_CHAT_TEMPLATE),
    "qwen2_5_vl": partial(qwen2_bpe_tokenizer, chat_template=QWEN2_VL_CHAT_TEMPLATE),
    "qwen3_vl": partial(qwen2_bpe_tokenizer, chat_template=QWEN3_VL_CHAT_TEMPLATE),
    "qwen3_5": qwen3_5_tokenizer,
}
