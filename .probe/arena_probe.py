import time, glob, os, numpy as np
from xarray_gds.codecs import blosc
from xarray_gds.store import read_files_host, pack_offsets
import zarr
p = "/tmp/blosc-probe.zarr"
files = sorted(f for f in glob.glob(p + "/t/*") if not os.path.basename(f).startswith("."))
data = read_files_host(files)
sizes = np.array([d.size for d in data]); offsets, total = pack_offsets(sizes)
arena = np.zeros(total, np.uint8)
for o, d in zip(offsets, data): arena[o:o+d.size] = d
nbytes = int(np.prod(zarr.open_array(p + "/t").chunks)) * 4
keys = [str(i) for i in range(len(files))]
for _ in range(3):
    t = time.perf_counter(); st = blosc.parse_arena(arena, offsets, sizes, keys, nbytes); t1 = time.perf_counter()
    print(f"parse_arena {t1-t:.4f}s streams {st.n_streams}")
