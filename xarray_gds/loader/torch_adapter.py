"""A :class:`~xarray_gds.loader.BatchLoader` as a PyTorch ``IterableDataset`` of whole
batches (:meth:`~xarray_gds.loader.BatchLoader.torch_dataset`), its arrays as tensors
through DLPack. The adapter class is made on first use: importing torch is slow."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["as_tensors", "torch_dataset_class"]

_torch_class: Any = None


def as_tensors(batch: Any) -> Any:
    """A batch's arrays as torch tensors, zero copy through DLPack (CuPy arrays on the
    GPU, numpy on the host); what ``to=`` already made, and Datasets, as they are."""
    import torch

    if isinstance(batch, dict):
        return {name: as_tensors(value) for name, value in batch.items()}
    if hasattr(batch, "__dlpack__") and not isinstance(batch, torch.Tensor):
        return torch.from_dlpack(batch)
    return batch


def torch_dataset_class() -> Any:
    """The IterableDataset adapter (made on first use: importing torch is slow)."""
    global _torch_class
    if _torch_class is None:
        import torch.utils.data

        class _TorchDataset(torch.utils.data.IterableDataset):
            def __init__(self, loader: Any) -> None:
                self.loader = loader
                self._pid = os.getpid()

            def __iter__(self) -> Iterator[Any]:
                info = torch.utils.data.get_worker_info()
                if info is not None:
                    forked = os.getpid() != self._pid and not getattr(self, "_unpickled", False)
                    self.loader._check_worker(info.id, info.num_workers, forked)
                return (as_tensors(batch) for batch in self.loader)

            def __len__(self) -> int:
                return len(self.loader)

            def __setstate__(self, state: dict[str, Any]) -> None:
                self.__dict__.update(state)
                self._unpickled = True  # a spawned worker's copy

            def state_dict(self) -> dict[str, Any]:
                return self.loader.state_dict()

            def load_state_dict(self, state: Mapping[str, Any]) -> None:
                self.loader.load_state_dict(state)

        _TorchDataset.__module__ = __name__
        _TorchDataset.__qualname__ = "_TorchDataset"
        _torch_class = _TorchDataset
    return _torch_class


def __getattr__(name: str) -> Any:
    if name == "_TorchDataset":  # pickle's lookup of the adapter class in a spawned worker
        return torch_dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
