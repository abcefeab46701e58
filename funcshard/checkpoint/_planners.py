"""DCP glue: the save and load planners, and making DCP's errors and warnings readable.

torch.distributed.checkpoint is imported lazily, on the first save or load: it takes a second or two to import.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch


@functools.cache
def dcp_api() -> Any:
    """The DCP module and this module's two planners, built on first use."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (
        LoadPlan,
        ReadItem,
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SavePlanner(dcp.DefaultSavePlanner):
        """Writes the blocks of ``{fqn: (global_shape, {offsets: block})}``, each as one DCP chunk."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> SavePlan:
            items = []
            for fqn, (shape, blocks) in self.state_dict.items():
                for off, t in blocks.items():
                    chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape)
                    items.append(
                        WriteItem(
                            index=MetadataIndex(fqn, torch.Size(off)),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(chunk, TensorProperties(dtype=t.dtype), torch.Size(shape)),
                        )
                    )
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
            blocks = self.state_dict[write_item.index.fqn][1]
            return blocks[tuple(write_item.index.offset)].detach()

    class LoadPlanner(dcp.DefaultLoadPlanner):
        """Fills the blocks of ``{fqn: {offsets: empty block}}`` from the overlapping saved chunks."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
            self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

        def create_local_plan(self) -> LoadPlan:
            items: list[ReadItem] = []
            for fqn, blocks in self.state_dict.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in blocks.items()]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return LoadPlan(items)

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            t = self.state_dict[read_item.dest_index.fqn][tuple(read_item.dest_index.offset)]
            for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
                t = t.narrow(d, o, n)  # the part of the destination block this saved chunk fills
            return t

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            pass  # resolve_tensor returned a view: the reader already copied into the block

    return dcp, SavePlanner, LoadPlanner, MetadataIndex


def cause_of(e: BaseException) -> str:
    """The first failure inside DCP's ``CheckpointException`` (whose own text is only a traceback dump)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = min(failures.items(), key=lambda kv: kv[0])
        return f"rank {rank}: {type(inner).__name__}: {_first_line(inner)}"
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in a single process (our ``"sim"`` case, on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
        yield
