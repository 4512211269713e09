#!/bin/sh
# Runs inside the QEMU guest (poold.run=): load the CXL/DAX stack, unpack the pure-Python
# dependencies into tmpfs (9p under TCG costs ~60 ms a file; one tar is fast), run the
# in-guest tests, copy their junit XML to the writable share.
T0=$(cut -d' ' -f1 /proc/uptime)
# kmem is loaded later, by the tests' setup: a dax device created before it stays unbound,
# so the devdax region is never onlined as system-ram first.
for m in cxl_acpi cxl_pci cxl_mem cxl_pmem libnvdimm device_dax dax_cxl; do modprobe $m || echo "modprobe $m failed"; done
NPCI=$(grep -l 0x050210 /sys/bus/pci/devices/*/class 2>/dev/null | wc -l)
i=0; while [ $i -lt 120 ]; do
  n=$(ls -d /sys/bus/cxl/devices/endpoint* 2>/dev/null | wc -l); [ "$n" -ge "$NPCI" ] && break
  sleep 0.5; i=$((i+1)); done
echo "POOLD-HW: $n/$NPCI CXL endpoints at uptime $(cut -d' ' -f1 /proc/uptime)"
mkdir -p /tmp/pylib && tar -C /tmp/pylib -xf /mnt/pylib/pylib.tar
cd /tmp
PYTHONPATH=/mnt/repo:/tmp/pylib PYTHONDONTWRITEBYTECODE=1 python3 -m pytest \
  -c /mnt/repo/tests/hw/guest/pytest-guest.ini --rootdir=/mnt/repo/tests/hw/guest \
  --confcutdir=/mnt/repo/tests/hw/guest -p no:cacheprovider -v --color=no \
  --junitxml=/tmp/junit.xml /mnt/repo/tests/hw/guest/test_in_guest.py
rc=$?
cp /tmp/junit.xml /mnt/out/junit.xml
echo "POOLD-HW: pytest rc=$rc in $(echo "$(cut -d' ' -f1 /proc/uptime) $T0" | awk '{print $1-$2}')s"
exit $rc
