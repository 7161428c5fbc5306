import time, glob, os, numpy as np, resource
from xarray_gds.bench import make_store
from xarray_gds.codecs import blosc
from xarray_gds.store import read_files_host, pack_offsets
p = "/tmp/blosc-probe.zarr"
if not os.path.exists(p):
    make_store(p, nbytes=int(0.5e9), chunk_bytes=4 << 20, zarr_format=2, compressor="blosc")
files = sorted(f for f in glob.glob(p + "/t/*") if not os.path.basename(f).startswith("."))
data = read_files_host(files)
sizes = np.array([d.size for d in data]); offsets, total = pack_offsets(sizes)
arena = np.zeros(total, np.uint8)
for o, d in zip(offsets, data): arena[o:o+d.size] = d
import zarr; nbytes = int(np.prod(zarr.open_array(p + "/t").chunks)) * 4
print("frames", len(files), "arena MB", total/1e6)
for _ in range(3):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter(); sp = blosc.sparse_tables(arena, offsets, sizes, nbytes); t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    frames = [sp[o:o+s] for o, s in zip(offsets, sizes)]
    st = blosc.parse_frames(frames, [str(i) for i in range(len(files))], nbytes); t2 = time.perf_counter()
    print(f"sparse {t1-t:.4f}s faults {r1-r0} parse {t2-t1:.4f}s streams {st.n_streams}")
