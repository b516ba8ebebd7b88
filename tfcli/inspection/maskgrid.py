"""The cells of tfcli's masks at the positions that are shown, and nothing more.

A mask grid is Q x K; at a length of a million that is 10^12 cells, none of which can be shown.
Each mask is a rule on positions (:meth:`NamedMask.key_span` AND the key side's padding), so
the first and last positions of each side are evaluated directly, as numpy summarises an array:
memory depends on how many positions are shown, not on the length, batch or max_seq_len.
Convention: bool, True = may attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tfcli.inspection.maskcheck import NamedMask


@dataclass(frozen=True)
class Padding:
    """One side of the example batch: its padded length and which positions are real, held as
    real lengths (real tokens first) or, for token ids the user spelled out, as [B, L]."""
    length: int
    lengths: tuple[int, ...] | None = None
    valid: Tensor | None = None  # [B, L] bool, from token ids

    @property
    def batch(self) -> int:
        return len(self.lengths) if self.lengths is not None else self.valid.size(0)

    def real(self) -> list[int]:
        """Real positions per sequence."""
        return list(self.lengths) if self.lengths is not None else self.valid.sum(1).tolist()

    def at(self, positions: Tensor) -> Tensor:
        """[n] positions -> [B, n]: True where the position is a real token."""
        if self.lengths is not None:
            return positions[None, :] < torch.tensor(self.lengths)[:, None]
        return self.valid[:, positions]

    def real_below(self, bounds: Tensor) -> Tensor:
        """[n] bounds -> [B, n]: how many real positions lie below each bound (0..length)."""
        if self.lengths is not None:
            return torch.minimum(bounds[None, :], torch.tensor(self.lengths)[:, None])
        counts = torch.cat([torch.zeros(self.batch, 1, dtype=torch.int64),
                            self.valid.cumsum(1)], dim=1)  # [B, L + 1]
        return counts[:, bounds]

    def whole(self) -> Tensor:
        """[B, L] validity, for a run of the model (whose memory is guarded)."""
        if self.lengths is not None:
            from tfcli.model.masks import valid_from_lengths

            return valid_from_lengths(list(self.lengths), self.length)
        return self.valid


def shown_positions(length: int, limit: int) -> list[int]:
    """Every position up to ``limit``; beyond, the first two thirds and the last third of it."""
    if length <= limit:
        return list(range(length))
    head = limit - limit // 3
    return [*range(head), *range(length - (limit - head), length)]


@dataclass
class Grid:
    """One mask at the shown positions: rows are queries, columns keys."""
    mask: NamedMask
    q_len: int
    k_len: int
    rows: list[int]  # shown query positions, ascending; a jump marks an elided run
    cols: list[int]
    allowed: Tensor  # [B, R, C] bool
    row_valid: Tensor  # [B, R]: the query is a real token
    col_valid: Tensor  # [B, C]
    row_has_key: Tensor  # [B, R]: the whole row (shown or not) allows some key
    real_queries: list[int]  # per sequence
    real_keys: list[int]

    @property
    def elided(self) -> bool:
        return len(self.rows) < self.q_len or len(self.cols) < self.k_len


def shown_cells(named: list[NamedMask], sides: dict[str, Padding],
                limit: dict[str, int]) -> list[Grid]:
    """Each mask at ``shown_positions(length, limit[side])`` of its query and key sides."""
    out = []
    for m in named:
        q_side, k_side = sides[m.query_side], sides[m.key_side]
        rows = shown_positions(q_side.length, limit[m.query_side])
        cols = shown_positions(k_side.length, limit[m.key_side])
        qs, ks = torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)
        first, last = m.key_span(qs, k_side.length)  # [R] each
        allowed = (first[:, None] <= ks) & (ks <= last[:, None])  # [R, C]
        has_key = first <= last  # [R]
        if m.padded:
            allowed = allowed[None] & k_side.at(ks)[:, None, :]  # [B, R, C]
            real = k_side.real_below(last + 1) - k_side.real_below(first)  # [B, R]
            has_key = has_key[None] & (real > 0)
        else:
            allowed = allowed[None].expand(k_side.batch, -1, -1)
            has_key = has_key[None].expand(k_side.batch, -1)
        out.append(Grid(m, q_side.length, k_side.length, rows, cols, allowed,
                        q_side.at(qs), k_side.at(ks), has_key, q_side.real(), k_side.real()))
    return out
