"""Build the small, committed tokenizer assets the recipes load instead of a hub download.

No model hub is reachable, so every recipe trains from a tokenizer we generate here: a byte-level BPE learned
on a fixed, seedless corpus written in this file (shapes, colours, counting, questions and answers, plus some
general English), extended with the model family's special tokens and chat template, and saved with
``save_pretrained`` so ``AutoTokenizer.from_pretrained(dir)`` loads it like a real checkpoint's tokenizer.

Running the script twice gives byte-identical files (tested): the corpus is enumerated in a fixed order, BPE
training is deterministic for a fixed corpus, and JSON is written with sorted keys.

One function per tokenizer in ``BUILDERS`` (``build_qwen2_vl`` and ``build_qwen3_vl``: one Qwen2 byte-level BPE,
``build_qwen2_bpe``, each with its family's chat template; ``build_qwen3_5``: the same on Qwen3.5's tokenizer;
``build_llava``: Llama-style SentencePiece BPE with byte fallback; ``build_gemma3``: Gemma's byte-fallback BPE with
the tokens and template of ``recipes.gemma.tokens``), all on the shared ``corpus()`` and ``train_bpe()``.

    python tools/build_tokenizer_assets.py                 # all tokenizers into assets/tokenizers/<name>/
    python tools/build_tokenizer_assets.py --only qwen2_vl --out /tmp/tok
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "assets" / "tokenizers"

SHAPES = ["circle", "square", "triangle", "rectangle", "star", "line", "dot", "box", "ring", "cross"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "gray", "brown"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
PLACES = ["left", "right", "top", "bottom", "center", "corner", "middle", "edge"]
SIZES = ["small", "large", "big", "tiny", "huge", "medium"]

GENERAL_TEXT = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, but a good answer needs
only a few. You are a helpful assistant. Please describe the image in detail. What do you see in this picture?
There is a cat sitting on the table next to a cup of tea. The sky is clear and the sun is shining brightly.
In the morning the children walk to school, and in the evening they come back home to eat dinner together.
Could you tell me how many objects are in the image? Yes, I can. There are several objects of different
colours and sizes. Describe the scene: a person is reading a book under a tree while birds sing above.
The answer is correct. That is not right; please look again and count carefully. Thank you very much!
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 25, 100 and 2024 appear in text as well as words.
Questions often start with what, where, when, which, who, why or how, and answers often start with it, there
or the. This is a test of a very small language model that learns from packed sequences of images and text.
"""

# A bank of common English words; ``corpus()`` strings them into simple sentences in a fixed order so BPE sees
# enough distinct words to learn a few thousand merges.
NOUNS = """
time year people way day man woman child world life hand part place case week company system program question
work government number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end member law car city
community name president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force education
foot boy age policy music market sense nation plan college interest death experience effect class control care
field development role effort rate heart drug show leader light voice wife police mind price report decision son
view relationship town road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star table need court oil
situation cost industry figure street image phone data picture practice piece land product doctor wall patient
worker news test movie north love support technology step baby computer type attention film tree source organization
hair window evidence population site truth garden river mountain island forest ocean bird fish horse apple bread
cheese flower chair bottle cup plate kitchen train plane ship bridge station shadow pattern shape colour color
""".split()
VERBS = """
is was are be have do say go can get make know think take see come want look use find give tell work call try ask
need feel become leave put mean keep let begin seem help talk turn start show hear play run move like live believe
hold bring happen write provide sit stand lose pay meet include continue set learn change lead understand watch
follow stop create speak read allow add spend grow open walk win offer remember love consider appear buy wait serve
die send expect build stay fall cut reach kill remain suggest raise pass sell require report decide pull count draw
paint describe notice point hide jump fly swim climb carry push throw catch hold break fix clean cook eat drink sleep
""".split()
ADJECTIVES = """
good new first last long great little own other old right big high different small large next early young important
few public bad same able free sure clear full special easy whole strong real best hard better true recent certain
personal open simple short dark bright round square flat sharp soft heavy light empty quiet happy sad warm cold hot
fast slow close far deep wide narrow thin thick clean dirty rich poor safe wild calm busy strange famous modern
""".split()
ADVERBS = "quickly slowly carefully quietly clearly nearly almost always never often sometimes together again".split()

QUESTIONS = [
    "What colour is the {shape}?",
    "How many {shape}s are there?",
    "Where is the {colour} {shape}?",
    "Is there a {colour} {shape} in the image?",
    "Describe the {size} {shape}.",
    "Which shape is {colour}?",
    "Count the {colour} shapes.",
]
ANSWERS = [
    "The {shape} is {colour}.",
    "There are {number} {shape}s.",
    "The {colour} {shape} is at the {place}.",
    "Yes, there is a {size} {colour} {shape} at the {place}.",
    "No, I do not see a {colour} {shape}.",
    "It is a {size} {colour} {shape} near the {place} of the image.",
]


def corpus() -> list[str]:
    """The fixed training corpus: templated Q&A lines in a fixed enumeration order plus general English."""
    lines = [line for line in GENERAL_TEXT.splitlines() if line]
    grid = itertools.product(SHAPES, COLOURS, NUMBERS, PLACES, SIZES)
    for i, (shape, colour, number, place, size) in enumerate(grid):
        if i % 7:  # a deterministic thinning keeps training fast; every word still appears many times
            continue
        fields = {"shape": shape, "colour": colour, "number": number, "place": place, "size": size}
        question = QUESTIONS[i % len(QUESTIONS)].format(**fields)
        answer = ANSWERS[i % len(ANSWERS)].format(**fields)
        lines.append(f"{question} {answer}")
        lines.append(f"{answer.capitalize()} {i % 1000} {place.upper()}")
    for i in range(len(NOUNS) * 4):
        noun, other = NOUNS[i % len(NOUNS)], NOUNS[(i * 7 + 3) % len(NOUNS)]
        verb, adj = VERBS[(i * 5 + 1) % len(VERBS)], ADJECTIVES[(i * 3 + 2) % len(ADJECTIVES)]
        adverb = ADVERBS[i % len(ADVERBS)]
        lines.append(f"The {adj} {noun} will {verb} the {other} {adverb}, and {other}s {verb} {noun}s.")
        lines.append(f"Why does the {noun} {verb}? Because {adj} {other}s are {adverb} {adj}er than {noun}s.")
    for verb in VERBS:
        lines.extend([f"{verb.capitalize()} it: {verb}s, {verb}ing and {verb}ed."] * 2)
    for word in NOUNS + ADJECTIVES:
        lines.extend([f"{word.capitalize()}? {word.upper()}! ({word}) {word}ly '{word}'"] * 2)
    return lines


def train_byte_level_bpe(
    special_tokens: list[str],
    vocab_size: int,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    normalizer: normalizers.Normalizer | None = None,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE on ``corpus()``; returns ``(vocab, merges)`` with special tokens at ids 0..k-1."""
    return train_bpe(special_tokens, vocab_size, pre_tokenizer, normalizer,
                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def train_bpe(
    special_tokens: list[str],
    vocab_size: int,
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    normalizer: normalizers.Normalizer | None = None,
    initial_alphabet: list[str] | None = None,
    model: models.Model | None = None,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a BPE ``model`` (default: plain ``models.BPE()``) on ``corpus()``; returns ``(vocab, merges)`` with
    the special tokens at ids 0..k-1, in the order given."""
    tokenizer = Tokenizer(model if model is not None else models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=initial_alphabet or [],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    state = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    return state["vocab"], merges


def _canonicalise_json(directory: Path) -> None:
    """Rewrite every JSON file with sorted keys so repeated builds are byte-identical."""
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------ Qwen2-VL, Qwen3-VL

# The special tokens of every Qwen vision-language family (their ids differ from the real ones; the tiny configs
# take them from the tokenizer).
QWEN2_VL_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

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


def build_qwen2_bpe(out_dir: Path, chat_template: str, vocab_size: int = 3000, tokenizer_cls=None,
                    split_regex: str | None = None, special_tokens: list[str] | None = None,
                    named_tokens: dict[str, str] | None = None, **tokenizer_kwargs) -> None:
    """Qwen2 byte-level BPE (Qwen2's own split regex and NFC; Qwen3 tokenises alike), the Qwen vision-language
    special tokens and ``chat_template``; ``tokenizer_cls`` / ``split_regex`` replace Qwen2's (Qwen3.5),
    ``special_tokens`` the Qwen ones (the first is padding), ``named_tokens`` names some as the family's processor
    reads them (InternVL's ``context_image_token``, ...)."""
    from transformers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    special_tokens = special_tokens or QWEN2_VL_SPECIAL_TOKENS
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex or PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    vocab, merges = train_byte_level_bpe(special_tokens, vocab_size, pre_tokenizer, normalizers.NFC())
    tokenizer = (tokenizer_cls or Qwen2Tokenizer)(vocab=vocab, merges=merges, model_max_length=32768, errors="replace",
                                                  **({"extra_special_tokens": named_tokens} if named_tokens else {}),
                                                  **tokenizer_kwargs)
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True) for t in special_tokens[1:]]},
        replace_extra_special_tokens=not named_tokens,
    )
    tokenizer.chat_template = chat_template
    _save(tokenizer, out_dir)


def build_qwen2_vl(out_dir: Path) -> None:
    """The Qwen2 BPE with Qwen2-VL-Instruct's chat template."""
    build_qwen2_bpe(out_dir, QWEN2_VL_CHAT_TEMPLATE)


def build_qwen2_5_vl(out_dir: Path) -> None:
    """The Qwen2 BPE with Qwen2.5-VL-Instruct's chat template (Qwen2-VL-Instruct's, unchanged)."""
    build_qwen2_bpe(out_dir, QWEN2_VL_CHAT_TEMPLATE)


def build_qwen3_vl(out_dir: Path) -> None:
    """The Qwen2 BPE (Qwen3-VL keeps Qwen2's tokenizer) with Qwen3-VL-Instruct's chat template."""
    build_qwen2_bpe(out_dir, QWEN3_VL_CHAT_TEMPLATE)


# ----------------------------------------------------------------------------------------------------- Qwen3.5


def build_qwen3_5(out_dir: Path) -> None:
    """The same BPE on Qwen3.5's own tokenizer (``Qwen3_5Tokenizer``: its split regex keeps digits single), with
    Qwen3-VL's chat template: Qwen3.5's adds a thinking block only around reasoning content, which the training
    records here do not carry."""
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    build_qwen2_bpe(out_dir, QWEN3_VL_CHAT_TEMPLATE, tokenizer_cls=Qwen3_5Tokenizer, split_regex=PRETOKENIZE_REGEX)


# ---------------------------------------------------------------------------------------------------- InternVL


def build_internvl(out_dir: Path) -> None:
    """The Qwen2 BPE (InternVL 3 / 3.5 keep their Qwen2 / Qwen3 language model's tokenizer) with InternVL's image
    tokens, named as ``InternVLProcessor`` reads them, ``<|im_end|>`` as eos and the chat template of the
    transformers port (``recipes.internvl.tokens``)."""
    from recipes.internvl.tokens import IM_END_TOKEN, INTERNVL_CHAT_TEMPLATE, NAMED_TOKENS, SPECIAL_TOKENS

    build_qwen2_bpe(out_dir, INTERNVL_CHAT_TEMPLATE, special_tokens=SPECIAL_TOKENS, named_tokens=NAMED_TOKENS,
                    eos_token=IM_END_TOKEN)


# ------------------------------------------------------------------------------------------------------- LLaVA

# Llama's special tokens (unk/bos/eos at 0/1/2, as in Llama-2), a pad token and LLaVA's image placeholder; then the
# 256 byte-fallback tokens <0x00>..<0xFF> a SentencePiece-style Llama BPE falls back to for unseen characters.
LLAVA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
LLAVA_BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]

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


def build_llava(out_dir: Path, vocab_size: int = 3000) -> None:
    """Llama (SentencePiece-style) BPE: Metaspace pre-tokenizer, byte fallback, no normalizer, as
    ``LlamaTokenizer`` builds it; Llama special tokens, ``<pad>``, ``<image>`` and a LLaVA-1.5 chat template."""
    from transformers import AddedToken, LlamaTokenizer

    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    model = models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    vocab, merges = train_bpe(LLAVA_SPECIAL_TOKENS + LLAVA_BYTE_TOKENS, vocab_size, pre_tokenizer, model=model)
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges, pad_token="<pad>", add_prefix_space=True,
                               model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<image>", special=True, normalized=False)]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    _save(tokenizer, out_dir)


# ------------------------------------------------------------------------------------------------------ Gemma 3


def build_gemma3(out_dir: Path, vocab_size: int = 3000) -> None:
    """Gemma (SentencePiece-style) BPE with byte fallback: the words' ``▁`` pieces learned with a Metaspace split,
    loaded into ``GemmaTokenizer`` (spaces become ``▁``, no pre-split); Gemma's special, turn and image tokens and
    Gemma 3's chat template (``recipes.gemma.tokens``)."""
    from recipes.gemma.tokens import BYTE_TOKENS, GEMMA3_CHAT_TEMPLATE, SPECIAL_TOKENS, gemma_tokenizer

    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    model = models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    vocab, merges = train_bpe(SPECIAL_TOKENS + BYTE_TOKENS, vocab_size, pre_tokenizer, model=model)
    _save(gemma_tokenizer(vocab, merges, GEMMA3_CHAT_TEMPLATE), out_dir)


def build_gemma4(out_dir: Path, vocab_size: int = 3000) -> None:
    """Gemma 3's byte-fallback BPE (``build_gemma3``) with Gemma 4's turn and image tokens and chat template
    (``recipes.gemma4.tokens``)."""
    from recipes.gemma.tokens import gemma_tokenizer
    from recipes.gemma4.tokens import END_OF_TURN, GEMMA4_CHAT_TEMPLATE, IMAGE_TOKENS, START_OF_TURN, VOCAB_SEED

    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    model = models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    vocab, merges = train_bpe(VOCAB_SEED, vocab_size, pre_tokenizer, model=model)
    _save(gemma_tokenizer(vocab, merges, GEMMA4_CHAT_TEMPLATE, image_tokens=IMAGE_TOKENS,
                          turn_tokens=(START_OF_TURN, END_OF_TURN)), out_dir)


# ----------------------------------------------------------------------------------------------------- GLM-4.1V

# GLM-4's pre-tokenizer split (cl100k's, which GLM-4's tiktoken vocabulary was built with: digits in runs of 1-3)
GLM4_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_glm4v(out_dir: Path, vocab_size: int = 3000) -> None:
    """GLM-4's byte-level BPE (cl100k split, no normalizer) in a ``PreTrainedTokenizerFast`` as GLM-4.1V ships it,
    with GLM-4.1V's special tokens and chat template (``recipes.glm4v.tokens``), ``<|endoftext|>`` as padding."""
    from transformers import AddedToken, PreTrainedTokenizerFast

    from recipes.glm4v.tokens import GLM4V_CHAT_TEMPLATE, PAD_TOKEN, SPECIAL_TOKENS

    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    vocab, merges = train_byte_level_bpe(SPECIAL_TOKENS, vocab_size, pre_tokenizer)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=PAD_TOKEN,
                                        model_max_length=32768, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                                for t in SPECIAL_TOKENS[1:]]})
    tokenizer.chat_template = GLM4V_CHAT_TEMPLATE
    _save(tokenizer, out_dir)


def _save(tokenizer, out_dir: Path) -> None:
    """``save_pretrained`` into a scratch folder, canonicalise, then replace ``out_dir`` file by file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        _canonicalise_json(Path(tmp))
        for stale in out_dir.iterdir():
            if stale.is_file():
                stale.unlink()
        for path in sorted(Path(tmp).iterdir()):
            (out_dir / path.name).write_bytes(path.read_bytes())


BUILDERS: dict[str, Callable[[Path], None]] = {"qwen2_vl": build_qwen2_vl, "qwen2_5_vl": build_qwen2_5_vl,
                                                "llava": build_llava,
                                                "qwen3_5": build_qwen3_5, "qwen3_vl": build_qwen3_vl,
                                                "gemma3": build_gemma3, "gemma4": build_gemma4, "glm4v": build_glm4v,
                                                "internvl": build_internvl}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent folder; one sub-folder per tokenizer")
    parser.add_argument("--only", choices=sorted(BUILDERS), action="append", help="build only these (repeatable)")
    args = parser.parse_args(argv)
    for name in args.only or sorted(BUILDERS):
        BUILDERS[name](args.out / name)
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
