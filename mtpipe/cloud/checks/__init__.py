"""The checks before spending: each prerequisite of a VM run, named by what it checks, and prerequisites.py, which runs them all."""
