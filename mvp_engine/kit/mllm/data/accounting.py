"""Token accounting: what a batch or an epoch really contained, so throughput and padding claims are honest."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from .sample import IGNORE_INDEX


@dataclass
class TokenAccounting:
    """Counts that add up across batches, ranks and epochs.

    ``slots`` = rows x padded length; ``effective`` = tokens of real samples; ``supervised`` = tokens with a
    label; ``attention_work`` = sum of squared segment lengths (what block-causal attention computes) against
    ``dense_attention_work`` = rows x padded length squared (what one unmasked attention per row would).
    ``model_flops`` / ``executed_flops``: forward + backward FLOPs the step needed / the kernels ran (``cost.py``);
    a batch alone cannot tell them (they need the model's cost profile), so the trainer fills them in.
    """

    slots: int = 0
    effective: int = 0
    supervised: int = 0
    media_tokens: int = 0
    samples: int = 0
    packs: int = 0
    batches: int = 0
    attention_work: int = 0
    dense_attention_work: int = 0
    model_flops: int = 0
    executed_flops: int = 0
    dropped: Counter = field(default_factory=Counter)

    @classmethod
    def from_batch(cls, batch: dict) -> TokenAccounting:
        segments = batch["pack_segment_ids"]
        rows, width = segments.shape
        real = segments >= 0
        cu = batch["cu_seqlens"].long()
        seg_lengths = cu[1:] - cu[:-1]
        # segments that start on a real token are samples; padding runs start on segment id -1
        starts_real = real.reshape(-1)[cu[:-1]]
        return cls(
            slots=rows * width,
            effective=int(real.sum()),
            supervised=int((batch["labels"] != IGNORE_INDEX).sum()),
            media_tokens=int(batch["media_tokens"].sum()),
            samples=int(batch["source_sample_num"].sum()),
            packs=int((batch["source_sample_num"] > 0).sum()),
            batches=1,
            attention_work=int((seg_lengths[starts_real] ** 2).sum()),
            dense_attention_work=rows * width * width,
        )

    def __add__(self, other: TokenAccounting) -> TokenAccounting:
        merged = {name: getattr(self, name) + getattr(other, name) for name in self._counts()}
        return TokenAccounting(**merged, dropped=self.dropped + other.dropped)

    @staticmethod
    def _counts() -> tuple[str, ...]:
        return ("slots", "effective", "supervised", "media_tokens", "samples", "packs", "batches",
                "attention_work", "dense_attention_work", "model_flops", "executed_flops")

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.effective / self.slots if self.slots else 0.0

    @property
    def attention_work_ratio(self) -> float:
        return self.attention_work / self.dense_attention_work if self.dense_attention_work else 0.0

    def as_tensor(self) -> torch.Tensor:
        """The additive counts as one tensor, for summing across ranks in a single all-reduce."""
        return torch.tensor([getattr(self, name) for name in self._counts()], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor, dropped: Counter | None = None) -> TokenAccounting:
        return cls(**{name: int(v) for name, v in zip(cls._counts(), values.tolist())}, dropped=dropped or Counter())

    def to_dict(self) -> dict:
        out = asdict(self)
        out["dropped"] = dict(self.dropped)
        out["dropped_total"] = sum(self.dropped.values())
        out["padding_ratio"] = self.padding_ratio
        out["attention_work_ratio"] = self.attention_work_ratio
        return out


@dataclass
class RecordLedger:
    """Where every record read in one epoch went, so the totals reconcile: ``records_read == samples_trained +
    dropped + bad``. ``samples_trained`` is counted from the batches actually trained (``source_sample_num``), never
    computed by subtraction; ``truncated`` counts trained samples cut to fit (they are trained, and counted once)."""

    epoch: int
    records_read: int
    samples_trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    bad: Counter = field(default_factory=Counter)
    truncated: int = 0

    @property
    def reconciles(self) -> bool:
        return self.records_read == self.samples_trained + sum(self.dropped.values()) + sum(self.bad.values())

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "records_read": self.records_read, "samples_trained": self.samples_trained,
                "dropped": dict(self.dropped), "bad": dict(self.bad), "truncated": self.truncated,
                "reconciles": self.reconciles}

    @classmethod
    def from_dict(cls, values: dict) -> RecordLedger:
        return cls(values["epoch"], values["records_read"], values["samples_trained"], Counter(values["dropped"]),
                   Counter(values["bad"]), values["truncated"])


@dataclass
class SourceTally:
    """One source's share of a run (``summary.json["sources"][name]``): ``records`` drawn by its epochs (a record
    drawn twice counts twice), ``samples`` trained and their ``effective_tokens`` / ``supervised_tokens``, and the
    draws ``dropped`` and ``bad`` by reason. Summed over sources these are the run's totals."""

    records: int = 0
    samples: int = 0
    effective_tokens: int = 0
    supervised_tokens: int = 0
    dropped: Counter = field(default_factory=Counter)
    bad: Counter = field(default_factory=Counter)

    TRAINED = ("samples", "effective_tokens", "supervised_tokens")  # the per-step counts (``source_counts`` rows)

    def add_trained(self, row: list[int]) -> None:
        for name, value in zip(self.TRAINED, row, strict=True):
            setattr(self, name, getattr(self, name) + int(value))

    def add_planned(self, other: SourceTally) -> None:
        """An epoch's draw: its records, drops and bad records found before training."""
        self.records += other.records
        self.dropped.update(other.dropped)
        self.bad.update(other.bad)

    def to_dict(self) -> dict:
        return {"records": self.records, "samples": self.samples, "effective_tokens": self.effective_tokens,
                "supervised_tokens": self.supervised_tokens, "dropped": dict(self.dropped), "bad": dict(self.bad)}

    @classmethod
    def from_dict(cls, values: dict) -> SourceTally:
        return cls(values["records"], values["samples"], values["effective_tokens"], values["supervised_tokens"],
                   Counter(values["dropped"]), Counter(values["bad"]))


def token_shares(tallies: dict[str, SourceTally]) -> dict[str, float]:
    """Each source's fraction of the effective tokens trained so far (``metrics.jsonl``'s ``source_token_shares``)."""
    total = sum(t.effective_tokens for t in tallies.values())
    return {name: t.effective_tokens / total if total else 0.0 for name, t in tallies.items()}
