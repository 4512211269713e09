#!/bin/bash
# Build the QEMU guest for poold's hardware tests (tests/hw) from Debian packages only:
# a stock Debian 6.12 kernel (.deb downloaded and extracted, never installed) and a busybox
# initramfs carrying cxl/daxctl, kmod and Debian's python3.11 with its stdlib.
# Adapted from shared/cxl-qemu/build-initramfs.sh (known to work on this machine).
#
# Usage: build-guest.sh CACHE_DIR     -> CACHE_DIR/vmlinuz, CACHE_DIR/initramfs.cpio
# Reuses a finished build when the inputs (this script, the guest init, KPKG) are unchanged.
# Installs missing host packages with apt-get (needs root): qemu-system-x86 from
# bookworm-backports (QEMU >= 8 for volatile CXL memory), busybox-static, ndctl, daxctl,
# kmod, cpio, xz-utils, python3.11.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=${1:?cache dir}
KPKG=${KPKG:-linux-image-6.12.117+deb12-amd64}   # bookworm-security, 6.12 LTS
mkdir -p "$W"; W=$(cd "$W" && pwd)
STAMP=$( (cat "$HERE/build-guest.sh" "$HERE/guest-init"; echo "$KPKG") | sha256sum | cut -c1-16)
if [ -f "$W/vmlinuz" ] && [ -f "$W/initramfs.cpio" ] && [ "$(cat "$W/stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "build-guest: cached ($W, $STAMP)"; exit 0
fi
T0=$(date +%s)

need_apt=0
qemu_major=$( (qemu-system-x86_64 --version 2>/dev/null || true) | sed -n "s/.*version \([0-9]*\)\..*/\1/p" | head -1)
[ "${qemu_major:-0}" -ge 8 ] || need_apt=1
for tool in /bin/busybox /usr/bin/cxl /usr/bin/daxctl /usr/bin/ndctl /usr/bin/kmod /usr/bin/cpio /usr/bin/xz /usr/bin/python3.11; do
  [ -x "$tool" ] || need_apt=1
done
if [ "$need_apt" = 1 ]; then
  [ "$(id -u)" = 0 ] || { echo "build-guest: missing packages and not root: cannot apt-get install" >&2; exit 3; }
  if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
    cat > /etc/apt/sources.list.d/bookworm-backports.sources <<'EOS'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -t bookworm-backports qemu-system-x86
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      busybox-static ndctl daxctl kmod cpio xz-utils python3.11-minimal libpython3.11-stdlib
fi
echo "build-guest: host packages ready after $(( $(date +%s) - T0 ))s"

# --- kernel: the .deb is kept in the cache, the extraction is temporary ---
mkdir -p "$W/debs"
if ! ls "$W"/debs/"$KPKG"_*.deb >/dev/null 2>&1; then
  (cd "$W/debs" && apt-get download "$KPKG")
fi
K="$W/kroot"; rm -rf "$K"; mkdir -p "$K"
dpkg-deb -x "$W"/debs/"$KPKG"_*.deb "$K"
KVER=$(ls "$K/lib/modules" | head -1)
cp "$K/boot/vmlinuz-$KVER" "$W/vmlinuz.new"
[ -f "$K/lib/modules/$KVER/modules.dep" ] || depmod -b "$K" "$KVER"
echo "build-guest: kernel $KVER extracted after $(( $(date +%s) - T0 ))s"

# --- rootfs ---
R="$W/rootfs"; rm -rf "$R"
mkdir -p "$R"/{bin,sbin,etc,proc,sys,dev,tmp,run,mnt,root,usr/bin,usr/sbin,usr/lib,lib/x86_64-linux-gnu}
cp /bin/busybox "$R/bin/busybox"
for a in $("$R/bin/busybox" --list); do [ -e "$R/bin/$a" ] || ln -s busybox "$R/bin/$a"; done
copy_with_libs() {  # binary or .so plus its ldd closure, at the same paths
  for f in "$@"; do
    mkdir -p "$R$(dirname "$f")"; cp -L "$f" "$R$f"
    ldd "$f" 2>/dev/null | awk '/=>/ {print $3} /^\s*\/lib/ {print $1}' | while read -r l; do
      if [ -n "$l" ] && [ -f "$l" ] && [ ! -e "$R$l" ]; then mkdir -p "$R$(dirname "$l")"; cp -L "$l" "$R$l"; fi
    done
  done
}
# ndctl: the pmem namespace in devdax mode (a static dax region) of tests/hw
copy_with_libs /usr/bin/cxl /usr/bin/daxctl /usr/bin/ndctl /usr/bin/kmod /usr/bin/python3.11
cp -L /lib64/ld-linux-x86-64.so.2 "$R/lib/x86_64-linux-gnu/"
mkdir -p "$R/lib64"; ln -sf ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$R/lib64/ld-linux-x86-64.so.2"
for m in modprobe insmod rmmod lsmod modinfo depmod; do rm -f "$R/bin/$m"; ln -sf /usr/bin/kmod "$R/sbin/$m"; done
[ -d /etc/daxctl.conf.d ] && cp -a /etc/daxctl.conf.d "$R/etc/" || true
ln -sf python3.11 "$R/usr/bin/python3"
mkdir -p "$R/usr/lib/python3.11"
(cd /usr/lib/python3.11 && tar --exclude=./test --exclude=./idlelib --exclude=./tkinter \
   --exclude=./turtledemo --exclude=./ensurepip --exclude=./lib2to3 --exclude=./pydoc_data \
   --exclude='./config-3.11-*' --exclude=./distutils --exclude=./site-packages --exclude=./dist-packages \
   --exclude='./lib-dynload/_test*' --exclude='./lib-dynload/_xx*' -cf - .) | tar -C "$R/usr/lib/python3.11" -xf -
copy_with_libs /usr/lib/python3.11/lib-dynload/*.so
# compiled wheels (pydantic-core) need these at run time; python3.11 alone does not pull them in
for l in libgcc_s.so.1 libstdc++.so.6 librt.so.1 libpthread.so.0 libdl.so.2 libutil.so.1; do
  [ -f "/lib/x86_64-linux-gnu/$l" ] && cp -L "/lib/x86_64-linux-gnu/$l" "$R/lib/x86_64-linux-gnu/$l"
done
# the tenant side of the tests drops privileges to this user
printf 'root:x:0:0:root:/root:/bin/sh\ntenant:x:1000:1000::/tmp:/bin/sh\n' > "$R/etc/passwd"
printf 'root:x:0:\ntenant:x:1000:\n' > "$R/etc/group"

# --- kernel modules: closure of the CXL/DAX/9p stack, decompressed ---
WANT="cxl_acpi cxl_pci cxl_mem cxl_pmem dax_cxl device_dax kmem libnvdimm nd_pmem dax_pmem 9p 9pnet_virtio"
MD="$K/lib/modules/$KVER"
python3 - "$MD" $WANT > "$W/modlist" <<'PY'
import os, sys
md, want = sys.argv[1], sys.argv[2:]
dep, byname = {}, {}
for line in open(os.path.join(md, "modules.dep")):
    k, _, v = line.partition(":")
    dep[k] = v.split()
    byname[os.path.basename(k).split(".ko")[0].replace("-", "_")] = k
todo, seen = [byname[w] for w in want], set()
while todo:
    m = todo.pop()
    if m not in seen:
        seen.add(m)
        todo += dep[m]
print("\n".join(sorted(seen)))
PY
RM="$R/lib/modules/$KVER"; mkdir -p "$RM"
while read -r m; do mkdir -p "$RM/$(dirname "$m")"; xz -dc "$MD/$m" > "$RM/${m%.xz}"; done < "$W/modlist"
cp "$MD"/modules.builtin* "$MD"/modules.order "$RM/" 2>/dev/null || true
depmod -b "$R" "$KVER"

cp "$HERE/guest-init" "$R/init"; chmod +x "$R/init"
(cd "$R" && find . -print0 | cpio --null -o -H newc --quiet) > "$W/initramfs.cpio.new"
mv "$W/vmlinuz.new" "$W/vmlinuz"; mv "$W/initramfs.cpio.new" "$W/initramfs.cpio"
rm -rf "$R" "$K"
echo "$STAMP" > "$W/stamp"
echo "build-guest: built $W (kernel $KVER) in $(( $(date +%s) - T0 ))s"
