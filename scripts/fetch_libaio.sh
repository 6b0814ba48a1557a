#!/usr/bin/env bash
# Unpack libaio (the library and its header) into .libaio/ without root: DeepSpeed's NVMe offload
# compiles its async_io op against it on first use. Machines with `apt install libaio-dev` need none of this.
#   bash scripts/fetch_libaio.sh        # then the NVMe tests find it (tests/helpers.py: use_libaio)
# On the GPU machines (no network), carry the folder made here: carry [".whl", ".libaio"].
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .libaio/usr/include/libaio.h ] && { echo "libaio: .libaio already holds it"; exit 0; }
command -v apt-get >/dev/null || { echo "libaio: no apt-get here; install libaio (headers and library) instead" >&2; exit 1; }
debs=$(mktemp -d)
(cd "$debs" && apt-get download libaio1 libaio-dev 2>/dev/null)
for deb in "$debs"/*.deb; do dpkg -x "$deb" .libaio; done
rm -rf "$debs"
ls .libaio/usr/include/libaio.h .libaio/usr/lib/*/libaio.so.1
