#!/bin/sh
# Runs inside the QEMU guest (poold.run=): load the CXL/DAX stack, unpack the pure-Python
# dependencies into tmpfs (9p under TCG costs ~60 ms a file; one tar is fast), run the
# in-guest tests, copy their junit XML to the writable share.
T0=$(cut -d' ' -f1 /proc/uptime)
# kmem is loaded later, by the tests' setup: a dax device created before it stays unbound,
# so the devdax region is never onlined as system-ram first.
for m in cxl_acpi cxl_pci cxl_mem cxl_pmem libnvdimm nd_pmem dax_pmem device_dax dax_cxl; do modprobe $m || echo "modprobe $m failed"; done
NPCI=$(grep -l 0x050210 /sys/bus/pci/devices/*/class 2>/dev/null | wc -l)
i=0; while [ $i -lt 120 ]; do
  n=$(ls -d /sys/bus/cxl/devices/endpoint* 2>/dev/null | wc -l); [ "$n" -ge "$NPCI" ] && break
  sleep 0.5; i=$((i+1)); done
echo "POOLD-HW: $n/$NPCI CXL endpoints at uptime $(cut -d' ' -f1 /proc/uptime)"
mkdir -p /tmp/pylib && tar -C /tmp/pylib -xf /mnt/pylib/pylib.tar
# The product packages go to tmpfs too: /mnt/repo is read-only, so from there every process
# (pytest, poold, pool-agent, poolctl) would compile each module again (seconds apiece under
# TCG); from /tmp/repo the first import writes the .pyc the others reuse.
mkdir -p /tmp/repo && cp -r /mnt/repo/poold /mnt/repo/agent /mnt/repo/cli /mnt/repo/migrations /tmp/repo/
# poold listens on loopback; nothing else brings lo up in this guest.
ip link set lo up
cd /tmp
# test_in_guest.py (the backends driven directly) before test_stack_in_guest.py (poold and
# pool-agent): the stack's agent must be alone on the devdax region.
# --import-mode=append: pytest must not put /mnt/repo ahead of /tmp/repo on sys.path.
PYTHONPATH=/tmp/repo:/mnt/repo:/tmp/pylib python3 -m pytest \
  -c /mnt/repo/tests/hw/guest/pytest-guest.ini --rootdir=/mnt/repo/tests/hw/guest \
  --confcutdir=/mnt/repo/tests/hw/guest -p no:cacheprovider -v --color=no --import-mode=append \
  --junitxml=/tmp/junit.xml /mnt/repo/tests/hw/guest/test_in_guest.py \
  /mnt/repo/tests/hw/guest/test_stack_in_guest.py
rc=$?
cp /tmp/junit.xml /mnt/out/junit.xml
cp /tmp/poold-stack/*.log /mnt/out/ 2>/dev/null
echo "POOLD-HW: pytest rc=$rc in $(echo "$(cut -d' ' -f1 /proc/uptime) $T0" | awk '{print $1-$2}')s"
exit $rc
