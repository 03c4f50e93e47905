"""The data of the elastic workers (tests/scripts/elastic_*_worker.py): variable-length rows with a per-sample random
crop (map-style, or a ``datasets`` stream) and padding collators: :func:`collate` records the sample indices each
process collated (``FETCHED``), :func:`collate_indexed` puts them in the batch."""

from __future__ import annotations

import torch

from helpers.tiny_models import VOCAB

# indices collated since the last optimizer step (num_workers=0: this process); they are the step's samples only
# with a loader that collates a batch when it hands it out, not with one that reads ahead (a prepared stream)
FETCHED: list[int] = []


class CropRows(torch.utils.data.Dataset):
    """Rows of 4-16 tokens; each fetch drops a random number (0-2) of leading tokens (torch's global generator)."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(11)
        lengths = torch.randint(4, 17, (count,), generator=generator).tolist()
        self.rows = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        start = int(torch.randint(0, 3, ()))
        return {"input_ids": self.rows[index][start:], "index": index}


def crop_stream(count: int):
    """The rows of ``CropRows(count)`` as a ``datasets`` stream (4 shards, a shuffle buffer of 6) whose lazy ``.map``
    crops each row like ``CropRows.__getitem__`` (torch's global generator)."""
    import datasets

    rows = CropRows(count).rows
    stream = datasets.Dataset.from_dict({"ids": rows, "index": list(range(count))}).to_iterable_dataset(num_shards=4)
    return stream.shuffle(seed=3, buffer_size=6).map(
        lambda row: {"input_ids": row["ids"][int(torch.randint(0, 3, ())):], "index": row["index"]},
        remove_columns=["ids"])


def pad_rows(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad with 0; padded positions are ignored by the loss (so micro-batches hold different token counts)."""
    width = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, : len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """:func:`pad_rows`, recording the rows' sample indices in ``FETCHED`` (batches a model takes as ``**batch``)."""
    FETCHED.extend(row["index"] for row in rows)
    return pad_rows(rows)


def collate_indexed(rows: list[dict]) -> dict[str, torch.Tensor]:
    """:func:`pad_rows` plus the rows' sample indices as ``"index"``: a loop records what it trains from the batch
    itself, whenever the loader collated it (a prepared stream collates the next batch before handing this one out)."""
    return {**pad_rows(rows), "index": torch.tensor([row["index"] for row in rows])}
