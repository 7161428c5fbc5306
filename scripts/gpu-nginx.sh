#!/usr/bin/env bash
# Bundles this machine's nginx for a GPU machine that has none and no network: the
# binary, the shared libraries it links (as `ldd` lists them, the C library and the
# dynamic loader included, so the bundle runs whatever the other machine's C library
# is) and a `nginx` wrapper that starts the binary with them. scripts/gpu-run.sh puts
# the bundle on PATH when it finds one, so that the remote benchmark cases and tests
# (which serve stores with nginx on 127.0.0.1) run there too.
#
#   bash scripts/gpu-nginx.sh              # into .nginx/ (git ignores it)
#   bash scripts/gpu-nginx.sh --dir DIR    # elsewhere
#
# Needs nginx here (scripts/test.sh installs Debian's).
set -euo pipefail
dir=.nginx
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=${2:?--dir needs a directory}; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-nginx.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
binary=$(command -v nginx || true)
for p in /usr/sbin/nginx /usr/local/sbin/nginx; do
  [ -n "$binary" ] && break
  [ -x "$p" ] && binary=$p
done
if [ -z "$binary" ]; then
  echo "gpu-nginx.sh: no nginx on this machine (apt-get install nginx)" >&2
  exit 1
fi
home=$(cd "$(dirname "$binary")" && pwd)
if [ -f "$home/nginx.bin" ] && [ -d "$home/lib" ] && [ "$(head -c 2 "$binary")" = "#!" ]; then
  # the nginx on PATH is itself such a bundle (as on a GPU machine that runs the
  # tests with one): copy it whole
  mkdir -p "$dir"
  if [ "$(cd "$dir" && pwd)" != "$home" ]; then
    rm -rf "$dir"
    mkdir -p "$dir"
    cp -R "$home/." "$dir/"
  fi
  "$dir/nginx" -v
  echo "$dir: nginx and $(ls "$dir/lib" | wc -l) libraries, $(du -sh "$dir" | cut -f1)"
  exit 0
fi
rm -rf "$dir"
mkdir -p "$dir/lib"
cp "$binary" "$dir/nginx.bin"
loader=
while read -r line; do
  # "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
  case $line in
    *"=> /"*) lib=${line#*=> }; lib=${lib%% (*} ;;
    /*) lib=${line%% (*}; loader=$(basename "$lib") ;;
    *) continue ;;
  esac
  cp -L "$lib" "$dir/lib/"
done < <(ldd "$binary")
if [ -z "$loader" ]; then
  echo "gpu-nginx.sh: ldd named no dynamic loader for $binary" >&2
  exit 1
fi
cat > "$dir/nginx" <<WRAP
#!/bin/sh
# nginx with the libraries bundled beside it (made by scripts/gpu-nginx.sh)
d=\$(cd "\$(dirname "\$0")" && pwd)
exec "\$d/lib/$loader" --library-path "\$d/lib" "\$d/nginx.bin" "\$@"
WRAP
chmod +x "$dir/nginx"
"$dir/nginx" -v
echo "$dir: nginx and $(ls "$dir/lib" | wc -l) libraries, $(du -sh "$dir" | cut -f1)"
