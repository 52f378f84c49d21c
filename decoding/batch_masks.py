"""Per-step masking on the device: one int32 per batch row selects a row of a resident table.

Host side, per step: `fill_row_indices` writes each row's table index into the engine's
pinned int32 buffer (B values; NO_MASK for unconstrained rows). That buffer is the whole
upload: B int32s, never a vocab-wide mask. Device side, `apply_masks` gathers the rows and
sets disallowed logits to -inf; NO_MASK is an all-True row, so unconstrained rows keep their
logits bit for bit. When no row of the batch is constrained the engine can skip both.

The device table is dense bool (1,024 rows x 51,200 ids = 52 MB): one gather per step, no
unpacking; the host keeps rows packed (mask_table.py) and uploads only new or rewritten rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from .mask_table import NO_MASK, MaskTable


class _HasMaskRow(Protocol):
    @property
    def mask_row(self) -> int: ...


def fill_row_indices(grammars: Sequence[_HasMaskRow | None], out: np.ndarray) -> int:
    """Write each grammar's mask row into `out[:len(grammars)]` (None -> NO_MASK, e.g. padding
    rows); returns how many rows are constrained (0: skip the upload and `apply_masks`)."""
    rows = [NO_MASK if g is None else g.mask_row for g in grammars]
    out[: len(rows)] = rows
    return len(rows) - rows.count(NO_MASK)


def table_tensor(table: MaskTable, device: torch.device | str = "cpu") -> torch.Tensor:
    """The whole table as a bool [n_rows, width] tensor (upload once; append new rows later
    with `table.dense(start)`)."""
    return torch.from_numpy(table.dense()).to(device)


def apply_masks(logits: torch.Tensor, row_index: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float, row_index [B] int32/int64 (on the logits' device), table [R, V]
    bool -> new logits with -inf where the row's mask disallows a token. No host sync, static
    shapes (graph-capturable); allocates one [B, V] bool and the output."""
    allowed = table.index_select(0, row_index)  # int32 indices work as they are
    return logits.masked_fill(allowed.logical_not_(), float("-inf"))
