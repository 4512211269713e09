"""The hardware-emulation harness: tests/hw/guest runs inside the QEMU guest, never on the host."""

collect_ignore = ["guest"]
