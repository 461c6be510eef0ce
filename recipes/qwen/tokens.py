"""The Qwen vision-language families' special tokens (Qwen2-VL, Qwen3-VL, Qwen3.5 share them): placeholders inside
``<|vision_start|>...<|vision_end|>``, ChatML turns, ``<|endoftext|>`` as padding and bos, ``<|im_end|>`` as eos."""

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
