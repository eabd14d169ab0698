"""The VM's lifecycle, the hall that uses the other rooms: VmLifecycle (run.py) in layers (base, creation, recovery), its notices, the rehearsal."""
