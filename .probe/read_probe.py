import sys, types, time, glob, os, cProfile, pstats, numpy as np
class Arena(np.ndarray):
    def set(self, src, stream=None): self[...] = src
fake = types.SimpleNamespace(
    empty=lambda n, dtype=None: np.empty(n, dtype).view(Arena), uint8=np.uint8,
    cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None)))
cupyx = types.ModuleType("cupyx"); cupyx.empty_pinned = lambda shape, dtype=None: np.empty(shape, dtype)
sys.modules["cupyx"] = cupyx
from xarray_gds import device as D, store as S
D.cupy = lambda: fake
from xarray_gds.bench import make_store
p = "/tmp/small-probe.zarr"
if not os.path.exists(p):
    make_store(p, nbytes=int(0.04e9), chunk_bytes=1 << 10)
st = S.GdsStore(p, read_only=True)
keys = sorted(os.path.relpath(f, p) for f in glob.glob(p + "/t/c/**", recursive=True) if os.path.isfile(f))
print(len(keys))
st.read_chunks(keys, "cuda")
for _ in range(2):
    t = time.perf_counter(); st.read_chunks(keys, "cuda"); dt = time.perf_counter() - t
    print(f"{dt:.3f}s {dt/len(keys)*1e6:.1f} us/chunk")
cProfile.run('st.read_chunks(keys, "cuda")', "/tmp/rp.prof")
pstats.Stats("/tmp/rp.prof").sort_stats("tottime").print_stats(15)
