"""Discovery: what far memory this host has, read from sysfs (see inventory.discover)."""
