"""The stream mode (``data.streaming=true``): packs from sources read in order, for data that cannot be indexed first.

Records come from per-source cursors (``stream_sources.py``; several sources interleave by a seeded draw weighted
by their ``repeat``), are measured one at a time as they arrive, go through a seeded shuffle buffer of
``packing.buffer_size`` samples and are packed by the greedy strategy's own first-fit packer
(``assembler.FirstFitPacks``, ``packing.max_open_packs`` open packs). A source that ends starts over (its next
pass), so a stream never runs dry: the run's length is ``train.max_steps``, exact by construction.

Why resuming is exact on any world size: the packs form one global sequence that every rank computes alike (each
reads and measures every record; it encodes only its own packs), and optimizer step ``s`` trains its packs
``[s x G, (s + 1) x G)`` for a global batch of ``G`` packs, dealt to ranks as the indexed path deals them (pack
``k`` to rank ``k mod world_size``). The state at a step boundary (:meth:`StreamPlanner.state_dict`) is therefore
the same on every rank and under every split of the same global batch: the cursors, the RNG states, and the keys
``(source, pass, unit, row)`` of every record held (the shuffle buffer, the open packs, the packs made but not yet
served) with their measured lengths -- never a tensor. A resume reads the held records again from their keys.

What is not exact here as it is on indexed data: there is no step estimate (``train.max_steps`` instead), no
compute balance over an epoch (``packing.balance`` is refused), and the shuffle is a buffer's, not an epoch's.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .accounting import RecordLedger, SourceTally
from .assembler import DROP_REASONS, FirstFitPacks, MLLMPackingAssembler, OverlongSampleError
from .bad_records import BadRecord, BadRecordReport
from .dataset import encode_samples
from .media import MLLMMediaHandler
from .mixture import MLLMSource
from .sample import MLLMRecord, MLLMSampleEncoder
from .sources import MLLMRecordError
from .spec import MLLMDataSpec, MLLMPackingSpec
from .stream_sources import RecordStream, open_streams

STATE_FORMAT = 1
Key = tuple[int, int, int, int]  # source, pass, unit, row
Entry = tuple[Key, int, int, int]  # key, measured length, packed length, media items


def stream_packing_problem(packing: MLLMPackingSpec | None) -> str | None:
    """Why ``packing`` cannot pack a stream (one line naming the key), or None."""
    if packing is None or packing.assembler_cls is not None or packing.strategy != "greedy":
        return ("data.streaming=true packs greedily from its shuffle buffer: use +packing=greedy (no "
                "packing.assembler_cls)")
    if packing.balance != "none":
        return (f"packing.balance={packing.balance!r} balances an epoch's planned packs; a stream has no epoch plan: "
                "use packing.balance=none with data.streaming=true")
    return None


class StreamPlanner:
    """The global pack sequence of a stream and its checkpointable state (see the module docstring)."""

    def __init__(self, streams: list[RecordStream], weights: list[float], encoder: MLLMSampleEncoder,
                 spec: MLLMPackingSpec, seed: int):
        if len(weights) != len(streams) or not any(w > 0 for w in weights):
            raise ValueError("data.sources: a stream needs at least one source with a repeat (weight) above 0")
        self.streams, self.encoder, self.spec = streams, encoder, spec
        self.assembler = MLLMPackingAssembler(spec)
        weights = np.asarray(weights, dtype=np.float64)
        self.cumulative = np.cumsum(weights / weights.sum())
        self.only = int(np.flatnonzero(weights)[0]) if np.count_nonzero(weights) == 1 else None
        self.packs = 0  # global packs served
        self.cursors = [[0, 0, 0] for _ in streams]  # (pass, unit, row) of each source's next record
        self.mix_rng = np.random.default_rng([seed, 0x5EED, 1])
        self.shuffle_rng = np.random.default_rng([seed, 0x5EED, 2])
        self.buffer: list[Entry] = []
        self.packer = FirstFitPacks(spec)
        self.ready: deque[tuple[list[Entry], list[dict]]] = deque()
        self.pending_bad: list[dict] = []  # found since the last pack was made: they travel with the next one
        self.read = [0] * len(streams)
        self.admitted_pass = [-1] * len(streams)  # the last pass of each source that admitted a record
        self.dropped: list[Counter] = [Counter() for _ in streams]
        self.truncated = 0
        self.records: dict[Key, MLLMRecord] = {}  # the held records themselves (read again on a resume)
        self._readers: dict[int, Iterator] = {}

    # --- reading -------------------------------------------------------------------------------------------------

    def _read_from(self, source: int, position: tuple[int, int, int]) -> Iterator[tuple[Key, object]]:
        """Every row of ``source`` from ``position`` on, pass after pass."""
        stream = self.streams[source]
        passes, unit, row = position
        while True:
            found = False
            for u in range(unit, stream.num_units):
                for r, item in stream.rows(u, row if u == unit else 0):
                    found = True
                    yield (source, passes, u, r), item
            if not found and unit == 0 and row == 0:
                raise ValueError(f"data.sources: {stream.name} has no record to stream")
            passes, unit, row = passes + 1, 0, 0

    def _next_row(self, source: int) -> tuple[Key, object]:
        if source not in self._readers:
            self._readers[source] = self._read_from(source, tuple(self.cursors[source]))
        key, item = next(self._readers[source])
        self.cursors[source] = [key[1], key[2], key[3] + 1]
        return key, item

    def _choose_source(self) -> int:
        if self.only is not None:  # one source: no draw, so its packs do not depend on the mixing RNG
            return self.only
        return int(np.searchsorted(self.cumulative, self.mix_rng.random(), side="right").clip(0, len(self.streams) - 1))

    def _bad(self, err: MLLMRecordError, stage: str, source: int) -> None:
        self.pending_bad.append({**BadRecord.from_error(err, stage).to_dict(), "source": source})

    def _pull(self) -> None:
        """Read, measure and admit one record; an admitted one enters the shuffle buffer (the one it displaces goes
        to the packer)."""
        source = self._choose_source()
        key, item = self._next_row(source)
        self.read[source] += 1
        if key[1] > self.admitted_pass[source] + 1:
            raise MLLMRecordError(f"{self.streams[source].name}: a whole pass of the stream admitted no record (each "
                                  "one bad, overlong or dropped), so it would be read again without end",
                                  "invalid_source")
        if isinstance(item, MLLMRecordError):
            self._bad(item, "read", source)
            return
        try:
            meta = self.encoder.measure(item)
        except MLLMRecordError as err:
            self._bad(err, "measure", source)
            return
        try:
            admission = self.assembler.admit([meta.length], [meta.num_media], [meta.media_end],
                                             [meta.first_supervised])
        except OverlongSampleError as err:
            self._bad(MLLMRecordError(f"{item.origin}: record {item.record_id!r} has {err.length} tokens > "
                                      f"max_seq_len={self.spec.max_seq_len} (overlong=error)", "overlong",
                                      record_id=item.record_id), "measure", source)
            return
        if not admission.admitted_mask[0]:
            self.dropped[source][DROP_REASONS[admission.codes[0]]] += 1
            return
        self.truncated += int(admission.truncated_mask[0])
        self.admitted_pass[source] = key[1]
        entry = (key, meta.length, int(admission.lengths[0]), meta.num_media)
        self.records[key] = item
        if len(self.buffer) < self.spec.buffer_size:
            self.buffer.append(entry)
            return
        slot = int(self.shuffle_rng.integers(len(self.buffer)))
        entry, self.buffer[slot] = self.buffer[slot], entry
        done: list[list[Entry]] = []
        self.packer.add(entry, entry[2], entry[3], done)
        for pack in done:
            self.ready.append((pack, self.pending_bad))
            self.pending_bad = []

    def next_pack(self) -> tuple[list[Entry], list[dict]]:
        """The next global pack (its members) and the bad records found since the previous pack."""
        while not self.ready:
            self._pull()
        self.packs += 1
        return self.ready.popleft()

    # --- state ---------------------------------------------------------------------------------------------------

    def held(self) -> list[Entry]:
        return [*self.buffer, *(e for pack in self.packer.open_items for e in pack),
                *(e for pack, _ in self.ready for e in pack)]

    def state_dict(self) -> dict:
        """JSON-able: cursors, RNG states, the held records' keys and lengths, counts; no record, no tensor."""
        packer = self.packer
        return {"format": STATE_FORMAT, "packs": self.packs, "cursors": [list(c) for c in self.cursors],
                "mix_rng": self.mix_rng.bit_generator.state, "shuffle_rng": self.shuffle_rng.bit_generator.state,
                "buffer": [_plain(e) for e in self.buffer],
                "open": [[_plain(e) for e in pack] for pack in packer.open_items],
                "open_rem": list(packer.open_rem), "open_media": list(packer.open_media),
                "ready": [[[_plain(e) for e in pack], bad] for pack, bad in self.ready],
                "pending_bad": list(self.pending_bad), "read": list(self.read),
                "admitted_pass": list(self.admitted_pass),
                "dropped": [dict(c) for c in self.dropped], "truncated": self.truncated}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the held records are read again from their keys (a sequential source from the
        oldest held position on)."""
        if state.get("format") != STATE_FORMAT or len(state["cursors"]) != len(self.streams):
            raise ValueError(f"stream state of format {state.get('format')} over {len(state['cursors'])} sources does "
                             f"not fit this stream ({len(self.streams)} sources, format {STATE_FORMAT})")
        self.packs = int(state["packs"])
        self.cursors = [list(c) for c in state["cursors"]]
        self.mix_rng.bit_generator.state = state["mix_rng"]
        self.shuffle_rng.bit_generator.state = state["shuffle_rng"]
        self.buffer = [_entry(e) for e in state["buffer"]]
        self.packer = FirstFitPacks(self.spec, [[_entry(e) for e in pack] for pack in state["open"]],
                                    state["open_rem"], state["open_media"])
        self.ready = deque(([_entry(e) for e in pack], bad) for pack, bad in state["ready"])
        self.pending_bad = list(state["pending_bad"])
        self.read = list(state["read"])
        self.admitted_pass = list(state["admitted_pass"])
        self.dropped = [Counter(c) for c in state["dropped"]]
        self.truncated = int(state["truncated"])
        self._readers = {}
        self.records = self._read_held({e[0] for e in self.held()})

    def _read_held(self, keys: set[Key]) -> dict[Key, MLLMRecord]:
        records: dict[Key, MLLMRecord] = {}
        for source in sorted({key[0] for key in keys}):
            wanted = {key for key in keys if key[0] == source}
            cursor = tuple(self.cursors[source])
            for key, item in self._read_from(source, min(key[1:] for key in wanted)):
                if key[1:] >= cursor:
                    break
                if key in wanted:
                    records[key] = item
        missing = keys - records.keys()
        if missing:
            source, passes, unit, row = min(missing)
            raise ValueError(f"stream state: {self.streams[source].name} no longer holds the buffered record at "
                             f"pass {passes}, unit {unit}, row {row}: the source changed since the checkpoint")
        return records


def _plain(entry: Entry) -> list:
    key, measured, packed, media = entry
    return [list(key), measured, packed, media]


def _entry(value: list) -> Entry:
    key, measured, packed, media = value
    return tuple(key), int(measured), int(packed), int(media)


class MLLMStreamDataset(IterableDataset):
    """Rank ``rank``'s packs of a stream, ``max_steps`` optimizer steps of ``world_size x micro_batch_size x
    gradient_accumulation_steps`` packs; resumable on any split of that global batch through ``state_dict`` /
    ``load_state_dict`` (the planner's state at a step boundary). Each served pack that ends one of this rank's
    steps carries ``data_state``, the state after that step, for the trainer's checkpoint (DataLoader workers
    keep their own copies of the dataset, so the state travels with the batches as decoding faults do)."""

    def __init__(self, data_spec: MLLMDataSpec, encoder: MLLMSampleEncoder, max_steps: int, rank: int = 0,
                 world_size: int = 1, micro_batch_size: int = 1, gradient_accumulation_steps: int = 1,
                 streams: list[RecordStream] | None = None, media_handler: MLLMMediaHandler | None = None,
                 bad_records: BadRecordReport | None = None):
        problem = stream_packing_problem(data_spec.packing)
        if problem:
            raise ValueError(problem)
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"train.max_steps={max_steps!r}: a stream needs the run's length in optimizer steps")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
        self.data_spec, self.encoder, self.max_steps = data_spec, encoder, max_steps
        self.rank, self.world_size = rank, world_size
        self.micro_batch_size, self.gradient_accumulation_steps = micro_batch_size, gradient_accumulation_steps
        self.streams = open_streams(data_spec) if streams is None else streams
        for stream in self.streams:
            if not stream.has_rows():
                raise MLLMRecordError(f"{stream.name}: no record to stream (data.streaming=true reads it again at "
                                      "its end, so an empty source would never end a step)", "invalid_source")
        entries = data_spec.source_entries()
        if len(entries) != len(self.streams):  # in-process streams: named by themselves, equal weights
            entries = [MLLMSource(path=stream.name, name=stream.name) for stream in self.streams]
        self.sources, self.weights = entries, [entry.repeat for entry in entries]
        self.media_handler = media_handler or MLLMMediaHandler()
        self.bad_records = bad_records or BadRecordReport(data_spec.on_bad_record, data_spec.max_bad_fraction)
        self.state: dict | None = None  # where iteration starts: None, the stream's beginning
        self.epoch = 0

    @property
    def packs_per_step(self) -> int:
        return self.world_size * self.micro_batch_size * self.gradient_accumulation_steps

    def planner(self) -> StreamPlanner:
        """A planner at this dataset's starting point."""
        planner = StreamPlanner(self.streams, self.weights, self.encoder, self.data_spec.packing,
                                self.data_spec.packing.seed)
        if self.state is not None:
            planner.load_state_dict(self.state)
        return planner

    def steps(self, planner: StreamPlanner) -> Iterator[tuple[list[tuple[list[Entry], list[dict]]], dict]]:
        """The global packs of each optimizer step from the planner's position to ``max_steps``, with the state
        after the step."""
        per_step = self.packs_per_step
        if planner.packs % per_step:
            raise ValueError(f"stream state at {planner.packs} packs is not at a step boundary of {per_step} packs")
        for _ in range(planner.packs // per_step, self.max_steps):
            packs = [planner.next_pack() for _ in range(per_step)]
            yield packs, planner.state_dict()

    def __iter__(self):
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        planner = self.planner()
        served = 0  # this rank's packs since the starting point
        for packs, after in self.steps(planner):
            mine = packs[self.rank::self.world_size]  # pack k of the step's G goes to rank k mod world_size
            for i, (pack, bad) in enumerate(mine):
                # whole micro-batches per worker, as MLLMStreamingPackedDataset deals them
                if (served // self.micro_batch_size) % workers == worker_id:
                    item = encode_samples(self.encoder, self.media_handler, len(self.sources),
                                          ((planner.records[key], measured, packed, key[0])
                                           for key, measured, packed, _ in pack))
                    item["bad_records"] = [*bad, *item["bad_records"]]
                    if i == len(mine) - 1:
                        item["data_state"] = after
                    yield item
                served += 1
            for pack, _ in packs:  # served: their records are no longer held
                for entry in pack:
                    planner.records.pop(entry[0], None)

    def state_dict(self) -> dict | None:
        return self.state

    def load_state_dict(self, state: dict | None) -> None:
        self.state = state

    def starting_at(self, packs_done: int) -> MLLMStreamDataset:
        """Check that the loaded state is where the run is (``packs_done`` of this rank's packs)."""
        at = 0 if self.state is None else int(self.state["packs"])
        if at != packs_done * self.world_size:
            raise ValueError(f"the stream state is {at} packs in, the run {packs_done * self.world_size}: resume "
                             "from a checkpoint of this stream-mode run (it holds the stream's state)")
        return self

    def set_epoch(self, epoch: int) -> None:
        """A stream is one epoch of ``max_steps`` steps."""
        self.epoch = epoch

    def ledger(self, state: dict | None) -> tuple[RecordLedger, list[SourceTally]]:
        """What the stream has read, dropped and truncated up to ``state`` (a state the iteration handed out), as
        the run's ledger and per-source tallies count it; bad records are counted by the trainer as they arrive.
        A record counts as read once its fate is known: those still held (buffered, in open or unserved packs) and
        bad ones not yet handed to the trainer are left out until then, so the ledger reconciles at every step."""
        tallies = [SourceTally() for _ in self.sources]
        ledger = RecordLedger(epoch=0, records_read=0)
        if state is not None:
            held = [*state["buffer"], *(e for pack in state["open"] for e in pack),
                    *(e for pack, _ in state["ready"] for e in pack)]
            waiting = [*state["pending_bad"], *(b for _, bad in state["ready"] for b in bad)]
            unsettled = Counter([entry[0][0] for entry in held] + [b["source"] for b in waiting])
            for source, (tally, read, dropped) in enumerate(zip(tallies, state["read"], state["dropped"])):
                tally.records, tally.dropped = read - unsettled[source], Counter(dropped)
            ledger.records_read = sum(t.records for t in tallies)
            ledger.dropped = sum((t.dropped for t in tallies), Counter())
            ledger.truncated = state["truncated"]
        return ledger, tallies

    def epoch_ledger(self, micro_batch_size: int | None = None, epoch: int | None = None) -> RecordLedger:
        return self.ledger(self.state)[0]

    def epoch_sources(self, micro_batch_size: int | None = None, epoch: int | None = None) -> list[SourceTally]:
        return self.ledger(self.state)[1]

    def estimate_total_steps(self, epochs: int, *_) -> int:
        raise ValueError("a stream has no step estimate (it is read in order, not indexed): the run takes "
                         "train.max_steps optimizer steps")
