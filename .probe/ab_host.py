import time, os, sys, numpy as np, xarray as xr, warnings
warnings.simplefilter("ignore")
from xarray_gds.bench import make_store
import xarray_gds.array as A
p = sys.argv[1]; cb = int(sys.argv[2]); gb = float(sys.argv[3])
if not os.path.exists(p):
    make_store(p, nbytes=int(gb*1e9), chunk_bytes=cb)
real = A.read_box
def load():
    ds = xr.open_dataset(p, engine="gds-zarr", device="cpu", consolidated=True)
    return ds.t.values
for name, fn in [("box", real), ("zarr", lambda *a: None)] * 4:
    A.read_box = fn
    load()
    t = time.perf_counter(); v = load(); dt = time.perf_counter() - t
    print(name, f"{dt:.3f}s")
