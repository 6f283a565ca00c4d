"""M-RoPE positions through the data plane: a packed row gets, per document, the positions of
``mrope_position_ids`` from its items' grids (``MediaItem.rope_grid``); they survive padding,
context-parallel slicing (and merging back), and a row without such items carries none."""
from __future__ import annotations

import numpy as np
import torch

from dataloading.construct.batch import MediaInputs
from dataloading.construct.constructor import Tokenized, assemble
from dataloading.construct.context_parallel import local_documents, merge_cp_slices, slice_for_cp
from dataloading.construct.positions import mrope_position_ids
from dataloading.formats.media import MediaItem


def _sample(sid: str, length: int, items: list[tuple[int, tuple]]) -> Tokenized:
    media = []
    for start, grid in items:
        n = grid[0] * grid[1] * grid[2] if grid is not None else 3
        item = MediaItem(torch.zeros(n, 2), (n,), n, rope_grid=grid)
        media.append(("image" if grid is not None else "audio", item, np.arange(start, start + n)))
    return Tokenized(sid, np.arange(length, dtype=np.int64), np.arange(length, dtype=np.int64), media)


SAMPLES = [
    _sample("a", 12, [(2, (1, 2, 3, 1.0))]),  # an image of 2 x 3 placeholders
    _sample("b", 7, []),  # text only
    _sample("c", 16, [(1, (1, 3, 2, 1.0)), (9, None)]),  # an image, then an audio clip (counts like text)
]


def test_a_row_gets_each_documents_positions():
    mb = assemble(SAMPLES)
    want = torch.cat([mrope_position_ids(12, [(2, 1, 2, 3, 1.0)]), mrope_position_ids(7, []),
                      mrope_position_ids(16, [(1, 1, 3, 2, 1.0)])], dim=1)
    assert torch.equal(mb.rope_position_ids, want)
    assert mb.rope_position_ids[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert mb.rope_position_ids[:, 8].tolist() == [5, 5, 5]  # text after the image: 2 + max(2, 3)
    assert torch.equal(mb.position_ids, torch.cat([torch.arange(12), torch.arange(7), torch.arange(16)]))
    assert assemble([SAMPLES[1]]).rope_position_ids is None  # no grid anywhere: the 1-D positions serve
    padded = mb.padded(40, pad_id=0)
    assert torch.equal(padded.rope_position_ids[:, :35], want)
    assert torch.equal(padded.rope_position_ids[:, 35:], torch.arange(5).expand(3, 5))


def test_context_parallel_slices_carry_them_and_merge_back():
    mb = assemble(SAMPLES)
    for cp in (2, 3):
        slices = [slice_for_cp(mb, cp, r, pad_id=0) for r in range(cp)]
        for s in slices:
            assert s.rope_position_ids.shape == (3, s.num_tokens)
            # a real token keeps the positions it has in the whole row (its document's start plus
            # its 1-D position there is its index in the row)
            docs = local_documents(s.cp, s.num_tokens)
            for k in torch.nonzero(s.labels >= 0).flatten().tolist():
                orig = (0, 12, 19)[int(docs[k])] + int(s.position_ids[k])
                assert torch.equal(s.rope_position_ids[:, k], mb.rope_position_ids[:, orig])
        merged = merge_cp_slices(slices)
        assert torch.equal(merged.rope_position_ids, mb.rope_position_ids)


def test_media_inputs_are_unchanged():
    mb = assemble(SAMPLES)
    assert isinstance(mb.media["image"], MediaInputs) and mb.media["image"].positions.tolist() == \
        list(range(2, 8)) + list(range(20, 26))
