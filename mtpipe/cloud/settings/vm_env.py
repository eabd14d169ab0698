"""The environment variables that name the VM and its config overlay.

A module of its own, importing nothing: dodo.py declares its task options from it, and `doit list`
/ `doit help` import dodo.py and nothing heavier (docs/decisions/reporting.md)."""

CONFIG_ENV = "MTPIPE_VM_CONFIG"
ENV_KEYS = {"project": "PROJECT", "zone": "ZONE", "reservation": "RESERVATION", "name": "NAME"}
