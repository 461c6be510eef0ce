"""Preference pairs as packing items: one prompt (system, media, earlier turns) and two answers, encoded as ONE
sample whose prefix is laid out once and followed by the chosen and the rejected continuation.

Why one sample: the planner, the packs, the collator, the rank split and the step estimate then treat a pair as
one item without knowing about pairs, and the prompt's image is encoded (and run through the vision tower) once.

Layout of a pair sample (``shared_prefix=True``)::

    tokens   [ prefix (p) | chosen continuation | rejected continuation ]
    branch     0 ... 0      1 ... 1               2 ... 2             (``BRANCH_FIELD``, a token field)
    position   0 .. p-1     p .. p+c-1            p .. p+r-1          (both continue from the prefix)

``p`` is one token short of the final answer's first supervised token, so each continuation starts with a shared,
unsupervised token (the last token of the assistant header): every supervised token is then predicted by a
position of its own continuation, the row's plain next-token shift never pairs a prefix position with a
continuation's target, and the first target after a branch change is unsupervised. Attention (``branch`` beside
the segment id in the mask predicates, ``mvp_engine.packing.masks.same_branch_or_prefix``): a continuation sees the
prefix and itself causally, never the other continuation.

``shared_prefix=False`` lays both conversations out whole, the media twice (``MLLMSample.parts``: a pack gives each
its own segment, branch 1 and branch 2 throughout): the duplicated prefix, for models and backends that cannot keep
two continuations of one segment apart (a recurrent state, a position-indexed sliding window, flash's one causal span
per segment; ``sdpa_varlen`` shares the prefix on the CPU, ``mvp_engine.packing.prefix_attention``) and the baseline
the shared layout is measured against. The planner still sees one item of the two lengths summed.

Labels: only the final answer of each conversation is supervised (earlier assistant turns belong to the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .sample import IGNORE_INDEX, MLLMRecord, MLLMSample, SampleMeta, first_supervised_index
from .sources import MLLMRecordError
from .store import digest

BRANCH_FIELD = "pair_branch_ids"
PREFIX, CHOSEN, REJECTED = 0, 1, 2

# bad-pair reasons (counted like bad records)
MISSING_ANSWER = "missing_answer"
IDENTICAL_ANSWERS = "identical_answers"
MEDIA_IN_ANSWER = "media_in_answer"
PREFIX_MISMATCH = "prefix_mismatch"


@dataclass
class PreferenceRecord(MLLMRecord):
    """A pair read from a source: ``messages`` is the prompt followed by the chosen answer (so every reader of a
    record, media paths included, sees one conversation), ``rejected`` the same prompt followed by the rejected
    answer."""

    rejected: list[dict] = field(default_factory=list)

    def conversations(self) -> tuple[MLLMRecord, MLLMRecord]:
        """The chosen and the rejected conversation as plain records."""
        return (MLLMRecord(self.record_id, self.origin, self.messages),
                MLLMRecord(self.record_id, self.origin, self.rejected))


def branch_positions(branch_ids: torch.Tensor) -> torch.Tensor:
    """Positions of one sample (1-D ``branch_ids``): 0, 1, ... along the sample, the rejected continuation's
    restarted where the chosen one's began (both continue from the prefix)."""
    positions = torch.arange(branch_ids.numel())
    return positions - (branch_ids == REJECTED).long() * int((branch_ids == CHOSEN).sum())


def final_answer_start(labels: torch.Tensor) -> int:
    """Index of the first token of the last supervised run (the final answer); -1 when nothing is supervised."""
    supervised = labels != IGNORE_INDEX
    if not bool(supervised.any()):
        return -1
    last = int(supervised.nonzero()[-1])
    gaps = (~supervised[:last]).nonzero()
    return int(gaps[-1]) + 1 if gaps.numel() else 0


def _part(sample: MLLMSample, labels: torch.Tensor, branch: int) -> MLLMSample:
    """One conversation of a duplicated-prefix pair: ``sample`` with its answer-only ``labels``, all of it
    ``branch``."""
    return MLLMSample(input_ids=sample.input_ids, labels=labels, sample_id=sample.sample_id, media=sample.media,
                      num_media=sample.num_media, media_tokens=sample.media_tokens, media_end=sample.media_end,
                      media_sq=sample.media_sq, media_kinds=sample.media_kinds,
                      token_fields={**sample.token_fields, BRANCH_FIELD: torch.full((sample.length,), branch)})


def _bad(record: MLLMRecord, what: str, reason: str) -> MLLMRecordError:
    return MLLMRecordError(f"{record.origin}: pair {record.record_id!r}: {what}", reason, record_id=record.record_id)


def _answer_labels(labels: torch.Tensor, start: int) -> torch.Tensor:
    out = labels.clone()
    out[:start] = IGNORE_INDEX
    return out


@dataclass(frozen=True)
class _Split:
    prefix: int  # p
    chosen: tuple[torch.Tensor, torch.Tensor]  # ids, labels of the whole chosen conversation (answer-only labels)
    rejected: tuple[torch.Tensor, torch.Tensor]


class PairEncoder:
    """``MLLMSampleEncoder`` over :class:`PreferenceRecord`: a recipe's chat-template encoder (anything with
    ``encode`` and ``layout``) run on both conversations, joined into one pair sample (module docstring). Every
    other attribute is the wrapped encoder's, so the engine reads media kinds and placeholders as before.

    Bad pairs are bad records: no supervised answer (``missing_answer``), the same tokens twice
    (``identical_answers``), media inside an answer (``media_in_answer``: the prefix holds them all) and prompts that
    tokenize differently (``prefix_mismatch``)."""

    def __init__(self, encoder: Any, shared_prefix: bool = True):
        if not callable(getattr(encoder, "layout", None)):
            raise TypeError(f"{type(encoder).__name__} has no layout(record) (ids and labels without pixels): "
                            "preference pairs need a ChatTemplateEncoder")
        self.encoder = encoder
        self.shared_prefix = shared_prefix

    def __getattr__(self, name: str):
        if name == "encoder":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.encoder, name)

    def fingerprint(self) -> str:
        return digest({"pair": self.encoder.fingerprint(), "shared_prefix": self.shared_prefix, "version": 1})

    # ------------------------------------------------------------------------------------------------- layout

    def _split(self, record: PreferenceRecord, chosen: tuple, rejected: tuple, media_end: int) -> _Split:
        starts = [final_answer_start(labels) for _, labels in (chosen, rejected)]
        if min(starts) < 1:
            raise _bad(record, "an answer has no supervised token", MISSING_ANSWER)
        (ids_c, labels_c), (ids_r, labels_r) = chosen, rejected
        labels_c, labels_r = _answer_labels(labels_c, starts[0]), _answer_labels(labels_r, starts[1])
        if torch.equal(ids_c, ids_r):
            raise _bad(record, "chosen and rejected answers are the same tokens", IDENTICAL_ANSWERS)
        prefix = min(starts) - 1 if self.shared_prefix else 0
        if self.shared_prefix and not torch.equal(ids_c[:prefix + 1], ids_r[:prefix + 1]):
            raise _bad(record, "the two conversations differ before the final answer (the prompt must be the same)",
                      PREFIX_MISMATCH)
        if self.shared_prefix and media_end > prefix:
            raise _bad(record, "an answer holds media; a pair's media belong to its prompt", MEDIA_IN_ANSWER)
        return _Split(prefix, (ids_c, labels_c), (ids_r, labels_r))

    @staticmethod
    def _join(split: _Split) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = split.prefix
        (ids_c, labels_c), (ids_r, labels_r) = split.chosen, split.rejected
        ids = torch.cat([ids_c, ids_r[p:]])
        labels = torch.cat([labels_c, labels_r[p:]])
        labels[:p] = IGNORE_INDEX
        branches = torch.cat([torch.full((p,), PREFIX), torch.full((len(ids_c) - p,), CHOSEN),
                              torch.full((len(ids_r) - p,), REJECTED)])
        return ids, labels, branches

    # ------------------------------------------------------------------------------------------------- public

    def measure(self, record: PreferenceRecord) -> SampleMeta:
        chosen_record, rejected_record = record.conversations()
        chosen_meta = self.encoder.measure(chosen_record)
        split = self._split(record, self.encoder.layout(chosen_record), self.encoder.layout(rejected_record),
                            chosen_meta.media_end)
        ids, labels, _ = self._join(split)
        copies = 1 if self.shared_prefix else 2
        # media_end = the whole pair: a pair is never truncated (a cut would drop the rejected continuation), so an
        # overlong pair is dropped at plan time
        return SampleMeta(length=int(ids.numel()), num_media=chosen_meta.num_media * copies, media_end=int(ids.numel()),
                          first_supervised=first_supervised_index(labels),
                          media_tokens=chosen_meta.media_tokens * copies, media_sq=chosen_meta.media_sq * copies)

    def encode(self, record: PreferenceRecord) -> MLLMSample:
        chosen_record, rejected_record = record.conversations()
        chosen = self.encoder.encode(chosen_record)
        rejected = self.encoder.encode(rejected_record) if not self.shared_prefix else None
        rejected_layout = (rejected.input_ids, rejected.labels) if rejected is not None \
            else self.encoder.layout(rejected_record)
        split = self._split(record, (chosen.input_ids, chosen.labels), rejected_layout, chosen.media_end)
        ids, labels, branches = self._join(split)
        p = split.prefix
        token_fields = {BRANCH_FIELD: branches}
        for name, values in chosen.token_fields.items():
            other = rejected.token_fields[name] if rejected is not None else self._rejected_types(name, split)
            token_fields[name] = torch.cat([values, other[p:]])
        media, num_media, media_tokens, media_sq = chosen.media, chosen.num_media, chosen.media_tokens, chosen.media_sq
        parts: tuple[MLLMSample, ...] = ()
        if rejected is not None:  # the duplicated prefix: both conversations, each a segment of its own
            media = {key: torch.cat([value, rejected.media[key]]) for key, value in media.items()}
            num_media, media_tokens, media_sq = 2 * num_media, 2 * media_tokens, 2 * media_sq
            parts = tuple(_part(conversation, answer_labels, branch) for conversation, (_, answer_labels), branch
                          in ((chosen, split.chosen, CHOSEN), (rejected, split.rejected, REJECTED)))
        return MLLMSample(input_ids=ids, labels=labels, sample_id=record.record_id, media=media, num_media=num_media,
                          media_tokens=media_tokens, media_end=int(ids.numel()), media_sq=media_sq,
                          token_fields=token_fields, media_kinds=chosen.media_kinds, parts=parts)

    def _rejected_types(self, name: str, split: _Split) -> torch.Tensor:
        """A token field of the rejected conversation (text-only past the prefix: its modality map)."""
        return self.encoder.placeholder_types(split.rejected[0])

    def unpaired(self, record: PreferenceRecord) -> tuple[MLLMSample, MLLMSample]:
        """The chosen and the rejected conversation as two plain samples, labels on the final answers only: the
        pair-by-pair reference a packed pair must compute exactly."""
        out = []
        for conversation in record.conversations():
            sample = self.encoder.encode(conversation)
            start = final_answer_start(sample.labels)
            if start < 1:
                raise _bad(record, "an answer has no supervised token", MISSING_ANSWER)
            sample.labels = _answer_labels(sample.labels, start)
            out.append(sample)
        return out[0], out[1]

