"""Model and processor builders for the GLM-4.1V recipe.

The default is a tiny, seeded, randomly initialised GLM-4.1V from YAML (``conf/model/glm4v_tiny.yaml``) with
vocabulary and special-token ids from the committed tokenizer asset (``assets/tokenizers/glm4v``);
``pretrained=<dir>`` loads a ``save_pretrained`` folder. Images: ``Glm4vImageProcessorPil`` (transformers'
torchvision-free backend); videos: :class:`~recipes.glm4v.video.Glm4vVideoProcessor` (numpy/PIL).

The model class is :class:`Glm4vMixedMediaForConditionalGeneration`: transformers 5.24's ``Glm4vModel`` finds the
placeholders of images *and* videos as ``input_ids == image_token_id`` (GLM writes video frames with the image
placeholder), so a batch holding an image and a clip (any pack that mixes them) fails its feature count check, or,
were the counts to agree, would scatter image features into video tokens. Here the video placeholders carry
``config.video_token_id`` in the model's ``input_ids`` (``packed.model_input_ids`` maps them from
``mm_token_type_ids``); the embedding of a placeholder is replaced by its feature either way, so nothing else
changes, and the checkpoint's weights, config and names are GLM-4.1V's.

GLM-4.5V (``recipes/glm4v_moe``) is built from the same parts: :class:`MixedMediaPlaceholders` is the fix as a mixin
for either model class, and :func:`tiny_config` / :func:`build_glm_model` take the config and model class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from transformers import Glm4vConfig, Glm4vForConditionalGeneration, PreTrainedTokenizerBase
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm4v.modeling_glm4v import Glm4vModel, Glm4vPreTrainedModel

from mvp_engine.engine import flops
from mvp_engine.engine.builders import (
    ProcessorBundle,
    build_hf_model,
    build_processor_bundle,
    grid_video_processor,
    to_plain,
)
from mvp_engine.engine.grid_vision import grid_cost_profile, grid_dummy_media
from mvp_engine.packing import FLASH_BACKENDS, sub_model_attention

from .tokens import BEGIN_IMAGE, BEGIN_VIDEO, END_IMAGE, END_VIDEO, IMAGE_TOKEN, PAD_TOKEN, VIDEO_TOKEN
from .video import Glm4vVideoProcessor

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER_DIR = REPO_ROOT / "assets" / "tokenizers" / "glm4v"
# the config.json model_type of a model.pretrained folder this recipe trains (Recipe.model_types)
MODEL_TYPES = (Glm4vConfig.model_type,)
VIDEO_SETTINGS = ("min_pixels", "max_pixels", "fps", "max_duration")  # model.video_<key>
# model.visual is the (Qwen2-VL-style grid-patch) tower, its merger the projector
VISION_PARTS = flops.VisionParts(tower=("visual",), projector=("merger",))


@dataclass
class Glm4vProcessorBundle(ProcessorBundle):
    """Tokenizer + ``Glm4vImageProcessorPil`` + :class:`Glm4vVideoProcessor`; the image placeholder
    ``<|image|>`` (video frames use it too)."""

    image_token: str = IMAGE_TOKEN
    video_processor: Glm4vVideoProcessor = field(default_factory=Glm4vVideoProcessor)


def build_processor(model_cfg: Mapping | None = None, tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR
                    ) -> Glm4vProcessorBundle:
    """Tokenizer, image and video processors: from ``model_cfg.pretrained`` if set (its saved preprocessor configs
    win), else the tokenizer asset and the tiny settings. Keys read: ``pretrained``, ``tokenizer_dir``,
    ``image_min_pixels`` / ``image_max_pixels`` (GLM counts an image as two frames: 2 x height x width),
    ``video_min_pixels`` / ``video_max_pixels`` (the whole clip), ``video_fps``, ``video_max_duration``. The video
    processor's patch sizes, mean and std are the image processor's."""
    cfg = to_plain(model_cfg) or {}
    size = {"shortest_edge": int(cfg.get("image_min_pixels") or 112 * 112),
            "longest_edge": int(cfg.get("image_max_pixels") or 28 * 28 * 15000)}
    bundle = build_processor_bundle(Glm4vProcessorBundle, cfg, Glm4vImageProcessorPil, tokenizer_dir, size=size)
    return replace(bundle, video_processor=grid_video_processor(cfg, Glm4vVideoProcessor(), bundle.image_processor,
                                                                VIDEO_SETTINGS))


class MixedMediaPlaceholders:
    """Mixed into a GLM-4.1V-style model (``Glm4vModel``, GLM-4.5V's ``Glm4vMoeModel``): video placeholders are
    ``config.video_token_id`` in ``input_ids`` (module docstring), each kind's count checked against its features."""

    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
        if input_ids is None:
            return super().get_placeholder_mask(input_ids, inputs_embeds, image_features, video_features)
        masks = []
        for kind, token_id, features in (("image", self.config.image_token_id, image_features),
                                         ("video", self.config.video_token_id, video_features)):
            mask = input_ids == token_id
            if features is not None and int(mask.sum()) * inputs_embeds.shape[-1] != features.numel():
                raise ValueError(f"{kind} features and {kind} tokens do not match: {int(mask.sum())} tokens, "
                                 f"{features.shape[0]} features")
            masks.append(mask.unsqueeze(-1).to(inputs_embeds.device))
        return tuple(masks)


class Glm4vMixedMediaModel(MixedMediaPlaceholders, Glm4vModel):
    """``Glm4vModel`` whose video placeholders are ``config.video_token_id`` in ``input_ids``."""


class Glm4vMixedMediaForConditionalGeneration(Glm4vForConditionalGeneration):
    """``Glm4vForConditionalGeneration`` on :class:`Glm4vMixedMediaModel`: the same weights and config."""

    def __init__(self, config: Glm4vConfig):
        Glm4vPreTrainedModel.__init__(self, config)
        self.model = Glm4vMixedMediaModel(config)
        self.lm_head = torch.nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()


def tiny_config(model_cfg: Mapping, tokenizer: PreTrainedTokenizerBase, config_cls=Glm4vConfig):
    """``config_cls`` (GLM-4.1V's or GLM-4.5V's config) from ``model_cfg.config`` (text_config / vision_config
    dicts, top-level fields), with the vocabulary size and every special-token id from the tokenizer, the vision
    tower's output width the text width."""
    raw = dict((to_plain(model_cfg) or {}).get("config") or {})
    text = dict(raw.pop("text_config", None) or {})
    vision = dict(raw.pop("vision_config", None) or {})

    def tid(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))

    text.update(vocab_size=len(tokenizer), pad_token_id=tid(PAD_TOKEN))
    vision.setdefault("out_hidden_size", text.get("hidden_size"))
    return config_cls(text_config=text, vision_config=vision, image_token_id=tid(IMAGE_TOKEN),
                       video_token_id=tid(VIDEO_TOKEN), image_start_token_id=tid(BEGIN_IMAGE),
                       image_end_token_id=tid(END_IMAGE), video_start_token_id=tid(BEGIN_VIDEO),
                       video_end_token_id=tid(END_VIDEO), **raw)


def build_glm_model(model_cls, config_cls, model_cfg: Mapping | None, attn_implementation: str = "sdpa",
                    tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR):
    """``model_cls`` from ``model_cfg.pretrained`` or a tiny seeded init of :func:`tiny_config` (``config_cls``).
    Keys read: ``pretrained``, ``tokenizer_dir``, ``config``, ``seed``, ``dtype``. The vision tower keeps flash (it
    passes its own cu_seqlens)."""
    attention = sub_model_attention(attn_implementation, vision_shares=("eager", "sdpa", *FLASH_BACKENDS))
    return build_hf_model(model_cls, model_cfg, attention, partial(tiny_config, config_cls=config_cls),
                          tokenizer_dir)


def build_model(model_cfg: Mapping | None, attn_implementation: str = "sdpa",
                tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR):
    """:class:`Glm4vMixedMediaForConditionalGeneration` (:func:`build_glm_model`)."""
    return build_glm_model(Glm4vMixedMediaForConditionalGeneration, Glm4vConfig, model_cfg, attn_implementation,
                           tokenizer_dir)


dummy_media = grid_dummy_media  # one merged token of zero pixels: the vision tower's layout is Qwen2-VL's
cost_profile = partial(grid_cost_profile, parts=VISION_PARTS)
