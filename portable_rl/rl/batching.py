"""Token ids of (prompt, response) pairs → the `[R, L]` arrays the learner sees: one sequence per row, or packed.

Sequence i (prompt_i + response_i, len_i tokens) sits in row r_i from column s_i on. Position t of a
sequence carries the logprob of its token t (given tokens < t), the convention of
`learner_jax.logprobs.sequence_logprobs`:

    input_ids[r_i, s_i + t]        = (prompt_i + response_i)[t]                         t < len_i
    segment_ids[r_i, s_i + t]      = k_i  (1, 2, ... in the order placed in the row)    0 = padding
    positions[r_i, s_i + t]        = t    (restarts at 0 for every sequence)
    attention_mask                 = segment_ids > 0
    response_mask[r_i, s_i + t]    = 1  for p_i <= t < len_i with a finite engine logprob, sampled by the engine
                                        (multi-turn: not an observation token), and t > 0
    rollout_logprobs[r_i, s_i + t] = engine logprob of that token where response_mask is 1, else 0
    advantages[r_i, s_i + t]       = A_i · response_mask

plus the per-sequence index `seq_row`, `seq_start`, `seq_len`, `prompt_len` ([N] int32 numpy), from
which per-sequence views are rebuilt (`Layout.to_rows` / `Layout.to_view`). Multi-turn trajectories
(`response_masks` given: per response token 1 = sampled by the engine, 0 = an environment's observation)
interleave model and observation tokens in the response; observation tokens get response_mask 0, so no loss,
TIS weight, KL or logprob, in every layout below (each moves the view's mask with its tokens). With
`turn_indices` the view also carries

    turn_index[i, t]               = the turn of response token t (0 off the response), [B, T] int32

for per-turn metrics (rl/learner.py). With truncated sampling
(`sampling_supports` given) also

    sampling_support[r_i, s_i + t, :] = the token ids of the support response token t was sampled from,
                                        padded with -1 to `support_width` (K; -1 everywhere off the
                                        response), [R, L, K] int32 (learner_jax/logprobs.py)

and with routing replay (`routed_experts` given: per sequence the engine's `Rollout.routed_experts`
[len_i - 1, S, K], engines/base.py "Routed experts")

    routed_experts[r_i, s_i + t, l, :]  = the experts sparse layer l of the engine routed token t to, for
                                          t < len_i - 1 (prompt, response and observation positions alike:
                                          the engine returns them all); -1 at the last token and on padding,
                                          where the learner keeps its own routing. [R, L, S, K] int16

Every layout below moves it with its tokens (a shared prompt's positions carry its first member's).

Three layouts:
    one per row (pack=False)   row i = sequence i from column 0; L = next power of two >= max len_i
                               (at least `min_len`); rows padded with empty rows to a multiple of
                               `row_multiple`. This is also the learner's per-sequence view.
    packed (pack=True)         sequences placed first-fit decreasing (longest first, each into the
                               first row with room) into rows of `row_tokens` tokens; a sequence is
                               never split. No power-of-two padding.
    shared prompts             (`shared_prompt_packed`, the learner's `share_prompts`) the sequences
                               of one prompt (a GRPO group) as one unit: the prompt's first p-1
                               tokens once, then per sequence its tokens from p-1 on (the last prompt
                               token again, whose logits predict the first response token, then the
                               response), as continuation segments (learner_jax/attention.py) with
                               positions p-1, p, ...: n·(p+r) tokens become p-1 + n·(r+1). Units
                               too long for a row are split into several, each with the prompt.

A response token whose engine logprob is NaN or ±inf is dropped from the loss (mask 0, logprob 0), so
nothing non-finite reaches JAX; `rl.rollout.collect_groups` counts them (`rollout/nonfinite_*`). The
first token of a sequence has no context (and in a packed row its logprob would be predicted from the
previous sequence), so it is never a response token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from portable_rl.errors import UserError

ROW_KEYS = ("input_ids", "segment_ids", "positions", "attention_mask", "response_mask", "rollout_logprobs",
            "advantages")
SEQ_KEYS = ("seq_row", "seq_start", "seq_len", "prompt_len")
_ROW_DTYPES = dict(input_ids=np.int32, segment_ids=np.int32, positions=np.int32, attention_mask=np.int32,
                   response_mask=np.float32, rollout_logprobs=np.float32, advantages=np.float32)


_FILL = {"sampling_support": -1, "routed_experts": -1}  # padding value of a view array, where it is not 0


class MicroBatchBudgetError(UserError, ValueError):
    """A sequence is longer than the micro-batch token budget (sequences are never split)."""


def bucket_length(length: int, min_len: int = 16) -> int:
    """Smallest power of two >= max(length, min_len)."""
    t = max(length, min_len, 1)
    return 1 << (t - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def packed_row_length(longest: int, min_len: int = 16) -> int:
    """Row length for packing without a token budget: the longest sequence rounded up to a multiple of
    64 (a power of two below 64, so short-sequence runs are not padded to 64)."""
    return bucket_length(longest, min_len) if longest <= 64 else round_up(longest, 64)


def round_rows(n: int, multiple: int = 1) -> int:
    """Row count for jit: a multiple of `multiple`, and (in units of `multiple`) the next value of the form
    c·2^k with c in 4..7, so a run sees at most 4 row counts per doubling (at most 25% empty rows)."""
    units = max(-(-n // multiple), 1)
    if units > 8:
        step = 1 << (units.bit_length() - 3)  # 4 steps per octave: 8→10→12→14→16→20→...
        units = round_up(units, step)
    return units * multiple


def first_fit_decreasing(lengths, capacity: int):
    """Bins of `capacity` tokens: longest first, each into the first bin with room.

    → (bin [N] int32, start [N] int32 (offset inside the bin), slot [N] int32 (1.. order in the bin), bins).
    Ties keep the input order, so the result is deterministic.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > capacity:
        raise MicroBatchBudgetError(f"a sequence of {int(lengths.max())} tokens does not fit a row of {capacity}")
    n = len(lengths)
    bin_of, start, slot = (np.zeros(n, np.int32) for _ in range(3))
    free = np.zeros(0, np.int64)        # room left in each open bin
    count = np.zeros(0, np.int32)       # sequences in each open bin
    for i in np.argsort(-lengths, kind="stable"):
        fits = np.flatnonzero(free >= lengths[i])
        if fits.size:
            b = fits[0]
        else:
            b = len(free)
            free, count = np.append(free, capacity), np.append(count, 0)
        bin_of[i], start[i] = b, capacity - free[b]
        count[b] += 1
        slot[i] = count[b]
        free[b] -= lengths[i]
    return bin_of, start, slot, len(free)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where pieces of the sequences of a per-sequence view sit in `[rows, length]`: piece i is
    columns [view_start_i, view_start_i + length_i) of view row seq_i, placed in row row_i from
    column start_i with segment id segment_i. Usually one piece per sequence from column 0; with
    shared prompts a sequence's prompt may be another sequence's piece (`shared_prompt_packed`).

    seq, row, start, length, segment, view_start: [n] int arrays (segment = 1.. order in its row;
    view_start None: all 0).
    """
    seq: np.ndarray
    row: np.ndarray
    start: np.ndarray
    length: np.ndarray
    segment: np.ndarray
    rows: int
    row_tokens: int
    view_start: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.row_tokens

    @property
    def sequences(self) -> np.ndarray:
        """The view rows that have tokens here, each once, in order."""
        return np.unique(self.seq)

    @functools.cached_property
    def _flat(self):
        """Per token: (view row, view column, packed row, packed column)."""
        total = int(self.length.sum())
        offset = np.arange(total) - np.repeat(np.cumsum(self.length) - self.length, self.length)
        view_start = 0 if self.view_start is None else np.repeat(self.view_start, self.length)
        return (np.repeat(self.seq, self.length), view_start + offset, np.repeat(self.row, self.length),
                np.repeat(self.start, self.length) + offset)

    def to_rows(self, view: np.ndarray, fill=0) -> np.ndarray:
        """[N, T, ...] per-sequence values → [rows, row_tokens, ...] (padding = `fill`)."""
        vr, vc, pr, pc = self._flat
        out = np.full(self.shape + view.shape[2:], fill, view.dtype)
        out[pr, pc] = view[vr, vc]
        return out

    def to_view(self, packed: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Writes the [rows, row_tokens] values of these sequences into the per-sequence view `out` [N, T]."""
        vr, vc, pr, pc = self._flat
        out[vr, vc] = packed[pr, pc]
        return out

    def arrays(self, view: dict) -> dict[str, np.ndarray]:
        """The `ROW_KEYS` arrays (and any other [N, T] view arrays given) in this layout."""
        out = {k: self.to_rows(v, fill=_FILL.get(k, 0)) for k, v in view.items()
               if k not in ("segment_ids", "positions", "attention_mask")}
        vr, vc, pr, pc = self._flat
        out["segment_ids"] = np.zeros(self.shape, np.int32)
        out["segment_ids"][pr, pc] = np.repeat(self.segment, self.length)
        out["positions"] = np.zeros(self.shape, np.int32)
        out["positions"][pr, pc] = vc
        out["attention_mask"] = (out["segment_ids"] > 0).astype(np.int32)
        return out

    @property
    def padding_tokens(self) -> int:
        return self.rows * self.row_tokens - int(self.length.sum())


def one_per_row(seq, lengths, rows: int, row_tokens: int, row=None) -> Layout:
    """Sequence j of `seq` in row `row[j]` (default j) from column 0; the other rows are empty."""
    seq, lengths = np.asarray(seq), np.asarray(lengths)
    n = len(seq)
    row = np.arange(n) if row is None else np.asarray(row)
    if n and (row.max() >= rows or lengths.max() > row_tokens):
        raise ValueError(f"{n} sequences of up to {lengths.max()} tokens do not fit {rows} rows of {row_tokens}")
    return Layout(seq=seq, row=row, start=np.zeros(n, np.int64), length=lengths,
                  segment=np.ones(n, np.int32), rows=rows, row_tokens=row_tokens)


def packed(seq, lengths, row_tokens: int, row_multiple: int = 1, rows: int | None = None) -> Layout:
    """First-fit decreasing into rows of `row_tokens`; rows = `round_rows(bins, row_multiple)` unless given."""
    seq, lengths = np.asarray(seq), np.asarray(lengths)
    row, start, slot, bins = first_fit_decreasing(lengths, row_tokens)
    rows = round_rows(bins, row_multiple) if rows is None else rows
    if rows < bins:
        raise ValueError(f"{bins} packed rows do not fit {rows}")
    return Layout(seq=seq, row=row, start=start, length=lengths, segment=slot, rows=rows, row_tokens=row_tokens)


def _prompt_groups(prompt_keys) -> list[list[int]]:
    """Indices grouped by equal key, groups in order of first appearance."""
    groups = {}
    for i, key in enumerate(prompt_keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _shared_tokens(members, prompt_lengths) -> int:
    """The prompt tokens a group's members share (its first p−1), 0 when it is not shared (one member,
    or a one-token prompt)."""
    shared = int(prompt_lengths[members[0]]) - 1
    return shared if len(members) > 1 and shared >= 1 else 0


def _unit_tokens(shared: int, member_lengths) -> int:
    """Tokens of one unit: the shared prompt piece, then each member from column `shared` on."""
    return int(shared + sum(int(n) - shared for n in member_lengths))


def shared_prompt_group_tokens(lengths, prompt_lengths, prompt_keys) -> np.ndarray:
    """Tokens of each prompt group laid out as one shared-prompt unit (`shared_prompt_packed`): [groups]."""
    lengths, prompt_lengths = np.asarray(lengths, np.int64), np.asarray(prompt_lengths, np.int64)
    out = []
    for members in _prompt_groups(prompt_keys):
        shared = _shared_tokens(members, prompt_lengths)
        out.append(_unit_tokens(shared, lengths[members]) if shared else int(lengths[members].max()))
    return np.array(out, np.int64)


def shared_prompt_packed(seq, lengths, prompt_lengths, prompt_keys, row_tokens: int, row_multiple: int = 1,
                         rows: int | None = None) -> Layout:
    """The sequences `seq` (lengths, prompt lengths [n]) grouped by `prompt_keys` [n] (equal keys: equal
    prompt tokens), each group as shared-prompt units (module doc), units first-fit decreasing into rows
    of `row_tokens`. A group of one, or a prompt of one token, is an ordinary segment."""
    from portable_rl.learner_jax.attention import MAX_SHARED_PROMPT_ID, continuation_id

    seq, lengths, prompt_lengths = (np.asarray(x, np.int64) for x in (seq, lengths, prompt_lengths))
    if lengths.size and lengths.max() > row_tokens:
        raise MicroBatchBudgetError(f"a sequence of {int(lengths.max())} tokens does not fit a row of {row_tokens}")
    units = []  # per unit: (prompt piece length, [member index]); prompt piece length 0: one plain sequence
    for members in _prompt_groups(prompt_keys):
        shared = _shared_tokens(members, prompt_lengths)
        if not shared:
            units += [(0, [i]) for i in members]
            continue
        members = sorted(members, key=lambda i: -lengths[i])
        unit, used = [], shared
        for i in members:
            own = lengths[i] - shared
            if unit and used + own > row_tokens:
                units.append((shared, unit))
                unit, used = [], shared
            unit.append(i)
            used += own
        units.append((shared, unit))
    sizes = [_unit_tokens(p, lengths[m]) for p, m in units]  # p = 0: the one plain sequence
    unit_row, unit_start, unit_slot, bins = first_fit_decreasing(sizes, row_tokens)
    if unit_slot.size and unit_slot.max() > MAX_SHARED_PROMPT_ID:
        raise ValueError(f"{int(unit_slot.max())} units in one row; at most {MAX_SHARED_PROMPT_ID}")
    pieces = []  # (view row, view start, length, row, start, segment)
    for (p, members), row, start, slot in zip(units, unit_row, unit_start, unit_slot):
        if not p:
            pieces.append((seq[members[0]], 0, lengths[members[0]], row, start, slot))
            continue
        pieces.append((seq[members[0]], 0, p, row, start, slot))           # the prompt's first p-1 tokens
        start += p
        for j, i in enumerate(members, 1):                                  # then each continuation
            pieces.append((seq[i], p, lengths[i] - p, row, start, continuation_id(int(slot), j)))
            start += lengths[i] - p
    cols = np.array(pieces, np.int64).reshape(-1, 6).T
    rows = round_rows(bins, row_multiple) if rows is None else rows
    if rows < bins:
        raise ValueError(f"{bins} packed rows do not fit {rows}")
    return Layout(seq=cols[0], view_start=cols[1], length=cols[2], row=cols[3], start=cols[4],
                  segment=cols[5].astype(np.int32), rows=rows, row_tokens=row_tokens)


def split_rows_of(layout: Layout, rows_per_part: int) -> list[Layout]:
    """`layout` cut into parts of `rows_per_part` consecutive rows each (the last padded with empty rows)."""
    parts = []
    for first in range(0, max(int(layout.row.max(initial=-1)) + 1, 1), rows_per_part):
        pick = (layout.row >= first) & (layout.row < first + rows_per_part)
        parts.append(dataclasses.replace(
            layout, seq=layout.seq[pick], row=layout.row[pick] - first, start=layout.start[pick],
            length=layout.length[pick], segment=layout.segment[pick], rows=rows_per_part,
            view_start=None if layout.view_start is None else layout.view_start[pick]))
    return parts


def _support_view(supports, prompt_ids, shape, width):
    """[B, T, K] int32: each response token's sampling support, padded with -1 (module doc)."""
    out = np.full(shape + (width,), -1, np.int32)
    for i, (p, per_token) in enumerate(zip(prompt_ids, supports)):
        for t, support in enumerate(per_token):
            if len(support) > width:
                raise ValueError(f"sequence {i}, response token {t}: a support of {len(support)} tokens > "
                                 f"support_width={width} (the sampling top_k)")
            out[i, len(p) + t, :len(support)] = support
    return out


def _routing_view(routed_experts, lengths, shape):
    """[B, T, S, K] int16: each sequence's engine routing at its positions but the last, -1 elsewhere (module doc)."""
    first = np.asarray(routed_experts[0])
    out = np.full(shape + first.shape[1:], -1, np.int16)
    for i, (routed, n) in enumerate(zip(routed_experts, lengths)):
        if routed is None:
            raise ValueError(f"sequence {i} has no routed_experts but others do: the engine must return them for "
                             "every rollout (SamplingConfig.return_routed_experts)")
        if routed.shape != (n - 1,) + first.shape[1:]:
            raise ValueError(f"sequence {i}: routed_experts of shape {routed.shape}; expected "
                             f"{(n - 1,) + first.shape[1:]} (one row per position but the last)")
        out[i, :n - 1] = routed
    return out


def _sequence_view(prompt_ids, response_ids, response_logprobs, advantages, pad_id, min_len, row_multiple,
                   response_masks=None, turn_indices=None):
    """The one-per-row arrays ([B, T], T a power of two) and the [N] lengths / prompt lengths."""
    n = len(prompt_ids)
    if not (n == len(response_ids) == len(response_logprobs) == len(advantages)):
        raise ValueError("prompt_ids, response_ids, response_logprobs and advantages must have the same length")
    lengths = np.array([len(p) + len(r) for p, r in zip(prompt_ids, response_ids)], np.int32)   # [N]
    t = bucket_length(int(lengths.max(initial=1)), min_len)
    b = max(round_up(n, row_multiple), row_multiple)
    view = {k: np.zeros((b, t), _ROW_DTYPES[k]) for k in ("input_ids", "response_mask", "rollout_logprobs",
                                                           "advantages")}
    view["input_ids"][:] = pad_id
    if turn_indices is not None:
        view["turn_index"] = np.zeros((b, t), np.int32)
    for i, (p, r, lp, a) in enumerate(zip(prompt_ids, response_ids, response_logprobs, advantages)):
        if len(lp) != len(r):
            raise ValueError(f"row {i}: {len(r)} response tokens but {len(lp)} logprobs")
        p_len, ln = len(p), len(p) + len(r)
        logp = np.asarray(lp, np.float32)                                # [len(r)]
        finite = np.isfinite(logp)                                       # [len(r)]
        finite[:1] &= p_len > 0                                          # no context for a sequence's first token
        if response_masks is not None and response_masks[i] is not None:
            finite &= np.asarray(response_masks[i]) > 0                  # observation tokens: not the model's
        if turn_indices is not None and turn_indices[i] is not None:
            view["turn_index"][i, p_len:ln] = turn_indices[i]
        view["input_ids"][i, :p_len] = p
        view["input_ids"][i, p_len:ln] = r
        view["response_mask"][i, p_len:ln] = finite
        view["rollout_logprobs"][i, p_len:ln] = np.where(finite, logp, 0.0)
        view["advantages"][i, p_len:ln] = np.where(finite, a, 0.0)
    prompt_len = np.array([len(p) for p in prompt_ids], np.int32)
    return view, lengths, prompt_len


def pack_rollouts(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                  response_logprobs: Sequence[Sequence[float]], advantages: Sequence[float], *,
                  pad_id: int = 0, min_len: int = 16, row_multiple: int = 1, pack: bool = False,
                  row_tokens: int | None = None, sampling_supports=None, support_width: int | None = None,
                  response_masks=None, turn_indices=None, routed_experts=None) -> dict:
    """Returns the `ROW_KEYS` arrays and the `SEQ_KEYS` index: every value a numpy array (`num_rows(batch)`
    and `num_sequences(batch)` count rows holding a sequence and sequences).

    pack=False: one sequence per row (module doc). pack=True: rows of `row_tokens` (default
    `packed_row_length` of the longest sequence), their count rounded by `round_rows(., row_multiple)`.
    `sampling_supports` (per sequence, per response token, the support's ids; truncated sampling) adds
    `sampling_support` [R, L, K], K = `support_width` (default: the largest support; a fixed K, the
    sampling top_k, keeps the shape the learner compiles for the same from step to step).
    `response_masks` / `turn_indices` (multi-turn; per sequence a list per response token, or None: all
    sampled, turn 0): the model-token mask and the `turn_index` view (module doc). `routed_experts` (per
    sequence the engine's [len - 1, S, K] routing; routing replay) adds `routed_experts` [R, L, S, K].
    """
    view, lengths, prompt_len = _sequence_view(prompt_ids, response_ids, response_logprobs, advantages, pad_id,
                                               min_len, 1 if pack else row_multiple, response_masks, turn_indices)
    if sampling_supports is not None:
        width = support_width or max((len(s) for per in sampling_supports for s in per), default=1)
        view["sampling_support"] = _support_view(sampling_supports, prompt_ids, view["input_ids"].shape, width)
    if routed_experts is not None:
        view["routed_experts"] = _routing_view(routed_experts, lengths, view["input_ids"].shape)
    n = len(lengths)
    seq = np.arange(n)
    if pack:
        layout = packed(seq, lengths, row_tokens or packed_row_length(int(lengths.max(initial=1)), min_len),
                        row_multiple)
    else:
        layout = one_per_row(seq, lengths, *view["input_ids"].shape)
    out = layout.arrays(view)
    out["input_ids"][out["segment_ids"] == 0] = pad_id
    out.update(seq_row=layout.row.astype(np.int32), seq_start=layout.start.astype(np.int32),
               seq_len=lengths, prompt_len=prompt_len)
    return out


def num_rows(batch: dict) -> int:
    """Rows of a `pack_rollouts` batch that hold at least one sequence (the rest is row padding)."""
    return int(len(np.unique(batch["seq_row"])))


def num_sequences(batch: dict) -> int:
    """Sequences in a `pack_rollouts` batch."""
    return int(len(batch["seq_len"]))
