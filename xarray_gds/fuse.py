"""Dask blocks of xarray-gds arrays read in joined batches, whatever the scheduler.

xarray turns every chunk of a lazily loaded variable into its own dask task, so with
``chunks={}`` (and ``open_mfdataset``'s defaults) each task reads one stored chunk:
one nvCOMP call a chunk, which leaves most of the GPU idle. :func:`optimize` is a
dask array optimization (dask's public ``array_optimize`` setting, which
:func:`install` sets once, keeping any optimization already set there): before dask's
own passes, it finds the block-reading tasks of every xarray-gds array in the graph
being computed, after culling (so only the blocks the computation needs), across
variables and stores, and replaces them with a few group tasks, each reading at most
``xarray_gds.fuse_bytes`` of blocks in one joined read (one file batch and one decode
per codec chain), and one cheap task a block that takes its block from its group.
Where the computation is the array itself (``ds.load()``, ``.compute()``), dask's final
concatenation of its blocks (a task of the graph since dask 2025.1) becomes one task
that copies each block from its group into one new array, and the per-block tasks go.

Blocks come back as they would without it: CuPy blocks through
:class:`~xarray_gds.chunks.GdsDaskManager`, numpy blocks through xarray's default
dask manager (which declares numpy blocks for every backend array; a one-time
warning says how to keep them on the GPU). Under ``dask.distributed`` the number of
groups is a multiple of the number of workers, and the group tasks depend on no other
task (each holds its arrays), so the scheduler spreads them: every worker reads and
decodes its own share, on its own GPU.
``xarray_gds.fuse_dask = False`` turns the pass off.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds import config
from xarray_gds import device as _device
from xarray_gds.errors import HostBlocksWarning, warn

__all__ = ["available", "install", "optimize", "register"]

_lock = threading.Lock()
_warned_host_blocks = False


@dataclass(frozen=True)
class _EngineArrays:
    """The engine's lazy array class and its joined read of many selections."""

    array_type: type
    read_many: Callable[[list[Any]], list[Any]]


#: set by :mod:`xarray_gds.array` (:func:`register`): the arrays this pass joins
_engine_arrays: _EngineArrays | None = None


def register(array_type: type, read_many: Callable[[list[Any]], list[Any]]) -> None:
    """The lazy array class whose dask blocks the pass joins, and the function that
    reads many selections of such arrays in one batch (the array module registers
    itself, so that this pass does not import it)."""
    global _engine_arrays
    _engine_arrays = _EngineArrays(array_type, read_many)


class _Optimizer:
    """The ``array_optimize`` callable: this pass, then the optimization it replaced."""

    def __init__(self, then: Any) -> None:
        self.then = then

    def __call__(self, dsk: Any, keys: Any, **kwargs: Any) -> Any:
        from dask.array.optimization import optimize as dask_optimize

        dsk = optimize(dsk, keys)
        return (self.then or dask_optimize)(dsk, keys, **kwargs)

    def __reduce__(self) -> Any:
        return (_Optimizer, (self.then,))


def install() -> None:
    """Make :func:`optimize` part of dask's array optimization (once per process)."""
    try:
        import dask
    except ImportError:  # dask is optional
        return
    with _lock:
        current = dask.config.get("array_optimize", None)
        if isinstance(current, _Optimizer):
            return
        dask.config.set(array_optimize=_Optimizer(current))


def available() -> bool:
    """Whether this dask has the task-spec graphs the pass rewrites (dask >= 2024.12);
    with an older one blocks are read one task at a time, joined only when dask's
    threads ask at the same moment (:mod:`xarray_gds.coalesce`)."""
    try:
        import dask._task_spec  # noqa: F401
    except ImportError:
        return False
    return True


def _source(value: Any) -> tuple[Any, bool] | None:
    """``(adapter, device_blocks)`` when ``value`` is what xarray hands dask for an
    xarray-gds array (through either chunk manager), else None."""
    from xarray.core import indexing

    from xarray_gds.chunks import DeviceBlocks

    if _engine_arrays is None:
        return None

    device_blocks = isinstance(value, DeviceBlocks)
    adapter = value._data if device_blocks else value
    if not isinstance(adapter, indexing.ImplicitToExplicitIndexingAdapter):
        return None
    inner = adapter.array
    for _ in range(8):
        if isinstance(inner, indexing.LazilyIndexedArray):
            ours = isinstance(inner.array, _engine_arrays.array_type)
            return (adapter, device_blocks) if ours else None
        if not isinstance(inner, indexing.CopyOnWriteArray | indexing.MemoryCachedArray):
            return None
        inner = inner.array
    return None


def _lazy(wrapped: Any) -> Any:
    """xarray's LazilyIndexedArray under its adapter and copy-on-write wrappers."""
    while not hasattr(wrapped, "key"):
        wrapped = wrapped.array
    return wrapped


def _find_sources(dsk: Any) -> dict[Hashable, tuple[Any, bool]]:
    from dask.highlevelgraph import HighLevelGraph

    found: dict[Hashable, tuple[Any, bool]] = {}
    if isinstance(dsk, HighLevelGraph):
        for layer in dsk.layers.values():
            if len(layer) != 1 or type(layer).__name__ != "MaterializedLayer":
                continue
            for key, value in layer.items():
                if (src := _source(value)) is not None:
                    found[key] = src
    return found


def optimize(dsk: Any, keys: Any) -> Any:
    """The graph with the block reads of xarray-gds arrays joined into groups (see the
    module docstring); ``dsk`` unchanged when it reads none."""
    if not config.get("fuse_dask") or not available():
        return dsk
    sources = _find_sources(dsk)
    if not sources:
        return dsk
    from dask._task_spec import DataNode, Task, TaskRef, convert_legacy_graph
    from dask.array.core import getter, getter_inline, getter_nofancy
    from dask.core import flatten
    from dask.optimization import cull

    graph = convert_legacy_graph(_materialize(dsk, sources))
    graph, _ = cull(graph, list(flatten(keys)))
    blocks: list[tuple[Hashable, Hashable, Any]] = []  # (block key, source key, slices)
    for key, task in graph.items():
        if not isinstance(task, Task) or task.func not in (getter, getter_nofancy, getter_inline):
            continue
        if len(task.args) != 2 or task.kwargs.get("lock"):
            continue
        ref, where = task.args
        if not isinstance(ref, TaskRef) or ref.key not in sources:
            continue
        slices = where.value if isinstance(where, DataNode) else where
        if not isinstance(slices, tuple) or not all(isinstance(s, slice) for s in slices):
            continue
        blocks.append((key, ref.key, slices))
    if not blocks:
        return dsk
    _warn_host_blocks(sources, {s for _, s, _ in blocks})
    groups = _groups(blocks, sources)
    root = _root_mark()
    joined: dict[Hashable, tuple[Hashable, int, Any]] = {}  # block: (group, index, slices)
    for g, members in enumerate(groups):
        refs = sorted({s for _, s, _ in members}, key=str)
        plan = [(refs.index(s), slices) for _, s, slices in members]
        group_key = (f"xarray-gds-read-{_token(members)}", g)
        graph[group_key] = Task(
            group_key,
            _read_group,
            DataNode(None, plan),
            *(_embedded(graph, r) for r in refs),
            **root,
        )
        for i, (key, _, _) in enumerate(members):
            graph[key] = Task(key, _pick, TaskRef(group_key), i)
            joined[key] = (group_key, i, members[i][2])
    for key, task in list(graph.items()):
        placed = _placed_finalize(task, joined)
        if placed is not None:
            graph[key] = placed
    _drop_unused(graph, {s for _, s, _ in blocks} | set(joined), set(flatten(keys)))
    return graph


def _materialize(dsk: Any, sources: dict[Hashable, tuple[Any, bool]]) -> dict[Hashable, Any]:
    """The graph's tasks, as ``ensure_dict`` gives them, with the block reads of
    ``from_array`` layers over ``sources`` built here (:func:`_read_layer_tasks`):
    dask materializes such a ``Blockwise`` layer at about 50 us a block, and every
    block read of a computation is replaced by this pass anyway."""
    from dask.highlevelgraph import HighLevelGraph, ensure_dict

    if not isinstance(dsk, HighLevelGraph):
        return ensure_dict(dsk)
    graph: dict[Hashable, Any] = {}
    layer: Any
    for layer in dsk.layers.values():
        tasks = _read_layer_tasks(layer, sources)
        graph.update(layer if tasks is None else tasks)
    return graph


def _read_layer_tasks(layer: Any, sources: dict[Hashable, tuple[Any, bool]]) -> Any:
    """The block tasks of a ``from_array`` layer reading one of ``sources`` (dask's
    ``Blockwise`` of ``getter(source, slices)`` over an ``ArraySliceDep``, no lock;
    ``asarray=False`` kept),
    one ``Task`` a block with the block's slices; None for any other layer."""
    import itertools

    from dask._task_spec import DataNode, Task, TaskRef
    from dask.array.core import getter, getter_inline, getter_nofancy
    from dask.layers import ArraySliceDep

    if type(layer).__name__ != "Blockwise" or not hasattr(layer, "task"):
        return None
    task = layer.task
    if not isinstance(task, Task) or task.func not in (getter, getter_nofancy, getter_inline):
        return None
    kwargs = dict(task.kwargs)  # from_array's asarray=False (CuPy blocks) comes here
    if set(kwargs) - {"asarray", "lock"} or kwargs.get("lock"):
        return None
    if len(task.args) != 2 or len(layer.indices) != 2:
        return None
    (src, src_ind), (dep_name, dep_ind) = layer.indices
    dep = layer.io_deps.get(dep_name)
    if not isinstance(src, TaskRef) or src.key not in sources or src_ind is not None:
        return None
    if not isinstance(dep, ArraySliceDep) or tuple(dep_ind) != tuple(layer.output_indices):
        return None
    if layer.concatenate or layer.new_axes or layer.output_blocks is not None:
        return None
    if [a.key for a in task.args if isinstance(a, TaskRef)] != [
        "__dask_blockwise__0",
        "__dask_blockwise__1",
    ]:
        return None
    tasks: dict[Hashable, Any] = {}
    for idx in itertools.product(*(range(n) for n in layer.numblocks[dep_name])):
        key = (layer.output, *idx)
        tasks[key] = Task(key, task.func, TaskRef(src.key), DataNode(None, dep[idx]), **kwargs)
    return tasks


def _placed_finalize(task: Any, joined: dict[Hashable, tuple[Hashable, int, Any]]) -> Any:
    """dask's final task of a computed array (``dask.array.core.finalize`` of every
    block, which dask >= 2025 puts in the graph), rewritten to take the blocks straight
    from their groups and copy each into its place in one new array (:func:`_place`),
    when the blocks are all joined blocks of one array that tile it. dask's own
    finalize concatenates CuPy blocks one axis at a time (``2n + 1``
    ``cupy.concatenate`` calls for a grid of (n, 1, 1) blocks), and each block is a
    task of its own for the scheduler; a ``chunks={}`` load of thousands of blocks
    spent a sizeable part of its time on the two. None for any other task."""
    from dask._task_spec import DataNode, List, Task, TaskRef
    from dask.array.core import finalize

    if not isinstance(task, Task) or task.func is not finalize or task.kwargs:
        return None
    if len(task.args) != 1 or not isinstance(task.args[0], List):
        return None
    leaves: list[Hashable] = []

    def nest(node: Any) -> Any:
        if isinstance(node, List):
            return [nest(a) for a in node.args]
        if isinstance(node, TaskRef) and node.key in joined:
            leaves.append(node.key)
            return len(leaves) - 1
        raise LookupError

    try:
        structure = nest(task.args[0])
    except LookupError:
        return None
    names = {k[0] if isinstance(k, tuple) else None for k in leaves}
    if len(leaves) < 2 or len(names) != 1 or None in names:
        return None
    places = [joined[k][2] for k in leaves]
    ndim = len(places[0])
    if ndim == 0 or any(len(p) != ndim for p in places):
        return None
    if any(
        not isinstance(s.start, int) or not isinstance(s.stop, int) or s.step not in (None, 1)
        for p in places
        for s in p
    ):
        return None
    shape = tuple(max(p[d].stop for p in places) for d in range(ndim))
    volume = sum(math.prod(s.stop - s.start for s in p) for p in places)
    if min(s.start for p in places for s in p) != 0 or volume != math.prod(shape) or not volume:
        return None  # (blocks of one array's grid do not overlap: equal volume is a tiling)
    groups = sorted({joined[k][0] for k in leaves}, key=str)
    at = {g: n for n, g in enumerate(groups)}
    layout = [(at[joined[k][0]], joined[k][1], joined[k][2]) for k in leaves]
    spec = (structure, shape, layout)
    return Task(task.key, _place, DataNode(None, spec), *(TaskRef(g) for g in groups))  # type: ignore[arg-type]


def _place(spec: Any, *groups: tuple[Any, ...]) -> Any:
    """The array of the blocks of ``groups`` (see :func:`_placed_finalize`): the box
    they are views of, where a group read them as one (:func:`_whole_base`), else one
    new array (NumPy or CuPy, on the blocks' device), each block copied into its place.
    Blocks of mixed types, dtypes or devices, or not of
    the shape of their place, go to dask's own ``finalize``."""
    structure, shape, layout = spec
    blocks = []
    for g, i, _ in layout:
        block = groups[g][i]
        if isinstance(block, BaseException):
            raise block
        blocks.append(block)
    first = blocks[0]
    device = _device.is_device_array(first)

    def placeable(block: Any, place: tuple[slice, ...]) -> bool:
        return (
            type(block) is type(first)
            and block.dtype == first.dtype
            and tuple(block.shape) == tuple(s.stop - s.start for s in place)
            and (not device or block.device.id == first.device.id)
        )

    if not hasattr(first, "dtype") or not all(
        placeable(b, p) for b, (_, _, p) in zip(blocks, layout, strict=True)
    ):
        from dask.array.core import finalize

        def fill(node: Any) -> Any:
            return [fill(n) for n in node] if isinstance(node, list) else blocks[node]

        return finalize(fill(structure))
    whole = _whole_base(blocks, [p for _, _, p in layout], shape)
    if whole is not None:
        return whole
    xp = _device.cupy() if device else np
    with xp.cuda.Device(first.device.id) if device else contextlib.nullcontext():
        out = xp.empty(shape, dtype=first.dtype)
        for block, (_, _, place) in zip(blocks, layout, strict=True):
            out[place] = block
    return out


def _whole_base(blocks: list[Any], places: list[tuple[slice, ...]], shape: tuple[int, ...]) -> Any:
    """The one array all ``blocks`` are views of at their ``places``, when it holds
    exactly an array of ``shape`` (a group reads the blocks that tile an array as one
    box, so its blocks are views of that box, which no task but this one holds): it is
    the result, in that shape, with no copy. None when the blocks are anything else
    (copies, views of a larger buffer, views out of place)."""
    base = getattr(blocks[0], "base", None)
    if base is None or base.size != math.prod(shape) or not base.flags.c_contiguous:
        return None
    if base.dtype != blocks[0].dtype:
        return None
    box = base if tuple(base.shape) == shape else base.reshape(shape)  # (a view)
    address = _address(box)
    for block, place in zip(blocks, places, strict=True):
        if block.base is not base or block.strides != box.strides:
            return None
        start = sum(s.start * st for s, st in zip(place, box.strides, strict=True))
        if _address(block) != address + start:
            return None
    return box


def _address(array: Any) -> int:
    """The address of an array's first element (NumPy or CuPy)."""
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(interface["data"][0])


def _root_mark() -> dict[str, Any]:
    """Group tasks are marked as producing data (as dask marks its own ``from_array``
    reads) where dask knows the mark: ``dask.distributed`` then queues them as root
    tasks and hands each to the least busy worker. Unmarked, the two groups of a
    computation were seen to both go to one of two idle workers."""
    from dask._task_spec import Task

    return {"_data_producer": True} if hasattr(Task, "data_producer") else {}


def _embedded(graph: dict[Hashable, Any], key: Hashable) -> Any:
    """The source array itself inside the group task (a small object: the lazy array
    and its store's path), or a reference to its task when it is not plain data.

    Embedded, the group tasks depend on nothing, so that ``dask.distributed`` spreads
    them over its workers; with a reference they would all wait on the worker that
    holds the source (the scheduler runs a task where its inputs are), and one
    ``open_dataset(chunks=...)`` array would be read by one worker only."""
    from dask._task_spec import DataNode, TaskRef

    node = graph.get(key)
    if isinstance(node, DataNode):
        return DataNode(None, node.value)
    return TaskRef(key)  # type: ignore[arg-type]


def _drop_unused(graph: dict[Hashable, Any], candidates: set[Hashable], keep: set[Any]) -> None:
    """Remove the source tasks that no task refers to any more (all their blocks were
    joined into groups), unless they are results of the computation."""
    used: set[Hashable] = set()
    for task in graph.values():
        used.update(task.dependencies)
    for key in candidates - used - keep:
        del graph[key]


def _token(members: list[Any]) -> str:
    from dask.base import tokenize

    return tokenize([str(k) for k, _, _ in members[:4]], len(members))


def _nbytes(slices: tuple[slice, ...], adapter: Any) -> int:
    n = math.prod(max(0, (s.stop or 0) - (s.start or 0)) for s in slices)
    return n * np.dtype(adapter.dtype).itemsize


def _groups(
    blocks: list[tuple[Hashable, Hashable, Any]], sources: dict[Hashable, tuple[Any, bool]]
) -> list[list[tuple[Hashable, Hashable, Any]]]:
    """Blocks cut into groups of about ``fuse_bytes`` at most (in graph order, so that
    the blocks of one array stay together), of about equal bytes. Under
    ``dask.distributed``, a multiple of the number of workers (as many as there are
    blocks at most), so that every worker reads about the same share."""
    sizes = np.array([_nbytes(slices, sources[s][0]) for _, s, slices in blocks], np.float64)
    total = float(sizes.sum())
    limit = max(1, int(config.get("fuse_bytes")))
    n_groups = max(1, math.ceil(total / limit))
    workers = _n_workers()
    if workers:
        n_groups = math.ceil(n_groups / workers) * workers
    n_groups = min(n_groups, len(blocks))
    if n_groups == 1 or total <= 0:
        return [blocks]
    # each block goes to the group its middle byte falls in
    middle = np.cumsum(sizes) - sizes / 2
    which = np.minimum((middle * n_groups / total).astype(np.int64), n_groups - 1)
    groups: list[list[tuple[Hashable, Hashable, Any]]] = [[] for _ in range(n_groups)]
    for block, g in zip(blocks, which.tolist(), strict=True):
        groups[g].append(block)
    return [g for g in groups if g]


def _n_workers() -> int:
    """Workers of the current dask.distributed client (0 without one). A client
    imports ``distributed``; without it, importing it here (about 0.25 s) is not done."""
    import sys

    if "distributed" not in sys.modules:
        return 0
    from distributed import default_client

    try:
        client = default_client()
    except ValueError:
        return 0
    try:
        try:  # all of them (newer clients list 5 unless told otherwise)
            info = client.scheduler_info(n_workers=-1)
        except TypeError:  # an older client: no n_workers argument, every worker listed
            info = client.scheduler_info()
        return len(info.get("workers", {}))
    except Exception:
        return 0


def _warn_host_blocks(sources: dict[Hashable, tuple[Any, bool]], used: set[Hashable]) -> None:
    global _warned_host_blocks
    if _warned_host_blocks:
        return
    for key in used:
        adapter, device_blocks = sources[key]
        lazy = _lazy(adapter)
        if not device_blocks and lazy.array.device == "cuda":
            _warned_host_blocks = True
            warn(
                f"xarray-gds: the dask blocks of {lazy.array.name!r} are decoded on the GPU "
                "and then copied to host memory (numpy), because xarray's default dask "
                "chunk manager declares numpy blocks for every backend array. To keep them "
                'on the GPU as CuPy blocks, pass chunked_array_type="gds-dask" to '
                "xr.open_dataset or xr.open_mfdataset, or open inside "
                'xr.set_options(chunk_manager="gds-dask") (see the Dask page of the docs).',
                HostBlocksWarning,
            )
            return


def _read_group(plan: list[tuple[int, tuple[slice, ...]]], *sources: Any) -> tuple[Any, ...]:
    """Every block of a group, read in one joined batch (the registered ``read_many``:
    :func:`xarray_gds.array.read_many`); a block whose chunks failed holds its
    exception, which :func:`_pick` raises."""
    from xarray.namedarray.pycompat import to_numpy

    from xarray_gds.chunks import DeviceBlocks

    assert _engine_arrays is not None  # a group exists only for registered arrays

    adapters = [src._data if isinstance(src, DeviceBlocks) else src for src in sources]
    bases = [_lazy_base(adapter) for adapter in adapters]
    wanted = []
    for s, slices in plan:
        base = bases[s]
        pair = None if base is None else _block_key(base, slices)
        if pair is None:
            lazy = _lazy(adapters[s][slices])  # xarray's own key arithmetic; reads nothing
            pair = (lazy.array, lazy.key)
        wanted.append(pair)
    values = _engine_arrays.read_many(wanted)
    out = []
    for (s, _), value in zip(plan, values, strict=True):
        if not isinstance(sources[s], DeviceBlocks) and not isinstance(value, BaseException):
            value = to_numpy(value)
        out.append(value)
    return tuple(out)


def _lazy_base(adapter: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(backend array, key tuple)`` of the lazy array under xarray's adapter, for the
    usual chain (copy-on-write and cache wrappers over a lazy array whose key holds
    integers and slices), or None for any other (xarray's own arithmetic then works out
    each block's key)."""
    from xarray.core import indexing

    inner = adapter.array
    while isinstance(inner, indexing.CopyOnWriteArray | indexing.MemoryCachedArray):
        inner = inner.array  # (a cache that holds values is no lazy array: left to xarray)
    if type(inner) is not indexing.LazilyIndexedArray:
        return None
    key = tuple(inner.key.tuple)
    if not all(isinstance(k, slice | int | np.integer) for k in key):
        return None
    return inner.array, key


def _block_key(base: tuple[Any, tuple[Any, ...]], slices: tuple[slice, ...]) -> Any:
    """``(backend array, key)`` that ``adapter[slices]`` reads, where ``base`` is
    :func:`_lazy_base` of the adapter: the same key xarray's indexing classes work out
    (they take about 50 us a block; for a ``chunks={}`` load of thousands of blocks
    that is a sizeable part of the time after the joined read), as a ``BasicIndexer``.
    None when ``slices`` does not fit the key."""
    from xarray.core import indexing

    array, key = base
    out: list[Any] = []
    picks = iter(slices)
    for k, size in zip(key, array.shape, strict=True):
        if not isinstance(k, slice):
            out.append(int(k))
            continue
        s = next(picks, None)
        if s is None:
            return None
        r = range(size)[k][s]
        out.append(slice(r.start, r.stop if r.stop >= 0 else None, r.step))
    if next(picks, None) is not None:
        return None
    return array, indexing.BasicIndexer(tuple(out))


def _pick(blocks: tuple[Any, ...], i: int) -> Any:
    block = blocks[i]
    if isinstance(block, BaseException):
        raise block
    return block
