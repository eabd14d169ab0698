"""The MaxText side: its command lines, running them (one process or several), the patches MaxText needs, its run directories, the CPU rollout backend."""
